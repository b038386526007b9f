"""The ``socket`` transport: the publisher's staging slot, chunk by chunk over HTTP.

Pullers anywhere fetch the safetensors-format chunks of the layout's staging slot (the bytes the
``shm`` transport maps) with ``GET /v1/chunk`` on the control channel, over a few parallel
connections; the publisher answers each with ``sendfile`` under a shared lock on the slot. The
chunks land in a reusable page-aligned host buffer that the pulled arrays alias (no copy into
XLA on CPU); chunk headers and digests are checked before the arrays are handed out.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import http.client
import mmap
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from rl_jax.transfer.control import FileSlice, HTTPStatus, describe_answer, error_answer, query_int
from rl_jax.transfer.errors import PublisherUnavailable, TransferError, VersionGone
from rl_jax.transfer.manifest import Manifest
from rl_jax.transfer.transports.base import Fetched, Route, Transport


def aligned_host_buffer(nbytes: int) -> np.ndarray:
    """A fresh page-aligned private buffer (transparent huge pages where the kernel allows),
    so that XLA's CPU client can adopt its 64-byte aligned slices without copying."""
    m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, np.uint8)  # exactly nbytes long: views of it have it as their base


def read_chunk(resp: http.client.HTTPResponse, target: np.ndarray, offset: int) -> None:
    """Reads a chunk's body into ``target`` (``uint8``, the chunk's length) as it arrives;
    ``offset`` names the chunk in the error when the body ends early."""
    view, got = memoryview(target), 0
    while got < target.size:
        n = resp.readinto(view[got:])
        if not n:
            raise TransferError(f"chunk at {offset} ended after {got} of {target.size} bytes "
                                "(publisher gone?)")
        got += n


class HostBufferPool:
    """Reusable aligned host buffers for the ``socket`` transport.

    Pulled arrays alias their buffer (no copy into XLA on CPU), so a buffer can be reused only
    once nothing references it any more: JAX keeps a reference to the buffer's base array for as
    long as an array aliases it, which ``sys.getrefcount`` sees. A buffer still in use is never
    handed out; when none is free a new one is allocated (at most ``max_buffers`` are kept).
    Reused buffers have warm pages: no page faults, no kernel zeroing.
    """

    def __init__(self, max_buffers: int = 3):
        self.max_buffers = max_buffers
        self._bases: list[np.ndarray] = []

    def get(self, nbytes: int) -> np.ndarray:
        for base in self._bases:
            # references: the list, the loop variable, getrefcount's argument
            if base.size >= nbytes and sys.getrefcount(base) <= 3:
                return base[:nbytes]
        base = aligned_host_buffer(nbytes)
        assert base.base is not None and not isinstance(base.base, np.ndarray)
        if len(self._bases) >= self.max_buffers:
            free = [b for b in self._bases if sys.getrefcount(b) <= 3]
            if not free:
                return base  # all kept buffers are in use: this one is not pooled
            self._bases.remove(min(free, key=lambda b: b.size))
        self._bases.append(base)
        return base[:nbytes]


class SocketTransport(Transport):
    """Chunks of the staging slot over HTTP (see the module docstring)."""

    name = "socket"
    staging = "host"

    def __init__(self, puller: Any):
        super().__init__(puller)
        self._buffers = HostBufferPool(puller.config.host_buffers)

    @classmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        return {}  # the chunks are the manifest's ``staging`` entry

    @classmethod
    def routes(cls, publisher: Any) -> dict[tuple[str, str], tuple[Route, int]]:
        return {("GET", "/v1/chunk"): (lambda query, body: _serve_chunk(publisher, query), 0)}

    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        """Every chunk into one host buffer, then views of it placed in the target shardings
        (``deadline``: the puller abandons this call's thread past it)."""
        staging = manifest.transports["staging"]
        total = int(staging["nbytes"])
        buf = self._buffers.get(total)
        chunks = [(int(c["offset"]), int(c["nbytes"])) for c in staging["chunks"]]
        local = threading.local()
        done = []
        headers = self.puller.client.headers()

        def get(chunk):
            offset, nbytes = chunk
            conn = getattr(local, "conn", None)
            if conn is None:  # its reads end at the pull's deadline, however the peer sends
                conn = local.conn = self.puller.client.connection(deadline=deadline)
            query = (f"/v1/chunk?layout={self.puller.layout_key}&version={manifest.version}"
                     f"&offset={offset}&nbytes={nbytes}")
            try:
                conn.request("GET", query, headers=headers)
                resp = conn.getresponse()
                if resp.status == 410:
                    local.conn = None
                    conn.close()
                    raise VersionGone(f"version {manifest.version} was superseded")
                if resp.status != 200:
                    answer = error_answer(resp)
                    local.conn = None
                    conn.close()
                    raise TransferError(f"chunk request failed: {answer}")
                if resp.length is not None and resp.length != nbytes:
                    local.conn = None
                    conn.close()
                    raise TransferError(f"chunk at {offset}: the publisher answered "
                                        f"{describe_answer(resp)}, not the chunk's {nbytes}")
                read_chunk(resp, buf[offset:offset + nbytes], offset)
            except (OSError, http.client.HTTPException) as e:
                local.conn = None
                conn.close()
                raise PublisherUnavailable(f"chunk at {offset} failed: {type(e).__name__}: "
                                           f"{e}") from e
            done.append(nbytes)
            if "mid_pull" in self.puller.hooks and len(done) == 1:
                self.puller.hooks["mid_pull"]()  # test seam: one chunk in, the others not yet

        workers = max(1, min(self.puller.config.socket_connections, len(chunks)))
        with concurrent.futures.ThreadPoolExecutor(workers, "transfer-socket") as pool:
            for f in [pool.submit(get, c) for c in chunks]:
                f.result()
        return Fetched(self.puller.arrays_from_chunks(manifest, buf), sum(done))


def _serve_chunk(publisher: Any, query: Mapping[str, str]) -> FileSlice:
    """``GET /v1/chunk?layout=&version=&offset=&nbytes=``: one chunk of the layout's staging
    slot, sent from the file under a shared lock (the slot is not rewritten while it is held);
    410 once the version is no longer offered."""
    key = query.get("layout", "")
    version, offset, nbytes = (query_int(query, k) for k in ("version", "offset", "nbytes"))
    prep, staging = publisher.offered(key, version)
    if prep.staging is None:
        raise HTTPStatus(409, "host staging was not prepared for this layout")
    if {"offset": offset, "nbytes": nbytes} not in prep.staging["chunks"]:
        raise HTTPStatus(400, f"no chunk at offset {offset} of {nbytes} bytes")
    if staging is None:  # the layout was dropped meanwhile
        raise HTTPStatus(410, f"version {version} is no longer offered")
    path = staging.slot_path(prep.staging["slot"])
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        raise HTTPStatus(410, f"version {version} is no longer offered")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise HTTPStatus(410, f"version {version} is no longer offered")
    if staging.stamp(prep.staging["slot"]) != version:
        os.close(fd)
        raise HTTPStatus(410, f"version {version} is no longer offered")
    return FileSlice(fd, offset, nbytes, owned=True)
