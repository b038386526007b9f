"""Generator side: pulls the newest version in the generator's own layout, verifies it, and
returns parameters ready for ``Engine.update_weights``.

A pull never touches the engine: it builds new arrays in the engine's shardings (and dtypes),
checks every shard's checksum against the manifest (and, over the host transports, that every
value is finite: as the publisher found while staging the bytes the checksums cover, or, for a
``disk`` checkpoint, by reading them: :mod:`rl_jax.transfer.finite`), and only then returns them. Over ``shm`` the
arrays alias the publisher's staging slot (no copy: each byte is read once, to verify it); the
slot is held with a shared lock for as long as any of them lives, and the publisher never
rewrites a held slot. Any failure
(publisher gone, deadline passed, corrupted or superseded data, layout refused) raises a
:class:`~rl_jax.transfer.errors.TransferError` and the caller simply keeps serving the weights it
has: a generator can never see a half-written version.

What a manifest names is checked before it is used: the files of the host transports must lie
in the staging directory the publisher announced (no ``..``, no symlink leading out), a
``disk`` checkpoint in its disk directory, every byte range inside the staging file, and the
version must be newer than the one asked after.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fcntl
import http.client
import logging
import mmap
import os
import sys
import threading
import time
import uuid as uuid_lib
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum, finite, jax_transport
from rl_jax.transfer.chunks import numpy_dtype, parse_chunk
from rl_jax.transfer.config import MAX_WAIT_S, TRANSPORTS, PullerConfig
from rl_jax.transfer.control import ControlClient, host_id, normalize_url
from rl_jax.transfer.errors import (IntegrityError, LayoutError, NonFiniteWeights,
                                    PublisherNotAllowed,
                                    PublisherUnavailable, TransferError, TransferTimeout,
                                    TransportUnavailable, VersionGone)
from rl_jax.transfer.layout import (Index, Layout, flatten, index_shape, normalize_index,
                                    unflatten)
from rl_jax.transfer.manifest import PENDING, Manifest, TensorInfo, verify
from rl_jax.transfer.staging import NONFINITE, STAMP_SUPERSEDED, STAMP_WRITING

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PullMetrics:
    """One successful pull. ``bytes`` are the bytes that crossed the process boundary into
    this process (for ``jax_transfer``, one copy per device shard); ``seconds`` runs from the
    manifest's arrival to verified arrays (``fetch_seconds`` + ``verify_seconds``)."""

    transport: str
    version: int
    previous_version: int | None
    versions_skipped: int
    bytes: int
    seconds: float
    fetch_seconds: float
    verify_seconds: float
    attempts: int

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gbps": self.gbps}


@dataclasses.dataclass
class WeightUpdate:
    """Verified parameters (nested dict, in the target shardings) and their version.
    ``finite_checked``: every value was found finite by the puller (host transports with
    ``PullerConfig.check_finite``); pass it on to ``Engine.update_weights``."""

    params: dict[str, Any]
    version: int
    metrics: PullMetrics
    manifest: Manifest
    finite_checked: bool = False


def run_with_deadline(fn: Callable[[], Any], seconds: float, what: str,
                      on_abandon: Callable[[], None] | None = None) -> Any:
    """Runs ``fn`` in a daemon thread; past ``seconds`` the thread is abandoned (it may hang in
    a pull that never completes) and :class:`TransferTimeout` is raised."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"transfer-{what}", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    if thread.is_alive():
        if on_abandon is not None:
            on_abandon()
        raise TransferTimeout(f"{what} did not finish within {seconds:.1f} s; abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def aligned_host_buffer(nbytes: int) -> np.ndarray:
    """A fresh page-aligned private buffer (transparent huge pages where the kernel allows),
    so that XLA's CPU client can adopt its 64-byte aligned slices without copying."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, np.uint8)  # exactly nbytes long: views of it have it as their base


class HostBufferPool:
    """Reusable aligned host buffers for the ``socket`` transport.

    Pulled arrays alias their buffer (no copy into XLA on CPU), so a buffer can be reused only
    once nothing references it any more: JAX keeps a reference to the buffer's base array for as
    long as an array aliases it, which ``sys.getrefcount`` sees. A buffer still in use is never
    handed out; when none is free a new one is allocated (at most ``max_buffers`` are kept).
    Reused buffers have warm pages: no page faults, no kernel zeroing.
    """

    def __init__(self, max_buffers: int = 3):
        self.max_buffers = max_buffers
        self._bases: list[np.ndarray] = []

    def get(self, nbytes: int) -> np.ndarray:
        for base in self._bases:
            # references: the list, the loop variable, getrefcount's argument
            if base.size >= nbytes and sys.getrefcount(base) <= 3:
                return base[:nbytes]
        base = aligned_host_buffer(nbytes)
        assert base.base is not None and not isinstance(base.base, np.ndarray)
        if len(self._bases) >= self.max_buffers:
            free = [b for b in self._bases if sys.getrefcount(b) <= 3]
            if not free:
                return base  # all kept buffers are in use: this one is not pooled
            self._bases.remove(min(free, key=lambda b: b.size))
        self._bases.append(base)
        return base[:nbytes]


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


