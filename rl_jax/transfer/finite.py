"""Whether weights hold only finite values, found by the copies that stage them.

The publisher stages every version through :func:`copy_finite` (or the per-layout
:func:`rows_copier` / :func:`plan_rows` plans of the same kernel): a copy that also says whether
the values it copied are finite. Its findings travel with the digests (per tensor in the
manifest, per block in a streamed version's progress table): a puller refuses a version with a
non-finite value without reading it again, and the generator's engine then skips its own
device-side check (``Engine.update_weights(..., finite_checked=True)``). Only what no publisher
staged is read again here (:func:`all_finite`: a ``disk`` checkpoint); versions pulled device to
device (``jax_transfer``) and through SGLang's protocol are checked by the engine.

For the IEEE formats (float16, bfloat16, float32, float64) a value is non-finite exactly when
its bits with the sign cleared are at least those of the largest finite value plus one (the
exponent all ones). Read as signed integers of the same width, a non-negative non-finite value
is then at least that threshold; read as unsigned integers, a negative one is at least the
threshold with the sign bit set, and every other value is below it. So two integer maxima over
the same bytes (SIMD reductions, no temporary array) decide it exactly. Other floating formats
(the float8 families) use ``np.isfinite``.

The kernel is a small C loop (``finite.c``, built on first use by :mod:`rl_jax.native`) that keeps
the check in the registers the copy loads anyway: no pass over memory of its own (what it costs is
measured by ``benchmarks/hardening_cost.py``). Where it cannot run (no C compiler, a cast other
than float32 -> bfloat16, a layout that is not rows of contiguous values,
``RL_JAX_NATIVE_FINITE=0``), numpy copies and :func:`all_finite` checks the destination.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable
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
    library = _state.get("library", False)  # (set once; read without the lock after)
    if library is not False:
        return library
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
                lib.rl_jax_cast_bf16_finite.argtypes = [ptr, ctypes.c_ssize_t, ptr,
                                                        ctypes.c_ssize_t, size, size]
                lib.rl_jax_copy_finite_stream.argtypes = [ptr, ptr, size, ctypes.c_int,
                                                          ctypes.c_uint64]
                for fn in (lib.rl_jax_copy_finite, lib.rl_jax_check_finite,
                           lib.rl_jax_cast_bf16_finite, lib.rl_jax_copy_finite_stream):
                    fn.restype = ctypes.c_int
                library = lib
            except Exception as e:  # noqa: BLE001 - any failure means "use numpy"
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            log.warning("native finiteness check unavailable, using numpy: %s", reason)
        _state["library"] = library
        return library


def _rows(*arrays: np.ndarray) -> list[tuple[int, int]] | None:
    """Arrays of one shape as rows of values contiguous in memory, a fixed stride apart, the
    same rows in each: ``(rows, values per row)`` first, then ``(address, stride in bytes)``
    per array; None when their layouts are not of that form."""
    shape = arrays[0].shape
    inner, k = 1, len(shape)
    while k > 0 and all(shape[k - 1] == 1 or a.strides[k - 1] == inner * a.itemsize
                        for a in arrays):
        inner *= shape[k - 1]
        k -= 1
    outer = [i for i in range(k) if shape[i] != 1]
    rows = 1
    strides = [inner * a.itemsize for a in arrays]
    if outer:
        rows, strides = shape[outer[-1]], [a.strides[outer[-1]] for a in arrays]
        for i in reversed(outer[:-1]):
            if any(a.strides[i] != step * rows for a, step in zip(arrays, strides)):
                return None
            rows *= shape[i]
    return [(rows, inner)] + [(a.ctypes.data, step) for a, step in zip(arrays, strides)]


def _native_rows(widths: tuple[int, ...], *arrays: np.ndarray) -> list[tuple[int, int]] | None:
    """:func:`_rows` where every address and stride is aligned to its array's value width
    (``widths``, in bytes), else None."""
    rows = _rows(*arrays)
    if rows is None or any(v % w for w, r in zip(widths, rows[1:]) for v in r):
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
    if values.dtype != dtype:
        view = _values_view(values, dtype)
        values = view if view is not None else \
            np.ascontiguousarray(values).reshape(-1).view(np.uint8).view(dtype)
    fast = _thresholds(dtype)
    if fast is not None and (library := _library()) is not None \
            and (rows := _native_rows((dtype.itemsize,), values)) is not None:
        (count, n), (address, stride) = rows
        return library.rl_jax_check_finite(address, stride, count, n, dtype.itemsize,
                                           fast[2]) == 1
    if fast is None or not values.flags.c_contiguous:
        return bool(np.isfinite(values).all())
    signed, unsigned, positive, negative = fast
    flat = values.reshape(-1)
    return bool(flat.view(signed).max() < positive and flat.view(unsigned).max() < negative)


def raw_finite(raw: np.ndarray, dtype) -> bool:
    """:func:`all_finite` of ``raw`` (contiguous bytes, ``uint8``) read as ``dtype``; its length
    is a multiple of the item size."""
    return all_finite(raw, dtype)


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _values_view(a: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``a`` (a view whose elements hold whole values of ``dtype``, like staging's void
    pieces) as an array of ``dtype`` values, or None when that is not a view."""
    try:
        return a.view(np.uint8).view(dtype) if a.shape and a.strides[-1] == a.itemsize \
            else None
    except ValueError:
        return None


