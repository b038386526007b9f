"""Policy losses and advantage estimators against plain-NumPy references, finite differences,
micro-batch invariance, packed rows, and edge cases (empty rows, zero advantages, extreme
log-ratios, garbage at masked positions)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loss_reference import (CLAMP, assert_same_gradient, assert_same_metrics, assert_same_value,
                            finite_difference_grad, needs_prox, ref_advantages, ref_loss,
                            ref_m2po_keep)
from rl_jax import losses
from rl_jax.losses import advantages, configs, core, policy, regularizers
from rl_jax.losses import get, make_config
from rl_jax.losses.advantages import (GroupSizeError, check_groups, dr_grpo_advantages,
                                      grpo_advantages, rloo_advantages)
from rl_jax.losses.configs import LossConfigError
from rl_jax.losses.core import finalize_metrics
from rl_jax.trainer.step import split_microbatches

ALL_LOSSES = ("reinforce_tis", "ppo_clip", "grpo", "dapo", "dr_grpo", "gspo", "gmpo", "cispo",
              "decoupled_ppo", "m2po")

# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def make_batch(seed, batch=6, time=8, *, token_advantages=False, packed=False, spread=0.8):
    """Random [B, T] inputs with prompt tokens, padding, one empty row and NaN at masked slots.

    Returns a dict of NumPy arrays: lp, blp (behaviour), prox, ref, ent, adv, mask, seg.
    """
    rng = np.random.default_rng(seed)
    lp = -rng.exponential(1.0, (batch, time))
    blp = lp + spread * rng.normal(size=(batch, time))
    prox = blp + rng.normal(size=(batch, time))
    ref = lp + 0.5 * rng.normal(size=(batch, time))
    ent = rng.uniform(0.0, 3.0, (batch, time))
    mask = np.zeros((batch, time))
    seg = np.zeros((batch, time), np.int32)
    for b in range(batch):
        if b == 1:
            continue  # an all-masked row
        if packed:
            t, sid = 0, 1
            while t < time - 1:
                n = int(rng.integers(2, 5))
                seg[b, t:t + n] = sid
                prompt = int(rng.integers(0, 2))
                mask[b, t + prompt:t + n] = 1.0
                t, sid = t + n, sid + 1
        else:
            start = int(rng.integers(0, 3))
            stop = int(rng.integers(start + 1, time + 1))
            mask[b, start:stop] = 1.0
    if packed:
        mask[seg == 0] = 0.0
    adv = rng.normal(size=(batch, time)) if token_advantages or packed else rng.normal(size=batch)
    # Inputs are float32 values (held in float64) so that the reference sees what JAX sees.
    arrays = {k: v.astype(np.float32).astype(np.float64)
              for k, v in dict(lp=lp, blp=blp, prox=prox, ref=ref, ent=ent, adv=adv).items()}
    for name in ("lp", "blp", "prox", "ref", "ent"):
        arrays[name] = np.where(mask > 0, arrays[name], np.nan)
    if adv.ndim == 2:
        arrays["adv"] = np.where(mask > 0, arrays["adv"], np.nan)
    return dict(**arrays, mask=mask, seg=seg if packed else None)


def call(name, config, d, lp=None, jit=True):
    """LossOutput of the JAX loss on float32 inputs."""
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)  # noqa: E731
    uses_prox = needs_prox(name, config)

    def run(logprobs):
        return get(name)(logprobs, f32(d["blp"]), f32(d["adv"]), f32(d["mask"]), config=config,
                         proximal_logprobs=f32(d["prox"]) if uses_prox else None,
                         ref_logprobs=f32(d["ref"]), entropy=f32(d["ent"]),
                         segment_ids=d["seg"])
    fn = jax.jit(run) if jit else run
    return fn(f32(d["lp"] if lp is None else lp))


def value_and_grad(name, config, d):
    """(loss, dloss/dlogprobs, metrics) with the trainer's reduction ``sum / denominator``."""
    def objective(logprobs):
        out = call(name, config, {**d, "lp": logprobs}, jit=False)
        return out.loss_sum / jnp.where(out.denominator > 0, out.denominator, 1.0), out
    (value, out), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(
        jnp.asarray(d["lp"], jnp.float32))
    return value, grad, out


