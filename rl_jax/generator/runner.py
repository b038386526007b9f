"""Jitted device work of the inference engine: prefill, admission, decode steps and sampling.

The KV cache is slot-based, one slot per running sequence: keys ``[slots, K, Dh, kv_len]`` and
values ``[slots, K, kv_len, Dh]`` per layer (heads before positions, and key positions innermost,
so that both attention products are plain per-head matmuls over the cache where it lies). Each
layer's slots are split into chunks at the decode batch sizes (:func:`slot_chunks`: 8, 8, 16, 32,
... slots), one array each, ``k_cache[l][c]`` and ``v_cache[l][c]``: a step over the first
``batch`` slots attends over whole chunks where they lie. (Over one array, the first ``batch`` rows
would be a slice, which XLA copies: at batch 8 of 64 slots that copy costs a quarter of the step.)
Its length ``kv_len`` follows
the longest running sequence (see :func:`kv_bucket`), so a decode step reads and attends over the
context the batch actually has, not the whole capacity; the memory bound is
``2·L·slots·max_seq_len·K·Dh`` elements. A slot holding a sequence of length ``n`` has
keys/values for positions ``0 .. n-2``; its last token is processed by the next decode step, which
writes position ``n-1`` and samples token ``n``.

Everything a decode step needs about a slot lives on the device in a :data:`SlotState` (its last
token, position, sampling parameters and random-key counters), so steps chain on the device: the
host dispatches step ``t+1`` before it reads the tokens of step ``t``. A step decodes a prefix of
the slots (``batch``, the engine allocates the lowest free slots first) and samples one token per
slot in the same jitted call.

Decode runs the layers unrolled over per-layer weights and per-layer caches (donated and updated
in place); a ``lax.scan`` over stacked weights and caches would copy every layer's weights and the
whole cache on every step. :func:`prepare_decode_weights` lays the parameters out for decode once
per parameter version: per-layer arrays, the query/key/value projections fused into one matrix
grouped by key/value head, the gate and up projections fused into one (one extra copy of the layer
weights in memory).

Sampling is reproducible per sequence: the random number of a token is a hash of ``(seed,
sample_index, token_index)``, independent of the batch.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import (apply_rotary, attention_mask, decoder_layer, rms_norm,
                                       rotary_tables)
from rl_jax.generator import kernels
from rl_jax.generator.types import GeneratorError
from rl_jax.sharding import ShardingRules

log = logging.getLogger(__name__)

# Per-layer cache layouts: keys [slots, K, Dh, kv_len], values [slots, K, kv_len, Dh]. Keys with
# positions innermost make the score product a plain [G, Dh] x [Dh, T] matmul per slot and head.
K_CACHE_AXES = ("act_batch", "act_kv_heads", "head_dim", "act_seq")
V_CACHE_AXES = ("act_batch", "act_kv_heads", "act_seq", "head_dim")
K_SEQ_AXIS, V_SEQ_AXIS = 3, 2
MIN_KV_LEN = 16
MIN_ADMIT = 8  # admissions install at least this many rows (padding dropped)
FINE_KV_LEN = 128

# Per-slot decode state: name -> dtype. All arrays are [slots].
SLOT_FIELDS = {
    "token": np.dtype(np.int32),  # last token of the sequence (the next step's input)
    "position": np.dtype(np.int32),  # its position (where the next step writes keys/values)
    "token_index": np.dtype(np.int32),  # index of the next sampled token in the completion
    "seed": np.dtype(np.uint32),
    "sample_index": np.dtype(np.int32),  # sample within its request (0..n-1)
    "temperature": np.dtype(np.float32),
    "top_k": np.dtype(np.int32),
    "top_p": np.dtype(np.float32),
    "min_p": np.dtype(np.float32),
}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "sample_index")
SlotState = dict[str, jax.Array]


def generator_rules() -> ShardingRules:
    """Tensor parallelism only: weights split over ``tensor``, sequences over ``data``."""
    return ShardingRules({"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "act_batch": "data", "act_heads": "tensor",
                          "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"})


def kv_bucket(needed: int, max_seq_len: int, minimum: int = MIN_KV_LEN) -> int:
    """The cache length for ``needed`` positions, within ``[minimum, max_seq_len]``: a power of
    two up to ``FINE_KV_LEN``, above it the smallest of ``2^i`` and ``1.5·2^i`` that holds them
    (at most a third of a bucket is padding where attention costs most; few sizes where it costs
    little, each size being one more compiled decode step)."""
    size = minimum
    while size < needed:
        if size >= FINE_KV_LEN and size * 3 // 2 >= needed and size % 2 == 0:
            size = size * 3 // 2
            break
        size *= 2
    return min(size, max_seq_len)


def batch_bucket(needed: int, max_slots: int, minimum: int = 8) -> int:
    """Slots a decode step covers when slots ``0..needed-1`` may be in use: a power of two of at
    least ``minimum``, at most ``max_slots``."""
    size = minimum
    while size < needed:
        size *= 2
    return min(size, max_slots)


def slot_chunks(max_slots: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of each cache chunk: the slots between consecutive decode batch sizes
    (:func:`batch_bucket`), so that every decode batch is a whole number of chunks."""
    stops = sorted({batch_bucket(n, max_slots) for n in range(1, max_slots + 1)})
    return tuple(zip([0, *stops[:-1]], stops))


