"""Policy-gradient losses over per-token arrays.

Every loss has the same signature::

    loss(logprobs, behaviour_logprobs, advantages, loss_mask, *, config=None,
         proximal_logprobs=None, ref_logprobs=None, entropy=None, segment_ids=None)
        -> LossOutput(loss_sum, denominator, metrics)

Args (all per-token arrays are ``[B, T]``, log-probabilities in nats):
  logprobs: ``log π_θ(y_t)`` of the sampled tokens under the policy being trained; the only
    input gradients flow into (with ``entropy``).
  behaviour_logprobs: ``log μ(y_t)`` reported by the generator that sampled the tokens.
  advantages: ``[B]`` (one per sequence), ``[B, 1]`` or ``[B, T]``; treated as data.
  loss_mask: ``1`` (or a positive weight) for tokens that enter the loss, ``0`` elsewhere.
    Masked positions of every other input may hold anything, even NaN or ±inf.
  config: the loss's configuration dataclass; ``None`` uses its defaults.
  proximal_logprobs: ``log π_prox(y_t)``, the trainer's own log-probabilities of the sampled
    tokens under the weights the generator used (or any recent policy), without gradient. When
    given, ratios are taken against it instead of ``μ``, and ``config.correction`` can weight
    the policy term by ``π_prox / μ``. Required by ``decoupled_ppo``.
  ref_logprobs: ``log π_ref(y_t)`` under a frozen reference policy, for the KL penalty.
  entropy: per-token entropy of ``π_θ`` in nats (differentiable), for the entropy bonus.
  segment_ids: packed rows: ``[B, T]`` int sequence ids ``1..`` per row, ``0`` for padding.

Returns ``LossOutput``: ``loss = loss_sum / denominator`` with the normalisation given by
``config.normalization`` (see :mod:`rl_jax.losses.core`), and metrics that accumulate by sum
(``_max`` keys by max) over micro-batches and shards; see :func:`finalize_metrics`.

Ratios are ``r_t = π_θ(y_t) / π_old(y_t)`` with ``π_old = π_prox`` when ``proximal_logprobs``
is given, else ``μ``, computed in float32 from a log-ratio clamped to ``±config.log_ratio_clamp``.
The per-token loss of every method is ``ℓ_t = pg_t · c_t + β · KL_t − α · H_t`` where ``c_t``
is the optional mismatch correction (see :mod:`rl_jax.losses.regularizers`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from rl_jax.losses.configs import (CISPOConfig, DAPOConfig, DecoupledPPOConfig, DrGRPOConfig,
                                   GMPOConfig, GRPOConfig, GSPOConfig, LossConfigError,
                                   M2POConfig, PolicyLossConfig, PPOClipConfig,
                                   ReinforceTISConfig)
from rl_jax.losses.core import (LossOutput, TokenInputs, clamped_log_ratio, masked_sum,
                                normalization_weights, per_sequence_sum, prepare_inputs,
                                ratio_metrics, safe_divide)
from rl_jax.losses.regularizers import add_regularizers, importance_weights, mismatch_correction

# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, epsilon_low: float,
                      epsilon_high: float, dual_clip_c: float | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's per-token loss ``max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``.

    With ``dual_clip_c = c``, tokens with ``A < 0`` are further bounded: ``min(ℓ, −c·A)``.

    Returns:
      ``(loss, clipped, dual_clipped)``: ``[B, T]`` loss, and bool masks of the tokens where the
      clipped branch (zero gradient) is active and where the dual clip is active.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = jnp.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip_c is None:
        return loss, clipped, jnp.zeros_like(clipped)
    bound = -dual_clip_c * advantages
    dual_clipped = (advantages < 0) & (loss > bound)
    return jnp.where(dual_clipped, bound, loss), clipped, dual_clipped


def second_moment_mask(log_ratio: jax.Array, weights: jax.Array, threshold: float
                       ) -> jax.Array:
    """M2PO's trust region: ``[B, T]`` bool, the tokens to keep.

    With ``m_t = (log r_t)²`` and token weights ``w_t`` (the loss mask; ``0`` excludes a token),
    the tokens with the largest ``m_t`` are dropped one at a time, largest first, until the
    weighted mean ``Σ w m / Σ w`` of those left is ``≤ threshold``: the fewest tokens whose removal
    brings the second moment of the log-ratios within the bound. Ties are dropped in index
    order. Nothing is dropped when the batch is already within the bound. The mask covers the
    tokens of this call (one batch, or one micro-batch when the trainer splits batches).
    """
    shape = log_ratio.shape
    w = jnp.where(weights > 0, weights, 0.0).reshape(-1)
    m2 = jnp.where(w > 0, jnp.square(log_ratio).reshape(-1), -1.0)
    order = jnp.argsort(-m2, stable=True)  # largest first, excluded tokens last
    sorted_w, sorted_m2 = w[order], jnp.maximum(m2[order], 0.0)
    # Before dropping the k largest: the sums over the tokens still kept.
    dropped_w = jnp.cumsum(sorted_w) - sorted_w
    dropped_wm2 = jnp.cumsum(sorted_w * sorted_m2) - sorted_w * sorted_m2
    kept_w = jnp.sum(w) - dropped_w
    kept_wm2 = jnp.sum(w * jnp.maximum(m2, 0.0)) - dropped_wm2
    within = (kept_w <= 0) | (kept_wm2 <= threshold * kept_w)
    # The first k at which the tokens still kept are within the bound (n: drop every token).
    first = jnp.min(jnp.where(within, jnp.arange(w.size), w.size))
    keep_sorted = jnp.arange(w.size) >= first
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    return keep.reshape(shape) & (weights > 0)


def _config(config, cls: type[PolicyLossConfig]):
    """``config`` (or ``cls()`` when None), checked to be the configuration of ``cls``'s loss."""
    if config is None:
        return cls()
    if not isinstance(config, PolicyLossConfig):
        raise LossConfigError(f"expected a {cls.__name__}, got {type(config).__name__}")
    if type(config).loss != cls.loss:
        made_for = (f"the configuration of {type(config).loss!r}" if type(config).loss
                    else "the base of every loss's configuration")
        raise LossConfigError(
            f"{cls.loss} got a {type(config).__name__}, {made_for}, whose defaults differ "
            f"(e.g. normalization={config.normalization!r}); build it with "
            f"rl_jax.losses.make_config({cls.loss!r}, ...)")
    return config


