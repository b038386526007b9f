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

Every endpoint needs ``Authorization: Bearer <token>`` (the publisher's
``PublisherConfig.auth_token``, compared in constant time; a route added with its own token,
:meth:`ControlServer.add_routes`, needs that one instead); a request without it, or with another
token, gets 401. Request bodies are JSON objects of at most ``max_body_bytes``; query values are
checked (a bad one gets 400 naming it).

Errors are ``{"error": message}`` with a 4xx/5xx status.
"""

from __future__ import annotations

import functools
import hmac
import http.client
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rl_jax.transfer.config import MAX_ANSWER_BYTES, env_token
from rl_jax.transfer.errors import AuthenticationError, PublisherUnavailable, TransferTimeout

log = logging.getLogger(__name__)

MAX_ID_CHARS = 200  # of a puller id or a layout key in a request


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

MAX_QUERY_INT = (1 << 62) - 1  # versions, offsets and sizes fit in an int64 with room to spare


def query_int(query: dict[str, str], name: str, *, default: int | None = None,
              minimum: int = 0, maximum: int = MAX_QUERY_INT) -> int:
    """The integer query value ``name`` in ``[minimum, maximum]``; 400 naming it otherwise
    (missing without a default, not a plain integer, out of range)."""
    raw = query.get(name)
    if raw is None:
        if default is None:
            raise HTTPStatus(400, f"query value {name!r} is required")
        return default
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isdigit() or not digits.isascii() or len(digits) > 19:
        raise HTTPStatus(400, f"query value {name}={raw[:40]!r} is not an integer")
    value = int(text)
    if not minimum <= value <= maximum:
        raise HTTPStatus(400, f"query value {name}={value} is out of range "
                              f"[{minimum}, {maximum}]")
    return value


def query_seconds(query: dict[str, str], name: str, *, default: float, maximum: float
                  ) -> float:
    """The number of seconds ``name`` in ``[0, maximum]``; 400 naming it otherwise."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw[:40])
    except ValueError:
        raise HTTPStatus(400, f"query value {name}={raw[:40]!r} is not a number") from None
    if not math.isfinite(value) or not 0 <= value <= maximum:
        raise HTTPStatus(400, f"query value {name}={raw[:40]!r} must be a number of seconds "
                              f"in [0, {maximum:g}]")
    return value


def body_int(body: dict[str, Any], name: str, *, minimum: int = -1,
             maximum: int = MAX_QUERY_INT) -> int:
    """The integer field ``name`` of a request body; 400 naming it otherwise."""
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise HTTPStatus(400, f"field {name!r} must be an integer in [{minimum}, {maximum}], "
                              f"got {str(value)[:40]!r}")
    return value


