"""Layouts: how a generator wants its parameters sharded, as a JSON-able description.

A generator describes its layout by its mesh (axis names and sizes, in the order of its device
array) and one ``PartitionSpec`` per tensor. The publisher rebuilds the same layout over its own
devices (for ``jax.experimental.transfer``, whose puller must ask for exactly the layout the
publisher offers) or only uses it to cut the tensors into the generator's shards (host
transports). Shards are identified by their index (``((start, stop), ...)`` per dimension), which
is the same on both sides whatever the devices are. :func:`check_layout` and
:func:`target_dtype` say whether, and in which dtypes, a layout can be made of the published
tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rl_jax.transfer.chunks import numpy_dtype
from rl_jax.transfer.errors import LayoutError

Index = tuple[tuple[int, int], ...]  # (start, stop) per dimension
SpecEntry = str | tuple[str, ...] | None
SINGLE_AXIS = "_single"  # the mesh axis of a one-device layout


# ---- nested dict <-> dotted names -----------------------------------------------------------

def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"layers": {"wq": x}}`` → ``{"layers.wq": x}`` (the trainer's parameter naming)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# ---- indices ----------------------------------------------------------------------------------

def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """A tuple of slices (as in ``devices_indices_map``) → ``((start, stop), ...)``."""
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise LayoutError(f"strided shard index {index} is not supported")
        out.append((start, stop))
    return tuple(out)


def index_shape(index: Index) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in index)


def index_slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in index)


def shard_indices(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> list[Index]:
    """The distinct shard indices of ``sharding`` for ``shape``, sorted."""
    return sorted({normalize_index(i, shape)
                   for i in sharding.devices_indices_map(tuple(shape)).values()})


def device_index_map(sharding: jax.sharding.Sharding, shape: Sequence[int]
                     ) -> dict[jax.Device, Index]:
    return {d: normalize_index(i, shape)
            for d, i in sharding.devices_indices_map(tuple(shape)).items()}


# ---- layouts ------------------------------------------------------------------------------------

def _spec_to_json(spec: PartitionSpec) -> list[Any]:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def _spec_from_json(entries: Sequence[Any]) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh shape plus one ``PartitionSpec`` per tensor (dotted names)."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    specs: Mapping[str, PartitionSpec]
    dtypes: Mapping[str, str] | None = None  # numpy dtype names; None keeps the publisher's

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.axis_sizes))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> "Layout":
        """The layout (shardings and dtypes) of a nested dict of arrays or
        ``ShapeDtypeStruct``s, e.g. an engine's live parameters."""
        flat = flatten(arrays)
        base = cls.from_shardings({n: a.sharding for n, a in flat.items()})
        return dataclasses.replace(base, dtypes={n: np.dtype(a.dtype).name
                                                 for n, a in flat.items()})

    @classmethod
    def from_shardings(cls, shardings: Mapping[str, Any]) -> "Layout":
        """The layout of a (nested) dict of shardings, e.g. ``jax.tree.map(lambda a:
        a.sharding, engine.params)``. All tensors must share one mesh (or one device)."""
        flat = flatten(shardings)
        if not flat:
            raise LayoutError("a layout needs at least one tensor")
        meshes, specs = set(), {}
        for name, sharding in flat.items():
            if isinstance(sharding, NamedSharding):
                mesh = sharding.mesh
                meshes.add((tuple(mesh.axis_names), tuple(mesh.devices.shape),
                            tuple(d.id for d in mesh.devices.flat)))
                specs[name] = sharding.spec
            elif isinstance(sharding, SingleDeviceSharding) or (
                    isinstance(sharding, jax.sharding.Sharding)
                    and len(sharding.device_set) == 1):
                device = next(iter(sharding.device_set))
                meshes.add(((SINGLE_AXIS,), (1,), (device.id,)))
                specs[name] = PartitionSpec()
            else:
                raise LayoutError(f"{name}: sharding {sharding!r} is not supported (use "
                                  "NamedSharding or a single device)")
        if len(meshes) != 1:
            raise LayoutError(f"all tensors of a layout must live on one mesh, got "
                              f"{len(meshes)} different ones")
        names, sizes, _ = meshes.pop()
        return cls(tuple(names), tuple(int(s) for s in sizes), specs)

    def to_json(self) -> dict[str, Any]:
        out = {"axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes),
               "specs": {n: _spec_to_json(s) for n, s in sorted(self.specs.items())}}
        if self.dtypes is not None:
            out["dtypes"] = dict(sorted(self.dtypes.items()))
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Layout":
        try:
            names = tuple(str(a) for a in data["axis_names"])
            sizes = tuple(int(s) for s in data["axis_sizes"])
            specs = {str(n): _spec_from_json(s) for n, s in data["specs"].items()}
            dtypes = data.get("dtypes")
            dtypes = None if dtypes is None else {str(n): str(d) for n, d in dtypes.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LayoutError(f"malformed layout description: {e}") from e
        if len(names) != len(sizes) or any(s <= 0 for s in sizes):
            raise LayoutError(f"bad mesh in layout: axes {names}, sizes {sizes}")
        for n, spec in specs.items():
            for part in spec:
                for axis in (part if isinstance(part, tuple) else (part,)):
                    if axis is not None and axis not in names:
                        raise LayoutError(f"{n}: spec {spec} names mesh axis {axis!r}, not in "
                                          f"{names}")
        return cls(names, sizes, specs, dtypes)

    @functools.cached_property
    def key(self) -> str:
        """A short stable identifier of this layout (a hash of its JSON; computed once)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def mesh_on(self, devices: Sequence[jax.Device]) -> Mesh:
        """This layout's mesh over the first ``num_devices`` of ``devices``."""
        if len(devices) < self.num_devices:
            raise LayoutError(f"layout needs {self.num_devices} devices, {len(devices)} given")
        arr = np.array(list(devices)[: self.num_devices], dtype=object).reshape(self.axis_sizes)
        return Mesh(arr, self.axis_names)

    def shardings_on(self, devices: Sequence[jax.Device]) -> dict[str, NamedSharding]:
        mesh = self.mesh_on(devices)
        return {n: NamedSharding(mesh, s) for n, s in self.specs.items()}

    def replicated_mesh_on(self, devices: Sequence[jax.Device], axis: str = "_replica") -> Mesh:
        """All of ``devices`` as ``(replicas, *mesh)``: replica group 0 is this layout's mesh
        over the first devices; a jit over all devices can write the layout into it."""
        n = len(devices)
        if n % self.num_devices:
            raise LayoutError(f"a layout over {self.num_devices} devices cannot be laid over "
                              f"{n} publisher devices (not a multiple)")
        arr = np.array(list(devices), dtype=object).reshape(
            (n // self.num_devices, *self.axis_sizes))
        return Mesh(arr, (axis, *self.axis_names))

    def indices(self, name: str, shape: Sequence[int]) -> list[Index]:
        """Distinct shard indices of tensor ``name`` (computed without devices)."""
        spec = self.specs[name]
        sizes = dict(zip(self.axis_names, self.axis_sizes))
        parts = list(spec) + [None] * (len(shape) - len(spec))
        if len(parts) > len(shape):
            raise LayoutError(f"{name}: spec {spec} has more entries than shape {tuple(shape)}")
        per_dim = []
        for dim, part in zip(shape, parts):
            axes = () if part is None else (part if isinstance(part, tuple) else (part,))
            splits = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if dim % splits:
                raise LayoutError(f"{name}: dimension of size {dim} does not split into "
                                  f"{splits} shards (spec {spec}, mesh {sizes})")
            step = dim // splits
            per_dim.append([(k * step, (k + 1) * step) for k in range(splits)])
        out: list[Index] = [()]
        for options in per_dim:
            out = [prefix + (o,) for prefix in out for o in options]
        return sorted(out)


def flat_signature(flat: Mapping[str, Any]) -> tuple:
    """Names, shapes and dtypes of the published tensors: what a layout's plan depends on."""
    return tuple((name, tuple(flat[name].shape), str(flat[name].dtype)) for name in sorted(flat))


_CHECKED: dict[tuple, None] = {}  # (layout key, flat signature) pairs already checked


def check_layout(layout: Layout, flat: Mapping[str, Any], signature: tuple | None = None
                 ) -> None:
    """Raises :class:`LayoutError` unless ``layout`` names exactly the published tensors and
    cuts each into whole shards (checked once per layout and set of tensor shapes)."""
    key = (layout.key, signature if signature is not None else flat_signature(flat))
    if key in _CHECKED:
        return
    _check_layout(layout, flat)
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[key] = None


def _check_layout(layout: Layout, flat: Mapping[str, Any]) -> None:
    missing = sorted(set(flat) - set(layout.specs))
    extra = sorted(set(layout.specs) - set(flat))
    if missing or extra:
        raise LayoutError(f"layout does not match the published tensors: missing {missing[:5]}, "
                          f"unknown {extra[:5]}")
    for name, value in flat.items():
        layout.indices(name, value.shape)
        if layout.dtypes is not None:
            numpy_dtype(layout.dtypes.get(name, np.dtype(value.dtype).name))


def target_dtype(layout: Layout, name: str, value: Any) -> np.dtype:
    """The dtype ``layout`` asks for tensor ``name`` (``value``'s own when it names none)."""
    if layout.dtypes is not None and name in layout.dtypes:
        return numpy_dtype(layout.dtypes[name])
    return np.dtype(value.dtype)

