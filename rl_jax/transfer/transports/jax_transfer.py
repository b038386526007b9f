"""The ``jax_transfer`` transport: device to device through ``jax.experimental.transfer``.

The publisher keeps a copy of each version in the generator's layout on its own devices
(:mod:`rl_jax.transfer.publisher.device_staging`); a puller asks for a ticket over the control
channel
(``POST /v1/ticket``: an id offered once, for this puller, expiring after
``PublisherConfig.ticket_ttl_s``) and pulls the arrays under it straight into its devices. The
pull runs in a thread abandoned at the deadline (a pull of an id nobody offers never returns;
see :mod:`rl_jax.transfer.jax_transport`). The values never pass through the host here, so the
finiteness check is left to the engine.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

import jax

from rl_jax.transfer import jax_transport
from rl_jax.transfer.chunks import numpy_dtype
from rl_jax.transfer.control import MAX_ID_CHARS, HTTPStatus, body_int
from rl_jax.transfer.errors import (IntegrityError, PublisherUnavailable, TransferError,
                                    TransportUnavailable, VersionGone)
from rl_jax.transfer.manifest import Manifest
from rl_jax.transfer.pulling import run_with_deadline
from rl_jax.transfer.transports.base import Fetched, Route, Transport

MAX_TICKET_BYTES = 16 << 10  # of a ticket request's body (a few short fields)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class JaxTransferTransport(Transport):
    """Device-to-device pulls under a ticket (see the module docstring)."""

    name = "jax_transfer"
    staging = "device"
    checks_values = False
    keeps_deadline = True  # the pull runs in a thread abandoned at the deadline

    def __init__(self, puller: Any):
        super().__init__(puller)
        self._transfer_host = "127.0.0.1" if _is_loopback(puller.client.host) else "0.0.0.0"

    @classmethod
    def start(cls, publisher: Any) -> Any:
        """This process's transfer server, which offers the publisher's device copies."""
        return jax_transport.start_server(publisher.config.host,
                                          publisher.config.num_transport_addresses)

    @classmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        return {"address": publisher.transport_state[cls.name].address(),
                "num_transport_addresses": publisher.config.num_transport_addresses}

    @classmethod
    def routes(cls, publisher: Any) -> dict[tuple[str, str], tuple[Route, int]]:
        return {("POST", "/v1/ticket"): (lambda query, body: _issue_ticket(publisher, body),
                                         MAX_TICKET_BYTES)}

    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        remaining = deadline - time.monotonic()
        info = manifest.transports["jax_transfer"]
        count = int(info["num_transport_addresses"])
        if count != self.puller.config.num_transport_addresses:
            raise TransportUnavailable(
                f"publisher uses {count} transport addresses, this puller "
                f"{self.puller.config.num_transport_addresses}; they must match")
        status, ticket = self.puller.client.request("POST", "/v1/ticket", body={
            "version": manifest.version, "layout_key": self.puller.layout_key,
            "puller_id": self.puller.puller_id}, deadline=deadline)
        if status == 410:
            raise VersionGone(f"version {manifest.version} was superseded")
        if status != 200:
            raise TransferError(f"pull ticket refused: {status} {(ticket or {}).get('error')}")
        address = ticket["address"]
        names = [t.name for t in manifest.tensors]
        missing = [n for n in names if n not in self.puller.shardings]
        if missing:
            raise IntegrityError(f"the publisher sent tensors this generator does not have: "
                                 f"{missing[:5]}")
        avals = [jax.ShapeDtypeStruct(t.shape, numpy_dtype(t.dtype),
                                      sharding=self.puller.shardings[t.name])
                 for t in manifest.tensors]

        def run():
            conn = jax_transport.connection(address, self._transfer_host, count)
            if "mid_pull" in self.puller.hooks:  # test seam: ticket issued, no data moved yet
                self.puller.hooks["mid_pull"]()
            return jax_transport.pull(conn, int(ticket["uuid"]), avals)

        try:
            pulled = run_with_deadline(run, remaining, "jax_transfer pull",
                                       on_abandon=lambda: jax_transport.drop_connection(address))
        except jax.errors.JaxRuntimeError as e:
            jax_transport.drop_connection(address)
            raise PublisherUnavailable(f"jax_transfer pull from {address} failed: {e}") from e
        arrays = dict(zip(names, pulled))
        nbytes = sum(s.data.nbytes for a in pulled for s in a.addressable_shards)
        return Fetched(arrays, nbytes)


def _issue_ticket(publisher: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /v1/ticket {version, layout_key}``: offers the layout's device copy of
    ``version`` once, under a fresh id, to the puller asking."""
    version = body_int(body, "version", minimum=0)
    key = body.get("layout_key")
    if not isinstance(key, str) or len(key) > MAX_ID_CHARS:
        raise HTTPStatus(400, "field 'layout_key' must be a layout key (a string)")
    prep, _ = publisher.offered(key, version)
    arrays = prep.device_arrays
    if arrays is None:
        raise HTTPStatus(409, "jax_transfer was not prepared for this layout (register it "
                              "with that transport)")
    server = publisher.transport_state[JaxTransferTransport.name]
    uuid = secrets.randbits(62)
    jax_transport.offer(server, uuid, arrays, publisher.config.ticket_ttl_s)
    hook = publisher.hooks.get("after_ticket")
    if hook is not None:
        hook(version)
    return {"uuid": uuid, "address": server.address(),
            "num_transport_addresses": publisher.config.num_transport_addresses}
