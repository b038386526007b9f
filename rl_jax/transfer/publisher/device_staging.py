"""The publisher's ``device`` copy of a version (for ``jax_transfer``): generator-layout arrays on
the trainer's own devices.

Each tensor is resharded in a jit over all the trainer's devices, laid out as ``(replicas,
*generator mesh)``, then the shards of replica group 0 are taken as an array on the
generator-shaped sub-mesh: exactly the layout the puller asks for. Tensors go one at a time, so
the transient replication costs one tensor, not the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from rl_jax.transfer import checksum
from rl_jax.transfer.errors import LayoutError
from rl_jax.transfer.layout import Layout, index_shape, normalize_index, target_dtype
from rl_jax.transfer.manifest import ShardInfo


class DeviceStaging:
    """Generator-layout copies of the parameters on the trainer's own devices."""

    def __init__(self):
        self._fns: dict[Any, Any] = {}

    @staticmethod
    def param_devices(flat: Mapping[str, jax.Array]) -> list[jax.Device]:
        """The devices all parameters live on, in mesh order."""
        first = next(iter(flat.values())).sharding
        if isinstance(first, NamedSharding):
            devices = list(first.mesh.devices.flat)
        else:
            devices = sorted(first.device_set, key=lambda d: d.id)
        for name, value in flat.items():
            if value.sharding.device_set != set(devices):
                raise LayoutError(f"{name} lives on other devices than the first parameter; the "
                                  "jax_transfer publisher needs one device set")
        return devices

    def stage(self, flat: Mapping[str, jax.Array], layout: Layout, algorithm: str
              ) -> tuple[dict[str, jax.Array], dict[str, list[ShardInfo]]]:
        """Returns ``({name: array in layout on the first devices}, {name: shard infos})``."""
        devices = self.param_devices(flat)
        rep_mesh = layout.replicated_mesh_on(devices)
        group = list(rep_mesh.devices[0].flat)
        target_mesh = layout.mesh_on(group)
        out, infos = {}, {}
        for name in sorted(flat):
            value = flat[name]
            dtype = target_dtype(layout, name, value)
            spec = layout.specs[name]
            key = (rep_mesh, spec, np.dtype(dtype).name)
            if key not in self._fns:
                self._fns[key] = jax.jit(lambda x, _d=dtype: jnp.copy(x.astype(_d)),
                                         out_shardings=NamedSharding(rep_mesh, spec))
            resharded = self._fns[key](value)
            by_device = {s.device: s.data for s in resharded.addressable_shards}
            target = NamedSharding(target_mesh, spec)
            array = jax.make_array_from_single_device_arrays(
                value.shape, target, [by_device[d] for d in target_mesh.devices.flat])
            del resharded, by_device
            out[name] = array
            digests = {}
            for shard in array.addressable_shards:
                index = normalize_index(shard.index, array.shape)
                if index not in digests:
                    digests[index] = checksum.digest(np.asarray(shard.data), algorithm)
            itemsize = np.dtype(dtype).itemsize
            infos[name] = [ShardInfo(i, d, int(np.prod(index_shape(i), dtype=np.int64)) * itemsize)
                           for i, d in sorted(digests.items())]
        return out, infos
