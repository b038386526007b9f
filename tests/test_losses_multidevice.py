"""Policy losses on a (data=2, fsdp=4) mesh of 8 host devices, batch sharded over data+fsdp:
value, gradient and metrics equal the single-device result, also inside the trainer's
micro-batched train step."""

import dataclasses
import os

# Eight host CPU devices; must be set before jax is imported (also when run on its own).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding  # noqa: E402

from loss_reference import (  # noqa: E402
    assert_same_gradient, assert_same_metrics, assert_same_value, needs_prox, ref_loss)
from rl_jax.losses import get, make_config  # noqa: E402
from rl_jax.losses.advantages import grpo_advantages  # noqa: E402
from rl_jax.losses.core import finalize_metrics  # noqa: E402
from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.state import ModelSpec, init_state  # noqa: E402
from rl_jax.trainer.step import default_batch_sharding, global_batch, make_train_step  # noqa: E402
from trainer_fixtures import TINY, random_batch  # noqa: E402

MODEL = dataclasses.replace(TINY, num_layers=1)

BATCH, TIME = 16, 12


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "XLA_FLAGS was set after jax was imported"
    return make_mesh(data=2, fsdp=4, tensor=1, devices=jax.devices()[:8])


def make_inputs(seed: int, packed: bool) -> dict[str, np.ndarray]:
    """float32 [B, T] inputs: prompt tokens, padding, empty rows, NaN at masked positions."""
    rng = np.random.default_rng(seed)
    lp = -rng.exponential(1.0, (BATCH, TIME))
    blp = lp + 0.8 * rng.normal(size=lp.shape)
    prox = blp + rng.normal(size=lp.shape)
    ref = lp + 0.5 * rng.normal(size=lp.shape)
    ent = rng.uniform(0.0, 3.0, lp.shape)
    mask = np.zeros(lp.shape)
    seg = np.zeros(lp.shape, np.int32)
    for b in range(BATCH):
        if b % 5 == 1:
            continue  # empty rows, on several shards
        if packed:
            t, sid = 0, 1
            while t < TIME - 2:
                n = int(rng.integers(2, 6))
                seg[b, t:t + n] = sid
                mask[b, t + 1:t + n] = 1.0
                t, sid = t + n, sid + 1
        else:
            start = int(rng.integers(0, 3))
            mask[b, start:int(rng.integers(start + 1, TIME + 1))] = 1.0
    # GRPO advantages of 4 groups of 4 sequences; per token when rows are packed.
    rewards = rng.integers(0, 2, BATCH).astype(np.float32)
    adv = np.asarray(grpo_advantages(rewards.reshape(4, 4))).reshape(-1)
    if packed:
        adv = adv[:, None] + 0.1 * rng.normal(size=lp.shape)
    out = {k: np.where(mask > 0, v, np.nan).astype(np.float32)
           for k, v in dict(lp=lp, blp=blp, prox=prox, ref=ref, ent=ent).items()}
    return dict(out, adv=adv.astype(np.float32), mask=mask.astype(np.float32),
                seg=seg if packed else None)


def loss_value_and_grad(name, config, arrays):
    """Jitted (loss, d loss / d logprobs, metrics) with the trainer's ``sum / denominator``."""
    def objective(lp, rest):
        out = get(name)(lp, rest["blp"], rest["adv"], rest["mask"], config=config,
                        proximal_logprobs=rest["prox"] if needs_prox(name, config) else None,
                        ref_logprobs=rest["ref"],
                        entropy=rest["ent"], segment_ids=rest.get("seg"))
        return out.loss_sum / jnp.where(out.denominator > 0, out.denominator, 1.0), out.metrics
    rest = {k: v for k, v in arrays.items() if k != "lp" and v is not None}
    (value, metrics), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(
        arrays["lp"], rest)
    return value, grad, metrics


CASES = [
    ("reinforce_tis", {}, False),
    ("ppo_clip", dict(dual_clip=True, correction="tis"), False),
    ("grpo", dict(kl_coef=0.05, entropy_coef=0.01), True),
    ("dapo", dict(correction="mis", correction_level="geometric"), False),
    ("dr_grpo", dict(max_tokens=16), True),
    ("gspo", dict(epsilon_low=0.1, epsilon_high=0.1), True),
    ("cispo", dict(correction="mis", correction_level="sequence"), False),
    ("decoupled_ppo", dict(kl_coef=0.1, kl_estimator="k2"), True),
]


