"""Generator side: pulls the newest version in the generator's own layout, verifies it, and
returns parameters ready for ``Engine.update_weights``.

A pull never touches the engine: it builds new arrays in the engine's shardings (and dtypes)
through one transport (:mod:`rl_jax.transfer.transports`), checks every shard's checksum against
the manifest (and, over the host transports, that every value is finite: as the publisher found
while staging the bytes the checksums cover, or, for a ``disk`` checkpoint, by reading them:
:mod:`rl_jax.transfer.finite`), and only then returns them. Any failure (publisher gone,
deadline passed, corrupted or superseded data, layout refused) raises a
:class:`~rl_jax.transfer.errors.TransferError` and the caller simply keeps serving the weights it
has: a generator can never see a half-written version.

What a manifest names is checked before it is used (:mod:`rl_jax.transfer.pulling`): the files
of the host transports must lie in the staging directory the publisher announced, a ``disk``
checkpoint in its disk directory, every byte range inside the staging file, and the version
must be newer than the one asked after. :class:`GeneratorPuller`, what the generator server
calls, is in :mod:`rl_jax.transfer.puller.generator`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
import uuid as uuid_lib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import finite, transports as registry
from rl_jax.transfer.chunks import numpy_dtype, parse_chunk
from rl_jax.transfer.config import MAX_WAIT_S, STAGING_PREFIX, PullerConfig
from rl_jax.transfer.control import ControlClient, host_id, peer_error
from rl_jax.transfer.errors import (IntegrityError, LayoutError, NonFiniteWeights,
                                    PublisherUnavailable, TransferError, TransferTimeout,
                                    TransportUnavailable, VersionGone)
from rl_jax.transfer.layout import Index, Layout, flatten, index_shape, normalize_index, unflatten
from rl_jax.transfer.manifest import Manifest, TensorInfo, verify
from rl_jax.transfer.pulling import check_extents, completed, run_with_deadline
from rl_jax.transfer.transports.base import Fetched, Transport

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



REPORTER_IDLE_S = 60.0  # a report sender with nothing to send for this long exits


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
        if config.transport != "auto" and config.transport not in registry.names():
            raise ValueError(f"transport must be 'auto' or one of {registry.names()}, got "
                             f"{config.transport!r}")
        self.config = config
        self.client = ControlClient(url, config.http_timeout_s, config.auth_token,
                                    config.max_answer_bytes)
        self.layout = Layout.from_arrays(target)
        self.layout_key = self.layout.key
        flat = flatten(target)
        self.shardings = {n: a.sharding for n, a in flat.items()}
        self.puller_id = puller_id or f"{host_id().split('/')[0]}:{os.getpid()}:" \
                                      f"{uuid_lib.uuid4().hex[:8]}"
        self._transports = list(transports) if transports else None
        self._registered = False
        # the publisher's staging and disk directories (where the files its manifests name
        # must lie), as its /v1/info said
        self.directories: dict[str, str | None] = {}
        self._deadline: float | None = None  # of the pull under way
        self.nonfinite: list[str] = []  # tensors of the pull under way with non-finite values
        self.hooks: dict[str, Callable[[], None]] = {}  # test seams: "mid_pull", "stream_start"
        self._pulls: dict[str, Transport] = {}  # each transport's puller side, made on first use
        self._reports: collections.deque[dict[str, Any]] = collections.deque()
        self._reports_lock = threading.Lock()
        self._reports_ready = threading.Condition(self._reports_lock)
        self._reporter: threading.Thread | None = None

    # ---- control --------------------------------------------------------------------------------

    def _choose(self, offered: Sequence[str], publisher_host: str) -> str:
        if self.config.transport != "auto":
            return self.config.transport
        for t in registry.names():
            if t in offered and not (registry.get(t).same_host and publisher_host != host_id()):
                return t
        raise TransportUnavailable(f"no usable transport among {list(offered)}")

    def register(self) -> dict[str, Any]:
        """Tells the publisher this layout (and transports); returns its answer."""
        status, info = self.client.request("GET", "/v1/info", deadline=self._deadline)
        if status != 200 or not isinstance(info, dict):
            raise PublisherUnavailable(f"publisher {self.client.url} answered /v1/info with "
                                       f"{status} and {type(info).__name__}, not an object "
                                       f"{peer_error(info)}".rstrip())
        offered, host = info.get("transports"), info.get("host_id")
        if not isinstance(offered, list) or not all(isinstance(t, str) for t in offered) \
                or not isinstance(host, str):
            raise PublisherUnavailable(f"publisher {self.client.url} answered /v1/info without "
                                       "a list of transports and a host_id: not a publisher")
        self.directories = {"staging": self._staging_dir(info.get("staging_dir")),
                            "disk": info.get("disk_dir") if isinstance(info.get("disk_dir"), str)
                            else None}
        if self._transports is None:
            self._transports = [self._choose(offered, host)]
        status, data = self.client.request("POST", "/v1/register", body={
            "layout": self.layout.to_json(), "transports": self._transports,
            "puller_id": self.puller_id}, deadline=self._deadline)
        if status != 200:
            raise TransportUnavailable(f"publisher refused the registration: {status} "
                                       f"{peer_error(data)}".rstrip())
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
                                  f"{peer_error(data)}")
            if status == 204 or data is None:
                return None
            if status != 200:
                raise TransferError(f"manifest request failed: {status} "
                                    f"{peer_error(data)}".rstrip())
            if not isinstance(data, dict):
                raise IntegrityError(f"the publisher's manifest is a JSON "
                                     f"{type(data).__name__}, not an object")
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
            self.nonfinite = []
            try:
                arrays, nbytes, digests = self._fetch(chosen, manifest, deadline)
                fetched = time.perf_counter()
                if registry.get(chosen).streamed(manifest):  # verified block by block as written
                    manifest = completed(manifest, digests)
                else:
                    verify(manifest, arrays, digests=digests)
                if self.nonfinite:
                    names = sorted(set(self.nonfinite))
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
                                and registry.get(chosen).checks_values)

    def _pick(self, manifest: Manifest) -> str:
        offered = [t for t in registry.names() if t in manifest.transports]
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
        version = info.get("version") if isinstance(info, dict) else None
        return isinstance(version, int) and version > manifest.version

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

    def _fetch(self, transport: str, manifest: Manifest, deadline: float) -> Fetched:
        """``manifest``'s version over ``transport`` within ``deadline``; whatever goes wrong
        is a :class:`TransferError`."""
        if transport not in manifest.transports:
            offered = sorted(t for t in manifest.transports if t in registry.names())
            raise TransportUnavailable(
                f"version {manifest.version} is not offered over {transport} for this layout "
                f"(offered: {offered}); register with that transport")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"the pull's deadline passed before version "
                                  f"{manifest.version} was fetched")
        kind = registry.get(transport)
        if kind.staging == "host":
            check_extents(manifest)
        try:
            pull = self._pulls.get(transport)
            if pull is None:
                pull = self._pulls[transport] = kind(self)
            if kind.keeps_deadline:
                return pull.fetch(manifest, deadline)
            return run_with_deadline(lambda: pull.fetch(manifest, deadline), remaining,
                                     f"{transport} pull")
        except TransferError:
            raise
        except Exception as e:  # never let a transport bug take the generator down
            raise TransferError(f"{transport} pull of version {manifest.version} failed: "
                                f"{type(e).__name__}: {e}") from e

    # ---- helpers of the transports --------------------------------------------------------------

    def arrays_from_chunks(self, manifest: Manifest, buf: np.ndarray, *,
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
                self.require_finite(manifest, tensor, views.values())
            arrays[tensor.name] = self.place(tensor.name, tensor.shape, views)
        return arrays

    def require_finite(self, manifest: Manifest, tensor: TensorInfo, values) -> None:
        """Notes ``tensor`` in :attr:`nonfinite` when it holds a non-finite value: as the
        publisher found while staging the bytes its digests cover (``TensorInfo.finite``),
        else by reading ``values`` (its host arrays). Nothing when
        ``PullerConfig.check_finite`` is off. The pull refuses the version once its digests
        matched (so that corrupted bytes are reported as such)."""
        if not self.config.check_finite:
            return
        ok = tensor.finite if tensor.finite is not None else all(
            finite.all_finite(v) for v in values)
        if not ok:
            self.nonfinite.append(tensor.name)

    def place(self, name: str, shape: tuple[int, ...], views: Mapping[Index, np.ndarray]
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