def rows_copier(dtype, src_dtype=None) -> Callable[..., bool] | None:
    """``copy(dst, dst_stride, src, src_stride, rows, count) -> bool``: copies ``rows`` rows of
    ``count`` values of ``src_dtype`` (default ``dtype``) as ``dtype`` between addresses (rows
    ``stride`` bytes apart, all aligned to the item sizes) and says whether they are all
    finite: the C kernel without the per-call work of :func:`copy_finite`, for loops over many
    pieces of the same arrays whose layout the caller works out once (:func:`plan_rows`).
    None where the kernel cannot run for these dtypes."""
    dtype = np.dtype(dtype)
    src_dtype = dtype if src_dtype is None else np.dtype(src_dtype)
    library = _library()
    if library is None:
        return None
    key = (id(library), dtype, src_dtype)  # made once: staging asks per run, per version
    if key not in _copiers:
        _copiers[key] = _rows_copier(library, dtype, src_dtype)
    return _copiers[key]


_copiers: dict[tuple, Callable[..., bool] | None] = {}


def _rows_copier(library, dtype: np.dtype, src_dtype: np.dtype) -> Callable[..., bool] | None:
    if src_dtype == dtype and (fast := _thresholds(dtype)) is not None:
        fn, width, exponent = library.rl_jax_copy_finite, dtype.itemsize, fast[2]

        def copy(dst: int, dst_stride: int, src: int, src_stride: int, rows: int,
                 count: int) -> bool:
            return fn(dst, dst_stride, src, src_stride, rows, count, width, exponent) == 1
        return copy
    if dtype == _BFLOAT16 and src_dtype == np.float32:
        cast = library.rl_jax_cast_bf16_finite

        def copy(dst: int, dst_stride: int, src: int, src_stride: int, rows: int,
                 count: int) -> bool:
            return cast(dst, dst_stride, src, src_stride, rows, count) == 1
        return copy
    return None


@dataclasses.dataclass(frozen=True)
class RowsPlan:
    """How the C kernel copies one strided box (see :func:`plan_rows`), with its addresses
    relative to the two arrays' base addresses, so that one plan serves every version of
    arrays laid out alike."""

    copier: Callable[..., bool]
    dst_offset: int
    dst_stride: int
    src_offset: int
    src_stride: int
    rows_per_part: int  # 0: the box is one contiguous run, a part is a stretch of it
    values: int  # per row, or per part of a run
    dst_width: int
    src_width: int

    def copy(self, dst_base: int, src_base: int, first: int, stop: int) -> bool:
        """Copies parts ``[first, stop)``; whether their values are all finite."""
        d, s = dst_base + self.dst_offset, src_base + self.src_offset
        if self.rows_per_part:
            per = self.rows_per_part
            return self.copier(d + first * per * self.dst_stride, self.dst_stride,
                               s + first * per * self.src_stride, self.src_stride,
                               (stop - first) * per, self.values)
        return self.copier(d + first * self.values * self.dst_width, 0,
                           s + first * self.values * self.src_width, 0, 1,
                           (stop - first) * self.values)


