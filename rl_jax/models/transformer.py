"""Decoder-only transformer (Llama, Qwen2, Qwen3 families) in Flax NNX.

Layers are stacked: every per-layer weight has a leading ``layers`` axis and the forward pass is a
``lax.scan`` over layers, so compile time does not grow with depth (``scan_layers=False`` unrolls
it: code per layer and no ``[L, ...]`` stacks of the activations saved for the backward pass;
see :class:`Transformer`). Every parameter is an
``nnx.Param`` carrying ``logical_axes`` metadata that :class:`rl_jax.sharding.ShardingRules` maps
onto a mesh.

Shapes: ``B`` batch, ``T`` query tokens, ``S`` key tokens, ``D`` hidden, ``H`` query heads,
``K`` key/value heads, ``Dh`` head dim, ``F`` MLP hidden, ``V`` vocabulary, ``L`` layers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rl_jax.models.config import ModelConfig
from rl_jax.models.fused_attention import attention_mask, check_implementation, fused_attention
from rl_jax.models.logprobs import blockwise_token_logprobs, blockwise_token_stats
from rl_jax.models.lora import (Dropout, LoraConfig, adapter_specs, init_adapter, lora_delta,
                                scaled_layer_weights)
from rl_jax.sharding import ShardingRules

# Stacked per-layer parameters: name → (shape builder, logical axes). Shapes exclude the leading
# layers axis, which every entry has.
def layer_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    d, f, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim)
    specs = {
        "attn_norm": ((d,), ("norm",)),
        "wq": ((d, h, hd), ("embed", "q_heads", "head_dim")),
        "wk": ((d, k, hd), ("embed", "kv_heads", "head_dim")),
        "wv": ((d, k, hd), ("embed", "kv_heads", "head_dim")),
        "wo": ((h, hd, d), ("q_heads", "head_dim", "embed")),
        "mlp_norm": ((d,), ("norm",)),
        "w_gate": ((d, f), ("embed", "mlp")),
        "w_up": ((d, f), ("embed", "mlp")),
        "w_down": ((f, d), ("mlp", "embed")),
    }
    if cfg.attention_bias:
        specs["bq"] = ((h, hd), ("q_heads", "head_dim"))
        specs["bk"] = ((k, hd), ("kv_heads", "head_dim"))
        specs["bv"] = ((k, hd), ("kv_heads", "head_dim"))
    if cfg.output_bias:
        specs["bo"] = ((d,), ("embed",))
    if cfg.qk_norm:
        specs["q_norm"] = ((hd,), ("head_dim",))
        specs["k_norm"] = ((hd,), ("head_dim",))
    return {name: (shape, ("layers",) + axes) for name, (shape, axes) in specs.items()}


def _init_for(name: str, shape: tuple[int, ...]):
    if "norm" in name:
        return nnx.initializers.ones
    if name.startswith("b"):
        return nnx.initializers.zeros
    return nnx.initializers.normal(0.02)


class Layers(nnx.Module):
    """All decoder layers' weights, stacked along a leading ``layers`` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        for name, (shape, axes) in layer_param_specs(cfg).items():
            full = (cfg.num_layers,) + shape
            value = _init_for(name, shape)(rngs.params(), full, param_dtype)
            setattr(self, name, nnx.Param(value, logical_axes=axes))

    def add_adapters(self, cfg: ModelConfig, lora: LoraConfig, key: jax.Array, param_dtype):
        """Low-rank adapters (``nnx.LoRAParam``) on the projections ``lora`` targets (see
        :mod:`rl_jax.models.lora`), drawn from ``key``."""
        specs = adapter_specs(cfg, layer_param_specs(cfg), lora)
        for i, (name, (shape, axes, fan_in)) in enumerate(sorted(specs.items())):
            value = init_adapter(jax.random.fold_in(key, i), name, shape, fan_in, param_dtype)
            setattr(self, name, nnx.LoRAParam(value, logical_axes=axes))

    def weights(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in sorted(vars(self))
                if isinstance(getattr(self, name), nnx.Param)}


