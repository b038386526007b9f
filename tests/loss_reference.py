"""Plain-NumPy (float64) references for rl_jax.losses, written one sequence at a time from the
papers' formulas, and the comparisons used by the loss tests.

Inputs are dicts of ``[B, T]`` arrays: ``lp`` (log π_θ), ``blp`` (behaviour μ), ``prox``
(π_prox), ``ref`` (π_ref), ``ent`` (entropy), ``adv`` (``[B]`` or ``[B, T]``), ``mask`` and
``seg`` (packed segment ids or ``None``).

Float32 rounding and sums. Reordering a float32 sum (micro-batches, shards) changes it by a few
ulps *of the summands*, not of the result. When the summands cancel (zero-mean GRPO advantages)
the result is small and its own relative error can exceed 1e-6 without any bug, so values and
signed metric sums are compared relative to ``Σ|summand|`` (returned by :func:`ref_loss` as
``scales``); for sums of non-negative terms (counts, ratios, k3 KL, entropy) that is the plain
relative error.
"""

import numpy as np

CLAMP = 20.0
PPO_FAMILY = ("ppo_clip", "grpo", "dapo", "dr_grpo")


def needs_prox(name, cfg) -> bool:
    """Whether the loss reads proximal log-probs under ``cfg`` (the tests pass them only then)."""
    return name == "decoupled_ppo" or cfg.correction != "none"


def ref_sequences(mask, seg):
    """[(row, token indices)] of every sequence with at least one loss token."""
    out = []
    for b in range(mask.shape[0]):
        ids = np.ones(mask.shape[1], int) if seg is None else seg[b]
        for sid in sorted(set(ids.tolist()) - {0}):
            ts = np.flatnonzero((ids == sid) & (mask[b] > 0))
            if ts.size:
                out.append((b, ts))
    return out


def cap_weights(w, mode, cap):
    if cap is None:
        return w
    return np.minimum(w, cap) if mode == "tis" else np.where(w > cap, 0.0, w)


def ref_m2po_keep(log_ratio, mask, threshold):
    """M2PO's mask, by its definition: drop the largest ``(log r)²`` one token at a time (ties in
    row-major order) until the mask-weighted mean of the rest is ``≤ threshold``."""
    idx = [tuple(i) for i in np.argwhere(mask > 0)]
    m2 = {i: log_ratio[i] ** 2 for i in idx}
    keep = set(idx)
    for i in sorted(idx, key=lambda i: -m2[i]):  # sorted() is stable: ties in row-major order
        w = sum(mask[j] for j in keep)
        if w <= 0 or sum(mask[j] * m2[j] for j in keep) <= threshold * w:
            break
        keep.discard(i)
    out = np.zeros(mask.shape, bool)
    for i in keep:
        out[i] = True
    return out


