"""The ``shm`` transport: pullers on the publisher's host alias its staging slot in shared memory.

Zero-copy: the pulled arrays are views of the slot file, mapped read-only, and each byte is read
once, to hash it where it lies. The slot is held with a shared ``flock`` for as long as any of
the arrays lives (the publisher never rewrites a held slot), and its stamp file is read before
and after. A streamed version (announced before it was staged, see
:mod:`rl_jax.transfer.publisher.staging`) is verified block by block from the slot's progress table
while
the publisher writes it, so the pull ends about when the publish does.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from rl_jax.procs import process_alive
from rl_jax.transfer import checksum
from rl_jax.transfer.chunks import NONFINITE, STAMP_SUPERSEDED, STAMP_WRITING
from rl_jax.transfer.control import host_id
from rl_jax.transfer.errors import (IntegrityError, PublisherUnavailable, TransferTimeout,
                                    TransportUnavailable, VersionGone)
from rl_jax.transfer.layout import Index
from rl_jax.transfer.manifest import Manifest, verify
from rl_jax.transfer.pulling import contained
from rl_jax.transfer.transports.base import Fetched, Transport

STREAM_POLL_S = 100e-6  # how often a streamed pull looks for newly written blocks
_NONFINITE_BIT = np.uint64(NONFINITE)  # of a progress row's version (see staging)
_VERSION_BITS = np.uint64(NONFINITE - 1)


class _SourceMaps:
    """Read-only mappings of the publisher's staging files, kept across versions: the files are
    rewritten in place, so after the first pull their page tables are warm here too (a fresh
    mapping costs a page fault per page on first touch: several times the copy itself)."""

    def __init__(self):
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def stamp(self, path: str) -> int:
        """The stamp (first ``int64``) in the stamp file ``path``."""
        return self.stamps(path)[0]

    def stamps(self, path: str) -> tuple[int, int]:
        """The stamp file ``path``: ``(stamp, version being written)``, read through a kept
        mapping."""
        table = self.table(path, np.int64)
        if table.size < 2:
            raise VersionGone(f"stamp file {path} is too short")
        return int(table[0]), int(table[1])

    def table(self, path: str, dtype: Any) -> np.ndarray:
        """The whole file ``path`` as a read-only array of ``dtype`` (a kept mapping, remade
        when the file is replaced or grows)."""
        with self._lock:
            st = os.stat(path)
            entry = self._maps.get(path)
            if entry is None or entry[0] != st.st_ino or entry[1] != st.st_size:
                fd = os.open(path, os.O_RDONLY)
                try:
                    entry = self._maps[path] = (st.st_ino, st.st_size,
                                                mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ))
                finally:
                    os.close(fd)
            return np.frombuffer(entry[2], dtype, count=entry[1] // np.dtype(dtype).itemsize)

    def view(self, path: str, fd: int, nbytes: int) -> np.ndarray:
        """A new array over the first ``nbytes`` of the file open as ``fd`` (whose ``path``
        names the cached mapping); the array is its views' base."""
        with self._lock:
            st = os.fstat(fd)
            if st.st_size < nbytes:
                raise VersionGone(f"staging file {path} is shorter than the manifest says")
            entry = self._maps.get(path)
            if entry is None or entry[0] != st.st_ino or entry[1] != st.st_size:
                # Mapped through another descriptor: ``mmap`` keeps a duplicate of the one it
                # is given, which would keep ``fd``'s lock alive with the cached mapping.
                own = os.open(path, os.O_RDONLY)
                try:
                    if os.fstat(own).st_ino != st.st_ino:
                        raise VersionGone(f"staging file {path} was replaced")
                    m = mmap.mmap(own, st.st_size, prot=mmap.PROT_READ)
                finally:
                    os.close(own)
                entry = self._maps[path] = (st.st_ino, st.st_size, m)
            return np.frombuffer(entry[2], np.uint8, count=nbytes)


def _aliases(array: jax.Array, base: np.ndarray) -> bool:
    """Whether every addressable shard of ``array`` lies in ``base``'s memory (no copy)."""
    lo = base.__array_interface__["data"][0]
    hi = lo + base.nbytes
    if len(array.sharding.device_set) == 1:
        return not array.nbytes or lo <= array.unsafe_buffer_pointer() < hi
    for shard in array.addressable_shards:
        if shard.data.nbytes and not lo <= shard.data.unsafe_buffer_pointer() < hi:
            return False
    return True