def _finish(x: TokenInputs, config: PolicyLossConfig, pg_loss: jax.Array, log_ratio: jax.Array,
            ratio: jax.Array, metrics: dict[str, jax.Array]) -> LossOutput:
    """Correction, regularisers, normalisation and the metrics every loss reports."""
    pg_loss, correction_metrics = mismatch_correction(pg_loss, x, config)
    total, regularizer_metrics = add_regularizers(pg_loss, x, config)
    weights, denominator = normalization_weights(x, config)
    loss_sum = jnp.sum(jnp.where(x.valid, weights * total, 0.0))
    policy_kl = jnp.expm1(log_ratio) - log_ratio  # k3 estimate of KL(π_old ‖ π_θ)
    # The train-inference mismatch, staleness included: k3 estimate of KL(μ ‖ π_θ) from the
    # sampled tokens (the same as policy_kl when the ratio is taken against μ).
    behaviour_log_ratio = jnp.clip(jax.lax.stop_gradient(x.logprobs) - x.behaviour_logprobs,
                                   -20.0, 20.0)
    behaviour_kl = jnp.expm1(behaviour_log_ratio) - behaviour_log_ratio
    metrics = {
        "tokens": jnp.sum(x.mask),
        "sequences": x.num_sequences,
        "advantage_sum": masked_sum(x.advantages, x.mask),
        "policy_kl_sum": masked_sum(policy_kl, x.mask),
        "behaviour_kl_sum": masked_sum(behaviour_kl, x.mask),
        **ratio_metrics("ratio", ratio, x),
        **metrics,
        **correction_metrics,
        **regularizer_metrics,
    }
    return LossOutput(loss_sum, denominator, jax.tree.map(jax.lax.stop_gradient, metrics))


def _count(flags: jax.Array, x: TokenInputs) -> jax.Array:
    return masked_sum(flags.astype(jnp.float32), x.mask)


