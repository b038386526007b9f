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
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum, jax_transport
from rl_jax.transfer.config import HOST_TRANSPORTS, MAX_WAIT_S, TRANSPORTS, PublisherConfig, \
    default_staging_dir, publisher_token
from rl_jax.transfer.control import ControlServer, FileSlice, HTTPStatus, body_int, host_id, \
    query_int, query_seconds
from rl_jax.transfer.errors import LayoutError, StagingSpaceError, TransferError
from rl_jax.transfer.layout import Layout, flatten, index_slices
from rl_jax.transfer.manifest import PENDING, Manifest, ShardInfo, TensorInfo, \
    canonical_digests
from rl_jax.transfer.staging import DeviceStaging, HostStaging, StagedVersion, check_layout, \
    target_dtype

log = logging.getLogger(__name__)

_STAGING_PREFIX = "rl_jax-transfer-"
POLLERS_WAIT_S = 0.002  # longest a publish waits for long-polling pullers to get a manifest
MAX_PULLERS = 256  # puller ids remembered per layout (the oldest are forgotten)
MAX_ID_CHARS = 200  # of a puller id or a layout key
# What a pull report may hold: field -> accepted types (others are dropped)
REPORT_FIELDS = {"puller_id": str, "version": int, "transport": str, "ok": bool,
                 "seconds": (int, float), "bytes": int, "error": str, "layout_key": str}
MAX_REPORT_CHARS = 2000  # of one string in a report
MAX_REPORT_BYTES = 16 << 10  # of one report's body


@dataclasses.dataclass
class _Registration:
    layout: Layout
    transports: set[str]
    last_seen: float
    pullers: dict[str, None] = dataclasses.field(default_factory=dict)  # oldest first


@dataclasses.dataclass
class _Prepared:
    manifest: Manifest | None = None
    error: str | None = None
    device_arrays: list[jax.Array] | None = None  # manifest tensor order
    staging: dict[str, Any] | None = None


@dataclasses.dataclass
class _Version:
    version: int
    prepared: dict[str, _Prepared]
    disk_path: str | None = None


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

    @property
    def gbps(self) -> float:
        return sum(self.bytes.values()) / max(self.seconds, 1e-9) / 1e9


def _clean_stale_staging(root: Path) -> None:
    """Removes staging directories left by publishers that died (their pid is gone)."""
    for path in root.glob(f"{_STAGING_PREFIX}*"):
        m = re.fullmatch(rf"{_STAGING_PREFIX}(\d+)-[0-9a-f]+", path.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


def _corrupt_hf_tensor(path: Path, name: str, config: Any) -> None:
    """Flips one bit of the first HF tensor that holds parameter ``name`` (fault injection)."""
    import struct

    from rl_jax.models.hf import hf_mappings
    hf_name = hf_mappings(config)[name].hf_name.format(i=0)
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            if hf_name in header:
                pos = 8 + n + header[hf_name]["data_offsets"][0]
                f.seek(pos)
                byte = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([byte ^ 0x01]))
                return


