"""Fused attention kernels for causal self-attention over packed segments, chosen by backend.

Implementations (the ``attention`` switch of :class:`rl_jax.models.transformer.Transformer`):

- ``"xla"``: ``jax.nn.dot_product_attention`` with the ``[B, T, S]`` boolean mask, as XLA
  lowers it (the scores are materialised). Runs everywhere; the reference for the others.
- ``"cudnn"``: cuDNN's flash attention through ``jax.nn.dot_product_attention(...,
  implementation="cudnn", is_causal=True)`` with the same boolean mask, which JAX hands to the
  kernel as an additive bias. Any mask is exact this way: several segments per row, padding, a
  shared prompt's prefix segment. (The public ``query_seq_lengths``/``key_value_seq_lengths``
  describe one right-padded sequence per row and cannot say where packed segments start; the
  segment-offset form of packing is not part of JAX's public API.) Needs an NVIDIA GPU of compute
  capability 8.0 or newer, bfloat16/float16, a head dimension that is a multiple of 8 and at most
  128, and even query/key lengths (cuDNN's rule for a bias in training).
- ``"splash"``: the Pallas TPU splash-attention kernel with a static causal mask and the
  segment ids (``SegmentIds``); grouped-query attention runs one multi-query kernel per key/value
  head. Needs a TPU, query and key lengths that are multiples of 128, a single device (the kernel
  is not partitioned automatically across a mesh), and no prefix segments (a query may attend only
  to its own segment).
- ``"auto"`` (the default): ``"cudnn"`` on such a GPU, ``"splash"`` on a TPU, when the inputs fit;
  ``"xla"`` otherwise, and always on a CPU. A named fused implementation whose requirements are not
  met raises a ``ValueError`` saying which one, instead of quietly running something else.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128
SPLASH_BLOCK = 128


def attention_mask(q_index: jax.Array, q_segment: jax.Array, kv_index: jax.Array,
                   kv_segment: jax.Array, q_prefix: jax.Array | None = None) -> jax.Array:
    """``[B, T, S]`` boolean: query t may attend key s (causal, and the same segment or the
    query's prefix segment ``q_prefix > 0``)."""
    causal = q_index[:, :, None] >= kv_index[:, None, :]
    same = q_segment[:, :, None] == kv_segment[:, None, :]
    if q_prefix is not None:
        prefix = q_prefix[:, :, None]
        same = same | ((prefix > 0) & (prefix == kv_segment[:, None, :]))
    return causal & same


def check_implementation(name: str) -> str:
    """``name`` if it is one of :data:`IMPLEMENTATIONS`, else a ``ValueError`` naming it."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {name!r}")
    return name


def current_backend() -> str:
    """``"cuda"`` (an NVIDIA GPU of compute capability >= 8.0, where cuDNN flash attention
    runs), ``"gpu"`` (any other GPU), ``"tpu"`` or ``"cpu"`` for JAX's default backend."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if "cuda" not in device.client.platform_version.lower() or capability is None:
        return "gpu"
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return "cuda" if (major, minor) >= (8, 0) else "gpu"


def cudnn_unsupported(*, backend: str, dtype: Any, head_dim: int, q_len: int,
                      kv_len: int) -> str | None:
    """Why cuDNN flash attention cannot take these inputs, or ``None`` when it can."""
    if backend != "cuda":
        return f"cuDNN flash attention needs an NVIDIA GPU (sm80+), the backend is {backend!r}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"cuDNN flash attention needs bfloat16 or float16, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN flash attention needs a head_dim that is a multiple of 8 and at most "
                f"{CUDNN_MAX_HEAD_DIM}, got {head_dim}")
    if q_len % 2 or kv_len % 2:
        return f"cuDNN flash attention with a mask needs even lengths, got T={q_len}, S={kv_len}"
    return None


def splash_unsupported(*, backend: str, q_len: int, kv_len: int, has_segment_ids: bool,
                       num_devices: int) -> str | None:
    """Why the splash kernel cannot take these inputs, or ``None`` when it can."""
    if backend != "tpu":
        return f"splash attention needs a TPU, the backend is {backend!r}"
    if not has_segment_ids:
        return "splash attention needs plain segment ids (prefix segments cannot be expressed)"
    if q_len % SPLASH_BLOCK or kv_len % SPLASH_BLOCK:
        return (f"splash attention needs lengths that are multiples of {SPLASH_BLOCK}, got "
                f"T={q_len}, S={kv_len}")
    if num_devices != 1:
        return f"splash attention runs on one device here, the mesh has {num_devices}"
    return None


