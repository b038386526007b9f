"""Publisher-side materialisation of one version in one generator layout.

Host staging (``shm`` and ``socket`` transports): the trainer's shards are copied straight into
the generator's shards inside a reusable staging file (safetensors-format chunks, see
:mod:`rl_jax.transfer.chunks`), hashing each checksum block right after it is copied (still in
cache). The copy *is* the reshard: no device work and one copy of each byte. With
``staging_threads``, blocks of the same shard are staged at once on otherwise idle cores.

Each layout has a few slot files used in turn: a slot is rewritten only when no puller holds it
(``flock``: exclusive while the publisher writes, shared while a puller's arrays alias the slot's
bytes), and never while it holds the newest version; so after a few versions the pages are warm
and a publish costs about one ``memcpy`` plus one hash of the bytes.
Each slot has a 16-byte stamp file, ``int64 [stamp, writing_version]``: the stamp is the version
the slot holds, -1 while it is being written, -2 once superseded; pullers check it before and
after reading, and the per-shard checksums catch anything else. The publisher holds the slot's
lock exclusively while it writes (shared once a streamed version's pullers may read it).

Streamed versions (every transport of the layout ``shm``, ``PublisherConfig.stream``): the
manifest is announced while the version is staged, its checksums ``"pending"``, with a progress
table (``slotN.progress``, ``uint64 [blocks, 2]``: digest, version, the version's top bit
:data:`NONFINITE` set where the block's shard holds a non-finite value) whose row for each 1 MiB
block is written once the block is copied and hashed; a waiting puller verifies blocks as their rows
appear, so its hashing overlaps the copy, and hands out its arrays (views of the slot, laid out and
checked against the manifest before the first block arrives) once the last block is verified and
the stamp says the version is complete. What staging needs besides the bytes (chunk headers, each
shard's place and copy runs) depends only on the layout and the shapes: ``_layout_plan`` makes it
once, and later versions rewrite only the headers' version digits and the shards.

Device staging (``jax_transfer``): each tensor is resharded in a jit over all the trainer's
devices, laid out as ``(replicas, *generator mesh)``, then the shards of replica group 0 are
taken as an array on the generator-shaped sub-mesh: exactly the layout the puller asks for.
Tensors go one at a time, so the transient replication costs one tensor, not the model.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import fcntl
import functools
import mmap
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from rl_jax.transfer import checksum, finite
from rl_jax.transfer.chunks import ChunkPlan, Entry, numpy_dtype, plan_chunks
from rl_jax.transfer.errors import LayoutError, StagingSpaceError, TransferError
from rl_jax.transfer.layout import Index, Layout, index_shape, normalize_index
from rl_jax.transfer.manifest import ShardInfo, TensorInfo

STAMP_WRITING = -1  # the slot is being written
STAMP_SUPERSEDED = -2  # the slot holds a version that is no longer offered
# Every copy into a slot says whether the values it copied are finite (``finite.copy_finite``):
# a progress row's version carries this bit where its shard met a non-finite value, and each
# staged tensor's info says ``finite`` (see ``TensorInfo``).
NONFINITE = 1 << 63
# The version in a chunk header's metadata: zero-padded to a fixed width, so a slot's headers
# stay in place from version to version and only these digits are rewritten.
VERSION_DIGITS = 20
_VERSION_PLACEHOLDER = "#" * VERSION_DIGITS


def header_version(version: int) -> str:
    """The version as chunk headers write it."""
    return f"{int(version):0{VERSION_DIGITS}d}"


def flat_signature(flat: Mapping[str, Any]) -> tuple:
    """Names, shapes and dtypes of the published tensors: what a layout's plan depends on."""
    return tuple((name, tuple(flat[name].shape), str(flat[name].dtype)) for name in sorted(flat))


_CHECKED: dict[tuple, None] = {}  # (layout key, flat signature) pairs already checked


def check_layout(layout: Layout, flat: Mapping[str, Any], signature: tuple | None = None
                 ) -> None:
    """Raises :class:`LayoutError` unless ``layout`` names exactly the published tensors and
    cuts each into whole shards (checked once per layout and set of tensor shapes)."""
    key = (layout.key, signature if signature is not None else flat_signature(flat))
    if key in _CHECKED:
        return
    _check_layout(layout, flat)
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[key] = None


def _check_layout(layout: Layout, flat: Mapping[str, Any]) -> None:
    missing = sorted(set(flat) - set(layout.specs))
    extra = sorted(set(layout.specs) - set(flat))
    if missing or extra:
        raise LayoutError(f"layout does not match the published tensors: missing {missing[:5]}, "
                          f"unknown {extra[:5]}")
    for name, value in flat.items():
        layout.indices(name, value.shape)
        if layout.dtypes is not None:
            numpy_dtype(layout.dtypes.get(name, np.dtype(value.dtype).name))


def target_dtype(layout: Layout, name: str, value: Any) -> np.dtype:
    if layout.dtypes is not None and name in layout.dtypes:
        return numpy_dtype(layout.dtypes[name])
    return np.dtype(value.dtype)


@functools.lru_cache(maxsize=1024)
def _shard_indices(sharding: Any, shape: tuple[int, ...]) -> dict[Any, Index]:
    return {device: normalize_index(index, shape)
            for device, index in sharding.addressable_devices_indices_map(shape).items()}


_DISTINCT: dict[tuple, tuple[tuple[int, Index], ...]] = {}


