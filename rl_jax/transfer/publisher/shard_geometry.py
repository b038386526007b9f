"""How each generator shard is filled from the trainer's shards: its geometry, planned once.

A shard's *geometry* (how its bytes come from the overlapping source shards) depends only on the
layouts and shapes, so it is planned once (:func:`plan_geometry`) and bound to each version's
arrays (:meth:`Geometry.bind`, giving a :class:`ShardJob`). Sources that cut the shard into
runs contiguous on both sides (FSDP and tensor-parallel cuts: one run per source, or one per
outer index of a stacked weight) become element runs; the others become boxes of rows copied
with strided copies (viewed as wider elements where a box cuts whole column blocks). The copies
and their hashing are :mod:`rl_jax.transfer.publisher.shard_copy`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import finite
from rl_jax.transfer.chunks import NONFINITE
from rl_jax.transfer.errors import LayoutError
from rl_jax.transfer.layout import Index, normalize_index



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


def host_shards(array: jax.Array) -> list[tuple[Index, np.ndarray]]:
    """The distinct addressable shards of ``array`` as host arrays (views on CPU)."""
    shape = tuple(array.shape)
    if len(array.sharding.device_set) == 1 and array.is_fully_addressable:
        return [(tuple((0, n) for n in shape), np.asarray(array))]
    shards = [(index, np.asarray(array.addressable_data(i)))
              for i, index in _distinct_shards(array, shape)]
    if not shards:
        raise LayoutError("parameter has no shards in this process")
    return shards


def assemble(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]],
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
class ShardJob:
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
    geometry: Any = None  # the Geometry the job was bound from (boxes only)

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
        """The address of ``dst``, then ``(address, item size, copier, streams)`` of each run's
        source where the C kernel can copy it (aligned, dtypes it handles; else None), for
        :func:`shard_copy._copy_hash_blocks`: values copied as they are go through
        ``finite.stream_copier`` (``streams``: the copy is hashed from the source), casts
        through ``finite.raw_copier``."""
        if self._addresses is None:
            out: list = [self.dst.ctypes.data]
            aligned = out[0] % self.dst.itemsize == 0
            sources: dict[int, Any] = {}  # many runs share a source (its rows, cut)
            for _, _, src, _ in self.runs:
                if id(src) not in sources:
                    address, width, copier = src.ctypes.data, src.itemsize, None
                    streams = src.dtype == self.dst.dtype
                    if aligned and not address % width:
                        copier = (finite.stream_copier(src.dtype) if streams
                                  else finite.raw_copier(self.dst.dtype, src.dtype))
                    sources[id(src)] = None if copier is None else (address, width, copier,
                                                                    streams)
                out.append(sources[id(src)])
            self._addresses = out
        return self._addresses

    def box_plans(self) -> list:
        """Per box, ``(finite.RowsPlan, dst address, source address)`` (None where the C kernel
        cannot copy it), for :func:`shard_copy._copy_rows`; the plans are made once per layout
        (kept by the geometry), the addresses taken once per version."""
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
class Geometry:
    """How one shard is filled from its sources, with the sources by position (so that it can
    be planned once and bound to each version's arrays): ``runs`` as ``(dst_start, dst_stop,
    source, src_start)``, or, when None, ``boxes`` as in :attr:`ShardJob.boxes` with the
    source's position in place of the source."""

    runs: tuple[tuple[int, int, int, int], ...] | None
    boxes: tuple[tuple[int, int, int, tuple, tuple, int, np.dtype | None], ...] = ()
    # the C kernel's plan of each box (``finite.RowsPlan`` or None), made from the first
    # version's arrays: later ones are laid out alike (contiguous sources of the same shapes)
    native: list = dataclasses.field(default_factory=list, compare=False)

    def bind(self, dst: np.ndarray, target: Index,
             sources: Sequence[tuple[Index, np.ndarray]]) -> ShardJob:
        if self.runs is None:
            return ShardJob(dst, target, sources, None, boxes=[
                (d0, d1, s0, dst_rest, src_rest, sources[k][1], piece)
                for d0, d1, s0, dst_rest, src_rest, k, piece in self.boxes], geometry=self)
        flats = {k: sources[k][1].reshape(-1) for k in {run[2] for run in self.runs}}
        runs = [(d0, d1, flats[k], r) for d0, d1, k, r in self.runs]
        return ShardJob(dst, target, sources, runs, [run[0] for run in runs])


def plan_geometry(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]]
              ) -> Geometry:
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
        return Geometry(tuple(sorted(runs, key=lambda run: run[0])))
    if not dst.ndim:
        return Geometry(None)
    positions = {id(host): k for k, (_, host) in enumerate(sources)}
    boxes = []
    for d0, d1, s0, dst_rest, src_rest, host in _boxes(target, sources):
        piece = _pieces(dst, host, dst_rest, src_rest)
        if piece is not None:
            piece, dst_rest, src_rest = piece
        boxes.append((d0, d1, s0, dst_rest, src_rest, positions[id(host)], piece))
    return Geometry(None, tuple(boxes))


def plan_job(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]]
              ) -> ShardJob:
    return plan_geometry(dst, target, sources).bind(dst, target, sources)
