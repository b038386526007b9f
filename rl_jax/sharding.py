"""Logical-axis → mesh-axis rules, shared by the trainer and the generator.

Every parameter and every constrained activation names its dimensions with *logical* axes
(``"embed"``, ``"mlp"``, ``"act_batch"``, ...). One :class:`ShardingRules` object decides which
mesh axes (``data``, ``fsdp``, ``tensor``) each logical axis is split over. The rules refuse, at
construction, any mapping where two logical axes that occur together in one array would claim the
same mesh axis, and :meth:`ShardingRules.sharding` refuses a mesh that does not divide a dimension.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rl_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# Every tuple of logical axes that appears on one array in this code base. A rules object is
# checked against all of them, so a collision is reported when the rules are built, not deep
# inside a jit trace.
KNOWN_AXIS_GROUPS: tuple[tuple[str, ...], ...] = (
    ("vocab", "embed"),
    ("embed", "vocab"),
    ("layers", "norm"),
    ("layers", "embed"),
    ("layers", "embed", "q_heads", "head_dim"),
    ("layers", "embed", "kv_heads", "head_dim"),
    ("layers", "q_heads", "head_dim", "embed"),
    ("layers", "q_heads", "head_dim"),
    ("layers", "kv_heads", "head_dim"),
    ("layers", "head_dim"),
    ("layers", "embed", "mlp"),
    ("layers", "mlp", "embed"),
    # low-rank adapters (rl_jax.models.lora): A [L, in..., r], B [L, r, out...]
    ("layers", "embed", "lora_rank"),
    ("layers", "q_heads", "head_dim", "lora_rank"),
    ("layers", "mlp", "lora_rank"),
    ("layers", "lora_rank", "q_heads", "head_dim"),
    ("layers", "lora_rank", "kv_heads", "head_dim"),
    ("layers", "lora_rank", "embed"),
    ("layers", "lora_rank", "mlp"),
    ("norm",),
    ("act_batch", "act_seq"),
    ("act_batch", "act_seq", "act_embed"),
    ("act_batch", "act_seq", "act_heads", "head_dim"),
    ("act_batch", "act_seq", "act_kv_heads", "head_dim"),
    ("act_batch", "act_seq", "act_mlp"),
    ("act_batch", "act_seq", "act_vocab"),
)


class ShardingError(UserError, ValueError):
    """A sharding rule or a mesh that cannot shard an array."""


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps logical axis names to mesh axes.

    ``rules`` maps a logical axis to ``None`` (replicated), one mesh axis, or a tuple of mesh axes
    (split over their product). Logical axes missing from ``rules`` are replicated.
    """

    rules: Mapping[str, MeshAxes]

    def __post_init__(self):
        object.__setattr__(self, "rules", dict(self.rules))
        for logical, mesh_axes in self.rules.items():
            for axis in _as_tuple(mesh_axes):
                if axis not in MESH_AXES:
                    raise ShardingError(
                        f"logical axis {logical!r} is mapped to unknown mesh axis {axis!r}; "
                        f"mesh axes are {MESH_AXES}")
        for group in KNOWN_AXIS_GROUPS:
            self.spec(group)

    @classmethod
    def default(cls) -> "ShardingRules":
        """FSDP over ``fsdp``, tensor parallelism over ``tensor``, batch over ``data``+``fsdp``."""
        return cls(DEFAULT_RULES)

    @classmethod
    def replicated(cls) -> "ShardingRules":
        """Everything replicated except the batch (pure data parallelism)."""
        return cls({"act_batch": ("data", "fsdp")})

    def replace(self, **overrides: MeshAxes) -> "ShardingRules":
        return ShardingRules({**self.rules, **overrides})

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        return () if logical is None else _as_tuple(self.rules.get(logical))

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for an array whose dimensions carry ``logical_axes``.

        Raises ShardingError if two of its logical axes claim the same mesh axis.
        """
        claimed: dict[str, str] = {}
        parts: list[Any] = []
        for logical in logical_axes:
            mesh_axes = self.mesh_axes(logical)
            for axis in mesh_axes:
                if axis in claimed:
                    raise ShardingError(
                        f"logical axes {claimed[axis]!r} and {logical!r} both claim mesh axis "
                        f"{axis!r} in an array with axes {tuple(logical_axes)}; a mesh axis can "
                        "split only one dimension of an array")
                claimed[axis] = logical
            parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return PartitionSpec(*parts)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[str | None],
                 shape: Sequence[int] | None = None, name: str = "array") -> NamedSharding:
        """NamedSharding on ``mesh``; with ``shape``, checks that the mesh divides every dimension."""
        spec = self.spec(logical_axes)
        if shape is not None:
            if len(shape) != len(logical_axes):
                raise ShardingError(
                    f"{name}: shape {tuple(shape)} has {len(shape)} dimensions but logical axes "
                    f"{tuple(logical_axes)} name {len(logical_axes)}")
            for dim, logical, part in zip(shape, logical_axes, spec):
                axes = _as_tuple(part)
                size = int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape])) if axes else 1
                if dim % size:
                    raise ShardingError(
                        f"{name}: dimension {logical!r} of size {dim} is not divisible by mesh "
                        f"axes {axes} of total size {size} (mesh {dict(mesh.shape)}); change the "
                        "mesh or map that logical axis elsewhere")
        return NamedSharding(mesh, _drop_missing_axes(spec, mesh))

    def constrain(self, x: jax.Array, mesh: Mesh | None, logical_axes: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` by logical axes; a no-op without a mesh."""
        if mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(mesh, logical_axes))


def _drop_missing_axes(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Removes mesh axes the mesh doesn't have (e.g. rules mention ``tensor``, mesh has none)."""
    parts = []
    for part in spec:
        axes = tuple(a for a in _as_tuple(part) if a in mesh.shape)
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*parts)


DEFAULT_RULES: dict[str, MeshAxes] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,
    "lora_rank": None,  # an adapter's rank: small, never split
    # activations
    "act_batch": ("data", "fsdp"),
    "act_seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with automatic (GSPMD) axis types.

    One of the sizes may be -1: it takes all remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ShardingError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        if known <= 0 or len(devices) % known:
            raise ShardingError(
                f"cannot fill mesh {dict(zip(MESH_AXES, sizes))} from {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if any(s <= 0 for s in sizes):
        raise ShardingError(f"mesh axis sizes must be positive, got {dict(zip(MESH_AXES, sizes))}")
    total = int(np.prod(sizes))
    if total != len(devices):
        raise ShardingError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {total} devices but {len(devices)} are "
            "available")
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