def plan_rows(dst: np.ndarray, src: np.ndarray, parts: int, dtype=None, *,
              dst_base: int, src_base: int) -> RowsPlan | None:
    """The plan of a copy of ``src`` into ``dst`` (same shape; ``dtype``: the values' dtype
    where both are views of another, like staging's void pieces) cut along axis 0 into
    ``parts`` equal parts, each part one call into C, with addresses relative to
    ``dst_base``/``src_base`` (the addresses of the arrays ``dst`` and ``src`` view). None
    where the kernel cannot do it (then use :func:`copy_finite`)."""
    if not dst.size or dst.shape != src.shape or parts <= 0:
        return None
    if dtype is not None and np.dtype(dtype) != dst.dtype:
        dst, src = _values_view(dst, np.dtype(dtype)), _values_view(src, np.dtype(dtype))
        if dst is None or src is None:
            return None
    copier = rows_copier(dst.dtype, src.dtype)
    rows = _native_rows((dst.itemsize, src.itemsize), dst, src) if copier else None
    if rows is None:
        return None
    (count, n), (d, d_stride), (s, s_stride) = rows
    common = dict(copier=copier, dst_offset=d - dst_base, dst_stride=d_stride,
                  src_offset=s - src_base, src_stride=s_stride, dst_width=dst.itemsize,
                  src_width=src.itemsize)
    if count % parts == 0:  # each part is whole rows
        return RowsPlan(rows_per_part=count // parts, values=n, **common)
    if count == 1 and n % parts == 0:  # one contiguous run: each part a stretch of it
        return RowsPlan(rows_per_part=0, values=n // parts, **common)
    return None


def raw_copier(dtype, src_dtype=None) -> Callable[[int, int, int], bool] | None:
    """``copy(dst_address, src_address, count) -> bool``: :func:`rows_copier` for one
    contiguous run of ``count`` values."""
    copier = rows_copier(dtype, src_dtype)
    if copier is None:
        return None
    key = ("raw", copier)
    if key not in _copiers:
        def copy(dst: int, src: int, count: int) -> bool:
            return copier(dst, 0, src, 0, 1, count)
        _copiers[key] = copy
    return _copiers[key]


def stream_copier(dtype) -> Callable[[int, int, int], bool] | None:
    """:func:`raw_copier` for values copied as they are (no cast), with non-temporal stores
    where the CPU has them (``rl_jax_copy_finite_stream``): the destination goes to memory
    without being read into the cache first, and is not left there, so a caller that hashes
    the copy hashes the source. None where the kernel cannot run for ``dtype``."""
    dtype = np.dtype(dtype)
    library = _library()
    fast = _thresholds(dtype)
    if library is None or fast is None:
        return None
    key = ("stream", id(library), dtype)
    if key not in _copiers:
        fn, width, exponent = library.rl_jax_copy_finite_stream, dtype.itemsize, fast[2]

        def copy(dst: int, src: int, count: int) -> bool:
            return fn(dst, src, count, width, exponent) == 1
        _copiers[key] = copy
    return _copiers[key]


def copy_finite(dst: np.ndarray, src: np.ndarray, dtype=None) -> bool:
    """Copies ``src`` into ``dst`` (same shape; cast to ``dst``'s dtype like
    ``np.copyto(casting="unsafe")``) and returns whether every copied value is finite, as
    ``dst`` holds it (a cast that overflows is non-finite). ``dtype``: the values' dtype where
    both arrays are reinterpreting views of them (see :func:`all_finite`)."""
    value = dst.dtype if dtype is None else np.dtype(dtype)
    if dst.size and dst.shape == src.shape:
        if dst.dtype == src.dtype and (fast := _thresholds(value)) is not None \
                and (library := _library()) is not None:
            width = value.itemsize
            if dst.dtype != value:  # views of other values: count in ``value``'s values
                dst, src = _values_view(dst, value), _values_view(src, value)
            if dst is not None and src is not None \
                    and (rows := _native_rows((width, width), dst, src)) is not None:
                (count, n), (d, d_stride), (s, s_stride) = rows
                return library.rl_jax_copy_finite(d, d_stride, s, s_stride, count, n, width,
                                                  fast[2]) == 1
        elif (dst.dtype == _BFLOAT16 and src.dtype == np.float32
              and (library := _library()) is not None
              and (rows := _native_rows((2, 4), dst, src)) is not None):
            (count, n), (d, d_stride), (s, s_stride) = rows
            return library.rl_jax_cast_bf16_finite(d, d_stride, s, s_stride, count, n) == 1
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is found below
        np.copyto(dst, src, casting="unsafe")
    return all_finite(dst, value)
