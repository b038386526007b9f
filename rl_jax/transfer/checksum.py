"""Per-shard checksums: cheap, exact, computed on the bytes each side actually holds.

A tensor's checksum is made of one digest per distinct shard *in the receiver's layout* (the
shard's bytes in C order), plus a combined digest over ``(index, shard digest)`` pairs. Both
sides compute it from what they hold: the publisher from the shards it offers, the puller from
the arrays it is about to hand to the engine, so anything that goes wrong in between (a flipped
byte, a truncated chunk, a shard placed at the wrong index) is caught.

Algorithms (the manifest names the one used):

- ``xxh3_64_blocks`` (default): the shard's bytes are cut into :data:`BLOCK_BYTES` blocks, each
  hashed with XXH3-64, and the shard digest is the XXH3-64 of the blocks' digests
  (little-endian ``uint64``). Blocks are independent, so both sides hash one shard on several
  cores, and the publisher hashes each block right after copying it, while it is in cache.
- ``xxh3_64``: XXH3-64 of the whole shard (one core per shard).
- ``crc32``: zlib's CRC-32, when ``xxhash`` is missing (much slower).

XXH3 (``xxhash``; not cryptographic: it protects against faults, not against an adversary) runs
several times faster on data in cache than memory bandwidth allows on data that is not, so the
publisher hashes what it has just copied while it is still in cache (see
:mod:`rl_jax.transfer.publisher.staging`). The ``xxhash`` extension releases the GIL while it
hashes, so
digests run on other cores while the caller copies. (The library's exported ``XXH3_64bits``,
called through ``ctypes``, is slower on cached data than the extension's own inlined code.)
Rates measured: ``docs/performance.md``.
"""

from __future__ import annotations

import concurrent.futures
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

ALGORITHMS = ("xxh3_64_blocks", "xxh3_64", "crc32")
DEFAULT_ALGORITHM = "xxh3_64_blocks" if xxhash is not None else "crc32"
BLOCK_BYTES = 1 << 20  # of ``xxh3_64_blocks``; a multiple of every dtype's item size
UNIT_BLOCKS = 8  # blocks per task handed to a worker thread




class Hasher:
    """Incremental digest of one byte stream."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM):
        check_algorithm(algorithm)
        self.algorithm = algorithm
        self._h = xxhash.xxh3_64() if algorithm != "crc32" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._h.hexdigest() if self._h is not None else f"{self._crc:08x}"


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {ALGORITHMS}")
    if algorithm != "crc32" and xxhash is None:
        raise ValueError(f"checksum algorithm {algorithm} needs the xxhash package")


def _bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes in C order as a flat ``uint8`` array (a copy only if not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def xxh3(raw: np.ndarray) -> int:
    """XXH3-64 of a contiguous ``uint8`` array, read in place (the ``xxhash`` extension
    releases the GIL while it hashes)."""
    return xxhash.xxh3_64_intdigest(memoryview(raw) if raw.size else b"")


def block_hasher():
    """A streaming XXH3-64 (``update(buffer)``, ``intdigest()``) for one block hashed in
    pieces: the same digest as :func:`xxh3` of the whole block."""
    return xxhash.xxh3_64()


def num_blocks(nbytes: int) -> int:
    """Blocks of an ``xxh3_64_blocks`` digest over ``nbytes`` bytes (one for no bytes)."""
    return max(1, -(-nbytes // BLOCK_BYTES))


def block_digests(raw: np.ndarray, first: int = 0, stop: int | None = None) -> np.ndarray:
    """``uint64`` XXH3-64 digests of blocks ``[first, stop)`` of the flat ``uint8`` ``raw``."""
    stop = num_blocks(raw.size) if stop is None else stop
    return np.array([xxh3(raw[k * BLOCK_BYTES:(k + 1) * BLOCK_BYTES])
                     for k in range(first, stop)], np.uint64)


def from_blocks(digests: np.ndarray) -> str:
    """The ``xxh3_64_blocks`` shard digest from its blocks' digests, in order."""
    return f"{xxh3(np.ascontiguousarray(digests, '<u8').view(np.uint8)):016x}"