def _clipped_ppo(x: TokenInputs, config: PPOClipConfig, old_logprobs: jax.Array):
    log_ratio = clamped_log_ratio(x.logprobs, old_logprobs, x.valid, config.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    pg, clipped, dual = clipped_surrogate(ratio, x.advantages, config.epsilon_low,
                                          config.epsilon_high,
                                          config.dual_clip_c if config.dual_clip else None)
    metrics = {"clipped_tokens": _count(clipped, x)}
    if config.dual_clip:
        metrics["dual_clipped_tokens"] = _count(dual, x)
    return pg, log_ratio, ratio, metrics


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


def reinforce_tis(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
                  loss_mask: ArrayLike, *, config: ReinforceTISConfig | None = None,
                  proximal_logprobs: ArrayLike | None = None,
                  ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
                  segment_ids: ArrayLike | None = None) -> LossOutput:
    """Importance-weighted REINFORCE with a truncated weight and no value network (PipelineRL).

    ``ℓ_t = −sg(min(r_t, c)) · A_t · log π_θ(y_t)``, ``r_t = π_θ(y_t) / π_old(y_t)``, so
    ``∇ℓ_t = −min(r_t, c) · A_t · ∇log π_θ(y_t)``; the weight corrects for tokens sampled by
    older policies in flight and is truncated at ``c = config.truncation`` (5).
    Normalisation ``"sequence_sum"``: token sum over the batch divided by the number of
    sequences (PipelineRL divides by its batch size in sequences).

    A. Piché, E. Kamalloo, R. Pardinas, X. Chen, D. Bahdanau, "PipelineRL: Faster On-policy
    Reinforcement Learning for Long Sequence Generation" (2025), arXiv:2509.19128; truncated
    importance weights after Espeholt et al. 2018, IMPALA, arXiv:1802.01561.

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` counts
    the truncated weights.
    """
    config = _config(config, ReinforceTISConfig)
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    log_ratio = clamped_log_ratio(x.logprobs, x.old_logprobs, x.valid, config.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, config.truncation))
    pg = -weight * x.advantages * x.logprobs
    metrics = {"clipped_tokens": _count(ratio > config.truncation, x)}
    return _finish(x, config, pg, log_ratio, ratio, metrics)


def ppo_clip(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
             loss_mask: ArrayLike, *, config: PPOClipConfig | None = None,
             proximal_logprobs: ArrayLike | None = None,
             ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
             segment_ids: ArrayLike | None = None) -> LossOutput:
    """PPO's clipped surrogate objective, token-level mean.

    ``ℓ_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − ε_low, 1 + ε_high))`` with ``ε = 0.2``, and
    with ``dual_clip`` ``ℓ_t = min(ℓ_t, −c · A_t)`` for ``A_t < 0``.

    J. Schulman, F. Wolski, P. Dhariwal, A. Radford, O. Klimov, "Proximal Policy Optimization
    Algorithms" (2017), arXiv:1707.06347. Dual clip: D. Ye et al. 2020, arXiv:1912.09729.

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` (tokens
    on the clipped, zero-gradient branch), ``dual_clipped_tokens`` with ``dual_clip``.
    """
    config = _config(config, PPOClipConfig)
    return _clipped_surrogate_loss(logprobs, behaviour_logprobs, advantages, loss_mask, config,
                                   proximal_logprobs, ref_logprobs, entropy, segment_ids)


def _clipped_surrogate_loss(logprobs, behaviour_logprobs, advantages, loss_mask, config,
                            proximal_logprobs, ref_logprobs, entropy, segment_ids) -> LossOutput:
    """The clipped surrogate of ``ppo_clip`` and its variants, ``config`` already checked."""
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    pg, log_ratio, ratio, metrics = _clipped_ppo(x, config, x.old_logprobs)
    return _finish(x, config, pg, log_ratio, ratio, metrics)


def grpo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
         loss_mask: ArrayLike, *, config: GRPOConfig | None = None,
         proximal_logprobs: ArrayLike | None = None,
         ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
         segment_ids: ArrayLike | None = None) -> LossOutput:
    """Group Relative Policy Optimization: PPO's clipped surrogate, sequence-level mean.

    ``J = (1/G) Σ_i (1/|o_i|) Σ_t [min(r A, clip(r, 1 − ε, 1 + ε) A) − β · KL_k3]``, ``ε = 0.2``;
    the loss is ``−J`` with normalisation ``"sequence"`` (per-sequence token mean, then the mean
    over the non-empty sequences of the global batch). Advantages come from
    :func:`rl_jax.losses.advantages.grpo_advantages`.

    Z. Shao, P. Wang, Q. Zhu, R. Xu, J. Song, et al., "DeepSeekMath: Pushing the Limits of
    Mathematical Reasoning in Open Language Models" (2024), arXiv:2402.03300.

    Arguments and return value: see the module docstring (config: :class:`GRPOConfig` by
    default; another loss's configuration is refused).
    """
    config = _config(config, GRPOConfig)
    return _clipped_surrogate_loss(logprobs, behaviour_logprobs, advantages, loss_mask, config,
                                   proximal_logprobs, ref_logprobs, entropy, segment_ids)