class Transformer(nnx.Module):
    """A causal language model.

    Args:
      config: the model's shape.
      rngs: parameter initialisation randomness.
      dtype: computation dtype (activations, matmul inputs); norms and softmax run in float32.
      param_dtype: storage dtype of parameters.
      mesh, rules: when given, activations are constrained to ``rules`` on ``mesh``.
      remat: rematerialise each layer in the backward pass (``"none"``, ``"full"``, ``"dots"``).
      scan_layers: run the layers as a rolled ``lax.scan`` (compile time independent of depth)
        or unrolled (every layer its own code, and no ``[L, ...]`` stacks of the activations
        the backward pass keeps). On a CPU those stacks are large temporary buffers allocated
        on every call, which glibc maps afresh each time (page faults), so unrolled is faster
        there unless ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295`` keeps those
        buffers in the heap (timings in ``docs/performance.md``).
      attention: ``"auto"`` (cuDNN flash attention on an NVIDIA GPU, the splash kernel on a
        single TPU, when the inputs fit; XLA otherwise and on a CPU), ``"xla"``, ``"cudnn"`` or
        ``"splash"`` (these two raise when they cannot take the inputs); see
        :mod:`rl_jax.models.fused_attention`.
      lora: low-rank adapters on the projections it targets (:mod:`rl_jax.models.lora`),
        drawn after every base parameter, so the base equals the unadapted model's of the same
        ``rngs``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, mesh: Mesh | None = None,
                 rules: ShardingRules | None = None, remat: str = "none",
                 scan_layers: bool = True, attention: str = "auto",
                 lora: LoraConfig | None = None):
        if remat not in ("none", "full", "dots"):
            raise ValueError(f"remat must be 'none', 'full' or 'dots', got {remat!r}")
        self.config = config
        self.dtype = dtype
        self.mesh = mesh
        self.rules = rules or ShardingRules.default()
        self.remat = remat
        self.scan_layers = bool(scan_layers)
        self.attention = check_implementation(attention)
        d, v = config.hidden_size, config.vocab_size
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(normal(rngs.params(), (v, d), param_dtype),
                               logical_axes=("vocab", "embed"))
        self.layers = Layers(config, rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((d,), param_dtype), logical_axes=("norm",))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(normal(rngs.params(), (d, v), param_dtype),
                                     logical_axes=("embed", "vocab"))
        self.lora = lora
        # A training forward's adapter-dropout key (set by the trainer on the model it builds
        # for one micro-batch: ModelSpec.merge); None: no dropout.
        self.lora_dropout_key = None
        if lora is not None:
            self.layers.add_adapters(config, lora, rngs.params(), param_dtype)

    # ---- forward ------------------------------------------------------------------------------

    def _constrain(self, x, axes):
        return self.rules.constrain(x, self.mesh, axes)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None,
                 prefix_ids: jax.Array | None = None) -> jax.Array:
        """Final hidden states ``[B, T, D]`` (after the final norm).

        Args:
          tokens: ``[B, T]`` int token ids.
          positions: ``[B, T]`` rotary positions; default ``0..T-1`` per row. For packed rows,
            positions restart at 0 in each segment.
          segment_ids: ``[B, T]``; a token attends only to earlier tokens of its own segment.
            Default: one segment per row.
          prefix_ids: ``[B, T]``; where ``> 0``, the token also attends to the (earlier) tokens
            of that segment of its row: a prompt shared by several completions packed once
            (see :func:`rl_jax.data.packing.pack_shared_prefixes`). Default: none.
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        cfg = self.config
        # FSDP: gather the whole table before the lookup (a gather from a table sharded on both
        # axes makes the partitioner replicate in a worse place).
        table = self._constrain(self.embed[...], (None, None))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        x = self._constrain(x, ("act_batch", "act_seq", "act_embed"))
        token_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = attention_mask(token_index, segment_ids, token_index, segment_ids, prefix_ids)
        # Prefix segments widen the mask beyond "causal within a segment": only the mask says it.
        plain_segments = segment_ids if prefix_ids is None else None
        num_devices = 1 if self.mesh is None else self.mesh.size
        cos, sin = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)

        dropout_key = None
        if self.lora is not None and self.lora.dropout and self.lora_dropout_key is not None:
            dropout_key = self.lora_dropout_key

        def layer(h, xs):
            w, index = xs if dropout_key is not None else (xs, None)
            drop = (None if dropout_key is None else
                    (jax.random.fold_in(dropout_key, index), self.lora.dropout))
            h, _ = decoder_layer(h, w, cfg, cos=cos, sin=sin, mask=mask, dtype=self.dtype,
                                 constrain=self._constrain, attention_impl=self.attention,
                                 segment_ids=plain_segments, num_devices=num_devices,
                                 lora_dropout=drop)
            return h, None

        if self.remat == "full":
            layer = jax.checkpoint(layer, prevent_cse=False)
        elif self.remat == "dots":
            layer = jax.checkpoint(
                layer, prevent_cse=False,
                policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        weights = scaled_layer_weights(self.layers.weights(), self.lora)
        if dropout_key is not None:
            weights = (weights, jnp.arange(cfg.num_layers, dtype=jnp.int32))
        x, _ = jax.lax.scan(layer, x, weights,
                            unroll=1 if self.scan_layers else cfg.num_layers)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)

    def unembedding(self) -> jax.Array:
        """The ``[D, V]`` output projection (the transposed embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Full ``[..., V]`` float32 logits. Prefer :meth:`token_logprobs` for training."""
        return output_logits(hidden, self.unembedding())

    def token_logprobs(self, tokens: jax.Array, targets: jax.Array,
                       positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                       *, block_size: int = 4096, return_entropy: bool = False,
                       prefix_ids: jax.Array | None = None):
        """Log-probabilities ``[B, T]`` of ``targets`` given ``tokens`` (and entropies if asked),
        computed blockwise over the vocabulary."""
        hidden = self(tokens, positions, segment_ids, prefix_ids)
        return blockwise_token_logprobs(hidden, self.unembedding(), targets,
                                        block_size=block_size, return_entropy=return_entropy)

    def token_stats(self, tokens: jax.Array, targets: jax.Array,
                    positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                    *, block_size: int = 4096, temperature: float = 1.0,
                    prefix_ids: jax.Array | None = None) -> dict[str, jax.Array]:
        """``logprobs``, ``entropy`` and ``is_argmax`` (each ``[B, T]``) of ``targets`` under
        ``softmax(logits / temperature)`` (the distribution a generator sampling at that
        temperature draws from); see :func:`rl_jax.models.logprobs.blockwise_token_stats`."""
        hidden = self(tokens, positions, segment_ids, prefix_ids)
        if temperature != 1.0:
            hidden = hidden / jnp.asarray(temperature, hidden.dtype)
        return blockwise_token_stats(hidden, self.unembedding(), targets, block_size=block_size)


