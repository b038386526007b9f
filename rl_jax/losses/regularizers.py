"""Terms usable with every policy loss: KL to a reference policy, entropy bonus, and importance
corrections for the mismatch between the trainer's and the generator's probabilities.

All functions are per token (``[B, T]`` in, ``[B, T]`` out) and use natural logarithms (nats).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses.configs import (CORRECTION_LEVELS, LOG_RATIO_CLAMP, LossConfigError,
                                   PolicyLossConfig)
from rl_jax.losses.core import (TokenInputs, clamped_log_ratio, masked_sum, per_sequence_sum,
                                ratio_metrics, safe_divide)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3", *,
               valid: jax.Array | None = None, clamp: float = LOG_RATIO_CLAMP,
               value_clamp: float | None = None) -> jax.Array:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` from tokens sampled by (approximately) ``π_θ``.

    With ``ρ = log π_ref(y_t) − log π_θ(y_t)``, clamped to ``[−clamp, clamp]``:
      ``k1 = −ρ``              unbiased, can be negative, high variance;
      ``k2 = ρ² / 2``          biased, non-negative, low variance;
      ``k3 = exp(ρ) − 1 − ρ``  unbiased, non-negative, low variance (used by GRPO).
    J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html;
    k3 as the GRPO penalty: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.

    Args:
      logprobs: ``[B, T]`` log π_θ of the sampled tokens (differentiable).
      ref_logprobs: ``[B, T]`` log π_ref of the same tokens.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      valid: optional ``[B, T]`` bool; the estimate is 0 (with zero gradient) elsewhere.
      clamp: bound on ``|ρ|``, so that ``exp(ρ)`` stays finite.
      value_clamp: optional bound on the estimate itself, ``[−value_clamp, value_clamp]`` (with
        ``|ρ| ≤ 20``, k3 alone can reach 4.9e8; verl and AReaL clamp it at ±10). Tokens beyond
        it get no gradient from the penalty.

    Returns:
      ``[B, T]`` float32, nats per token.
    """
    if valid is None:
        valid = jnp.ones(jnp.shape(logprobs), bool)
    rho = clamped_log_ratio(ref_logprobs, logprobs, valid, clamp)
    if estimator == "k1":
        kl = -rho
    elif estimator == "k2":
        kl = 0.5 * jnp.square(rho)
    elif estimator == "k3":
        kl = jnp.expm1(rho) - rho
    else:
        raise LossConfigError(
            f"kl estimator must be one of ('k1', 'k2', 'k3'), got {estimator!r}")
    if value_clamp is not None:
        if not value_clamp > 0:
            raise LossConfigError(f"kl value_clamp must be positive, got {value_clamp}")
        kl = jnp.clip(kl, -value_clamp, value_clamp)
    return kl


