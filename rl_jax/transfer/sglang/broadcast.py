"""SGLang's distributed weight-update protocol, both sides, over ``torch.distributed``.

SGLang servers (0.5.23) receive weights from a trainer that joins a collective group with them:

1. ``POST /destroy_weights_update_group {group_name}`` first, so that a trainer that restarts
   under the same group name is not refused ("The specified group name has already been
   created"); a 400 saying the group does not exist is the normal answer;
2. ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
   group_name, backend}`` to every server (server ``i`` takes ranks ``rank_offset ..
   rank_offset + tp_i - 1``, the trainer is rank 0) while the trainer joins the group itself.
   Both sides form it as SGLang's ``init_custom_process_group`` does (:func:`join_group`): a
   ``tcp://`` rendezvous store wrapped in ``PrefixStore(group_name)``, then torch's group helper
   under ``group_name`` (which prefixes again);
3. per version: ``/pause_generation`` (``in_place`` or ``retract``) when the version takes more
   than one bucket (SGLang loads each bucket as it arrives, so requests decoding between buckets
   would run on a mix of old and new tensors), ``/begin_weight_update``; per bucket
   ``/update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
   weight_version}`` while rank 0 broadcasts each tensor of the bucket in order; then
   ``/end_weight_update`` and ``/continue_generation``. Names, shapes and dtypes are Hugging
   Face's.

The HTTP answers are read while the tensors are broadcast: a server that refuses a bucket
(answering at once, without taking part in the broadcast) stops the update within
``POLL_S`` with its reason, instead of a broadcast time-out minutes later; the group is then
destroyed on both sides and joined again by the next update.

On GPU the backend is NCCL (JAX arrays reach torch through DLPack); on CPU it is gloo, which is
what this project's generator server uses (its receiving side,
:class:`~rl_jax.transfer.sglang.receiver.DistributedWeightReceiver`, behind the same endpoints). The
protocol carries no checksums: the receiver checks names, shapes and dtypes and
this project's server swaps a version in only once every tensor of it has arrived, but bit-level
integrity rests on TCP. torch is imported lazily; without it this module raises
:class:`~rl_jax.transfer.errors.TransportUnavailable`.

The trainer gathers each full tensor on its host (the protocol broadcasts whole HF tensors from
one rank); this is the simple path to real SGLang servers, not the fastest one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from rl_jax.transfer.errors import TransferError, TransportUnavailable
from rl_jax.transfer.layout import flatten

log = logging.getLogger(__name__)

DEFAULT_GROUP = "rl_jax_weights"
PAUSE_MODES = ("in_place", "retract", "none")
POLL_S = 0.02  # s between looks at the servers' answers while a bucket is broadcast


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise TransportUnavailable(
            "SGLang's distributed weight protocol needs torch (pip install torch; CPU builds "
            "support the gloo backend); use the shm/socket/jax_transfer/disk transports "
            "otherwise") from e
    if not dist.is_available():
        raise TransportUnavailable("this torch build has no torch.distributed")
    return torch, dist


@dataclasses.dataclass
class Group:
    """A joined weight-update group (torch's ``ProcessGroup`` registered under ``name``)."""

    process_group: Any
    name: str
    rank: int
    world_size: int

    def destroy(self) -> None:
        """Leaves the group and frees its name in this process (pending broadcasts are
        dropped)."""
        _, dist = _torch()
        if self.process_group is not None:
            try:
                dist.destroy_process_group(self.process_group)
            except (RuntimeError, ValueError) as e:
                log.warning("destroying weight-update group %s: %s", self.name, e)
            self.process_group = None


def _tcp_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"tcp://{host}:{int(port)}"


def join_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str = DEFAULT_GROUP, backend: str = "gloo",
               timeout_s: float = 300.0) -> Group:
    """Joins the group as SGLang's ``init_custom_process_group`` forms it (both ends must agree
    on every key of the rendezvous store): a ``tcp://master_address:master_port`` rendezvous
    (rank 0 hosts the store), ``PrefixStore(group_name, store)`` and torch's group helper with
    ``group_name``. The default process group is untouched (none is needed)."""
    torch, dist = _torch()
    from torch.distributed import distributed_c10d as c10d
    if backend not in ("gloo", "nccl"):
        raise TransportUnavailable(f"backend must be gloo or nccl, got {backend!r}")
    if not group_name:
        raise TransferError("the weight-update group needs a name")
    if group_name in c10d._world.pg_names.values():
        raise TransferError(f"this process already joined a group named {group_name!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(
        _tcp_url(master_address, master_port), int(rank), int(world_size), timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
        backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return Group(group, group_name, int(rank), int(world_size))


def _to_torch(array: np.ndarray):
    """A torch view of a host array (DLPack; bfloat16 through a uint16 view)."""
    torch, _ = _torch()
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_dlpack(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(np.ascontiguousarray(array))


def _torch_dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == ml_dtypes.bfloat16 else np.dtype(dtype).name


def hf_tensors(params: Mapping[str, Any], config: Any) -> dict[str, np.ndarray]:
    """The trainer's parameters as Hugging Face tensors on this host (gathers each one)."""
    from rl_jax.models.hf import hf_mappings
    maps = hf_mappings(config)
    out: dict[str, np.ndarray] = {}
    for name, value in sorted(flatten(params).items()):
        host = np.asarray(jax.device_get(value))
        m = maps[name]
        if "{i}" in m.hf_name:
            for i in range(host.shape[0]):
                out[m.hf_name.format(i=i)] = np.ascontiguousarray(m.to_hf(host[i]))
        else:
            out[m.hf_name] = np.ascontiguousarray(m.to_hf(host))
    return out


class ServerRefused(TransferError):
    """A server answered a weight-update call with an error (its reason in the message)."""

    def __init__(self, message: str, *, url: str, path: str, status: int | None):
        super().__init__(message)
        self.url, self.path, self.status = url, path, status


MAX_ANSWER_BYTES = 1 << 20  # the largest answer read from a server


def call_server(url: str, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 30.0, keys: Any = None) -> dict[str, Any]:
    """One request with ``keys.headers_for(path)`` (an ``rl_jax.generator.auth.Keys``, or None);
    the server's JSON object answer (read bounded), or :class:`ServerRefused` naming its reason
    (an error status or ``"success": false``; status None: not reachable)."""
    headers = {"Content-Type": "application/json",
               **(keys.headers_for(path) if keys is not None else {})}
    req = urllib.request.Request(url.rstrip("/") + path, method=method, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read(MAX_ANSWER_BYTES + 1)
    except OSError as e:
        raise ServerRefused(f"{url}{path} failed: {e}", url=url, path=path,
                            status=None) from None
    try:
        data = json.loads(raw or b"{}") if len(raw) <= MAX_ANSWER_BYTES else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        data = {"message": f"not a JSON object: {raw[:200]!r}"}
    if status != 200 or data.get("success") is False:
        raise ServerRefused(f"{url}{path} answered {status}: {_reason(data)}", url=url,
                            path=path, status=status)
    return data


def _post(url: str, path: str, body: dict[str, Any], timeout: float, keys: Any = None
          ) -> dict[str, Any]:
    return call_server(url, "POST", path, body, timeout, keys)


def _reason(data: dict[str, Any]) -> str:
    """The message of an answer: SGLang's ``message`` or an ``{"error": {"message"}}``."""
    error = data.get("error")
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])[:1000]
    return str(data.get("message", data))[:1000]


@dataclasses.dataclass(frozen=True)
class SendStats:
    version: int
    bytes: int
    buckets: int
    seconds: float
    paused: bool = False

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class SGLangWeightSender:
    """Trainer side: pushes weights to SGLang-protocol servers (real SGLang or this project's)
    through a collective group.

    Args:
      server_urls: the servers' base URLs.
      config: the model's ``ModelConfig`` (for Hugging Face names).
      master_address, master_port: where the group's store listens (on the trainer's host,
        reachable by the servers); port 0: a free port each time the group is formed. A group
        broken by a refusal may keep its store's port for a while: a fixed port is waited for
        (up to ``timeout_s``) before the group is formed again.
      server_world_sizes: ranks each server takes (an SGLang server's tensor-parallel size; 1
        for this project's servers whatever their mesh; default 1 each).
      pause_mode: how generation is paused around a version of several buckets (``in_place``
        keeps running requests and their KV cache, ``retract`` sends them back to the queue;
        ``none`` only where every server assembles a version before swapping, as this
        project's do).
      keys: the servers' keys (``rl_jax.generator.auth.Keys``; the admin key for these
        endpoints), or None.
    """

    def __init__(self, server_urls: Sequence[str], config: Any, *, master_address: str,
                 master_port: int = 0, group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                 server_world_sizes: Sequence[int] | None = None,
                 bucket_bytes: int = 512 << 20, timeout_s: float = 300.0,
                 pause_mode: str = "in_place", keys: Any = None):
        _torch()
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.urls = [u.rstrip("/") for u in server_urls]
        if not self.urls:
            raise ValueError("SGLangWeightSender needs at least one server url")
        self.config = config
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name, self.backend = group_name, backend
        self.sizes = list(server_world_sizes or [1] * len(self.urls))
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.pause_mode, self.keys = pause_mode, keys
        self.world_size = 1 + sum(self.sizes)
        self.group: Group | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.urls) + 1, "sglang-sender")

    def _all(self, path: str, body: dict[str, Any], *, ignore: str | None = None
             ) -> list[dict[str, Any]]:
        """``path`` on every server at once; raises the first refusal (other than one whose
        reason contains ``ignore``)."""
        futures = [self._pool.submit(_post, url, path, body, self.timeout_s, self.keys)
                   for url in self.urls]
        answers = []
        for f in futures:
            try:
                answers.append(f.result())
            except ServerRefused as e:
                if ignore is None or ignore not in str(e):
                    raise
                answers.append({})
        return answers

    def init_group(self) -> None:
        """Frees the group name on every server (a trainer restarting under the same name), then
        ``/init_weights_update_group`` on every server while joining as rank 0. A server that
        refuses stops the wait at once with its reason."""
        self._all("/destroy_weights_update_group", {"group_name": self.group_name},
                  ignore="does not exist")
        port = self._store_port()
        futures, offset = [], 1
        for url, size in zip(self.urls, self.sizes):
            futures.append(self._pool.submit(_post, url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port,
                "rank_offset": offset, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend}, self.timeout_s,
                self.keys))
            offset += size
        joining = self._pool.submit(join_group, self.master_address, port, 0,
                                    self.world_size, self.group_name, self.backend,
                                    self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:  # the rendezvous thread is left to time out; its group is never used
                raise failed[0].exception()
            if joining.done() and all(f.done() for f in futures):
                break
            if time.monotonic() > deadline:
                raise TransferError(f"the weight-update group did not form within "
                                    f"{self.timeout_s:.0f} s")
            time.sleep(POLL_S)
        self.group = joining.result()

    def _store_port(self) -> int:
        """The port of this formation's store: a free one, or the fixed one once it is free."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with socket.socket(socket.AF_INET6 if ":" in self.master_address
                               else socket.AF_INET) as probe:
                try:
                    probe.bind((self.master_address.strip("[]"), self.master_port))
                    return probe.getsockname()[1]
                except OSError as e:
                    if not self.master_port or time.monotonic() > deadline:
                        raise TransferError(f"the weight-update group's store cannot listen at "
                                            f"{self.master_address}:{self.master_port}: {e}") \
                            from None
            time.sleep(0.1)

    def send(self, params: Mapping[str, Any], version: int, *, flush_cache: bool = False
             ) -> SendStats:
        """Broadcasts every tensor, in buckets of about ``bucket_bytes``, as ``version`` (see the
        module docstring). ``flush_cache``: drop the servers' prefix cache after the last bucket
        (SGLang refuses it while requests run; in-flight updates keep the cache)."""
        if self.group is None:
            self.init_group()
        start = time.perf_counter()
        tensors = hf_tensors(params, self.config)
        buckets: list[list[str]] = [[]]
        size = 0
        for name, t in tensors.items():
            if buckets[-1] and size + t.nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += t.nbytes
        pause = len(buckets) > 1 and self.pause_mode != "none"
        if pause:
            self._all("/pause_generation", {"mode": self.pause_mode})
        try:
            self._all("/begin_weight_update", {})
            try:
                for k, names in enumerate(buckets):
                    self._bucket(tensors, names, version,
                                 flush_cache and k == len(buckets) - 1)
            finally:
                self._end_session()
        finally:
            if pause:
                self._all("/continue_generation", {})
        nbytes = sum(t.nbytes for t in tensors.values())
        return SendStats(int(version), nbytes, len(buckets), time.perf_counter() - start, pause)

    def _end_session(self) -> None:
        try:
            self._all("/end_weight_update", {})
        except ServerRefused as e:
            log.warning("closing the weight-update session: %s", e)

    def _bucket(self, tensors: Mapping[str, np.ndarray], names: list[str], version: int,
                flush_cache: bool) -> None:
        """One ``/update_weights_from_distributed`` call per server beside the broadcasts of
        its tensors; a refusal or a time-out breaks the group (destroyed on both sides)."""
        _, dist = _torch()
        body = {"names": names, "dtypes": [_torch_dtype_name(tensors[n].dtype) for n in names],
                "shapes": [list(tensors[n].shape) for n in names],
                "group_name": self.group_name, "flush_cache": flush_cache,
                "weight_version": str(version)}
        futures = [self._pool.submit(_post, url, "/update_weights_from_distributed", body,
                                     self.timeout_s, self.keys) for url in self.urls]
        works = [dist.broadcast(_to_torch(tensors[n]), src=0,
                                group=self.group.process_group, async_op=True) for n in names]
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                for f in futures:
                    if f.done() and f.exception() is not None:
                        raise f.exception()
                if all(f.done() for f in futures) and all(w.is_completed() for w in works):
                    break
                if time.monotonic() > deadline:
                    raise TransferError(f"weight version {version}: a bucket of {len(names)} "
                                        f"tensors was not taken within {self.timeout_s:.0f} s")
                time.sleep(POLL_S)
            for w in works:
                w.wait()
        except BaseException:
            self._break_group()
            raise

    def _break_group(self) -> None:
        """Destroys the group here and on the servers; the next update joins it again."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
        try:
            self._all("/destroy_weights_update_group", {"group_name": self.group_name},
                      ignore="does not exist")
        except TransferError as e:
            log.warning("destroying the weight-update group on the servers: %s", e)

    def close(self) -> None:
        """Destroys the group on the servers and here (the name can be joined again)."""
        if self.group is not None:
            self._break_group()
        self._pool.shutdown(wait=False)
