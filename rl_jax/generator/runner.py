"""Jitted device work of the inference engine: prefill, cache insertion, decode and sampling.

The KV cache is slot-based, one array per layer: ``k_cache[l], v_cache[l]`` of shape
``[slots, kv_len, K, Dh]``, one slot per running sequence. Its length ``kv_len`` follows the
longest running sequence (a power of two of at least 16, at most ``max_seq_len``), so a decode
step reads and attends over the context the batch actually has, not the whole capacity; the memory
bound is ``2·L·slots·max_seq_len·K·Dh`` elements. A slot holding a sequence of length ``n`` has
keys/values for positions ``0 .. n-2``; its last token is processed by the next decode step, which
writes position ``n-1`` and samples token ``n``.

Decode runs the layers unrolled over per-layer weights and per-layer caches (donated and updated
in place): a ``lax.scan`` over stacked weights and caches would copy every layer's weights and the
whole cache on every step. The per-layer weights are split from the stacked parameters once per
parameter version (one extra copy of the layer weights in memory).

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
from rl_jax.models.transformer import (attention_mask, attention_output, decoder_layer, mlp,
                                       project_qkv, rms_norm, rotary_tables)
from rl_jax.sharding import ShardingRules

CACHE_AXES = ("layers", "act_batch", "act_seq", "act_kv_heads", "head_dim")
LAYER_CACHE_AXES = CACHE_AXES[1:]
MIN_KV_LEN = 16


def generator_rules() -> ShardingRules:
    """Tensor parallelism only: weights split over ``tensor``, sequences over ``data``."""
    return ShardingRules({"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "act_batch": "data", "act_heads": "tensor",
                          "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"})


def kv_bucket(needed: int, max_seq_len: int, minimum: int = MIN_KV_LEN) -> int:
    """The cache length for ``needed`` positions: the next power of two, within
    ``[minimum, max_seq_len]``."""
    size = minimum
    while size < needed:
        size *= 2
    return min(size, max_seq_len)


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


def split_layers(layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """Stacked layer weights ``{name: [L, ...]}`` → one ``{name: [...]}`` per layer."""
    num_layers = next(iter(layers.values())).shape[0]
    return tuple({name: w[i] for name, w in layers.items()} for i in range(num_layers))


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     positions: jax.Array, dtype: Any) -> jax.Array:
    """One query per slot over its cache: ``q [S,1,H,Dh]``, caches ``[S,T,K,Dh]``, slot ``s``
    attending keys ``0..positions[s]``. Returns ``[S,1,H,Dh]``.

    Written as broadcast products and reductions (float32) rather than batched matmuls: these
    read the cache where it lies, while a batched matmul first transposes a copy of it.
    """
    s, _, h, hd = q.shape
    kv_len, kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = q[:, 0].reshape(s, kv_heads, h // kv_heads, hd).astype(jnp.float32)
    k = k_cache.astype(dtype).astype(jnp.float32)
    v = v_cache.astype(dtype).astype(jnp.float32)
    scores = jnp.sum(q[:, None] * k[:, :, :, None, :], axis=-1) * (hd ** -0.5)  # [S,T,K,G]
    visible = jnp.arange(kv_len, dtype=jnp.int32)[None, :] <= positions[:, None]
    scores = jnp.where(visible[:, :, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=1).astype(dtype).astype(jnp.float32)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [S,K,G,Dh]
    return out.reshape(s, 1, h, hd).astype(dtype)


def decode(params: dict[str, Any], layer_weights: tuple[dict[str, jax.Array], ...],
           k_cache: tuple[jax.Array, ...], v_cache: tuple[jax.Array, ...], tokens: jax.Array,
           positions: jax.Array, *, cfg: ModelConfig, dtype: Any, constrain=None):
    """One token per slot: ``tokens [S]`` at ``positions [S]`` (each ``< kv_len``).

    ``params`` supplies the embedding, final norm and unembedding; ``layer_weights`` are the
    per-layer weights (:func:`split_layers`); caches are per layer ``[S, kv_len, K, Dh]``.
    Returns the updated caches and float32 logits ``[S, V]``.
    """
    constrain = constrain or (lambda x, axes: x)
    s = tokens.shape[0]
    cos, sin = rotary_tables(positions[:, None], cfg.head_dim, cfg.rope_theta,
                             cfg.rope_scaling_dict)
    h = jnp.take(params["embed"], tokens[:, None], axis=0).astype(dtype)
    slots = jnp.arange(s)
    new_k, new_v = [], []
    for w, kc, vc in zip(layer_weights, k_cache, v_cache):
        x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project_qkv(x, w, cfg, cos, sin, dtype)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", "head_dim"))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", "head_dim"))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", "head_dim"))
        kc = kc.at[slots, positions].set(k[:, 0].astype(kc.dtype))
        vc = vc.at[slots, positions].set(v[:, 0].astype(vc.dtype))
        new_k.append(kc)
        new_v.append(vc)
        attn = decode_attention(q, kc, vc, positions, dtype)
        h = h + attention_output(attn, w, cfg, dtype)
        h = constrain(h, ("act_batch", "act_seq", "act_embed"))
        h = h + mlp(rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps), w, dtype, constrain)
        h = constrain(h, ("act_batch", "act_seq", "act_embed"))
    return tuple(new_k), tuple(new_v), _logits(params, cfg, h[:, 0])


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 hash (20 rounds), unrolled; as ``jax.random``'s, bit for bit."""
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


