"""Trainer side: publishes each new version of the parameters in every layout generators asked
for, and answers them over the control channel (:mod:`rl_jax.transfer.control`).

Typical use in a training loop (single-process trainer; in a multi-process trainer every process
must call :meth:`Publisher.publish`, and the host transports need each layout's shards to be
addressable in the publishing process)::

    publisher = Publisher(PublisherConfig(transports=("shm", "socket", "jax_transfer")))
    print(publisher.url)                        # give this to the generators
    for step in ...:
        state, metrics = train_step(state, batch)
        stats = publisher.publish(state.params, int(state.step))   # before the next step
                                                                   # donates state.params

``publish`` returns once the version is announced; it has then read everything it needs from
``params`` (a copy per layout lives in the staging buffers or on the trainer's devices), so the
next train step may donate them. Only the newest version is offered; the previous one is
dropped as soon as the new one is announced (a generator in the middle of pulling it gets
"superseded" and starts again on the newest).

What is staged for each layout, and its manifest, is :mod:`rl_jax.transfer.publisher.preparing`'s;
the
control channel is :mod:`rl_jax.transfer.publisher.routes`'s; each transport's own part of
both is in its module of :mod:`rl_jax.transfer.transports`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rl_jax.transfer import checksum, transports as registry
from rl_jax.transfer.config import (STAGING_PREFIX, PublisherConfig, default_staging_dir,
                                    publisher_token, remove_dead_owners_dirs)
from rl_jax.transfer.control import ControlServer, host_id
from rl_jax.transfer.errors import LayoutError, StagingSpaceError, TransferError
from rl_jax.transfer.layout import flatten
from rl_jax.transfer.publisher.device_staging import DeviceStaging
from rl_jax.transfer.publisher.disk_staging import corrupt_hf_tensor, drop_older, write_checkpoint
from rl_jax.transfer.publisher.preparing import Prepared, Preparing, PublishedVersion, Registration
from rl_jax.transfer.publisher.routes import ControlRoutes
from rl_jax.transfer.publisher.staging import HostStaging, StagedVersion

log = logging.getLogger(__name__)

POLLERS_WAIT_S = 0.002  # longest a publish waits for long-polling pullers to get a manifest


@dataclasses.dataclass(frozen=True)
class PublishStats:
    """What one :meth:`Publisher.publish` did. ``bytes`` counts bytes written per kind of
    copy (``host`` staging buffers, ``device`` layout copies, ``disk``)."""

    version: int
    seconds: float
    layouts: int
    bytes: Mapping[str, int]
    errors: Mapping[str, str]
    # tensors found to hold a non-finite value while staged: pullers refuse the version
    nonfinite: tuple[str, ...] = ()
    # layouts whose version found no room in the staging directory (and no transport to fall
    # back to): their errors are StagingSpaceError messages
    out_of_space: tuple[str, ...] = ()

    @property
    def gbps(self) -> float:
        return sum(self.bytes.values()) / max(self.seconds, 1e-9) / 1e9


class Publisher(ControlRoutes, Preparing):
    """Publishes versioned weights to generators (see the module docstring).

    Args:
      config: :class:`PublisherConfig`.
      spec: a ``ModelSpec`` (or anything with ``.config`` and ``.merge(params)``); needed only
        by the ``disk`` transport, which writes HF checkpoints.
    """

    def __init__(self, config: PublisherConfig = PublisherConfig(), *, spec: Any = None):
        unknown = set(config.transports) - set(registry.names())
        if unknown or not config.transports:
            raise ValueError(f"transports must be a non-empty subset of {registry.names()}, "
                             f"got {config.transports}")
        for name in config.transports:
            registry.get(name).check_publisher(config, spec)
        self.config = config
        self.spec = spec
        self.algorithm = checksum.DEFAULT_ALGORITHM
        self.host_id = host_id()
        root = Path(config.staging_dir or default_staging_dir())
        root.mkdir(parents=True, exist_ok=True)
        remove_dead_owners_dirs(root, STAGING_PREFIX)
        self._staging_root = root / f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._host: dict[str, HostStaging] = {}
        self._device = DeviceStaging()
        self._layouts: dict[str, Registration] = {}
        self._current: PublishedVersion | None = None
        self._disk_holds: collections.Counter[int] = collections.Counter()  # versions being read
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._polling: collections.Counter[str] = collections.Counter()  # long polls per layout
        self._answered = threading.Condition(lock)  # a layout's long polls all ended
        self._publish_lock = threading.Lock()
        self._closed = False
        self.reports: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.history: collections.deque[PublishStats] = collections.deque(maxlen=256)
        # Test seams: {"corrupt": {"version": v, "tensor": name}} flips one bit of that tensor
        # after its checksum is taken; hooks["before_announce"](version) runs just before a
        # version is announced, hooks["after_announce"](version) right after (before the
        # publishing thread joins the copies of streamed layouts), hooks["after_ticket"](version)
        # after a pull ticket is issued.
        self.faults: dict[str, Any] = {}
        self.hooks: dict[str, Callable[[int], None]] = {}
        # what each enabled transport keeps on this publisher (``Transport.start``: e.g. the
        # jax transfer server)
        self.transport_state: dict[str, Any] = {
            name: registry.get(name).start(self) for name in config.transports}
        routes, limits = self._routes()
        self._server = ControlServer(config.host, config.port, routes,
                                     auth_token=publisher_token(config.auth_token),
                                     max_body_bytes=config.max_body_bytes, body_limits=limits)
        log.info("transfer publisher at %s (transports %s)", self.url, config.transports)

    # ---- public API -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def version(self) -> int | None:
        with self._cond:
            return None if self._current is None else self._current.version

    def layouts(self) -> dict[str, dict[str, Any]]:
        """Registered layouts: key → ``{"transports", "pullers", "idle_s"}``."""
        now = time.monotonic()
        with self._cond:
            return {k: {"transports": sorted(r.transports), "pullers": sorted(r.pullers),
                        "idle_s": now - r.last_seen} for k, r in self._layouts.items()}

    def wait_for_layouts(self, count: int, timeout: float = 60.0) -> bool:
        """Blocks until ``count`` layouts are registered (e.g. before the first publish)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._layouts) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def publish(self, params: Mapping[str, Any], version: int) -> PublishStats:
        """Prepares ``params`` (the trainer's nested dict, any sharding) as ``version`` for
        every active layout and announces it. Versions must increase. A layout that cannot be
        produced gets an error its pullers will see; the others are unaffected."""
        start = time.perf_counter()
        flat = flatten(params)
        version = int(version)
        with self._publish_lock:
            current = self.version
            if current is not None and version <= current:
                raise ValueError(f"version {version} is not newer than the published {current}")
            now = time.monotonic()
            with self._cond:
                active = {k: r for k, r in self._layouts.items()
                          if now - r.last_seen <= self.config.layout_ttl_s}
            nbytes: collections.Counter[str] = collections.Counter()
            prepared: dict[str, Prepared] = {}
            host_full = None
            disk_path = None
            if any(registry.get(t).staging == "disk" for t in self.config.transports):
                disk_path = self.disk_path(version)
                host_full = write_checkpoint(disk_path, self.spec, params, flat, version,
                                             self.algorithm)
                nbytes["disk"] += sum(v.nbytes for v in host_full.values())
                fault = self.faults.get("corrupt")
                if fault and int(fault.get("version", -1)) == version:
                    corrupt_hf_tensor(Path(disk_path), fault["tensor"], self.spec.config)
            self._drop_unregistered_staging()
            streams: dict[str, StagedVersion] = {}
            out_of_space = []
            for key, reg in active.items():
                try:
                    try:
                        if self._streamed(reg):
                            prepared[key], streams[key] = self._begin_stream(key, reg, flat,
                                                                             version, nbytes)
                        else:
                            prepared[key] = self._prepare(key, reg, flat, version, nbytes,
                                                          host_full)
                    except StagingSpaceError as e:
                        prepared[key] = self._prepare_unstaged(key, reg, flat, version, nbytes,
                                                               host_full, e)
                except StagingSpaceError as e:
                    log.warning("layout %s cannot be published: %s", key, e)
                    prepared[key] = Prepared(error=str(e))
                    out_of_space.append(key)
                except (LayoutError, TransferError) as e:
                    log.warning("layout %s cannot be published: %s", key, e)
                    prepared[key] = Prepared(error=str(e))
            hook = self.hooks.get("before_announce")
            if hook is not None:
                hook(version)
            with self._cond:
                previous = self._current
                self._current = PublishedVersion(version, prepared, disk_path)
                for key, prep in prepared.items():
                    if prep.staging is not None:
                        self._host[key].commit(prep.staging["slot"])
                self._cond.notify_all()
            if previous is not None:
                self._release(previous)
            if streams:
                self._let_pollers_through(streams)
            hook = self.hooks.get("after_announce")
            if hook is not None:
                hook(version)
            for key, staged in streams.items():
                self._finish_stream(key, staged, prepared[key])
        nonfinite = tuple(sorted({t.name for p in prepared.values() if p.manifest is not None
                                  for t in p.manifest.tensors if t.finite is False}))
        if nonfinite:
            log.error("version %d holds non-finite values (NaN or infinity) in %d tensor(s) "
                      "%s: generators will refuse it", version, len(nonfinite), nonfinite[:5])
        stats = PublishStats(version, time.perf_counter() - start, len(prepared), dict(nbytes),
                             {k: p.error for k, p in prepared.items() if p.error}, nonfinite,
                             tuple(out_of_space))
        self.history.append(stats)
        return stats

    def _let_pollers_through(self, keys: Iterable[str]) -> None:
        """Waits (briefly) until the pullers long-polling these layouts have their manifest.

        A streamed version is copied by the publishing thread too, which takes the GIL back
        after every piece it copies; a control-server thread woken by the announcement could
        then wait for the interpreter's switch interval (5 ms) before it answers, and the
        pullers would verify late. So the publishing thread steps aside until they are
        answered (the helper threads copy meanwhile)."""
        deadline = time.monotonic() + POLLERS_WAIT_S
        with self._cond:
            while any(self._polling[k] for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._answered.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.close()
        for staging in self._host.values():
            staging.close()
        shutil.rmtree(self._staging_root, ignore_errors=True)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


    def disk_path(self, version: int) -> str:
        """Where the ``disk`` transport writes ``version`` (an HF checkpoint directory)."""
        if self.config.disk_dir is None:
            raise ValueError("this publisher has no disk transport (PublisherConfig.disk_dir)")
        return str(Path(self.config.disk_dir) / f"v{version}")

    _disk_path = disk_path

    @contextlib.contextmanager
    def holding_disk(self, version: int):
        """The ``disk`` directory of ``version``, kept while the block runs (servers loading it
        may take longer than the trainer takes to publish two more versions)."""
        path = self.disk_path(version)
        with self._cond:
            self._disk_holds[version] += 1
        try:
            yield path
        finally:
            with self._cond:
                self._disk_holds[version] -= 1
                if not self._disk_holds[version]:
                    del self._disk_holds[version]
                current = self._current
            if current is not None and current.disk_path:
                self._drop_disk_before(current.disk_path, current.version - 1)

    def _drop_disk_before(self, path: str, version: int) -> None:
        with self._cond:
            held = frozenset(self._disk_holds)
        drop_older(path, version, keep=held)

    def _release(self, previous: PublishedVersion) -> None:
        """Drops a superseded version (tickets already issued keep their arrays until pulled or
        expired); keeps one older disk directory for loaders still reading it, and every one a
        loader holds (:meth:`holding_disk`)."""
        for prep in previous.prepared.values():
            prep.device_arrays = None
        if previous.disk_path:
            self._drop_disk_before(previous.disk_path, previous.version)