def select_implementation(requested: str, *, backend: str, dtype: Any, head_dim: int,
                          q_len: int, kv_len: int, causal_self: bool, has_segment_ids: bool,
                          num_devices: int = 1) -> str:
    """The implementation that runs: ``"xla"``, ``"cudnn"`` or ``"splash"``.

    Args:
      requested: one of :data:`IMPLEMENTATIONS`.
      backend: as :func:`current_backend` names it.
      dtype: the dtype of queries, keys and values.
      causal_self: the mask is causal self-attention (query ``t`` and key ``t`` are the same
        token), restricted to segments; false for attention over a cache.
      has_segment_ids: the mask is exactly "causal and same segment" and the segment ids are at
        hand (false when prefix segments widen it).
      num_devices: devices the arrays are spread over.

    ``"auto"`` falls back to ``"xla"`` when no fused kernel fits; a named fused implementation
    that does not fit raises a ``ValueError`` with the reason.
    """
    check_implementation(requested)
    if requested == "xla":
        return "xla"
    reasons = {}
    for name in ("cudnn", "splash"):
        if not causal_self:
            reasons[name] = f"{name} attention is used only for causal self-attention"
        elif name == "cudnn":
            reasons[name] = cudnn_unsupported(backend=backend, dtype=dtype, head_dim=head_dim,
                                              q_len=q_len, kv_len=kv_len)
        else:
            reasons[name] = splash_unsupported(backend=backend, q_len=q_len, kv_len=kv_len,
                                               has_segment_ids=has_segment_ids,
                                               num_devices=num_devices)
    if requested == "auto":
        preferred = {"cuda": "cudnn", "tpu": "splash"}.get(backend)
        return preferred if preferred and reasons[preferred] is None else "xla"
    if reasons[requested] is not None:
        raise ValueError(f"attention={requested!r} cannot run: {reasons[requested]}")
    return requested


# ---- kernels ----------------------------------------------------------------------------------

def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The reference: ``q [B,T,H,Dh]``, ``k, v [B,S,K,Dh]``, ``mask [B,T,S]`` → ``[B,T,H,Dh]``."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """cuDNN flash attention with ``mask [B,T,S]`` (which must be causal: ``is_causal`` lets the
    kernel skip the blocks above the diagonal, and the mask removes the rest)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True,
                                        implementation="cudnn")


