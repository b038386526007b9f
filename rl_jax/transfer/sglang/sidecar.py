r"""A sidecar on an SGLang generator host: pulls verified versions from the trainer's
:class:`~rl_jax.transfer.publisher.core.Publisher` over the registry's transports
(:mod:`rl_jax.transfer.transports`) and hands each to the local SGLang server through SGLang's
own local path, so real SGLang gets the sharded, checksummed transfer this project's servers get.

    python -m rl_jax.transfer.sglang.sidecar --publisher_url=http://tr0:29500 \
        --server_url=http://127.0.0.1:30000 --port=30001 [--host=127.0.0.1 \
        --handoff=disk|tensor --transport=auto --shm_dir=/dev/shm --model=DIR \
        --api_key_file=F --admin_api_key_file=F --no_pull_on_start]

(``--model``: the server's checkpoint, default its ``/server_info`` ``model_path``; the key
files: the server's keys, the admin key, else the API key, also guarding the front). It pulls
the newest published version at start, then prints ``rl_jax sglang sidecar ready at URL``.

Pulls are :class:`~rl_jax.transfer.puller.generator.GeneratorPuller`'s, as in this project's
server: digests, finiteness (checked here where the transport leaves it to the receiver) and
versions are verified before anything reaches SGLang; a version that fails is refused and the
server keeps its weights. The hand-off (``handoff``) writes the version's HF tensors, each copied
once from the pulled layout into its place, into one of two images, never the one the server
took last:

- ``disk``: ``model.safetensors`` in one of two directories under ``shm_dir`` (tmpfs; config and
  tokenizer files copied once), then ``POST /update_weights_from_disk``;
- ``tensor``: one of two torch shared-memory buffers (``file_system`` sharing, so that SGLang
  opens them by name), then ``/update_weights_from_tensor`` with the ``MultiprocessingSerializer``
  payload of its ``(HF name, tensor view)`` list, one per TP rank, between
  ``/begin_weight_update`` and ``/end_weight_update`` (needs torch here).

SGLang's update waits for its running requests (its model-update lock); the version shows in its
``/model_info``. The HTTP front answers ``POST /update_weights_from_transfer {weight_version,
wait_s, transport, publisher_url}`` as this project's server does
(:mod:`rl_jax.generator.server.weight_endpoints`), and ``GET /health`` (the server's); an admin key
guards the update. The server's answers are read bounded and checked. One unit of about 500
lines: the sidecar, its two hand-offs, its front and command line.

Long module: the pull, the two hand-offs and the HTTP front share one update's state (the
alternating images, the version the server runs); the front and command line could move out.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import hmac
import io
import json
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from rl_jax.transfer import finite
from rl_jax.transfer.config import PullerConfig, default_staging_dir, remove_dead_owners_dirs
from rl_jax.transfer.errors import NonFiniteWeights, TransferError, TransportUnavailable
from rl_jax.transfer.layout import flatten
from rl_jax.transfer.puller.core import PullMetrics
from rl_jax.transfer.puller.generator import GeneratorPuller, pinned_publisher
from rl_jax.transfer.sglang.broadcast import ServerRefused, call_server

log = logging.getLogger(__name__)

HANDOFFS = ("disk", "tensor")
IMAGES_PREFIX = "rl_jax-sglang-sidecar-"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model")
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclasses.dataclass(frozen=True, repr=False)
class ServerKeys:
    """The server's keys, sent as ``rl_jax.generator.auth.Keys`` sends them (which may be given
    instead): the admin key (else the API key) to its weight endpoints, the API key elsewhere."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def headers_for(self, path: str) -> dict[str, str]:
        admin = path.startswith(("/update_weights", "/begin_weight", "/end_weight"))
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclasses.dataclass
class _Served:
    """What :meth:`GeneratorPuller.pull_latest` reads of an engine: the server's version and the
    target layout (``ShapeDtypeStruct``s on this host's CPU)."""

    version: int
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SidecarUpdate:
    """A version handed over: the pull's metrics, then seconds writing the HF image
    (``fill_seconds``) and in all (``handoff_seconds``: the check, the image, the server)."""

    version: int
    metrics: PullMetrics
    handoff_seconds: float
    fill_seconds: float


