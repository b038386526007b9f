"""Puller-side checks and plumbing shared by the transports: a deadline for work that may hang,
paths and byte ranges a manifest names checked before they are used, and a streamed manifest
completed with the digests verified while it was written.

Everything a manifest names comes from another process and is checked here before a transport
reads it: files must lie inside the directory the publisher announced (no ``..``, no symlink
leading out), every chunk and shard inside the staging file.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rl_jax.transfer import checksum
from rl_jax.transfer.errors import IntegrityError, TransferTimeout
from rl_jax.transfer.layout import Index
from rl_jax.transfer.manifest import PENDING, Manifest


def run_with_deadline(fn: Callable[[], Any], seconds: float, what: str,
                      on_abandon: Callable[[], None] | None = None) -> Any:
    """Runs ``fn`` in a daemon thread; past ``seconds`` the thread is abandoned (it may hang in
    a pull that never completes) and :class:`TransferTimeout` is raised."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"transfer-{what}", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    if thread.is_alive():
        if on_abandon is not None:
            on_abandon()
        raise TransferTimeout(f"{what} did not finish within {seconds:.1f} s; abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def completed(manifest: Manifest, digests: Mapping[str, Mapping[Index, str]]) -> Manifest:
    """A streamed manifest with the shard digests verified block by block filled in."""
    tensors = []
    for t in manifest.tensors:
        shards = tuple(dataclasses.replace(sh, checksum=digests.get(t.name, {}).get(
            sh.index, PENDING)) for sh in t.shards)
        tensors.append(dataclasses.replace(t, shards=shards, checksum=checksum.combine(
            [(sh.index, sh.checksum) for sh in shards], manifest.algorithm)))
    return dataclasses.replace(manifest, tensors=tuple(tensors))


def contained(path: Any, root: str | None, what: str) -> str:
    """``path`` (a path a manifest names), resolved, if it lies strictly inside the directory
    ``root`` (resolved too); raises :class:`IntegrityError` for ``..`` components, a path
    elsewhere, or a symlink on the way that leads out."""
    if root is None:
        raise IntegrityError(f"{what} {str(path)[:200]!r}: the publisher named no directory "
                             "for it, so it cannot be checked; refused")
    if not isinstance(path, str) or not path or "\0" in path:
        raise IntegrityError(f"{what} must be a path, got {str(path)[:200]!r}")
    if ".." in Path(path).parts:
        raise IntegrityError(f"{what} {path[:200]!r} contains '..'; refused")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))  # an absolute path stays itself
    if real == real_root or os.path.commonpath([real, real_root]) != real_root:
        raise IntegrityError(f"{what} {path[:200]!r} lies outside the publisher's directory "
                             f"{root!r} (resolved: {real!r}); refused")
    return real


def check_extents(manifest: Manifest) -> None:
    """Raises :class:`IntegrityError` unless every chunk and shard a host transport reads lies
    inside the staging file the manifest describes."""
    staging = manifest.transports.get("staging")
    if not isinstance(staging, Mapping):
        raise IntegrityError(f"version {manifest.version}: the manifest describes no staging")
    try:
        total = int(staging["nbytes"])
        chunks = [(int(c["offset"]), int(c["nbytes"])) for c in staging["chunks"]]
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"version {manifest.version}: malformed staging description: "
                             f"{e!r}") from e
    if not 0 <= total <= 1 << 50:
        raise IntegrityError(f"version {manifest.version}: staging size {total} is out of range")
    for offset, nbytes in chunks:
        if offset < 0 or nbytes <= 0 or offset + nbytes > total:
            raise IntegrityError(f"version {manifest.version}: chunk at {offset} of {nbytes} "
                                 f"bytes lies outside the {total}-byte staging file")
    for tensor in manifest.tensors:
        for shard in tensor.shards:
            if shard.offset is None or shard.offset < 0 or shard.nbytes < 0 \
                    or shard.offset + shard.nbytes > total:
                raise IntegrityError(f"version {manifest.version}: {tensor.name}'s shard at "
                                     f"{shard.offset} of {shard.nbytes} bytes lies outside the "
                                     f"{total}-byte staging file")