REPORTER_IDLE_S = 60.0  # a report sender with nothing to send for this long exits
STREAM_POLL_S = 100e-6  # how often a streamed pull looks for newly written blocks


def _streamed(manifest: Manifest) -> bool:
    """Whether ``manifest`` was announced before its version was staged (checksums pending,
    in the slot's progress table)."""
    return "progress" in manifest.transports.get("shm", {})


_NONFINITE_BIT = np.uint64(NONFINITE)  # of a progress row's version (see staging)
_VERSION_BITS = np.uint64(NONFINITE - 1)


def _completed(manifest: Manifest, digests: Mapping[str, Mapping[Index, str]]) -> Manifest:
    """A streamed manifest with the shard digests verified block by block filled in."""
    tensors = []
    for t in manifest.tensors:
        shards = tuple(dataclasses.replace(sh, checksum=digests.get(t.name, {}).get(
            sh.index, PENDING)) for sh in t.shards)
        tensors.append(dataclasses.replace(t, shards=shards, checksum=checksum.combine(
            [(sh.index, sh.checksum) for sh in shards], manifest.algorithm)))
    return dataclasses.replace(manifest, tensors=tuple(tensors))


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


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


STAGING_PREFIX = "rl_jax-transfer-"  # the name of a publisher's staging directory


def contained(path: Any, root: str | None, what: str) -> str:
    """``path`` (a path a manifest names), resolved, if it lies strictly inside the directory
    ``root`` (resolved too); raises :class:`IntegrityError` for ``..`` components, a path
    elsewhere, or a symlink on the way that leads out."""
    if root is None:
        raise IntegrityError(f"{what} {str(path)[:200]!r}: the publisher named no directory "
                             "for it, so it cannot be checked; refused")
    if not isinstance(path, str) or not path or "\0" in path:
        raise IntegrityError(f"{what} must be a path, got {str(path)[:200]!r}")
    if ".." in Path(path).parts:
        raise IntegrityError(f"{what} {path[:200]!r} contains '..'; refused")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # an absolute path stays itself
    if real == real_root or os.path.commonpath([real, real_root]) != real_root:
        raise IntegrityError(f"{what} {path[:200]!r} lies outside the publisher's directory "
                             f"{root!r} (resolved: {real!r}); refused")
    return real


def pinned_publisher(requested: str | None, configured: str | None, allow_any: bool = False
                     ) -> str:
    """The publisher a generator may pull from when a request names ``requested`` (None:
    the ``configured`` one, the generator's own): that one, or any other only with
    ``allow_any``.

    Addresses are compared as ``http://host:port`` (lower-case host). Raises
    :class:`PublisherNotAllowed` for another publisher, ``ValueError`` for a malformed address
    or when neither is given."""
    if requested in (None, ""):
        if not configured:
            raise ValueError("publisher_url is required (this generator was started without "
                             "one)")
        return configured
    url = normalize_url(requested)
    if configured and url == normalize_url(configured):
        return configured  # as configured: the generator keeps one puller per publisher
    if allow_any:
        return url
    if not configured:
        raise PublisherNotAllowed(f"this generator was started without a publisher and may "
                                  f"not pull from {url} (its configuration does not allow any "
                                  "publisher)")
    raise PublisherNotAllowed(f"this generator pulls only from its publisher "
                              f"{normalize_url(configured)}, not {url} (its configuration does "
                              "not allow other publishers)")


def _check_extents(manifest: Manifest) -> None:
    """Raises :class:`IntegrityError` unless every chunk and shard a host transport reads lies
    inside the staging file the manifest describes."""
    staging = manifest.transports.get("staging")
    if not isinstance(staging, Mapping):
        raise IntegrityError(f"version {manifest.version}: the manifest describes no staging")
    try:
        total = int(staging["nbytes"])
        chunks = [(int(c["offset"]), int(c["nbytes"])) for c in staging["chunks"]]
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"version {manifest.version}: malformed staging description: "
                             f"{e!r}") from e
    if not 0 <= total <= 1 << 50:
        raise IntegrityError(f"version {manifest.version}: staging size {total} is out of range")
    for offset, nbytes in chunks:
        if offset < 0 or nbytes <= 0 or offset + nbytes > total:
            raise IntegrityError(f"version {manifest.version}: chunk at {offset} of {nbytes} "
                                 f"bytes lies outside the {total}-byte staging file")
    for tensor in manifest.tensors:
        for shard in tensor.shards:
            if shard.offset is None or shard.offset < 0 or shard.nbytes < 0 \
                    or shard.offset + shard.nbytes > total:
                raise IntegrityError(f"version {manifest.version}: {tensor.name}'s shard at "
                                     f"{shard.offset} of {shard.nbytes} bytes lies outside the "
                                     f"{total}-byte staging file")


