"""Low-rank adapters in the trainer: PEFT's initialisation, frozen base, adapter-only optimizer
state, sharding like the adapted weights, exact resume, PEFT export (checked with PEFT itself)
and the merged HF checkpoint."""

import os

# Eight host CPU devices; must be set before jax is imported (also when run on its own).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hf_reference  # noqa: E402
from rl_jax.models import hf  # noqa: E402
from rl_jax.models.lora import LoraConfig, LoraConfigError, TARGETS  # noqa: E402
from rl_jax.models.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS,  # noqa: E402
                                       load_peft_adapter, save_merged, save_peft_adapter)
from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.checkpoint import Checkpointer, CheckpointRestoreError  # noqa: E402
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state,  # noqa: E402
                                  init_state, make_optimizer)
from rl_jax.trainer.step import (StreamingTrainStep, batch_partition_spec,  # noqa: E402
                                 causal_lm_loss, global_batch, make_train_step)
from trainer_fixtures import TINY, random_batch  # noqa: E402

TX = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=20))
LORA = LoraConfig(rank=4, alpha=8.0)
ATOL = 1e-4  # logits against transformers/PEFT in float32, as tests/test_hf_interop.py


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _logits(spec, params, frozen, tokens):
    model = spec.merge(params, frozen)
    return np.asarray(model.logits(model(jnp.asarray(tokens))))


def _random_adapters(spec, seed):
    """Adapters with B non-zero too (fresh ones leave the model unchanged)."""
    adapters = spec.init_adapters(seed)
    rng = np.random.RandomState(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(0, 0.2, x.shape).astype(np.float32))
        if str(path[-1].key).endswith("_lora_b") else x, adapters)


# ---- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    (dict(rank=0), "lora.rank"), (dict(rank=-2), "lora.rank"), (dict(rank=2.5), "lora.rank"),
    (dict(alpha=0.0), "lora.alpha"), (dict(alpha=float("nan")), "lora.alpha"),
    (dict(dropout=1.0), "lora.dropout"), (dict(dropout=-0.1), "lora.dropout"),
    (dict(targets=("q", "qkv")), "unknown ['qkv']"), (dict(targets=()), "at least one"),
    (dict(targets=("q", "q")), "twice"),
])
def test_bad_adapter_configs_are_refused(kwargs, words):
    with pytest.raises(LoraConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        LoraConfig(**kwargs)




def test_the_recipe_section_has_the_same_defaults_and_checks():
    from rl_jax.recipe.checks import parse
    from rl_jax.recipe.schema import RLConfigError, defaults, to_dict
    section = defaults().lora
    assert not section.enabled
    assert LoraConfig(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                      targets=section.targets) == LoraConfig()
    config = to_dict(defaults())
    for change, words in [({"targets": ("q", "qkv")}, "lora.targets"),
                          ({"rank": 0}, "lora.rank")]:
        bad = {**config, "lora": {**config["lora"], **change}}
        with pytest.raises(RLConfigError, match=words):
            parse(bad, registries=False)


def test_defaults_are_the_usual_ones():
    c = LoraConfig()
    assert (c.rank, c.alpha, c.dropout, c.scale) == (16, 32.0, 0.0, 2.0)
    assert c.targets == ("q", "k", "v", "o", "gate", "up", "down") == tuple(TARGETS)


# ---- initialisation, freezing, optimizer state ---------------------------------------------------

def test_fresh_adapters_leave_the_base_unchanged_and_are_drawn_as_peft_draws():
    spec = ModelSpec(TINY, mesh=None, lora=LORA)
    base_spec = ModelSpec(TINY, mesh=None)
    base = base_spec.init_params(0)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    # The base of a LoRA model equals the plain model of the same seed.
    for a, b in zip(_leaves(frozen), _leaves(base)):
        np.testing.assert_array_equal(a, b)
    layers = adapters["layers"]
    assert sorted(layers) == sorted(w + s for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                    "w_down") for s in ("_lora_a", "_lora_b"))
    fan_in = {"wq": 32, "wo": 32, "w_down": 64}
    for w, n in fan_in.items():
        a = np.asarray(layers[w + "_lora_a"])
        assert a.shape[-1] == LORA.rank and np.abs(a).max() <= 1 / math.sqrt(n)
        assert a.std() > 0.5 / math.sqrt(3 * n)  # uniform(±1/√n) has std 1/√(3n)
        assert not np.asarray(layers[w + "_lora_b"]).any()
    tokens = np.random.RandomState(0).randint(0, 64, (2, 12))
    np.testing.assert_array_equal(_logits(spec, adapters, frozen, tokens),
                                  _logits(base_spec, base, None, tokens))


