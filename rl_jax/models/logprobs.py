"""Log-probabilities and entropies of given tokens, computed blockwise over the vocabulary.

The full ``[tokens, vocab]`` logits are never built: the vocabulary is visited in blocks with a
running (online) log-sum-exp, and the block computation is rematerialised in the backward pass,
so peak memory is ``O(tokens × block_size)`` in both passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite stand-in for -inf: exp() of it is 0 and, unlike -inf, 0 * it is 0 (no NaN gradients).
_NEG = -1e30


def blockwise_token_stats(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    block_size: int = 4096,
) -> dict[str, jax.Array]:
    """Per-token statistics of ``softmax(hidden @ unembed)`` without building the full logits.

    Args:
      hidden: ``[..., D]`` final hidden states (after the final norm).
      unembed: ``[D, V]`` output projection.
      targets: ``[...]`` integer token ids in ``[0, V)``.
      block_size: vocabulary columns per block; the vocabulary is padded up to a multiple.

    Returns:
      dict of float32 ``[...]`` arrays: ``logprobs`` (log-probability of the target),
      ``entropy`` (nats) and ``is_argmax`` (1.0 where the target has the largest logit).
    """
    lead = targets.shape
    d, vocab = unembed.shape
    if hidden.shape[:-1] != lead or hidden.shape[-1] != d:
        raise ValueError(f"hidden {hidden.shape} does not match targets {lead} and unembed "
                         f"{unembed.shape}")
    h = hidden.reshape(-1, d)
    tgt = targets.reshape(-1).astype(jnp.int32)
    block_size = int(min(block_size, vocab))
    num_blocks = -(-vocab // block_size)
    padded = num_blocks * block_size
    w = unembed.astype(h.dtype)
    if padded != vocab:
        w = jnp.pad(w, ((0, 0), (0, padded - vocab)))
    w_blocks = jnp.moveaxis(w.reshape(d, num_blocks, block_size), 1, 0)  # [nb, D, bs]

    @jax.checkpoint
    def body(carry, xs):
        m, s, t, tgt_logit = carry
        w_block, block_index = xs
        logits = jnp.dot(h, w_block, preferred_element_type=jnp.float32)  # [N, bs]
        cols = block_index * block_size + jnp.arange(block_size)
        valid = cols < vocab
        logits = jnp.where(valid[None, :], logits, _NEG)
        new_m = jnp.maximum(m, jnp.max(logits, axis=-1))
        scale = jnp.exp(m - new_m)
        e = jnp.exp(logits - new_m[:, None])
        s = s * scale + jnp.sum(e, axis=-1)
        t = t * scale + jnp.sum(e * jnp.where(valid[None, :], logits, 0.0), axis=-1)
        hit = cols[None, :] == tgt[:, None]
        tgt_logit = tgt_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        return (new_m, s, t, tgt_logit), None

    n = h.shape[0]
    init = (jnp.full((n,), _NEG, jnp.float32), jnp.zeros((n,), jnp.float32),
            jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    (m, s, t, tgt_logit), _ = jax.lax.scan(body, init, (w_blocks, jnp.arange(num_blocks)))
    lse = m + jnp.log(s)
    return {
        "logprobs": (tgt_logit - lse).reshape(lead),
        "entropy": (lse - t / s).reshape(lead),
        "is_argmax": jax.lax.stop_gradient(tgt_logit >= m).astype(jnp.float32).reshape(lead),
    }


def blockwise_token_logprobs(
    hidden: jax.Array,
    unembed: jax.Array,
    targets: jax.Array,
    *,
    block_size: int = 4096,
    return_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probability ``[...]`` of ``targets`` under ``softmax(hidden @ unembed)`` (and the
    entropy of each predictive distribution when ``return_entropy``), computed blockwise over the
    vocabulary; see :func:`blockwise_token_stats` for the arguments."""
    stats = blockwise_token_stats(hidden, unembed, targets, block_size=block_size)
    return stats["logprobs"], stats["entropy"] if return_entropy else None


def full_token_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                        return_entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Reference implementation that builds the full logits. For tests and small vocabularies."""
    logits = jnp.einsum("...d,dv->...v", hidden, unembed.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    out = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1) if return_entropy else None
    return out, entropy
