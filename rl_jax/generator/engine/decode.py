"""The decode-path model over the paged KV cache: prefill, the decode weight layout, decode steps.

Built from the training model's layer functions (:mod:`rl_jax.models.transformer`): prefill runs
its ``decoder_layer``; a decode step's layer (:func:`decode_layer`) shares its residual
structure (``pre_norm_block``), RMSNorm, qk-norm (``qk_norm``), the rotary embedding
(``apply_rotary``), the MLP's activation (``mlp_activation``) and the output logits. What
differs is what a decode step needs for speed: the projections run over
:func:`prepare_decode_weights`' layout (queries, keys and values fused into one matrix grouped
by key/value head, gate and up fused into one: one matmul each instead of three and two, and no
per-step re-layout; the training layout keeps one matrix per HF tensor so that its shardings and
names match), and attention reads one query per slot over its pages of the cache through its
page table (a kernel of :mod:`rl_jax.generator.engine.kernels`, or :func:`attend_pages`) instead of
a
``[B, T, S]``-masked product. The qk-norm runs on the fused layout's ``[S, K, G, Dh]`` heads
before the reshape the rotary embedding takes, as it always has: normalising after the reshape
computes the same values but XLA rounds it differently (one ulp).

Decode runs the layers unrolled over per-layer weights and per-layer caches (donated and updated
in place); a ``lax.scan`` over stacked weights and caches would copy every layer's weights and the
whole cache on every step. :func:`prepare_decode_weights` lays the parameters out for decode once
per parameter version (one extra copy of the layer weights in memory). A step decodes a prefix
of the slots (``batch``; the engine allocates the lowest free slots first) and samples one token
per slot in the same jitted call (:mod:`rl_jax.generator.engine.sampling`); the cache layout, page
table and slot state are :mod:`rl_jax.generator.engine.kv_cache`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.generator.engine.kv_cache import SAMPLING_FIELDS, SlotState, gather_pages
from rl_jax.generator.engine.sampling import pack, sample
from rl_jax.models.config import ModelConfig
from rl_jax.models.fused_attention import attention_mask
from rl_jax.models.transformer import (apply_rotary, decoder_layer, mlp_activation, output_logits,
                                       pre_norm_block, qk_norm, rms_norm, rotary_tables,
                                       unembedding)


# ---- prefill -------------------------------------------------------------------------------------

def prefill(params: dict[str, Any], tokens: jax.Array, lengths: jax.Array, *, cfg: ModelConfig,
            dtype: Any, constrain=None, attention_impl: str = "xla", num_devices: int = 1):
    """Runs prompts ``tokens [B, P]`` (right-padded to ``P``; true ``lengths [B]``).

    ``attention_impl``: the prompts' causal self-attention kernel
    (:mod:`rl_jax.models.fused_attention`; ``"auto"``: cuDNN flash attention on a GPU, splash
    on a TPU, where this ``P`` and dtype fit them, else XLA's); ``num_devices``: devices the
    arrays are spread over. Each prompt is one segment and its padding another.

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
                             constrain=constrain, attention_impl=attention_impl,
                             segment_ids=segment, num_devices=num_devices)

    h, (k, v) = jax.lax.scan(layer, x, params["layers"])
    last = h[jnp.arange(b), lengths - 1]
    h = rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    return k, v, output_logits(h, unembedding(params, cfg))


# ---- decode weights ------------------------------------------------------------------------------

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
    return {"embed": params["embed"], "final_norm": params["final_norm"],
            "unembed": unembedding(params, cfg).astype(dtype), "layers": tuple(layers)}


# ---- decode --------------------------------------------------------------------------------------

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