def importance_weights(target_logprobs: jax.Array, source_logprobs: jax.Array, *,
                       mode: str = "tis", cap: float | None = 5.0, level: str = "token",
                       valid: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       clamp: float = LOG_RATIO_CLAMP) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stop-gradient importance weights ``w = π_target / π_source``, capped, per token ``[B, T]``.

    Levels: ``"token"`` uses each token's ratio ``ρ_t``; ``"sequence"`` gives every token of a
    sequence the product ``Π_t ρ_t``; ``"geometric"`` the geometric mean ``(Π_t ρ_t)^(1/n)``
    (log-ratios summed or averaged over the sequence's masked tokens, then clamped).

    ``mode="tis"`` (truncated importance sampling): ``min(w, cap)``.
    F. Yao, L. Liu, D. Zhang, C. Dong, J. Shang, J. Gao, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training" (2025), https://fengyao.notion.site/off-policy-rl.

    ``mode="mis"`` (masked importance sampling): ``w · [w ≤ cap]``: tokens (or whole sequences)
    above the cap are dropped from the policy term; they still count in the denominator.
    J. Liu, Y. Li, Y. Fu, J. Wang, Q. Liu, Y. Shen, "When Speed Kills Stability: Demystifying RL
    Collapse from the Training-Inference Mismatch" (2025), https://richardli.xyz/rl-collapse.
    The same token masking caps the behaviour weight in AReaL (Fu et al. 2025, arXiv:2505.24298).

    ``cap=None`` leaves the weights uncapped.

    Args:
      target_logprobs: ``[B, T]`` log-probabilities under the policy being corrected to
        (the trainer's proximal policy for a mismatch correction).
      source_logprobs: ``[B, T]`` log-probabilities under the sampling policy (the generator).
      mode: ``"tis"`` or ``"mis"``.
      cap: ``C > 0`` or ``None``.
      level: ``"token"``, ``"sequence"`` or ``"geometric"``.
      valid: optional ``[B, T]`` bool of the tokens that count; weights are 1 elsewhere.
      segment_ids: optional ``[B, T]`` packed-sequence ids (see ``rl_jax.losses.core``).
      clamp: bound on the (token or sequence) log-ratio before ``exp``.

    Returns:
      ``(weights, capped, ratio)``: the capped weights, a bool ``[B, T]`` marking the valid tokens
      whose weight was changed by the cap, and the uncapped ratio (all stop-gradient).
    """
    if mode not in ("tis", "mis"):
        raise LossConfigError(f"importance weight mode must be 'tis' or 'mis', got {mode!r}")
    if level not in CORRECTION_LEVELS:
        raise LossConfigError(f"importance weight level must be one of {CORRECTION_LEVELS}, "
                              f"got {level!r}")
    if valid is None:
        valid = jnp.ones(jnp.shape(target_logprobs), bool)
    log_ratio = clamped_log_ratio(target_logprobs, source_logprobs, valid, clamp)
    if level != "token":
        log_ratio = per_sequence_sum(log_ratio, segment_ids)
        if level == "geometric":
            log_ratio = safe_divide(log_ratio,
                                    per_sequence_sum(valid.astype(jnp.float32), segment_ids))
        log_ratio = jnp.where(valid, jnp.clip(log_ratio, -clamp, clamp), 0.0)
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    if cap is None:
        return ratio, jnp.zeros(ratio.shape, bool), ratio
    capped = valid & (ratio > cap)
    weights = jnp.minimum(ratio, cap) if mode == "tis" else jnp.where(capped, 0.0, ratio)
    return weights, capped, ratio


def mismatch_correction(pg_loss: jax.Array, x: TokenInputs,
                        config: PolicyLossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Multiplies the policy term by the ``config.correction`` weight ``π_prox / μ``.

    Returns the corrected ``[B, T]`` policy term and the ``behaviour_ratio_*`` /
    ``behaviour_capped_tokens`` metrics (none when ``correction == "none"``).
    """
    if config.correction == "none":
        return pg_loss, {}
    if x.proximal_logprobs is None:
        raise LossConfigError(
            f"correction={config.correction!r} weights tokens by π_prox/μ and needs "
            "proximal_logprobs (the trainer's log-probabilities of the sampling policy)")
    weights, capped, ratio = importance_weights(
        x.proximal_logprobs, x.behaviour_logprobs, mode=config.correction,
        cap=config.correction_cap, level=config.correction_level, valid=x.valid,
        segment_ids=x.segment_ids, clamp=config.log_ratio_clamp)
    metrics = ratio_metrics("behaviour_ratio", ratio, x)
    metrics["behaviour_capped_tokens"] = masked_sum(capped.astype(jnp.float32), x.mask)
    return pg_loss * weights, metrics


def add_regularizers(pg_loss: jax.Array, x: TokenInputs,
                     config: PolicyLossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``ℓ = pg + β · KL(π_θ ‖ π_ref) − α · H`` per token, with ``kl_sum``/``entropy_sum`` metrics.

    The KL (``config.kl_estimator``) is reported whenever ``ref_logprobs`` is given and added when
    ``kl_coef > 0``; the entropy (nats, e.g. from ``Transformer.token_stats``) likewise with
    ``entropy_coef``. Neither term is importance weighted.
    """
    total = pg_loss
    metrics: dict[str, jax.Array] = {}
    if x.ref_logprobs is not None:
        kl = kl_penalty(x.logprobs, x.ref_logprobs, config.kl_estimator, valid=x.valid,
                        clamp=config.log_ratio_clamp, value_clamp=config.kl_value_clamp)
        metrics["kl_sum"] = masked_sum(jax.lax.stop_gradient(kl), x.mask)
        if config.kl_coef:
            total = total + config.kl_coef * kl
    elif config.kl_coef:
        raise LossConfigError(f"kl_coef={config.kl_coef} needs ref_logprobs")
    if x.entropy is not None:
        metrics["entropy_sum"] = masked_sum(jax.lax.stop_gradient(x.entropy), x.mask)
        if config.entropy_coef:
            total = total - config.entropy_coef * x.entropy
    elif config.entropy_coef:
        raise LossConfigError(f"entropy_coef={config.entropy_coef} needs entropy")
    return total, metrics