# ---- building blocks (pure functions, shared with the inference engine) ---------------------
# The generator's decode path (rl_jax.generator.engine.decode) builds its layer from these too; what
# it
# computes differently (fused projection matrices over its own weight layout, attention over the
# slot cache) is explained there.

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32, cast back before scaling (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: dict[str, Any] | None = None) -> np.ndarray:
    """``[Dh/2]`` float32 inverse frequencies, with ``linear`` or ``llama3`` scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling:
        kind = scaling.get("rope_type", "default")
        factor = float(scaling.get("factor", 1.0))
        if kind == "linear":
            inv = inv / factor
        elif kind == "llama3":
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old_len = float(scaling.get("original_max_position_embeddings", 8192))
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary_tables(positions: jax.Array, head_dim: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``[B, T, Dh]`` (half-rotation layout, as HF)."""
    inv = jnp.asarray(rope_inverse_frequencies(head_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B, T, N, Dh]`` by per-token angles ``cos, sin [B, T, Dh]``."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
              implementation: str = "xla", segment_ids: jax.Array | None = None,
              causal_self: bool = False, num_devices: int = 1) -> jax.Array:
    """Grouped-query attention. ``q [B,T,H,Dh]``, ``k, v [B,S,K,Dh]``, ``mask [B,T,S]`` →
    ``[B,T,H,Dh]``. Scores and softmax in float32.

    ``"xla"`` is ``jax.nn.dot_product_attention`` with the mask: on a CPU its XLA lowering keeps
    the ``[T, S]`` score matrices in the layouts its products want (grouped einsums, whose scores
    need transposing, are slower; see ``docs/performance.md``).
    Fused kernels (``implementation`` ``"auto"``, ``"cudnn"``, ``"splash"``) are considered only
    for ``causal_self`` attention; ``segment_ids [B,T]`` are given when the mask is exactly
    causal-within-segments. See :func:`rl_jax.models.fused_attention.select_implementation`."""
    return fused_attention(q, k, v, mask, implementation=implementation,
                           segment_ids=segment_ids, causal_self=causal_self,
                           num_devices=num_devices)


