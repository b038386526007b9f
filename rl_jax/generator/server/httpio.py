"""The HTTP server's aiohttp plumbing: request bodies read within bounds, JSON answers and
errors, the error middleware that turns exceptions into SGLang's error JSON, awaiting many engine
futures as one, and the watchdog that stops a server whose parent is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
from typing import Any

from aiohttp import web

from rl_jax.generator.json_body import ProtocolError
from rl_jax.generator.responses import error_json
from rl_jax.generator.types import GeneratorError, Overloaded
from rl_jax.models.hf import CheckpointError
from rl_jax.procs import process_alive

log = logging.getLogger("rl_jax.generator.server")  # one logger for the server's modules


class ProtocolLog(logging.LoggerAdapter):
    """The logger of aiohttp's request handler (``web.AppRunner(logger=...)``): a request that
    is not HTTP/1.1 aiohttp can parse (an HTTP/2 preface such as routers' probes send, a bad
    request line, headers past the limits) is one warning line naming the peer and the problem
    (aiohttp answers it 400 and closes the connection); every other error keeps its
    traceback."""

    def __init__(self):
        super().__init__(logging.getLogger("rl_jax.generator.server.http"), {})

    def exception(self, msg, *args, exc_info=True, **kwargs):
        from aiohttp.http_exceptions import HttpProcessingError
        if isinstance(exc_info, HttpProcessingError):
            peer = args[0] if args else "?"
            text = " ".join(str(exc_info.message or exc_info).split())
            self.warning("refused a malformed HTTP request from %s: %s: %.200s", peer,
                         type(exc_info).__name__, text)
            return
        self.error(msg, *args, exc_info=exc_info, **kwargs)


class EngineStopped(RuntimeError):
    """The engine's scheduler thread is not running (HTTP 503): nothing would be served."""


async def exit_with_parent(parent_pid: int, stop: asyncio.Event, interval: float = 1.0):
    """Sets ``stop`` once process ``parent_pid`` is gone (a killed test run or launcher must not
    leave servers behind). A direct parent is gone as soon as this process is re-parented."""
    def alive():
        if direct:
            return os.getppid() == parent_pid
        return process_alive(parent_pid)

    direct = os.getppid() == parent_pid
    while alive():
        await asyncio.sleep(interval)
    log.warning("parent process %d is gone; shutting down", parent_pid)
    stop.set()


async def all_results(futures: list[concurrent.futures.Future]) -> list:
    """The results of the engine's ``futures``, in order, awaited as one: a single wake-up of
    the event loop when the last is done (or the first fails), whatever their number."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle(result_or_error, failed: bool):
        if done.done():
            return
        if failed:
            done.set_exception(result_or_error)
        else:
            done.set_result(result_or_error)

    def finished(future: concurrent.futures.Future):
        error = None if future.cancelled() else future.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if error is not None:
            loop.call_soon_threadsafe(settle, error, True)
        elif last:
            loop.call_soon_threadsafe(settle, None, False)

    if not futures:
        return []
    for future in futures:
        future.add_done_callback(finished)
    await done
    return [f.result() for f in futures]


class NonFiniteAnswer(RuntimeError):
    """An answer holds a NaN or an infinity, which JSON cannot carry: it is not sent (a 500: a
    request that could produce one should have been refused)."""


def dumps(data: Any) -> str:
    """``data`` as strict JSON: a non-finite number raises :class:`NonFiniteAnswer` instead of
    being written as the non-JSON tokens ``NaN`` or ``Infinity``."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError as e:
        raise NonFiniteAnswer(f"the answer holds a non-finite number (NaN or infinity), which "
                              f"JSON cannot carry; not sent ({e})") from None


def json_response(data: Any, status: int = 200, headers=None) -> web.Response:
    return web.Response(text=dumps(data), status=status, headers=headers,
                        content_type="application/json")


def error_response(message: str, kind: str, status: int, headers=None) -> web.Response:
    return json_response(error_json(message, kind, status), status=status, headers=headers)


async def sse_event(response: web.StreamResponse, data: Any):
    await response.write(b"data: " + dumps(data).encode() + b"\n\n")


class UndecodableBody(ProtocolError):
    """A request body that does not decode as its ``Content-Encoding`` says (HTTP 400; the
    connection is closed after the answer, since the rest of the body cannot be read)."""


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes, announced or not, (408) when it
    takes longer than ``timeout`` seconds to arrive, and (400, :class:`UndecodableBody`) when
    it does not decode as its ``Content-Encoding`` says (aiohttp decompresses it, the limit
    counting decompressed bytes)."""
    size = request.content_length
    if size is not None and size > limit:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=size,
            reason=f"the request body ({size} bytes) is larger than this server's limit of "
                   f"{limit} bytes")
    chunks, total = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                total += len(chunk)
                if total > limit:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limit, actual_size=total,
                        reason=f"the request body is larger than this server's limit of "
                               f"{limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"the request body did not arrive within {timeout:g} s") from None
    except web.RequestPayloadError as e:
        request.content.feed_eof()  # nothing more is read from it (no lingering read)
        encoding = request.headers.get("Content-Encoding", "")
        detail = getattr(e.__cause__, "message", None) or str(e)
        raise UndecodableBody(f"the request body does not decode as its Content-Encoding "
                              f"{encoding[:40]!r} says ({' '.join(str(detail).split())[:200]})"
                              ) from None
    return b"".join(chunks)


def log_refused(request: web.Request, status: int, message: str):
    """One warning line for a refused request (no traceback: the client erred, not the
    server)."""
    log.warning("%d %s %s from %s: %.300s", status, request.method, request.path,
                request.remote, message)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except Overloaded as e:
        return error_response(str(e), "overloaded", 503, headers={"Retry-After": "1"})
    except EngineStopped as e:
        return error_response(str(e), "unavailable", 503)
    except UndecodableBody as e:
        log_refused(request, 400, str(e))
        response = error_response(str(e), "invalid_request_error", 400)
        response.force_close()
        return response
    except (GeneratorError, CheckpointError) as e:
        log_refused(request, 400, str(e))
        return error_response(str(e), "invalid_request_error", 400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "payload_too_large"}.get(e.status, "http_error")
        message = {404: f"no endpoint {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.status,
                                                                                  e.reason)
        log_refused(request, e.status, message)
        return error_response(message, kind, e.status)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("error serving %s %s", request.method, request.path)
        return error_response(f"{type(e).__name__}: {e}", "internal_error", 500)
