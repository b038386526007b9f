"""Safetensors-format chunks: how the host transports lay tensor shards out in bytes.

A version of one layout is staged as a sequence of chunks; each chunk is a complete, valid
safetensors blob (``u64`` header length, JSON header, data) holding some tensor shards, named
``"<tensor>#<shard ordinal>"``. Every data region starts on a 64-byte boundary (the header is
padded with spaces; gaps between tensors are filled by ``__pad<k>`` U8 entries, so the blob has
no holes): aligned host buffers can be handed to XLA's CPU client without a copy. The chunks are
concatenated in one staging file; the manifest gives each chunk's and each shard's offset.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from rl_jax.transfer.errors import IntegrityError

ALIGN = 64

# The staging file's bookkeeping, written by the publisher and read in place by the ``shm``
# transport: a slot's stamp is the version it holds or one of these two; each shard's progress
# row holds the version copied into it, with NONFINITE set where a copied value was not finite
# (``finite.copy_finite``; each staged tensor's info says ``finite``, see ``TensorInfo``).
STAMP_WRITING = -1  # the slot is being written
STAMP_SUPERSEDED = -2  # the slot holds a version that is no longer offered
NONFINITE = 1 << 63

_TO_SAFETENSORS = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16", np.dtype(np.uint16): "U16", np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64", np.dtype(np.uint64): "U64",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in _TO_SAFETENSORS.items()}


def safetensors_dtype(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt not in _TO_SAFETENSORS:
        raise TypeError(f"dtype {dt} has no safetensors name")
    return _TO_SAFETENSORS[dt]


def numpy_dtype(name: str) -> np.dtype:
    """A dtype from its numpy name (``"float32"``, ``"bfloat16"``) as manifests store it."""
    try:
        return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError as e:
        raise IntegrityError(f"unknown dtype {name!r} in manifest") from e


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor shard to stage."""

    name: str  # "<tensor>#<shard ordinal>"
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    offset: int  # of the chunk in the staging file
    nbytes: int
    header: bytes  # length prefix + padded JSON header
    entries: dict[str, int]  # entry name -> absolute offset of its data in the staging file


def plan_chunks(entries: Sequence[Entry], chunk_bytes: int,
                metadata: dict[str, str] | None = None) -> list[ChunkPlan]:
    """Groups ``entries`` (in order) into chunks of about ``chunk_bytes`` and lays them out."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += _align(e.nbytes)
    plans, offset = [], 0
    for group in groups:
        if not group:
            continue
        plan = _plan_one(group, offset, metadata or {})
        plans.append(plan)
        offset = _align(offset + plan.nbytes)
    return plans


def _plan_one(group: list[Entry], chunk_offset: int, metadata: dict[str, str]) -> ChunkPlan:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    relative: dict[str, int] = {}
    pos = 0
    for k, e in enumerate(group):
        relative[e.name] = pos
        header[e.name] = {"dtype": safetensors_dtype(e.dtype), "shape": list(e.shape),
                          "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
        pad = _align(pos) - pos
        if pad and k + 1 < len(group):
            header[f"__pad{k}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [pos, pos + pad]}
            pos += pad
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (_align(8 + len(text)) - 8 - len(text))
    head = struct.pack("<Q", len(text)) + text
    start = chunk_offset + len(head)
    return ChunkPlan(offset=chunk_offset, nbytes=len(head) + pos, header=head,
                     entries={n: start + r for n, r in relative.items()})


def parse_chunk(blob: memoryview | np.ndarray) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...],
                                                                         int, int]],
                                                        dict[str, str]]:
    """Reads a chunk's header: ``({entry: (dtype, shape, start, stop)}, metadata)`` with offsets
    relative to the chunk's first byte. Raises :class:`IntegrityError` on a malformed chunk."""
    raw = memoryview(blob).cast("B") if not isinstance(blob, np.ndarray) else \
        memoryview(blob.reshape(-1).view(np.uint8))
    if len(raw) < 8:
        raise IntegrityError(f"chunk of {len(raw)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise IntegrityError(f"chunk header claims {n} bytes but the chunk has {len(raw)}")
    try:
        header = json.loads(bytes(raw[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(f"chunk header is not valid JSON: {e}") from e
    meta = header.pop("__metadata__", {}) or {}
    entries = {}
    base = 8 + n
    for name, info in header.items():
        if name.startswith("__pad"):
            continue
        try:
            dtype = _FROM_SAFETENSORS[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, stop = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise IntegrityError(f"chunk entry {name!r} is malformed: {e}") from e
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if stop - start != expected or base + stop > len(raw):
            raise IntegrityError(f"chunk entry {name!r} has data offsets {start}..{stop} that "
                                 f"do not fit its shape {shape} or the chunk")
        entries[name] = (dtype, shape, base + start, base + stop)
    return entries, meta