# Each case: (loss name, config overrides, make_batch options).
CASES = [
    ("reinforce_tis", {}, {}),
    ("reinforce_tis", dict(normalization="token", correction="tis", correction_level="sequence"),
     dict(token_advantages=True)),
    ("ppo_clip", {}, {}),
    ("ppo_clip", dict(dual_clip=True, correction="mis", correction_level="geometric"),
     dict(spread=1.5)),
    ("grpo", dict(kl_coef=0.1, entropy_coef=0.01), {}),
    ("grpo", dict(kl_coef=0.1, kl_estimator="k1"), dict(packed=True)),
    ("grpo", dict(kl_coef=0.1, kl_value_clamp=0.3), dict(spread=1.5)),
    ("dapo", dict(kl_coef=0.05, kl_estimator="k2", correction="tis"), dict(token_advantages=True)),
    ("dr_grpo", {}, {}),
    ("dr_grpo", dict(max_tokens=20, correction="mis"), dict(packed=True)),
    ("gspo", {}, dict(spread=2e-4)),
    ("gspo", dict(epsilon_low=0.2, epsilon_high=0.2, correction="tis"), dict(packed=True)),
    ("cispo", {}, dict(spread=1.5)),
    ("cispo", dict(epsilon_low=0.2, epsilon_high=0.3, entropy_coef=0.02), {}),
    ("decoupled_ppo", {}, {}),
    ("decoupled_ppo", dict(behaviour_weight_mode="tis", dual_clip=True), dict(spread=1.5)),
    ("m2po", {}, dict(spread=0.5)),
    ("m2po", dict(m2_threshold=0.2, kl_coef=0.1, correction="tis"), dict(packed=True)),
    ("gmpo", {}, {}),
    ("gmpo", dict(epsilon_low=0.2, epsilon_high=0.3, kl_coef=0.1, correction="mis",
                  correction_level="geometric"), dict(packed=True, spread=1.5)),
]
CASE_IDS = [f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)]


@pytest.mark.parametrize("name,overrides,options", CASES, ids=CASE_IDS)
def test_loss_matches_numpy_reference_and_finite_differences(name, overrides, options):
    cfg = make_config(name, **overrides)
    d = make_batch(CASES.index((name, overrides, options)), **options)
    value, grad, out = value_and_grad(name, cfg, d)
    expected, expected_metrics, _ = ref_loss(name, cfg, d)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    metrics = finalize_metrics(out.metrics)
    for key, want in expected_metrics.items():
        np.testing.assert_allclose(metrics[key], want, rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(grad, finite_difference_grad(name, cfg, d), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad)[d["mask"] == 0] == 0.0)


def test_reference_cases_exercise_every_branch():
    """Clipping (every loss), dual clipping and capped behaviour weights are active in CASES."""
    seen: dict[str, float] = {}
    for i, (name, overrides, options) in enumerate(CASES):
        _, m, _ = ref_loss(name, make_config(name, **overrides), make_batch(i, **options))
        for key in ("clipped_fraction", "dual_clipped_fraction", "behaviour_capped_fraction"):
            k = f"{name}:{key}" if key == "clipped_fraction" else key
            seen[k] = max(seen.get(k, 0.0), float(m.get(key, 0.0)))
    assert all(seen.get(f"{n}:clipped_fraction", 0) > 0 for n in ALL_LOSSES), seen
    assert seen["dual_clipped_fraction"] > 0 and seen["behaviour_capped_fraction"] > 0, seen


# ----------------------------------------------------------------------------------------------
# Exactness under micro-batching and packing
# ----------------------------------------------------------------------------------------------