def ref_loss(name, cfg, d, lp=None, weight_lp=None):
    """``(loss, metrics, scales)`` of loss ``name`` under ``cfg``.

    ``weight_lp`` feeds the stop-gradient weights of the REINFORCE-style losses (finite
    differences keep them at the unperturbed log-probs). ``metrics`` are finalized (means,
    fractions, ESS); ``scales`` hold ``Σ|summand|`` of the loss (already divided by the
    denominator), of ``advantage_sum`` and of ``kl_sum``.
    """
    lp = d["lp"] if lp is None else lp
    weight_lp = lp if weight_lp is None else weight_lp
    old = d["prox"] if needs_prox(name, cfg) else d["blp"]
    seqs = ref_sequences(d["mask"], d["seg"])
    if name == "m2po":
        m2_keep = ref_m2po_keep(np.where(d["mask"] > 0, np.clip(
            weight_lp - old, -CLAMP, CLAMP), 0.0), d["mask"], cfg.m2_threshold)
    num = abs_num = tokens = 0.0
    stats = dict(clipped=0.0, dual=0.0, ratio=0.0, ratio_sq=0.0, ratio_max=0.0, kl=0.0, ent=0.0,
                 behaviour_kl=0.0, beh=0.0, beh_sq=0.0, capped=0.0, adv_abs=0.0, kl_abs=0.0, m2=0.0)
    for b, ts in seqs:
        m = d["mask"][b, ts]
        a = d["adv"][b] * np.ones(len(ts)) if d["adv"].ndim == 1 else d["adv"][b, ts]
        r = np.exp(np.clip(lp[b, ts] - old[b, ts], -CLAMP, CLAMP))
        wr = np.exp(np.clip(weight_lp[b, ts] - old[b, ts], -CLAMP, CLAMP))
        if name == "reinforce_tis":
            pg = -np.minimum(wr, cfg.truncation) * a * lp[b, ts]
            clipped = wr > cfg.truncation
        elif name == "cispo":
            lo = 0.0 if cfg.epsilon_low is None else 1 - cfg.epsilon_low
            hi = 1 + cfg.epsilon_high
            pg = -np.clip(wr, lo, hi) * a * lp[b, ts]
            clipped = (wr > hi) | (wr < lo)
        elif name == "m2po":
            keep = m2_keep[b, ts]
            pg = np.where(keep, -r * a, 0.0)
            clipped = ~keep
            stats["m2"] += np.sum(m * np.clip(weight_lp[b, ts] - old[b, ts], -CLAMP, CLAMP) ** 2)
        elif name == "gspo":
            s = np.exp(np.sum(m * np.clip(lp[b, ts] - old[b, ts], -CLAMP, CLAMP)) / m.sum())
            a_seq = np.sum(m * a) / m.sum()
            lo, hi = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
            pg = np.full(len(ts), max(-a_seq * s, -a_seq * min(max(s, lo), hi)))
            clipped = np.full(len(ts), (a_seq > 0 and s > hi) or (a_seq < 0 and s < lo))
            r = np.full(len(ts), s)
        elif name == "gmpo":
            # J_i = sgn(A) · (Π_t |min(r_t A, clip(r_t, e^−ε_low, e^ε_high) A)|)^(1/|o_i|)
            a_seq = np.sum(m * a) / m.sum()
            tr = np.exp(np.clip(lp[b, ts] - old[b, ts], -CLAMP, CLAMP))
            lo, hi = np.exp(-cfg.epsilon_low), np.exp(cfg.epsilon_high)
            term = np.abs(np.minimum(tr * a_seq, np.clip(tr, lo, hi) * a_seq))
            g = np.exp(np.sum(m * np.log(term)) / m.sum()) if a_seq != 0 else 0.0
            pg = np.full(len(ts), -np.sign(a_seq) * g)
            clipped = ((a_seq > 0) & (tr > hi)) | ((a_seq < 0) & (tr < lo))
            r = np.full(len(ts), g / abs(a_seq) if a_seq != 0 else 1.0)
        else:
            lo, hi = 1 - cfg.epsilon_low, 1 + cfg.epsilon_high
            pg = np.maximum(-a * r, -a * np.clip(r, lo, hi))
            clipped = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
            if cfg.dual_clip:
                stats["dual"] += np.sum(m * ((a < 0) & (pg > -cfg.dual_clip_c * a)))
                pg = np.where(a < 0, np.minimum(pg, -cfg.dual_clip_c * a), pg)
        beh = None
        if name == "decoupled_ppo":
            beh = np.exp(np.clip(d["prox"][b, ts] - d["blp"][b, ts], -CLAMP, CLAMP))
            pg = pg * cap_weights(beh, cfg.behaviour_weight_mode, cfg.behaviour_weight_cap)
            cap = cfg.behaviour_weight_cap
        elif cfg.correction != "none":
            log_w = np.clip(d["prox"][b, ts] - d["blp"][b, ts], -CLAMP, CLAMP)
            if cfg.correction_level == "sequence":
                log_w = np.full(len(ts), np.clip(log_w.sum(), -CLAMP, CLAMP))
            elif cfg.correction_level == "geometric":
                log_w = np.full(len(ts), np.clip(log_w.mean(), -CLAMP, CLAMP))
            beh = np.exp(log_w)
            pg = pg * cap_weights(beh, cfg.correction, cfg.correction_cap)
            cap = cfg.correction_cap
        rho = np.clip(d["ref"][b, ts] - lp[b, ts], -CLAMP, CLAMP)
        kl = {"k1": -rho, "k2": 0.5 * rho ** 2, "k3": np.exp(rho) - 1 - rho}[cfg.kl_estimator]
        if cfg.kl_value_clamp is not None:
            kl = np.clip(kl, -cfg.kl_value_clamp, cfg.kl_value_clamp)
        h = d["ent"][b, ts]
        per_token = pg + cfg.kl_coef * kl - cfg.entropy_coef * h
        norm = m.sum() if cfg.normalization == "sequence" else 1.0
        num += np.sum(m * per_token) / norm
        abs_num += (np.sum(np.abs(m * pg)) + np.sum(np.abs(m * cfg.kl_coef * kl))
                    + np.sum(np.abs(m * cfg.entropy_coef * h))) / norm
        tokens += m.sum()
        stats["clipped"] += np.sum(m * clipped)
        stats["ratio"] += np.sum(m * r)
        stats["ratio_sq"] += np.sum(m * r * r)
        stats["ratio_max"] = max(stats["ratio_max"], r.max())
        stats["kl"] += np.sum(m * kl)
        mu = np.clip(lp[b, ts] - d["blp"][b, ts], -20.0, 20.0)  # train-inference mismatch
        stats["behaviour_kl"] += np.sum(m * (np.exp(mu) - 1 - mu))
        stats["kl_abs"] += np.sum(m * np.abs(kl))
        stats["adv_abs"] += np.sum(m * np.abs(a))
        stats["ent"] += np.sum(m * h)
        if beh is not None:
            stats["beh"] += np.sum(m * beh)
            stats["beh_sq"] += np.sum(m * beh * beh)
            stats["capped"] += np.sum(m * (beh > cap))
    n = len(seqs)
    den = {"token": tokens, "sequence": n, "sequence_sum": n,
           "constant": n * (cfg.max_tokens or d["mask"].shape[1])}[cfg.normalization]
    value = num / den if den else 0.0

    def mean(x):
        return x / tokens if tokens else 0.0

    metrics = dict(tokens=tokens, sequences=n, clipped_fraction=mean(stats["clipped"]),
                   ratio_mean=mean(stats["ratio"]), ratio_max=stats["ratio_max"],
                   ratio_ess=stats["ratio"] ** 2 / (tokens * stats["ratio_sq"]) if tokens else 0,
                   kl_mean=mean(stats["kl"]), entropy_mean=mean(stats["ent"]),
                   behaviour_kl_mean=mean(stats["behaviour_kl"]))
    if name == "m2po":
        metrics["m2_mean"] = mean(stats["m2"])
    if name in PPO_FAMILY + ("decoupled_ppo",) and cfg.dual_clip:
        metrics["dual_clipped_fraction"] = mean(stats["dual"])
    if needs_prox(name, cfg):
        metrics.update(behaviour_ratio_mean=mean(stats["beh"]),
                       behaviour_ratio_ess=stats["beh"] ** 2 / (tokens * stats["beh_sq"]),
                       behaviour_capped_fraction=mean(stats["capped"]))
    scales = dict(loss=abs_num / den if den else 0.0, advantage_sum=stats["adv_abs"],
                  kl_sum=stats["kl_abs"])
    return value, metrics, scales


