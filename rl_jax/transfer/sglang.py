"""SGLang's distributed weight-update protocol, both sides, over ``torch.distributed``.

SGLang servers receive weights from a trainer that joins a collective group with them:

1. the trainer POSTs ``/init_weights_update_group`` ``{master_address, master_port, rank_offset,
   world_size, group_name, backend}`` to every server (server ``i`` takes ranks
   ``rank_offset .. rank_offset + tp_i - 1``, the trainer is rank 0) and, concurrently, joins
   the group itself (a ``TCPStore`` at ``master_address:master_port`` whose keys are prefixed by
   ``group_name + "/"``, as ``torch.distributed``'s own group helper does);
2. per bucket of tensors, the trainer POSTs ``/update_weights_from_distributed`` ``{names,
   dtypes, shapes, group_name, flush_cache, weight_version}`` and, concurrently, broadcasts each
   tensor of the bucket from rank 0, in order. Names, shapes and dtypes are Hugging Face's.

On GPU the backend is NCCL (JAX arrays reach torch through DLPack); on CPU it is gloo, which is
what this project's generator server uses (:class:`DistributedWeightReceiver`). The protocol
carries no checksums: the receiver checks names, shapes and dtypes and assembles a version only
once every tensor of the model has arrived (never a half-updated model), but bit-level integrity
rests on TCP. torch is imported lazily; without it this module raises
:class:`~rl_jax.transfer.errors.TransportUnavailable`.

The trainer gathers each full tensor on its host (the protocol broadcasts whole HF tensors from
one rank); this is the path for real SGLang servers, not the fastest one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from rl_jax.transfer.errors import IntegrityError, TransferError, TransportUnavailable
from rl_jax.transfer.layout import flatten, unflatten

DEFAULT_GROUP = "rl_jax_weights"


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


def join_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str = DEFAULT_GROUP, backend: str = "gloo",
               timeout_s: float = 300.0) -> "Group":
    """A process group of its own (the default group is untouched), keyed like
    ``torch.distributed``'s group helper: a ``TCPStore`` (rank 0 hosts it) with prefix
    ``group_name + "/"``."""
    torch, dist = _torch()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), int(world_size),
                          is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    else:
        raise TransportUnavailable(f"backend must be gloo or nccl, got {backend!r}")
    return Group(group, store, rank, int(world_size))


@dataclasses.dataclass
class Group:
    """A joined group; holds the store so that rank 0's store server stays alive."""

    process_group: Any
    store: Any
    rank: int
    world_size: int


def _broadcast(group: Group, tensor: Any) -> None:
    _, dist = _torch()
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.process_group.broadcast([tensor], opts).wait()


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


def _post(url: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise TransferError(f"{url}{path} answered {e.code}: {e.read()[:500]!r}") from e
    except OSError as e:
        raise TransferError(f"{url}{path} failed: {e}") from e
    if isinstance(data, dict) and data.get("success") is False:
        raise TransferError(f"{url}{path} refused: {data.get('message')}")
    return data


@dataclasses.dataclass(frozen=True)
class SendStats:
    version: int
    bytes: int
    buckets: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class SGLangWeightSender:
    """Trainer side: pushes weights to SGLang(-protocol) servers through a collective group.

    Args:
      server_urls: the servers' base URLs.
      config: the model's ``ModelConfig`` (for Hugging Face names).
      master_address, master_port: where the group's store listens (on the trainer's host,
        reachable by the servers).
      server_world_sizes: ranks each server takes (its tensor-parallel size; default 1 each).
    """

    def __init__(self, server_urls: Sequence[str], config: Any, *, master_address: str,
                 master_port: int, group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                 server_world_sizes: Sequence[int] | None = None,
                 bucket_bytes: int = 512 << 20, timeout_s: float = 300.0):
        _torch()
        self.urls = list(server_urls)
        self.config = config
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name, self.backend = group_name, backend
        self.sizes = list(server_world_sizes or [1] * len(self.urls))
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.world_size = 1 + sum(self.sizes)
        self.group = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.urls)),
                                                           "sglang-sender")

    def init_group(self) -> None:
        """``/init_weights_update_group`` on every server while joining as rank 0."""
        futures, offset = [], 1
        for url, size in zip(self.urls, self.sizes):
            futures.append(self._pool.submit(_post, url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": offset, "world_size": self.world_size,
                "group_name": self.group_name, "backend": self.backend}, self.timeout_s))
            offset += size
        self.group = join_group(self.master_address, self.master_port, 0, self.world_size,
                                self.group_name, self.backend, self.timeout_s)
        for f in futures:
            f.result()

    def send(self, params: Mapping[str, Any], version: int, *, flush_cache: bool = True
             ) -> SendStats:
        """Broadcasts every tensor, in buckets of about ``bucket_bytes``, as ``version``."""
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
        for k, names in enumerate(buckets):
            body = {"names": names, "dtypes": [_torch_dtype_name(tensors[n].dtype) for n in names],
                    "shapes": [list(tensors[n].shape) for n in names],
                    "group_name": self.group_name,
                    "flush_cache": flush_cache and k == len(buckets) - 1,
                    "weight_version": str(version)}
            futures = [self._pool.submit(_post, url, "/update_weights_from_distributed", body,
                                         self.timeout_s) for url in self.urls]
            for n in names:
                _broadcast(self.group, _to_torch(tensors[n]))
            for f in futures:
                f.result()
        nbytes = sum(t.nbytes for t in tensors.values())
        return SendStats(int(version), nbytes, len(buckets), time.perf_counter() - start)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.group = None


