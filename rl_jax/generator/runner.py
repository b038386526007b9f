"""Jitted device work of the inference engine: prefill, cache insertion, decode and sampling.

The KV cache is slot-based: ``k, v [L, slots, max_seq_len, K, Dh]``, one slot per running
sequence, bounded memory ``2·L·slots·max_seq_len·K·Dh`` elements. A slot holding a sequence of
length ``n`` has keys/values for positions ``0 .. n-2``; its last token is processed by the
next decode step, which writes position ``n-1`` and samples token ``n``.

Sampling is reproducible per sequence: the random key of a token is
``fold_in(fold_in(key(seed), sample_index), token_index)``, independent of the batch.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import attention_mask, decoder_layer, rms_norm, rotary_tables
from rl_jax.sharding import ShardingRules

CACHE_AXES = ("layers", "act_batch", "act_seq", "act_kv_heads", "head_dim")


def generator_rules() -> ShardingRules:
    """Tensor parallelism only: weights split over ``tensor``, sequences over ``data``."""
    return ShardingRules({"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "act_batch": "data", "act_heads": "tensor",
                          "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"})


def _unembed(params: dict[str, Any], cfg: ModelConfig) -> jax.Array:
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def _logits(params, cfg, h):
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return jnp.einsum("bd,dv->bv", h, _unembed(params, cfg).astype(h.dtype),
                      preferred_element_type=jnp.float32)


def prefill(params: dict[str, Any], tokens: jax.Array, lengths: jax.Array, *, cfg: ModelConfig,
            dtype: Any, constrain=None):
    """Runs prompts ``tokens [B, P]`` (right-padded to ``P``; true ``lengths [B]``).

    Returns ``(k, v, logits)``: keys/values ``[L, B, P, K, Dh]`` and float32 next-token logits
    ``[B, V]`` at each prompt's last position.
    """
    b, p = tokens.shape
    index = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    segment = (index < lengths[:, None]).astype(jnp.int32)
    mask = attention_mask(index, segment, index, segment)
    cos, sin = rotary_tables(index, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)

    def layer(h, w):
        return decoder_layer(h, w, cfg, cos=cos, sin=sin, mask=mask, dtype=dtype,
                             constrain=constrain)

    h, (k, v) = jax.lax.scan(layer, x, params["layers"])
    last = h[jnp.arange(b), lengths - 1]
    return k, v, _logits(params, cfg, last)


def decode(params: dict[str, Any], k_cache: jax.Array, v_cache: jax.Array, tokens: jax.Array,
           positions: jax.Array, *, cfg: ModelConfig, dtype: Any, constrain=None):
    """One token per slot: ``tokens [S]`` at ``positions [S]``. Returns updated caches and
    float32 logits ``[S, V]``."""
    s = tokens.shape[0]
    max_len = k_cache.shape[2]
    q_index = positions[:, None]
    kv_index = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (s, max_len))
    ones_q = jnp.ones((s, 1), jnp.int32)
    mask = attention_mask(q_index, ones_q, kv_index, jnp.ones((s, max_len), jnp.int32))
    cos, sin = rotary_tables(q_index, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    x = jnp.take(params["embed"], tokens[:, None], axis=0).astype(dtype)

    def layer(h, xs):
        w, kc, vc = xs
        return decoder_layer(h, w, cfg, cos=cos, sin=sin, mask=mask, dtype=dtype,
                             constrain=constrain, cache=(kc, vc, positions))

    h, (k_cache, v_cache) = jax.lax.scan(layer, x, (params["layers"], k_cache, v_cache))
    return k_cache, v_cache, _logits(params, cfg, h[:, 0])


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array,
           *, filtered: bool) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row of ``logits [S, V]``.

    Returns ``(tokens [S], logprobs [S])``; the log-probability is under
    ``softmax(logits / temperature)`` before top-k/top-p/min-p filtering (under the raw logits
    for greedy rows, ``temperature == 0``), the distribution a trainer recomputes.
    """
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = logits / t
    logp = jax.nn.log_softmax(scaled, axis=-1)
    masked = scaled
    if filtered:
        vocab = logits.shape[-1]
        desc = -jnp.sort(-scaled, axis=-1)
        kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        keep = jnp.where((top_k > 0)[:, None], scaled >= kth, True)
        probs_desc = jax.nn.softmax(desc, axis=-1)
        before = jnp.cumsum(probs_desc, axis=-1) - probs_desc
        cutoff = jnp.min(jnp.where(before < top_p[:, None], desc, jnp.inf), axis=-1)
        keep &= scaled >= cutoff[:, None]
        probs = jnp.exp(logp)
        keep &= probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        masked = jnp.where(keep, scaled, -jnp.inf)

    def gumbel(seed, index, step):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), step)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    noise = jax.vmap(gumbel)(seeds, sample_index, token_index)
    sampled = jnp.argmax(masked + noise, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


class ModelRunner:
    """Owns the KV cache and the compiled prefill/decode functions for one model shape."""

    def __init__(self, config: ModelConfig, *, max_slots: int, max_seq_len: int,
                 mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 dtype: Any = jnp.float32, cache_dtype: Any = None):
        self.config = config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.mesh = mesh
        self.rules = rules or generator_rules()
        self.dtype = dtype
        cache_dtype = cache_dtype or dtype
        shape = (config.num_layers, max_slots, max_seq_len, config.num_kv_heads, config.head_dim)
        constrain = None
        if mesh is not None:
            self.cache_sharding = self.rules.sharding(mesh, CACHE_AXES, shape, name="kv cache")
            constrain = partial(self.rules.constrain, mesh=mesh)
            constrain = (lambda x, axes, _c=constrain: _c(x, logical_axes=axes))
        else:
            self.cache_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        zeros = jax.jit(lambda: jnp.zeros(shape, cache_dtype), out_shardings=self.cache_sharding)
        self.k_cache = zeros()
        self.v_cache = zeros()
        self.cache_bytes = 2 * int(np.prod(shape)) * jnp.dtype(cache_dtype).itemsize
        kw = dict(cfg=config, dtype=dtype, constrain=constrain)
        self._prefill = jax.jit(partial(prefill, **kw))
        self._decode = jax.jit(partial(decode, **kw), donate_argnums=(1, 2))
        self._insert = jax.jit(_insert, donate_argnums=(0, 1))
        self._sample = jax.jit(sample, static_argnames=("filtered",))

    def prefill(self, params, tokens: np.ndarray, lengths: np.ndarray):
        return self._prefill(params, jnp.asarray(tokens), jnp.asarray(lengths))

    def insert(self, k_new, v_new, rows: np.ndarray, slots: np.ndarray):
        """Copies prefill rows ``rows [M]`` into cache slots ``slots [M]`` (prefix sharing: one
        prefilled prompt can fill several slots)."""
        self.k_cache, self.v_cache = self._insert(self.k_cache, self.v_cache, k_new, v_new,
                                                  jnp.asarray(rows), jnp.asarray(slots))

    def decode(self, params, tokens: np.ndarray, positions: np.ndarray):
        self.k_cache, self.v_cache, logits = self._decode(
            params, self.k_cache, self.v_cache, jnp.asarray(tokens), jnp.asarray(positions))
        return logits

    def sample(self, logits, arrays: dict[str, np.ndarray], filtered: bool):
        return self._sample(logits, *(jnp.asarray(arrays[k]) for k in (
            "temperature", "top_k", "top_p", "min_p", "seed", "sample_index", "token_index")),
            filtered=filtered)

    def reset_cache(self):
        self.k_cache = jnp.zeros_like(self.k_cache)
        self.v_cache = jnp.zeros_like(self.v_cache)


def _insert(k_cache, v_cache, k_new, v_new, rows, slots):
    p = k_new.shape[2]
    k_cache = k_cache.at[:, slots, :p].set(k_new[:, rows].astype(k_cache.dtype))
    v_cache = v_cache.at[:, slots, :p].set(v_new[:, rows].astype(v_cache.dtype))
    return k_cache, v_cache