def _distinct_shards(array: jax.Array, shape: tuple[int, ...]) -> tuple[tuple[int, Index], ...]:
    """``(i, index)`` of the distinct addressable shards of arrays sharded like ``array``:
    ``addressable_data(i)`` holds ``index`` (a jax Array keeps its shards in its sharding's
    device order, so this is worked out once per sharding and shape)."""
    key = (array.sharding, shape)
    found = _DISTINCT.get(key)
    if found is None:
        indices = _shard_indices(array.sharding, shape)
        seen: dict[Index, int] = {}
        for i, shard in enumerate(array.addressable_shards):
            seen.setdefault(indices[shard.device], i)
        found = tuple((i, index) for index, i in seen.items())
        if len(_DISTINCT) >= 1024:
            _DISTINCT.clear()
        _DISTINCT[key] = found
    return found


def _host_shards(array: jax.Array) -> list[tuple[Index, np.ndarray]]:
    """The distinct addressable shards of ``array`` as host arrays (views on CPU)."""
    shape = tuple(array.shape)
    if len(array.sharding.device_set) == 1 and array.is_fully_addressable:
        return [(tuple((0, n) for n in shape), np.asarray(array))]
    shards = [(index, np.asarray(array.addressable_data(i)))
              for i, index in _distinct_shards(array, shape)]
    if not shards:
        raise LayoutError("parameter has no shards in this process")
    return shards


