"""The publisher's ``disk`` copy of a version: an HF checkpoint directory, written once per
version for every layout (``<disk_dir>/v<version>``), with the digests of its tensors beside it
in ``rl_jax_checksums.json``. Writing it gathers the whole model on the publishing host, which
then also gives the tensor infos of layouts staged nowhere else.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum
from rl_jax.transfer.layout import Layout, index_slices, target_dtype
from rl_jax.transfer.manifest import ShardInfo, TensorInfo, canonical_digests


def write_checkpoint(path: str, spec: Any, params: Any, flat: Mapping[str, jax.Array],
                     version: int, algorithm: str) -> dict[str, np.ndarray]:
    """Writes an HF checkpoint directory at ``path`` (atomically) and returns the gathered host
    arrays (the disk transport gathers the whole model on this host by nature)."""
    from rl_jax.models.hf import save_pretrained
    save_pretrained(spec.merge(params), path)
    host_full = {n: np.asarray(jax.device_get(v)) for n, v in flat.items()}
    (Path(path) / "rl_jax_checksums.json").write_text(json.dumps(
        {"version": version, "algorithm": algorithm,
         "tensors": canonical_digests(host_full, algorithm)}, indent=1))
    return host_full


def tensor_info(name: str, full: np.ndarray, layout: Layout, algorithm: str) -> TensorInfo:
    """The manifest's info of tensor ``name`` (the whole host array ``full``) cut into
    ``layout``'s shards, each hashed."""
    dtype = target_dtype(layout, name, full)
    value = full.astype(dtype, copy=False)
    shards = []
    for index in layout.indices(name, full.shape):
        part = value[index_slices(index)]
        shards.append(ShardInfo(index, checksum.digest(part, algorithm), part.nbytes))
    return TensorInfo(name, tuple(full.shape), dtype.name,
                      checksum.combine([(s.index, s.checksum) for s in shards], algorithm),
                      tuple(shards))


def drop_older(path: str, version: int, keep: frozenset[int] = frozenset()) -> None:
    """Removes the checkpoint directories beside ``path`` older than ``version``, but for the
    versions in ``keep``."""
    for old in Path(path).parent.glob("v*"):
        m = re.fullmatch(r"v(\d+)", old.name)
        if m and int(m.group(1)) < version and int(m.group(1)) not in keep:
            shutil.rmtree(old, ignore_errors=True)


def corrupt_hf_tensor(path: Path, name: str, config: Any) -> None:
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
