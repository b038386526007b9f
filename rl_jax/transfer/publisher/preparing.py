"""Publisher side: one version made ready for one generator layout, and the manifest saying where
each of the layout's transports finds it.

A layout registered for some transports needs the copies those transports read
(``Transport.staging``): ``host`` (a staging slot, :mod:`rl_jax.transfer.publisher.staging`, shared
by
``shm`` and ``socket``), ``device`` (:mod:`rl_jax.transfer.publisher.device_staging`) and ``disk``
(the
version's HF checkpoint, written once for every layout by the publisher:
:mod:`rl_jax.transfer.publisher.disk_staging`). Each copy is made once, in the order of
``STAGINGS``; the
manifest's tensor infos come from the first, and each transport adds its entry
(``Transport.entry``). A layout pulled only over streaming transports is announced before its
copy is made (:meth:`Preparing._begin_stream`, :meth:`Preparing._finish_stream`); one whose
host staging has no room falls back to the transports that need none.

:class:`Preparing` is a part of :class:`~rl_jax.transfer.publisher.core.Publisher` (its methods run
in
the publishing thread and read the publisher's configuration, copies and fault seams).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum, transports as registry
from rl_jax.transfer.errors import LayoutError, StagingSpaceError, TransferError
from rl_jax.transfer.layout import Layout, check_layout, target_dtype
from rl_jax.transfer.manifest import PENDING, Manifest, ShardInfo, TensorInfo
from rl_jax.transfer.publisher.disk_staging import tensor_info
from rl_jax.transfer.publisher.staging import HostStaging, StagedVersion
from rl_jax.transfer.transports.base import STAGINGS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Registration:
    """A layout generators asked for, the transports they pull it over, and who they are."""

    layout: Layout
    transports: set[str]
    last_seen: float
    pullers: dict[str, None] = dataclasses.field(default_factory=dict)  # oldest first


@dataclasses.dataclass
class Prepared:
    """One version in one layout: its manifest (None while a streamed one's copy fails), or the
    error its pullers get; the copies transports serve from."""

    manifest: Manifest | None = None
    error: str | None = None
    device_arrays: list[jax.Array] | None = None  # manifest tensor order
    staging: dict[str, Any] | None = None  # the host staging's description and slot


@dataclasses.dataclass
class PublishedVersion:
    version: int
    prepared: dict[str, Prepared]
    disk_path: str | None = None


# What one copy gives a layout's manifest: the description its transports' entries are made
# from, and the manifest entries it adds itself; None when it is not made.
_Made = tuple[dict[str, Any], dict[str, Any]] | None


class Preparing:
    """The publisher's staging orchestration (see the module docstring)."""

    def _wanted(self, reg: Registration) -> list[str]:
        """The transports ``reg``'s pullers asked for that this publisher enables, in the
        registry's order."""
        return [t for t in registry.names()
                if t in reg.transports and t in self.config.transports]

    def _prepare(self, key: str, reg: Registration, flat: Mapping[str, jax.Array], version: int,
                 nbytes: collections.Counter, host_full: Mapping[str, np.ndarray] | None
                 ) -> Prepared:
        layout = reg.layout
        check_layout(layout, flat)
        wanted = self._wanted(reg)
        prep = Prepared()
        infos: dict[str, TensorInfo] = {}
        transports: dict[str, Any] = {}
        stage = {"host": self._stage_host, "device": self._stage_device,
                 "disk": self._stage_disk}
        for staging in STAGINGS:
            names = [t for t in wanted if registry.get(t).staging == staging]
            if not names:
                continue
            made = stage[staging](key, layout, flat, version, nbytes, host_full, prep, infos)
            if made is None:
                continue
            staged, shared = made
            transports.update({t: registry.get(t).entry(self, staged) for t in names})
            transports.update(shared)
        if not infos:
            raise LayoutError(f"none of the transports {sorted(reg.transports)} this layout's "
                              f"pullers asked for is enabled ({list(self.config.transports)})")
        self._inject_corruption(key, version, prep, infos)
        prep.manifest = Manifest(version, key, self.algorithm, self.host_id,
                                 tuple(infos[n] for n in sorted(infos)), transports)
        return prep

    def _host_staging(self, key: str) -> HostStaging:
        if key not in self._host:
            self._host[key] = HostStaging(self._staging_root / key, self.config.max_host_slots)
        return self._host[key]

    def _stage_host(self, key: str, layout: Layout, flat: Mapping[str, jax.Array], version: int,
                    nbytes: collections.Counter, host_full: Mapping[str, np.ndarray] | None,
                    prep: Prepared, infos: dict[str, TensorInfo]) -> _Made:
        """Copies the version into one of the layout's staging slots; the manifest's ``staging``
        entry describes its chunks for every host transport."""
        tensors, staging, _ = self._host_staging(key).stage(
            version, flat, layout, self.config.chunk_bytes, self.algorithm,
            self.config.staging_threads, check_finite=self.config.check_finite)
        infos.update((t.name, t) for t in tensors)
        prep.staging = staging
        nbytes["host"] += sum(s.nbytes for t in tensors for s in t.shards)
        return staging, {"staging": {"nbytes": staging["nbytes"], "chunks": staging["chunks"]}}

    def _stage_device(self, key: str, layout: Layout, flat: Mapping[str, jax.Array], version: int,
                      nbytes: collections.Counter, host_full: Mapping[str, np.ndarray] | None,
                      prep: Prepared, infos: dict[str, TensorInfo]) -> _Made:
        """Copies the version in the layout onto the trainer's devices."""
        arrays, shard_infos = self._device.stage(flat, layout, self.algorithm)
        nbytes["device"] += sum(s.nbytes for v in shard_infos.values() for s in v)
        if not infos:
            infos.update({n: TensorInfo(n, tuple(flat[n].shape),
                                        target_dtype(layout, n, flat[n]).name,
                                        checksum.combine([(s.index, s.checksum) for s in v],
                                                         self.algorithm), tuple(v))
                          for n, v in shard_infos.items()})
        prep.device_arrays = [arrays[n] for n in sorted(arrays)]
        return {}, {}

    def _stage_disk(self, key: str, layout: Layout, flat: Mapping[str, jax.Array], version: int,
                    nbytes: collections.Counter, host_full: Mapping[str, np.ndarray] | None,
                    prep: Prepared, infos: dict[str, TensorInfo]) -> _Made:
        """The version's checkpoint (written by ``publish`` for every layout); None when this
        publisher writes none."""
        if host_full is None:
            return None
        if not infos:
            infos.update({n: tensor_info(n, v, layout, self.algorithm)
                          for n, v in host_full.items()})
        return {"path": self.disk_path(version)}, {}

    def _prepare_unstaged(self, key: str, reg: Registration, flat: Mapping[str, jax.Array],
                          version: int, nbytes: collections.Counter,
                          host_full: Mapping[str, np.ndarray] | None,
                          error: StagingSpaceError) -> Prepared:
        """The fallback when host staging has no room: the version is offered over the
        enabled transports that need no staging space (``disk``, whose checkpoint is written
        anyway, and ``jax_transfer`` when the layout's pullers asked for it); raises ``error``
        when there is none."""
        others = set(reg.transports) | ({"disk"} if host_full is not None else set())
        others = (others & set(self.config.transports)) - set(registry.staged_on("host"))
        if not others:
            raise error
        log.warning("layout %s: %s; offering version %d over %s instead", key, error, version,
                    sorted(others))
        return self._prepare(key, dataclasses.replace(reg, transports=others), flat, version,
                             nbytes, host_full)

    def _drop_unregistered_staging(self) -> None:
        """Frees the staging slots of layouts that are no longer registered (dropped for a new
        one past ``max_layouts``). Runs in the publishing thread, which owns them."""
        with self._cond:
            gone = [self._host.pop(k) for k in list(self._host) if k not in self._layouts]
        for staging in gone:
            log.info("freeing the staging of layout %s (no longer registered)",
                     staging.dir.name)
            staging.close()

    def _streamed(self, reg: Registration) -> bool:
        """Whether ``reg``'s version is announced before it is staged: every transport its
        pullers use streams (each reads the host staging)."""
        wanted = self._wanted(reg)
        return (self.config.stream and self.algorithm == "xxh3_64_blocks" and bool(wanted)
                and all(registry.get(t).streams for t in wanted))

    def _begin_stream(self, key: str, reg: Registration, flat: Mapping[str, jax.Array],
                      version: int, nbytes: collections.Counter
                      ) -> tuple[Prepared, StagedVersion]:
        """Lays ``version`` out in a slot, starts copying it on the staging threads but the
        caller's, and returns the manifest to announce meanwhile: shard checksums pending, the
        slot's progress table named (see :meth:`HostStaging.begin`)."""
        layout = reg.layout  # checked against the tensors by begin (once per set of shapes)
        host = self._host_staging(key)
        staged = host.begin(version, flat, layout, self.config.chunk_bytes,
                            stream=True, check_finite=self.config.check_finite)
        nbytes["host"] += sum(n for n, _ in staged.placed.values())
        tensors = tuple(TensorInfo(name, shape, dtype.name, PENDING, tuple(
            ShardInfo(index, PENDING, *staged.placed[name, k]) for k, index in
            enumerate(indices))) for name, shape, dtype, indices in staged.tensors)
        fault = self.faults.get("corrupt")
        if fault and int(fault.get("version", -1)) == version:
            staged.held.add((fault["tensor"], 0))  # announced once corrupted
        host.start(staged, self.algorithm, self.config.staging_threads)
        description = staged.description
        transports = {t: registry.get(t).entry(self, description) for t in self._wanted(reg)}
        transports["staging"] = {"nbytes": description["nbytes"],
                                 "chunks": description["chunks"]}
        prep = Prepared(manifest=Manifest(version, key, self.algorithm, self.host_id, tensors,
                                          transports),
                        staging={"slot": staged.slot, **description})
        return prep, staged

    def _finish_stream(self, key: str, staged: StagedVersion, prep: Prepared) -> None:
        """Copies and hashes a streamed version; its manifest then carries the checksums (and
        the transports' entries of a version no longer being written)."""
        def corrupt(staged: StagedVersion) -> None:
            fault = self.faults.get("corrupt")
            if fault and int(fault.get("version", -1)) == staged.version:
                self._host[key].corrupt(staged.placed[fault["tensor"], 0][1])
                log.warning("fault injection: corrupted %s of version %d", fault["tensor"],
                            staged.version)

        try:
            infos = self._host[key].finish(staged, self.algorithm, self.config.staging_threads,
                                           before_done=corrupt)
        except (LayoutError, TransferError) as e:
            log.warning("layout %s cannot be published: %s", key, e)
            with self._cond:
                prep.error, prep.manifest = str(e), None
                self._cond.notify_all()
            return
        written = {k: v for k, v in prep.staging.items() if k != "progress"}
        entries = {t: registry.get(t).entry(self, written) for t in prep.manifest.transports
                   if t in registry.names()}
        manifest = dataclasses.replace(prep.manifest, tensors=tuple(infos),
                                       transports={**prep.manifest.transports, **entries})
        with self._cond:
            prep.manifest = manifest
            self._cond.notify_all()

    def _inject_corruption(self, key: str, version: int, prep: Prepared,
                           infos: dict[str, TensorInfo]):
        fault = self.faults.get("corrupt")
        if not fault or int(fault.get("version", -1)) != version:
            return
        name = fault["tensor"]
        shard = infos[name].shards[0]
        if prep.staging is not None and shard.offset is not None:
            self._host[key].corrupt(shard.offset)
        if prep.device_arrays is not None:
            k = sorted(infos).index(name)
            bad = np.array(prep.device_arrays[k]).copy()
            flat = bad.reshape(-1).view(np.uint8)
            flat[0] ^= 0x01
            prep.device_arrays[k] = jax.device_put(bad, prep.device_arrays[k].sharding)
        log.warning("fault injection: corrupted %s of version %d", name, version)