def dapo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
         loss_mask: ArrayLike, *, config: DAPOConfig | None = None,
         proximal_logprobs: ArrayLike | None = None,
         ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
         segment_ids: ArrayLike | None = None) -> LossOutput:
    """DAPO: clipped surrogate with decoupled ranges ("clip-higher"), token-level mean.

    ``ℓ_t = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``, ``ε_low = 0.2``, ``ε_high = 0.28``;
    ``loss = Σ_i Σ_t ℓ / Σ_i |o_i|`` over the global batch (normalisation ``"token"``). DAPO's
    dynamic sampling and overlong reward shaping act on the data, not on this loss.

    Q. Yu, Z. Zhang, R. Zhu, Y. Yuan, X. Zuo, et al., "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale" (2025), arXiv:2503.14476.

    Arguments and return value: see the module docstring (config: :class:`DAPOConfig` by
    default; another loss's configuration is refused).
    """
    config = _config(config, DAPOConfig)
    return _clipped_surrogate_loss(logprobs, behaviour_logprobs, advantages, loss_mask, config,
                                   proximal_logprobs, ref_logprobs, entropy, segment_ids)


def dr_grpo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
            loss_mask: ArrayLike, *, config: DrGRPOConfig | None = None,
            proximal_logprobs: ArrayLike | None = None,
            ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
            segment_ids: ArrayLike | None = None) -> LossOutput:
    """Dr. GRPO ("GRPO done right"): GRPO without its length and difficulty biases.

    ``loss = (1/G) Σ_i Σ_t max(−A·r, −A·clip(r, 1 − ε, 1 + ε)) / L``: no ``1/|o_i|`` (normalisation
    ``"constant"``, ``L = config.max_tokens``, the generation budget, or ``T`` when unset), and
    advantages ``A_i = R_i − mean(R_group)`` without division by the group's std: use
    :func:`rl_jax.losses.advantages.dr_grpo_advantages`.

    Z. Liu, C. Chen, W. Li, P. Qi, T. Pang, C. Du, W. S. Lee, M. Lin, "Understanding R1-Zero-Like
    Training: A Critical Perspective" (2025), arXiv:2503.20783.

    Arguments and return value: see the module docstring (config: :class:`DrGRPOConfig` by
    default; another loss's configuration is refused).
    """
    config = _config(config, DrGRPOConfig)
    return _clipped_surrogate_loss(logprobs, behaviour_logprobs, advantages, loss_mask, config,
                                   proximal_logprobs, ref_logprobs, entropy, segment_ids)


def gspo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
         loss_mask: ArrayLike, *, config: GSPOConfig | None = None,
         proximal_logprobs: ArrayLike | None = None,
         ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
         segment_ids: ArrayLike | None = None) -> LossOutput:
    """Group Sequence Policy Optimization: one importance ratio and one clip per sequence.

    ``s_i = exp((1/|y_i|) Σ_t log(π_θ(y_t) / π_old(y_t)))`` (geometric mean of the token ratios),
    ``ℓ_i = max(−A_i · s_i, −A_i · clip(s_i, 1 − ε_low, 1 + ε_high))`` with ``ε_low = 3e-4``,
    ``ε_high = 4e-4``, and ``loss = (1/G) Σ_i ℓ_i`` (normalisation ``"sequence"``). ``A_i`` is
    the sequence's advantage (the token mean of ``advantages`` over the sequence). Every token
    carries its sequence's ``ℓ_i``, so the other normalisations weight sequences by length.

    C. Zheng, S. Liu, M. Li, X.-H. Chen, B. Yu, et al., "Group Sequence Policy Optimization"
    (2025), arXiv:2507.18071.

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` counts
    the tokens of clipped sequences; ``ratio_*`` describe ``s_i`` per token.
    """
    config = _config(config, GSPOConfig)
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    log_ratio = clamped_log_ratio(x.logprobs, x.old_logprobs, x.valid, config.log_ratio_clamp)
    seq_log_ratio = safe_divide(per_sequence_sum(log_ratio * x.mask, x.segment_ids),
                                x.sequence_tokens)
    seq_ratio = jnp.exp(jnp.where(x.valid, seq_log_ratio, 0.0))
    seq_advantage = safe_divide(per_sequence_sum(x.advantages * x.mask, x.segment_ids),
                                x.sequence_tokens)
    pg, clipped, _ = clipped_surrogate(seq_ratio, seq_advantage, config.epsilon_low,
                                       config.epsilon_high)
    metrics = {"clipped_tokens": _count(clipped, x)}
    return _finish(x, config, pg, log_ratio, seq_ratio, metrics)