def attend_pages(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                 positions: jax.Array, *, dtype: Any, contiguous=None) -> jax.Array:
    """Attention of one query per slot over its pages: ``table [S, W]``'s pages of ``k_pool
    [N, K, Dh, P]`` and ``v_pool [N, K, P, Dh]`` gathered into the contiguous form
    (``kv_cache.gather_pages``), then :func:`attend`, or ``contiguous(q, keys, values,
    positions)`` (a kernel over that form)."""
    keys, values = gather_pages(k_pool, v_pool, table)
    if contiguous is not None:
        return contiguous(q, keys, values, positions)
    return attend(q, keys.astype(dtype), values.astype(dtype), positions, dtype=dtype)


def decode_layer(h, w, k_pool, v_pool, table, positions, cos, sin, *, cfg, dtype, constrain,
                 attention=None):
    """One decoder layer for one token per slot: ``h [S, D]``; the layer's key pages
    ``[N, K, Dh, P]`` and value pages ``[N, K, P, Dh]`` and the slots' page table rows
    ``table [S, W]``. The training model's layer (``models.transformer.pre_norm_block``) over
    :func:`prepare_decode_weights`' layout. ``attention``: a paged decode attention kernel
    (``attention(q, k_pool, v_pool, table, positions)``, see
    :mod:`rl_jax.generator.engine.kernels`),
    which reads each slot's pages up to its position only; ``None`` for :func:`attend_pages`.
    Returns ``(h, k_pool, v_pool)``."""
    s = h.shape[0]
    kv_heads, hd = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // kv_heads

    def attention_block(x):
        qkv = x @ w["wqkv"]
        if cfg.attention_bias:
            qkv = qkv + w["bqkv"]
        qkv = constrain(qkv.reshape(s, kv_heads, g + 2, hd),
                        ("act_batch", "act_kv_heads", None, "head_dim"))
        q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
        q, k = qk_norm(q, k, w, cfg)
        # One token per slot: rotated as the training model's [B, T=1, heads, Dh].
        q = apply_rotary(q.reshape(s, 1, kv_heads * g, hd), cos, sin).reshape(s, kv_heads, g, hd)
        k = apply_rotary(k[:, None], cos, sin)[:, 0]
        caches, attn = _write_and_attend(q, k, v, k_pool, v_pool, table, positions,
                                         dtype=dtype, attention=attention)
        out = attn.reshape(s, kv_heads * g * hd) @ w["wo"]
        if cfg.output_bias:
            out = out + w["bo"]
        return out, caches

    def mlp_block(x):
        gate_up = jnp.einsum("sd,dcf->scf", x, w["w_gate_up"])
        act = constrain(mlp_activation(gate_up[:, 0], gate_up[:, 1]), ("act_batch", "act_mlp"))
        return act @ w["w_down"]

    h, (k_pool, v_pool) = pre_norm_block(h, w, cfg, attention_block=attention_block,
                                         mlp_block=mlp_block, constrain=constrain,
                                         axes=("act_batch", "act_embed"))
    return h, k_pool, v_pool


