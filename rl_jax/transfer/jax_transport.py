"""``jax.experimental.transfer`` plumbing: one transfer server per process, cached connections.

Facts this module is built around (observed on CPU with jax 0.10.2, see STACK-NOTES):
the puller must ask for exactly the layout the publisher offers; ``pull`` of an id nobody
published hangs forever and its ``timeout`` does not fire; ``await_pull`` serves one pull (and
with a ``timeout`` it forgets the arrays when nobody pulled in time); both sides must have the
same number of transport addresses, or the process aborts. Hence: ids are agreed over the
control channel (a ticket per puller per version), pulls run in a thread abandoned at the
deadline, and the address count is checked before connecting.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from rl_jax.transfer.errors import TransportUnavailable

_lock = threading.Lock()
_server: Any = None
_server_addresses = 0
_connections: dict[str, Any] = {}


def available() -> bool:
    try:
        from jax.experimental import transfer  # noqa: F401
    except ImportError:
        return False
    return True


def start_server(host: str, num_transport_addresses: int) -> Any:
    """This process's transfer server (started once; its address count is fixed)."""
    global _server, _server_addresses
    if not available():
        raise TransportUnavailable("jax.experimental.transfer is not available in this jax")
    from jax.experimental import transfer
    with _lock:
        if _server is None:
            client = jax.local_devices()[0].client
            _server = transfer.start_transfer_server(
                client, f"{host}:0", [f"{host}:0"] * num_transport_addresses)
            _server_addresses = num_transport_addresses
        elif _server_addresses != num_transport_addresses:
            raise TransportUnavailable(
                f"this process's transfer server has {_server_addresses} transport addresses, "
                f"the publisher uses {num_transport_addresses}; they must be equal (set "
                "num_transport_addresses alike on both sides)")
        return _server


def offer(server: Any, uuid: int, arrays: Sequence[jax.Array], ttl_s: float) -> None:
    """Makes ``arrays`` pullable once under ``uuid``; forgotten after ``ttl_s`` if not pulled."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=ttl_s)
    server.await_pull(uuid, list(arrays), timeout=deadline)


def connection(address: str, host: str, num_transport_addresses: int) -> Any:
    server = start_server(host, num_transport_addresses)
    with _lock:
        if address not in _connections:
            _connections[address] = server.connect(address)
        return _connections[address]


def drop_connection(address: str) -> None:
    """Forgets (and poisons) the connection after an abandoned pull; the next pull reconnects."""
    with _lock:
        conn = _connections.pop(address, None)
    if conn is not None and hasattr(conn, "_poison_connection"):
        try:
            conn._poison_connection()
        except Exception:  # best effort: the connection is abandoned anyway
            pass


def pull(conn: Any, uuid: int, avals: Sequence[jax.ShapeDtypeStruct],
         started: Callable[[], None] | None = None) -> list[jax.Array]:
    """Pulls and waits for the data (call from a thread that may be abandoned); ``started``
    runs once the pull is under way."""
    arrays = conn.pull(uuid, list(avals))
    if started is not None:
        started()
    for a in arrays:
        a.block_until_ready()
    return arrays