class Puller:
    """Pulls versions from one publisher into fixed target shardings.

    Args:
      url: the publisher's control URL (``Publisher.url``).
      target: nested dict of arrays or ``ShapeDtypeStruct``s with shardings: the layout and
        dtypes the pulled parameters must have (e.g. an engine's live parameters).
      config: :class:`PullerConfig`.
      transports: what to register for (default: the one transport this puller will use);
        list several to pull one version through different transports.
    """

    def __init__(self, url: str, target: Mapping[str, Any], *,
                 config: PullerConfig | None = None, puller_id: str | None = None,
                 transports: Sequence[str] | None = None):
        config = PullerConfig() if config is None else config
        if config.transport != "auto" and config.transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {TRANSPORTS}, got "
                             f"{config.transport!r}")
        self.config = config
        self.client = ControlClient(url, config.http_timeout_s, config.auth_token)
        self.layout = Layout.from_arrays(target)
        self.layout_key = self.layout.key
        flat = flatten(target)
        self.shardings = {n: a.sharding for n, a in flat.items()}
        self.puller_id = puller_id or f"{host_id().split('/')[0]}:{os.getpid()}:" \
                                      f"{uuid_lib.uuid4().hex[:8]}"
        self._transports = list(transports) if transports else None
        self._registered = False
        self._dirs: dict[str, str | None] = {}  # the publisher's staging and disk directories
        self._deadline: float | None = None  # of the pull under way
        self._nonfinite: list[str] = []  # tensors of the pull under way with non-finite values
        self._transfer_host = "127.0.0.1" if _is_loopback(self.client.host) else "0.0.0.0"
        self.hooks: dict[str, Callable[[], None]] = {}  # test seams: "mid_pull", "stream_start"
        self._buffers = HostBufferPool(config.host_buffers)
        self._sources = _SourceMaps()
        self._reports: collections.deque[dict[str, Any]] = collections.deque()
        self._reports_lock = threading.Lock()
        self._reports_ready = threading.Condition(self._reports_lock)
        self._reporter: threading.Thread | None = None

    # ---- control --------------------------------------------------------------------------------

    def _choose(self, offered: Sequence[str], publisher_host: str) -> str:
        if self.config.transport != "auto":
            return self.config.transport
        for t in TRANSPORTS:
            if t in offered and not (t == "shm" and publisher_host != host_id()):
                return t
        raise TransportUnavailable(f"no usable transport among {list(offered)}")

    def register(self) -> dict[str, Any]:
        """Tells the publisher this layout (and transports); returns its answer."""
        status, info = self.client.request("GET", "/v1/info", deadline=self._deadline)
        if status != 200 or not isinstance(info, dict):
            raise PublisherUnavailable(f"publisher {self.client.url} answered /v1/info with "
                                       f"{status}: {str(info)[:200]}")
        self._dirs = {"staging": self._staging_dir(info.get("staging_dir")),
                      "disk": info.get("disk_dir") if isinstance(info.get("disk_dir"), str)
                      else None}
        if self._transports is None:
            self._transports = [self._choose(info["transports"], info["host_id"])]
        status, data = self.client.request("POST", "/v1/register", body={
            "layout": self.layout.to_json(), "transports": self._transports,
            "puller_id": self.puller_id}, deadline=self._deadline)
        if status != 200:
            raise TransportUnavailable(f"publisher refused the registration: "
                                       f"{(data or {}).get('error')}")
        self._registered = True
        return data

    @staticmethod
    def _staging_dir(path: Any) -> str | None:
        """The publisher's staging directory, if it looks like one (an absolute path to a
        directory named ``rl_jax-transfer-*``); host transport files must lie inside it."""
        if not isinstance(path, str) or not os.path.isabs(path) \
                or not Path(path).name.startswith(STAGING_PREFIX) or ".." in Path(path).parts:
            return None
        return path

    def poll(self, after: int, wait_s: float = 0.0) -> Manifest | None:
        """The manifest of the newest version ``> after`` for this layout, waiting up to
        ``wait_s`` for one to appear (None if none did)."""
        for _ in range(2):
            if not self._registered:
                self.register()
            status, data = self.client.request(
                "GET", "/v1/manifest", query={"layout": self.layout_key, "after": after,
                                              "wait": wait_s},
                timeout=self.config.http_timeout_s + wait_s, deadline=self._deadline)
            if status == 404:  # a restarted publisher: register again
                self._registered = False
                continue
            if status == 409:
                raise LayoutError(f"publisher cannot produce this generator's layout: "
                                  f"{data.get('error')}")
            if status == 204 or data is None:
                return None
            if status != 200:
                raise TransferError(f"manifest request failed: {status} {data}")
            if not isinstance(data, dict):
                raise IntegrityError(f"the publisher's manifest is not a JSON object: "
                                     f"{str(data)[:200]}")
            manifest = Manifest.from_json(data)
            if manifest.version <= after:
                raise IntegrityError(f"the publisher answered with version {manifest.version} "
                                     f"when asked for one newer than {after}; refused")
            if manifest.layout_key != self.layout_key:
                raise IntegrityError(f"the publisher answered with a manifest for layout "
                                     f"{manifest.layout_key[:80]!r}, not this generator's "
                                     f"{self.layout_key!r}; refused")
            return manifest
        raise PublisherUnavailable("publisher keeps forgetting this layout")

    # ---- pulling --------------------------------------------------------------------------------

    def pull(self, after: int, *, wait_s: float = 0.0, current: int | None = None,
             transport: str | None = None) -> WeightUpdate | None:
        """Pulls the newest version ``> after`` (waiting up to ``wait_s`` for one), verified.

        ``current`` is the version the caller runs now (default ``after``): versions between
        it and the pulled one count as skipped. Returns None when there is nothing newer;
        raises :class:`TransferError` on any failure (the caller keeps its weights).
        """
        current = after if current is None else current
        wait_s = min(max(float(wait_s), 0.0), MAX_WAIT_S)
        # One deadline for the whole pull (registration, manifest, data, verification); the
        # long-poll's wait comes on top of it, and the data must come within ``timeout_s`` of
        # the manifest.
        deadline = time.monotonic() + self.config.timeout_s + wait_s
        self._deadline = deadline
        try:
            return self._pull(after, wait_s, current, transport, deadline)
        finally:
            self._deadline = None

    def _pull(self, after: int, wait_s: float, current: int | None, transport: str | None,
              deadline: float) -> WeightUpdate | None:
        manifest = self.poll(after, wait_s)
        if manifest is None:
            return None
        # Fetching and verifying get ``timeout_s`` from the manifest's arrival (within the
        # whole pull's deadline).
        deadline = self._deadline = min(deadline, time.monotonic() + self.config.timeout_s)
        attempts = 0
        while True:
            attempts += 1
            chosen = transport or self._pick(manifest)
            start = time.perf_counter()
            self._nonfinite = []
            try:
                arrays, nbytes, *digests = self._fetch(chosen, manifest, deadline)
                fetched = time.perf_counter()
                if _streamed(manifest):  # verified by _fetch_shm, block by block as written
                    manifest = _completed(manifest, digests[0])
                else:
                    verify(manifest, arrays, digests=digests[0] if digests else None)
                if self._nonfinite:
                    names = sorted(set(self._nonfinite))
                    raise NonFiniteWeights(
                        f"pulled weights (version {manifest.version}) refused: {len(names)} "
                        f"tensor(s) hold non-finite values (NaN or infinity): {names[:5]}")
            except (VersionGone, IntegrityError) as e:
                if attempts > self.config.retries or not self._superseded(manifest, e):
                    self._report(manifest.version, chosen, False, 0.0, 0, str(e))
                    raise
                log.info("version %d superseded while pulling; pulling the newest",
                         manifest.version)
                newer = self.poll(manifest.version, 0.0)
                if newer is None:
                    raise
                manifest = newer
                continue
            except TransferError as e:
                self._report(manifest.version, chosen, False, 0.0, 0, str(e))
                raise
            end = time.perf_counter()
            metrics = PullMetrics(
                transport=chosen, version=manifest.version, previous_version=current,
                versions_skipped=0 if current is None or current < 0
                else max(0, manifest.version - current - 1),
                bytes=nbytes, seconds=end - start, fetch_seconds=fetched - start,
                verify_seconds=end - fetched, attempts=attempts)
            self._report(manifest.version, chosen, True, metrics.seconds, nbytes, None)
            return WeightUpdate(unflatten(arrays), manifest.version, metrics, manifest,
                                finite_checked=self.config.check_finite
                                and chosen != "jax_transfer")

    def _pick(self, manifest: Manifest) -> str:
        offered = [t for t in TRANSPORTS if t in manifest.transports]
        registered = [t for t in offered if t in (self._transports or offered)]
        if not registered and self.config.transport == "auto":
            # The publisher fell back to another transport (e.g. ``disk`` when its staging
            # space ran out).
            registered = offered
        return self._choose(registered, manifest.host_id)

    def _superseded(self, manifest: Manifest, error: Exception) -> bool:
        if isinstance(error, VersionGone):
            return True
        try:
            _, info = self.client.request("GET", "/v1/info", timeout=5.0,
                                          deadline=self._deadline)
        except TransferError:
            return False
        return info.get("version") is not None and info["version"] > manifest.version

    def _report(self, version, transport, ok, seconds, nbytes, error):
        body = {"puller_id": self.puller_id, "version": version, "transport": transport,
                "ok": ok, "seconds": seconds, "bytes": nbytes, "error": error,
                "layout_key": self.layout_key}

        with self._reports_lock:  # one sender thread, started on the first report
            self._reports.append(body)
            if self._reporter is None or not self._reporter.is_alive():
                self._reporter = threading.Thread(target=self._send_reports, daemon=True,
                                                  name="transfer-report")
                self._reporter.start()
            self._reports_ready.notify()

    def _send_reports(self) -> None:
        """Posts queued pull reports to the publisher (best effort; the pull never waits)."""
        while True:
            with self._reports_lock:
                while not self._reports:
                    if not self._reports_ready.wait(REPORTER_IDLE_S) and not self._reports:
                        self._reporter = None  # idle: the next report starts a new sender
                        return
                body = self._reports.popleft()
            try:
                self.client.request("POST", "/v1/report", body=body, timeout=5.0)
            except TransferError:
                pass

    def _fetch(self, transport: str, manifest: Manifest, deadline: float
               ) -> tuple[dict[str, jax.Array], int]:
        if transport not in manifest.transports:
            raise TransportUnavailable(
                f"version {manifest.version} is not offered over {transport} for this layout "
                f"(offered: {sorted(t for t in manifest.transports if t in TRANSPORTS)}); "
                "register with that transport")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"the pull's deadline passed before version "
                                  f"{manifest.version} was fetched")
        if transport in ("shm", "socket"):
            _check_extents(manifest)
        try:
            if transport == "jax_transfer":
                return self._fetch_jax(manifest, remaining)
            if transport == "shm":  # never blocks: it waits only in its own deadline checks
                return self._fetch_shm(manifest, deadline)
            fn = {"socket": self._fetch_socket, "disk": self._fetch_disk}[transport]
            return run_with_deadline(lambda: fn(manifest), remaining, f"{transport} pull")
        except TransferError:
            raise
        except Exception as e:  # never let a transport bug take the generator down
            raise TransferError(f"{transport} pull of version {manifest.version} failed: "
                                f"{type(e).__name__}: {e}") from e

    # ---- host transports ------------------------------------------------------------------------

    def _fetch_shm(self, manifest: Manifest, deadline: float
                   ) -> tuple[dict[str, jax.Array], int, dict]:
        """Zero-copy: the arrays alias the publisher's staging slot (mapped read-only), whose
        shared lock lives as long as they do. Each shard is hashed where it lies; a streamed
        version is verified block by block as the publisher writes it."""
        if manifest.host_id != host_id():
            raise TransportUnavailable("the publisher is on another host: shm is unusable")
        info, staging = dict(manifest.transports["shm"]), manifest.transports["staging"]
        total = int(staging["nbytes"])
        streamed = _streamed(manifest)
        for name in ("file", "stamp") + (("progress",) if streamed else ()):
            info[name] = contained(info.get(name), self._dirs.get("staging"),
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
                arrays = self._arrays_from_chunks(manifest, base, check_finite=False)
                verify(manifest, arrays, checksums=False)
                if not all(_aliases(a, base) for a in arrays.values()):
                    arrays = None
                digests = self._verify_streamed(manifest, base, stamps, deadline,
                                                info["progress"])
            else:
                hashed = checksum.Digests(manifest.algorithm, self.config.digest_threads)
                for k, tensor in enumerate(manifest.tensors):
                    if k == len(manifest.tensors) // 2 and "mid_pull" in self.hooks:
                        self.hooks["mid_pull"]()
                    for shard in tensor.shards:
                        hashed.add((tensor.name, shard.index),
                                   base[shard.offset:shard.offset + shard.nbytes])
                digests: dict[str, dict[Index, str]] = {}
                for (name, index), value in hashed.result().items():
                    digests.setdefault(name, {})[index] = value
            if stamps()[0] != manifest.version:
                raise VersionGone(f"version {manifest.version} was superseded while read")
            if arrays is None:  # (a streamed version's findings are in its progress table)
                arrays = self._arrays_from_chunks(manifest, base,
                                                  check_finite=not streamed)
            return arrays, total, digests
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
        if "stream_start" in self.hooks:
            self.hooks["stream_start"]()
        version = np.uint64(manifest.version)
        got = np.zeros(len(blocks), np.uint64)
        bad = []
        mid_pull = len(blocks) // 2 if "mid_pull" in self.hooks else -1
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
                    self.hooks["mid_pull"]()
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
        if self.config.check_finite:  # the publisher's finding, per block, with its digest
            flagged = np.flatnonzero(table[:, 1] & _NONFINITE_BIT).tolist()
            self._nonfinite.extend(blocks[i][0] for i in flagged)
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
        if pid is not None:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                raise PublisherUnavailable(f"the publisher (pid {pid}) exited while writing "
                                           f"version {manifest.version}") from None
            except PermissionError:
                pass
        if time.monotonic() > deadline:
            raise TransferTimeout(f"version {manifest.version} was not fully written before "
                                  "the pull's deadline")
        time.sleep(STREAM_POLL_S)

    def _fetch_socket(self, manifest: Manifest) -> tuple[dict[str, jax.Array], int]:
        staging = manifest.transports["staging"]
        total = int(staging["nbytes"])
        buf = self._buffers.get(total)
        chunks = [(int(c["offset"]), int(c["nbytes"])) for c in staging["chunks"]]
        local = threading.local()
        done = []
        headers = self.client.headers()

        def get(chunk):
            offset, nbytes = chunk
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = self.client.connection()
            query = (f"/v1/chunk?layout={self.layout_key}&version={manifest.version}"
                     f"&offset={offset}&nbytes={nbytes}")
            try:
                conn.request("GET", query, headers=headers)
                resp = conn.getresponse()
                if resp.status == 410:
                    resp.read()
                    raise VersionGone(f"version {manifest.version} was superseded")
                if resp.status != 200:
                    raise TransferError(f"chunk request failed: {resp.status} "
                                        f"{resp.read()[:300]!r}")
                view = memoryview(buf[offset:offset + nbytes])
                got = 0
                while got < nbytes:
                    n = resp.readinto(view[got:])
                    if not n:
                        raise TransferError(f"chunk at {offset} ended after {got} of {nbytes} "
                                            "bytes (publisher gone?)")
                    got += n
            except (OSError, http.client.HTTPException) as e:
                local.conn = None
                conn.close()
                raise PublisherUnavailable(f"chunk at {offset} failed: {type(e).__name__}: "
                                           f"{e}") from e
            done.append(nbytes)
            if "mid_pull" in self.hooks and len(done) == 1:
                self.hooks["mid_pull"]()  # test seam: one chunk in, the others not yet

        workers = max(1, min(self.config.socket_connections, len(chunks)))
        with concurrent.futures.ThreadPoolExecutor(workers, "transfer-socket") as pool:
            for f in [pool.submit(get, c) for c in chunks]:
                f.result()
        return self._arrays_from_chunks(manifest, buf), sum(done)

    def _arrays_from_chunks(self, manifest: Manifest, buf: np.ndarray, *,
                            check_finite: bool = True) -> dict[str, jax.Array]:
        """Views into the staged bytes (after checking every chunk header against the
        manifest), placed in the target shardings (without a copy when aligned, on CPU); with
        ``check_finite`` (and ``PullerConfig.check_finite``) every value is checked finite."""
        entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for c in manifest.transports["staging"]["chunks"]:
            offset, nbytes = int(c["offset"]), int(c["nbytes"])
            found, meta = parse_chunk(buf[offset:offset + nbytes])
            found_version = str(meta.get("version", ""))
            if not found_version.isdigit() or int(found_version) != manifest.version:
                raise IntegrityError(f"chunk at {offset} holds version {found_version!r}, "
                                     f"expected {manifest.version}")
            for name, (dtype, shape, start, stop) in found.items():
                entries[name] = (dtype, shape, offset + start, offset + stop)
        arrays = {}
        for tensor in manifest.tensors:
            dtype = numpy_dtype(tensor.dtype)
            views: dict[Index, np.ndarray] = {}
            for k, shard in enumerate(tensor.shards):
                entry = entries.get(f"{tensor.name}#{k}")
                if entry is None:
                    raise IntegrityError(f"{tensor.name}: shard {k} is missing from the chunks")
                e_dtype, e_shape, start, stop = entry
                if e_dtype != dtype or e_shape != index_shape(shard.index) or (
                        shard.offset is not None and start != shard.offset):
                    raise IntegrityError(f"{tensor.name}: shard {k} in the chunks ({e_dtype}, "
                                         f"{e_shape} at {start}) does not match the manifest")
                views[shard.index] = buf[start:stop].view(dtype).reshape(e_shape)
            if check_finite:
                self._require_finite(manifest, tensor, views.values())
            arrays[tensor.name] = self._place(tensor.name, tensor.shape, views)
        return arrays

    def _require_finite(self, manifest: Manifest, tensor: TensorInfo, values) -> None:
        """Notes ``tensor`` in :attr:`_nonfinite` when it holds a non-finite value: as the
        publisher found while staging the bytes its digests cover (``TensorInfo.finite``),
        else by reading ``values`` (its host arrays). Nothing when
        ``PullerConfig.check_finite`` is off. The pull refuses the version once its digests
        matched (so that corrupted bytes are reported as such)."""
        if not self.config.check_finite:
            return
        ok = tensor.finite if tensor.finite is not None else all(
            finite.all_finite(v) for v in values)
        if not ok:
            self._nonfinite.append(tensor.name)

    def _place(self, name: str, shape: tuple[int, ...], views: Mapping[Index, np.ndarray]
               ) -> jax.Array:
        sharding = self.shardings.get(name)
        if sharding is None:
            raise IntegrityError(f"the publisher sent tensor {name!r}, which this generator "
                                 "does not have")

        def callback(index):
            key = normalize_index(index, shape)
            if key not in views:
                raise IntegrityError(f"{name}: no shard for index {key} in the pulled data")
            return views[key]

        return jax.make_array_from_callback(shape, sharding, callback)

    # ---- jax.experimental.transfer --------------------------------------------------------------

    def _fetch_jax(self, manifest: Manifest, remaining: float
                   ) -> tuple[dict[str, jax.Array], int]:
        info = manifest.transports["jax_transfer"]
        count = int(info["num_transport_addresses"])
        if count != self.config.num_transport_addresses:
            raise TransportUnavailable(
                f"publisher uses {count} transport addresses, this puller "
                f"{self.config.num_transport_addresses}; they must match")
        status, ticket = self.client.request("POST", "/v1/ticket", body={
            "version": manifest.version, "layout_key": self.layout_key,
            "puller_id": self.puller_id}, deadline=self._deadline)
        if status == 410:
            raise VersionGone(f"version {manifest.version} was superseded")
        if status != 200:
            raise TransferError(f"pull ticket refused: {status} {(ticket or {}).get('error')}")
        address = ticket["address"]
        names = [t.name for t in manifest.tensors]
        missing = [n for n in names if n not in self.shardings]
        if missing:
            raise IntegrityError(f"the publisher sent tensors this generator does not have: "
                                 f"{missing[:5]}")
        avals = [jax.ShapeDtypeStruct(t.shape, numpy_dtype(t.dtype),
                                      sharding=self.shardings[t.name])
                 for t in manifest.tensors]

        def run():
            conn = jax_transport.connection(address, self._transfer_host, count)
            if "mid_pull" in self.hooks:  # test seam: ticket issued, no data moved yet
                self.hooks["mid_pull"]()
            return jax_transport.pull(conn, int(ticket["uuid"]), avals)

        try:
            pulled = run_with_deadline(run, remaining, "jax_transfer pull",
                                       on_abandon=lambda: jax_transport.drop_connection(address))
        except jax.errors.JaxRuntimeError as e:
            jax_transport.drop_connection(address)
            raise PublisherUnavailable(f"jax_transfer pull from {address} failed: {e}") from e
        arrays = dict(zip(names, pulled))
        nbytes = sum(s.data.nbytes for a in pulled for s in a.addressable_shards)
        return arrays, nbytes

    # ---- disk -----------------------------------------------------------------------------------

    def _fetch_disk(self, manifest: Manifest) -> tuple[dict[str, jax.Array], int]:
        from rl_jax.models.hf import CheckpointError, _TensorReader, hf_mappings, read_config
        path = contained(manifest.transports["disk"].get("path"), self._dirs.get("disk"),
                         f"checkpoint of version {manifest.version}")
        try:
            cfg = read_config(path)
            reader = _TensorReader(Path(path))
        except (CheckpointError, OSError) as e:
            raise VersionGone(f"checkpoint {path} of version {manifest.version} is not "
                              f"readable: {e}") from e
        maps = hf_mappings(cfg)
        arrays, nbytes = {}, 0
        for tensor in manifest.tensors:
            m = maps.get(tensor.name)
            if m is None:
                raise IntegrityError(f"{tensor.name}: no HF name for this tensor")
            dtype = numpy_dtype(tensor.dtype)
            try:
                if "{i}" in m.hf_name:
                    full = np.stack([m.to_ours(reader.get(m.hf_name.format(i=i)))
                                     for i in range(tensor.shape[0])])
                else:
                    full = m.to_ours(reader.get(m.hf_name))
            except (CheckpointError, KeyError) as e:
                raise IntegrityError(f"{tensor.name}: {e}") from e
            full = np.ascontiguousarray(full.astype(dtype, copy=False))
            nbytes += full.nbytes
            if full.shape != tensor.shape:
                raise IntegrityError(f"{tensor.name}: checkpoint shape {full.shape} != "
                                     f"manifest {tensor.shape}")
            self._require_finite(manifest, dataclasses.replace(tensor, finite=None), [full])
            views = {shard.index: full[tuple(slice(a, b) for a, b in shard.index)]
                     for shard in tensor.shards}
            arrays[tensor.name] = self._place(tensor.name, tensor.shape, views)
        return arrays, nbytes


class GeneratorPuller:
    """The generator server's integration surface: pulls for an :class:`Engine`.

    ``pull_latest(engine)`` pauses nothing and changes nothing: it returns a verified
    :class:`WeightUpdate` in the engine's live shardings and dtypes (or None when the publisher
    has nothing newer than ``engine.version``); the server then calls
    ``engine.update_weights(update.params, update.version, finite_checked=...)``, which swaps
    between two decode steps. :meth:`start` runs that loop in a background thread instead.
    """

    def __init__(self, url: str, *, config: PullerConfig | None = None,
                 puller_id: str | None = None, transports: Sequence[str] | None = None):
        self.url, self.config = url, PullerConfig() if config is None else config
        self.puller_id, self.transports = puller_id, transports
        self._puller: Puller | None = None
        self._lock = threading.Lock()
        self.last: PullMetrics | None = None
        self.counters = {"updates": 0, "failures": 0, "versions_skipped": 0, "bytes": 0}
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def puller(self, params: Mapping[str, Any]) -> Puller:
        """The :class:`Puller` for ``params``'s layout (rebuilt if the layout changed)."""
        key = Layout.from_arrays(params).key
        if self._puller is None or self._puller.layout_key != key:
            self._puller = Puller(self.url, params, config=self.config,
                                  puller_id=self.puller_id, transports=self.transports)
        return self._puller

    def pull_latest(self, engine: Any, *, wait_s: float = 0.0, min_version: int | None = None,
                    transport: str | None = None) -> WeightUpdate | None:
        """Pulls the newest version newer than ``engine.version`` (and at least
        ``min_version``), waiting up to ``wait_s`` for one. Raises ``TransferError`` on
        failure; the engine is untouched either way.

        Returns or raises within about ``config.timeout_s + wait_s`` (``wait_s`` at most
        ``MAX_WAIT_S``) whatever the publisher does (see :meth:`Puller.pull`: every request
        and wait of the pull ends at its deadline; a stalled publisher gives
        :class:`TransferTimeout`), so a caller holding a lock around this call holds it for a
        bounded time."""
        wait_s = min(max(float(wait_s), 0.0), MAX_WAIT_S)
        bound = self.config.timeout_s + wait_s
        if not self._lock.acquire(timeout=bound):
            raise TransferTimeout(f"another pull from {self.url} still runs after {bound:.1f} s")
        try:
            current = int(engine.version)
            after = current if min_version is None else max(current, int(min_version) - 1)
            try:
                update = self.puller(engine.params).pull(after, wait_s=wait_s, current=current,
                                                         transport=transport)
            except TransferError as e:
                self.counters["failures"] += 1
                self.last_error = str(e)
                raise
            if update is not None:
                self.last = update.metrics
                self.counters["updates"] += 1
                self.counters["versions_skipped"] += update.metrics.versions_skipped
                self.counters["bytes"] += update.metrics.bytes
            return update
        finally:
            self._lock.release()

    def run(self, engine: Any, stop: threading.Event, wait_s: float = 30.0,
            backoff_s: float = 1.0) -> None:
        """Long-polls and applies every new version until ``stop`` is set."""
        while not stop.is_set():
            try:
                update = self.pull_latest(engine, wait_s=wait_s)
            except TransferError as e:
                log.warning("weight pull failed (keeping version %s): %s", engine.version, e)
                stop.wait(backoff_s)
                continue
            if update is not None:
                try:
                    engine.update_weights(update.params, update.version,
                                          finite_checked=update.finite_checked)
                except (ValueError, RuntimeError) as e:  # e.g. the engine's WeightsRefused
                    # A version the engine refuses (non-finite values, an older version) is
                    # skipped: the engine keeps serving what it has and the next one is pulled.
                    log.warning("weight version %s refused (keeping version %s): %s",
                                update.version, engine.version, e)
                    stop.wait(backoff_s)

    def start(self, engine: Any, wait_s: float = 30.0) -> threading.Thread:
        """:meth:`run` in a daemon thread (stop it with :meth:`stop`)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(engine, self._stop, wait_s),
                                        name="transfer-puller", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "last": None if self.last is None else self.last.to_json(),
                "last_error": self.last_error}
