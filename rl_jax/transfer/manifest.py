"""Versioned manifests: what one version of the weights is, in one layout, and where to get it.

A manifest is plain JSON (it travels over the control channel)::

    {"version": 12, "layout_key": "…", "checksum": "xxh3_64", "host_id": "…",
     "tensors": [{"name": "layers.wq", "shape": [2, 32, 4, 8], "dtype": "float32",
                  "checksum": "<combined>",
                  "shards": [{"index": [[0, 2], [0, 32], [0, 2], [0, 8]],
                              "checksum": "<digest>", "nbytes": 2048, "offset": 4160}, …]}, …],
     "transports": {"shm": {…}, "socket": {…}, "jax_transfer": {…}, "disk": {…}}}

``offset`` is where the shard's bytes start in the staging file (host transports only).
:func:`verify` is what every puller runs on the arrays it is about to hand to the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from rl_jax.transfer import checksum
from rl_jax.transfer.chunks import numpy_dtype
from rl_jax.transfer.errors import IntegrityError
from rl_jax.transfer.layout import Index, normalize_index


PENDING = "pending"  # the checksum of a streamed version's shard: in its progress table


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    index: Index
    checksum: str
    nbytes: int
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"index": [list(p) for p in self.index], "checksum": self.checksum,
               "nbytes": self.nbytes}
        if self.offset is not None:
            out["offset"] = self.offset
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShardInfo":
        return cls(tuple((int(a), int(b)) for a, b in d["index"]), str(d["checksum"]),
                   int(d["nbytes"]), None if d.get("offset") is None else int(d["offset"]))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy name: "float32", "bfloat16", ...
    checksum: str
    shards: tuple[ShardInfo, ...]
    # whether every value is finite, as the publisher found while staging the bytes the
    # checksums cover; None where it did not stage them (or a streamed version's, whose
    # findings are in its progress table)
    finite: bool | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "checksum": self.checksum, "shards": [s.to_json() for s in self.shards]}
        if self.finite is not None:
            out["finite"] = self.finite
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorInfo":
        finite = d.get("finite")
        if finite is not None and not isinstance(finite, bool):
            raise TypeError(f"tensor {str(d.get('name'))[:80]!r}: finite must be true or "
                            f"false, got {str(finite)[:40]!r}")
        return cls(str(d["name"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]),
                   str(d["checksum"]), tuple(ShardInfo.from_json(s) for s in d["shards"]),
                   finite)


@dataclasses.dataclass(frozen=True)
class Manifest:
    version: int
    layout_key: str
    algorithm: str
    host_id: str
    tensors: tuple[TensorInfo, ...]
    transports: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        """Bytes of the model (each tensor once)."""
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "layout_key": self.layout_key,
                "checksum": self.algorithm, "host_id": self.host_id,
                "tensors": [t.to_json() for t in self.tensors],
                "transports": dict(self.transports)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Manifest":
        try:
            manifest = cls(int(d["version"]), str(d["layout_key"]), str(d["checksum"]),
                           str(d.get("host_id", "")),
                           tuple(TensorInfo.from_json(t) for t in d["tensors"]),
                           dict(d.get("transports", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise IntegrityError(f"malformed manifest: {type(e).__name__}: "
                                 f"{str(e)[:200]}") from e
        if manifest.algorithm not in checksum.ALGORITHMS:
            raise IntegrityError(f"manifest of version {manifest.version} names checksum "
                                 f"{manifest.algorithm[:40]!r}; known: {checksum.ALGORITHMS}")
        return manifest


def shard_digests(array: jax.Array, algorithm: str) -> dict[Index, str]:
    """Digest of each distinct addressable shard of ``array`` (replicas hashed once)."""
    out: dict[Index, str] = {}
    for shard in array.addressable_shards:
        index = normalize_index(shard.index, array.shape)
        if index not in out:
            out[index] = checksum.digest(np.asarray(shard.data), algorithm)
    return out


def verify(manifest: Manifest, arrays: Mapping[str, Any], *, what: str = "pulled weights",
           digests: Mapping[str, Mapping[Index, str]] | None = None,
           checksums: bool = True) -> None:
    """Checks ``arrays`` (flat, dotted names) against ``manifest``: same tensor names, shapes,
    dtypes, shard indices and shard digests. Raises :class:`IntegrityError` naming every problem
    (up to a few); returns nothing when all match.

    ``digests`` (``{name: {index: digest}}``) are digests the caller already took of the very
    bytes the arrays alias (hashed while copying them); the arrays' shard indices are still
    checked, their bytes are not hashed again. ``checksums=False`` checks everything but the
    digests (a streamed pull checks its arrays before their bytes are all written, and each
    block's digest as it arrives)."""
    problems: list[str] = []
    expected = {t.name: t for t in manifest.tensors}
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing:
        problems.append(f"missing tensor(s) {missing[:5]}")
    if extra:
        problems.append(f"unexpected tensor(s) {extra[:5]}")
    for name in sorted(set(expected) & set(arrays)):
        info, array = expected[name], arrays[name]
        if tuple(array.shape) != info.shape:
            problems.append(f"{name}: shape {tuple(array.shape)} != manifest {info.shape}")
            continue
        if np.dtype(array.dtype) != numpy_dtype(info.dtype):
            problems.append(f"{name}: dtype {np.dtype(array.dtype).name} != manifest "
                            f"{info.dtype}")
            continue
        if not checksums:
            got = dict.fromkeys(normalize_index(sh.index, array.shape)
                                for sh in array.addressable_shards)
        elif digests is not None and name in digests:
            indices = {normalize_index(sh.index, array.shape) for sh in array.addressable_shards}
            got = {i: d for i, d in digests[name].items() if i in indices}
            if set(got) != indices:
                problems.append(f"{name}: shards at {sorted(indices - set(got))} were not "
                                "received")
                continue
        else:
            got = shard_digests(array, manifest.algorithm)
        want = {s.index: s.checksum for s in info.shards}
        if set(got) != set(want):
            problems.append(f"{name}: shard indices {sorted(got)} != manifest {sorted(want)}")
            continue
        bad = [i for i in sorted(want) if got[i] != want[i]] if checksums else []
        if bad:
            problems.append(f"{name}: checksum mismatch in {len(bad)} shard(s), first at index "
                            f"{[list(p) for p in bad[0]]} (got {got[bad[0]]}, manifest "
                            f"{want[bad[0]]})")
        if len(problems) >= 8:
            break
    if problems:
        raise IntegrityError(f"{what} (version {manifest.version}) refused: "
                             + "; ".join(problems))


def canonical_digests(flat: Mapping[str, np.ndarray], algorithm: str) -> dict[str, str]:
    """Whole-tensor digests of host arrays (the layout-free checksums of the disk transport)."""
    out = {}
    for name, value in flat.items():
        full = tuple((0, d) for d in np.shape(value))
        out[name] = checksum.combine([(full, checksum.digest(np.asarray(value), algorithm))],
                                     algorithm)
    return out
