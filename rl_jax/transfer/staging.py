"""Publisher-side materialisation of one version in one generator layout.

Host staging (``shm`` and ``socket`` transports): the trainer's shards are copied straight into
the generator's shards inside a reusable staging file (safetensors-format chunks, see
:mod:`rl_jax.transfer.chunks`), hashing each shard right after it is copied (partly still in
cache). The copy *is* the reshard: no device work and one copy of each byte. With
``staging_threads``, several shards are staged at once on otherwise idle cores.

Each layout has a few slot files used in turn: a slot is rewritten only when no puller holds it
(``flock``: exclusive while the publisher writes, shared while a puller's arrays alias the slot's
bytes), and never while it holds the newest version; so after a few versions the pages are warm
and a publish costs about one ``memcpy`` plus one hash of the bytes.
Each slot has a stamp file (``int64`` version; -1 while it is being written, -2 once superseded):
pullers check it before and after reading, and the per-shard checksums catch anything else.

Device staging (``jax_transfer``): each tensor is resharded in a jit over all the trainer's
devices, laid out as ``(replicas, *generator mesh)``, then the shards of replica group 0 are
taken as an array on the generator-shaped sub-mesh: exactly the layout the puller asks for.
Tensors go one at a time, so the transient replication costs one tensor, not the model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
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

from rl_jax.transfer import checksum
from rl_jax.transfer.chunks import Entry, numpy_dtype, plan_chunks
from rl_jax.transfer.errors import LayoutError
from rl_jax.transfer.layout import Index, Layout, index_shape, index_slices, normalize_index
from rl_jax.transfer.manifest import ShardInfo, TensorInfo

STAMP_WRITING = -1  # the slot is being written
STAMP_SUPERSEDED = -2  # the slot holds a version that is no longer offered


def check_layout(layout: Layout, flat: Mapping[str, Any]) -> None:
    """Raises :class:`LayoutError` unless ``layout`` names exactly the published tensors and
    cuts each into whole shards."""
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


def _host_shards(array: jax.Array) -> list[tuple[Index, np.ndarray]]:
    """The distinct addressable shards of ``array`` as host arrays (views on CPU)."""
    seen: dict[Index, np.ndarray] = {}
    for shard in array.addressable_shards:
        index = normalize_index(shard.index, array.shape)
        if index not in seen:
            seen[index] = np.asarray(shard.data)
    if not seen:
        raise LayoutError("parameter has no shards in this process")
    return list(seen.items())


def _assemble(dst: np.ndarray, target: Index, sources: Sequence[tuple[Index, np.ndarray]]
              ) -> None:
    """Fills ``dst`` (the shard ``target``) from the overlapping source shards: one copy per
    source (strided where the layouts cut differently), cast to ``dst``'s dtype."""
    covered = 0
    for index, host in sources:
        lo = [max(s0, t0) for (s0, _), (t0, _) in zip(index, target)]
        hi = [min(s1, t1) for (_, s1), (_, t1) in zip(index, target)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        src = tuple(slice(a - s0, b - s0) for a, b, (s0, _) in zip(lo, hi, index))
        out = tuple(slice(a - t0, b - t0) for a, b, (t0, _) in zip(lo, hi, target))
        np.copyto(dst[out], host[src], casting="unsafe")
        covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
    if covered != dst.size:
        raise LayoutError(f"source shards cover {covered} of {dst.size} elements of shard "
                          f"{target} (parameters not fully addressable in this process?)")


def _stage_one(dst: np.ndarray, index: Index, sources: Sequence[tuple[Index, np.ndarray]],
               algorithm: str) -> str:
    """Copies one shard into place and returns its digest (hashed while partly in cache)."""
    _assemble(dst, index, sources)
    return checksum.digest(dst, algorithm)


def _stage_shards(jobs: Mapping[Any, tuple[np.ndarray, Index, Sequence[tuple[Index, np.ndarray]]]],
                  algorithm: str, pool) -> dict[Any, str]:
    """Runs :func:`_stage_one` for every job, on ``pool``'s threads (largest shards first) or,
    without a pool, in this thread; returns ``{key: digest}``."""
    if pool is None:
        return {key: _stage_one(*job, algorithm) for key, job in jobs.items()}
    order = sorted(jobs, key=lambda key: -jobs[key][0].nbytes)
    futures = {key: pool.submit(_stage_one, *jobs[key], algorithm) for key in order}
    concurrent.futures.wait(futures.values())  # none writes into the slot after we return
    return {key: futures[key].result() for key in jobs}


class StagingFull(LayoutError):
    """Every staging slot of a layout is held by pullers (no slot can be rewritten)."""


@dataclasses.dataclass
class _Slot:
    fd: int
    map: mmap.mmap | None
    size: int
    stamp_fd: int
    stamp_map: mmap.mmap
    stamp: np.ndarray  # int64[1], a view of stamp_map


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
        self.current_slot: int | None = None
        self._staged_slot: int | None = None

    def slot_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.safetensors"

    def stamp_path(self, slot: int) -> Path:
        return self.dir / f"slot{slot}.version"

    def _new_slot(self, slot: int) -> _Slot:
        fd = os.open(self.slot_path(slot), os.O_RDWR | os.O_CREAT, 0o600)
        stamp_fd = os.open(self.stamp_path(slot), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(stamp_fd, 8)
        stamp_map = mmap.mmap(stamp_fd, 8)
        entry = _Slot(fd, None, 0, stamp_fd, stamp_map, np.frombuffer(stamp_map, np.int64))
        entry.stamp[0] = STAMP_WRITING
        self._slots[slot] = entry
        return entry

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
              chunk_bytes: int, algorithm: str, threads: int = 0
              ) -> tuple[list[TensorInfo], dict[str, Any], int]:
        """Writes ``flat`` in ``layout`` into a slot nobody holds (never the current version's).

        Returns ``(tensor infos with offsets, staging description, slot)``; call
        :meth:`commit` once the version is announced.
        """
        names = sorted(flat)
        entries, shard_lists = [], {}
        for name in names:
            dtype = target_dtype(layout, name, flat[name])
            indices = layout.indices(name, flat[name].shape)
            shard_lists[name] = indices
            entries += [Entry(f"{name}#{k}", dtype, index_shape(i)) for k, i in enumerate(indices)]
        plans = plan_chunks(entries, chunk_bytes, {"format": "rl_jax.transfer",
                                                   "version": str(version), "layout": layout.key})
        size = max(p.offset + p.nbytes for p in plans)
        slot = self._acquire()
        entry = self._slots[slot]
        try:
            entry.stamp[0] = STAMP_WRITING
            buf = np.frombuffer(self._map(entry, size), np.uint8, count=size)
            offsets = {}
            for p in plans:
                buf[p.offset:p.offset + len(p.header)] = np.frombuffer(p.header, np.uint8)
                offsets.update(p.entries)
            jobs, placed = {}, {}  # (name, k) -> (dst, index, sources), (nbytes, offset)
            for name in names:
                dtype = target_dtype(layout, name, flat[name])
                sources = _host_shards(flat[name])
                for k, index in enumerate(shard_lists[name]):
                    off = offsets[f"{name}#{k}"]
                    nbytes = int(np.prod(index_shape(index), dtype=np.int64)) * dtype.itemsize
                    dst = buf[off:off + nbytes].view(dtype).reshape(index_shape(index))
                    jobs[name, k], placed[name, k] = (dst, index, sources), (nbytes, off)
            digests = _stage_shards(jobs, algorithm, checksum.worker_pool(threads))
            infos = []
            for name in names:
                shards = tuple(ShardInfo(index, digests[name, k], *placed[name, k])
                               for k, index in enumerate(shard_lists[name]))
                infos.append(TensorInfo(name, tuple(flat[name].shape),
                                        target_dtype(layout, name, flat[name]).name,
                                        checksum.combine([(s.index, s.checksum) for s in shards],
                                                         algorithm), shards))
            entry.stamp[0] = version
        finally:
            fcntl.flock(entry.fd, fcntl.LOCK_UN)
        self._staged_slot = slot
        description = {"file": str(self.slot_path(slot)), "stamp": str(self.stamp_path(slot)),
                       "slot": slot, "nbytes": size,
                       "chunks": [{"offset": p.offset, "nbytes": p.nbytes} for p in plans]}
        return infos, description, slot

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
            for m in (entry.map, entry.stamp_map):
                try:
                    if m is not None:
                        m.close()
                except BufferError:  # a numpy view is still alive; the OS frees it at exit
                    pass
            os.close(entry.fd)
            os.close(entry.stamp_fd)
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
