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
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

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


def all_finite(values: np.ndarray) -> bool:
    """Whether every value of ``values`` (a floating dtype, numpy's or ml_dtypes') is finite.
    Arrays of other dtypes are finite by definition (True)."""
    dtype = values.dtype
    if values.size == 0 or not is_floating(dtype):
        return True
    fast = _thresholds(dtype)
    if fast is None or not values.flags.c_contiguous:
        return bool(np.isfinite(values).all())
    signed, unsigned, positive, negative = fast
    flat = values.reshape(-1)
    return bool(flat.view(signed).max() < positive and flat.view(unsigned).max() < negative)


def raw_finite(raw: np.ndarray, dtype) -> bool:
    """:func:`all_finite` of ``raw`` (contiguous bytes, ``uint8``) read as ``dtype``; its length
    is a multiple of the item size."""
    return all_finite(raw.view(np.dtype(dtype)))