def _chunk_bounds(chunks: tuple[jax.Array, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` slots of each of one layer's cache chunks (from their shapes)."""
    bounds, start = [], 0
    for chunk in chunks:
        bounds.append((start, start + chunk.shape[0]))
        start += chunk.shape[0]
    return bounds


def _local_slots(slots: jax.Array, start: int, stop: int) -> jax.Array:
    """Global slot indices as indices into the chunk ``[start, stop)``; the others past its
    end (dropped by a scatter with ``mode="drop"``)."""
    return jnp.where((slots >= start) & (slots < stop), slots - start, stop - start)


# ---- prefill --------------------------------------------------------------------------------------

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
    h = rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    unembed = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.einsum("bd,dv->bv", h, unembed.astype(h.dtype),
                        preferred_element_type=jnp.float32)
    return k, v, logits


# ---- decode weights -------------------------------------------------------------------------------

def decode_weight_axes(cfg: ModelConfig) -> dict[str, Any]:
    """Logical axes of every array of :func:`prepare_decode_weights`' result (same tree)."""
    # The fused head axes are flattened with key/value heads outermost, so splitting them over
    # the "kv_heads" mesh axes keeps every group of heads whole.
    layer = {"attn_norm": ("norm",), "wqkv": ("embed", "kv_heads"), "wo": ("kv_heads", "embed"),
             "mlp_norm": ("norm",), "w_gate_up": ("embed", None, "mlp"),
             "w_down": ("mlp", "embed")}
    if cfg.attention_bias:
        layer["bqkv"] = ("kv_heads",)
    if cfg.output_bias:
        layer["bo"] = ("embed",)
    if cfg.qk_norm:
        layer["q_norm"] = ("head_dim",)
        layer["k_norm"] = ("head_dim",)
    return {"embed": ("vocab", "embed"), "final_norm": ("norm",), "unembed": ("embed", "vocab"),
            "layers": (layer,) * cfg.num_layers}


def prepare_decode_weights(params: dict[str, Any], *, cfg: ModelConfig, dtype: Any
                           ) -> dict[str, Any]:
    """Lays trainer parameters out for :func:`decode`.

    Returns ``{"embed" [V, D], "final_norm" [D], "unembed" [D, V], "layers": (per layer)}`` where
    each layer holds ``wqkv [D, K·(G+2)·Dh]`` (for key/value head ``k``: its ``G`` query heads,
    then its key and its value projection), ``wo [H·Dh, D]``, ``w_gate_up [D, 2, F]``,
    ``w_down [F, D]``, the norms, and the biases fused like their matrices. Matrices are cast to
    the computation ``dtype``; two-dimensional matrices make plain matmuls (no per-step
    re-layout).
    """
    k, hd = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // k
    layers = []
    for i in range(cfg.num_layers):
        w = {name: value[i] for name, value in params["layers"].items()}
        d = w["wq"].shape[0]
        out = {
            "attn_norm": w["attn_norm"],
            "wqkv": jnp.concatenate([w["wq"].reshape(d, k, g, hd), w["wk"][:, :, None],
                                     w["wv"][:, :, None]], axis=2).reshape(d, -1).astype(dtype),
            "wo": w["wo"].reshape(k * g * hd, -1).astype(dtype),
            "mlp_norm": w["mlp_norm"],
            "w_gate_up": jnp.stack([w["w_gate"], w["w_up"]], axis=1).astype(dtype),
            "w_down": w["w_down"].astype(dtype),
        }
        if cfg.attention_bias:
            out["bqkv"] = jnp.concatenate([w["bq"].reshape(k, g, hd), w["bk"][:, None],
                                           w["bv"][:, None]], axis=1).reshape(-1).astype(dtype)
        if cfg.output_bias:
            out["bo"] = w["bo"].astype(dtype)
        if cfg.qk_norm:
            out["q_norm"], out["k_norm"] = w["q_norm"], w["k_norm"]
        layers.append(out)
    unembed = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return {"embed": params["embed"], "final_norm": params["final_norm"],
            "unembed": unembed.astype(dtype), "layers": tuple(layers)}


# ---- decode ---------------------------------------------------------------------------------------

def attend(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array, *,
           dtype: Any) -> jax.Array:
    """Attention of one query per slot over its cache: ``q [S, K, G, Dh]`` (G query heads per
    key/value head), ``keys [S, K, Dh, T]``, ``values [S, K, T, Dh]``; cache positions
    ``<= positions [S]`` are attended. Returns ``[S, K, G, Dh]`` in ``dtype``."""
    # Softmax attention with the normalisation after the value product, and the mask as an
    # additive bias: fewer passes over the [S, K, G, T] scores than softmax-then-product.
    bias = jnp.where(jnp.arange(values.shape[2], dtype=jnp.int32)[None, :] <= positions[:, None],
                     0.0, -1e30)
    scores = jnp.einsum("skgx,skxt->skgt", q * jnp.asarray(q.shape[-1] ** -0.5, dtype), keys,
                        preferred_element_type=jnp.float32) + bias[:, None, None, :]
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    attn = jnp.einsum("skgt,sktx->skgx", weights.astype(dtype), values,
                      preferred_element_type=jnp.float32)
    return (attn / jnp.sum(weights, axis=-1)[..., None]).astype(dtype)


def _decode_layer(h, w, k_cache, v_cache, positions, cos, sin, *, cfg, dtype, constrain,
                  attention=None):
    """One decoder layer for one token per slot: ``h [S, D]``; the layer's key cache chunks
    ``[n, K, Dh, T]`` and value cache chunks ``[n, K, T, Dh]``, of which those of slots
    ``0..S-1`` are this step's (``S`` ends a chunk). Mirrors
    ``models.transformer.decoder_layer``. ``attention``: a decode attention kernel
    (``attention(q, keys, values, positions)`` over the cache as it lies, see
    :mod:`rl_jax.generator.kernels`), which reads each slot's cache up to its position only;
    ``None`` for :func:`attend`."""
    s = h.shape[0]
    kv_heads, hd = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kv_heads
    x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
    qkv = x @ w["wqkv"]
    if cfg.attention_bias:
        qkv = qkv + w["bqkv"]
    qkv = constrain(qkv.reshape(s, kv_heads, g + 2, hd),
                    ("act_batch", "act_kv_heads", None, "head_dim"))
    q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    q = apply_rotary(q.reshape(s, 1, kv_heads * g, hd), cos, sin).reshape(s, kv_heads, g, hd)
    k = apply_rotary(k[:, None], cos, sin)[:, 0]
    k_cache, v_cache, parts = list(k_cache), list(v_cache), []
    for i, (start, stop) in enumerate(_chunk_bounds(k_cache)):
        if start >= s:
            break
        kc, vc, pos = k_cache[i], v_cache[i], positions[start:stop]
        rows = jnp.arange(stop - start)
        kc = kc.at[rows, :, :, pos].set(k[start:stop].astype(kc.dtype), mode="drop")
        vc = vc.at[rows, :, pos].set(v[start:stop].astype(vc.dtype), mode="drop")
        if attention is not None:
            parts.append(attention(q[start:stop], kc, vc, pos).astype(dtype))
        else:
            parts.append(attend(q[start:stop], kc.astype(dtype), vc.astype(dtype), pos,
                                dtype=dtype))
        k_cache[i], v_cache[i] = kc, vc
    attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    out = attn.reshape(s, kv_heads * g * hd) @ w["wo"]
    if cfg.output_bias:
        out = out + w["bo"]
    h = constrain(h + out, ("act_batch", "act_embed"))
    x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
    gate_up = jnp.einsum("sd,dcf->scf", x, w["w_gate_up"])
    act = constrain(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], ("act_batch", "act_mlp"))
    h = constrain(h + act @ w["w_down"], ("act_batch", "act_embed"))
    return h, tuple(k_cache), tuple(v_cache)


def decode(weights: dict[str, Any], k_cache: tuple[jax.Array, ...],
           v_cache: tuple[jax.Array, ...], state: SlotState, *, batch: int, filtered: bool,
           cfg: ModelConfig, dtype: Any, max_seq_len: int, constrain=None,
           attention=None):
    """One decode step of slots ``0..batch-1``: feeds each slot's last token, writes its keys and
    values, samples the next token.

    Args:
      weights: :func:`prepare_decode_weights` output.
      k_cache, v_cache: per layer, per slot chunk (:func:`slot_chunks`) keys
        ``[n, K, Dh, kv_len]`` and values ``[n, K, kv_len, Dh]`` (slot positions ``< kv_len``).
      state: :data:`SlotState`, ``[slots]`` arrays.
      batch: slots decoded (a prefix that ends a chunk; the others are untouched).
      filtered: whether any slot uses top-k/top-p/min-p (see :func:`sample`).
      attention: a decode attention kernel (:mod:`rl_jax.generator.kernels`: the native CPU
        kernel or the Pallas one; see :meth:`ModelRunner._choose_attention`), ``None`` for
        :func:`attend`.

    Returns ``(k_cache, v_cache, state, out)`` with the caches and state advanced (tokens, positions
    and token indices of slots ``< batch``) and ``out [3, batch]`` int32: the sampled tokens and
    their float32 log-probabilities' bits.
    """
    constrain = constrain or (lambda x, axes: x)
    if batch not in {stop for _, stop in _chunk_bounds(k_cache[0])}:
        raise ValueError(f"decode batch {batch} does not end a cache chunk "
                         f"{_chunk_bounds(k_cache[0])}")
    st = {name: value[:batch] for name, value in state.items()}
    positions = st["position"]
    cos, sin = rotary_tables(positions[:, None], cfg.head_dim, cfg.rope_theta,
                             cfg.rope_scaling_dict)
    h = jnp.take(weights["embed"], st["token"], axis=0).astype(dtype)
    new_k, new_v = [], []
    for w, kc, vc in zip(weights["layers"], k_cache, v_cache):
        h, kc, vc = _decode_layer(h, w, kc, vc, positions, cos, sin, cfg=cfg, dtype=dtype,
                                  constrain=constrain, attention=attention)
        new_k.append(kc)
        new_v.append(vc)
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    logits = jnp.einsum("sd,dv->sv", h, weights["unembed"], preferred_element_type=jnp.float32)
    tokens, logprobs, unfiltered = sample(logits, *(st[name] for name in SAMPLING_FIELDS),
                                          st["token_index"], filtered=filtered)
    state = dict(state)
    state["token"] = state["token"].at[:batch].set(tokens)
    state["position"] = state["position"].at[:batch].set(
        jnp.minimum(positions + 1, max_seq_len - 1))
    state["token_index"] = state["token_index"].at[:batch].add(1)
    return tuple(new_k), tuple(new_v), state, _pack(tokens, logprobs, unfiltered)


def decode_many(weights: dict[str, Any], k_cache: tuple[jax.Array, ...],
                v_cache: tuple[jax.Array, ...], state: SlotState, *, steps: int, batch: int,
                filtered: bool, cfg: ModelConfig, dtype: Any, max_seq_len: int, constrain=None,
                attention=None):
    """``steps`` :func:`decode` steps in one program, each step's tokens feeding the next (the
    host reads them together): ``out [steps, 3, batch]``. Each token is sampled exactly as by
    one step at a time (its key depends on the slot's seed, sample and token index only)."""
    outs = []
    for _ in range(steps):  # unrolled: a step's ops stay as fused as in a single step
        k_cache, v_cache, state, out = decode(weights, k_cache, v_cache, state, batch=batch,
                                              filtered=filtered, cfg=cfg, dtype=dtype,
                                              max_seq_len=max_seq_len, constrain=constrain,
                                              attention=attention)
        outs.append(out)
    return k_cache, v_cache, state, jnp.stack(outs)


def _pack(tokens: jax.Array, logprobs: jax.Array, unfiltered: jax.Array) -> jax.Array:
    """``[3, n]`` int32: tokens and the bits of the float32 log-probs (sampled distribution,
    then unfiltered; one device-to-host copy)."""
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32),
                      jax.lax.bitcast_convert_type(unfiltered, jnp.int32)])


def _padded(values: Any, n: int, dtype: Any, fill: Any = 0) -> np.ndarray:
    """``values`` as a ``[n]`` array of ``dtype``, ``fill`` after them (no copy when it already
    is one)."""
    values = np.asarray(values, dtype)
    if len(values) == n:
        return values
    out = np.full((n,), fill, dtype)
    out[:len(values)] = values
    return out


def unpack(out: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host ``(tokens [n] int32, logprobs [n] float32, unfiltered [n] float32)`` from a packed
    step output (``[..., n]`` for the ``[steps, 3, n]`` output of :func:`decode_many`)."""
    out = np.asarray(out)
    return out[..., 0, :], out[..., 1, :].view(np.float32), out[..., 2, :].view(np.float32)


def admit(k_cache, v_cache, state: SlotState, k_new, v_new, logits, rows, slots, values,
          fresh, *, filtered: bool):
    """Installs prefilled sequences in their slots and samples first tokens.

    Args:
      k_new, v_new: prefill keys/values ``[L, B, P, K, Dh]`` (``P <= kv_len``).
      logits: prefill logits ``[B, V]``.
      rows, slots: ``[M]``: sequence ``i`` takes prefill row ``rows[i]`` into slot ``slots[i]``
        (slots ``>= slots`` count, used for padding, are dropped).
      values: :data:`SlotState` fields ``[M]`` for the sequences (``token`` is the last token
        of resumed sequences, ``token_index`` the index of the token sampled here for fresh ones).
      fresh: ``[M]`` bool, whether the sequence samples its first token here (otherwise it
        resumes with ``values["token"]``).

    Returns ``(k_cache, v_cache, state, out)`` with ``out [3, M]`` as :func:`decode`'s.
    The runner compiles the parts separately (:func:`first_tokens`, whose shapes do not depend
    on the cache, and :func:`install_kv` / :func:`install_state`, cheap scatters), so a new
    cache length costs only a small compilation.
    """
    k_rows, v_rows, tokens, out = first_tokens(k_new, v_new, logits, rows, values, fresh,
                                               filtered=filtered)
    k_cache, v_cache = install_kv(k_cache, v_cache, k_rows, v_rows, slots)
    return k_cache, v_cache, install_state(state, slots, values, fresh, tokens), out


def first_tokens(k_new, v_new, logits, rows, values, fresh, *, filtered: bool):
    """Per admitted sequence ``[M]``: its prefill keys/values ``[L, M, P, K, Dh]`` (row
    ``rows[i]`` of the prefill), its sampled first token ``[M]`` and the packed ``[3, M]``
    output (the resumed token where not ``fresh``)."""
    tokens, logprobs, unfiltered = sample(logits[rows],
                                          *(values[name] for name in SAMPLING_FIELDS),
                                          values["token_index"], filtered=filtered)
    out = _pack(jnp.where(fresh, tokens, values["token"]), logprobs, unfiltered)
    return k_new[:, rows], v_new[:, rows], tokens, out


def install_kv(k_cache, v_cache, k_rows, v_rows, slots):
    """Keys/values ``[L, M, P, K, Dh]`` into the first ``P`` positions of ``slots [M]`` (slots
    past the cache are dropped); the only part of admission compiled per cache length."""
    p = k_rows.shape[2]

    def put_keys(chunk, local, new):  # [M, P, K, Dh] → [M, K, Dh, P]
        return chunk.at[local, :, :, :p].set(jnp.transpose(new, (0, 2, 3, 1)).astype(
            chunk.dtype), mode="drop")

    def put_values(chunk, local, new):  # [M, P, K, Dh] → [M, K, P, Dh]
        return chunk.at[local, :, :p].set(jnp.swapaxes(new, 1, 2).astype(chunk.dtype),
                                          mode="drop")

    def put(put_one, chunks, new):
        return tuple(put_one(c, _local_slots(slots, start, stop), new)
                     for c, (start, stop) in zip(chunks, _chunk_bounds(chunks)))

    return (tuple(put(put_keys, chunks, k_rows[i]) for i, chunks in enumerate(k_cache)),
            tuple(put(put_values, chunks, v_rows[i]) for i, chunks in enumerate(v_cache)))


def install_state(state: SlotState, slots, values, fresh, tokens) -> SlotState:
    """Slot state of admitted sequences ``[M]`` (first tokens ``tokens`` where ``fresh``)."""
    tokens = jnp.where(fresh, tokens, values["token"])
    updates = dict(values, token=tokens, token_index=values["token_index"] + fresh)
    return {name: state[name].at[slots].set(updates[name].astype(state[name].dtype),
                                            mode="drop") for name in state}


def move_slots(k_cache, v_cache, state: SlotState, src, dst):
    """Moves sequences from slots ``src [N]`` to slots ``dst [N]``: their keys, values and slot
    state (pairs whose ``dst`` is past the cache, the padding, are dropped). Everything is read
    before anything is written."""
    def move(a):
        return a.at[dst].set(a[src], mode="drop")

    def move_chunks(chunks):
        rows = jnp.concatenate(chunks)[src]  # XLA fuses the concatenation into the gather
        return tuple(c.at[_local_slots(dst, start, stop)].set(rows, mode="drop")
                     for c, (start, stop) in zip(chunks, _chunk_bounds(chunks)))

    return (tuple(map(move_chunks, k_cache)), tuple(map(move_chunks, v_cache)),
            {name: move(a) for name, a in state.items()})


# ---- sampling -------------------------------------------------------------------------------------

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


# ---- the runner -----------------------------------------------------------------------------------

class ModelRunner:
    """Owns the KV cache, the per-slot decode state and the compiled functions for one model.

    Calls are asynchronous (JAX dispatch): :meth:`admit` and :meth:`decode` return device arrays
    and chain through the donated cache and state, so the host can queue a step before reading
    the previous one's tokens.
    """

    def __init__(self, config: ModelConfig, *, max_slots: int, max_seq_len: int,
                 mesh: Mesh | None = None, rules: ShardingRules | None = None,
                 dtype: Any = jnp.float32, cache_dtype: Any = None, attention: str = "auto"):
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
        self.cache_bytes = (2 * config.num_layers * max_slots * max_seq_len * config.num_kv_heads
                            * config.head_dim * jnp.dtype(self.cache_dtype).itemsize)
        self._zeros: dict[int, Any] = {}
        self._resizers: dict[int, Any] = {}
        # decode programs (batch, length, filtered, steps) compiled or under way
        self._compiled: set[tuple[int, int, bool, int]] = set()
        self._compiling: dict[tuple[int, int, bool, int], threading.Event] = {}  # ahead
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, max_seq_len))
        self._state_sharding = self._sharding(("act_batch",), (max_slots,), "slot state")
        self.state = self._initial_state()
        kw = dict(cfg=config, dtype=dtype, constrain=constrain)
        # the decode attention: "native" (the CPU kernel), "pallas" or "xla" (attend)
        self.attention_backend = self._choose_attention(attention)
        self.native_attention = self.attention_backend == "native"
        self._prefill = jax.jit(partial(prefill, **kw))
        kw["attention"] = self._attention_kernel()
        self._decode = jax.jit(partial(decode, max_seq_len=max_seq_len, **kw),
                               static_argnames=("batch", "filtered"), donate_argnums=(1, 2, 3))
        self._decode_many = jax.jit(partial(decode_many, max_seq_len=max_seq_len, **kw),
                                    static_argnames=("steps", "batch", "filtered"),
                                    donate_argnums=(1, 2, 3))
        self._first_tokens = jax.jit(first_tokens, static_argnames=("filtered",))
        self._install_kv = jax.jit(install_kv, donate_argnums=(0, 1))
        self._install_state = jax.jit(install_state, donate_argnums=(0,))
        self._move = jax.jit(move_slots, donate_argnums=(0, 1, 2))
        prepare_kw = {} if mesh is None else {"out_shardings": self._weight_shardings()}
        self._prepare = jax.jit(partial(prepare_decode_weights, cfg=config, dtype=dtype),
                                **prepare_kw)

    def _devices(self) -> list:
        return jax.devices()[:1] if self.mesh is None else list(self.mesh.devices.flat)

    def _choose_attention(self, attention: str) -> str:
        """The decode attention for ``attention`` (:data:`kernels.BACKENDS`): ``"xla"``
        (:func:`attend`); ``"native"`` (the CPU kernel, an error where it cannot run);
        ``"pallas"`` (the Pallas kernel on one device of any backend -- on CPU in Pallas'
        interpreter, slow -- an error where it does not compile); ``"auto"``: on CPU the native
        kernel where it runs and has a specialisation for the model's heads, else XLA's; on
        GPU/TPU the Pallas kernel where it compiles for the model's heads, else XLA's (one log
        line says why)."""
        if attention not in kernels.BACKENDS:
            raise GeneratorError(f"attention must be one of {kernels.BACKENDS}, got "
                                 f"{attention!r}")
        if attention == "xla":
            return "xla"
        platform = self._devices()[0].platform
        if attention == "native" or (attention == "auto" and platform == "cpu"):
            return "native" if self._use_native_attention(attention) else "xla"
        problem = self._pallas_problem(platform)
        if attention == "pallas":
            if problem:
                raise GeneratorError(f"pallas decode attention requested, but {problem}")
            if platform == "cpu":
                log.warning("pallas decode attention on CPU runs in Pallas' interpreter "
                            "(slow; for tests): prefer attention='auto' or 'native' there")
            return "pallas"
        if problem:
            log.warning("pallas decode attention unavailable on %s, using XLA's: %s",
                        platform, problem)
            return "xla"
        return "pallas"

    def _pallas_problem(self, platform: str) -> str | None:
        """Why the Pallas kernel cannot run for this runner (``None`` where it can)."""
        if len(self._devices()) != 1:
            return "it runs on one device only (no sharded form)"
        if platform == "cpu":
            return None  # the interpreter runs any shape
        group = self.config.num_heads // self.config.num_kv_heads
        return kernels.pallas_decode_attention_problem(
            kv_heads=self.config.num_kv_heads, group=group, head_dim=self.config.head_dim,
            max_seq_len=self.max_seq_len, dtype=self.dtype, cache_dtype=self.cache_dtype,
            platform=platform)

    def _attention_kernel(self):
        """The decode attention kernel of :attr:`attention_backend` (``None``: :func:`attend`)."""
        if self.attention_backend == "native":
            return kernels.decode_attention
        if self.attention_backend == "pallas":
            platform = self._devices()[0].platform
            return partial(kernels.pallas_decode_attention, interpret=platform == "cpu",
                           platform=platform)
        return None

    def _use_native_attention(self, attention: str) -> bool:
        """Whether the native CPU kernel runs (``attention`` ``"native"`` or ``"auto"``): where
        it can -- a single CPU device, float32 computation and cache, the kernel built -- and,
        for ``"auto"``, has a specialisation for the model's heads, :data:`kernels.SPECIALISED`.
        An error where ``"native"`` cannot run."""
        devices = self._devices()
        problems = []
        if len(devices) != 1 or devices[0].platform != "cpu":
            problems.append("it runs on one CPU device only")
        if jnp.dtype(self.dtype) != jnp.float32 or jnp.dtype(self.cache_dtype) != jnp.float32:
            problems.append("it computes in float32 over a float32 cache")
        group = self.config.num_heads // self.config.num_kv_heads
        if group > 64:
            problems.append("it takes at most 64 query heads per key/value head")
        if attention == "auto" and (group, self.config.head_dim) not in kernels.SPECIALISED:
            return False  # its generic loops are no faster than XLA's attention
        if not problems and not kernels.decode_attention_available():
            problems.append("it could not be built (see the log)")
        if problems and attention == "native":
            raise GeneratorError("native decode attention requested, but "
                                 + "; ".join(problems))
        return not problems

    @property
    def kv_len(self) -> int:
        """Current length of the cache's position axis."""
        return self.v_cache[0][0].shape[V_SEQ_AXIS]

    def prepare(self, params: dict[str, Any]) -> dict[str, Any]:
        """Decode weights for ``params`` (:func:`prepare_decode_weights`), dispatched
        asynchronously; block on the result before swapping it in to keep the copy off the
        decode path."""
        return self._prepare(params)

    def prefill(self, params, tokens: np.ndarray, lengths: np.ndarray):
        """``(k, v, logits)`` of prompts ``tokens [B, P]`` with true ``lengths [B]``."""
        return self._prefill(params, np.asarray(tokens, np.int32), np.asarray(lengths, np.int32))

    def admit(self, k_new, v_new, logits, rows: np.ndarray, slots: np.ndarray,
              values: dict[str, np.ndarray], fresh: np.ndarray, filtered: bool):
        """Installs prefilled sequences (see :func:`admit`); returns the packed ``[3, M]`` first
        tokens and log-probs (meaningful where ``fresh``)."""
        needed = k_new.shape[2]
        if needed > self.kv_len:
            self._resize(kv_bucket(needed, self.max_seq_len))
        # At least MIN_ADMIT rows (padding goes to a dropped slot): fewer programs to compile.
        # Host arrays go to the programs as they are (the jitted call moves them to the device
        # far cheaper than eager jnp.asarray calls).
        n = max(MIN_ADMIT, len(rows))
        rows, fresh = _padded(rows, n, np.int32), _padded(fresh, n, bool)
        slots = _padded(slots, n, np.int32, fill=self.max_slots)
        values = {name: _padded(values[name], n, dtype) for name, dtype in SLOT_FIELDS.items()}
        k_rows, v_rows, tokens, out = self._first_tokens(k_new, v_new, logits, rows, values,
                                                         fresh, filtered=filtered)
        self.k_cache, self.v_cache = self._install_kv(self.k_cache, self.v_cache, k_rows,
                                                      v_rows, slots)
        self.state = self._install_state(self.state, slots, values, fresh, tokens)
        return out

    def decode(self, weights: dict[str, Any], batch: int, kv_needed: int, filtered: bool,
               kv_horizon: int = 0, steps: int = 1):
        """One decode step of slots ``0..batch-1`` whose next positions are ``< kv_needed``;
        returns the packed ``[3, batch]`` sampled tokens and log-probs (see :func:`unpack`).
        With ``steps > 1``, that many steps in one program (:func:`decode_many`; the cache holds
        the positions all of them write), returning ``[steps, 3, batch]``.

        ``kv_horizon`` is how many positions the running sequences may reach: when it exceeds
        the cache length, the step for the next length is compiled in a background thread, so
        that growing into it need not stall decoding for a compilation.
        """
        length = kv_bucket(kv_needed + steps - 1, self.max_seq_len)
        # Grow when needed; shrink only to half or less (each resize copies the cache).
        if length > self.kv_len or 2 * length <= self.kv_len:
            ahead = self._compiling.pop((batch, length, filtered, steps), None)
            if ahead is not None:
                ahead.wait()  # finishing it is faster than compiling again
            self._resize(length)
        self._compiled.add((batch, self.kv_len, filtered, steps))
        program, static = self._decode_program(steps)
        self.k_cache, self.v_cache, self.state, out = program(
            weights, self.k_cache, self.v_cache, self.state, batch=batch, filtered=filtered,
            **static)
        if kv_horizon > self.kv_len:
            self._compile_ahead(weights, batch, kv_bucket(self.kv_len + 1, self.max_seq_len),
                                filtered, steps)
        return out

    def move(self, src: np.ndarray, dst: np.ndarray):
        """Moves the sequences of slots ``src`` into the free slots ``dst`` (see
        :func:`move_slots`), so that the running ones fit a smaller decode batch."""
        n = self._move_pairs(len(src))
        s, d = np.zeros(n, np.int32), np.full(n, self.max_slots, np.int32)
        s[:len(src)], d[:len(dst)] = src, dst
        self.k_cache, self.v_cache, self.state = self._move(
            self.k_cache, self.v_cache, self.state, s, d)

    def compile_move(self, length: int):
        """Compiles :meth:`move` for caches of ``length`` positions (without running it)."""
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        index = jax.ShapeDtypeStruct((self._move_pairs(1),), jnp.int32)
        self._move.lower(*self._cache_structs(length), jax.tree.map(abstract, self.state),
                         index, index).compile()

    def compile_shrinks(self, lengths) -> int:
        """Compiles every cache resize a decode step may shrink by between ``lengths`` (to half
        the length or less; growing is compiled ahead as the sequences approach it), without
        running them; returns how many."""
        lengths = sorted(set(lengths))
        count = 0
        for longer in lengths:
            current = self._cache_structs(longer)
            for shorter in lengths:
                if 2 * shorter <= longer:
                    self._resizer(shorter).lower(*current).compile()
                    count += 1
        return count

    def _move_pairs(self, pairs: int) -> int:
        """Pairs a move of ``pairs`` sequences is padded to: half the slots (a compaction moves
        at most that many: the sequences above the smaller batch, no more than fit below it;
        each padding pair reads a slot), else all of them."""
        half = max(self.max_slots // 2, 1)
        return half if pairs <= half else self.max_slots

    def _decode_program(self, steps: int):
        """The jitted decode of ``steps`` steps and its extra static arguments."""
        return (self._decode, {}) if steps == 1 else (self._decode_many, {"steps": steps})

    def _compile_ahead(self, weights, batch: int, length: int, filtered: bool, steps: int = 1):
        """Compiles, in a background thread, the decode step (of ``steps`` steps) for caches of
        ``length`` positions and the resize to it (JAX's compilation cache then serves the
        first real call)."""
        key = (batch, length, filtered, steps)
        if key in self._compiled:
            return
        self._compiled.add(key)
        done = self._compiling[key] = threading.Event()
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa
        current = jax.tree.map(abstract, (self.k_cache, self.v_cache))
        args = (jax.tree.map(abstract, weights), *self._cache_structs(length),
                jax.tree.map(abstract, self.state))
        resizer = self._resizer(length)

        def compile_both():
            try:
                resizer.lower(*current).compile()
                program, static = self._decode_program(steps)
                program.lower(*args, batch=batch, filtered=filtered, **static).compile()
            except Exception:  # a missed warm-up only costs the compilation later
                log.debug("compiling the decode step ahead failed", exc_info=True)
            finally:
                done.set()

        # Not a daemon: the interpreter waits for it at exit rather than killing it inside XLA.
        threading.Thread(target=compile_both, name="decode-compile", daemon=False).start()

    def reset_cache(self):
        self.k_cache, self.v_cache = self._zero_cache(min(MIN_KV_LEN, self.max_seq_len))
        self.state = self._initial_state()

    # ---- layouts ------------------------------------------------------------------------------

    def _sharding(self, axes, shape, name):
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return self.rules.sharding(self.mesh, axes, shape, name=name)

    def _weight_shardings(self):
        return jax.tree.map(lambda axes: self.rules.sharding(self.mesh, axes),
                            decode_weight_axes(self.config),
                            is_leaf=lambda x: isinstance(x, tuple) and all(
                                a is None or isinstance(a, str) for a in x))

    def _initial_state(self) -> SlotState:
        s = self.max_slots
        return {name: jax.device_put(np.zeros((s,), dtype), self._state_sharding)
                for name, dtype in SLOT_FIELDS.items()}

    def _cache_structs(self, length: int):
        """``(k_cache, v_cache)`` of ``length`` positions as shape/dtype/sharding structures:
        per layer, per slot chunk (:func:`slot_chunks`), keys ``[n, K, Dh, length]`` and values
        ``[n, K, length, Dh]``."""
        k, hd = self.config.num_kv_heads, self.config.head_dim

        def chunks(axes, shape_of, name):
            return tuple(jax.ShapeDtypeStruct(
                shape_of(stop - start), self.cache_dtype,
                sharding=self._sharding(axes, shape_of(stop - start), name))
                for start, stop in slot_chunks(self.max_slots))

        keys = chunks(K_CACHE_AXES, lambda n: (n, k, hd, length), "key cache")
        values = chunks(V_CACHE_AXES, lambda n: (n, k, length, hd), "value cache")
        layers = self.config.num_layers
        return (keys,) * layers, (values,) * layers

    def _zero_cache(self, length: int):
        if length not in self._zeros:
            structs = self._cache_structs(length)
            self._zeros[length] = jax.jit(
                lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), structs),
                out_shardings=jax.tree.map(lambda x: x.sharding, structs))
        return self._zeros[length]()

    def _resizer(self, length: int):
        if length not in self._resizers:
            self._resizers[length] = jax.jit(  # no donation: the shapes differ
                partial(_resize_cache, length=length),
                out_shardings=jax.tree.map(lambda x: x.sharding, self._cache_structs(length)))
        return self._resizers[length]

    def _resize(self, length: int):
        """Pads or truncates every layer's cache to ``length`` positions (copies the cache)."""
        self.k_cache, self.v_cache = self._resizer(length)(self.k_cache, self.v_cache)


def _resize_cache(k_cache, v_cache, *, length: int):
    def one(c, axis):
        if c.shape[axis] >= length:
            return jax.lax.slice_in_dim(c, 0, length, axis=axis)
        pad = [(0, 0)] * c.ndim
        pad[axis] = (0, length - c.shape[axis])
        return jnp.pad(c, pad)
    return (tuple(tuple(one(c, K_SEQ_AXIS) for c in chunks) for chunks in k_cache),
            tuple(tuple(one(c, V_SEQ_AXIS) for c in chunks) for chunks in v_cache))