def microbatched(name, cfg, d, num_micro):
    """Σ loss_sum / Σ denominator over the trainer's micro-batch split, the gradient of that
    value w.r.t. the full logprobs, and the metrics accumulated as the trainer does."""
    arrays = {k: jnp.asarray(v) for k, v in d.items() if v is not None}

    @jax.jit
    def run(arrays):
        micro = split_microbatches(arrays, num_micro)
        sums, denoms, grads, metrics = [], [], [], None
        for i in range(num_micro):
            part = {"seg": None, **{k: v[i] for k, v in micro.items()}}
            objective = lambda lp: call(name, cfg, {**part, "lp": lp}, jit=False)  # noqa: E731
            out, vjp = jax.vjp(objective, part["lp"].astype(jnp.float32))
            sums.append(out.loss_sum)
            denoms.append(out.denominator)
            grads.append(vjp(jax.tree.map(jnp.zeros_like, out)._replace(
                loss_sum=jnp.ones(())))[0])
            metrics = out.metrics if metrics is None else {
                k: jnp.maximum(v, out.metrics[k]) if k.endswith("_max") else v + out.metrics[k]
                for k, v in metrics.items()}
        denom = sum(denoms)
        # [num_micro, B / num_micro, T] → original row order (the inverse of the strided split).
        grad = jnp.swapaxes(jnp.stack(grads, 0), 0, 1).reshape(arrays["lp"].shape) / denom
        return sum(sums) / denom, grad, metrics

    return run(arrays)


# Every loss and every normalisation, packed and unpacked rows, corrections and regularisers.
# M2PO's mask is a function of the whole call's tokens: micro-batches reduce exactly to the
# full batch only where the bound does not bind (test_m2po_mask_* cover the mask itself).
MICRO_CASES = [CASES[i] for i in (0, 1, 3, 5, 6, 8, 12, 14)] + [
    ("gspo", dict(epsilon_low=0.2, epsilon_high=0.2, correction="mis"), dict(packed=True)),
    ("m2po", dict(m2_threshold=1e6), dict(packed=True)),
    ("gmpo", dict(epsilon_low=0.2, epsilon_high=0.3, correction="tis"), dict(packed=True))]


@pytest.mark.parametrize("name,overrides,options", MICRO_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(MICRO_CASES)])
def test_microbatches_reduce_to_the_full_batch(name, overrides, options, num_micro=3):
    cfg = make_config(name, **overrides)
    d = make_batch(7, batch=12, **options)
    d["mask"][[4, 7, 10]] = 0.0  # with row 1: micro-batch 1 of 3 is all masked
    for k in ("lp", "blp", "prox", "ref", "ent"):
        d[k] = np.where(d["mask"] > 0, d[k], np.nan)
    value, grad, out = value_and_grad(name, cfg, d)
    micro_value, micro_grad, micro_metrics = microbatched(name, cfg, d, num_micro)
    _, _, scales = ref_loss(name, cfg, d)
    assert_same_value(micro_value, value, scales["loss"])
    assert_same_gradient(micro_grad, grad)
    assert_same_metrics({k: float(v) for k, v in micro_metrics.items()},
                        {k: float(v) for k, v in out.metrics.items()}, scales)


def unpack(d):
    """The same sequences as ``d`` (packed), one per row, left-aligned, no segment ids."""
    rows = []
    for b in range(d["mask"].shape[0]):
        for sid in sorted(set(d["seg"][b].tolist()) - {0}):
            rows.append(np.flatnonzero(d["seg"][b] == sid) + b * d["mask"].shape[1])
    time = d["mask"].shape[1]
    out = {}
    for k in ("lp", "blp", "prox", "ref", "ent", "adv", "mask"):
        flat = d[k].reshape(-1)
        arr = np.full((len(rows), time), 0.0 if k == "mask" else np.nan)
        for i, idx in enumerate(rows):
            arr[i, :len(idx)] = flat[idx]
        out[k] = arr
    out["seg"] = None
    return out