class HFImage:
    """Where each HF tensor of a version lies in one byte image, packed without holes as
    safetensors requires (one dtype: every offset is a multiple of its size):
    ``entries[hf_name] = (our name, layer or None, offset, nbytes, hf_shape)``."""

    def __init__(self, config: Any, dtype: np.dtype):
        from rl_jax.models.hf import hf_mappings
        self.maps, self.dtype, self.entries, offset = hf_mappings(config), dtype, {}, 0
        for name, m in sorted(self.maps.items()):
            layers = range(config.num_layers) if "{i}" in m.hf_name else [None]
            for i in layers:
                nbytes = int(np.prod(m.hf_shape)) * dtype.itemsize
                hf_name = m.hf_name if i is None else m.hf_name.format(i=i)
                self.entries[hf_name] = (name, i, offset, nbytes, m.hf_shape)
                offset += nbytes
        self.nbytes = offset
        self.header = self._header()

    def _header(self) -> bytes:
        """The safetensors header (length prefix included) of a file holding the image."""
        meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        for hf_name, (_, _, offset, nbytes, shape) in self.entries.items():
            meta[hf_name] = {"dtype": ST_DTYPES[self.dtype.name], "shape": list(shape),
                             "data_offsets": [offset, offset + nbytes]}
        raw = json.dumps(meta, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    def fill(self, params: Mapping[str, Any], image: np.ndarray, pool: Any) -> None:
        """Copies ``params`` (our nested dict, this image's dtype) into ``image`` (uint8) on the
        threads of ``pool``, each tensor written through a view of its HF place in our layout
        where the mapping allows (as unsigned integers of the same size: plain copies)."""
        flat = {n: np.asarray(v) for n, v in flatten(params).items()}
        bits = np.dtype(f"u{self.dtype.itemsize}")

        def copy(entry):
            name, i, offset, nbytes, shape = entry
            src = (flat[name] if i is None else flat[name][i]).view(bits)
            dst = image[offset:offset + nbytes].view(bits).reshape(shape)
            ours = self.maps[name].to_ours(dst)
            if ours.shape == src.shape and np.may_share_memory(ours, dst):
                np.copyto(ours, src)
            else:
                np.copyto(dst, self.maps[name].to_hf(src))

        for _ in pool.map(copy, self.entries.values()):
            pass


class SGLangSidecar:
    """Pulls versions from ``publisher_url`` for the SGLang server at ``server_url`` (same host).

    Args:
      keys: the server's keys (:class:`ServerKeys` or ``rl_jax.generator.auth.Keys``).
      handoff: ``"disk"`` or ``"tensor"`` (module docstring).
      shm_dir: where the hand-off directories go (default: ``/dev/shm`` when writable).
      transport: the puller's transport (``"auto"`` or a registry name).
      model_path: the checkpoint the server was started from (default: its ``/server_info``).
      dtype: the dtype pulled and handed over (default: the server's, else the checkpoint's).
    """

    def __init__(self, publisher_url: str, server_url: str, *, keys: Any = None,
                 handoff: str = "disk", shm_dir: str | None = None, transport: str = "auto",
                 model_path: str | None = None, dtype: str | None = None,
                 timeout_s: float = 600.0, puller_config: PullerConfig | None = None):
        from rl_jax.models.hf import read_config
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {HANDOFFS}, got {handoff!r}")
        self.publisher_url, self.server_url = publisher_url, server_url.rstrip("/")
        self.keys, self.handoff, self.timeout_s = keys, handoff, timeout_s
        info = self._call("GET", "/server_info")
        model_path = model_path or info.get("model_path")
        if not isinstance(model_path, str) or not os.path.isdir(model_path):
            raise TransferError(f"the server's checkpoint {str(model_path)[:200]!r} is not a "
                                "directory here; give the sidecar model_path")
        self.model_path, self.config = model_path, read_config(model_path)
        dtype = dtype or info.get("dtype")  # else (SGLang's "auto") the checkpoint's
        dtype = dtype if dtype in ST_DTYPES else json.loads(
            (Path(model_path) / "config.json").read_text()).get("torch_dtype", "float32")
        if dtype not in ST_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(ST_DTYPES)}, got {dtype!r}")
        self.dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        tp = info.get("tp_size", 1)
        self.tp_size = tp if isinstance(tp, int) and 1 <= tp <= 1024 else 1
        self.target = _target(self.config, self.dtype)
        self.image = HFImage(self.config, self.dtype)
        config = puller_config or PullerConfig(transport=transport)
        self.puller = GeneratorPuller(publisher_url, config=config)
        root = Path(shm_dir or default_staging_dir())
        remove_dead_owners_dirs(root, IMAGES_PREFIX)  # images of sidecars that were killed
        self.root = root / f"{IMAGES_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.slots = [self.root / "slot0", self.root / "slot1"]
        self._buffers: list[tuple[Any, np.ndarray, list]] = []  # tensor: (buffer, view, names)
        self._files: dict[Path, tuple[Any, mmap.mmap]] = {}  # disk: slot -> its mapped file
        self._next, self._lock = 0, threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1))
        if handoff == "disk":
            for slot in self.slots:
                slot.mkdir(parents=True)
                for name in COPIED_FILES:
                    if (Path(model_path) / name).is_file():
                        shutil.copyfile(Path(model_path) / name, slot / name)
        else:
            self._buffers = [self._shared_buffer() for _ in range(2)]

    # ---- the SGLang server -----------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout: float = 30.0) -> dict[str, Any]:
        """One request to the server (:func:`rl_jax.transfer.sglang.broadcast.call_server`)."""
        return call_server(self.server_url, method, path, body, timeout, self.keys)

    def server_state(self) -> tuple[int, str | None]:
        """``(weight version, model path)`` the server reports; the version is -1 where it is
        not an integer (SGLang's ``"default"``)."""
        info = self._call("GET", "/model_info")
        raw, path = info.get("weight_version"), info.get("model_path")
        text = str(raw)[:32] if isinstance(raw, (str, int)) and not isinstance(raw, bool) else ""
        version = int(text) if text.lstrip("-").isdigit() else -1
        return version, path if isinstance(path, str) else None

    # ---- updates ---------------------------------------------------------------------------------

    def update(self, min_version: int | None = None, wait_s: float = 0.0,
               transport: str | None = None) -> SidecarUpdate | None:
        """Pulls the newest version newer than the server's (and at least ``min_version``),
        waiting up to ``wait_s``, and hands it to the server. None when nothing newer was
        published; raises ``TransferError`` (a refused pull: the server is untouched) or
        :class:`ServerRefused` (the server refused or could not be reached)."""
        with self._lock:
            current, served_path = self.server_state()
            update = self.puller.pull_latest(_Served(current, self.target), wait_s=wait_s,
                                             min_version=min_version, transport=transport)
            if update is None:
                return None
            start = time.perf_counter()
            bad = [] if update.finite_checked else [n for n, v in flatten(update.params).items()
                                                    if not finite.all_finite(np.asarray(v))]
            if bad:
                raise NonFiniteWeights(f"pulled weights (version {update.version}) refused: "
                                       f"{bad[:5]} hold non-finite values (NaN or infinity)")
            if self.handoff == "disk":
                filled = self._to_disk(update.params, update.version, served_path)
            else:
                filled = self._to_tensor(update.params, update.version)
            return SidecarUpdate(update.version, update.metrics, time.perf_counter() - start,
                                 filled - start)

    def _to_disk(self, params: Mapping[str, Any], version: int, served_path: str | None
                 ) -> float:
        slot = self.slots[1] if served_path == str(self.slots[0]) else self.slots[0]
        header = self.image.header
        if slot not in self._files:  # mapped once: later versions write warm pages
            f = open(slot / "model.safetensors", "w+b", buffering=0)
            f.truncate(len(header) + self.image.nbytes)
            f.write(header)
            self._files[slot] = (f, mmap.mmap(f.fileno(), len(header) + self.image.nbytes))
        view = np.frombuffer(self._files[slot][1], np.uint8, self.image.nbytes, len(header))
        self.image.fill(params, view, self._pool)
        del view
        filled = time.perf_counter()
        try:
            self._call("POST", "/update_weights_from_disk", {
                "model_path": str(slot), "weight_version": str(version), "flush_cache": False,
                "abort_all_requests": False}, timeout=self.timeout_s)
        except BaseException:  # the server may still read it: the next version gets a new file
            self._drop_file(slot)
            raise
        return filled

    def _drop_file(self, slot: Path) -> None:
        f, mapped = self._files.pop(slot)
        mapped.close()
        f.close()
        (slot / "model.safetensors").unlink(missing_ok=True)

    def _shared_buffer(self) -> tuple[Any, np.ndarray, list]:
        """A torch shared-memory buffer of one image, its uint8 NumPy view, and its
        ``(HF name, tensor view)`` list."""
        try:
            import torch
            import torch.multiprocessing as torch_mp
        except ImportError as e:
            raise TransportUnavailable("the tensor hand-off needs torch") from e
        torch_mp.set_sharing_strategy("file_system")  # handles SGLang can open by name
        buf = torch.empty(self.image.nbytes, dtype=torch.uint8).share_memory_()
        dtype = getattr(torch, self.dtype.name)
        named = [(hf_name, buf[offset:offset + nbytes].view(dtype).view(shape))
                 for hf_name, (_, _, offset, nbytes, shape) in self.image.entries.items()]
        return buf, buf.numpy(), named

    def _to_tensor(self, params: Mapping[str, Any], version: int) -> float:
        from multiprocessing.reduction import ForkingPickler
        k, self._next = self._next, 1 - self._next
        _, view, named = self._buffers[k]
        self.image.fill(params, view, self._pool)
        # Pickled afresh for each rank and version: every pickled view takes a reference on the
        # shared file that one unpickling gives back (a payload read twice would unlink it).
        payloads = []
        for _ in range(self.tp_size):
            pickled = io.BytesIO()
            ForkingPickler(pickled).dump(named)
            payloads.append(base64.b64encode(pickled.getvalue()).decode())
        filled = time.perf_counter()
        self._call("POST", "/begin_weight_update", {})
        try:
            self._call("POST", "/update_weights_from_tensor", {
                "serialized_named_tensors": payloads,
                "weight_version": str(version), "flush_cache": False,
                "abort_all_requests": False}, timeout=self.timeout_s)
        except BaseException:  # the server may still read it: a new buffer takes its place
            self._buffers[k] = self._shared_buffer()
            raise
        finally:
            try:
                self._call("POST", "/end_weight_update", {})
            except ServerRefused as e:
                log.warning("closing SGLang's weight-update session: %s", e)
        return filled

    def close(self) -> None:
        """Removes the hand-off directories and drops the shared buffers (torch unlinks each
        file once no process maps it, or its shm manager when the server exits)."""
        for slot in list(self._files):
            self._drop_file(slot)
        shutil.rmtree(self.root, ignore_errors=True)
        self._buffers = []
        self._pool.shutdown()