def finite_difference_grad(name, cfg, d, h=1e-6):
    """Central differences of :func:`ref_loss` w.r.t. every loss token's log-prob."""
    lp = np.array(d["lp"], np.float64)
    grad = np.zeros_like(lp)
    for b, t in zip(*np.nonzero(d["mask"] > 0)):
        up, down = lp.copy(), lp.copy()
        up[b, t] += h
        down[b, t] -= h
        grad[b, t] = (ref_loss(name, cfg, d, up, lp)[0]
                      - ref_loss(name, cfg, d, down, lp)[0]) / (2 * h)
    return grad


def ref_advantages(kind, rewards, ids):
    """GRPO / Dr. GRPO / RLOO advantages, one group at a time; id -1 is padding (0)."""
    out = np.zeros(len(rewards))
    for g in set(ids.tolist()) - {-1}:
        idx = np.flatnonzero(ids == g)
        r = rewards[idx]
        if kind == "grpo":
            out[idx] = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
        elif kind == "dr_grpo":
            out[idx] = r - r.mean()
        else:
            out[idx] = [r[i] - np.delete(r, i).mean() for i in range(len(r))]
    return out


# ----------------------------------------------------------------------------------------------
# Comparisons for reductions of one computation in two orders (micro-batches, shards)
# ----------------------------------------------------------------------------------------------


def assert_same_value(actual, desired, scale, rtol=1e-6):
    """``|actual − desired| ≤ rtol · max(|desired|, scale)`` with ``scale = Σ|summand|``."""
    actual, desired = float(actual), float(desired)
    bound = rtol * max(abs(desired), scale)
    assert abs(actual - desired) <= bound, f"{actual} vs {desired}: > {rtol} x {scale:.4g}"


def assert_same_gradient(actual, desired, rtol=1e-6):
    """``max|actual − desired| ≤ rtol · max|desired|``: the relative error of the gradient as a
    vector (a token's gradient can be the difference of nearly equal policy and KL terms), and
    the same exact zeros (masked and clipped tokens)."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    scale = np.max(np.abs(desired))
    error = np.max(np.abs(actual - desired))
    assert error <= rtol * scale, f"gradient error {error:.3g} > {rtol} x {scale:.3g}"
    np.testing.assert_array_equal(actual == 0, desired == 0)


def assert_same_metrics(actual, desired, scales, rtol=1e-6):
    """Raw (reducible) metrics: relative error ≤ rtol, signed sums relative to ``scales``."""
    assert actual.keys() == desired.keys()
    for key, want in desired.items():
        if key in scales:
            assert_same_value(actual[key], want, scales[key], rtol)
        else:
            np.testing.assert_allclose(float(actual[key]), float(want), rtol=rtol, err_msg=key)