@functools.lru_cache(maxsize=32)
def _splash_kernel(q_len: int, kv_len: int, group: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    block = max(b for b in (512, 256, SPLASH_BLOCK) if q_len % b == 0 and kv_len % b == 0)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    mask = sa.MultiHeadMask([sa.CausalMask((q_len, kv_len))] * group)
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mqa_single_device(mask=mask, block_sizes=sizes,
                                                interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     interpret: bool = False) -> jax.Array:
    """Causal attention within segments by the splash kernel: ``q [B,T,H,Dh]``,
    ``k, v [B,S,K,Dh]``, ``segment_ids [B,T]`` (keys share the queries' ids: self-attention) →
    ``[B,T,H,Dh]``. ``interpret`` runs the kernel in Pallas' interpreter (any backend)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, dh = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kv_heads})")
    group = h // kv_heads
    kernel = _splash_kernel(t, s, group, interpret)
    scale = jnp.asarray(1.0 / np.sqrt(dh), q.dtype)
    # [B, K, G, T, Dh] queries against [B, K, S, Dh] keys: one multi-query kernel per kv head.
    qg = (q * scale).reshape(b, t, kv_heads, group, dh).transpose(0, 2, 3, 1, 4)
    kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    ids = sa.SegmentIds(q=segment_ids.astype(jnp.int32), kv=segment_ids.astype(jnp.int32))
    per_row = jax.vmap(kernel, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_row, in_axes=(0, 0, 0, 0))(qg, kg, vg, ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                    implementation: str = "xla", segment_ids: jax.Array | None = None,
                    causal_self: bool = False, num_devices: int = 1) -> jax.Array:
    """Attention by the implementation :func:`select_implementation` picks for these inputs on
    the current backend. ``mask [B,T,S]`` is always given (the XLA and cuDNN paths use it);
    ``segment_ids [B,T]`` only when the mask is exactly causal-within-segments."""
    chosen = select_implementation(
        implementation, backend=current_backend(), dtype=q.dtype, head_dim=q.shape[-1],
        q_len=q.shape[1], kv_len=k.shape[1], causal_self=causal_self,
        has_segment_ids=segment_ids is not None, num_devices=num_devices)
    if chosen == "cudnn":
        return cudnn_attention(q, k, v, mask)
    if chosen == "splash":
        return splash_attention(q, k, v, segment_ids)
    return xla_attention(q, k, v, mask)


def compile_problem(implementation: str, *, dtype: Any, heads: int, kv_heads: int,
                    head_dim: int, length: int = SPLASH_BLOCK) -> str | None:
    """Why ``implementation`` does not compile on the current backend for these heads (one
    causal-within-segments attention of ``length`` tokens, compiled), or ``None`` when it does:
    a start-up probe, so that ``"auto"`` can fall back to XLA instead of failing later."""

    q = jax.ShapeDtypeStruct((1, length, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, length, kv_heads, head_dim), dtype)
    segments = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def probe(q, k, v, segment_ids):
        index = jnp.arange(length, dtype=jnp.int32)[None]
        mask = attention_mask(index, segment_ids, index, segment_ids)
        return fused_attention(q, k, v, mask, implementation=implementation,
                               segment_ids=segment_ids, causal_self=True)

    try:
        jax.jit(probe).lower(q, kv, kv, segments).compile()
    except Exception as e:  # any lowering or compilation failure is the answer
        return f"{type(e).__name__}: {e}"[:500]
    return None


# ---- self-check on the current backend ---------------------------------------------------------

def packed_example(*, batch: int = 2, length: int = 512, heads: int = 8, kv_heads: int = 2,
                   head_dim: int = 128, dtype: Any = jnp.bfloat16, seed: int = 0):
    """Random ``q, k, v`` and ``segment_ids [B, T]`` of packed rows: several segments of uneven
    lengths per row (ids 1, 2, ...) and trailing padding (id 0)."""
    rng = np.random.default_rng(seed)
    segment_ids = np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length - 8), size=3 + row, replace=False))
        start, segment = 0, 1
        for cut in cuts:
            segment_ids[row, start:cut] = segment
            start, segment = cut, segment + 1
        # the rest of the row stays padding
    shapes = [(batch, length, heads, head_dim)] + [(batch, length, kv_heads, head_dim)] * 2
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes)
    return q, k, v, jnp.asarray(segment_ids)


def check_fused_attention(dtype: Any = jnp.bfloat16, *, implementation: str = "auto",
                          **example: Any) -> dict[str, Any]:
    """Compares ``implementation`` (default: what ``"auto"`` picks here) with the XLA path on a
    packed batch (:func:`packed_example`), outputs and gradients, both against a float32 XLA
    reference of the same inputs.

    Returns ``backend``, ``implementation`` (the one that ran), ``dtype``, ``max_abs_error``
    (fused vs XLA in ``dtype``), ``fused_vs_f32``/``xla_vs_f32`` (output errors against float32)
    and ``grad_fused_vs_f32``/``grad_xla_vs_f32`` (largest error over dq, dk, dv), and ``matched``:
    the fused errors are within twice the XLA path's own (plus a small absolute slack).
    """

    q, k, v, segment_ids = packed_example(dtype=dtype, **example)
    b, t = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention_mask(index, segment_ids, index, segment_ids)
    chosen = select_implementation(
        implementation, backend=current_backend(), dtype=q.dtype, head_dim=q.shape[-1],
        q_len=t, kv_len=t, causal_self=True, has_segment_ids=True)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def run(impl, q, k, v):
        def loss(q, k, v):
            out = fused_attention(q, k, v, mask, implementation=impl, segment_ids=segment_ids,
                                  causal_self=True)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v)
        return out.astype(jnp.float32), [g.astype(jnp.float32) for g in grads]

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_grads = run("xla", *f32)
    xla_out, xla_grads = run("xla", q, k, v)
    fused_out, fused_grads = run(chosen, q, k, v)

    def err(a, b):
        return float(jnp.max(jnp.abs(a - b)))

    result = {
        "backend": current_backend(), "implementation": chosen, "dtype": jnp.dtype(dtype).name,
        "max_abs_error": err(fused_out, xla_out),
        "fused_vs_f32": err(fused_out, ref_out), "xla_vs_f32": err(xla_out, ref_out),
        "grad_fused_vs_f32": max(err(a, r) for a, r in zip(fused_grads, ref_grads)),
        "grad_xla_vs_f32": max(err(a, r) for a, r in zip(xla_grads, ref_grads)),
    }
    slack = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2
    result["matched"] = bool(
        result["fused_vs_f32"] <= 2 * result["xla_vs_f32"] + slack
        and result["grad_fused_vs_f32"] <= 2 * result["grad_xla_vs_f32"] + slack)
    return result