def test_base_is_frozen_in_compute_dtype_and_only_adapters_have_optimizer_state():
    spec = ModelSpec(TINY, mesh=None, lora=LORA, dtype=jnp.bfloat16)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    state = init_state(TX, spec, adapters, frozen)
    # Every moment the optimizer keeps belongs to an adapter.
    mu = state.opt_state[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(adapters)
    opt_bytes = sum(x.size for x in jax.tree.leaves(state.opt_state))
    assert opt_bytes <= 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 8
    base_before = _leaves(frozen)
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    for seed in range(3):
        state, metrics = step(state, random_batch(seed))
        assert np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 3
    for a, b in zip(base_before, _leaves(state.frozen)):
        np.testing.assert_array_equal(a, b)
    moved = [not np.array_equal(a, b) for a, b in zip(_leaves(adapters), _leaves(state.params))]
    assert all(moved)


def test_streaming_step_equals_the_whole_batch_step():
    spec = ModelSpec(TINY, mesh=None, lora=LORA)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    whole = make_train_step(spec, TX, causal_lm_loss, donate=False)
    streaming = StreamingTrainStep(spec, TX, causal_lm_loss, micro_rows=2)
    a = init_state(TX, spec, adapters, frozen)
    b = init_state(TX, spec, adapters, frozen)
    for seed in range(2):
        batch = random_batch(seed)
        a, ma = whole(a, batch)
        b, mb = streaming(b, jax.tree.map(np.asarray, batch))
        np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-6)
    # Summation order differs (as tests/test_trainer.py's micro-batching cases).
    for x, y in zip(_leaves(a.params), _leaves(b.params)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


# ---- adapter dropout ----------------------------------------------------------------------------

DROP = LoraConfig(rank=4, alpha=8.0, dropout=0.25)


def _dropout_run(lora, mesh=None, steps=2, num_micro=2):
    spec = ModelSpec(TINY, mesh=mesh, lora=lora)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    state = init_state(TX, spec, adapters, frozen)
    step = make_train_step(spec, TX, causal_lm_loss, donate=False, num_microbatches=num_micro)
    sharding = None if mesh is None else NamedSharding(mesh, batch_partition_spec(spec))
    for s in range(steps):
        batch = random_batch(s)
        state, _ = step(state, batch if mesh is None else global_batch(batch, sharding))
    return spec, state


def test_adapter_dropout_acts_in_training_only_and_is_reproducible():
    # Evaluation (no key) ignores dropout: the model equals the one without.
    spec = ModelSpec(TINY, mesh=None, lora=DROP)
    plain = ModelSpec(TINY, mesh=None, lora=LORA)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    adapters = _random_adapters(spec, 4)
    tokens = np.random.RandomState(0).randint(0, 64, (2, 12))
    np.testing.assert_array_equal(_logits(spec, adapters, frozen, tokens),
                                  _logits(plain, adapters, frozen, tokens))
    # With a key, only the adapter path is dropped: different, and fixed by the key.
    def with_key(key):
        model = spec.merge(adapters, frozen, key)
        return np.asarray(model.logits(model(jnp.asarray(tokens))))
    k0, k1 = spec.dropout_key(jnp.int32(0), jnp.int32(0)), spec.dropout_key(jnp.int32(1),
                                                                             jnp.int32(0))
    assert np.abs(with_key(k0) - _logits(plain, adapters, frozen, tokens)).max() > 1e-3
    np.testing.assert_array_equal(with_key(k0), with_key(k0))
    assert not np.array_equal(with_key(k0), with_key(k1))

    # The same masks on a sharded model (threefry draws do not depend on the layout): a
    # different mask would move these logits by ~1e-2, not by rounding.
    mesh = make_mesh(2, 2, 2)
    sharded = ModelSpec(TINY, mesh=mesh, lora=DROP)
    s_adapters = jax.device_put(adapters, sharded.param_shardings)
    s_frozen = jax.device_put(frozen, sharded.frozen_shardings)
    got = jax.jit(lambda a, f, k: (lambda m: m.logits(m(jnp.asarray(tokens))))(
        sharded.merge(a, f, k)))(s_adapters, s_frozen, k0)
    np.testing.assert_allclose(np.asarray(got), with_key(k0), rtol=1e-5, atol=1e-5)

    # Training with dropout moves the adapters differently, and the same way twice.
    _, a = _dropout_run(DROP)
    _, b = _dropout_run(DROP)
    _, c = _dropout_run(LORA)
    for x, y in zip(_leaves(a.params), _leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    assert any(not np.allclose(x, y) for x, y in zip(_leaves(a.params), _leaves(c.params)))


# ---- sharding ------------------------------------------------------------------------------------

def _train(mesh, steps=3, seed=0):
    spec = ModelSpec(TINY, mesh=mesh, lora=LORA)
    adapters, frozen = spec.split_frozen(spec.init_params(seed))
    state = init_state(TX, spec, adapters, frozen)
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    sharding = (None if mesh is None else NamedSharding(mesh, batch_partition_spec(spec)))
    losses = []
    for s in range(steps):
        batch = random_batch(s)
        state, metrics = step(state, batch if mesh is None else global_batch(batch, sharding))
        losses.append(float(metrics["loss"]))
    return spec, state, losses


def test_sharded_adapter_training_equals_unsharded():
    _, ref_state, ref_losses = _train(None)
    spec, state, losses = _train(make_mesh(2, 2, 2))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(_leaves(state.params), _leaves(ref_state.params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # Adapters, and their moments, sharded like the weights they adapt (default rules: embed
    # over fsdp, heads and mlp over tensor; the rank never split).
    layers = state.params["layers"]
    expected = {
        "wq_lora_a": P(None, "fsdp", None), "wq_lora_b": P(None, None, "tensor", None),
        "wk_lora_b": P(None, None, "tensor", None),
        "wo_lora_a": P(None, "tensor", None, None), "wo_lora_b": P(None, None, "fsdp"),
        "w_gate_lora_a": P(None, "fsdp", None), "w_gate_lora_b": P(None, None, "tensor"),
        "w_down_lora_a": P(None, "tensor", None), "w_down_lora_b": P(None, None, "fsdp"),
    }
    mu = state.opt_state[1][0].mu["layers"]
    for name, want in expected.items():
        assert layers[name].sharding.spec == want, name
        assert mu[name].sharding.spec == want, name
    assert state.frozen["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)


# ---- checkpoints ---------------------------------------------------------------------------------

def test_resumed_lora_run_continues_bit_exactly(tmp_path):
    mesh = make_mesh(2, 2, 2)
    spec = ModelSpec(TINY, mesh=mesh, lora=LORA)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    sharding = NamedSharding(mesh, batch_partition_spec(spec))
    batch = lambda s: global_batch(random_batch(s), sharding)  # noqa: E731

    state = init_state(TX, spec, adapters, frozen)
    with Checkpointer(tmp_path / "ckpt", use_async=False) as ckpt:
        for s in range(2):
            state, _ = step(state, batch(s))
        ckpt.save(int(state.step), state, {"next_batch": 2})
        straight = state
        for s in range(2, 4):
            straight, want = step(straight, batch(s))

        # Checkpoints hold no base: a restore must be given it.
        with pytest.raises(CheckpointRestoreError, match="frozen"):
            ckpt.restore(abstract_state(TX, spec))
        _, base = spec.split_frozen(ModelSpec(TINY, mesh=mesh).init_params(0))
        restored, meta, at = ckpt.restore(abstract_state(TX, spec).replace(frozen=base))
    assert at == 2 and meta == {"next_batch": 2}
    saved = {p.name for p in (tmp_path / "ckpt" / "2" / "state").iterdir()}
    assert saved, "a checkpoint was written"
    for s in range(2, 4):
        restored, got = step(restored, batch(s))
    assert float(got["loss"]) == float(want["loss"])
    for a, b in zip(_leaves(straight), _leaves(restored)):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_holds_only_adapters(tmp_path):
    spec = ModelSpec(TINY, mesh=None, lora=LORA)
    adapters, frozen = spec.split_frozen(spec.init_params(0))
    state = init_state(TX, spec, adapters, frozen)
    with Checkpointer(tmp_path / "ckpt", use_async=False) as ckpt:
        ckpt.save(0, state)
    import orbax.checkpoint as ocp
    meta = ocp.StandardCheckpointer().metadata(tmp_path / "ckpt" / "0" / "state")
    tree = getattr(meta, "item_metadata", meta)
    names = {".".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(dict(tree))[0]}
    assert "frozen" not in {n.split(".")[0] for n in names}
    assert not [n for n in names if n.startswith("params.") and "_lora_" not in n]


# ---- PEFT export and the merged checkpoint -------------------------------------------------------

@pytest.fixture(scope="module", params=["qwen2", "llama"])
def hf_base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = hf_reference.write_hf_checkpoint(request.param, path)
    return request.param, path, torch_model


def test_peft_adapter_loads_with_peft_with_equal_logits(hf_base, tmp_path):
    peft = pytest.importorskip("peft")
    family, path, torch_model = hf_base
    cfg = hf.read_config(path)
    base_model = hf.load_pretrained(path)
    spec = ModelSpec(cfg, mesh=None, lora=LORA)
    _, frozen = spec.split_frozen(ModelSpec(cfg, mesh=None).split(base_model))
    adapters = _random_adapters(spec, 1)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 10))
    ours = _logits(spec, adapters, frozen, tokens)

    out = save_peft_adapter(tmp_path / "adapter", adapters, cfg, LORA, base_model=str(path))
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["r"] == 4 and meta["lora_alpha"] == 8.0 and meta["peft_type"] == "LORA"
    assert sorted(meta["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert (out / ADAPTER_WEIGHTS).exists()

    import copy
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
    # PEFT found every tensor (it warns, not fails, on missing ones): its B's equal ours.
    state = peft_model.state_dict()
    b = state["base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"]
    np.testing.assert_array_equal(
        b.numpy(), np.asarray(adapters["layers"]["wq_lora_b"])[1].reshape(4, -1).T)
    ref = hf_reference.hf_logits(peft_model, tokens)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)
    base_ref = hf_reference.hf_logits(torch_model, tokens)
    assert np.abs(ref - base_ref).max() > 100 * ATOL  # the adapters change the model

    # Round trip through the PEFT files.
    loaded, lora = load_peft_adapter(out, cfg)
    assert lora == LORA
    for a, b in zip(_leaves(loaded), _leaves(adapters)):
        np.testing.assert_array_equal(a, b)


def test_merged_checkpoint_equals_the_adapted_model(hf_base, tmp_path):
    family, path, torch_model = hf_base
    cfg = hf.read_config(path)
    spec = ModelSpec(cfg, mesh=None, lora=LORA)
    base = ModelSpec(cfg, mesh=None).split(hf.load_pretrained(path))
    _, frozen = spec.split_frozen(base)
    adapters = _random_adapters(spec, 2)
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 10))
    ours = _logits(spec, adapters, frozen, tokens)

    full = {**base, "layers": {**base["layers"], **adapters["layers"]}}
    with pytest.raises(hf.CheckpointError, match="save_merged"):
        hf.save_pretrained(spec.merge(adapters, frozen), tmp_path / "plain")
    out = save_merged(tmp_path / "merged", cfg, full, LORA)
    merged = hf.load_pretrained(out)
    np.testing.assert_allclose(np.asarray(merged.logits(merged(jnp.asarray(tokens)))), ours,
                               rtol=0, atol=ATOL)
    import transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_reference.hf_logits(ref_model, tokens), ours, rtol=0,
                               atol=ATOL)


def test_bad_peft_adapters_are_refused(hf_base, tmp_path):
    _, path, _ = hf_base
    cfg = hf.read_config(path)
    spec = ModelSpec(cfg, mesh=None, lora=LORA)
    out = save_peft_adapter(tmp_path / "a", _random_adapters(spec, 3), cfg, LORA)
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    for change, words in [({"r": 0}, "lora.rank"), ({"target_modules": ["qkv_proj"]},
                                                     "target_modules"),
                          ({"use_dora": True}, "use_dora"), ({"peft_type": "IA3"}, "LORA"),
                          ({"r": 8}, "shape")]:
        (out / ADAPTER_CONFIG).write_text(json.dumps({**meta, **change}))
        with pytest.raises(hf.CheckpointError, match=words):
            load_peft_adapter(out, cfg)
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(out / ADAPTER_WEIGHTS))
    name = next(iter(tensors))
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    with pytest.raises(hf.CheckpointError, match="non-finite"):
        load_peft_adapter(out, cfg)