@pytest.mark.parametrize("name,overrides", [
    ("grpo", {}), ("gspo", dict(epsilon_low=0.2, epsilon_high=0.2)), ("gmpo", {}),
    ("dr_grpo", dict(max_tokens=16)), ("reinforce_tis", dict(correction="mis",
                                                             correction_level="sequence")),
    ("decoupled_ppo", {})])
def test_packed_rows_equal_one_sequence_per_row(name, overrides):
    cfg = make_config(name, **overrides)
    packed = make_batch(3, batch=4, time=12, packed=True)
    plain = unpack(packed)
    a, b = call(name, cfg, packed), call(name, cfg, plain)
    _, _, scales = ref_loss(name, cfg, plain)
    assert_same_value(a.loss_sum / a.denominator, b.loss_sum / b.denominator, scales["loss"])
    assert float(a.metrics["sequences"]) == plain["mask"].any(1).sum()
    assert_same_metrics(a.metrics, b.metrics, scales)


# ----------------------------------------------------------------------------------------------
# Edge cases
# ----------------------------------------------------------------------------------------------


def _all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_all_masked_batch_gives_zero_everything(name):
    cfg = make_config(name, kl_coef=0.1, entropy_coef=0.01)
    d = make_batch(0)
    d["mask"][:] = 0.0
    d = {**d, **{k: np.full_like(d[k], np.nan) for k in ("lp", "blp", "prox", "ref", "ent")}}
    value, grad, out = value_and_grad(name, cfg, d)
    assert float(out.loss_sum) == 0.0 and float(out.denominator) == 0.0 and float(value) == 0.0
    assert not np.any(np.asarray(grad)) and _all_finite(out.metrics)
    assert all(float(v) == 0.0 for v in finalize_metrics(out.metrics).values())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_zero_advantages_give_zero_loss_and_gradient(name):
    cfg = make_config(name)
    d = make_batch(1)
    d["adv"] = np.zeros_like(d["adv"])
    value, grad, out = value_and_grad(name, cfg, d)
    assert float(value) == 0.0 and not np.any(np.asarray(grad))
    if name != "m2po":  # M2PO's mask depends on the log-ratios alone, not on the advantages
        assert float(finalize_metrics(out.metrics)["clipped_fraction"]) == 0.0


def extreme_batch():
    """Row 0: log π_θ − log μ = +1e4, −1e4, +50, −50, +inf (μ = −inf), then masked ±inf/NaN."""
    lp = np.full((2, 8), -1.0)
    blp = np.array([[-1e4 - 1, 1e4 - 1, -51.0, 49.0, -np.inf, np.nan, np.inf, -np.inf],
                    [-1.3, -0.7, -1.0, -1.1, -0.9, -1.0, -1.0, -1.0]])
    mask = np.array([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], np.float64)
    lp[0, 5:] = [np.nan, np.inf, -np.inf]
    return dict(lp=lp, blp=blp, prox=np.where(mask > 0, lp - 0.5, np.nan),
                ref=np.where(mask > 0, -1e4, np.nan),
                ent=np.where(mask > 0, 1.0, np.inf), adv=np.array([1.0, -1.0]), mask=mask,
                seg=None)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_extreme_log_ratios_stay_finite(name):
    cfg = make_config(name, kl_coef=0.1, entropy_coef=0.01)
    value, grad, out = value_and_grad(name, cfg, extreme_batch())
    assert _all_finite((value, grad, out.metrics, finalize_metrics(out.metrics)))
    assert not np.any(np.asarray(grad)[extreme_batch()["mask"] == 0])
    assert float(out.metrics["ratio_max"]) <= math.exp(CLAMP) * (1 + 1e-6)


