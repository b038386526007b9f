"""The receiving side of SGLang's distributed weight-update protocol
(:mod:`rl_jax.transfer.sglang.broadcast`
has the protocol and the sending side), as this project's generator server runs it behind SGLang's
endpoints (:mod:`rl_jax.generator.server.distributed_endpoints`): groups joined as SGLang joins
them,
buckets checked before they are received, a version assembled whole in the engine's layout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from rl_jax.transfer.errors import IntegrityError, TransferError
from rl_jax.transfer.layout import flatten, unflatten
from rl_jax.transfer.sglang.broadcast import DEFAULT_GROUP, Group, _torch, join_group


class DistributedWeightReceiver:
    """Server side, behind this project's generator server's distributed endpoints.

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
        self.groups: dict[str, Group] = {}
        self._pending: dict[str, np.ndarray] = {}
        self._pending_version: str | None = None

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                   timeout_s: float = 300.0) -> None:
        if group_name in self.groups:
            raise TransferError("The specified group name has already been created, please "
                                "use a different group name or destroy it first")
        self.groups[group_name] = join_group(master_address, master_port, int(rank_offset),
                                             int(world_size), group_name, backend, timeout_s)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise TransferError("The group to be destroyed does not exist.")
        group.destroy()
        self._pending, self._pending_version = {}, None

    def check_group(self, group_name: str) -> Group:
        """The joined group ``group_name``; :class:`TransferError` (before any broadcast is
        taken, so the sender stops at once) when there is none."""
        group = self.groups.get(group_name)
        if group is None:
            raise TransferError(f"Group {group_name} not in {sorted(self.groups)}. Please call "
                                "`init_weights_update_group` first.")
        return group

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                group_name: str = DEFAULT_GROUP, weight_version: Any = None
                ) -> tuple[dict[str, Any], Any] | None:
        """Receives one bucket; returns ``(params, weight_version)`` when the model is complete.

        Names, shapes and dtypes are checked before anything is received: a bucket with an
        unknown tensor, a wrong shape or a dtype that is not a floating one raises
        :class:`IntegrityError` at once, without taking part in its broadcasts (the sender,
        reading the answer, stops and breaks the group)."""
        torch, dist = _torch()
        group = self.check_group(group_name)
        if not (isinstance(names, list) and isinstance(dtypes, list)
                and isinstance(shapes, list) and len(names) == len(dtypes) == len(shapes)):
            raise IntegrityError("names, dtypes and shapes must be lists of the same length")
        problems = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or name not in self.expected:
                problems.append(f"unknown tensor {name!r:.80}")
            elif not isinstance(shape, list) or tuple(shape) != self.expected[name]:
                problems.append(f"{name}: shape {shape!r:.60} != model {self.expected[name]}")
            elif dtype not in ("float32", "bfloat16", "float16"):
                problems.append(f"{name}: dtype {dtype!r:.40} is not float32, bfloat16 or "
                                "float16")
        if problems:
            raise IntegrityError("weights refused: " + "; ".join(problems[:5]))
        if weight_version != self._pending_version:
            self._pending, self._pending_version = {}, weight_version
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=group.process_group)
            self._pending[name] = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                                   if t.dtype == torch.bfloat16 else t.numpy())
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