class Publisher:
    """Publishes versioned weights to generators (see the module docstring).

    Args:
      config: :class:`PublisherConfig`.
      spec: a ``ModelSpec`` (or anything with ``.config`` and ``.merge(params)``); needed only
        by the ``disk`` transport, which writes HF checkpoints.
    """

    def __init__(self, config: PublisherConfig = PublisherConfig(), *, spec: Any = None):
        unknown = set(config.transports) - set(TRANSPORTS)
        if unknown or not config.transports:
            raise ValueError(f"transports must be a non-empty subset of {TRANSPORTS}, got "
                             f"{config.transports}")
        if "disk" in config.transports and (config.disk_dir is None or spec is None):
            raise ValueError("the disk transport needs PublisherConfig.disk_dir and spec=")
        self.config = config
        self.spec = spec
        self.algorithm = checksum.DEFAULT_ALGORITHM
        self.host_id = host_id()
        root = Path(config.staging_dir or default_staging_dir())
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale_staging(root)
        self._staging_root = root / f"{_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._host: dict[str, HostStaging] = {}
        self._device = DeviceStaging()
        self._layouts: dict[str, _Registration] = {}
        self._current: _Version | None = None
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
        self._transfer_server = None
        if "jax_transfer" in config.transports:
            self._transfer_server = jax_transport.start_server(config.host,
                                                               config.num_transport_addresses)
        self._server = ControlServer(config.host, config.port, {
            ("GET", "/v1/info"): self._route_info,
            ("POST", "/v1/register"): self._route_register,
            ("GET", "/v1/manifest"): self._route_manifest,
            ("POST", "/v1/ticket"): self._route_ticket,
            ("GET", "/v1/chunk"): self._route_chunk,
            ("POST", "/v1/report"): self._route_report,
        }, auth_token=publisher_token(config.auth_token), max_body_bytes=config.max_body_bytes,
            body_limits={"/v1/report": MAX_REPORT_BYTES, "/v1/ticket": MAX_REPORT_BYTES,
                         "/v1/info": 0, "/v1/manifest": 0, "/v1/chunk": 0})
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
            prepared: dict[str, _Prepared] = {}
            host_full = None
            disk_path = None
            if "disk" in self.config.transports:
                disk_path, host_full = self._write_disk(params, flat, version)
                nbytes["disk"] += sum(v.nbytes for v in host_full.values())
                fault = self.faults.get("corrupt")
                if fault and int(fault.get("version", -1)) == version:
                    _corrupt_hf_tensor(Path(disk_path), fault["tensor"], self.spec.config)
            self._drop_unregistered_staging()
            streams: dict[str, StagedVersion] = {}
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
                except (LayoutError, TransferError) as e:
                    log.warning("layout %s cannot be published: %s", key, e)
                    prepared[key] = _Prepared(error=str(e))
            hook = self.hooks.get("before_announce")
            if hook is not None:
                hook(version)
            with self._cond:
                previous, self._current = self._current, _Version(version, prepared, disk_path)
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
                             {k: p.error for k, p in prepared.items() if p.error}, nonfinite)
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

    # ---- preparing a version --------------------------------------------------------------------

    def _prepare(self, key: str, reg: _Registration, flat: Mapping[str, jax.Array], version: int,
                 nbytes: collections.Counter, host_full: Mapping[str, np.ndarray] | None
                 ) -> _Prepared:
        layout = reg.layout
        check_layout(layout, flat)
        wanted = reg.transports & set(self.config.transports)
        prep = _Prepared()
        infos: dict[str, TensorInfo] = {}
        transports: dict[str, Any] = {}
        if wanted & set(HOST_TRANSPORTS):
            if key not in self._host:
                self._host[key] = HostStaging(self._staging_root / key,
                                             self.config.max_host_slots)
            tensors, staging, _ = self._host[key].stage(
                version, flat, layout, self.config.chunk_bytes, self.algorithm,
                self.config.staging_threads, check_finite=self.config.check_finite)
            infos = {t.name: t for t in tensors}
            prep.staging = staging
            nbytes["host"] += sum(s.nbytes for t in tensors for s in t.shards)
            if "shm" in wanted:
                transports["shm"] = {"file": staging["file"], "stamp": staging["stamp"]}
            if "socket" in wanted:
                transports["socket"] = {}
            transports["staging"] = {"nbytes": staging["nbytes"], "chunks": staging["chunks"]}
        if "jax_transfer" in wanted:
            arrays, shard_infos = self._device.stage(flat, layout, self.algorithm)
            nbytes["device"] += sum(s.nbytes for v in shard_infos.values() for s in v)
            if not infos:
                infos = {n: TensorInfo(n, tuple(flat[n].shape), target_dtype(layout, n, flat[n]).name,
                                       checksum.combine([(s.index, s.checksum) for s in v],
                                                        self.algorithm), tuple(v))
                         for n, v in shard_infos.items()}
            prep.device_arrays = [arrays[n] for n in sorted(arrays)]
            transports["jax_transfer"] = {
                "address": self._transfer_server.address(),
                "num_transport_addresses": self.config.num_transport_addresses}
        if "disk" in wanted and host_full is not None:
            if not infos:
                infos = {n: self._host_infos(n, v, layout) for n, v in host_full.items()}
            transports["disk"] = {"path": self._disk_path(version)}
        if not infos:
            raise LayoutError(f"none of the transports {sorted(reg.transports)} this layout's "
                              f"pullers asked for is enabled ({list(self.config.transports)})")
        self._inject_corruption(key, version, prep, infos)
        prep.manifest = Manifest(version, key, self.algorithm, self.host_id,
                                 tuple(infos[n] for n in sorted(infos)), transports)
        return prep

    def _prepare_unstaged(self, key: str, reg: _Registration, flat: Mapping[str, jax.Array],
                          version: int, nbytes: collections.Counter,
                          host_full: Mapping[str, np.ndarray] | None,
                          error: StagingSpaceError) -> _Prepared:
        """The fallback when host staging has no room: the version is offered over the
        enabled transports that need no staging space (``disk``, whose checkpoint is written
        anyway, and ``jax_transfer`` when the layout's pullers asked for it); raises ``error``
        when there is none."""
        others = set(reg.transports) | ({"disk"} if host_full is not None else set())
        others = (others & set(self.config.transports)) - set(HOST_TRANSPORTS)
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

    def _streamed(self, reg: _Registration) -> bool:
        return (self.config.stream and self.algorithm == "xxh3_64_blocks"
                and reg.transports & set(self.config.transports) == {"shm"})

    def _begin_stream(self, key: str, reg: _Registration, flat: Mapping[str, jax.Array],
                      version: int, nbytes: collections.Counter
                      ) -> tuple[_Prepared, StagedVersion]:
        """Lays ``version`` out in a slot, starts copying it on the staging threads but the
        caller's, and returns the manifest to announce meanwhile: shard checksums pending, the
        slot's progress table named (see :meth:`HostStaging.begin`)."""
        layout = reg.layout  # checked against the tensors by begin (once per set of shapes)
        if key not in self._host:
            self._host[key] = HostStaging(self._staging_root / key, self.config.max_host_slots)
        staged = self._host[key].begin(version, flat, layout, self.config.chunk_bytes,
                                       stream=True, check_finite=self.config.check_finite)
        nbytes["host"] += sum(n for n, _ in staged.placed.values())
        tensors = tuple(TensorInfo(name, shape, dtype.name, PENDING, tuple(
            ShardInfo(index, PENDING, *staged.placed[name, k]) for k, index in
            enumerate(indices))) for name, shape, dtype, indices in staged.tensors)
        fault = self.faults.get("corrupt")
        if fault and int(fault.get("version", -1)) == version:
            staged.held.add((fault["tensor"], 0))  # announced once corrupted
        self._host[key].start(staged, self.algorithm, self.config.staging_threads)
        description = staged.description
        transports = {"shm": {"file": description["file"], "stamp": description["stamp"],
                              "progress": description["progress"], "pid": os.getpid()},
                      "staging": {"nbytes": description["nbytes"],
                                  "chunks": description["chunks"]}}
        prep = _Prepared(manifest=Manifest(version, key, self.algorithm, self.host_id, tensors,
                                           transports),
                         staging={"slot": staged.slot, **description})
        return prep, staged

    def _finish_stream(self, key: str, staged: StagedVersion, prep: _Prepared) -> None:
        """Copies and hashes a streamed version; its manifest then carries the checksums."""
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
        shm = {k: v for k, v in prep.manifest.transports["shm"].items()
               if k in ("file", "stamp")}
        manifest = dataclasses.replace(prep.manifest, tensors=tuple(infos),
                                       transports={**prep.manifest.transports, "shm": shm})
        with self._cond:
            prep.manifest = manifest
            self._cond.notify_all()

    def _host_infos(self, name: str, full: np.ndarray, layout: Layout) -> TensorInfo:
        dtype = target_dtype(layout, name, full)
        value = full.astype(dtype, copy=False)
        shards = []
        for index in layout.indices(name, full.shape):
            part = value[index_slices(index)]
            shards.append(ShardInfo(index, checksum.digest(part, self.algorithm), part.nbytes))
        return TensorInfo(name, tuple(full.shape), dtype.name,
                          checksum.combine([(s.index, s.checksum) for s in shards],
                                           self.algorithm), tuple(shards))

    def _inject_corruption(self, key: str, version: int, prep: _Prepared,
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

    def disk_path(self, version: int) -> str:
        """Where the ``disk`` transport writes ``version`` (an HF checkpoint directory)."""
        if self.config.disk_dir is None:
            raise ValueError("this publisher has no disk transport (PublisherConfig.disk_dir)")
        return str(Path(self.config.disk_dir) / f"v{version}")

    _disk_path = disk_path

    def _write_disk(self, params, flat, version: int) -> tuple[str, dict[str, np.ndarray]]:
        """Writes an HF checkpoint directory (atomically) and returns the gathered host arrays
        (the disk transport gathers the whole model on this host by nature)."""
        from rl_jax.models.hf import save_pretrained
        path = self._disk_path(version)
        save_pretrained(self.spec.merge(params), path)
        host_full = {n: np.asarray(jax.device_get(v)) for n, v in flat.items()}
        (Path(path) / "rl_jax_checksums.json").write_text(json.dumps(
            {"version": version, "algorithm": self.algorithm,
             "tensors": canonical_digests(host_full, self.algorithm)}, indent=1))
        return path, host_full

    def _release(self, previous: _Version) -> None:
        """Drops a superseded version (tickets already issued keep their arrays until pulled or
        expired); keeps one older disk directory for loaders still reading it."""
        for prep in previous.prepared.values():
            prep.device_arrays = None
        if previous.disk_path:
            for old in Path(previous.disk_path).parent.glob("v*"):
                m = re.fullmatch(r"v(\d+)", old.name)
                if m and int(m.group(1)) < previous.version:
                    shutil.rmtree(old, ignore_errors=True)

    # ---- control routes (run in the HTTP server's threads) ---------------------------------------

    def _route_info(self, query, body):
        with self._cond:
            return {"version": None if self._current is None else self._current.version,
                    "transports": list(self.config.transports), "host_id": self.host_id,
                    "pid": os.getpid(), "layouts": len(self._layouts),
                    "checksum": self.algorithm, "staging_dir": str(self._staging_root),
                    "disk_dir": self.config.disk_dir and str(Path(self.config.disk_dir))}

    def _route_register(self, query, body):
        try:
            layout = Layout.from_json(body["layout"])
        except (KeyError, TypeError, ValueError, AttributeError, LayoutError) as e:
            raise HTTPStatus(400, f"register needs a valid layout: {type(e).__name__}: "
                                  f"{str(e)[:300]}")
        transports = body.get("transports")
        if transports is not None and (not isinstance(transports, list) or not all(
                isinstance(t, str) for t in transports) or len(transports) > len(TRANSPORTS)):
            raise HTTPStatus(400, f"field 'transports' must be a list of at most "
                                  f"{len(TRANSPORTS)} names from {list(TRANSPORTS)}")
        puller_id = body.get("puller_id", "")
        if not isinstance(puller_id, str) or len(puller_id) > MAX_ID_CHARS:
            raise HTTPStatus(400, f"field 'puller_id' must be a string of at most "
                                  f"{MAX_ID_CHARS} characters")
        requested = set(transports or self.config.transports)
        usable = requested & set(self.config.transports)
        if not usable:
            raise HTTPStatus(409, f"none of the transports {sorted(requested)} is enabled on "
                                  f"this publisher (enabled: {list(self.config.transports)})")
        key = layout.key
        with self._cond:
            reg = self._layouts.get(key)
            if reg is None:
                self._make_room_for_layout()
                reg = self._layouts[key] = _Registration(layout, set(), time.monotonic())
            reg.transports |= usable
            reg.pullers.pop(puller_id, None)
            reg.pullers[puller_id] = None
            while len(reg.pullers) > MAX_PULLERS:
                reg.pullers.pop(next(iter(reg.pullers)))
            reg.last_seen = time.monotonic()
            self._cond.notify_all()
            return {"layout_key": key, "transports": sorted(reg.transports),
                    "version": None if self._current is None else self._current.version}

    def _make_room_for_layout(self) -> None:
        """Caller holds ``self._cond``. Makes room for one more layout under
        ``max_layouts`` by forgetting the idle ones (not seen for ``layout_ttl_s``, so not
        published to any more); 409 when every registered layout is in use."""
        limit = self.config.max_layouts
        if len(self._layouts) < limit:
            return
        now = time.monotonic()
        idle = sorted((r.last_seen, k) for k, r in self._layouts.items()
                      if now - r.last_seen > self.config.layout_ttl_s)
        for _, k in idle[:len(self._layouts) - limit + 1]:
            del self._layouts[k]
        if len(self._layouts) >= limit:
            raise HTTPStatus(409, f"this publisher already serves {len(self._layouts)} layouts "
                                  f"(PublisherConfig.max_layouts={limit}; each costs a copy of "
                                  "the model); pull in one of those layouts or raise the limit",
                             layouts=len(self._layouts))

    def _route_manifest(self, query, body):
        key = query.get("layout", "")
        after = query_int(query, "after", default=-1, minimum=-1)
        deadline = time.monotonic() + query_seconds(query, "wait", default=0.0,
                                                    maximum=MAX_WAIT_S)
        with self._cond:
            while True:
                reg = self._layouts.get(key)
                if reg is None:
                    raise HTTPStatus(404, f"unknown layout {key!r}; register it first")
                reg.last_seen = time.monotonic()
                cur = self._current
                if cur is not None and cur.version > after and key in cur.prepared:
                    prep = cur.prepared[key]
                    if prep.error:
                        raise HTTPStatus(409, prep.error, version=cur.version)
                    return prep.manifest.to_json()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._polling[key] += 1
                try:
                    self._cond.wait(min(remaining, 5.0))
                finally:
                    self._polling[key] -= 1
                    if not self._polling[key]:
                        self._answered.notify_all()

    def _prepared(self, key: str, version: int) -> _Prepared:
        """Caller holds ``self._cond``."""
        cur = self._current
        if cur is None or cur.version != version:
            raise HTTPStatus(410, f"version {version} is no longer offered",
                             latest=None if cur is None else cur.version)
        prep = cur.prepared.get(key)
        if prep is None or prep.manifest is None:
            raise HTTPStatus(409, f"layout {key!r} was not prepared for version {version}")
        return prep

    def _route_ticket(self, query, body):
        version = body_int(body, "version", minimum=0)
        key = body.get("layout_key")
        if not isinstance(key, str) or len(key) > MAX_ID_CHARS:
            raise HTTPStatus(400, "field 'layout_key' must be a layout key (a string)")
        with self._cond:
            prep = self._prepared(key, version)
            arrays = prep.device_arrays
        if arrays is None:
            raise HTTPStatus(409, "jax_transfer was not prepared for this layout (register it "
                                  "with that transport)")
        uuid = secrets.randbits(62)
        jax_transport.offer(self._transfer_server, uuid, arrays, self.config.ticket_ttl_s)
        hook = self.hooks.get("after_ticket")
        if hook is not None:
            hook(version)
        return {"uuid": uuid, "address": self._transfer_server.address(),
                "num_transport_addresses": self.config.num_transport_addresses}

    def _route_chunk(self, query, body):
        key = query.get("layout", "")
        version, offset, nbytes = (query_int(query, k) for k in ("version", "offset", "nbytes"))
        with self._cond:
            prep = self._prepared(key, version)
            if prep.staging is None:
                raise HTTPStatus(409, "host staging was not prepared for this layout")
            if {"offset": offset, "nbytes": nbytes} not in prep.staging["chunks"]:
                raise HTTPStatus(400, f"no chunk at offset {offset} of {nbytes} bytes")
            staging = self._host.get(key)
            if staging is None:  # the layout was dropped meanwhile
                raise HTTPStatus(410, f"version {version} is no longer offered")
            path = staging.slot_path(prep.staging["slot"])
        # A shared lock for the send: the slot is not rewritten under it.
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            raise HTTPStatus(410, f"version {version} is no longer offered")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise HTTPStatus(410, f"version {version} is no longer offered")
        if staging.stamp(prep.staging["slot"]) != version:
            os.close(fd)
            raise HTTPStatus(410, f"version {version} is no longer offered")
        return FileSlice(fd, offset, nbytes, owned=True)

    def _route_report(self, query, body):
        """Keeps the known fields of a pull report (strings cut short, others dropped); the
        body's size is bounded by the server, the number of reports kept by ``reports``."""
        report: dict[str, Any] = {"time": time.time()}
        for name, types in REPORT_FIELDS.items():
            value = body.get(name)
            if value is None or not isinstance(value, types) or (
                    isinstance(value, bool) and types is not bool):
                continue
            report[name] = value[:MAX_REPORT_CHARS] if isinstance(value, str) else value
        self.reports.append(report)
        return {"ok": True}