def test_extreme_weights_are_truncated_as_documented():
    d = extreme_batch()
    # reinforce_tis: ratio e^20 (clamped) is truncated at c = 5: ∂ℓ/∂logπ = −5·A / N, N = 11.
    cfg = make_config("reinforce_tis", normalization="token")
    _, grad, out = value_and_grad("reinforce_tis", cfg, d)
    assert float(out.denominator) == 11.0
    np.testing.assert_allclose(np.asarray(grad)[0, [0, 2, 4]], -5.0 / 11, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad)[0, [1, 3]], -math.exp(-CLAMP) / 11, rtol=1e-5)
    np.testing.assert_allclose(float(out.metrics["ratio_max"]), math.exp(CLAMP), rtol=1e-6)
    # cispo: weight capped at 1 + ε_high = 5, no lower bound.
    _, grad, _ = value_and_grad("cispo", make_config("cispo"), d)
    np.testing.assert_allclose(np.asarray(grad)[0, [0, 2, 4]], -5.0 / 11, rtol=1e-6)
    # ppo_clip, A > 0: huge ratios sit on the clipped branch: no gradient.
    cfg = make_config("ppo_clip")
    _, grad, out = value_and_grad("ppo_clip", cfg, d)
    assert not np.any(np.asarray(grad)[0, [0, 2, 4]])
    # decoupled_ppo with a huge π_prox/μ: MIS drops the token, TIS truncates its weight at 5.
    e = dict(d, prox=d["lp"].copy(), blp=np.where(d["mask"] > 0, -1.0, np.nan))
    e["blp"][0, 0] = -60.0
    _, grad, out = value_and_grad("decoupled_ppo", make_config("decoupled_ppo"), e)
    assert float(grad[0, 0]) == 0.0 and float(out.metrics["behaviour_capped_tokens"]) == 1.0
    _, grad_tis, _ = value_and_grad(
        "decoupled_ppo", make_config("decoupled_ppo", behaviour_weight_mode="tis"), e)
    np.testing.assert_allclose(float(grad_tis[0, 0]), -5.0 * 1.0 / 11, rtol=1e-6)


@pytest.mark.parametrize("seed,threshold", [(0, 0.04), (1, 0.3), (2, 1.0), (3, 1e-4)])
def test_m2po_mask_is_the_fewest_largest_tokens_within_the_bound(seed, threshold):
    rng = np.random.default_rng(seed)
    log_ratio = rng.normal(scale=0.6, size=(5, 9)).astype(np.float32)
    log_ratio[0, :3] = log_ratio[0, 3]  # ties
    mask = (rng.uniform(size=(5, 9)) < 0.7).astype(np.float32)
    mask[2] *= 0.5  # weighted tokens
    keep = np.asarray(jax.jit(policy.second_moment_mask, static_argnums=2)(
        jnp.asarray(log_ratio), jnp.asarray(mask), threshold))
    np.testing.assert_array_equal(keep, ref_m2po_keep(log_ratio.astype(np.float64), mask,
                                                      threshold))
    m2, w = log_ratio.astype(np.float64) ** 2, mask * keep
    assert w.sum() == 0 or (w * m2).sum() <= threshold * w.sum() * (1 + 1e-6)
    dropped = (mask > 0) & ~keep
    if dropped.any():  # only the largest go, and one fewer would not be within the bound
        assert m2[dropped].min() >= m2[keep].max(initial=0.0)
        last = np.argwhere(dropped)[np.argmin(m2[dropped])]
        w1 = w.copy()
        w1[tuple(last)] = mask[tuple(last)]
        assert (w1 * m2).sum() > threshold * w1.sum()
    assert not keep[mask == 0].any()


def test_m2po_masks_more_as_the_policies_drift_apart():
    fractions = []
    for spread in (0.05, 0.3, 1.0, 3.0):
        d = make_batch(11, batch=16, time=12, spread=spread)
        _, grad, out = value_and_grad("m2po", make_config("m2po"), d)
        m = finalize_metrics(out.metrics)
        fractions.append(float(m["clipped_fraction"]))
        kept = (d["mask"] > 0) & (np.asarray(grad) != 0)
        lr = np.clip(d["lp"] - d["blp"], -CLAMP, CLAMP)
        assert np.mean(lr[kept] ** 2) <= 0.04 * (1 + 1e-5)
    assert fractions[0] == 0.0 and fractions == sorted(fractions) and fractions[-1] > 0.5