class ControlServer:
    """A ``ThreadingHTTPServer`` dispatching ``(method, path)`` to routes in a daemon thread.

    Requests must carry ``auth_token``; bodies are limited to ``body_limits[path]`` bytes
    (default ``max_body_bytes``), refused with 413 before they are read."""

    def __init__(self, host: str, port: int, routes: dict[tuple[str, str], Route], *,
                 auth_token: str, max_body_bytes: int = 4 << 20,
                 body_limits: dict[str, int] | None = None):
        if not auth_token:
            raise ValueError("the control server needs a non-empty auth_token")
        routes_ = self._routes = dict(routes)
        limits = self._limits = dict(body_limits or {})
        expected = f"Bearer {auth_token}".encode()
        tokens = self._tokens = {}  # path -> the header a route added with its own token needs

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # quiet: the trainer's log is not an access log
                log.debug("control: " + fmt, *args)

            def _authorized(self, path: str) -> bool:
                given = self.headers.get("Authorization", "").encode("utf-8", "replace")
                return hmac.compare_digest(given, tokens.get(path, expected))

            def _refuse(self, status: int, message: str, **headers: str):
                """Answers without reading the body (so the connection is closed after)."""
                self.close_connection = True
                self._json(status, {"error": message}, headers)

            def _dispatch(self, method: str):
                url = urllib.parse.urlsplit(self.path)
                if url.path in tokens and not self._authorized(url.path):
                    return self._refuse(401, "missing or wrong key (send 'Authorization: "
                                             "Bearer <key>' with the generator servers' admin "
                                             "key)",
                                        **{"WWW-Authenticate": 'Bearer realm="rl_jax.control"'})
                if not self._authorized(url.path):
                    return self._refuse(401, "missing or wrong transfer token (send "
                                             "'Authorization: Bearer <token>', the publisher's "
                                             "RL_JAX_TRANSFER_TOKEN)",
                                        **{"WWW-Authenticate": 'Bearer realm="rl_jax.transfer"'})
                if "Transfer-Encoding" in self.headers:
                    return self._refuse(411, "chunked request bodies are not accepted; send "
                                             "Content-Length")
                raw_length = self.headers.get("Content-Length") or "0"
                if not raw_length.isdigit() or not raw_length.isascii():
                    return self._refuse(400, f"Content-Length {raw_length[:40]!r} is not a "
                                             "non-negative integer")
                length = int(raw_length)
                limit = limits.get(url.path, max_body_bytes)
                if length > limit:
                    return self._refuse(413, f"request body of {length} bytes exceeds the "
                                             f"limit of {limit} bytes for {url.path}")
                try:
                    query = dict(urllib.parse.parse_qsl(url.query, strict_parsing=False,
                                                        max_num_fields=16))
                except ValueError as e:
                    return self._refuse(400, f"bad query string: {e}")
                body: dict[str, Any] = {}
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                        return self._json(400, {"error": "request body is not valid JSON"})
                    if not isinstance(body, dict):
                        return self._json(400, {"error": "request body must be a JSON object"})
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
                elif isinstance(result, bytes):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(result)))
                    self.end_headers()
                    self.wfile.write(result)
                else:
                    self._json(200, result)

            def _json(self, status: int, data: Any, headers: dict[str, str] | None = None):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
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

            def do_DELETE(self):
                self._dispatch("DELETE")

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

    def add_routes(self, routes: dict[tuple[str, str], Route], *, token: str | None = None,
                   max_body_bytes: int | None = None) -> None:
        """Serves ``routes`` from now on, each path answering only requests that carry
        ``token`` (default: the server's own) and bodies of at most ``max_body_bytes``."""
        for (_, path), route in routes.items():
            if token:
                self._tokens[path] = f"Bearer {token}".encode()
            if max_body_bytes is not None:
                self._limits[path] = max_body_bytes
        self._routes.update(routes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def normalize_url(url: str) -> str:
    """``http://host:port`` of a publisher address (``host:port`` or a URL, any case)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"publisher url must look like http://HOST:PORT, got {url!r}")
    text = url.strip()
    parts = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or not port or parts.username \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"publisher url must look like http://HOST:PORT, got {url!r}")
    host = parts.hostname.lower()
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


class _DeadlineSocket(socket.socket):
    """A socket whose receives each wait at most ``step`` seconds and never past ``deadline``
    (``time.monotonic()``): a peer that trickles its answer cannot stretch a request past it."""

    deadline: float = math.inf
    step: float | None = None

    def recv_into(self, buffer, nbytes=0, flags=0):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.settimeout(left if self.step is None else min(self.step, left))
        return super().recv_into(buffer, nbytes, flags)


class _DeadlineConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose reads end at ``deadline`` (see :class:`_DeadlineSocket`)."""

    def __init__(self, host: str, port: int, timeout: float, deadline: float):
        super().__init__(host, port, timeout=timeout)
        self._deadline = deadline

    def connect(self):
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed before connecting")
        self.timeout = min(self.timeout, left)
        super().connect()
        raw = self.sock
        sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        sock.deadline, sock.step = self._deadline, self.timeout
        sock.settimeout(self.timeout)
        self.sock = sock


MAX_ERROR_ANSWER_BYTES = 64 << 10  # of an error answer to a chunk or delta request


def describe_answer(resp: http.client.HTTPResponse, nbytes: int | None = None) -> str:
    """What an answer was without its content: ``"404 with 120 bytes of 'application/json'"``
    (``nbytes`` read, else the announced ``Content-Length``)."""
    kind = (resp.getheader("Content-Type") or "").split(";")[0].strip()
    size = nbytes if nbytes is not None else resp.getheader("Content-Length")
    size_text = "a body of unannounced length" if size is None else f"{str(size)[:20]} bytes"
    return (f"{resp.status} with {size_text} of "
            f"{repr(kind[:60]) if kind else 'no Content-Type'}")


def read_answer(resp: http.client.HTTPResponse, limit: int, what: str) -> bytes:
    """The body of ``resp``, refused (:class:`PublisherUnavailable`, naming ``what``, the status,
    size and content type, never the content) when it announces or sends more than ``limit``
    bytes: an oversized answer is not read into memory."""
    announced = (resp.getheader("Content-Length") or "").strip()
    if announced.isdigit() and int(announced) > limit:
        raise PublisherUnavailable(f"{what}: {describe_answer(resp)}, more than the {limit} "
                                   f"bytes a control answer may have (PullerConfig."
                                   f"max_answer_bytes); refused unread")
    data = resp.read(limit + 1)
    if len(data) > limit:
        raise PublisherUnavailable(f"{what}: {resp.status} with more than {limit} bytes (the "
                                   f"most a control answer may have: PullerConfig."
                                   f"max_answer_bytes); refused")
    return data


def peer_error(payload: Any) -> str:
    """The ``error`` message of a publisher's JSON error answer (whitespace collapsed, at most
    200 characters); "" when the answer is not such an object."""
    error = payload.get("error") if isinstance(payload, dict) else None
    return " ".join(error.split())[:200] if isinstance(error, str) else ""


def error_answer(resp: http.client.HTTPResponse) -> str:
    """A refused chunk or delta request's answer in words: its status and the publisher's
    error message when it sent one (read within :data:`MAX_ERROR_ANSWER_BYTES`), else its size
    and content type (:func:`describe_answer`)."""
    try:
        data = read_answer(resp, MAX_ERROR_ANSWER_BYTES, "error answer")
    except PublisherUnavailable:
        return describe_answer(resp)
    try:
        message = peer_error(json.loads(data))
    except (ValueError, RecursionError):
        message = ""
    return f"{resp.status}: {message}" if message else describe_answer(resp, len(data))


class ControlClient:
    """Blocking JSON requests to a publisher (one connection per request), authenticated with
    ``token`` (default: ``$RL_JAX_TRANSFER_TOKEN`` when each request is made). Each request
    ends within its timeout (the whole request, not each read) and the pull's deadline; an
    answer over ``max_answer_bytes`` is refused unread."""

    def __init__(self, url: str, timeout: float = 30.0, token: str | None = None,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        self.url = normalize_url(url)
        parts = urllib.parse.urlsplit(self.url)
        self.host, self.port, self.timeout = parts.hostname, parts.port, timeout
        self.max_answer_bytes = max_answer_bytes
        self._token = token

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header of every request (empty without a token: refused)."""
        token = self._token or env_token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def connection(self, timeout: float | None = None, deadline: float | None = None
                   ) -> http.client.HTTPConnection:
        """A connection to the publisher whose reads wait at most ``timeout`` each and, with
        ``deadline`` (``time.monotonic()``), end there whatever the peer sends."""
        timeout = timeout or self.timeout
        if deadline is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        return _DeadlineConnection(self.host, self.port, timeout, deadline)

    def request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                body: dict[str, Any] | None = None, timeout: float | None = None,
                deadline: float | None = None) -> tuple[int, Any]:
        """Returns ``(status, decoded JSON or None)``; raises :class:`PublisherUnavailable` when
        the publisher cannot be reached, answers 5xx or something that is not a JSON answer
        within ``max_answer_bytes``, :class:`AuthenticationError` on 401, and
        :class:`TransferTimeout` once ``timeout`` (for the whole request) or ``deadline``
        (``time.monotonic()``, the pull's) has passed. Errors name the answer's status, size and
        content type, and the publisher's ``error`` message, never other content."""
        if query:
            path += "?" + urllib.parse.urlencode(query)
        raw = None if body is None else json.dumps(body).encode()
        timeout = timeout or self.timeout
        own = time.monotonic() + timeout
        if deadline is not None and deadline - time.monotonic() <= 0:
            raise TransferTimeout(f"publisher {self.url}: the pull's deadline passed before "
                                  f"{method} {url_path(path)}")
        end = own if deadline is None else min(own, deadline)
        conn = self.connection(timeout, end)
        headers = self.headers()
        if raw:
            headers["Content-Type"] = "application/json"
        what = f"publisher {self.url} answered {method} {url_path(path)} with"
        try:
            conn.request(method, path, body=raw, headers=headers)
            resp = conn.getresponse()
            data = read_answer(resp, self.max_answer_bytes, what.removesuffix(" with"))
        except (OSError, http.client.HTTPException) as e:
            if time.monotonic() >= end - 0.05:
                which = "the pull's deadline" if deadline is not None and deadline <= own \
                    else f"its deadline ({timeout:g} s)"
                raise TransferTimeout(f"publisher {self.url} did not answer {method} "
                                      f"{url_path(path)} before {which}") from e
            raise PublisherUnavailable(f"publisher {self.url} unreachable ({method} "
                                       f"{url_path(path)}): {type(e).__name__}: {e}") from e
        finally:
            conn.close()
        if resp.status == 401:
            raise AuthenticationError(f"publisher {self.url} refused this puller's token (set "
                                      "RL_JAX_TRANSFER_TOKEN or PullerConfig.auth_token to the "
                                      "publisher's)")
        payload = None
        if data:
            kind = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise PublisherUnavailable(f"{what} {describe_answer(resp, len(data))}, not "
                                           "JSON")
            try:
                payload = json.loads(data)
            except (ValueError, RecursionError):
                raise PublisherUnavailable(f"{what} {describe_answer(resp, len(data))} that "
                                           "does not parse as JSON") from None
        if resp.status >= 500:
            raise PublisherUnavailable(f"publisher {self.url} failed ({method} "
                                       f"{url_path(path)}): {resp.status} "
                                       f"{peer_error(payload)}".rstrip())
        return resp.status, payload


def url_path(path: str) -> str:
    """``path`` without its query (what error messages name)."""
    return path.split("?", 1)[0]
