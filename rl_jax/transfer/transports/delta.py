"""The ``delta`` transport: a version as the bytes that changed since the one the puller holds.

For links where bytes are what costs (across regions or clusters): between two versions of
bfloat16 weights most values are bit-identical (an optimizer step moves a float32 master weight
by far less than bfloat16's precision), so the XOR of the two versions' staging chunks is mostly
zero bytes and compresses to a few percent of the chunk with zstd (the ``zstandard`` package).

The puller keeps the host bytes of the last version it pulled (the whole staging image; its
arrays alias them). For the next version it asks the publisher, chunk by chunk, for
``GET /v1/delta?layout=&version=&base=&offset=&nbytes=``: the chunk of ``version`` XOR the same
chunk of ``base``, compressed. The publisher answers from its staging slots while both versions
are staged (the previous version's slot stays until the one after next is staged: a puller one
version behind gets deltas); otherwise 410, and that chunk comes whole (``/v1/chunk``, as the
``socket`` transport sends it). The rebuilt version is never trusted: every shard's digest is
checked against the manifest, and on any mismatch (a corrupted base or delta) the version is
fetched again whole before it is handed out.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import http.client
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from rl_jax.transfer.control import (MAX_ERROR_ANSWER_BYTES, HTTPStatus, error_answer, peer_error,
                                    query_int, read_answer)
from rl_jax.transfer.errors import (IntegrityError, PublisherUnavailable, TransferError,
                                    VersionGone)
from rl_jax.transfer.manifest import Manifest, verify
from rl_jax.transfer.transports.base import Fetched, Route, Transport
from rl_jax.transfer.transports.sockets import HostBufferPool, read_chunk

log = logging.getLogger(__name__)

LEVEL = 1  # zstd's fastest level: the XOR of two versions is mostly zeros either way


def _zstd():
    try:
        import zstandard
    except ImportError as e:  # a dependency of the package; only a broken install lacks it
        raise TransferError("the delta transport needs the zstandard package "
                            "(pip install zstandard)") from e
    return zstandard


class DeltaTransport(Transport):
    """Changed bytes since the puller's version (see the module docstring)."""

    name = "delta"
    staging = "host"

    def __init__(self, puller: Any):
        super().__init__(puller)
        self._buffers = HostBufferPool(puller.config.host_buffers + 1)  # +1: the base
        # (bytes of the last version pulled, its version, its chunks): what deltas apply to
        self._base: tuple[np.ndarray, int, tuple] | None = None
        self.stats = {"delta_chunks": 0, "whole_chunks": 0, "refetched_versions": 0}

    @classmethod
    def check_publisher(cls, config: Any, spec: Any) -> None:
        try:
            _zstd()
        except TransferError as e:
            raise ValueError(str(e)) from None

    @classmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        return {}  # the chunks are the manifest's ``staging`` entry

    @classmethod
    def routes(cls, publisher: Any) -> dict[tuple[str, str], tuple[Route, int]]:
        return {("GET", "/v1/delta"): (lambda query, body: _serve_delta(publisher, query), 0)}

    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        """The version rebuilt from the base the puller holds and the publisher's deltas (whole
        chunks where a delta cannot be had), checked against the manifest's digests; fetched
        again whole when the check fails."""
        staging = manifest.transports["staging"]
        chunks = tuple((int(c["offset"]), int(c["nbytes"])) for c in staging["chunks"])
        base = self._base
        if base is not None and (base[2] != chunks or base[1] >= manifest.version):
            base = None  # another layout, or not older: nothing to apply a delta to
        buf = self._buffers.get(int(staging["nbytes"]))
        shipped = 0
        if base is not None:
            try:
                shipped += self._get_chunks(manifest, chunks, buf, base, deadline)
                arrays = self.puller.arrays_from_chunks(manifest, buf)
                verify(manifest, arrays, what=f"version {manifest.version} rebuilt from "
                       f"version {base[1]} and deltas")
                self._base = (buf, manifest.version, chunks)
                return Fetched(arrays, shipped, _digests(manifest))
            except IntegrityError as e:
                # Never trusted: a base or a delta that does not give the manifest's digests
                # is dropped, and the version comes whole.
                log.warning("version %d from deltas failed its check (%s); fetching it whole",
                            manifest.version, str(e)[:300])
                self._base = None
                self.stats["refetched_versions"] += 1
        shipped += self._get_chunks(manifest, chunks, buf, None, deadline)
        self._base = (buf, manifest.version, chunks)  # the puller verifies it before use
        return Fetched(self.puller.arrays_from_chunks(manifest, buf), shipped)

    def _get_chunks(self, manifest: Manifest, chunks: tuple, buf: np.ndarray,
                    base: tuple | None, deadline: float) -> int:
        """Fills ``buf`` with every chunk of ``manifest``'s version over a few connections
        whose reads end at ``deadline``; returns the bytes received."""
        local = threading.local()
        headers = self.puller.client.headers()
        key, version = self.puller.layout_key, manifest.version
        zstd = _zstd()

        def request(conn, path: str) -> http.client.HTTPResponse:
            conn.request("GET", path, headers=headers)
            return conn.getresponse()

        def get(chunk) -> int:
            offset, nbytes = chunk
            conn = getattr(local, "conn", None)
            if conn is None:  # its reads end at the pull's deadline, however the peer sends
                conn = local.conn = self.puller.client.connection(deadline=deadline)
            target = buf[offset:offset + nbytes]
            try:
                if base is not None:
                    resp = request(conn, f"/v1/delta?layout={key}&version={version}"
                                         f"&base={base[1]}&offset={offset}&nbytes={nbytes}")
                    # zstd's output bound for the chunk (incompressible XORs), or an error
                    limit = nbytes + (nbytes >> 7) + (64 << 10) if resp.status == 200 \
                        else MAX_ERROR_ANSWER_BYTES
                    body = read_answer(resp, limit, f"delta of the chunk at {offset}")
                    if resp.status == 200:
                        try:
                            delta = zstd.ZstdDecompressor().decompress(
                                body, max_output_size=nbytes)
                        except zstd.ZstdError as e:
                            raise IntegrityError(f"delta of the chunk at {offset} does not "
                                                 f"decompress: {e}") from None
                        if len(delta) != nbytes:
                            raise IntegrityError(f"delta of the chunk at {offset} has "
                                                 f"{len(delta)} bytes, not {nbytes}")
                        np.bitwise_xor(base[0][offset:offset + nbytes],
                                       np.frombuffer(delta, np.uint8), out=target)
                        self.stats["delta_chunks"] += 1
                        return len(body)
                    if resp.status != 410 or b"base" not in body:
                        _refuse(resp.status, body, version)
                # No base, or the publisher no longer holds it: the chunk whole.
                resp = request(conn, f"/v1/chunk?layout={key}&version={version}"
                                     f"&offset={offset}&nbytes={nbytes}")
                if resp.status != 200:
                    answer = error_answer(resp)
                    local.conn = None
                    conn.close()
                    if resp.status == 410:
                        raise VersionGone(f"version {version} was superseded")
                    raise TransferError(f"chunk request failed: {answer}")
                read_chunk(resp, target, offset)
                self.stats["whole_chunks"] += 1
                return nbytes
            except (OSError, http.client.HTTPException) as e:
                local.conn = None
                conn.close()
                raise PublisherUnavailable(f"chunk at {offset} failed: {type(e).__name__}: "
                                           f"{e}") from e

        workers = max(1, min(self.puller.config.socket_connections, len(chunks)))
        with concurrent.futures.ThreadPoolExecutor(workers, "transfer-delta") as pool:
            return sum(f.result() for f in [pool.submit(get, c) for c in chunks])


