"""Per-shard checksums: cheap, exact, computed on the bytes each side actually holds.

A tensor's checksum is made of one digest per distinct shard *in the receiver's layout* (the
shard's bytes in C order), plus a combined digest over ``(index, shard digest)`` pairs. Both
sides compute it from what they hold: the publisher from the shards it offers, the puller from
the arrays it is about to hand to the engine, so anything that goes wrong in between (a flipped
byte, a truncated chunk, a shard placed at the wrong index) is caught.

The digest is XXH3-64 (``xxhash``; not cryptographic: it protects against faults, not against
an adversary). Measured here: ~75 GB/s on data in cache, ~30 GB/s streaming from memory (about
half the time of a ``memcpy`` of the same bytes). Whole-shard digests call the library's C
function through ``ctypes``, which releases the GIL, so :class:`Digests` can hash on other cores
while the caller copies the next shard. Without ``xxhash`` the publisher falls back to
CRC-32 (zlib, ~4 GB/s); the algorithm travels in the manifest.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import struct
import threading
import zlib
from collections.abc import Iterable

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

ALGORITHMS = ("xxh3_64", "crc32")
DEFAULT_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


def _load_xxh3():
    """``XXH3_64bits(ptr, len) -> uint64`` from the ``xxhash`` package's own extension (the
    very code ``xxhash.xxh3_64`` runs), callable without the GIL; None if unavailable."""
    if xxhash is None:
        return None
    try:
        from xxhash import _xxhash
        fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t), ctypes.c_uint64
    return fn


_XXH3_64 = _load_xxh3()


class Hasher:
    """Incremental digest of one byte stream."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {ALGORITHMS}")
        if algorithm == "xxh3_64" and xxhash is None:
            raise ValueError("checksum algorithm xxh3_64 needs the xxhash package")
        self.algorithm = algorithm
        self._h = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


def digest(array: np.ndarray, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Digest of ``array``'s bytes in C order (a non-contiguous view is copied first)."""
    a = np.ascontiguousarray(array)
    if algorithm == "xxh3_64" and _XXH3_64 is not None and a.size:
        return f"{_XXH3_64(a.ctypes.data, a.nbytes):016x}"  # == xxhash.xxh3_64(a).hexdigest()
    h = Hasher(algorithm)
    h.update(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
    return h.hexdigest()


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:  # a forked child has none of its parent's threads
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def worker_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor | None:
    """The process's shared pool of ``threads`` transfer workers (None for ``threads=0``).
    Work given to it should release the GIL (numpy copies, :func:`digest`)."""
    if threads <= 0:
        return None
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = concurrent.futures.ThreadPoolExecutor(
                threads, f"transfer-worker{threads}")
        return _pools[threads]


class Digests:
    """Digests of many arrays, keyed by the caller.

    ``threads=0`` hashes each array in the calling thread when it is added. ``threads=N`` hands
    them to N shared background threads (:func:`digest` runs without the GIL), which pays off
    when cores are idle. An added array must not change until :meth:`result` returns.
    """

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, threads: int = 0):
        self.algorithm = algorithm
        self._pool = worker_pool(threads)
        self._values: dict = {}

    def add(self, key, array: np.ndarray) -> None:
        self._values[key] = (digest(array, self.algorithm) if self._pool is None
                             else self._pool.submit(digest, array, self.algorithm))

    def result(self) -> dict:
        """``{key: digest}`` once every digest is computed."""
        return {k: v if isinstance(v, str) else v.result() for k, v in self._values.items()}


def combine(shards: Iterable[tuple[tuple[tuple[int, int], ...], str]],
            algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The tensor digest: a digest over its ``(index, shard digest)`` pairs, sorted by index."""
    h = Hasher(algorithm)
    for index, shard_digest in sorted(shards):
        h.update(struct.pack(f"<{2 * len(index)}q", *(v for pair in index for v in pair)))
        h.update(shard_digest.encode())
    return h.hexdigest()