# ----------------------------------------------------------------------------------------------
# Registry, configs, errors
# ----------------------------------------------------------------------------------------------


def test_registry_gives_every_documented_loss():
    assert set(losses.names()) == set(ALL_LOSSES)
    for name in ALL_LOSSES:
        fn = get(name)
        doc = fn.__doc__
        assert "arXiv:" in doc and "=" in doc, name
        assert isinstance(make_config(name), losses.config_class(name))
    assert get("grpo") is policy.grpo
    with pytest.raises(LossConfigError, match="unknown policy loss"):
        get("ppo2")


def test_published_defaults():
    assert make_config("ppo_clip").epsilon_low == make_config("ppo_clip").epsilon_high == 0.2
    assert not make_config("ppo_clip").dual_clip and make_config("ppo_clip").dual_clip_c == 3.0
    assert (make_config("dapo").epsilon_low, make_config("dapo").epsilon_high) == (0.2, 0.28)
    assert (make_config("gspo").epsilon_low, make_config("gspo").epsilon_high) == (3e-4, 4e-4)
    assert make_config("gmpo").epsilon_low == make_config("gmpo").epsilon_high == 0.4
    assert make_config("reinforce_tis").truncation == 5.0
    assert make_config("cispo").epsilon_low is None
    norms = {n: make_config(n).normalization for n in ALL_LOSSES}
    assert norms == {"reinforce_tis": "sequence_sum", "ppo_clip": "token", "grpo": "sequence",
                     "dapo": "token", "dr_grpo": "constant", "gspo": "sequence", "gmpo": "sequence",
                     "cispo": "token", "decoupled_ppo": "token", "m2po": "token"}
    for name in ALL_LOSSES:
        assert make_config(name).kl_coef == 0.0 and make_config(name).entropy_coef == 0.0


@pytest.mark.parametrize("name,overrides,match", [
    ("grpo", dict(normalization="batch"), "normalization"),
    ("grpo", dict(kl_estimator="k4"), "kl_estimator"),
    ("ppo_clip", dict(dual_clip_c=1.0), "dual_clip_c"),
    ("dapo", dict(epsilon_high=-0.1), "epsilon_high"),
    ("reinforce_tis", dict(truncation=0.0), "truncation"),
    ("decoupled_ppo", dict(correction="tis"), "correction"),
    ("dr_grpo", dict(max_tokens=0), "max_tokens"),
    ("m2po", dict(m2_threshold=0.0), "m2_threshold"),
    ("gmpo", dict(epsilon_low=-0.1), "epsilon_low"),
    ("grpo", dict(epsilon=0.2), "no field"),
])
def test_bad_configs_are_refused(name, overrides, match):
    with pytest.raises(LossConfigError, match=match):
        make_config(name, **overrides)


def test_the_safe_mean_of_an_all_masked_batch_is_zero_with_a_zero_gradient():
    d = make_batch(2)
    cfg = make_config("grpo")
    out = call("grpo", cfg, d, jit=False)
    np.testing.assert_allclose(float(out.mean()), float(out.loss_sum / out.denominator),
                               rtol=1e-6)
    d["mask"][:] = 0.0

    def mean(logprobs):
        return call("grpo", cfg, {**d, "lp": logprobs}, jit=False).mean()

    lp = jnp.asarray(d["lp"], jnp.float32)
    empty = call("grpo", cfg, d, jit=False)
    assert math.isnan(float(empty.loss_sum / empty.denominator))  # the plain quotient: 0 / 0
    value, grad = jax.value_and_grad(mean)(lp)
    assert float(value) == 0.0 and not np.any(np.asarray(grad))
    assert float(core.safe_mean(jnp.zeros(()), jnp.zeros(()))) == 0.0