def gmpo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
         loss_mask: ArrayLike, *, config: GMPOConfig | None = None,
         proximal_logprobs: ArrayLike | None = None,
         ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
         segment_ids: ArrayLike | None = None) -> LossOutput:
    """Geometric-Mean Policy Optimization: the geometric mean of token-clipped ratios.

    ``J_i = sgn(A_i) · (Π_t |min(r_t · A_i, clip(r_t, e^−ε_low, e^ε_high) · A_i)|)^(1/|o_i|)``,
    i.e. ``ℓ_i = −A_i · exp((1/|o_i|) Σ_t c_t)`` with ``c_t = min(log r_t, ε_high)`` for
    ``A_i > 0`` and ``max(log r_t, −ε_low)`` for ``A_i < 0`` (the pessimistic side, as PPO's
    clip; clipped tokens get no gradient), ``ε_low = ε_high = 0.4``, and ``loss = (1/G) Σ_i ℓ_i``
    (normalisation ``"sequence"``). The geometric mean is less sensitive than GRPO's arithmetic
    mean to tokens with outlier ratios, so the ratios stay in a narrower range. ``A_i`` is the
    sequence's advantage (the token mean of ``advantages`` over the sequence); every token
    carries its sequence's ``ℓ_i``, as in :func:`gspo`.

    Y. Zhao, Y. Liu, J. Liu, J. Chen, X. Wu, et al., "Geometric-Mean Policy Optimization"
    (2025), arXiv:2507.20673.

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` counts the
    clipped token log-ratios; ``ratio_*`` describe the sequence's geometric-mean ratio per token.
    """
    config = _config(config, GMPOConfig)
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    log_ratio = clamped_log_ratio(x.logprobs, x.old_logprobs, x.valid, config.log_ratio_clamp)
    seq_advantage = safe_divide(per_sequence_sum(x.advantages * x.mask, x.segment_ids),
                                x.sequence_tokens)
    clipped = (((seq_advantage > 0) & (log_ratio > config.epsilon_high))
               | ((seq_advantage < 0) & (log_ratio < -config.epsilon_low)))
    clipped_log_ratio = jnp.where(
        clipped, jnp.where(seq_advantage > 0, config.epsilon_high, -config.epsilon_low), log_ratio)
    seq_log_ratio = safe_divide(per_sequence_sum(clipped_log_ratio * x.mask, x.segment_ids),
                                x.sequence_tokens)
    seq_ratio = jnp.exp(jnp.where(x.valid, seq_log_ratio, 0.0))
    pg = -seq_advantage * seq_ratio
    metrics = {"clipped_tokens": _count(clipped, x)}
    return _finish(x, config, pg, log_ratio, seq_ratio, metrics)


def cispo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
          loss_mask: ArrayLike, *, config: CISPOConfig | None = None,
          proximal_logprobs: ArrayLike | None = None,
          ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
          segment_ids: ArrayLike | None = None) -> LossOutput:
    """CISPO: REINFORCE with clipped, stop-gradient importance-sampling weights.

    ``ℓ_t = −sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)``, token-level mean
    (``Σ_i Σ_t ℓ / Σ_i |o_i|``). Unlike PPO no token loses its gradient: only the weight is
    bounded. The paper sets no lower bound (``epsilon_low=None``) and tunes ``ε_high``; the
    default ``ε_high = 4`` caps the weight at 5.

    MiniMax, A. Chen, et al., "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (2025), arXiv:2506.13585; adopted by ScaleRL (Khatri et al. 2025,
    arXiv:2510.13786).

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` counts the
    clipped weights.
    """
    config = _config(config, CISPOConfig)
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    log_ratio = clamped_log_ratio(x.logprobs, x.old_logprobs, x.valid, config.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    low = 0.0 if config.epsilon_low is None else 1.0 - config.epsilon_low
    high = 1.0 + config.epsilon_high
    weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))
    pg = -weight * x.advantages * x.logprobs
    metrics = {"clipped_tokens": _count((ratio > high) | (ratio < low), x)}
    return _finish(x, config, pg, log_ratio, ratio, metrics)