def _hold_slot(path: str) -> int:
    """Opens a staging slot with a shared lock (the publisher does not rewrite a slot while
    anyone holds it); raises :class:`VersionGone` when it is being rewritten or gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise VersionGone(f"staging file {path} is gone: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise VersionGone(f"staging file {path} is being rewritten") from e
    return fd


class ShmTransport(Transport):
    """Pullers on the publisher's host map its staging slot (see the module docstring)."""

    name = "shm"
    staging = "host"
    same_host = True
    streams = True
    keeps_deadline = True  # never blocks: it waits only in its own deadline checks

    def __init__(self, puller: Any):
        super().__init__(puller)
        self._sources = _SourceMaps()

    @classmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        """The slot's data and stamp files; while the version is streamed, also its progress
        table and the publisher's pid (a puller waiting for blocks notices a dead publisher)."""
        entry = {"file": staged["file"], "stamp": staged["stamp"]}
        if "progress" in staged:
            entry.update(progress=staged["progress"], pid=os.getpid())
        return entry

    @classmethod
    def streamed(cls, manifest: Manifest) -> bool:
        return "progress" in manifest.transports.get("shm", {})

    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        """Zero-copy: the arrays alias the publisher's staging slot (mapped read-only), whose
        shared lock lives as long as they do. Each shard is hashed where it lies; a streamed
        version is verified block by block as the publisher writes it."""
        if manifest.host_id != host_id():
            raise TransportUnavailable("the publisher is on another host: shm is unusable")
        info, staging = dict(manifest.transports["shm"]), manifest.transports["staging"]
        total = int(staging["nbytes"])
        streamed = self.streamed(manifest)
        for name in ("file", "stamp") + (("progress",) if streamed else ()):
            info[name] = contained(info.get(name), self.puller.directories.get("staging"),
                                   f"staging {name} of version {manifest.version}")

        def stamps() -> tuple[int, int]:
            try:
                return self._sources.stamps(info["stamp"])
            except (OSError, ValueError) as e:
                raise VersionGone(f"staging of version {manifest.version} is gone: {e}") from e

        fd = _hold_slot(info["file"])
        release = None
        try:
            stamp, writing = stamps()
            if stamp != manifest.version and not (streamed and writing == manifest.version
                                                  and stamp == STAMP_WRITING):
                raise VersionGone(f"version {manifest.version} was superseded")
            try:
                base = self._sources.view(info["file"], fd, total)
            except OSError as e:
                raise VersionGone(f"staging file of version {manifest.version} is gone: "
                                  f"{e}") from e
            release = weakref.finalize(base, os.close, fd)  # unlocks when no array aliases it
            arrays = None
            if streamed:
                # A streamed version's chunk headers are written before it is announced, so
                # its arrays (views of the slot, aliased without a copy) are laid out while
                # the publisher still writes the bytes, and checked against the manifest
                # (names, shapes, dtypes, shards) then, so that little is left to do once the
                # last block is verified. Arrays that were copied rather than aliased
                # (misaligned) would hold unverified bytes, so those are laid out again below.
                arrays = self.puller.arrays_from_chunks(manifest, base, check_finite=False)
                verify(manifest, arrays, checksums=False)
                if not all(_aliases(a, base) for a in arrays.values()):
                    arrays = None
                digests = self._verify_streamed(manifest, base, stamps, deadline,
                                                info["progress"])
            else:
                hashed = checksum.Digests(manifest.algorithm, self.puller.config.digest_threads)
                for k, tensor in enumerate(manifest.tensors):
                    if k == len(manifest.tensors) // 2 and "mid_pull" in self.puller.hooks:
                        self.puller.hooks["mid_pull"]()
                    for shard in tensor.shards:
                        hashed.add((tensor.name, shard.index),
                                   base[shard.offset:shard.offset + shard.nbytes])
                digests: dict[str, dict[Index, str]] = {}
                for (name, index), value in hashed.result().items():
                    digests.setdefault(name, {})[index] = value
            if stamps()[0] != manifest.version:
                raise VersionGone(f"version {manifest.version} was superseded while read")
            if arrays is None:  # (a streamed version's findings are in its progress table)
                arrays = self.puller.arrays_from_chunks(manifest, base,
                                                        check_finite=not streamed)
            return Fetched(arrays, total, digests)
        except BaseException:
            if release is not None:
                release()
            else:
                os.close(fd)
            raise

    def _verify_streamed(self, manifest: Manifest, base: np.ndarray,
                         stamps: Callable[[], tuple[int, int]], deadline: float,
                         progress_path: str) -> dict[str, dict[Index, str]]:
        """Hashes each checksum block of a streamed version as soon as the publisher marks it
        written in the slot's progress table (so it is read while still in cache) and checks
        it against the digest there; returns the shard digests once every block matched and
        the publisher finished the version."""
        info = manifest.transports["shm"]
        if manifest.algorithm != "xxh3_64_blocks":
            raise IntegrityError(f"a streamed version needs xxh3_64_blocks checksums, not "
                                 f"{manifest.algorithm}")
        blocks = []  # (tensor name, shard index, shard offset, start, stop) per table row
        for tensor in manifest.tensors:
            for shard in tensor.shards:
                for k in range(checksum.num_blocks(shard.nbytes)):
                    start = shard.offset + k * checksum.BLOCK_BYTES
                    stop = min(shard.offset + shard.nbytes, start + checksum.BLOCK_BYTES)
                    blocks.append((tensor.name, shard.index, shard.offset, start, stop))
        try:
            table = self._sources.table(progress_path, np.uint64)
        except OSError as e:
            raise VersionGone(f"progress table of version {manifest.version} is gone: "
                              f"{e}") from e
        if table.size < 2 * len(blocks):
            raise VersionGone(f"progress table of version {manifest.version} is too short")
        table = table[:2 * len(blocks)].reshape(-1, 2)
        if "stream_start" in self.puller.hooks:
            self.puller.hooks["stream_start"]()
        version = np.uint64(manifest.version)
        got = np.zeros(len(blocks), np.uint64)
        bad = []
        mid_pull = len(blocks) // 2 if "mid_pull" in self.puller.hooks else -1
        # Blocks are found ready with one vectorised look at the table per wake-up (a scan in
        # Python would cost more than the hashing for models of many thousand blocks).
        pending = np.arange(len(blocks))
        while pending.size:
            ready = table[pending, 1] & _VERSION_BITS == version
            if not ready.any():
                self._wait_for_publisher(manifest, stamps, deadline, info.get("pid"))
                continue
            for i in pending[ready].tolist():
                if i == mid_pull:
                    self.puller.hooks["mid_pull"]()
                _, _, _, start, stop = blocks[i]
                got[i] = checksum.xxh3(base[start:stop])
                if got[i] != table[i, 0]:
                    bad.append(i)
            pending = pending[~ready]
        while stamps()[0] == STAMP_WRITING:  # every block is marked: the publisher is ending
            self._wait_for_publisher(manifest, stamps, deadline, info.get("pid"))
        for i in bad:  # read once more now that the publisher is done
            name, index, offset, start, stop = blocks[i]
            got[i] = checksum.xxh3(base[start:stop])
            if got[i] != table[i, 0] or table[i, 1] & _VERSION_BITS != version:
                raise IntegrityError(
                    f"pulled weights (version {manifest.version}) refused: {name}: checksum "
                    f"mismatch in the shard at index {[list(p) for p in index]}, block at byte "
                    f"{start - offset} of it (got {int(got[i]):016x}, "
                    f"publisher {int(table[i, 0]):016x})")
        if self.puller.config.check_finite:  # the publisher's finding, per block, with its digest
            flagged = np.flatnonzero(table[:, 1] & _NONFINITE_BIT).tolist()
            self.puller.nonfinite.extend(blocks[i][0] for i in flagged)
        rows: dict[tuple[str, Index], list[int]] = {}
        for i, (name, index, *_) in enumerate(blocks):
            rows.setdefault((name, index), []).append(i)
        digests: dict[str, dict[Index, str]] = {}
        for (name, index), idx in rows.items():
            digests.setdefault(name, {})[index] = checksum.from_blocks(got[idx])
        return digests

    def _wait_for_publisher(self, manifest: Manifest, stamps: Callable[[], tuple[int, int]],
                            deadline: float, pid: int | None) -> None:
        """A short wait for the publisher to write more of a streamed version; raises when it
        was superseded, the publisher died, or the pull's deadline passed."""
        stamp, writing = stamps()
        if stamp == STAMP_SUPERSEDED or (stamp != manifest.version
                                         and writing != manifest.version):
            raise VersionGone(f"version {manifest.version} was superseded while streamed")
        if pid is not None and not process_alive(int(pid)):
            raise PublisherUnavailable(f"the publisher (pid {pid}) exited while writing "
                                       f"version {manifest.version}")
        if time.monotonic() > deadline:
            raise TransferTimeout(f"version {manifest.version} was not fully written before "
                                  "the pull's deadline")
        time.sleep(STREAM_POLL_S)
