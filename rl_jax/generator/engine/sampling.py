"""Sampling of one token per slot, reproducible per sequence, and the packed step output.

The random number of a token is a Threefry hash of ``(seed, sample_index, token_index)``
(:func:`uniform_per_row`), independent of the batch and of the other slots, so a sequence samples
the same tokens whichever slots and decode batches it shares. Tokens are drawn by a two-level
inverse CDF over vocabulary blocks (:func:`inverse_cdf`; no prefix sum over the vocabulary, no
sort); top-k, top-p and min-p are thresholds found by bisection over the logits' bits
(:func:`filter_cut`). A step's sampled tokens and log-probabilities travel to the host as one
packed ``[3, n]`` int32 array (:func:`pack`, :func:`unpack`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 hash (20 rounds), unrolled, on uint32 arrays."""
    def rotate_left(x, d):
        return (x << np.uint32(d)) | (x >> np.uint32(32 - d))

    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ rotate_left(x2, r)
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def uniform_per_row(seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array
                    ) -> jax.Array:
    """``[S]`` float32 uniform in ``[0, 1)``: a Threefry hash of ``(seed, sample_index,
    token_index)`` (the chain ``fold_in(fold_in(key(seed), sample_index), token_index)`` of
    ``jax.random``'s threefry keys, then one more hash for the bits)."""
    u32 = lambda x: x.astype(jnp.uint32)  # noqa: E731
    zero = jnp.zeros_like(u32(seeds))
    k1, k2 = _threefry2x32(zero, u32(seeds), zero, u32(sample_index))
    k1, k2 = _threefry2x32(k1, k2, zero, u32(token_index))
    b1, b2 = _threefry2x32(k1, k2, zero, zero)
    mantissa = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(32 - 23))
    one = np.float32(1.0).view(np.uint32)
    return jax.lax.bitcast_convert_type(mantissa | jnp.uint32(one), jnp.float32) - 1.0


def _cdf_block(vocab: int) -> int:
    """Block length of the two-level inverse CDF: about ``sqrt(vocab)``, a power of two."""
    block = 1
    while block * block < vocab:
        block *= 2
    return block


def _blocks(x: jax.Array, block: int, fill: float) -> jax.Array:
    """``[S, V]`` → ``[S, ceil(V / block), block]``, padded with ``fill``."""
    pad = (-x.shape[-1]) % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(x.shape[0], -1, block)


def _inverse_cdf_blocks(values: jax.Array, weight, u: jax.Array) -> jax.Array:
    """Inverse-CDF sampling over ``weight(values)`` without a prefix sum over the vocabulary.

    ``values [S, NB, B]`` are blocked per-row inputs and ``weight(v, rows)`` maps a ``[S, ..., B]``
    slice of them (``rows``: how to index per-row parameters) to non-negative weights; each row
    must have positive mass. Returns per row the first flat index whose inclusive prefix sum
    exceeds ``u·total`` for ``u [S]`` in ``[0, 1)``: block sums pick a block, then that block's
    own prefix sums pick the element. An index of zero weight is never returned. Also returns the
    row totals ``[S]``.
    """
    num_blocks, block = values.shape[1:]
    block_sums = jnp.sum(weight(values, 3), axis=-1)
    block_cum = jnp.cumsum(block_sums, axis=-1)
    total = block_cum[:, -1]
    target = u * total
    chosen = jnp.minimum(jnp.sum(block_cum <= target[:, None], axis=-1), num_blocks - 1)
    before = jnp.take_along_axis(block_cum - block_sums, chosen[:, None], axis=-1)[:, 0]
    within = weight(jnp.take_along_axis(values, chosen[:, None, None], axis=1)[:, 0], 2)
    rest = jnp.maximum(target - before, 0.0)
    index = jnp.arange(block, dtype=jnp.int32)
    j = jnp.sum(jnp.cumsum(within, axis=-1) <= rest[:, None], axis=-1).astype(jnp.int32)
    # Rounding can leave ``rest`` at or past the block's total: take its last non-zero element.
    last = jnp.max(jnp.where(within > 0, index, 0), axis=-1)
    return chosen.astype(jnp.int32) * block + jnp.minimum(j, last), total


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row of ``weights [S, V]`` (non-negative, each row with positive mass), the first index
    ``j`` whose inclusive prefix sum exceeds ``u·sum(row)`` for ``u [S]`` in ``[0, 1)``: a sample
    of ``weights / sum``. Returns ``[S]`` int32; an index of zero weight is never returned."""
    blocks = _blocks(weights, _cdf_block(weights.shape[-1]), 0.0)
    return _inverse_cdf_blocks(blocks, lambda w, _: w, u)[0]


def _ordered_bits(x: jax.Array) -> jax.Array:
    """uint32 keys ordered as the float32 values ``x`` (for non-NaN values)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> np.uint32(31)).astype(bool)
    return jnp.where(negative, ~bits, bits | np.uint32(0x80000000))