def _assemble(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]],
              copy=functools.partial(np.copyto, casting="unsafe")) -> None:
    """Fills ``dst`` (the shard ``target``) from the overlapping source shards: one copy per
    source (strided where the layouts cut differently, ``copy(dst_part, src_part)``), cast to
    ``dst``'s dtype."""
    covered = 0
    for index, host in sources:
        lo = [max(s0, t0) for (s0, _), (t0, _) in zip(index, target)]
        hi = [min(s1, t1) for (_, s1), (_, t1) in zip(index, target)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        src = tuple(slice(a - s0, b - s0) for a, b, (s0, _) in zip(lo, hi, index))
        out = tuple(slice(a - t0, b - t0) for a, b, (t0, _) in zip(lo, hi, target))
        copy(dst[out], host[src])
        covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
    if covered != dst.size:
        raise LayoutError(f"source shards cover {covered} of {dst.size} elements of shard "
                          f"{target} (parameters not fully addressable in this process?)")


MAX_RUNS = 512  # per source and shard; more runs, or shorter than MIN_RUN_BYTES, are
MIN_RUN_BYTES = 1 << 16  # left to one strided copy


@functools.lru_cache(maxsize=4096)  # the same geometry comes back every version
def _runs(lo_dst: tuple[int, ...], lo_src: tuple[int, ...], extents: tuple[int, ...],
          dst_shape: tuple[int, ...], src_shape: tuple[int, ...]
          ) -> tuple[tuple[int, int, int], ...] | None:
    """The box of ``extents`` at ``lo_dst`` in a C-order array of ``dst_shape`` and at
    ``lo_src`` in one of ``src_shape``, as runs of elements contiguous in both:
    ``[(dst_start, src_start, count)]``; None if that takes more than :data:`MAX_RUNS`.

    A run spans the trailing axes that the box covers whole in both arrays plus the axis before
    them; the axes further out enumerate the runs (e.g. a stacked ``[layers, d, f]`` weight cut
    along ``d``: one run per layer)."""
    n = len(extents)
    j = n
    while j > 0 and extents[j - 1] == dst_shape[j - 1] == src_shape[j - 1]:
        j -= 1
    outer = max(j - 1, 0)
    count = int(np.prod(extents[outer:], dtype=np.int64))
    if int(np.prod(extents[:outer], dtype=np.int64)) > MAX_RUNS:
        return None
    dst_strides = np.cumprod((list(dst_shape[1:]) + [1])[::-1])[::-1] if n else np.ones(0)
    src_strides = np.cumprod((list(src_shape[1:]) + [1])[::-1])[::-1] if n else np.ones(0)
    out = []
    for idx in np.ndindex(*extents[:outer]):
        d = sum((lo_dst[i] + k) * int(dst_strides[i]) for i, k in enumerate(idx))
        r = sum((lo_src[i] + k) * int(src_strides[i]) for i, k in enumerate(idx))
        d += sum(lo_dst[i] * int(dst_strides[i]) for i in range(outer, n))
        r += sum(lo_src[i] * int(src_strides[i]) for i in range(outer, n))
        out.append((d, r, count))
    return tuple(out)


@dataclasses.dataclass
class _ShardJob:
    """One shard to stage: ``dst`` (its place in the slot) filled from ``sources``.

    ``runs`` lists ``(dst_start, dst_stop, src_flat, src_start)`` element runs, sorted, that
    are contiguous in both layouts (FSDP and tensor-parallel cuts give one run per source, or
    one per outer index of a stacked weight), so any byte range of ``dst`` can be copied on its
    own; None when a source would need too many short runs, and the shard is assembled from
    strided copies, in slabs of rows."""

    dst: np.ndarray
    index: Index
    sources: Sequence[tuple[Index, np.ndarray]]
    runs: list[tuple[int, int, np.ndarray, int]] | None
    starts: list[int] = dataclasses.field(default_factory=list)  # dst_start of each run
    # without runs: (dst_row0, dst_row1, src_row0, dst slices, src slices of the other axes,
    # source, piece dtype) per source overlapping the shard; with a piece dtype (see
    # :func:`_pieces`) both arrays are viewed as that dtype and the slices count its elements
    boxes: list[tuple[int, int, int, tuple, tuple, np.ndarray, np.dtype | None]] = \
        dataclasses.field(default_factory=list)
    # streamed versions: this shard's rows of the slot's progress table (``uint64 [blocks,
    # 2]``: digest, then the version once the digest is valid) and that version
    progress: np.ndarray | None = None
    version: int = 0
    rows: np.ndarray | None = None  # the same rows, also when held back (``progress`` None)
    # whether copies check the values (``PublisherConfig.check_finite``); False once a copy
    # into ``dst`` met a non-finite value (set by any staging thread)
    check: bool = True
    finite: bool = True
    _addresses: list | None = None
    _box_plans: list | None = None
    geometry: Any = None  # the _Geometry the job was bound from (boxes only)

    def copy(self, dst: np.ndarray, src: np.ndarray, dtype: np.dtype | None = None) -> None:
        """``dst[...] = src`` (cast to ``dst``'s dtype), noting a non-finite value when the
        job checks (``dtype``: the values' dtype where both are views of another dtype)."""
        if not self.check:
            np.copyto(dst, src, casting="unsafe")
        elif not finite.copy_finite(dst, src, dtype):
            self.finite = False

    def done(self, k: int, digest: int) -> None:
        """Block ``k`` is copied and hashed: tells pullers streaming the version. The block's
        row is marked :data:`NONFINITE` when the shard met a non-finite value so far (always
        so for the block that holds it: the copy comes before its ``done``)."""
        if self.progress is not None:
            self.progress[k, 0] = digest  # the digest is stored before the flag that
            self.progress[k, 1] = self.stamp()  # makes it valid

    def run_addresses(self) -> list:
        """The address of ``dst``, then ``(address, item size, copier)`` of each run's source
        where the C kernel can copy it (``finite.raw_copier``: aligned, dtypes it handles;
        else None), for :func:`_copy_hash_blocks`."""
        if self._addresses is None:
            out: list = [self.dst.ctypes.data]
            aligned = out[0] % self.dst.itemsize == 0
            sources: dict[int, Any] = {}  # many runs share a source (its rows, cut)
            for _, _, src, _ in self.runs:
                if id(src) not in sources:
                    address, width, copier = src.ctypes.data, src.itemsize, None
                    if aligned and not address % width:
                        copier = finite.raw_copier(self.dst.dtype, src.dtype)
                    sources[id(src)] = None if copier is None else (address, width, copier)
                out.append(sources[id(src)])
            self._addresses = out
        return self._addresses

    def box_plans(self) -> list:
        """Per box, ``(finite.RowsPlan, dst address, source address)`` (None where the C kernel
        cannot copy it), for :func:`_copy_rows`; the plans are made once per layout (kept by
        the geometry), the addresses taken once per version."""
        if self._box_plans is None:
            base = self.dst.ctypes.data
            native = list(self.geometry.native) if self.geometry is not None else []
            if not native:  # (threads staging slabs of this shard may make it at once)
                for d0, d1, src0, dst_rest, src_rest, host, piece in self.boxes:
                    dst = self.dst if piece is None else self.dst.view(piece)
                    src = host if piece is None else host.view(piece)
                    native.append(finite.plan_rows(
                        dst[(slice(d0, d1),) + dst_rest],
                        src[(slice(src0, src0 + d1 - d0),) + src_rest], d1 - d0,
                        None if piece is None else self.dst.dtype, dst_base=base,
                        src_base=host.ctypes.data))
                if self.geometry is not None:
                    self.geometry.native[:] = native
            self._box_plans = [None if plan is None else (plan, base, box[5].ctypes.data)
                               for plan, box in zip(native, self.boxes)]
        return self._box_plans

    def stamp(self) -> int:
        """The version as a progress row states it: with :data:`NONFINITE` where the shard
        holds a non-finite value."""
        return self.version | (0 if self.finite or not self.check else NONFINITE)


def _boxes(target: Index, sources: Sequence[tuple[Index, np.ndarray]]) -> list[tuple]:
    """The part of each source that lands in the shard ``target``, as a row range (axis 0) and
    slices of the other axes; raises :class:`LayoutError` if they do not cover the shard."""
    out, covered = [], 0
    for index, host in sources:
        lo = [max(s0, t0) for (s0, _), (t0, _) in zip(index, target)]
        hi = [min(s1, t1) for (_, s1), (_, t1) in zip(index, target)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        out.append((lo[0] - target[0][0], hi[0] - target[0][0], lo[0] - index[0][0],
                    tuple(slice(a - t0, b - t0) for a, b, (t0, _) in
                          zip(lo[1:], hi[1:], target[1:])),
                    tuple(slice(a - s0, b - s0) for a, b, (s0, _) in
                          zip(lo[1:], hi[1:], index[1:])), host))
        covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
    size = int(np.prod([b - a for a, b in target]))
    if covered != size:
        raise LayoutError(f"source shards cover {covered} of {size} elements of shard "
                          f"{target} (parameters not fully addressable in this process?)")
    return out


MIN_PIECE_BYTES = 64


def _pieces(dst: np.ndarray, host: np.ndarray, dst_rest: tuple, src_rest: tuple
            ) -> tuple[np.dtype, tuple, tuple] | None:
    """When a box cuts the last axis of both arrays at multiples of its width (a column block,
    as FSDP or tensor parallelism cut ``[..., d]`` weights), the dtype of one such block of
    bytes and the box's slices counted in it: numpy copies a strided array of 256-byte
    elements faster than 64 floats per row. None when the dtypes differ (a cast), the box
    covers the last axis whole, or its blocks are small or misaligned."""
    if dst.dtype != host.dtype or dst.ndim < 2 or not (dst.flags.c_contiguous
                                                      and host.flags.c_contiguous):
        return None
    d, r = dst_rest[-1], src_rest[-1]
    width = d.stop - d.start
    if (width == dst.shape[-1] or width * dst.itemsize < MIN_PIECE_BYTES
            or any(v % width for v in (d.start, r.start, dst.shape[-1], host.shape[-1]))):
        return None
    return (np.dtype((np.void, width * dst.itemsize)),
            dst_rest[:-1] + (slice(d.start // width, d.start // width + 1),),
            src_rest[:-1] + (slice(r.start // width, r.start // width + 1),))


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """How one shard is filled from its sources, with the sources by position (so that it can
    be planned once and bound to each version's arrays): ``runs`` as ``(dst_start, dst_stop,
    source, src_start)``, or, when None, ``boxes`` as in :attr:`_ShardJob.boxes` with the
    source's position in place of the source."""

    runs: tuple[tuple[int, int, int, int], ...] | None
    boxes: tuple[tuple[int, int, int, tuple, tuple, int, np.dtype | None], ...] = ()
    # the C kernel's plan of each box (``finite.RowsPlan`` or None), made from the first
    # version's arrays: later ones are laid out alike (contiguous sources of the same shapes)
    native: list = dataclasses.field(default_factory=list, compare=False)

    def bind(self, dst: np.ndarray, target: Index,
             sources: Sequence[tuple[Index, np.ndarray]]) -> _ShardJob:
        if self.runs is None:
            return _ShardJob(dst, target, sources, None, boxes=[
                (d0, d1, s0, dst_rest, src_rest, sources[k][1], piece)
                for d0, d1, s0, dst_rest, src_rest, k, piece in self.boxes], geometry=self)
        flats = {k: sources[k][1].reshape(-1) for k in {run[2] for run in self.runs}}
        runs = [(d0, d1, flats[k], r) for d0, d1, k, r in self.runs]
        return _ShardJob(dst, target, sources, runs, [run[0] for run in runs])


def _geometry(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]]
              ) -> _Geometry:
    runs: list | None = []
    shape = [t1 - t0 for t0, t1 in target]
    for k, (index, host) in enumerate(sources):
        lo = [max(s0, t0) for (s0, _), (t0, _) in zip(index, target)]
        hi = [min(s1, t1) for (_, s1), (_, t1) in zip(index, target)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        pieces = None
        if host.flags.c_contiguous:
            pieces = _runs(tuple(a - t0 for a, (t0, _) in zip(lo, target)),
                           tuple(a - s0 for a, (s0, _) in zip(lo, index)),
                           tuple(b - a for a, b in zip(lo, hi)), tuple(shape), host.shape)
        if pieces is None or (len(pieces) > 1 and pieces[0][2] * host.itemsize < MIN_RUN_BYTES):
            runs = None
            break
        runs += [(d, d + count, k, r) for d, r, count in pieces]
    if runs is not None and sum(b - a for a, b, _, _ in runs) != dst.size:
        runs = None  # let _boxes name the uncovered part
    if runs is not None:
        return _Geometry(tuple(sorted(runs, key=lambda run: run[0])))
    if not dst.ndim:
        return _Geometry(None)
    positions = {id(host): k for k, (_, host) in enumerate(sources)}
    boxes = []
    for d0, d1, s0, dst_rest, src_rest, host in _boxes(target, sources):
        piece = _pieces(dst, host, dst_rest, src_rest)
        if piece is not None:
            piece, dst_rest, src_rest = piece
        boxes.append((d0, d1, s0, dst_rest, src_rest, positions[id(host)], piece))
    return _Geometry(None, tuple(boxes))


def _plan_job(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]]
              ) -> _ShardJob:
    return _geometry(dst, target, sources).bind(dst, target, sources)


SUB_BLOCK_BYTES = 512 << 10  # copied, then hashed while still in the core's cache
# Strided copies go in larger slabs: a numpy call per source and slab costs more than
# hashing a slab back from the (shared) L3 cache.
SLAB_BYTES = 2 << 20


def _copy_hash_blocks(job: _ShardJob, first: int, stop: int) -> np.ndarray:
    """Copies blocks ``[first, stop)`` of ``job.dst`` from the source runs and hashes them as
    they go, :data:`SUB_BLOCK_BYTES` at a time (a whole 1 MiB block, once copied, is no longer
    in a 1 MiB L2 cache: hashing it would read it back from memory); returns their ``uint64``
    digests."""
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
            while i < len(job.runs) and job.runs[i][0] < a1:
                start, end, src, src_start = job.runs[i]
                a, b = max(a0, start), min(a1, end)
                if a < b:
                    if addresses is not None and addresses[i + 1] is not None:
                        address, width, copier = addresses[i + 1]
                        if not copier(addresses[0] + a * item,
                                      address + (src_start + a - start) * width, b - a):
                            job.finite = False
                    else:
                        job.copy(flat[a:b], src[src_start + a - start:src_start + b - start])
                i += 1
            hasher.update(memoryview(raw[a0 * item:a1 * item]))
        out[k - first] = digest = hasher.intdigest()
        job.done(k, digest)
    return out


def _copy_rows(job: _ShardJob, r0: int, r1: int) -> None:
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


def _copy_slab_hash(job: _ShardJob, r0: int, r1: int) -> dict[int, int]:
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


def _stage_whole(job: _ShardJob, algorithm: str) -> str:
    """Copies the whole shard into place and returns its digest."""
    _assemble(job.dst, job.index, job.sources, job.copy)
    return checksum.digest(job.dst, algorithm)


def _shard_tasks(job: _ShardJob, algorithm: str) -> list[tuple]:
    """``(fn, *args)`` tasks that stage ``job`` (see :func:`_start_staging`)."""
    if algorithm != "xxh3_64_blocks" or job.dst.ndim == 0 or job.dst.size == 0:
        return [(_stage_whole, job, algorithm)]
    if job.runs is not None:
        n = checksum.num_blocks(job.dst.nbytes)
        return [(_copy_hash_blocks, job, k, min(n, k + checksum.UNIT_BLOCKS))
                for k in range(0, n, checksum.UNIT_BLOCKS)]
    rows = job.dst.shape[0]
    step = max(1, checksum.UNIT_BLOCKS * checksum.BLOCK_BYTES // (job.dst.nbytes // rows))
    return [(_copy_slab_hash, job, r, min(rows, r + step)) for r in range(0, rows, step)]


def _start_staging(jobs: Mapping[Any, _ShardJob], algorithm: str, threads: int
                   ) -> tuple[checksum.TaskRun, list[tuple[Any, _ShardJob]]]:
    """Starts staging every shard of ``jobs`` on ``threads`` threads: ``threads - 1`` helpers
    begin at once, the caller joins them in :func:`_finish_staging`; returns the run and each
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


def _finish_staging(run: checksum.TaskRun, owners: list[tuple[Any, _ShardJob]]
                    ) -> dict[Any, str]:
    """Joins a :func:`_start_staging` run; returns ``{key: digest}``."""
    parts: dict[Any, tuple[_ShardJob, list]] = {}
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


class StagingFull(LayoutError):
    """Every staging slot of a layout is held by pullers (no slot can be rewritten)."""


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def reserve(fd: int, size: int, path: Path | str) -> None:
    """Allocates the first ``size`` bytes of the open file ``fd`` before it is mapped.

    Writing into a mapping of a sparse file whose filesystem is full (a full ``/dev/shm``)
    kills the process with SIGBUS; with the blocks allocated up front, running out of space is
    a :class:`StagingSpaceError` here instead, naming the directory, the size and the free
    space. The free space is checked first (``statvfs``), ``posix_fallocate`` settles races."""
    st = os.fstat(fd)
    missing = size - min(st.st_blocks * 512, size)
    if missing <= 0:
        return
    directory = Path(path).parent
    try:
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:
        free = None
    if free is not None and missing > free:
        raise StagingSpaceError(
            f"staging directory {directory} has {free} bytes free, {Path(path).name} needs "
            f"{missing} more ({size} in all); give it room or set PublisherConfig.staging_dir "
            "to a larger filesystem")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise StagingSpaceError(
                f"staging directory {directory} ran out of space allocating {size} bytes for "
                f"{Path(path).name} ({os.strerror(e.errno)}); give it room or set "
                "PublisherConfig.staging_dir to a larger filesystem") from e
        raise TransferError(f"cannot allocate {size} bytes for staging file {path}: "
                            f"{os.strerror(e.errno)}") from e


@dataclasses.dataclass
class _Slot:
    fd: int
    map: mmap.mmap | None
    size: int
    stamp_fd: int
    stamp_map: mmap.mmap
    stamp: np.ndarray  # int64[2], a view of stamp_map: the stamp, the version being written
    progress_fd: int | None = None
    progress_map: mmap.mmap | None = None
    progress_size: int = 0
    plan: "_LayoutPlan | None" = None  # whose chunk headers the slot holds
    views: dict[tuple[str, int], np.ndarray] | None = None  # each shard's place in the slot
    paths: tuple[str, str, str] = ("", "", "")  # data, stamp and progress files


@dataclasses.dataclass
class _LayoutPlan:
    """What staging a version needs that depends only on the layout and the tensors' shapes,
    computed once (:meth:`HostStaging._layout_plan`): the chunk layout (headers rendered with the
    version left as a placeholder), every shard's place, and each shard's copy geometry."""

    tensors: list[tuple[str, tuple[int, ...], np.dtype, list[Index]]]  # name, shape, dtype
    chunks: list[ChunkPlan]
    size: int
    placed: dict[tuple[str, int], tuple[int, int]]  # (nbytes, offset) of each shard
    version_at: list[int]  # where each header's version digits are
    blocks: dict[tuple[str, int], tuple[int, int]]  # each shard's rows of the progress table
    num_blocks: int
    geometry: dict[tuple, _Geometry] = dataclasses.field(default_factory=dict)

    def job(self, name: str, k: int, dst: np.ndarray, index: Index,
            sources: Sequence[tuple[Index, np.ndarray]], source_key: tuple | None
            ) -> _ShardJob:
        """Shard ``k`` of ``name`` filled from ``sources``, whose indices are ``source_key``
        (None: not cached, e.g. non-contiguous sources)."""
        key = (name, k, source_key)
        geometry = self.geometry.get(key) if source_key is not None else None
        if geometry is None:
            geometry = _geometry(dst, index, sources)
            if source_key is not None:
                self.geometry[key] = geometry
        return geometry.bind(dst, index, sources)


@dataclasses.dataclass
class StagedVersion:
    """A version laid out in a slot (headers written, shards planned), not yet copied: what
    :meth:`HostStaging.begin` returns and :meth:`HostStaging.finish` completes."""

    version: int
    slot: int
    tensors: list[tuple[str, tuple[int, ...], np.dtype, list[Index]]]  # name, shape, dtype
    jobs: dict[tuple[str, int], _ShardJob]
    placed: dict[tuple[str, int], tuple[int, int]]  # (nbytes, offset) of each shard
    description: dict[str, Any]
    streamed: bool
    # shards whose progress rows are written only once every shard is copied (fault injection)
    held: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    # the copies under way (HostStaging.start): the run and each task's (key, job)
    run: tuple[checksum.TaskRun, list] | None = dataclasses.field(default=None, repr=False)


class HostStaging:
    """Slot files (and their stamps) for one layout, reused version after version.

    A slot is rewritten only when nobody holds it: the publisher takes an exclusive ``flock`` on
    it for the write, pullers hold a shared one for as long as their arrays alias its bytes
    (``shm``) or a chunk of it is being sent (``socket``). When every slot but the newest is
    held, a new one is made (up to ``max_slots``).
    """

    def __init__(self, directory: Path, max_slots: int = 8):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_slots = max_slots
        self._slots: dict[int, _Slot] = {}
        self._plans: dict[tuple, _LayoutPlan] = {}
        self.current_slot: int | None = None
        self._staged_slot: int | None = None

    def slot_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.safetensors"

    def stamp_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.version"

    def progress_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.progress"

    def _new_slot(self, slot: int) -> _Slot:
        fd = os.open(self.slot_path(slot), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            stamp_fd = os.open(self.stamp_path(slot), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            os.close(fd)
            raise
        try:
            reserve(stamp_fd, 16, self.stamp_path(slot))
            stamp_map = mmap.mmap(stamp_fd, 16)
        except BaseException:
            os.close(fd)
            os.close(stamp_fd)
            raise
        entry = _Slot(fd, None, 0, stamp_fd, stamp_map, np.frombuffer(stamp_map, np.int64),
                      paths=(str(self.slot_path(slot)), str(self.stamp_path(slot)),
                             str(self.progress_path(slot))))
        entry.stamp[:] = (STAMP_WRITING, STAMP_WRITING)
        self._slots[slot] = entry
        return entry

    def _progress(self, entry: _Slot, slot: int, blocks: int) -> np.ndarray:
        """The slot's progress table, ``uint64 [blocks, 2]`` (see :class:`_ShardJob`)."""
        size = 16 * max(blocks, 1)
        if entry.progress_map is None or entry.progress_size < size:
            if entry.progress_fd is None:
                entry.progress_fd = os.open(self.progress_path(slot), os.O_RDWR | os.O_CREAT,
                                            0o600)
            reserve(entry.progress_fd, size, self.progress_path(slot))
            if entry.progress_map is not None:
                try:
                    entry.progress_map.close()
                except BufferError:
                    pass
            os.ftruncate(entry.progress_fd, size)
            entry.progress_map, entry.progress_size = mmap.mmap(entry.progress_fd, size), size
        return np.frombuffer(entry.progress_map, np.uint64, count=2 * blocks).reshape(blocks, 2)

    def _acquire(self) -> int:
        """A slot locked exclusively for writing: a free existing one, else a new one."""
        for slot, entry in sorted(self._slots.items()):
            if slot == self.current_slot:
                continue
            try:
                fcntl.flock(entry.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # pullers still use the version it holds
            return slot
        if len(self._slots) >= self.max_slots:
            raise StagingFull(f"all {len(self._slots)} staging slots of this layout are held by "
                              "pullers (generators keeping old versions?)")
        slot = max(self._slots, default=-1) + 1
        fcntl.flock(self._new_slot(slot).fd, fcntl.LOCK_EX)
        return slot

    def _map(self, entry: _Slot, size: int) -> mmap.mmap:
        if entry.map is None or entry.size < size:
            reserve(entry.fd, size, entry.paths[0])  # the old mapping stays valid if it fails
            entry.plan = entry.views = None  # headers rewritten, views remade on the new map
            if entry.map is not None:
                try:
                    entry.map.close()
                except BufferError:  # a view is still alive; dropped with it
                    pass
            os.ftruncate(entry.fd, size)
            entry.map, entry.size = mmap.mmap(entry.fd, size), size
        return entry.map

    def fd(self, slot: int) -> int:
        return self._slots[slot].fd

    def stamp(self, slot: int) -> int:
        return int(self._slots[slot].stamp[0])

    def stage(self, version: int, flat: Mapping[str, jax.Array], layout: Layout,
              chunk_bytes: int, algorithm: str, threads: int = 0, *,
              check_finite: bool = True) -> tuple[list[TensorInfo], dict[str, Any], int]:
        """Writes ``flat`` in ``layout`` into a slot nobody holds (never the current version's).

        Returns ``(tensor infos with offsets, staging description, slot)``; call
        :meth:`commit` once the version is announced.
        """
        staged = self.begin(version, flat, layout, chunk_bytes, check_finite=check_finite)
        return self.finish(staged, algorithm, threads), staged.description, staged.slot

    def begin(self, version: int, flat: Mapping[str, jax.Array], layout: Layout,
              chunk_bytes: int, *, stream: bool = False,
              check_finite: bool = True) -> StagedVersion:
        """Takes a slot nobody holds (never the current version's), writes the chunk headers
        and plans every shard's copy; :meth:`start` and :meth:`finish` copy and hash.

        With ``stream``, pullers may hold the slot while it is written (the publisher's lock on
        it becomes a shared one) and each checksum block is announced in the slot's progress
        table as soon as it is copied and hashed, so they verify the version as it is written.
        With ``check_finite``, every copy also says whether its values are finite (see
        :data:`NONFINITE` and ``TensorInfo.finite``).
        """
        plan = self._layout_plan(flat, layout, chunk_bytes)
        slot = self._acquire()
        entry = self._slots[slot]
        try:
            entry.stamp[:] = (STAMP_WRITING, version)
            views = self._views(entry, plan)
            buf = np.frombuffer(entry.map, np.uint8, count=plan.size)
            digits = np.frombuffer(header_version(version).encode(), np.uint8)
            for at in plan.version_at:
                buf[at:at + VERSION_DIGITS] = digits
            jobs = {}
            for name, _, _, indices in plan.tensors:
                sources = _host_shards(flat[name])
                source_key = (tuple(i for i, _ in sources)
                              if all(h.flags.c_contiguous for _, h in sources) else None)
                for k, index in enumerate(indices):
                    jobs[name, k] = job = plan.job(name, k, views[name, k], index, sources,
                                                   source_key)
                    job.check = check_finite
            data_path, stamp_path, progress_path = entry.paths
            description = {"file": data_path, "stamp": stamp_path, "slot": slot,
                           "nbytes": plan.size,
                           "chunks": [{"offset": p.offset, "nbytes": p.nbytes}
                                      for p in plan.chunks]}
            if stream:
                progress = self._progress(entry, slot, plan.num_blocks)
                for key, job in jobs.items():
                    first, stop = plan.blocks[key]
                    job.progress = job.rows = progress[first:stop]
                    job.version = version
                description["progress"] = progress_path
                fcntl.flock(entry.fd, fcntl.LOCK_SH)  # pullers may hold it from now on
        except BaseException:
            entry.stamp[0] = STAMP_SUPERSEDED
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
            raise
        self._staged_slot = slot
        return StagedVersion(version, slot, plan.tensors, jobs, plan.placed, description,
                             stream)

    def _layout_plan(self, flat: Mapping[str, jax.Array], layout: Layout,
                     chunk_bytes: int) -> _LayoutPlan:
        """The plan of ``layout`` for tensors shaped like ``flat``'s (made on first use)."""
        signature = flat_signature(flat)
        key = (layout.key, chunk_bytes, signature)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        check_layout(layout, flat, signature)
        entries, tensors = [], []
        for name, shape, _ in signature:
            dtype = target_dtype(layout, name, flat[name])
            indices = layout.indices(name, shape)
            tensors.append((name, shape, dtype, indices))
            entries += [Entry(f"{name}#{k}", dtype, index_shape(i)) for k, i in enumerate(indices)]
        chunks = plan_chunks(entries, chunk_bytes, {"format": "rl_jax.transfer",
                                                    "version": _VERSION_PLACEHOLDER,
                                                    "layout": layout.key})
        marker = b'"version":"' + _VERSION_PLACEHOLDER.encode()
        version_at = []
        for c in chunks:
            at = c.header.find(marker)
            if at < 0:
                raise AssertionError("chunk header without its version field")
            version_at.append(c.offset + at + len(marker) - VERSION_DIGITS)
        offsets = {name: off for c in chunks for name, off in c.entries.items()}
        placed, blocks, first = {}, {}, 0
        for name, _, dtype, indices in tensors:  # manifest order: names sorted, shards in order
            for k, index in enumerate(indices):
                nbytes = int(np.prod(index_shape(index), dtype=np.int64)) * dtype.itemsize
                placed[name, k] = (nbytes, offsets[f"{name}#{k}"])
                n = checksum.num_blocks(nbytes)
                blocks[name, k] = (first, first + n)
                first += n
        plan = _LayoutPlan(tensors, chunks, max(c.offset + c.nbytes for c in chunks), placed,
                           version_at, blocks, first)
        if len(self._plans) >= 4:  # layouts come and go rarely; keep the recent ones
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan
        return plan

    def _views(self, entry: _Slot, plan: _LayoutPlan) -> dict[tuple[str, int], np.ndarray]:
        """Maps the slot for ``plan`` (writing its chunk headers unless the slot holds them
        already) and returns every shard's place in it."""
        self._map(entry, plan.size)
        if entry.plan is not plan or entry.views is None:
            buf = np.frombuffer(entry.map, np.uint8, count=plan.size)
            for c in plan.chunks:
                buf[c.offset:c.offset + len(c.header)] = np.frombuffer(c.header, np.uint8)
            views = {}
            for name, _, dtype, indices in plan.tensors:
                for k, index in enumerate(indices):
                    nbytes, off = plan.placed[name, k]
                    views[name, k] = buf[off:off + nbytes].view(dtype).reshape(index_shape(index))
            entry.plan, entry.views = plan, views
        return entry.views

    def start(self, staged: StagedVersion, algorithm: str, threads: int = 0) -> None:
        """Starts copying and hashing a :meth:`begin`-ed version on ``threads - 1`` helper
        threads (none for ``threads <= 1``), so that the caller can announce it meanwhile;
        :meth:`finish` must follow. Shards held back from the progress table
        (``staged.held``) must be named before."""
        if staged.run is not None:
            return
        try:
            for key in staged.held:
                staged.jobs[key].progress = None
            staged.run = _start_staging(staged.jobs, algorithm, threads)
        except BaseException:
            entry = self._slots[staged.slot]
            entry.stamp[0] = STAMP_SUPERSEDED
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
            raise

    def finish(self, staged: StagedVersion, algorithm: str, threads: int = 0,
               before_done: Any = None) -> list[TensorInfo]:
        """Copies and hashes a :meth:`begin`-ed version into its slot; returns the tensor
        infos (with checksums and offsets). ``before_done(staged)`` runs once every shard is
        copied, before the shards held back from the progress table (``staged.held``) are
        announced in it (fault injection)."""
        entry = self._slots[staged.slot]
        try:
            self.start(staged, algorithm, threads)
            digests = _finish_staging(*staged.run)
            held = {key: job for key, job in staged.jobs.items() if job.progress is None}
            blocks = {key: checksum.block_digests(job.dst.reshape(-1).view(np.uint8))
                      for key, job in held.items() if job.rows is not None}
            if before_done is not None:
                before_done(staged)
            for key, values in blocks.items():
                held[key].rows[:, 0] = values
                held[key].rows[:, 1] = held[key].stamp()
            entry.stamp[0] = staged.version  # every byte is in place: pullers may finish
            infos = []
            for name, shape, dtype, indices in staged.tensors:
                shards = tuple(ShardInfo(index, digests[name, k], *staged.placed[name, k])
                               for k, index in enumerate(indices))
                infos.append(TensorInfo(name, shape, dtype.name, checksum.combine(
                    [(s.index, s.checksum) for s in shards], algorithm), shards,
                    finite=all(staged.jobs[name, k].finite for k in range(len(indices)))
                    if all(staged.jobs[name, k].check for k in range(len(indices))) else None))
        except BaseException:
            entry.stamp[0] = STAMP_SUPERSEDED  # pullers streaming it give up on it
            raise
        finally:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
        return infos

    def commit(self, slot: int) -> None:
        """``slot`` holds the announced version; the previous one's stamp says superseded, so
        that a puller still reading it starts again on the newest."""
        previous, self.current_slot = self.current_slot, slot
        if previous is not None and previous != slot:
            self._slots[previous].stamp[0] = STAMP_SUPERSEDED

    def corrupt(self, offset: int) -> None:
        """Flips one bit at ``offset`` of the slot being published (fault injection)."""
        m = self._slots[self._staged_slot].map
        m[offset] = m[offset] ^ 0x01

    def close(self) -> None:
        for entry in self._slots.values():
            for m in (entry.map, entry.stamp_map, entry.progress_map):
                try:
                    if m is not None:
                        m.close()
                except BufferError:  # a numpy view is still alive; the OS frees it at exit
                    pass
            os.close(entry.fd)
            os.close(entry.stamp_fd)
            if entry.progress_fd is not None:
                os.close(entry.progress_fd)
        self._slots.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class DeviceStaging:
    """Generator-layout copies of the parameters on the trainer's own devices."""

    def __init__(self):
        self._fns: dict[Any, Any] = {}

    @staticmethod
    def param_devices(flat: Mapping[str, jax.Array]) -> list[jax.Device]:
        """The devices all parameters live on, in mesh order."""
        first = next(iter(flat.values())).sharding
        if isinstance(first, NamedSharding):
            devices = list(first.mesh.devices.flat)
        else:
            devices = sorted(first.device_set, key=lambda d: d.id)
        for name, value in flat.items():
            if value.sharding.device_set != set(devices):
                raise LayoutError(f"{name} lives on other devices than the first parameter; the "
                                  "jax_transfer publisher needs one device set")
        return devices

    def stage(self, flat: Mapping[str, jax.Array], layout: Layout, algorithm: str
              ) -> tuple[dict[str, jax.Array], dict[str, list[ShardInfo]]]:
        """Returns ``({name: array in layout on the first devices}, {name: shard infos})``."""
        devices = self.param_devices(flat)
        rep_mesh = layout.replicated_mesh_on(devices)
        group = list(rep_mesh.devices[0].flat)
        target_mesh = layout.mesh_on(group)
        out, infos = {}, {}
        for name in sorted(flat):
            value = flat[name]
            dtype = target_dtype(layout, name, value)
            spec = layout.specs[name]
            key = (rep_mesh, spec, np.dtype(dtype).name)
            if key not in self._fns:
                self._fns[key] = jax.jit(lambda x, _d=dtype: jnp.copy(x.astype(_d)),
                                         out_shardings=NamedSharding(rep_mesh, spec))
            resharded = self._fns[key](value)
            by_device = {s.device: s.data for s in resharded.addressable_shards}
            target = NamedSharding(target_mesh, spec)
            array = jax.make_array_from_single_device_arrays(
                value.shape, target, [by_device[d] for d in target_mesh.devices.flat])
            del resharded, by_device
            out[name] = array
            digests = {}
            for shard in array.addressable_shards:
                index = normalize_index(shard.index, array.shape)
                if index not in digests:
                    digests[index] = checksum.digest(np.asarray(shard.data), algorithm)
            infos[name] = [ShardInfo(i, d, int(np.prod(index_shape(i), dtype=np.int64))
                                     * np.dtype(dtype).itemsize) for i, d in sorted(digests.items())]
        return out, infos
