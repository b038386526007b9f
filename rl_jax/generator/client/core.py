"""Async HTTP client for a pool of generator servers (this project's or real SGLang servers).

:class:`GeneratorClient` implements :class:`~rl_jax.generator.base.Generator` over N servers:

- one pooled ``aiohttp.ClientSession`` (keep-alive connections to every server);
- least-outstanding-requests balancing (ties rotate), counted from this client's view;
- health checks (:mod:`rl_jax.generator.client.health`): every ``health_check_interval`` for
  healthy servers, every ``down_retry_interval`` for servers marked down; a connection error or
  timeout marks a server down at once, a 5xx schedules an immediate probe; a malformed answer
  (token ids outside the vocabulary, log-probs above 0, lengths that disagree) marks it down and
  the request goes to another server, and after ``max_malformed`` of them it gets no more;
- a request that fails on one server (connection error, timeout, 5xx, 503 overload) is retried
  on another, up to ``max_attempts`` in all; when no server is up, it waits up to
  ``unavailable_wait_s`` for one to come back; a 4xx is the request's fault and is raised at once
  as :class:`GeneratorRequestError` (never retried);
- API keys (``keys``, :class:`~rl_jax.generator.auth.Keys`): each request carries the key its
  endpoint needs as ``Authorization: Bearer`` (SGLang's convention, also understood by real
  SGLang servers and their router): the admin key for endpoints that change a server, the API key
  for the others; a refusal (401/403) is a :class:`GeneratorRequestError`;
- control operations (pause, resume, abort, flush, weight updates) are broadcast to every
  server (:mod:`rl_jax.generator.client.control`, with the client's errors). The last weight update
  and pause are re-applied to a server that comes back up, so a
  restarted server does not serve stale weights;
- membership can change while requests run (:meth:`GeneratorClient.add_server`,
  :meth:`GeneratorClient.remove_server`, from any thread): a request in flight on a server that
  is removed or marked down is abandoned at once (aborted there when it still answers) and
  raised as :class:`ServerLeft`, for its caller to issue again elsewhere under a new request id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from rl_jax.generator.auth import NO_KEYS, Keys
from rl_jax.generator.base import Generator
from rl_jax.generator.client.control import (BroadcastControl, GeneratorRequestError,
                                             GeneratorUnavailable, ServerLeft, _message)
from rl_jax.generator.client.health import HealthChecks
from rl_jax.generator.client.identity import ServerIdentity, warn_if_seed_ignored
from rl_jax.generator.protocol import request_json
from rl_jax.generator.responses import outputs_from_json
from rl_jax.generator.types import GenerateOutput, GenerateRequest, GeneratorError

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ClientConfig:
    request_timeout: float = 3600.0  # s, one /generate attempt (long completions are slow)
    control_timeout: float = 600.0  # s, control calls (a weight load can take minutes)
    connect_timeout: float = 5.0  # s
    max_attempts: int = 3  # per request, across servers
    retry_backoff: float = 0.1  # s before the 2nd attempt, doubling after
    health_check_interval: float = 10.0  # s between probes of healthy servers
    down_retry_interval: float = 1.0  # s between probes of servers marked down
    health_timeout: float = 5.0  # s
    max_connections: int = 0  # total pooled connections (0: unlimited)
    # s a request waits for a server to come back when none is up (a loaded host's health probes
    # time out and mark every server down for a moment) before it fails
    unavailable_wait_s: float = 60.0
    vocab_size: int = 0  # token ids in answers must be below it (0: not checked)
    # A server whose answers were malformed this many times (token ids outside the vocabulary,
    # log-probs above 0 or not numbers, lengths that disagree) gets no more requests.
    max_malformed: int = 3


@dataclasses.dataclass
class ServerState:
    url: str
    healthy: bool = True
    outstanding: int = 0  # requests this client has in flight there
    served: int = 0  # requests answered 200
    failures: int = 0  # consecutive failed attempts or probes
    next_probe: float = 0.0  # time.monotonic() of the next health check
    weight_version: int | None = None  # as last seen
    identity: ServerIdentity | None = None  # once identify_servers() has read it
    seed_warned: bool = False
    malformed: int = 0  # malformed answers; at ClientConfig.max_malformed it is not trusted


class GeneratorClient(HealthChecks, BroadcastControl, Generator):
    """:class:`Generator` over HTTP servers speaking SGLang's API.

    Use as ``async with GeneratorClient(urls) as client: ...`` (or call :meth:`close`). The
    session and health checker start on first use, inside the running event loop.
    """

    def __init__(self, urls: Sequence[str], config: ClientConfig = ClientConfig(), *,
                 keys: Keys = NO_KEYS):
        if not urls:
            raise ValueError("GeneratorClient needs at least one server url")
        self.config = config
        self.keys = keys
        self._headers: dict[str, dict[str, str]] = {}  # path -> authorization headers
        self.servers = [ServerState(url.rstrip("/")) for url in urls]
        self.stats: collections.Counter = collections.Counter()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._rotation = itertools.count()
        # "weights" -> (path, body) of the last weight update; "pause" -> last pause body
        self._replay: dict[str, Any] = {}
        self._probe_locks: dict[str, asyncio.Lock] = {}
        # url -> set when that server leaves (removed or marked down); replaced after
        self._lost: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task] = set()

    # ---- membership -----------------------------------------------------------------------------

    def add_server(self, url: str, *, healthy: bool = True) -> ServerState:
        """Adds the server ``url`` (callable from any thread). ``healthy=False``: it takes no
        request until a health probe passes, which first re-applies the last weight update and
        pause (see :meth:`join`)."""
        url = url.rstrip("/")
        if any(s.url == url for s in self.servers):
            raise ValueError(f"generator server {url} is already in the pool")
        server = ServerState(url, healthy=healthy)
        if not healthy:
            server.next_probe = time.monotonic()
        self.servers = [*self.servers, server]  # one assignment: readers see old or new list
        return server

    def remove_server(self, url: str) -> int:
        """Removes the server ``url`` (callable from any thread); its requests in flight raise
        :class:`ServerLeft` in their callers. Returns how many there were."""
        url = url.rstrip("/")
        gone = [s for s in self.servers if s.url == url]
        if not gone:
            raise KeyError(f"generator server {url} is not in the pool")
        if len(self.servers) == 1:
            raise ValueError(f"generator server {url} is the last one of the pool")
        self.servers = [s for s in self.servers if s.url != url]
        self._signal_lost(url)
        return gone[0].outstanding

    async def join(self, url: str) -> ServerState:
        """Adds the server ``url`` and brings it to this pool's state before it takes a request:
        the last weight update and pause are applied to it by the health probe; raises
        :class:`GeneratorUnavailable` (and leaves it out) when that fails."""
        await self._ensure_started()
        server = self.add_server(url, healthy=False)
        if not await self._probe(server):
            self.servers = [s for s in self.servers if s is not server]
            raise GeneratorUnavailable(f"generator server {server.url} did not answer /health "
                                       "or could not take the pool's current weights")
        return server

    async def call(self, url: str, method: str, path: str, body: Any = None
                   ) -> tuple[int, Any]:
        """One request to the server ``url`` (in the pool or not) with this client's keys;
        ``(status, JSON or text body)``. Raises aiohttp/asyncio errors on transport failure."""
        status, data, _ = await self._request(ServerState(url.rstrip("/")), method, path, body,
                                              timeout=self.config.health_timeout)
        return status, data

    def _signal_lost(self, url: str):
        """Wakes the requests in flight on ``url`` (from any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def wake():
            event = self._lost.pop(url, None)
            if event is not None:
                event.set()

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            wake()
        else:
            loop.call_soon_threadsafe(wake)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def _ensure_started(self) -> aiohttp.ClientSession:
        self._loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections),
                timeout=aiohttp.ClientTimeout(total=None))
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.create_task(self._health_loop())
        return self._session

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._probe_locks.clear()

    # ---- HTTP -----------------------------------------------------------------------------------

    async def _request(self, server: ServerState, method: str, path: str, body: Any = None,
                       timeout: float | None = None) -> tuple[int, Any, dict[str, str]]:
        """(status, JSON or text body, headers); raises aiohttp/asyncio errors on transport
        failure."""
        session = await self._ensure_started()
        timeout = aiohttp.ClientTimeout(total=timeout or self.config.control_timeout,
                                        sock_connect=self.config.connect_timeout)
        headers = self._headers.get(path)
        if headers is None:
            headers = self._headers[path] = self.keys.headers_for(path)
        async with session.request(method, server.url + path, json=body, headers=headers,
                                   timeout=timeout) as response:
            text = await response.text()
            try:
                data = await response.json(content_type=None) if text else None
            except ValueError:
                data = text
            return response.status, data, dict(response.headers)

    # ---- generate -------------------------------------------------------------------------------

    def _pick(self, exclude: set[str]) -> ServerState | None:
        healthy = [s for s in self.servers
                   if s.healthy and s.malformed < self.config.max_malformed]
        candidates = [s for s in healthy if s.url not in exclude] or healthy
        if not candidates:
            return None
        start = next(self._rotation) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda s: s.outstanding)

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """The ``n`` completions of ``request``, from the least-loaded healthy server."""
        await self._ensure_started()
        if request.rid is None:
            request = dataclasses.replace(request, rid=uuid.uuid4().hex)
        return (await self._post(request_json(request), [request.rid],
                                 lambda data: [outputs_from_json(
                                     data, request, self.config.vocab_size)]))[0]

    async def generate_batch(self, requests: Sequence[GenerateRequest]
                             ) -> list[list[GenerateOutput]]:
        """Completions of several prompts in one SGLang batch request: one HTTP exchange with
        one server (the least loaded; another one if it fails), whose answer lists each prompt's
        ``n`` completions in turn (prompts asking for different ``n`` go in one batch per ``n``,
        as SGLang needs). In request order."""
        if len(requests) <= 1:
            return [await self.generate(r) for r in requests]
        by_n: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_n.setdefault(r.sampling.n, []).append(i)
        if len(by_n) > 1:
            # SGLang refuses a batch whose prompts ask for different n ("The parallel_sample_num
            # should be the same for all samples"): one batch per n, side by side.
            groups = list(by_n.values())
            answers = await asyncio.gather(*(self.generate_batch([requests[i] for i in g])
                                             for g in groups))
            out: list[list[GenerateOutput]] = [[] for _ in requests]
            for g, answer in zip(groups, answers):
                for i, outputs in zip(g, answer):
                    out[i] = outputs
            return out
        await self._ensure_started()
        requests = [r if r.rid is not None else dataclasses.replace(r, rid=uuid.uuid4().hex)
                    for r in requests]
        if len({r.rid for r in requests}) != len(requests):
            raise GeneratorError(f"duplicate request ids in a batch: {[r.rid for r in requests]}")
        bodies = [request_json(r) for r in requests]
        body = {"input_ids": [b["input_ids"] for b in bodies],
                "sampling_params": [b["sampling_params"] for b in bodies],
                "rid": [r.rid for r in requests], "return_logprob": True}

        def split(data: Any) -> list[list[GenerateOutput]]:
            items = data if isinstance(data, list) else [data]
            want = sum(r.sampling.n for r in requests)
            if len(items) != want:
                raise GeneratorError(f"expected {want} completions for a batch of "
                                     f"{len(requests)} prompts, got {len(items)}")
            out, i = [], 0
            for r in requests:
                out.append(outputs_from_json(items[i:i + r.sampling.n], r,
                                             self.config.vocab_size))
                i += r.sampling.n
            return out

        return await self._post(body, [r.rid for r in requests], split)

    async def _post(self, body: dict[str, Any], rids: list[str],
                    parse: Callable[[Any], list[list[GenerateOutput]]]
                    ) -> list[list[GenerateOutput]]:
        """POSTs ``body`` (the prompts ``rids``) to ``/generate`` on the least-loaded healthy
        server, moving to another one on a connection failure, a timeout, overload or a server
        error; returns ``parse(answer)``, the outputs of each prompt."""
        tried: set[str] = set()
        problems: list[str] = []
        backoff = self.config.retry_backoff
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(backoff)
                backoff *= 2
            server = self._pick(tried) or await self._wait_for_a_server(tried)
            if server is None:
                problems.append(f"no healthy server within {self.config.unavailable_wait_s} s")
                continue
            tried.add(server.url)
            warn_if_seed_ignored(server, body)
            server.outstanding += 1
            self.stats["attempts"] += 1
            try:
                status, data, headers = await self._watched(server, body, rids)
            except asyncio.TimeoutError:
                problems.append(f"{server.url}: timed out after {self.config.request_timeout} s")
                # Free the rids there before a retry could land on the same server.
                for rid in rids:
                    await self._abort_on(server, rid)
                self._probe_soon(server)
                continue
            except (aiohttp.ClientError, OSError) as e:
                problems.append(f"{server.url}: {e!r}")
                self._mark_down(server, repr(e))
                if not isinstance(e, aiohttp.ClientConnectorError):
                    # The request may have reached the server before the connection broke:
                    # free its rids there, or a retry landing there again is refused as a
                    # duplicate while the first attempt still runs.
                    for rid in rids:
                        await self._abort_on(server, rid)
                continue
            finally:
                server.outstanding -= 1
            if status == 200:
                try:
                    result = parse(data)
                except GeneratorError as e:  # garbage from this server: try another one
                    server.malformed += 1
                    problems.append(f"{server.url}: malformed answer: {e}")
                    self._mark_down(server, f"malformed answer ({server.malformed}): {e}")
                    continue
                server.served += 1
                server.failures = 0
                for outputs in result:
                    if outputs and outputs[0].output_versions:
                        server.weight_version = max(outputs[0].output_versions)
                return result
            message = _message(data)
            if status == 503:
                self.stats["overloaded"] += 1
                problems.append(f"{server.url}: overloaded ({message})")
                backoff = max(backoff, _retry_after(headers))
                continue
            if status >= 500:
                problems.append(f"{server.url}: {status} {message}")
                self._probe_soon(server)
                continue
            raise GeneratorRequestError(message, status=status, url=server.url)
        self.stats["failed"] += 1
        what = f"request {rids[0]}" if len(rids) == 1 else f"batch {rids}"
        raise GeneratorUnavailable(f"{what} failed after {self.config.max_attempts} attempts: "
                                   f"{'; '.join(problems)}")

    async def _wait_for_a_server(self, tried: set[str]) -> ServerState | None:
        """Probes every server until one is up, for at most ``unavailable_wait_s``."""
        deadline = time.monotonic() + self.config.unavailable_wait_s
        while True:
            await asyncio.gather(*(self._probe(s) for s in self.servers))
            server = self._pick(tried)
            if server is not None or time.monotonic() >= deadline:
                return server
            self.stats["waited_for_a_server"] += 1
            await asyncio.sleep(min(self.config.down_retry_interval,
                                    max(deadline - time.monotonic(), 0.0)))

    async def _watched(self, server: ServerState, body: dict[str, Any], rids: list[str]
                       ) -> tuple[int, Any, dict[str, str]]:
        """POSTs ``body`` to ``server``'s ``/generate`` unless the server leaves first: then the
        request is abandoned (its rids aborted there in the background) and :class:`ServerLeft`
        raised."""
        what = f"request {rids[0]}" if len(rids) == 1 else f"batch {rids}"
        if all(s is not server for s in self.servers):  # removed by another thread just now
            raise ServerLeft(f"generator server {server.url} left the pool before {what} was "
                             "sent", url=server.url)
        lost = self._lost.setdefault(server.url, asyncio.Event())
        request = asyncio.ensure_future(self._request(server, "POST", "/generate", body,
                                                      timeout=self.config.request_timeout))
        watcher = asyncio.ensure_future(lost.wait())
        left = False
        try:
            await asyncio.wait((request, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not request.done():
                left = True
                request.cancel()
        if left:
            self.stats["abandoned"] += 1
            task = asyncio.ensure_future(asyncio.gather(*(self._abort_on(server, rid)
                                                          for rid in rids)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise ServerLeft(f"generator server {server.url} left the pool while {what} ran "
                             "there", url=server.url)
        return request.result()

    async def _abort_on(self, server: ServerState, rid: str):
        try:
            await self._request(server, "POST", "/abort_request", {"rid": rid},
                                timeout=self.config.health_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-server state as this client sees it (for logs and tests)."""
        return [dataclasses.asdict(s) for s in self.servers]


def _retry_after(headers: dict[str, str]) -> float:
    try:
        return min(float(headers.get("Retry-After", 0)), 30.0)
    except ValueError:
        return 0.0
