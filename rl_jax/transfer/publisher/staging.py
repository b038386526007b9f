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

Streamed versions (every transport of the layout streams, ``PublisherConfig.stream``): the
manifest is announced while the version is staged, its checksums ``"pending"``, with a progress
table (``slotN.progress``, ``uint64 [blocks, 2]``: digest, version, the version's top bit
:data:`~rl_jax.transfer.publisher.shard_geometry.NONFINITE` set where the block's shard holds a
non-finite
value) whose row for each 1 MiB block is written once the block is copied and hashed; a waiting
puller verifies blocks as their rows appear, so its hashing overlaps the copy, and hands out its
arrays (views of the slot, laid out and checked against the manifest before the first block
arrives) once the last block is verified and the stamp says the version is complete. What
staging needs besides the bytes (chunk headers, each shard's place and copy runs) depends only
on the layout and the shapes: ``_layout_plan`` makes it once, and later versions rewrite only
the headers' version digits and the shards.

The copies themselves (and their hashing) are :mod:`rl_jax.transfer.publisher.shard_copy`'s; the
device
copy of ``jax_transfer`` is :mod:`rl_jax.transfer.publisher.device_staging`.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum
from rl_jax.transfer.chunks import STAMP_SUPERSEDED, STAMP_WRITING, ChunkPlan, Entry, plan_chunks
from rl_jax.transfer.errors import LayoutError, StagingSpaceError, TransferError
from rl_jax.transfer.layout import (Index, Layout, check_layout, flat_signature, index_shape,
                                    target_dtype)
from rl_jax.transfer.manifest import ShardInfo, TensorInfo
from rl_jax.transfer.publisher.shard_copy import finish_staging, start_staging
from rl_jax.transfer.publisher.shard_geometry import Geometry, ShardJob, host_shards, plan_geometry

# The version in a chunk header's metadata: zero-padded to a fixed width, so a slot's headers
# stay in place from version to version and only these digits are rewritten.
VERSION_DIGITS = 20
_VERSION_PLACEHOLDER = "#" * VERSION_DIGITS


def header_version(version: int) -> str:
    """The version as chunk headers write it."""
    return f"{int(version):0{VERSION_DIGITS}d}"



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
    geometry: dict[tuple, Geometry] = dataclasses.field(default_factory=dict)

    def job(self, name: str, k: int, dst: np.ndarray, index: Index,
            sources: Sequence[tuple[Index, np.ndarray]], source_key: tuple | None
            ) -> ShardJob:
        """Shard ``k`` of ``name`` filled from ``sources``, whose indices are ``source_key``
        (None: not cached, e.g. non-contiguous sources)."""
        key = (name, k, source_key)
        geometry = self.geometry.get(key) if source_key is not None else None
        if geometry is None:
            geometry = plan_geometry(dst, index, sources)
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
    jobs: dict[tuple[str, int], ShardJob]
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
        self._whole: dict[int, int] = {}  # slot -> the version it holds whole (see slot_of)

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
        """The slot's progress table, ``uint64 [blocks, 2]`` (see :class:`ShardJob`)."""
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

    def slot_of(self, version: int) -> int | None:
        """The slot that holds ``version`` whole (staged to the end, current or superseded
        since, not yet taken for another version), or None. A reader re-checks
        :meth:`whole_version` once it holds the slot's shared lock: a slot may be taken for
        another version meanwhile."""
        for slot, held in sorted(self._whole.items()):
            if held == version:
                return slot
        return None

    def whole_version(self, slot: int) -> int | None:
        """The version ``slot`` holds whole, or None while it is written or after a failed
        write."""
        return self._whole.get(slot)

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
        self._whole.pop(slot, None)  # rewritten from now on
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
                sources = host_shards(flat[name])
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
            staged.run = start_staging(staged.jobs, algorithm, threads)
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
            digests = finish_staging(*staged.run)
            held = {key: job for key, job in staged.jobs.items() if job.progress is None}
            blocks = {key: checksum.block_digests(job.dst.reshape(-1).view(np.uint8))
                      for key, job in held.items() if job.rows is not None}
            if before_done is not None:
                before_done(staged)
            for key, values in blocks.items():
                held[key].rows[:, 0] = values
                held[key].rows[:, 1] = held[key].stamp()
            entry.stamp[0] = staged.version  # every byte is in place: pullers may finish
            self._whole[staged.slot] = staged.version
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