def m2po(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
         loss_mask: ArrayLike, *, config: M2POConfig | None = None,
         proximal_logprobs: ArrayLike | None = None,
         ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
         segment_ids: ArrayLike | None = None) -> LossOutput:
    """M2PO: importance-weighted policy gradient with a second-moment trust region.

    ``ℓ_t = −M_t · r_t · A_t`` with ``r_t = π_θ(y_t) / π_old(y_t)`` (no clipping), token-level
    mean, where ``M_t ∈ {0, 1}`` masks the fewest tokens with the largest ``(log r_t)²`` such that
    the mean ``(log r)²`` of the kept tokens is ``≤ τ_M2`` (``config.m2_threshold``, 0.04): see
    :func:`second_moment_mask`. Bounding the second moment of the log-ratios, rather than each
    ratio, removes only the extreme outliers that very stale samples produce, and keeps the
    informative high-ratio tokens PPO's clip would silence; the paper reports training that
    stays stable with data 256 updates stale.

    H. Zheng, J. Zhao, B. Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach
    with Stale Data on LLMs?" (2025), arXiv:2510.01161.

    The mask is computed over the tokens of one call: exactly the paper's global batch when the
    batch is one call, a per-micro-batch mask when the trainer accumulates micro-batches.

    Arguments and return value: see the module docstring. Metrics: ``clipped_tokens`` counts
    the masked tokens; ``m2_sum`` gives ``m2_mean``, the second moment before masking.
    """
    config = _config(config, M2POConfig)
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    log_ratio = clamped_log_ratio(x.logprobs, x.old_logprobs, x.valid, config.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    keep = second_moment_mask(jax.lax.stop_gradient(log_ratio), x.mask, config.m2_threshold)
    pg = jnp.where(keep, -ratio * x.advantages, 0.0)
    metrics = {"clipped_tokens": _count(~keep, x),
               "m2_sum": masked_sum(jnp.square(jax.lax.stop_gradient(log_ratio)), x.mask)}
    return _finish(x, config, pg, log_ratio, ratio, metrics)


def decoupled_ppo(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
                  loss_mask: ArrayLike, *, config: DecoupledPPOConfig | None = None,
                  proximal_logprobs: ArrayLike | None = None,
                  ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
                  segment_ids: ArrayLike | None = None) -> LossOutput:
    """Decoupled PPO (AReaL): trust region around the proximal policy, behaviour correction.

    ``u_t = π_θ(y_t) / π_prox(y_t)``, ``w_t = π_prox(y_t) / μ(y_t)`` (stop-gradient, capped at
    ``behaviour_weight_cap`` by masking (AReaL) or truncation),
    ``ℓ_t = w_t · max(−A_t · u_t, −A_t · clip(u_t, 1 − ε, 1 + ε))``, token-level mean. ``π_prox``
    is the policy the trainer last produced; ``μ`` may be several versions older (in-flight
    weight updates), and the clip range no longer depends on how stale ``μ`` is.

    W. Fu, J. Gao, X. Shen, C. Zhu, Z. Mei, et al., "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning" (2025), arXiv:2505.24298; decoupled
    objective after J. Hilton, K. Cobbe, J. Schulman, "Batch size-invariance for policy
    optimization" (2021), arXiv:2110.00641.

    Arguments and return value: see the module docstring; ``proximal_logprobs`` is required.
    Metrics: ``clipped_tokens``, ``behaviour_ratio_*`` and ``behaviour_capped_tokens``.
    """
    config = _config(config, DecoupledPPOConfig)
    if proximal_logprobs is None:
        raise LossConfigError("decoupled_ppo needs proximal_logprobs (log π_prox of the tokens)")
    x = prepare_inputs(logprobs, behaviour_logprobs, advantages, loss_mask,
                       proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                       entropy=entropy, segment_ids=segment_ids)
    pg, log_ratio, ratio, metrics = _clipped_ppo(x, config, x.proximal_logprobs)
    weight, capped, behaviour_ratio = importance_weights(
        x.proximal_logprobs, x.behaviour_logprobs, mode=config.behaviour_weight_mode,
        cap=config.behaviour_weight_cap, valid=x.valid, clamp=config.log_ratio_clamp)
    metrics.update(ratio_metrics("behaviour_ratio", behaviour_ratio, x))
    metrics["behaviour_capped_tokens"] = _count(capped, x)
    return _finish(x, config, weight * pg, log_ratio, ratio, metrics)