def gumbel_noise(seeds: jax.Array, sample_index: jax.Array, token_index: jax.Array,
                 vocab: int) -> jax.Array:
    """``[S, vocab]`` float32 Gumbel noise, row ``s`` equal bit for bit to
    ``jax.random.gumbel(fold_in(fold_in(key(seeds[s]), sample_index[s]), token_index[s]),
    (vocab,))`` with the default threefry implementation.

    On CPU ``jax.random`` runs its hash as a rolled loop (a dozen small kernels per call, three
    calls per row); here the hash is unrolled and batched over rows, which makes the noise about
    twice as cheap. Other PRNG settings fall back to ``jax.random`` itself.
    """
    if not (jax.config.jax_threefry_partitionable
            and jax.config.jax_default_prng_impl == "threefry2x32"):
        def one(seed, index, step):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), step)
            return jax.random.gumbel(key, (vocab,), jnp.float32)
        return jax.vmap(one)(seeds, sample_index, token_index)
    u32 = lambda x: x.astype(jnp.uint32)[:, None]  # noqa: E731
    zero = jnp.zeros_like(u32(seeds))
    # key(seed) is (0, seed) for a 32-bit seed; fold_in(key, d) = hash(key, (0, d)).
    k1, k2 = _threefry2x32(zero, u32(seeds), zero, u32(sample_index))
    k1, k2 = _threefry2x32(k1, k2, zero, u32(token_index))
    # Partitionable random bits: hash(key, (0, i)), its two words xor-ed.
    b1, b2 = _threefry2x32(k1, k2, jnp.zeros((1, vocab), jnp.uint32),
                           jax.lax.iota(jnp.uint32, vocab)[None, :])
    bits = b1 ^ b2
    # jax.random.uniform(minval=tiny, maxval=1) then -log(-log(u)), as jax.random.gumbel.
    tiny, one = jnp.float32(jnp.finfo(jnp.float32).tiny), jnp.float32(1.0)
    mantissa = jax.lax.shift_right_logical(bits, jnp.uint32(32 - 23))
    floats = jax.lax.bitcast_convert_type(
        mantissa | jnp.uint32(np.float32(1.0).view(np.uint32)), jnp.float32) - one
    uniform = jax.lax.max(tiny, floats * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def argmax_first(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (first maximum; first NaN if any) as three vectorised
    reductions; XLA's CPU argmax (a variadic reduce) is several times slower."""
    vocab = x.shape[-1]
    nan = jnp.isnan(x)
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


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

    noise = gumbel_noise(seeds, sample_index, token_index, logits.shape[-1])
    sampled = argmax_first(masked + noise)
    tokens = jnp.where(greedy, argmax_first(logits), sampled).astype(jnp.int32)
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
        self.cache_dtype = cache_dtype or dtype
        constrain = None
        if mesh is not None:
            constrain = partial(self.rules.constrain, mesh=mesh)
            constrain = (lambda x, axes, _c=constrain: _c(x, logical_axes=axes))
        self.cache_sharding = self._layer_cache_sharding(max_seq_len)
        self.cache_bytes = (2 * config.num_layers * max_slots * max_seq_len * config.num_kv_heads
                            * config.head_dim * jnp.dtype(self.cache_dtype).itemsize)
        self._zeros: dict[int, Any] = {}
        self._resizers: dict[int, Any] = {}
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, max_seq_len))
        kw = dict(cfg=config, dtype=dtype, constrain=constrain)
        self._prefill = jax.jit(partial(prefill, **kw))
        self._decode = jax.jit(partial(decode, **kw), donate_argnums=(2, 3))
        self._insert = jax.jit(_insert, donate_argnums=(0, 1))
        self._split = jax.jit(split_layers)
        self._split_key: tuple[Any, ...] = ()
        self._layer_weights: tuple[dict[str, jax.Array], ...] = ()
        self._sample = jax.jit(sample, static_argnames=("filtered",))
        self._sample_rows = jax.jit(_sample_rows, static_argnames=("filtered",))

    @property
    def kv_len(self) -> int:
        """Current length of the cache's position axis."""
        return self.k_cache[0].shape[1]

    def prefill(self, params, tokens: np.ndarray, lengths: np.ndarray):
        return self._prefill(params, jnp.asarray(tokens), jnp.asarray(lengths))

    def insert(self, k_new, v_new, rows: np.ndarray, slots: np.ndarray):
        """Copies prefill rows ``rows [M]`` into cache slots ``slots [M]`` (prefix sharing: one
        prefilled prompt can fill several slots)."""
        if k_new.shape[2] > self.kv_len:
            self._resize(kv_bucket(k_new.shape[2], self.max_seq_len))
        self.k_cache, self.v_cache = self._insert(self.k_cache, self.v_cache, k_new, v_new,
                                                  jnp.asarray(rows), jnp.asarray(slots))

    def decode(self, params, tokens: np.ndarray, positions: np.ndarray):
        """Logits ``[slots, V]`` for ``tokens [slots]`` at ``positions [slots]``. Host
        ``positions`` size the cache to the longest sequence; device ones use ``max_seq_len``."""
        needed = (int(np.max(positions)) + 1 if isinstance(positions, np.ndarray)
                  else self.max_seq_len)
        length = kv_bucket(needed, self.max_seq_len)
        if length != self.kv_len:
            self._resize(length)
        top = {name: value for name, value in params.items() if name != "layers"}
        self.k_cache, self.v_cache, logits = self._decode(
            top, self._per_layer(params["layers"]), self.k_cache, self.v_cache,
            jnp.asarray(tokens), jnp.asarray(positions))
        return logits

    def sample(self, logits, arrays: dict[str, np.ndarray], filtered: bool,
               rows: np.ndarray | None = None):
        """Samples one token per row of ``logits`` (or of ``logits[rows]``); ``arrays`` hold
        the per-row sampling parameters (see :func:`sample`)."""
        args = [jnp.asarray(arrays[k]) for k in (
            "temperature", "top_k", "top_p", "min_p", "seed", "sample_index", "token_index")]
        if rows is None:
            return self._sample(logits, *args, filtered=filtered)
        return self._sample_rows(logits, jnp.asarray(rows), *args, filtered=filtered)

    def reset_cache(self):
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, self.max_seq_len))

    # ---- cache and weight layout --------------------------------------------------------------

    def _layer_cache_sharding(self, length: int):
        shape = (self.max_slots, length, self.config.num_kv_heads, self.config.head_dim)
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return self.rules.sharding(self.mesh, LAYER_CACHE_AXES, shape, name="kv cache")

    def _zero_cache(self, length: int):
        if length not in self._zeros:
            shape = (self.max_slots, length, self.config.num_kv_heads, self.config.head_dim)
            layers = self.config.num_layers
            sharding = self._layer_cache_sharding(length)
            self._zeros[length] = jax.jit(
                lambda: tuple(tuple(jnp.zeros(shape, self.cache_dtype) for _ in range(layers))
                              for _ in range(2)),
                out_shardings=((sharding,) * layers,) * 2)
        return self._zeros[length]()

    def _resize(self, length: int):
        """Pads or truncates every layer's cache to ``length`` positions (copies the cache)."""
        if length not in self._resizers:
            sharding = self._layer_cache_sharding(length)
            layers = self.config.num_layers
            self._resizers[length] = jax.jit(  # no donation: the shapes differ
                partial(_resize_cache, length=length), out_shardings=((sharding,) * layers,) * 2)
        self.k_cache, self.v_cache = self._resizers[length](self.k_cache, self.v_cache)

    def _per_layer(self, layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
        """Per-layer weights, split once per parameter version (keyed on the arrays' identity;
        the key keeps them alive, so an id is never reused while cached)."""
        leaves = tuple(jax.tree.leaves(layers))
        if len(leaves) != len(self._split_key) or any(
                a is not b for a, b in zip(leaves, self._split_key)):
            self._layer_weights = ()  # free the old split before making the new one
            self._layer_weights = self._split(layers)
            self._split_key = leaves
        return self._layer_weights


def _sample_rows(logits, rows, *args, filtered: bool):
    return sample(logits[rows], *args, filtered=filtered)


def _insert(k_cache, v_cache, k_new, v_new, rows, slots):
    """Writes prefill keys/values ``[L, B, P, K, Dh]`` rows ``rows`` into slots ``slots`` of the
    per-layer caches (``P <= kv_len``)."""
    p = k_new.shape[2]
    k_cache = tuple(c.at[slots, :p].set(k_new[i, rows].astype(c.dtype))
                    for i, c in enumerate(k_cache))
    v_cache = tuple(c.at[slots, :p].set(v_new[i, rows].astype(c.dtype))
                    for i, c in enumerate(v_cache))
    return k_cache, v_cache


def _resize_cache(k_cache, v_cache, *, length: int):
    def one(c):
        if c.shape[1] >= length:
            return c[:, :length]
        return jnp.pad(c, ((0, 0), (0, length - c.shape[1]), (0, 0), (0, 0)))
    return tuple(map(one, k_cache)), tuple(map(one, v_cache))
