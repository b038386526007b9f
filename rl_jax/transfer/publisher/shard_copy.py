"""The copy-and-hash kernels of host staging: each generator shard filled from the trainer's
shards and hashed while it is still in cache.

Each shard is a :class:`~rl_jax.transfer.publisher.shard_geometry.ShardJob` bound from its
planned geometry (:mod:`rl_jax.transfer.publisher.shard_geometry`). A shard made of runs
contiguous on both sides is copied block by block, each ``checksum.BLOCK_BYTES`` block hashed
right after its copy, :data:`SUB_BLOCK_BYTES` at a time; the others are assembled from strided
copies in slabs of rows, each slab's blocks hashed right after it. Copies go through the C
kernels of :mod:`rl_jax.transfer.finite` where they can, which also say whether the values are
finite. :func:`start_staging` cuts the work into tasks of about ``checksum.UNIT_BLOCKS`` blocks
run on ``staging_threads`` threads; :func:`finish_staging` joins them and gives each shard's
digest. Where each shard lies, and the slot files, are :mod:`rl_jax.transfer.publisher.staging`'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

import numpy as np

from rl_jax.transfer import checksum
from rl_jax.transfer.publisher.shard_geometry import ShardJob, assemble

SUB_BLOCK_BYTES = 512 << 10  # copied, then hashed while still in the core's cache
# Strided copies go in larger slabs: a numpy call per source and slab costs more than
# hashing a slab back from the (shared) L3 cache.
SLAB_BYTES = 2 << 20


def _copy_hash_blocks(job: ShardJob, first: int, stop: int) -> np.ndarray:
    """Copies blocks ``[first, stop)`` of ``job.dst`` from the source runs and hashes them as
    they go, :data:`SUB_BLOCK_BYTES` at a time (a whole 1 MiB block, once copied, is no longer
    in a 1 MiB L2 cache: hashing it would read it back from memory); returns their ``uint64``
    digests. A stretch whose pieces were all copied as they are with streaming stores (see
    ``finite.stream_copier``) is hashed from its sources, in order: the same bytes, still in
    the cache where the copy read them."""
    flat = job.dst.reshape(-1)
    raw = flat.view(np.uint8)
    item = flat.itemsize
    per_block, per_sub = checksum.BLOCK_BYTES // item, SUB_BLOCK_BYTES // item
    out = np.empty(stop - first, np.uint64)
    # Runs the C kernel can copy (same dtype, aligned): their addresses, taken once, so that
    # each piece costs one call (see finite.raw_copier).
    addresses = job.run_addresses() if job.check else None
    for k in range(first, stop):
        e1 = min(flat.size, (k + 1) * per_block)
        hasher = checksum.block_hasher()
        for a0 in range(k * per_block, e1, per_sub):
            a1 = min(e1, a0 + per_sub)
            i = max(bisect.bisect_right(job.starts, a0) - 1, 0)
            streamed: list | None = []  # the source pieces, while every piece streams
            while i < len(job.runs) and job.runs[i][0] < a1:
                start, end, src, src_start = job.runs[i]
                a, b = max(a0, start), min(a1, end)
                if a < b:
                    piece = src[src_start + a - start:src_start + b - start]
                    if addresses is not None and addresses[i + 1] is not None:
                        address, width, copier, streams = addresses[i + 1]
                        if not copier(addresses[0] + a * item,
                                      address + (src_start + a - start) * width, b - a):
                            job.finite = False
                        if streamed is not None and streams:
                            streamed.append(piece)
                        else:
                            streamed = None
                    else:
                        job.copy(flat[a:b], piece)
                        streamed = None
                i += 1
            if streamed:
                for piece in streamed:
                    hasher.update(memoryview(piece.view(np.uint8)))
            else:
                hasher.update(memoryview(raw[a0 * item:a1 * item]))
        out[k - first] = digest = hasher.intdigest()
        job.done(k, digest)
    return out


def _copy_rows(job: ShardJob, r0: int, r1: int) -> None:
    """Copies rows ``[r0, r1)`` (axis 0) of ``job.dst`` from the sources (strided copies)."""
    plans = job.box_plans() if job.check else None
    for k, (d0, d1, src0, dst_rest, src_rest, host, piece) in enumerate(job.boxes):
        a, b = max(r0, d0), min(r1, d1)
        if a < b and plans is not None and plans[k] is not None:
            plan, dst_base, src_base = plans[k]
            if not plan.copy(dst_base, src_base, a - d0, b - d0):
                job.finite = False
        elif a < b:
            dst = job.dst if piece is None else job.dst.view(piece)
            src = host if piece is None else host.view(piece)
            job.copy(dst[(slice(a, b),) + dst_rest],
                     src[(slice(src0 + a - d0, src0 + b - d0),) + src_rest], job.dst.dtype)


def _copy_slab_hash(job: ShardJob, r0: int, r1: int) -> dict[int, int]:
    """Assembles rows ``[r0, r1)`` (axis 0) of ``job.dst`` from the sources (strided copies),
    :data:`SLAB_BYTES` of rows at a time, hashing each slab right after it is copied;
    returns ``{block: digest}`` for the checksum blocks that lie wholly inside the rows (the
    few straddling two slabs are hashed once every slab is copied)."""
    raw = job.dst.reshape(-1).view(np.uint8)
    row_bytes = job.dst.nbytes // job.dst.shape[0]
    block = checksum.BLOCK_BYTES
    k = -(-r0 * row_bytes // block)  # the first block that starts inside the rows
    stop = checksum.num_blocks(raw.size) if r1 * row_bytes == raw.size \
        else r1 * row_bytes // block  # past the last block that ends inside them
    fed, hasher, out = k * block, checksum.block_hasher(), {}
    step = max(1, SLAB_BYTES // max(row_bytes, 1))
    for s0 in range(r0, r1, step):
        s1 = min(r1, s0 + step)
        _copy_rows(job, s0, s1)
        copied = s1 * row_bytes
        while k < stop and fed < copied:
            end = min(copied, (k + 1) * block, raw.size)
            hasher.update(memoryview(raw[fed:end]))
            fed = end
            if fed == min((k + 1) * block, raw.size):
                out[k] = digest = hasher.intdigest()
                job.done(k, digest)
                hasher, k = checksum.block_hasher(), k + 1
    return out


def _stage_whole(job: ShardJob, algorithm: str) -> str:
    """Copies the whole shard into place and returns its digest."""
    assemble(job.dst, job.index, job.sources, job.copy)
    return checksum.digest(job.dst, algorithm)


def _shard_tasks(job: ShardJob, algorithm: str) -> list[tuple]:
    """``(fn, *args)`` tasks that stage ``job`` (see :func:`start_staging`)."""
    if algorithm != "xxh3_64_blocks" or job.dst.ndim == 0 or job.dst.size == 0:
        return [(_stage_whole, job, algorithm)]
    if job.runs is not None:
        n = checksum.num_blocks(job.dst.nbytes)
        return [(_copy_hash_blocks, job, k, min(n, k + checksum.UNIT_BLOCKS))
                for k in range(0, n, checksum.UNIT_BLOCKS)]
    rows = job.dst.shape[0]
    step = max(1, checksum.UNIT_BLOCKS * checksum.BLOCK_BYTES // (job.dst.nbytes // rows))
    return [(_copy_slab_hash, job, r, min(rows, r + step)) for r in range(0, rows, step)]


def start_staging(jobs: Mapping[Any, ShardJob], algorithm: str, threads: int
                   ) -> tuple[checksum.TaskRun, list[tuple[Any, ShardJob]]]:
    """Starts staging every shard of ``jobs`` on ``threads`` threads: ``threads - 1`` helpers
    begin at once, the caller joins them in :func:`finish_staging`; returns the run and each
    task's ``(key, job)``.

    With ``xxh3_64_blocks`` the work is cut into tasks of about ``checksum.UNIT_BLOCKS`` blocks,
    so one large shard uses every thread: shards made of contiguous source runs are copied and
    hashed block by block (each block hashed while in cache); the others are assembled in slabs
    of rows (strided copies) and each slab's blocks hashed right after, the few blocks
    straddling two slabs once all are copied. Other algorithms take one task per shard: copied
    whole, then hashed."""
    tasks, owners = [], []
    for key, job in jobs.items():
        for task in _shard_tasks(job, algorithm):
            tasks.append(task)
            owners.append((key, job))
    return checksum.TaskRun(tasks, threads), owners


def finish_staging(run: checksum.TaskRun, owners: list[tuple[Any, ShardJob]]
                    ) -> dict[Any, str]:
    """Joins a :func:`start_staging` run; returns ``{key: digest}``."""
    parts: dict[Any, tuple[ShardJob, list]] = {}
    for (key, job), value in zip(owners, run.join()):
        parts.setdefault(key, (job, []))[1].append(value)
    out = {}
    for key, (job, values) in parts.items():
        if isinstance(values[0], str):
            out[key] = values[0]
            if job.progress is not None:  # a 0-d or empty shard: its one block
                job.done(0, int(checksum.block_digests(job.dst.reshape(-1).view(np.uint8))[0]))
        elif isinstance(values[0], dict):  # slabs: hash the blocks no slab held whole
            raw = job.dst.reshape(-1).view(np.uint8)
            found = {k: d for v in values for k, d in v.items()}
            digests = np.empty(checksum.num_blocks(raw.size), np.uint64)
            for k in range(digests.size):
                if k in found:
                    digests[k] = found[k]
                else:
                    digests[k] = checksum.block_digests(raw, k, k + 1)[0]
                    job.done(k, int(digests[k]))
            out[key] = checksum.from_blocks(digests)
        else:
            out[key] = checksum.from_blocks(np.concatenate(values))
    return out
