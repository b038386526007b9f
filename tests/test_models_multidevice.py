"""The model on a (data=2, fsdp=2, tensor=2) mesh of 8 host devices: parameter shardings, sharded
loading of an HF checkpoint, and forward / loss / gradient equality with the unsharded model."""

import os

# Eight host CPU devices; must be set before jax is imported (also when run on its own).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

import hf_reference  # noqa: E402
from rl_jax.models import hf  # noqa: E402
from rl_jax.models.build import create_model, iter_params  # noqa: E402
from rl_jax.models.config import ModelConfig  # noqa: E402
from rl_jax.sharding import make_mesh  # noqa: E402

# Specs under ShardingRules.default(): fsdp splits `embed`, tensor splits vocab/heads/mlp.
EXPECTED_SPECS = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm": P(None),
    "layers.attn_norm": P(None, None),
    "layers.mlp_norm": P(None, None),
    "layers.wq": P(None, "fsdp", "tensor", None),
    "layers.wk": P(None, "fsdp", "tensor", None),
    "layers.wv": P(None, "fsdp", "tensor", None),
    "layers.wo": P(None, "tensor", None, "fsdp"),
    "layers.w_gate": P(None, "fsdp", "tensor"),
    "layers.w_up": P(None, "fsdp", "tensor"),
    "layers.w_down": P(None, "tensor", "fsdp"),
    "layers.bq": P(None, "tensor", None),
    "layers.bk": P(None, "tensor", None),
    "layers.bv": P(None, "tensor", None),
    "layers.bo": P(None, "fsdp"),
    "layers.q_norm": P(None, None),
    "layers.k_norm": P(None, None),
}
BATCH = P(("data", "fsdp"), None)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "XLA_FLAGS was set after jax was imported"
    return make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8])


def params(model) -> dict[str, jax.Array]:
    return {name: v[...] for name, v in iter_params(nnx.state(model, nnx.Param))}


def assert_sharded_as_expected(model, mesh):
    for name, value in params(model).items():
        sharding = value.sharding
        assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh, name
        assert sharding.spec == EXPECTED_SPECS[name], (name, sharding.spec)
        # Each device holds its slice only.
        shard_shape = tuple(
            dim // int(np.prod([mesh.shape[a] for a in
                                ((part,) if isinstance(part, str) else part or ())]))
            for dim, part in zip(value.shape, tuple(sharding.spec) + (None,) * value.ndim))
        assert {s.data.shape for s in value.addressable_shards} == {shard_shape}, name
        assert len(value.addressable_shards) == 8


def test_create_model_shards_parameters(mesh):
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                      output_bias=True, qk_norm=True)
    model = create_model(cfg, mesh=mesh, seed=3)
    assert set(params(model)) == set(EXPECTED_SPECS)
    assert_sharded_as_expected(model, mesh)
    assert model.mesh is mesh
    # Initial values do not depend on the layout.
    unsharded = params(create_model(cfg, seed=3))
    for name, value in params(model).items():
        assert isinstance(unsharded[name].sharding, SingleDeviceSharding)
        assert np.array_equal(np.asarray(value), np.asarray(unsharded[name])), name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tied Qwen2 checkpoint (q/k/v biases; the unembedding is the sharded embedding)."""
    path = tmp_path_factory.mktemp("hf-qwen2-tied")
    hf_reference.write_hf_checkpoint("qwen2", path, tie=True)
    return path


def test_save_from_a_sharded_model(checkpoint, mesh, tmp_path):
    sharded = hf.load_pretrained(checkpoint, mesh=mesh)
    out = hf.save_pretrained(sharded, tmp_path / "saved", max_shard_bytes=60_000)
    reloaded = params(hf.load_pretrained(out))
    for name, value in params(sharded).items():
        assert np.array_equal(np.asarray(value), np.asarray(reloaded[name])), name


def forward_and_grads(model, tokens, targets):
    """Jitted logits ``[B, T, V]``, loss (mean negative token log-prob) and its gradients."""
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        m = nnx.merge(graphdef, state)
        return -jnp.mean(m.token_logprobs(tokens, targets, block_size=32)[0])

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        loss, grads = jax.value_and_grad(loss_fn)(state)
        return m.logits(m(tokens)), loss, grads

    logits, loss, grads = run(state)
    return np.asarray(logits), float(loss), {
        name: np.asarray(g[...]) for name, g in iter_params(grads)}


def test_sharded_load_forward_and_gradients_match_unsharded(checkpoint, mesh):
    sharded = hf.load_pretrained(checkpoint, mesh=mesh)
    unsharded = hf.load_pretrained(checkpoint)
    assert sharded.mesh is mesh and unsharded.mesh is None
    assert set(params(sharded)) == {"embed", "final_norm", "layers.attn_norm", "layers.mlp_norm",
                                    "layers.wq", "layers.wk", "layers.wv", "layers.wo",
                                    "layers.w_gate", "layers.w_up", "layers.w_down",
                                    "layers.bq", "layers.bk", "layers.bv"}
    assert_sharded_as_expected(sharded, mesh)
    reference = params(unsharded)
    for name, value in params(sharded).items():
        full = np.asarray(reference[name])
        assert np.array_equal(np.asarray(value), full), name
        for shard in value.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), full[shard.index]), name

    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 96, (4, 16))
    targets_np = np.roll(tokens_np, -1, axis=1)
    batch = NamedSharding(mesh, BATCH)
    tokens, targets = (jax.device_put(jnp.asarray(x, jnp.int32), batch)
                       for x in (tokens_np, targets_np))
    logits, loss, grads = forward_and_grads(sharded, tokens, targets)
    ref_logits, ref_loss, ref_grads = forward_and_grads(
        unsharded, jnp.asarray(tokens_np, jnp.int32), jnp.asarray(targets_np, jnp.int32))

    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = np.max(np.abs(ref))
        assert scale > 0, name
        np.testing.assert_allclose(grads[name], ref, rtol=0, atol=1e-5 * scale, err_msg=name)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