def test_kl_value_clamp_bounds_the_estimate_and_its_gradient():
    rho = jnp.array([[15.0, 0.5, -15.0]])
    logprobs = jnp.zeros_like(rho)
    plain = regularizers.kl_penalty(logprobs, rho, "k3")
    np.testing.assert_allclose(float(plain[0, 0]), math.expm1(15.0) - 15.0, rtol=1e-6)  # 3.3e6
    clamped = regularizers.kl_penalty(logprobs, rho, "k3", value_clamp=10.0)
    # k3 at ρ = −15 is e^−15 + 14 ≈ 14: clamped too.
    np.testing.assert_allclose(np.asarray(clamped[0]), [10.0, math.expm1(0.5) - 0.5, 10.0],
                               rtol=1e-6)
    grad = jax.grad(lambda lp: regularizers.kl_penalty(lp, rho, "k3", value_clamp=10.0).sum())(
        logprobs)
    assert float(grad[0, 0]) == 0.0 and float(grad[0, 1]) != 0.0 and float(grad[0, 2]) == 0.0
    k1 = regularizers.kl_penalty(logprobs, rho, "k1", value_clamp=10.0)
    np.testing.assert_allclose(np.asarray(k1[0]), [-10.0, -0.5, 10.0])
    with pytest.raises(LossConfigError, match="kl_value_clamp"):
        make_config("grpo", kl_value_clamp=0.0)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_a_loss_refuses_the_configuration_of_another(name):
    d = make_batch(3)
    for other in ALL_LOSSES:
        if losses.config_class(other) is losses.config_class(name):
            continue
        with pytest.raises(LossConfigError, match=f"{name} got a"):
            call(name, make_config(other), d, jit=False)
    with pytest.raises(LossConfigError, match="base of every loss"):
        call(name, configs.PolicyLossConfig(), d, jit=False)

    class Mine(losses.config_class(name)):  # a user's subclass stays the same loss's
        pass

    mine = call(name, Mine(), d, jit=False)
    ours = call(name, make_config(name), d, jit=False)
    assert float(mine.loss_sum) == float(ours.loss_sum)


def test_missing_inputs_are_refused():
    d = make_batch(0)
    args = (d["lp"], d["blp"], d["adv"], d["mask"])
    with pytest.raises(LossConfigError, match="ref_logprobs"):
        get("grpo")(*args, config=make_config("grpo", kl_coef=0.1))
    with pytest.raises(LossConfigError, match="entropy"):
        get("dapo")(*args, config=make_config("dapo", entropy_coef=0.1))
    with pytest.raises(LossConfigError, match="proximal_logprobs"):
        get("ppo_clip")(*args, config=make_config("ppo_clip", correction="tis"))
    with pytest.raises(LossConfigError, match="proximal_logprobs"):
        get("decoupled_ppo")(*args)
    with pytest.raises(LossConfigError, match="advantages"):
        get("grpo")(d["lp"], d["blp"], d["adv"][:3], d["mask"])
    with pytest.raises(LossConfigError, match="gspo got a GRPOConfig"):
        get("gspo")(*args, config=make_config("grpo"))


def test_gmpo_clips_each_token_on_the_pessimistic_side():
    """log r = (0.6, −0.6): with A > 0 only the high side clips (0.4, −0.6), ℓ = −A·e^−0.1; with
    A < 0 only the low side (0.6, −0.4), ℓ = −A·e^0.1; the clipped token has no gradient."""
    lp = jnp.array([[-1.0, -1.0]])
    blp = lp - jnp.array([[0.6, -0.6]])
    mask = jnp.ones((1, 2))
    for adv, mean_log_ratio, clipped in ((2.0, -0.1, 0), (-2.0, 0.1, 1)):
        def loss(logprobs):
            return get("gmpo")(logprobs, blp, jnp.array([adv]), mask).mean()
        value, grad = jax.value_and_grad(loss)(lp)
        np.testing.assert_allclose(float(value), -adv * math.exp(mean_log_ratio), rtol=1e-6)
        assert float(grad[0, clipped]) == 0.0
        np.testing.assert_allclose(float(grad[0, 1 - clipped]),
                                   -adv * math.exp(mean_log_ratio) / 2, rtol=1e-6)


