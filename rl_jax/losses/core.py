"""Shared machinery of the policy losses: input preparation, normalisation, metrics.

Every policy loss returns ``LossOutput(loss_sum, denominator, metrics)``. The loss is
``loss_sum / denominator``; because both are plain sums over sequences or tokens, the value of a
batch equals ``Σ loss_sum / Σ denominator`` over any split of it into micro-batches, hosts or
shards, provided no *sequence* is split (rows never are: micro-batching and data sharding split
only the batch axis).

Sequences. A sequence is one row of ``[B, T]`` when ``segment_ids`` is ``None``; with packed rows
``segment_ids[b, t] ≥ 1`` names the sequence a token belongs to (ids are per row and at most
``T``) and ``0`` marks padding. A sequence is *non-empty* when it has at least one token with
``loss_mask > 0``; empty sequences add nothing to any sum or count.

Normalisations (``PolicyLossConfig.normalization``), with ``ℓ_{i,t}`` the per-token loss of token
``t`` of sequence ``i``, ``m`` the loss mask, ``n_i = Σ_t m_{i,t}`` and ``N`` the number of
non-empty sequences in the *global* batch:

  ``"token"``        Σ_i Σ_t m ℓ / Σ_i n_i              denominator: tokens
  ``"sequence"``     Σ_i (Σ_t m ℓ / n_i) / N            denominator: sequences
  ``"sequence_sum"`` Σ_i Σ_t m ℓ / N                    denominator: sequences
  ``"constant"``     Σ_i Σ_t m ℓ / (N · L)              denominator: sequences × L

``L`` is ``max_tokens`` (the generation budget), or the static time dimension ``T`` when
``max_tokens`` is ``None``.

Metrics are sums over tokens weighted by the loss mask (``tokens``, ``clipped_tokens``,
``ratio_sum``, ``ratio_sq_sum``, ``kl_sum``, ...), counts (``sequences``), or maxima of
non-negative quantities (keys ending in ``_max``, ``0`` for an empty batch); they accumulate over
micro-batches by ``+`` and ``max``. :func:`finalize_metrics` turns the accumulated values into
means, fractions and effective sample sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from rl_jax.losses.configs import LOG_RATIO_CLAMP, LossConfigError, PolicyLossConfig


class LossOutput(NamedTuple):
    """``loss_sum / denominator`` is the loss; ``metrics`` are sums, counts and ``_max`` values.

    Reduce with :meth:`mean` (or :func:`safe_mean` over sums accumulated across micro-batches):
    a batch with no unmasked token has ``denominator == 0``, where the plain quotient is NaN.
    """

    loss_sum: jax.Array
    denominator: jax.Array
    metrics: dict[str, jax.Array]

    def mean(self) -> jax.Array:
        """The loss, ``loss_sum / denominator``; 0 (with a zero gradient) when nothing is
        unmasked."""
        return safe_mean(self.loss_sum, self.denominator)


def safe_mean(loss_sum: ArrayLike, denominator: ArrayLike) -> jax.Array:
    """``loss_sum / denominator``, and 0 with a zero gradient where ``denominator <= 0`` (an
    all-masked batch, whose ``loss_sum`` is 0 too) instead of ``0 / 0 = NaN``."""
    loss_sum, denominator = jnp.asarray(loss_sum), jnp.asarray(denominator)
    ok = denominator > 0
    return jnp.where(ok, loss_sum / jnp.where(ok, denominator, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Validated float32 ``[B, T]`` inputs of a policy loss, zero wherever ``valid`` is false.

    ``logprobs`` and ``entropy`` carry gradients; the other arrays are stop-gradient data.
    ``old_logprobs`` is the policy the ratio is taken against: ``proximal_logprobs`` when given,
    otherwise ``behaviour_logprobs``. ``sequence_tokens`` holds, at every token, ``n_i`` of its
    sequence; ``num_sequences`` counts the non-empty sequences.
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    behaviour_logprobs: jax.Array
    proximal_logprobs: jax.Array | None
    ref_logprobs: jax.Array | None
    entropy: jax.Array | None
    advantages: jax.Array
    mask: jax.Array
    valid: jax.Array
    segment_ids: jax.Array | None
    sequence_tokens: jax.Array
    num_sequences: jax.Array


def _float(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def prepare_inputs(logprobs: ArrayLike, behaviour_logprobs: ArrayLike, advantages: ArrayLike,
                   loss_mask: ArrayLike, *, proximal_logprobs: ArrayLike | None = None,
                   ref_logprobs: ArrayLike | None = None, entropy: ArrayLike | None = None,
                   segment_ids: ArrayLike | None = None) -> TokenInputs:
    """Checks shapes, casts to (at least) float32 and zeroes every masked position.

    Masked positions may hold anything, including NaN or ±inf: ``jnp.where`` selects zero there,
    so neither the loss nor its gradient sees them, and gradients at masked positions are exactly
    zero.
    """
    logprobs = _float(logprobs)
    if logprobs.ndim != 2:
        raise LossConfigError(f"logprobs must be [batch, time], got shape {logprobs.shape}")
    shape = logprobs.shape

    def token_array(name, x):
        if x is None:
            return None
        x = _float(x)
        if x.shape != shape:
            raise LossConfigError(f"{name} has shape {x.shape}, logprobs has {shape}")
        return x

    mask = token_array("loss_mask", loss_mask)
    valid = mask > 0
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise LossConfigError(f"segment_ids must be integer {shape}, got {segment_ids.dtype} "
                                  f"{segment_ids.shape}")
        segment_ids = segment_ids.astype(jnp.int32)
        valid = valid & (segment_ids > 0) & (segment_ids <= shape[1])
    mask = jnp.where(valid, mask, 0.0)

    advantages = _float(advantages)
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None]
    if advantages.shape not in (shape, (shape[0], 1)):
        raise LossConfigError(f"advantages must be [batch], [batch, 1] or [batch, time] = {shape}, "
                              f"got {advantages.shape}")
    if segment_ids is not None and advantages.shape != shape:
        raise LossConfigError("with packed rows (segment_ids) advantages must be per token "
                              f"{shape}, got {advantages.shape}")
    advantages = jnp.broadcast_to(advantages, shape)

    def clean(x, data=True):
        if x is None:
            return None
        x = jnp.where(valid, x, 0.0)
        return jax.lax.stop_gradient(x) if data else x

    behaviour = clean(token_array("behaviour_logprobs", behaviour_logprobs))
    proximal = clean(token_array("proximal_logprobs", proximal_logprobs))
    sequence_tokens = per_sequence_sum(mask, segment_ids)
    return TokenInputs(
        logprobs=clean(logprobs, data=False),
        old_logprobs=behaviour if proximal is None else proximal,
        behaviour_logprobs=behaviour,
        proximal_logprobs=proximal,
        ref_logprobs=clean(token_array("ref_logprobs", ref_logprobs)),
        entropy=clean(token_array("entropy", entropy), data=False),
        advantages=clean(advantages),
        mask=mask,
        valid=valid,
        segment_ids=segment_ids,
        sequence_tokens=sequence_tokens,
        num_sequences=count_sequences(mask, segment_ids),
    )


def per_sequence_sum(x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """``[B, T]`` → ``[B, T]``: at every token, the sum of ``x`` over the token's sequence.

    Without ``segment_ids`` a row is a sequence. With packed rows the sum runs over the tokens of
    the row that share the token's segment id (ids in ``[0, T]``; the id-0 padding "sequence" is
    summed too, so mask ``x`` first). Sums stay within a row, so a batch-sharded input needs no
    communication.
    """
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), x.shape)
    num_segments = x.shape[1] + 1
    ids = jnp.clip(segment_ids, 0, x.shape[1])
    sums = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=num_segments))(x, ids)
    return jnp.take_along_axis(sums, ids, axis=1)


def count_sequences(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Number of sequences with at least one token of positive ``mask`` (a float32 scalar)."""
    if segment_ids is None:
        return jnp.sum((jnp.sum(mask, axis=1) > 0).astype(jnp.float32))
    num_segments = mask.shape[1] + 1
    ids = jnp.clip(segment_ids, 0, mask.shape[1])
    tokens = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=num_segments))(mask, ids)
    return jnp.sum((tokens[:, 1:] > 0).astype(jnp.float32))


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` where ``denominator > 0``, else 0 (gradient-safe)."""
    positive = denominator > 0
    return jnp.where(positive, numerator / jnp.where(positive, denominator, 1.0), 0.0)


def _np_safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """:func:`safe_divide` on host arrays."""
    positive = denominator > 0
    return np.where(positive, numerator / np.where(positive, denominator, 1.0), 0.0).astype(
        np.float32)


def clamped_log_ratio(logp: jax.Array, logq: jax.Array, valid: jax.Array,
                      clamp: float = LOG_RATIO_CLAMP) -> jax.Array:
    """``clip(log p − log q, −clamp, clamp)``, 0 at invalid tokens; safe to ``exp``."""
    return jnp.clip(jnp.where(valid, logp - logq, 0.0), -clamp, clamp)


def normalization_weights(x: TokenInputs, config: PolicyLossConfig) -> tuple[jax.Array, jax.Array]:
    """Per-token weights ``[B, T]`` and the denominator of ``config.normalization``.

    ``loss_sum = Σ weights · ℓ`` and ``loss = loss_sum / denominator`` (see the module docstring).
    """
    kind = config.normalization
    if kind == "token":
        return x.mask, jnp.sum(x.mask)
    if kind == "sequence":
        return safe_divide(x.mask, x.sequence_tokens), x.num_sequences
    if kind == "sequence_sum":
        return x.mask, x.num_sequences
    length = x.mask.shape[1] if config.max_tokens is None else config.max_tokens
    return x.mask, x.num_sequences * float(length)


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x * mask, 0.0))


def masked_max(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Maximum of a non-negative ``x`` over valid tokens; 0 when there are none."""
    return jnp.max(jnp.where(valid, x, 0.0))


def ratio_metrics(prefix: str, ratio: jax.Array, x: TokenInputs) -> dict[str, jax.Array]:
    """Token-weighted ``{prefix}_sum``, ``{prefix}_sq_sum`` (for the ESS) and ``{prefix}_max``."""
    ratio = jax.lax.stop_gradient(ratio)
    return {f"{prefix}_sum": masked_sum(ratio, x.mask),
            f"{prefix}_sq_sum": masked_sum(jnp.square(ratio), x.mask),
            f"{prefix}_max": masked_max(ratio, x.valid)}


def finalize_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Accumulated loss metrics → means, fractions and effective sample sizes.

    With ``N = tokens`` (mask-weighted token count):
      ``<x>_tokens`` → ``<x>_fraction = <x>_tokens / N`` (e.g. ``clipped_fraction``);
      ``<x>_sum``    → ``<x>_mean = <x>_sum / N`` (e.g. ``ratio_mean``, ``kl_mean``);
      ``<x>_sum`` with ``<x>_sq_sum`` → also ``<x>_ess = (Σw)² / (N · Σw²)`` in ``(0, 1]``
      (Kish's effective sample size as a fraction of the tokens);
    ``tokens``, ``sequences``, ``_max``/``_min`` values and unknown keys pass through. Every ratio
    is 0 when there are no tokens. Works on Python floats, NumPy and JAX values, inside or
    outside ``jit``.
    """
    out: dict[str, Any] = {}
    tokens = metrics.get("tokens")
    # Host values (the train loop's, every step) stay in NumPy: eager JAX would dispatch a few
    # dozen tiny device operations per call.
    traced = any(isinstance(v, jax.Array) for v in metrics.values())
    asarray = jnp.asarray if traced else (lambda x: np.asarray(x, np.float32))
    divide = safe_divide if traced else _np_safe_divide
    for key, value in metrics.items():
        if tokens is not None and key.endswith("_sq_sum"):
            continue
        if tokens is not None and key.endswith("_tokens"):
            out[key[:-len("_tokens")] + "_fraction"] = divide(asarray(value), asarray(tokens))
        elif tokens is not None and key.endswith("_sum"):
            name = key[:-len("_sum")]
            out[name + "_mean"] = divide(asarray(value), asarray(tokens))
            sq = metrics.get(name + "_sq_sum")
            if sq is not None:
                total = asarray(value)
                out[name + "_ess"] = divide(total * total, asarray(tokens) * asarray(sq))
        else:
            out[key] = value
    return out