def project_qkv(x: jax.Array, w: dict[str, jax.Array], cfg: ModelConfig, cos: jax.Array,
                sin: jax.Array, dtype, lora_dropout: Dropout | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalised input ``x [B,T,D]`` → rotated ``q [B,T,H,Dh]``, ``k, v [B,T,K,Dh]``; with
    adapters in ``w``, their low-rank terms added (``lora_dropout`` on their inputs)."""
    def proj(name):
        base = jnp.einsum("btd,dhk->bthk", x, w[name].astype(dtype))
        return _with_adapter(base, x, w, name, dtype, dropout=lora_dropout)

    q, k, v = proj("wq"), proj("wk"), proj("wv")
    if cfg.attention_bias:
        q = q + w["bq"].astype(dtype)
        k = k + w["bk"].astype(dtype)
        v = v + w["bv"].astype(dtype)
    q, k = qk_norm(q, k, w, cfg)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def qk_norm(q: jax.Array, k: jax.Array, w: dict[str, jax.Array], cfg: ModelConfig
            ) -> tuple[jax.Array, jax.Array]:
    """Projected queries and keys (``[..., Dh]``: any layout with the head dim last) with each
    head RMS-normalised where the family has qk-norm (Qwen3); unchanged otherwise. The rotary
    embedding (:func:`apply_rotary`) comes after it."""
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
    return q, k


def attention_output(attn: jax.Array, w: dict[str, jax.Array], cfg: ModelConfig, dtype,
                     lora_dropout: Dropout | None = None):
    out = _with_adapter(jnp.einsum("bthk,hkd->btd", attn, w["wo"].astype(dtype)), attn, w,
                        "wo", dtype, n_in=2, dropout=lora_dropout)
    if cfg.output_bias:
        out = out + w["bo"].astype(dtype)
    return out


def mlp(x: jax.Array, w: dict[str, jax.Array], dtype, constrain=None,
        lora_dropout: Dropout | None = None) -> jax.Array:
    gate = _with_adapter(jnp.einsum("btd,df->btf", x, w["w_gate"].astype(dtype)), x, w,
                         "w_gate", dtype, dropout=lora_dropout)
    up = _with_adapter(jnp.einsum("btd,df->btf", x, w["w_up"].astype(dtype)), x, w, "w_up",
                       dtype, dropout=lora_dropout)
    act = mlp_activation(gate, up)
    if constrain is not None:
        act = constrain(act, ("act_batch", "act_seq", "act_mlp"))
    return _with_adapter(jnp.einsum("btf,fd->btd", act, w["w_down"].astype(dtype)), act, w,
                         "w_down", dtype, dropout=lora_dropout)


def _with_adapter(y: jax.Array, x: jax.Array, w: dict[str, jax.Array], weight: str, dtype,
                  n_in: int = 1, dropout: Dropout | None = None) -> jax.Array:
    """``y`` (the base projection of ``x``) plus the adapter's low-rank term where ``w`` holds
    one for ``weight``."""
    delta = lora_delta(x, w, weight, dtype, n_in=n_in, dropout=dropout)
    return y if delta is None else y + delta


def mlp_activation(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's hidden activation from its gate and up projections (SwiGLU:
    ``silu(gate) * up``), ``[..., F]``."""
    return jax.nn.silu(gate) * up


def unembedding(params: dict[str, Any], cfg: ModelConfig) -> jax.Array:
    """The ``[D, V]`` output projection of a parameter dict (the transposed embedding when
    tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def output_logits(hidden: jax.Array, unembed: jax.Array) -> jax.Array:
    """Float32 logits ``[..., V]`` of final hidden states ``[..., D]`` (after the final norm)
    and the output projection ``unembed [D, V]``."""
    return jnp.einsum("...d,dv->...v", hidden, unembed.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


def pre_norm_block(h: jax.Array, w: dict[str, jax.Array], cfg: ModelConfig, *, attention_block,
                   mlp_block, constrain, axes: tuple[str, ...]):
    """A decoder layer's residual structure around whatever computes its two parts:
    ``h + attention_block(rms_norm(h))``, then that plus ``mlp_block(rms_norm(·))``, each sum
    constrained to the logical ``axes`` of ``h``. ``attention_block(x)`` returns ``(out,
    extra)``; the result is ``(h, extra)``."""
    out, extra = attention_block(rms_norm(h, w["attn_norm"], cfg.rms_norm_eps))
    h = constrain(h + out, axes)
    h = h + mlp_block(rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps))
    return constrain(h, axes), extra


def write_cache(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes ``new [B,T,K,Dh]`` into ``cache [B,S,K,Dh]`` at rows ``start[b] .. start[b]+T-1``."""
    def one(c, x, s):
        return jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0))
    return jax.vmap(one)(cache, new, start)