def _digests(manifest: Manifest) -> dict[str, dict]:
    """The manifest's shard digests: what a rebuilt version was just checked against."""
    return {t.name: {sh.index: sh.checksum for sh in t.shards} for t in manifest.tensors}


def _refuse(status: int, body: bytes, version: int):
    """Raises for a refused delta request: :class:`VersionGone` (410), else a
    :class:`TransferError` with the status and the publisher's error message, if any."""
    if status == 410:
        raise VersionGone(f"version {version} was superseded")
    try:
        message = peer_error(json.loads(body))
    except (ValueError, RecursionError):
        message = ""
    raise TransferError(f"delta request failed: {status}: "
                        f"{message or f'{len(body)} bytes that are no error message'}")


def _serve_delta(publisher: Any, query: Mapping[str, str]) -> bytes:
    """``GET /v1/delta?layout=&version=&base=&offset=&nbytes=``: one chunk of ``version`` XOR
    the same chunk of ``base``, zstd-compressed, read from the two staging slots under shared
    locks (neither is rewritten while held). 410 when ``version`` is no longer offered, or
    (saying "base") when no slot holds ``base`` any more."""
    key = query.get("layout", "")
    version, base, offset, nbytes = (query_int(query, k)
                                     for k in ("version", "base", "offset", "nbytes"))
    prep, staging = publisher.offered(key, version)
    if prep.staging is None:
        raise HTTPStatus(409, "host staging was not prepared for this layout")
    if {"offset": offset, "nbytes": nbytes} not in prep.staging["chunks"]:
        raise HTTPStatus(400, f"no chunk at offset {offset} of {nbytes} bytes")
    if base >= version:
        raise HTTPStatus(400, f"base={base} is not older than version={version}")
    if staging is None:  # the layout was dropped meanwhile
        raise HTTPStatus(410, f"version {version} is no longer offered")
    base_slot = staging.slot_of(base)
    if base_slot is None:
        raise HTTPStatus(410, f"base version {base} is no longer staged")
    fds = []
    try:
        for slot, wanted, what in ((prep.staging["slot"], version, "version"),
                                   (base_slot, base, "base version")):
            try:
                fd = os.open(staging.slot_path(slot), os.O_RDONLY)
            except OSError:
                raise HTTPStatus(410, f"{what} {wanted} is no longer staged") from None
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise HTTPStatus(410, f"{what} {wanted} is no longer staged") from None
            if staging.whole_version(slot) != wanted:
                raise HTTPStatus(410, f"{what} {wanted} is no longer staged")
        new, old = (np.frombuffer(os.pread(fd, nbytes, offset), np.uint8) for fd in fds)
        if new.size != nbytes or old.size != nbytes:
            raise HTTPStatus(410, f"base version {base} is no longer staged whole")
        return _zstd().ZstdCompressor(level=LEVEL).compress(np.bitwise_xor(new, old).data)
    finally:
        for fd in fds:
            os.close(fd)