# ---- the supervised recipe with adapters ---------------------------------------------------------

def _lm_config(steps, stop_after=0, **lora):
    from rl_jax.recipe.checks import load_recipe_file
    from pathlib import Path
    c = load_recipe_file(Path(__file__).parent.parent / "configs" / "tiny_lm.py")
    c.trainer.steps, c.trainer.stop_after = steps, stop_after
    c.data.rows_per_batch, c.data.seq_len, c.data.eval_examples = 8, 64, 16
    c.checkpoint.every, c.checkpoint.use_async = 2, False
    c.logging.every = c.logging.eval_every = 2
    from ml_collections import ConfigDict
    c.lora = ConfigDict(dict(enabled=True, rank=4, alpha=8.0, **lora))
    return c


def test_lm_recipe_trains_adapters_resumes_exactly_and_exports(tmp_path):
    from rl_jax.trainer import lm
    straight = lm.run(_lm_config(4), str(tmp_path / "straight"))
    lm.run(_lm_config(4, stop_after=2), str(tmp_path / "resumed"))
    resumed = lm.run(_lm_config(4), str(tmp_path / "resumed"))
    assert straight["steps"] == resumed["steps"] == 4
    assert resumed["eval_loss"] == straight["eval_loss"]
    # Only the adapters count as trained parameters.
    assert straight["parameters"] < 0.2 * 600_000
    cfg = hf.read_config(tmp_path / "straight" / "hf")
    adapters, lora = load_peft_adapter(tmp_path / "straight" / "adapter", cfg)
    assert lora == LoraConfig(rank=4, alpha=8.0)
    assert np.asarray(adapters["layers"]["wq_lora_b"]).any()  # B left zero: trained
    bad = _lm_config(4)
    bad.lora.rank = 0
    with pytest.raises(lm.RecipeConfigError, match="lora.rank"):
        lm.lora_config(bad)
    with pytest.raises(lm.RecipeConfigError, match="unknown"):
        lm.lora_config(_lm_config(4, targets=("q", "qkv")))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_rl_run_trains_adapters_and_the_generators_run_them_merged(tmp_path):
    """The RL recipe with lora.enabled: the train state and its checkpoints hold the adapters
    only; every version the generators take is the base with the adapters merged (their
    held-out answers change from the base's); a resumed run continues; the export is the merged
    model plus the PEFT adapter."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    workdir = tmp_path / "run"
    base = workdir / "base" / "hf"  # the recipe's base, trained a little (it writes digits)

    def run(steps: int):
        cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
               f"--workdir={workdir}", "--config.base.lm_overrides=('task.num_digits=2', "
               "'trainer.steps=300', 'trainer.stop_after=60')",
               f"--config.trainer.steps={steps}", "--config.trainer.time_limit_s=0",
               "--config.lora.enabled=True", "--config.lora.rank=4", "--config.lora.alpha=8",
               "--config.optimizer.learning_rate=5e-3", "--config.rollout.groups_per_batch=4",
               "--config.rollout.group_size=4", "--config.rollout.filter_zero_signal=False",
               # a random base solves nothing: partial credit gives its groups a signal
               "--config.env.kwargs.partial_credit=True",
               "--config.generator.warmup_shapes=False", "--config.eval.examples=32",
               "--config.eval.every=0", "--config.checkpoint.every=2",
               "--config.checkpoint.use_async=False", "--config.cpus.trainer=",
               "--config.cpus.generators=", "--config.cpus.rollout=",
               "--config.logging.tensorboard=False"]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads((workdir / "summary.json").read_text())

    first = run(4)
    assert first["steps"] == 4 and first["parameters"] < 0.2 * 600_000
    import orbax.checkpoint as ocp
    meta = ocp.StandardCheckpointer().metadata(workdir / "checkpoints" / "4" / "state")
    tree = getattr(meta, "item_metadata", meta)
    names = {".".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(dict(tree))[0]}
    params = [n for n in names if n.startswith("params.")]
    assert params and all("_lora_" in n for n in params)
    cfg = hf.read_config(workdir / "hf")
    adapters, lora = load_peft_adapter(workdir / "adapter", cfg)
    assert lora == LoraConfig(rank=4, alpha=8.0)
    assert np.asarray(adapters["layers"]["wq_lora_b"]).any()  # B starts at zero: trained
    from safetensors.numpy import load_file
    merged = {k: v for f in sorted((workdir / "hf").glob("*.safetensors"))
              for k, v in load_file(f).items()}
    plain = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(f).items()}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(merged[q], plain[q])  # the adapters merged in
    assert np.array_equal(merged["model.embed_tokens.weight"],
                          plain["model.embed_tokens.weight"])  # not adapted: the base's
    resumed = run(6)  # continues from step 4's checkpoint
    assert resumed["steps"] == 6 and resumed["final_version"] >= 6