def decoder_layer(h: jax.Array, w: dict[str, jax.Array], cfg: ModelConfig, *, cos, sin, mask,
                  dtype, constrain=None, cache=None, attention_impl: str = "xla",
                  segment_ids: jax.Array | None = None, num_devices: int = 1,
                  lora_dropout: Dropout | None = None):
    """One pre-norm decoder layer on ``h [B,T,D]`` with per-layer weights ``w``.

    Without ``cache`` queries attend to this call's own keys (``mask [B,T,T]``) and the result is
    ``(h, (k, v))`` with the new keys/values ``[B,T,K,Dh]``. With ``cache = (k_cache, v_cache,
    start)`` (caches ``[B,S,K,Dh]``, ``start [B]``), the new keys/values are first written at rows
    ``start..start+T-1`` and queries attend over the whole cache (``mask [B,T,S]``); the result is
    ``(h, (k_cache, v_cache))`` updated.

    ``attention_impl`` picks the attention kernel (see :func:`attention`); without a cache the
    mask must be causal self-attention (``mask [B,T,T]`` from equal query and key indices), with
    ``segment_ids [B,T]`` when it is exactly causal-within-segments. Attention over a cache
    always runs on XLA. ``lora_dropout``: ``(key, rate)`` of adapter dropout (training).
    """
    constrain = constrain or (lambda x, axes: x)

    def attention_block(x):
        q, k, v = project_qkv(x, w, cfg, cos, sin, dtype, lora_dropout)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", "head_dim"))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", "head_dim"))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", "head_dim"))
        if cache is not None:
            k_cache, v_cache, start = cache
            k = write_cache(k_cache, k, start)
            v = write_cache(v_cache, v, start)
        attn = attention(q, k.astype(dtype), v.astype(dtype), mask,
                         implementation=attention_impl,
                         segment_ids=segment_ids if cache is None else None,
                         causal_self=cache is None, num_devices=num_devices)
        return attention_output(attn, w, cfg, dtype, lora_dropout), (k, v)

    return pre_norm_block(h, w, cfg, attention_block=attention_block,
                          mlp_block=lambda x: mlp(x, w, dtype, constrain, lora_dropout),
                          constrain=constrain,
                          axes=("act_batch", "act_seq", "act_embed"))