def digest(array: np.ndarray, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """Digest of ``array``'s bytes in C order (a non-contiguous view is copied first)."""
    raw = _bytes(array)
    if algorithm == "xxh3_64_blocks":
        check_algorithm(algorithm)
        return from_blocks(block_digests(raw))
    if algorithm == "xxh3_64" and xxhash is not None:
        return f"{xxh3(raw):016x}"  # == xxhash.xxh3_64(array).hexdigest()
    h = Hasher(algorithm)
    h.update(memoryview(raw) if raw.size else b"")
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


class TaskRun:
    """``fn(*args)`` for every ``(fn, *args)`` of ``tasks`` on ``threads`` threads: ``threads
    - 1`` of the shared pool start on them at once; the caller joins them in :meth:`join`
    (each thread takes the next task until none is left), so it can do other work while the
    helpers already run the first tasks. The tasks should release the GIL for most of their
    time (copies, digests)."""

    def __init__(self, tasks: list[tuple], threads: int):
        self._tasks = tasks
        self._results: list = [None] * len(tasks)
        self._errors: list[BaseException] = []
        self._order = iter(range(len(tasks)))  # next() on it is atomic under the GIL
        helpers = min(threads, len(tasks)) - 1
        pool = worker_pool(threads - 1) if helpers > 0 else None
        self._futures = [pool.submit(self._drain) for _ in range(helpers)] if pool else []

    def _drain(self) -> None:
        for i in self._order:
            if self._errors:
                return
            fn, *args = self._tasks[i]
            try:
                self._results[i] = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised in join()
                self._errors.append(e)
                return

    def join(self) -> list:
        """Runs the tasks left in the calling thread too; returns every result in order once
        all are done, or raises the first exception once every thread stopped."""
        self._drain()
        concurrent.futures.wait(self._futures)
        if self._errors:
            raise self._errors[0]
        return self._results


def run_tasks(tasks: list[tuple], threads: int) -> list:
    """The results of ``tasks`` run on ``threads`` threads, in order (see :class:`TaskRun`)."""
    return TaskRun(tasks, threads).join()


class Digests:
    """Digests of many arrays, keyed by the caller.

    ``threads=0`` hashes each array in the calling thread when it is added. ``threads=N``
    hashes them all in :meth:`result` on N threads (the caller's and N - 1 shared ones; the
    hashing runs without the GIL), which pays off when cores are idle: with ``xxh3_64_blocks``
    a large array is split into tasks of :data:`UNIT_BLOCKS` blocks, so even one array is
    hashed on N cores at once. An added array must not change until :meth:`result` returns.
    """

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, threads: int = 0):
        check_algorithm(algorithm)
        self.algorithm = algorithm
        self.threads = threads
        self._values: dict = {}

    def add(self, key, array: np.ndarray) -> None:
        self._values[key] = digest(array, self.algorithm) if self.threads <= 0 else array

    def result(self) -> dict:
        """``{key: digest}`` once every digest is computed."""
        if self.threads <= 0:
            return dict(self._values)
        tasks, owners = [], []
        for key, array in self._values.items():
            if self.algorithm == "xxh3_64_blocks":
                raw = _bytes(array)
                n = num_blocks(raw.size)
                for k in range(0, n, UNIT_BLOCKS):
                    tasks.append((block_digests, raw, k, min(n, k + UNIT_BLOCKS)))
                    owners.append(key)
            else:
                tasks.append((digest, array, self.algorithm))
                owners.append(key)
        parts: dict = {}
        for key, value in zip(owners, run_tasks(tasks, self.threads)):
            parts.setdefault(key, []).append(value)
        return {key: from_blocks(np.concatenate(v)) if self.algorithm == "xxh3_64_blocks"
                else v[0] for key, v in parts.items()}


def combine(shards: Iterable[tuple[tuple[tuple[int, int], ...], str]],
            algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The tensor digest: a digest over its ``(index, shard digest)`` pairs, sorted by index."""
    h = Hasher(algorithm)
    for index, shard_digest in sorted(shards):
        h.update(struct.pack(f"<{2 * len(index)}q", *(v for pair in index for v in pair)))
        h.update(shard_digest.encode())
    return h.hexdigest()
