"""Kernels for the decode step: native CPU decode attention as an XLA FFI custom call, and a
Pallas decode attention for accelerators (:mod:`.pallas_decode`).

``decode_attention.cc`` is decode attention over the paged KV cache (and over a contiguous
per-slot cache, with the same loops) that reads each slot's keys and values only up to its own
position (XLA's form reads every position it is given and runs on one thread of XLA:CPU). It is
compiled on first use with the C++ compiler of this machine
(``$CXX``, else ``g++``/``c++``), for this CPU, against the XLA FFI headers shipped with
jaxlib, into a cache directory (``$RL_JAX_KERNEL_CACHE``, default ``~/.cache/rl_jax/kernels``)
keyed by the source, the jaxlib version, the compiler and the CPU. Processes share the built
library (one builds under a file lock, the others wait for it).

Without a compiler, or when the build fails, :func:`decode_attention_available` says False
(once, with the reason, in the log) and the decode step keeps XLA's attention.
``RL_JAX_NATIVE_ATTENTION=0`` turns the kernel off.

The Pallas kernels read the same cache layouts (the paged one reads a slot's pages in place,
through its page table), also up to each slot's position only; they run on GPU (Triton) and,
in Pallas' interpreter, anywhere (slow: for tests). Before a runner uses
it, :func:`pallas_decode_attention_problem` compiles it for the model's shapes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from rl_jax import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "rl_jax_decode_attention"
SYMBOL = "RlJaxDecodeAttention"
PAGED_TARGET = "rl_jax_paged_decode_attention"
PAGED_SYMBOL = "RlJaxPagedDecodeAttention"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared",
         "-fPIC", "-w")

# ModelRunner(attention=...), EngineConfig.attention, the server's --attention_backend
BACKENDS = ("auto", "native", "pallas", "xla")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _build(compiler: str) -> Path:
    """The built library (compiled now unless a matching one is cached: :mod:`rl_jax.native`)."""
    import jaxlib
    return native.build(SOURCE, "decode_attention", compiler, FLAGS,
                        include_dirs=(jax.ffi.include_dir(),), key_parts=(jaxlib.__version__,))


def decode_attention_available() -> bool:
    """Whether the native decode attention is built and registered with XLA (builds it on the
    first call in a process)."""
    with _lock:
        if "available" in _state:
            return bool(_state["available"])
        reason = None
        if os.environ.get("RL_JAX_NATIVE_ATTENTION", "1") in ("0", "false", "False", "no"):
            reason = "turned off by RL_JAX_NATIVE_ATTENTION"
        elif (compiler := native.compiler("c++")) is None:
            reason = "no C++ compiler found ($CXX, g++, c++)"
        else:
            try:
                library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
                for target, symbol in ((TARGET, SYMBOL), (PAGED_TARGET, PAGED_SYMBOL)):
                    jax.ffi.register_ffi_target(target,
                                                jax.ffi.pycapsule(getattr(library, symbol)),
                                                platform="cpu")
                _state["library"] = library  # keeps it loaded
            except Exception as e:  # noqa: BLE001 - any failure means "use XLA's attention"
                reason = f"{type(e).__name__}: {e}"
        _state["available"] = reason is None
        if reason is not None:
            log.warning("native decode attention unavailable, using XLA's: %s", reason)
        return reason is None


# (query heads per key/value head, head_dim) with a compiled specialisation in the kernel
# (``Specialised`` in decode_attention.cc); other shapes take its generic loops, which are no
# faster than XLA's attention.
SPECIALISED = {(g, d) for g in (1, 2, 4, 8) for d in (32, 64, 128)}


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                     positions: jax.Array) -> jax.Array:
    """Attention of one query per slot over its cache (call inside jit, CPU backend):
    ``q [S, K, G, Dh]``, ``keys [S, K, Dh, T]``, ``values [S, K, T, Dh]``, float32; cache
    positions ``<= positions [S]`` are attended.
    Returns ``[S, K, G, Dh]`` float32, softmax scaled by ``Dh ** -0.5``. Raises
    :class:`RuntimeError` when the kernel is unavailable."""
    if not decode_attention_available():  # builds and registers it on the first call
        raise RuntimeError("the native decode attention is unavailable (the log says why)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), keys.astype(jnp.float32), values.astype(jnp.float32),
                positions.astype(jnp.int32))


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           table: jax.Array, positions: jax.Array) -> jax.Array:
    """Attention of one query per slot over a paged cache (call inside jit, CPU backend):
    ``q [S, K, G, Dh]``, pages of keys ``[N, K, Dh, P]`` and values ``[N, K, P, Dh]``, the page
    table ``[S, W]`` (slot ``s``'s position ``t`` is at ``table[s, t // P]``, offset ``t % P``),
    float32; positions ``<= positions [S]`` (below ``W·P``) are attended. A slot whose attended
    positions name a page outside ``0..N-1`` (a free slot) gets zeros.
    Returns ``[S, K, G, Dh]`` float32, softmax scaled by ``Dh ** -0.5``. Raises
    :class:`RuntimeError` when the kernel is unavailable."""
    if not decode_attention_available():
        raise RuntimeError("the native decode attention is unavailable (the log says why)")
    call = jax.ffi.ffi_call(PAGED_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k_pages.astype(jnp.float32),
                v_pages.astype(jnp.float32), table.astype(jnp.int32),
                positions.astype(jnp.int32))


def pallas_decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array,
                            positions: jax.Array, **kwargs) -> jax.Array:
    """:func:`.pallas_decode.decode_attention` (imported on first use)."""
    from rl_jax.generator.engine.kernels import pallas_decode
    return pallas_decode.decode_attention(q, keys, values, positions, **kwargs)


def pallas_paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                                  table: jax.Array, positions: jax.Array,
                                  **kwargs) -> jax.Array:
    """:func:`.pallas_decode.paged_decode_attention` (imported on first use)."""
    from rl_jax.generator.engine.kernels import pallas_decode
    return pallas_decode.paged_decode_attention(q, k_pool, v_pool, table, positions, **kwargs)


_pallas_problems: dict[tuple, str | None] = {}


def pallas_decode_attention_problem(*, kv_heads: int, group: int, head_dim: int,
                                    max_seq_len: int, dtype, cache_dtype, platform: str,
                                    page_size: int | None = None) -> str | None:
    """Why the Pallas decode attention does not compile for these heads and dtypes on
    ``platform`` (the default backend's devices), or ``None`` where it does. Compiles it once
    per process and shape so that a failure shows at startup rather than in the first decode
    step: with ``page_size``, the paged kernel for 8 slots over a pool of pages of that size
    (table rows as wide as ``max_seq_len`` needs); without, the contiguous kernel over caches
    of a few of its blocks (a short cache, a whole number of blocks, and the last block
    overlapping the one before)."""
    from rl_jax.generator.engine.kernels import pallas_decode
    block = pallas_decode.BLOCK
    lengths = sorted({min(max_seq_len, n) for n in (16, 2 * block, 3 * block + 16)})
    key = (kv_heads, group, head_dim, tuple(lengths), jnp.dtype(dtype).name,
           jnp.dtype(cache_dtype).name, platform, page_size)
    with _lock:
        if key in _pallas_problems:
            return _pallas_problems[key]
    problem = None
    q = jax.ShapeDtypeStruct((8, kv_heads, group, head_dim), dtype)
    positions = jax.ShapeDtypeStruct((8,), jnp.int32)
    try:
        if page_size is not None:
            width = -(-max_seq_len // page_size)
            pages = 8 * width
            k_pool = jax.ShapeDtypeStruct((pages, kv_heads, head_dim, page_size), cache_dtype)
            v_pool = jax.ShapeDtypeStruct((pages, kv_heads, page_size, head_dim), cache_dtype)
            table = jax.ShapeDtypeStruct((8, width), jnp.int32)
            jax.jit(partial(pallas_decode.paged_decode_attention, platform=platform)).lower(
                q, k_pool, v_pool, table, positions).compile()
        for length in lengths if page_size is None else ():
            keys = jax.ShapeDtypeStruct((8, kv_heads, head_dim, length), cache_dtype)
            values = jax.ShapeDtypeStruct((8, kv_heads, length, head_dim), cache_dtype)
            jax.jit(partial(pallas_decode.decode_attention, platform=platform)).lower(
                q, keys, values, positions).compile()
    except Exception as e:  # noqa: BLE001 - any failure means "use XLA's attention"
        pages = "" if page_size is None else f" over pages of {page_size} positions"
        problem = f"it does not compile for {group} query heads per key/value head of " \
                  f"head_dim {head_dim}{pages}: {type(e).__name__}: {str(e)[:500]}"
    with _lock:
        _pallas_problems[key] = problem
    return problem