def test_finalize_metrics_formulas():
    m = {"tokens": 4.0, "sequences": 2.0, "clipped_tokens": 1.0, "ratio_sum": 6.0,
         "ratio_sq_sum": 12.0, "ratio_max": 3.0, "kl_sum": 0.4, "loss": 1.5}
    out = finalize_metrics(m)
    assert out["clipped_fraction"] == pytest.approx(0.25)
    assert out["ratio_mean"] == pytest.approx(1.5)
    assert out["ratio_ess"] == pytest.approx(36.0 / 48.0)
    assert out["kl_mean"] == pytest.approx(0.1)
    assert out["ratio_max"] == 3.0 and out["loss"] == 1.5 and out["sequences"] == 2.0
    assert "ratio_sq_sum" not in out and "ratio_sq_mean" not in out


# ----------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------


ESTIMATORS = {"grpo": grpo_advantages, "rloo": rloo_advantages, "dr_grpo": dr_grpo_advantages}


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_advantages_match_numpy_reference(kind):
    rng = np.random.default_rng(5)
    # groups 0, 2, 3, 6 used (sizes 3, 2, 5, 4); 1, 4, 5, 7 empty; -1 marks padding samples.
    ids = np.array([0, 0, 0, 2, 2, 3, 3, 3, 3, 3, 6, 6, 6, 6, -1, -1])
    ids = ids[rng.permutation(len(ids))]
    rewards = rng.normal(size=len(ids))
    rewards[ids == 6] = 1.0  # all-equal group: advantage 0, not NaN
    fn = advantages.get_advantage_estimator(kind)
    assert fn is ESTIMATORS[kind]
    expected = ref_advantages(kind, rewards, ids)
    eager = fn(rewards.astype(np.float32), ids, num_groups=8)
    jitted = jax.jit(fn, static_argnames="num_groups")(rewards.astype(np.float32), ids,
                                                        num_groups=8)
    np.testing.assert_allclose(eager, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(eager)[ids == 6] == 0.0) and np.all(np.asarray(eager)[ids < 0] == 0)
    # [G, n] rewards: rows are groups.
    grid = rng.normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(fn(grid), ref_advantages(kind, grid.reshape(-1).astype(np.float64),
                                                        np.repeat(np.arange(3), 4)).reshape(3, 4),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_singleton_groups_are_an_error(kind):
    fn = ESTIMATORS[kind]
    with pytest.raises(GroupSizeError, match="single sample"):
        fn(np.array([1.0, 0.0, 1.0]), np.array([0, 0, 1]))
    with pytest.raises(GroupSizeError, match="group size 1"):
        fn(np.ones((4, 1)))
    with pytest.raises(GroupSizeError, match="out of range"):
        fn(np.array([1.0, 0.0]), np.array([3, 3]), num_groups=2)
    # Traced ids can't be checked at trace time: singleton members get 0; check on the host.
    traced = jax.jit(lambda r, i: fn(r, i, num_groups=2))(jnp.array([1.0, 0.0, 1.0]),
                                                         jnp.array([0, 0, 1]))
    assert float(traced[2]) == 0.0 and _all_finite(traced)
    with pytest.raises(GroupSizeError):
        check_groups(np.array([0, 0, 1]))
    with pytest.raises(LossConfigError, match="num_groups"):
        jax.jit(fn)(jnp.ones(4), jnp.array([0, 0, 1, 1]))
    np.testing.assert_array_equal(check_groups(np.array([2, 2, 0, 0, -1]), 4), [2, 0, 2, 0])