def _smallest_key_below(keys: jax.Array, weights: tuple[jax.Array, ...],
                        limits: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """For each pair ``(weights[i] [S, V], limits[i] [S])``, per row the smallest uint32 ``t``
    with ``sum(weights[i][keys > t]) < limits[i]``, by bisection over the 32 key bits (exact:
    the result is a key of the row, or 0)."""
    def body(_, bounds):
        out = []
        for (lo, hi), w, limit in zip(bounds, weights, limits):
            mid = lo + ((hi - lo) >> np.uint32(1))
            mass = jnp.sum(jnp.where(keys > mid[:, None], w, 0.0), axis=-1)
            ok = mass < limit
            out.append((jnp.where(ok, lo, mid + np.uint32(1)), jnp.where(ok, mid, hi)))
        return tuple(out)

    s = keys.shape[0]
    start = ((jnp.zeros((s,), jnp.uint32), jnp.full((s,), 0xFFFFFFFF, jnp.uint32)),) * len(limits)
    return tuple(hi for _, hi in jax.lax.fori_loop(0, 32, body, start))


def filter_cut(logits: jax.Array, probs: jax.Array, top_k: jax.Array, top_p: jax.Array
               ) -> jax.Array:
    """``[S]`` uint32: top-k and top-p keep the tokens whose ``_ordered_bits(logits)`` are
    ``>=`` this (0 keeps all).

    ``probs [S, V]`` is the sampling distribution (ordered as ``logits``). Top-k keeps values
    ``>=`` the k-th largest (``top_k > 0``); top-p keeps a value when the probability of strictly
    larger values is ``< top_p`` (``top_p < 1``). Ties are kept together. Thresholds are found by
    bisection over the values' bits, without sorting; a search that no row of the batch asks for
    (top-k, or top-p) is skipped, as it would only find 0.
    """
    use_k, use_p = top_k > 0, top_p < 1.0

    def search(with_k: bool, with_p: bool):
        def run():
            weights, limits = [], []
            if with_k:
                weights.append(jnp.ones_like(probs))
                limits.append(jnp.where(use_k, top_k, logits.shape[-1] + 1).astype(jnp.float32))
            if with_p:
                weights.append(probs)
                limits.append(jnp.where(use_p, top_p, 2.0))
            cuts = _smallest_key_below(_ordered_bits(logits), tuple(weights), tuple(limits))
            return cuts[0] if len(cuts) == 1 else jnp.maximum(*cuts)
        return run

    branch = jnp.any(use_k).astype(jnp.int32) + 2 * jnp.any(use_p).astype(jnp.int32)
    return jax.lax.switch(branch, [lambda: jnp.zeros(logits.shape[:1], jnp.uint32),
                                   search(True, False), search(False, True),
                                   search(True, True)])


def filter_mask(scaled: jax.Array, unnormalised: jax.Array, total: jax.Array, top_k: jax.Array,
                top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """``[S, V]`` bool: tokens kept by top-k and top-p (:func:`filter_cut`) and min-p
    (probabilities ``>= min_p`` times the largest), for temperature-scaled logits ``scaled``,
    ``unnormalised = exp(scaled - max)`` and its row sums ``total``."""
    cut = filter_cut(scaled, unnormalised / total[:, None], top_k, top_p)
    return (_ordered_bits(scaled) >= cut[:, None]) & (unnormalised >= min_p[:, None])


def argmax_first(x: jax.Array) -> jax.Array:
    """``[S]`` int32 index of each row's first maximum of ``x [S, V]``."""
    vocab = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array,
           *, filtered: bool) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row of ``logits [S, V]``; the other arguments are ``[S]``.

    Returns ``(tokens [S] int32, logprobs [S] float32, unfiltered [S] float32)``: ``logprobs``
    is the token's log-probability under the distribution it was drawn from,
    ``softmax(logits / temperature)`` restricted to the tokens top-k/top-p/min-p keep and
    renormalised (the behaviour policy of an importance ratio), ``unfiltered`` under
    ``softmax(logits / temperature)`` before filtering (the distribution a trainer recomputes);
    the two are equal for rows without filters. Greedy rows (``temperature == 0``, the first
    maximum) report both under the raw logits. ``filtered=False`` skips the filters (every row
    must have them off).

    Without filters this reads the logits twice (row maxima, then block sums of
    ``exp((logits - max) / temperature)``); nothing of size ``[S, V]`` is written.
    """
    s, vocab = logits.shape
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)
    top = jnp.max(logits, axis=-1)
    block = _cdf_block(vocab)
    blocks = _blocks(logits, block, -jnp.inf)
    u = jnp.where(greedy, 0.0, uniform_per_row(seeds, sample_index, token_index))

    def per_row(x, ndim):
        return x.reshape((s,) + (1,) * (ndim - 1))

    def exp_scaled(v, ndim):
        return jnp.exp((v - per_row(top, ndim)) / per_row(t, ndim))

    if filtered:
        unnormalised = jnp.exp((logits - top[:, None]) / t[:, None])
        cut = filter_cut(logits, unnormalised / jnp.sum(unnormalised, axis=-1, keepdims=True),
                         top_k, top_p)

        def weight(v, ndim):
            e = exp_scaled(v, ndim)
            keep = (_ordered_bits(v) >= per_row(cut, ndim)) & (e >= per_row(min_p, ndim))
            return jnp.where(keep, e, 0.0)

        tokens, kept = _inverse_cdf_blocks(blocks, weight, u)
        total = jnp.sum(unnormalised, axis=-1)
        # Greedy rows keep the unfiltered total (their filters are not applied).
        kept = jnp.where(greedy, total, kept)
    else:
        tokens, total = _inverse_cdf_blocks(blocks, exp_scaled, u)
        kept = total
    tokens = jax.lax.cond(jnp.any(greedy),
                          lambda: jnp.where(greedy, argmax_first(logits), tokens),
                          lambda: tokens)
    picked = (jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - top) / t
    return tokens, picked - jnp.log(kept), picked - jnp.log(total)


def pack(tokens: jax.Array, logprobs: jax.Array, unfiltered: jax.Array) -> jax.Array:
    """``[3, n]`` int32: tokens and the bits of the float32 log-probs (sampled distribution,
    then unfiltered; one device-to-host copy)."""
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32),
                      jax.lax.bitcast_convert_type(unfiltered, jnp.int32)])


def unpack(out: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host ``(tokens [n] int32, logprobs [n] float32, unfiltered [n] float32)`` from a packed
    step output (``[..., n]`` for the ``[steps, 3, n]`` output of
    :func:`rl_jax.generator.engine.decode.decode_many`)."""
    out = np.asarray(out)
    return out[..., 0, :], out[..., 1, :].view(np.float32), out[..., 2, :].view(np.float32)