class DistributedWeightReceiver:
    """Server side (what this project's generator server wires to the two endpoints).

    ``init_group`` and ``receive`` block (run them in a worker thread). ``receive`` returns a
    complete parameter dict (in ``target``'s shardings and dtypes) once every tensor of the
    model has arrived for one ``weight_version``, else None (more buckets to come).
    """

    def __init__(self, config: Any, target: Mapping[str, Any]):
        from rl_jax.models.hf import hf_mappings
        _torch()
        self.config = config
        self.maps = hf_mappings(config)
        self.target = flatten(target)
        self.expected: dict[str, tuple[int, ...]] = {}
        for m in self.maps.values():
            names = ([m.hf_name.format(i=i) for i in range(config.num_layers)]
                     if "{i}" in m.hf_name else [m.hf_name])
            for n in names:
                self.expected[n] = tuple(m.hf_shape)
        self.group = None
        self.group_name: str | None = None
        self._pending: dict[str, np.ndarray] = {}
        self._pending_version: str | None = None

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                   timeout_s: float = 300.0) -> None:
        self.group = join_group(master_address, master_port, int(rank_offset), int(world_size),
                                group_name, backend, timeout_s)
        self.group_name = group_name

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                group_name: str | None = None, weight_version: Any = None
                ) -> tuple[dict[str, Any], Any] | None:
        """Receives one bucket; returns ``(params, weight_version)`` when the model is complete.

        Raises :class:`IntegrityError` for unknown names or wrong shapes, *after* taking part in
        every broadcast of the bucket (so the group stays in step with the trainer)."""
        torch, _ = _torch()
        if self.group is None:
            raise TransferError("no weight update group: call /init_weights_update_group first")
        if group_name is not None and group_name != self.group_name:
            raise TransferError(f"unknown group {group_name!r} (joined {self.group_name!r})")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise IntegrityError("names, dtypes and shapes must have the same length")
        if weight_version != self._pending_version:
            self._pending, self._pending_version = {}, weight_version
        problems = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
            _broadcast(self.group, t)
            if name not in self.expected:
                problems.append(f"unknown tensor {name!r}")
            elif tuple(shape) != self.expected[name]:
                problems.append(f"{name}: shape {tuple(shape)} != model {self.expected[name]}")
            else:
                self._pending[name] = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                                       if t.dtype == torch.bfloat16 else t.numpy())
        if problems:
            self._pending = {}
            raise IntegrityError("weights refused: " + "; ".join(problems[:5]))
        if set(self._pending) != set(self.expected):
            return None
        params = self._assemble()
        self._pending, self._pending_version = {}, None
        return params, weight_version

    def _assemble(self) -> dict[str, Any]:
        out = {}
        for name, m in self.maps.items():
            target = self.target[name]
            if "{i}" in m.hf_name:
                full = np.stack([m.to_ours(self._pending[m.hf_name.format(i=i)])
                                 for i in range(self.config.num_layers)])
            else:
                full = m.to_ours(self._pending[m.hf_name])
            full = np.ascontiguousarray(full.astype(target.dtype, copy=False))
            out[name] = jax.make_array_from_callback(full.shape, target.sharding,
                                                     lambda idx, f=full: f[idx])
        return unflatten(out)
