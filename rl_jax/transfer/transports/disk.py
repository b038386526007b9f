"""The ``disk`` transport: an HF safetensors checkpoint directory per version.

The publisher writes the whole model once per version (``<disk_dir>/v<version>``, with
``rl_jax_checksums.json`` beside it; :mod:`rl_jax.transfer.publisher.disk_staging`), whatever the
layouts;
pullers on any host sharing that filesystem read the tensors they need from it, cut them into
their own shards, check every value finite and every shard's digest. It is the fallback when
host staging has no room, and what SGLang's ``/update_weights_from_disk`` loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.transfer.chunks import numpy_dtype
from rl_jax.transfer.errors import IntegrityError, VersionGone
from rl_jax.transfer.manifest import Manifest
from rl_jax.transfer.pulling import contained
from rl_jax.transfer.transports.base import Fetched, Transport


class DiskTransport(Transport):
    """HF checkpoint directories (see the module docstring)."""

    name = "disk"
    staging = "disk"

    @classmethod
    def check_publisher(cls, config: Any, spec: Any) -> None:
        if config.disk_dir is None or spec is None:
            raise ValueError("the disk transport needs PublisherConfig.disk_dir and spec=")

    @classmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        return {"path": staged["path"]}

    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        """Reads the checkpoint (``deadline``: the puller abandons this call's thread past
        it)."""
        from rl_jax.models.hf import CheckpointError, _TensorReader, hf_mappings, read_config
        path = contained(manifest.transports["disk"].get("path"),
                         self.puller.directories.get("disk"),
                         f"checkpoint of version {manifest.version}")
        try:
            cfg = read_config(path)
            reader = _TensorReader(Path(path))
        except (CheckpointError, OSError) as e:
            raise VersionGone(f"checkpoint {path} of version {manifest.version} is not "
                              f"readable: {e}") from e
        maps = hf_mappings(cfg)
        arrays, nbytes = {}, 0
        for tensor in manifest.tensors:
            m = maps.get(tensor.name)
            if m is None:
                raise IntegrityError(f"{tensor.name}: no HF name for this tensor")
            dtype = numpy_dtype(tensor.dtype)
            try:
                if "{i}" in m.hf_name:
                    full = np.stack([m.to_ours(reader.get(m.hf_name.format(i=i)))
                                     for i in range(tensor.shape[0])])
                else:
                    full = m.to_ours(reader.get(m.hf_name))
            except (CheckpointError, KeyError) as e:
                raise IntegrityError(f"{tensor.name}: {e}") from e
            full = np.ascontiguousarray(full.astype(dtype, copy=False))
            nbytes += full.nbytes
            if full.shape != tensor.shape:
                raise IntegrityError(f"{tensor.name}: checkpoint shape {full.shape} != "
                                     f"manifest {tensor.shape}")
            self.puller.require_finite(manifest, dataclasses.replace(tensor, finite=None), [full])
            views = {shard.index: full[tuple(slice(a, b) for a, b in shard.index)]
                     for shard in tensor.shards}
            arrays[tensor.name] = self.puller.place(tensor.name, tensor.shape, views)
        return Fetched(arrays, nbytes)

