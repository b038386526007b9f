"""Whether weights hold only finite values, checked on the host at the speed of a read.

The puller checks every version it pulls over a host transport (``shm``, ``socket``, ``disk``)
on the very bytes it verifies against their digests, and a streamed ``shm`` version block by
block right after each block is hashed, while it is still in the core's cache, in the shadow
of the publisher's copy: the check adds no pass over memory of its own. The generator's
engine then skips its own device-side check of those weights (``Engine.update_weights(...,
finite_checked=True)``); versions pulled device to device (``jax_transfer``) are checked by the
engine.

For the IEEE formats (float16, bfloat16, float32, float64) a value is non-finite exactly when
its bits with the sign cleared are at least those of the largest finite value plus one (the
exponent all ones). Read as signed integers of the same width, a non-negative non-finite value
is then at least that threshold; read as unsigned integers, a negative one is at least the
threshold with the sign bit set, and every other value is below it. So two integer maxima over
the same bytes (SIMD reductions, no temporary array) decide it exactly. Other floating formats
(the float8 families) use ``np.isfinite``.

The publisher stages every version through :func:`copy_finite`: a copy that says whether the
values it copied are finite, from a small C kernel (``finite.c``, built on first use by
:mod:`rl_jax.native`) whose loop keeps the check in the registers the copy loads anyway, so it
costs the copy nothing measurable; where the kernel cannot run (no C compiler, a cast, a layout
that is not rows of contiguous values, ``RL_JAX_NATIVE_FINITE=0``), numpy copies and
:func:`all_finite` checks the destination. The publisher's findings travel with the digests
(per tensor in the manifest, per block in a streamed version's progress table), so the
puller, which trusts the digests of its authenticated publisher, trusts them too and reads
the values again only where no publisher staged them (``disk``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("finite.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-w")
_lock = threading.Lock()
_state: dict[str, object] = {}

_FAST_NAMES = ("float16", "bfloat16", "float32", "float64")


@functools.lru_cache(maxsize=None)
def _thresholds(dtype: np.dtype) -> tuple[np.dtype, np.dtype, int, int] | None:
    """``(signed view, unsigned view, positive threshold, negative threshold)`` for the IEEE
    formats, None for any other dtype."""
    if dtype.name not in _FAST_NAMES:
        return None
    bits = 8 * dtype.itemsize
    signed, unsigned = np.dtype(f"int{bits}"), np.dtype(f"uint{bits}")
    largest = np.array(ml_dtypes.finfo(dtype).max, dtype).view(unsigned).item()
    return signed, unsigned, largest + 1, (1 << (bits - 1)) | (largest + 1)


def is_floating(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name in _FAST_NAMES or dtype.name.startswith("float8")


def _library():
    """The built kernel (ctypes functions ``copy``, ``check``), or None where it cannot run
    (the reason is logged once)."""
    with _lock:
        if "library" in _state:
            return _state["library"]
        from rl_jax import native
        library, reason = None, None
        if os.environ.get("RL_JAX_NATIVE_FINITE", "1") in ("0", "false", "False", "no"):
            reason = "turned off by RL_JAX_NATIVE_FINITE"
        elif (compiler := native.compiler("c")) is None:
            reason = "no C compiler found ($CC, cc, gcc)"
        else:
            try:
                lib = ctypes.CDLL(str(native.build(SOURCE, "finite", compiler, FLAGS)))
                size, ptr = ctypes.c_size_t, ctypes.c_void_p
                lib.rl_jax_copy_finite.argtypes = [ptr, ctypes.c_ssize_t, ptr, ctypes.c_ssize_t,
                                                   size, size, ctypes.c_int, ctypes.c_uint64]
                lib.rl_jax_check_finite.argtypes = [ptr, ctypes.c_ssize_t, size, size,
                                                    ctypes.c_int, ctypes.c_uint64]
                lib.rl_jax_copy_finite.restype = lib.rl_jax_check_finite.restype = ctypes.c_int
                library = lib
            except Exception as e:  # noqa: BLE001 - any failure means "use numpy"
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            log.warning("native finiteness check unavailable, using numpy: %s", reason)
        _state["library"] = library
        return library


def _rows(a: np.ndarray) -> tuple[int, int, int, int] | None:
    """``a`` as rows of contiguous bytes a fixed stride apart: ``(address, stride, rows,
    row_bytes)``, or None when its layout is not of that form."""
    inner, k = a.itemsize, a.ndim
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == inner):
        inner *= a.shape[k - 1]
        k -= 1
    outer = [(a.shape[i], a.strides[i]) for i in range(k) if a.shape[i] != 1]
    if not outer:
        return a.ctypes.data, inner, 1, inner
    rows, stride = outer[-1]
    for size, step in reversed(outer[:-1]):
        if step != stride * rows:
            return None
        rows *= size
    return a.ctypes.data, stride, rows, inner


def _native_rows(a: np.ndarray, width: int) -> tuple[int, int, int, int] | None:
    rows = _rows(a)
    if rows is None or rows[0] % width or rows[1] % width or rows[3] % width:
        return None
    return rows


def all_finite(values: np.ndarray, dtype=None) -> bool:
    """Whether every value of ``values`` (a floating dtype, numpy's or ml_dtypes') is finite.
    ``dtype``: the values' dtype where ``values`` is a reinterpreting view of them (bytes, or
    the void pieces of strided staging copies). Arrays of other dtypes are finite by
    definition (True)."""
    dtype = np.dtype(values.dtype if dtype is None else dtype)
    if values.size == 0 or not is_floating(dtype):
        return True
    fast = _thresholds(dtype)
    library = _library() if fast is not None else None
    if library is not None and (rows := _native_rows(values, dtype.itemsize)) is not None:
        address, stride, count, row_bytes = rows
        return library.rl_jax_check_finite(address, stride, count, row_bytes // dtype.itemsize,
                                           dtype.itemsize, fast[2]) == 1
    if values.dtype != dtype:
        if not values.flags.c_contiguous:
            values = np.ascontiguousarray(values)
        values = values.reshape(-1).view(np.uint8).view(dtype)
    if fast is None or not values.flags.c_contiguous:
        return bool(np.isfinite(values).all())
    signed, unsigned, positive, negative = fast
    flat = values.reshape(-1)
    return bool(flat.view(signed).max() < positive and flat.view(unsigned).max() < negative)


def raw_finite(raw: np.ndarray, dtype) -> bool:
    """:func:`all_finite` of ``raw`` (contiguous bytes, ``uint8``) read as ``dtype``; its length
    is a multiple of the item size."""
    return all_finite(raw, dtype)


def copy_finite(dst: np.ndarray, src: np.ndarray, dtype=None) -> bool:
    """Copies ``src`` into ``dst`` (same shape; cast to ``dst``'s dtype like
    ``np.copyto(casting="unsafe")``) and returns whether every copied value is finite, as
    ``dst`` holds it (a cast that overflows is non-finite). ``dtype``: the values' dtype where
    both arrays are reinterpreting views of them (see :func:`all_finite`)."""
    value = np.dtype(dst.dtype if dtype is None else dtype)
    if dst.dtype == src.dtype and dst.shape == src.shape and dst.size and is_floating(value):
        fast = _thresholds(value)
        library = _library() if fast is not None else None
        if library is not None:
            d, s = _native_rows(dst, value.itemsize), _native_rows(src, value.itemsize)
            if d is not None and s is not None and d[2:] == s[2:]:
                result = library.rl_jax_copy_finite(d[0], d[1], s[0], s[1], d[2],
                                                    d[3] // value.itemsize, value.itemsize,
                                                    fast[2])
                return result == 1
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is found below
        np.copyto(dst, src, casting="unsafe")
    return all_finite(dst, value)