def _target(config: Any, dtype: np.dtype) -> dict[str, Any]:
    """The layout pulled: every parameter whole on this host's first CPU device."""
    from flax import nnx

    from rl_jax.models.build import abstract_model
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=device), shapes)


# ---- the HTTP front --------------------------------------------------------------------------

MAX_BODY_BYTES = 64 << 10


def _error(text: str, kind: str, status: int, **extra) -> Any:
    from aiohttp import web
    body = {**extra, "error": {"message": text, "type": kind, "code": status}}
    return web.json_response(body, status=status)


def _request_fields(body: Any) -> tuple[Any, float, str | None, Any]:
    """``(weight_version, wait_s, transport, publisher_url)`` of an update request; raises
    ``ValueError`` naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    version, wait_s, transport = (body.get(k) for k in ("weight_version", "wait_s", "transport"))
    if version is not None and (isinstance(version, bool) or not str(version).isdigit()
                                or len(str(version)) > 18):
        raise ValueError(f"weight_version must be a non-negative integer, got {version!r:.60}")
    wait_s = 0.0 if wait_s is None else wait_s
    if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) \
            or not 0 <= wait_s <= 3600:
        raise ValueError(f"wait_s must be a number of seconds in [0, 3600], got {wait_s!r:.60}")
    if transport is not None and not isinstance(transport, str):
        raise ValueError(f"transport must be a string, got {transport!r:.60}")
    return (None if version is None else int(version)), float(wait_s), transport, \
        body.get("publisher_url")


def make_app(sidecar: SGLangSidecar, admin_key: str | None = None) -> Any:
    """The front (module docstring); with ``admin_key``, the update needs
    ``Authorization: Bearer <admin_key>``."""
    from aiohttp import web
    lock = asyncio.Lock()

    @web.middleware
    async def guard(request, handler):
        presented = request.headers.get("Authorization", "").partition(" ")[2].strip()
        if admin_key and request.path != "/health" and not hmac.compare_digest(
                presented.encode("utf-8", "surrogateescape"), admin_key.encode()):
            return _error(f"{request.path} needs the admin API key", "forbidden", 403)
        return await handler(request)

    async def update(request):
        raw = await request.read()
        try:  # JSON errors are ValueErrors too; nesting past the stack a RecursionError
            wanted, wait_s, transport, publisher = _request_fields(
                json.loads(raw) if raw.strip() else {})
        except (ValueError, RecursionError) as e:
            return _error(str(e)[:300], "invalid_request_error", 400)
        try:
            pinned_publisher(publisher, sidecar.publisher_url)
        except (ValueError, TransferError) as e:  # PublisherNotAllowed, a malformed url
            return _error(str(e), "forbidden", 403)
        async with lock:
            current = -1
            try:
                current, _ = await asyncio.to_thread(sidecar.server_state)
                if wanted is not None and current >= wanted:
                    return web.json_response({"success": True, "weight_version": current,
                                              "message": f"already at version {current}"})
                done = await asyncio.to_thread(sidecar.update, wanted, wait_s, transport)
            except ServerRefused as e:
                status, kind = (503, "unavailable") if e.status is None else (400, "refused")
                return _error(str(e), kind, status, success=False, message=str(e),
                              weight_version=current)
            except TransferError as e:
                return _error(str(e), "transfer_error", 400, success=False, message=str(e),
                              weight_version=current)
        if done is None:
            return web.json_response({"success": True, "weight_version": current,
                                      "message": "no newer version was published"})
        return web.json_response({"success": True, "weight_version": done.version,
                                  "swap_ms": 1000 * done.handoff_seconds,
                                  "transfer": done.metrics.to_json(),
                                  "message": f"pulled weight version {done.version}"})

    async def health(request):
        try:
            await asyncio.to_thread(sidecar._call, "GET", "/health", None, 5.0)
        except ServerRefused as e:
            return _error(str(e), "unavailable", 503)
        return web.Response(text="")

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[guard])
    app.router.add_post("/update_weights_from_transfer", update)
    app.router.add_get("/health", health)
    return app


async def start_front(sidecar: SGLangSidecar, host: str, port: int,
                      admin_key: str | None = None) -> tuple[Any, int]:
    """Starts the front; ``(its aiohttp runner, the bound port)``."""
    from aiohttp import web
    runner = web.AppRunner(make_app(sidecar, admin_key))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m rl_jax.transfer.sglang.sidecar",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--publisher_url", required=True, help="the trainer's weight publisher")
    parser.add_argument("--server_url", required=True, help="the local SGLang server")
    for flag in ("--shm_dir", "--model", "--api_key_file", "--admin_api_key_file"):
        parser.add_argument(flag, help="module docstring")
    parser.add_argument("--host", default="127.0.0.1", help="address the front binds")
    parser.add_argument("--port", type=int, default=30001, help="the front's port (0: any)")
    parser.add_argument("--handoff", choices=HANDOFFS, default="disk")
    parser.add_argument("--transport", default="auto", help="auto or a transport's name")
    parser.add_argument("--no_pull_on_start", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        keys = ServerKeys(*(Path(f).read_text().strip() if f else None
                            for f in (args.api_key_file, args.admin_api_key_file)))
        sidecar = SGLangSidecar(args.publisher_url, args.server_url, keys=keys,
                                handoff=args.handoff, shm_dir=args.shm_dir,
                                transport=args.transport, model_path=args.model)
    except (ValueError, TransferError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    async def serve():
        runner, port = await start_front(sidecar, args.host, args.port,
                                         keys.admin_api_key or keys.api_key)
        print(f"rl_jax sglang sidecar ready at http://{args.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        if not args.no_pull_on_start:
            try:
                sidecar.update()
            except TransferError as e:  # ServerRefused too
                log.warning("no initial weights from %s: %s", args.publisher_url, e)
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        sidecar.close()


if __name__ == "__main__":
    main()
