"""Per-shard checksums: cheap, exact, computed on the bytes each side actually holds.

A tensor's checksum is made of one digest per distinct shard *in the receiver's layout* (the
shard's bytes in C order), plus a combined digest over ``(index, shard digest)`` pairs. Both
sides compute it from what they hold: the publisher from the shards it offers, the puller from
the arrays it is about to hand to the engine, so anything that goes wrong in between (a flipped
byte, a truncated chunk, a shard placed at the wrong index) is caught.

The digest is XXH3-64 (``xxhash``, ~20-30 GB/s per core, far above memory bandwidth; not
cryptographic: it protects against faults, not against an adversary). Without ``xxhash`` the
publisher falls back to CRC-32 (zlib, ~4 GB/s); the algorithm travels in the manifest.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

import numpy as np

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

ALGORITHMS = ("xxh3_64", "crc32")
DEFAULT_ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
BLOCK_BYTES = 1 << 20  # copy-and-hash granularity (stays in cache between the two)


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


def _bytes_view(array: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(array)
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


def digest(array: np.ndarray, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Digest of ``array``'s bytes in C order (a non-contiguous view is copied first)."""
    h = Hasher(algorithm)
    h.update(_bytes_view(array))
    return h.hexdigest()


def copy_and_digest(dst: np.ndarray, src: np.ndarray, algorithm: str = DEFAULT_ALGORITHM,
                    block_bytes: int = BLOCK_BYTES) -> str:
    """Copies ``src`` into the C-contiguous ``dst`` (same shape and dtype) and returns the digest
    of the copied bytes, hashing each block right after copying it, while it is in cache."""
    h = Hasher(algorithm)
    if dst.size == 0:
        return h.hexdigest()
    flat_dst = dst.reshape(-1)
    if src.flags.c_contiguous:
        flat_src = src.reshape(-1)
        step = max(1, block_bytes // dst.itemsize)
        for i in range(0, flat_dst.size, step):
            np.copyto(flat_dst[i:i + step], flat_src[i:i + step])
            h.update(memoryview(flat_dst[i:i + step].view(np.uint8)))
        return h.hexdigest()
    np.copyto(dst, src)
    h.update(memoryview(flat_dst.view(np.uint8)))
    return h.hexdigest()


def combine(shards: Iterable[tuple[tuple[tuple[int, int], ...], str]],
            algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The tensor digest: a digest over its ``(index, shard digest)`` pairs, sorted by index."""
    h = Hasher(algorithm)
    for index, shard_digest in sorted(shards):
        h.update(struct.pack(f"<{2 * len(index)}q", *(v for pair in index for v in pair)))
        h.update(shard_digest.encode())
    return h.hexdigest()
