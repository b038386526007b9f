"""The HTTP control channel: a small threaded server on the publisher, a client for pullers.

Publisher endpoints (JSON unless noted):

  GET  /v1/info                         {version, transports, host_id, pid, layouts}
  POST /v1/register {layout, transports, puller_id}   → {layout_key, version}
  GET  /v1/manifest?layout=K&after=V&wait=S
        long-poll: the manifest of the newest version > V for layout K, once it is ready;
        204 when nothing newer arrived within S seconds; 404 for an unknown layout (register
        again: the publisher restarted); 409 when the layout cannot be produced.
  POST /v1/ticket {version, layout_key, puller_id}   → {uuid, address, num_transport_addresses}
        (jax_transfer: the publisher calls ``await_pull`` once for this puller and version)
  GET  /v1/chunk?layout=K&version=V&offset=O&nbytes=N  → raw bytes of one safetensors chunk
        (socket transport; sent with ``sendfile`` from the staging file); 410 when V was
        superseded meanwhile.
  POST /v1/report {puller_id, version, transport, ok, seconds, bytes, error}  (metrics)

Errors are ``{"error": message}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import os
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rl_jax.transfer.errors import PublisherUnavailable

log = logging.getLogger(__name__)


@functools.cache
def host_id() -> str:
    """Identifies this host (and boot): shared memory is only usable where it is equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class HTTPStatus(Exception):
    """Raised by a route to answer with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class FileSlice:
    """A route's answer that is ``nbytes`` bytes of an open file from ``offset`` (sendfile);
    with ``owned``, the server closes ``fd`` afterwards."""

    def __init__(self, fd: int, offset: int, nbytes: int, owned: bool = False):
        self.fd, self.offset, self.nbytes, self.owned = fd, offset, nbytes, owned


Route = Callable[[dict[str, str], dict[str, Any]], Any]


class ControlServer:
    """A ``ThreadingHTTPServer`` dispatching ``(method, path)`` to routes in a daemon thread."""

    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route]):
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet: the trainer's log is not an access log
                log.debug("control: " + fmt, *args)

            def _dispatch(self, method: str):
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                body: dict[str, Any] = {}
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return self._json(400, {"error": "request body is not valid JSON"})
                route = routes_.get((method, url.path))
                if route is None:
                    return self._json(404, {"error": f"no endpoint {method} {url.path}"})
                try:
                    result = route(query, body)
                except HTTPStatus as e:
                    return self._json(e.status, {"error": e.message, **e.extra})
                except Exception as e:  # a bug in a route must not kill the server thread
                    log.exception("control route %s failed", url.path)
                    return self._json(500, {"error": f"{type(e).__name__}: {e}"})
                if result is None:
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif isinstance(result, FileSlice):
                    self._file(result)
                else:
                    self._json(200, result)

            def _json(self, status: int, data: Any):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _file(self, part: FileSlice):
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(part.nbytes))
                self.end_headers()
                self.wfile.flush()
                sent, sock = 0, self.connection
                try:
                    while sent < part.nbytes:
                        n = os.sendfile(sock.fileno(), part.fd, part.offset + sent,
                                        part.nbytes - sent)
                        if n == 0:
                            break
                        sent += n
                except (BrokenPipeError, ConnectionResetError):  # the puller went away
                    self.close_connection = True
                finally:
                    if part.owned:
                        os.close(part.fd)
                if sent < part.nbytes:
                    self.close_connection = True

            def do_GET(self):
                self._dispatch("GET")

            def do_POST(self):
                self._dispatch("POST")

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 64

            def handle_error(self, request, client_address):  # a dead peer is not an error
                log.debug("control connection from %s ended abruptly", client_address)

        self._server = Server((host, port), Handler)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="transfer-control",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


class ControlClient:
    """Blocking JSON requests to a publisher (one connection per request)."""

    def __init__(self, url: str, timeout: float = 30.0):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if not parts.hostname or not parts.port:
            raise ValueError(f"publisher url must look like http://HOST:PORT, got {url!r}")
        self.url = f"http://{parts.hostname}:{parts.port}"
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout

    def connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                body: dict[str, Any] | None = None, timeout: float | None = None
                ) -> tuple[int, Any]:
        """Returns ``(status, decoded JSON or None)``; raises :class:`PublisherUnavailable` when
        the publisher cannot be reached or answers 5xx."""
        if query:
            path += "?" + urllib.parse.urlencode(query)
        raw = None if body is None else json.dumps(body).encode()
        conn = self.connection(timeout)
        try:
            conn.request(method, path, body=raw,
                         headers={"Content-Type": "application/json"} if raw else {})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise PublisherUnavailable(f"publisher {self.url} unreachable ({method} {path}): "
                                       f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()
        payload = json.loads(data) if data else None
        if resp.status >= 500:
            message = payload.get("error") if isinstance(payload, dict) else data[:200]
            raise PublisherUnavailable(f"publisher {self.url} failed ({method} {path}): "
                                       f"{resp.status} {message}")
        return resp.status, payload