def _write_and_attend(q, k, v, k_pool, v_pool, table, positions, *, dtype, attention):
    """Writes each slot's new key and value ``k, v [S, K, Dh]`` at its position into its page
    (dropped where its table row names no page there), then attends ``q [S, K, G, Dh]`` over
    the slots' pages. Returns ``((k_pool, v_pool), attn [S, K, G, Dh])``."""
    num_pages, size = k_pool.shape[0], k_pool.shape[3]
    s, width = table.shape
    column = positions // size
    page = jnp.where(column < width,
                     table[jnp.arange(s), jnp.minimum(column, width - 1)], num_pages)
    offset = positions % size
    k_pool = k_pool.at[page, :, :, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[page, :, offset].set(v.astype(v_pool.dtype), mode="drop")
    if attention is not None:
        attn = attention(q, k_pool, v_pool, table, positions).astype(dtype)
    else:
        attn = attend_pages(q, k_pool, v_pool, table, positions, dtype=dtype)
    return (k_pool, v_pool), attn


def decode(weights: dict[str, Any], k_cache: tuple[jax.Array, ...],
           v_cache: tuple[jax.Array, ...], state: SlotState, table: jax.Array, *, batch: int,
           filtered: bool, cfg: ModelConfig, dtype: Any, max_seq_len: int, constrain=None,
           attention=None):
    """One decode step of slots ``0..batch-1``: feeds each slot's last token, writes its keys and
    values, samples the next token.

    Args:
      weights: :func:`prepare_decode_weights` output.
      k_cache, v_cache: per layer, the page pools: keys ``[N, K, Dh, P]`` and values
        ``[N, K, P, Dh]`` (:mod:`rl_jax.generator.engine.kv_cache`).
      state: :data:`SlotState`, ``[slots]`` arrays.
      table: ``[batch, W]`` int32, the page table rows of slots ``0..batch-1``
        (``kv_cache.PageTable``; positions ``< W·P`` are attended).
      batch: slots decoded (a prefix of the slots; the others are untouched).
      filtered: whether any slot uses top-k/top-p/min-p (see
        :func:`rl_jax.generator.engine.sampling.sample`).
      attention: a paged decode attention (:mod:`rl_jax.generator.engine.kernels`' native CPU
      kernel,
        or :func:`attend_pages` over the Pallas kernel; see ``ModelRunner._choose_attention``),
        ``None`` for :func:`attend_pages` over :func:`attend`.

    Returns ``(k_cache, v_cache, state, out)`` with the caches and state advanced (tokens, positions
    and token indices of slots ``< batch``) and ``out [3, batch]`` int32: the sampled tokens and
    their float32 log-probabilities' bits.
    """
    constrain = constrain or (lambda x, axes: x)
    if table.shape[0] != batch:
        raise ValueError(f"decode batch {batch} needs {batch} page table rows, got "
                         f"{table.shape[0]}")
    st = {name: value[:batch] for name, value in state.items()}
    positions = st["position"]
    cos, sin = rotary_tables(positions[:, None], cfg.head_dim, cfg.rope_theta,
                             cfg.rope_scaling_dict)
    h = jnp.take(weights["embed"], st["token"], axis=0).astype(dtype)
    new_k, new_v = [], []
    for w, kc, vc in zip(weights["layers"], k_cache, v_cache):
        h, kc, vc = decode_layer(h, w, kc, vc, table, positions, cos, sin, cfg=cfg,
                                 dtype=dtype, constrain=constrain, attention=attention)
        new_k.append(kc)
        new_v.append(vc)
    h = rms_norm(h, weights["final_norm"], cfg.rms_norm_eps)
    logits = output_logits(h, weights["unembed"])
    tokens, logprobs, unfiltered = sample(logits, *(st[name] for name in SAMPLING_FIELDS),
                                          st["token_index"], filtered=filtered)
    state = dict(state)
    state["token"] = state["token"].at[:batch].set(tokens)
    state["position"] = state["position"].at[:batch].set(
        jnp.minimum(positions + 1, max_seq_len - 1))
    state["token_index"] = state["token_index"].at[:batch].add(1)
    return tuple(new_k), tuple(new_v), state, pack(tokens, logprobs, unfiltered)


def decode_many(weights: dict[str, Any], k_cache: tuple[jax.Array, ...],
                v_cache: tuple[jax.Array, ...], state: SlotState, table: jax.Array, *,
                steps: int, batch: int,
                filtered: bool, cfg: ModelConfig, dtype: Any, max_seq_len: int, constrain=None,
                attention=None):
    """``steps`` :func:`decode` steps in one program, each step's tokens feeding the next (the
    host reads them together): ``out [steps, 3, batch]``. Each token is sampled exactly as by
    one step at a time (its key depends on the slot's seed, sample and token index only)."""
    outs = []
    for _ in range(steps):  # unrolled: a step's ops stay as fused as in a single step
        k_cache, v_cache, state, out = decode(weights, k_cache, v_cache, state, table,
                                              batch=batch, filtered=filtered, cfg=cfg,
                                              dtype=dtype, max_seq_len=max_seq_len,
                                              constrain=constrain, attention=attention)
        outs.append(out)
    return k_cache, v_cache, state, jnp.stack(outs)