@pytest.mark.parametrize("name,overrides,packed", CASES, ids=[c[0] for c in CASES])
def test_sharded_batch_matches_single_device(mesh, name, overrides, packed):
    config = make_config(name, **overrides)
    inputs = make_inputs(CASES.index((name, overrides, packed)), packed)
    single = jax.devices()[0]
    local = {k: None if v is None else jax.device_put(v, SingleDeviceSharding(single))
             for k, v in inputs.items()}
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = {k: None if v is None else jax.device_put(v, rows) for k, v in inputs.items()}
    assert sharded["lp"].sharding.shard_shape(sharded["lp"].shape) == (BATCH // 8, TIME)

    value, grad, metrics = loss_value_and_grad(name, config, local)
    s_value, s_grad, s_metrics = loss_value_and_grad(name, config, sharded)
    assert len(s_grad.sharding.device_set) == 8

    # Tolerances relative to Σ|summand| (see tests/loss_reference.py): GRPO advantages are
    # zero-mean, so the loss is a small difference of O(1) per-token terms.
    as_float64 = {k: None if v is None else v.astype(np.float64) for k, v in inputs.items()}
    expected_value, expected, scales = ref_loss(name, config, as_float64)
    assert_same_value(s_value, value, scales["loss"])
    assert_same_gradient(s_grad, grad)
    assert not np.any(np.asarray(grad)[inputs["mask"] == 0])
    assert_same_metrics({k: float(v) for k, v in s_metrics.items()},
                        {k: float(v) for k, v in metrics.items()}, scales)
    full = finalize_metrics(metrics)
    for key in ("clipped_fraction", "ratio_mean", "ratio_ess", "kl_mean", "entropy_mean"):
        np.testing.assert_allclose(full[key], expected[key], rtol=1e-5, err_msg=key)
    assert float(full["tokens"]) == inputs["mask"].sum()
    assert_same_value(value, expected_value, scales["loss"], rtol=1e-5)


@flax.struct.dataclass
class PolicyBatch:
    """A packed RL batch for the trainer's step; every field is ``[B, T]``."""

    tokens: jax.Array
    targets: jax.Array
    loss_mask: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    behaviour_logprobs: jax.Array
    advantages: jax.Array


def policy_batch(seed: int) -> PolicyBatch:
    lm = random_batch(seed, batch=16, seq=16, vocab=MODEL.vocab_size)
    rng = np.random.default_rng(seed)
    shape = lm.tokens.shape
    behaviour = -np.log(MODEL.vocab_size) + 0.3 * rng.normal(size=shape)
    advantages = np.repeat(rng.normal(size=(shape[0], 2)), shape[1] // 2, axis=1)
    return PolicyBatch(tokens=lm.tokens, targets=lm.targets, loss_mask=lm.loss_mask,
                       positions=lm.positions, segment_ids=lm.segment_ids,
                       behaviour_logprobs=behaviour.astype(np.float32),
                       advantages=advantages.astype(np.float32))


def test_trainer_step_with_a_policy_loss_is_invariant():
    """The trainer's micro-batched step on the 8-device mesh, with a registered loss over packed
    rows, gives the single-device full-batch loss, metrics and gradient (read from an SGD
    update ``−lr · gradient``). The forward pass itself is rounded differently on the two
    meshes, so the tolerance is that of tests/test_trainer.py (1e-5)."""
    config = make_config("grpo", entropy_coef=0.01)

    def loss_fn(model, batch: PolicyBatch):
        stats = model.token_stats(batch.tokens, batch.targets, batch.positions, batch.segment_ids)
        return get("grpo")(stats["logprobs"], batch.behaviour_logprobs, batch.advantages,
                           batch.loss_mask, config=config, entropy=stats["entropy"],
                           segment_ids=batch.segment_ids)

    lr = 100.0  # large, so that the float32 rounding of the updated weights is negligible
    tx = optax.sgd(lr)
    rng = np.random.default_rng(0)  # random weights without compiling the initialiser
    initial = jax.tree.map(lambda s: (0.1 * rng.normal(size=s.shape)).astype(s.dtype),
                           jax.eval_shape(lambda: ModelSpec(MODEL, mesh=None).init_params(0)))
    before = jax.tree.leaves(initial)
    results = []
    for mesh_shape, num_micro in [(None, 1), ((2, 4, 1), 2)]:
        mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
        spec = ModelSpec(MODEL, mesh=mesh)
        state = init_state(tx, spec, jax.device_put(initial, spec.param_shardings))
        step = make_train_step(spec, tx, loss_fn, num_microbatches=num_micro, donate=False)
        state, metrics = step(state, global_batch(policy_batch(1), default_batch_sharding(spec)))
        after = [np.asarray(x) for x in jax.tree.leaves(state.params)]
        grad = np.concatenate([((b - a) / -lr).ravel() for a, b in zip(before, after)])
        results.append((finalize_metrics({k: float(v) for k, v in metrics.items()}), grad))
    (want, want_grad), (got, got_grad) = results
    assert got.keys() == want.keys() and int(got["skipped"]) == 0
    for key in ("loss", "grad_norm", "denominator", "tokens", "sequences", "ratio_mean",
                "ratio_max", "entropy_mean", "clipped_fraction", "policy_kl_mean"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert_same_gradient(got_grad, want_grad, rtol=1e-5)
