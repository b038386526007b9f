"""The run's generator fleet: servers join and leave while the trainer runs.

A server joins (:meth:`Fleet.join`) once it answers ``/health``, takes the run's API and admin
keys, and runs the newest weight version every other server runs: the last weight update is
applied to it (the same call that brings a restarted server back, so this project's servers
pull the version from the publisher and SGLang's load it from disk) before the rollout may send
it a request. It joins between two weight updates (under ``WeightSync.membership``), so every
later update reaches it and the staleness gate's generator version counts it from then on.

A server leaves (:meth:`Fleet.leave`) at once: the rollout sends it nothing more, the groups in
flight there are issued again on the others under new request ids (their late completions, if
any, are dropped: :class:`~rl_jax.rollout.attempts.Attempts`), and weight updates stop going to
it. A server that dies is handled by the clients the same way (its requests are issued again)
without leaving: it takes requests again once it answers and runs the current weights.

Sources of membership changes:

* the control routes (:meth:`Fleet.routes`), served by the weight publisher's control server and
  authenticated with the generator servers' admin key (their API key where they have no admin
  key, the publisher's transfer token where they have no keys)::

      POST   /v1/generators {"url": "http://HOST:PORT"[, "timeout_s": S]}
             → 200 {"url", "weight_version", "pool_version", "members"} once it runs the
               newest version the others run (pool_version) or a newer one
      DELETE /v1/generators {"url": "http://HOST:PORT"}   (or ?url=...)
             → 200 {"url", "reissued", "members"}
      GET    /v1/generators → {"members", "events"}

* a real ``sglang-router`` (``generator.router_url``,
  :class:`~rl_jax.orchestrator.router.RouterWorkers`): the rollout's requests go through the
  router, weight updates to each worker. A worker someone adds to the router is taken out of it
  until it runs the newest weights, then put back (joined); one removed from the router leaves.
  A join or leave through the control routes adds the worker to the router or removes it. The
  requests in flight on a worker that leaves finish there, or fail and are retried through the
  router (the router, not this run, knows where each one runs).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import urllib.parse
from typing import Any

import aiohttp

from rl_jax.generator.client.control import GeneratorUnavailable
from rl_jax.generator.client.core import GeneratorClient, ServerState
from rl_jax.orchestrator.router import RouterError, RouterWorkers
from rl_jax.transfer.control import HTTPStatus

log = logging.getLogger(__name__)

MAX_URL_CHARS = 2048
MAX_JOIN_S = 3600.0
JOIN_FIELDS = frozenset({"url", "timeout_s"})
LEAVE_FIELDS = frozenset({"url"})
MAX_EVENTS = 1000  # membership changes kept for the summary


def server_url(value: Any, field: str = "url") -> str:
    """``value`` as ``http(s)://host:port`` (lower-case host, no trailing slash); 400 naming
    ``field`` unless it is such a URL (no user, path, query or fragment)."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_URL_CHARS:
        raise HTTPStatus(400, f"field {field!r} must be a generator server URL "
                              f"http(s)://HOST:PORT of at most {MAX_URL_CHARS} characters, got "
                              f"{str(value)[:80]!r}")
    parts = urllib.parse.urlsplit(value.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port \
            or parts.username or parts.password or parts.path not in ("", "/") \
            or parts.query or parts.fragment or not value.isascii():
        raise HTTPStatus(400, f"field {field!r} must be a generator server URL "
                              f"http(s)://HOST:PORT, got {value[:80]!r}")
    host = parts.hostname.lower()
    return f"{parts.scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def _only(body: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HTTPStatus(400, f"unknown field {unknown[0][:80]!r} (accepted: "
                              f"{sorted(allowed)})")


class Fleet:
    """Membership of the run's generator servers (see the module docstring).

    Args:
      control: the client for weight updates and control calls (on ``loop``).
      loop: the :class:`~rl_jax.orchestrator.pool.BackgroundLoop` running ``control``.
      rollout_client: the client the rollout sends requests with (its own loop); membership
        changes reach it from any thread.
      weights: the run's :class:`~rl_jax.orchestrator.weights.WeightSync`.
      pool: the :class:`~rl_jax.orchestrator.pool.GeneratorPool` (its watchdog stops
        restarting a server that left).
      router: the ``sglang-router`` the rollout sends requests through (None: the rollout
        client holds the servers themselves).
      poll_s: seconds between two reads of the router's worker list.
      joins_refused: why no server may join this run (None: servers may join).
    """

    def __init__(self, control: GeneratorClient, loop: Any, rollout_client: GeneratorClient,
                 weights: Any, pool: Any = None, router: RouterWorkers | None = None,
                 poll_s: float = 2.0, joins_refused: str | None = None):
        self.control, self.loop, self.rollout_client = control, loop, rollout_client
        self.joins_refused = joins_refused
        self.weights, self.pool, self.router, self.poll_s = weights, pool, router, poll_s
        self.events: list[dict[str, Any]] = []
        self.served: dict[str, int] = {}  # requests answered by servers that left
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._joining: str | None = None  # a server being brought to the weights
        self._pool_version = 0  # the version every member ran at the last join

    def start(self) -> "Fleet":
        """With a router: puts the members it does not list into it, then follows its worker
        list (every ``poll_s``)."""
        if self.router is not None and self._poller is None:
            listed = self.router.workers()
            for url in self.members:
                if url not in listed:
                    self.router.add(url)
            self._poller = threading.Thread(target=self._poll, name="fleet-router",
                                            daemon=True)
            self._poller.start()
        return self

    def close(self):
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=30)

    def _poll(self):
        while not self._stop.wait(self.poll_s):
            try:
                self.follow_router()
            except RouterError as e:
                log.warning("generator fleet: %s", e)

    def follow_router(self) -> None:
        """One read of the router's worker list: healthy workers it lists that are not members
        join; members it no longer lists leave."""
        with self._lock:
            listed = self.router.workers()
            members = set(self.members)
            for url, worker in listed.items():
                if url not in members and worker.get("is_healthy") and not self._stop.is_set():
                    try:
                        self.join(url, source="router")
                    except HTTPStatus as e:
                        log.error("worker %s of the router cannot join the run (left out of "
                                  "the router): %s", url, e.message)
            for url in sorted(members - set(listed)):
                try:
                    self.leave(url, source="router")
                except HTTPStatus as e:
                    log.error("worker %s left the router: %s", url, e.message)

    @property
    def members(self) -> list[str]:
        """The servers that joined (not one still taking the weights)."""
        return [s.url for s in self.control.servers if s.url != self._joining]

    # ---- join and leave -------------------------------------------------------------------------

    def join(self, url: str, timeout_s: float | None = None, *, source: str = "control"
             ) -> dict[str, Any]:
        """Adds the server ``url`` once it runs the newest weights (see the module docstring);
        raises :class:`HTTPStatus` (409 already a member, 502 unusable, 504 too slow)."""
        url = server_url(url)
        timeout_s = self.weights.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if url in self.members:
                raise HTTPStatus(409, f"generator server {url} is already in the pool")
            if self.joins_refused:
                raise HTTPStatus(409, f"generator server {url} cannot join: "
                                      f"{self.joins_refused}")
            start = time.perf_counter()
            self._joining = url
            try:
                version = self._join(url, timeout_s)
            finally:
                self._joining = None
            self._record("join", url, source=source, weight_version=version,
                         seconds=round(time.perf_counter() - start, 3))
        log.warning("generator server %s joined at weight version %d (%d servers)", url,
                    version, len(self.members))
        return {"url": url, "weight_version": version, "pool_version": self._pool_version,
                "members": self.members}

    def _join(self, url: str, timeout_s: float) -> int:
        """The steps of :meth:`join` (caller holds the lock); the server's weight version."""
        self._router_call("remove", url)  # no requests through the router until it joined
        self._check_server(url, timeout_s)
        with self.weights.membership:  # between two weight updates
            want = self._pool_version = self.weights.applied or 0
            try:
                self.loop.run(self.control.join(url), timeout=timeout_s)
                version = self.loop.run(self._version(url), timeout=timeout_s)
            except (GeneratorUnavailable, TimeoutError, asyncio.TimeoutError,
                    aiohttp.ClientError, OSError) as e:
                self._drop(url)
                status = 504 if isinstance(e, (TimeoutError, asyncio.TimeoutError)) else 502
                raise HTTPStatus(status, f"generator server {url} could not join: "
                                         f"{type(e).__name__}: {str(e)[:300]}") from None
            if version is None or version < want:
                self._drop(url)
                raise HTTPStatus(502, f"generator server {url} runs weight version "
                                      f"{version}, not the run's {want} (it could not take "
                                      "the last update; is it serving the run's model?)")
            if self.router is None:
                self.rollout_client.add_server(url)
            else:
                try:
                    self._router_call("add", url)
                except HTTPStatus:
                    self._drop(url)
                    raise
        return version

    def leave(self, url: str, *, source: str = "control") -> dict[str, Any]:
        """Removes the server ``url``; its groups in flight are issued again on the others.
        Raises :class:`HTTPStatus` (404 not a member, 409 the last one)."""
        url = server_url(url)
        with self._lock:
            if url not in self.members:
                raise HTTPStatus(404, f"generator server {url} is not in the pool "
                                      f"(members: {self.members})")
            if len(self.members) == 1:
                raise HTTPStatus(409, f"generator server {url} is the run's last one; add "
                                      "another before removing it")
            self._router_call("remove", url)
            with self.weights.membership:
                served = {s.url: s.served for s in self.control.servers}.get(url, 0)
                reissued = 0
                if self.router is None:
                    served = {s.url: s.served for s in self.rollout_client.servers}[url]
                    reissued = self.rollout_client.remove_server(url)
                self.control.remove_server(url)
            self.served[url] = self.served.get(url, 0) + served
            if self.pool is not None:
                self.pool.release(url)
            self._record("leave", url, source=source, reissued=reissued)
        log.warning("generator server %s left (%d requests in flight there issued again; %d "
                    "servers)", url, reissued, len(self.members))
        return {"url": url, "reissued": reissued, "members": self.members}

    def _check_server(self, url: str, timeout_s: float) -> None:
        """502 unless ``url`` answers /health and takes the run's API and admin keys."""
        checks = (("GET", "/health", None, "health"),
                  ("GET", "/model_info", None, "API key"),
                  ("POST", "/abort_request", {"rid": f"join-check-{time.monotonic_ns()}"},
                   "admin key"))
        for method, path, body, what in checks:
            try:
                status, data = self.loop.run(self.control.call(url, method, path, body),
                                             timeout=min(timeout_s, 60.0))
            except (TimeoutError, asyncio.TimeoutError, aiohttp.ClientError, OSError) as e:
                raise HTTPStatus(502, f"generator server {url} unreachable at {path}: "
                                      f"{type(e).__name__}: {str(e)[:200]}") from None
            if status in (401, 403):
                raise HTTPStatus(502, f"generator server {url} refused the run's {what} "
                                      f"(HTTP {status} at {path}): start it with the run's keys")
            if status != 200:
                raise HTTPStatus(502, f"generator server {url} answered {status} at {path}: "
                                      f"{str(data)[:200]}")

    async def _version(self, url: str) -> int | None:
        status, version = await self.control.read_version(ServerState(url))
        return version if status == 200 else None

    def _router_call(self, action: str, url: str) -> None:
        """``router.add(url)`` or ``router.remove(url)`` when there is a router; 502 when it
        fails."""
        if self.router is None:
            return
        try:
            getattr(self.router, action)(url)
        except RouterError as e:
            raise HTTPStatus(502, f"could not {action} worker {url} at the router: {e}") \
                from None

    def _drop(self, url: str) -> None:
        try:
            self.control.remove_server(url)
        except (KeyError, ValueError):
            pass

    def _record(self, action: str, url: str, **extra: Any) -> None:
        self.events.append({"action": action, "url": url, "time": time.time(),
                            "trainer_version": self.weights.published, **extra})
        del self.events[:-MAX_EVENTS]

    def summary(self) -> dict[str, Any]:
        """Members, membership changes and requests answered per server (for summary.json)."""
        served = dict(self.served)
        if self.router is None:
            for s in self.rollout_client.servers:
                served[s.url] = served.get(s.url, 0) + s.served
        return {"members": self.members, "events": list(self.events), "served": served,
                "router": None if self.router is None else self.router.url}

    # ---- control routes
    # ---------------------------------------------------------------------------

    @staticmethod
    def starting_routes() -> dict[tuple[str, str], Any]:
        """The control routes' answers while the run starts (its servers still being brought to
        the trainer's weights): 503, to be tried again, for a caller holding the right key."""
        def starting(query: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
            raise HTTPStatus(503, "the run is starting: servers join and leave once its own "
                                  "servers run the trainer's weights; try again",
                             retry_after_s=2)
        return {(method, "/v1/generators"): starting for method in ("POST", "DELETE", "GET")}

    def routes(self) -> dict[tuple[str, str], Any]:
        """The control routes (see the module docstring) for the publisher's control server."""
        return {("POST", "/v1/generators"): self._route_join,
                ("DELETE", "/v1/generators"): self._route_leave,
                ("GET", "/v1/generators"): self._route_list}

    def _route_join(self, query: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        _only(body, JOIN_FIELDS)
        if query:
            raise HTTPStatus(400, f"query value {sorted(query)[0][:80]!r} is not accepted; "
                                  "send the fields as a JSON body")
        timeout = body.get("timeout_s", self.weights.timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not math.isfinite(timeout) or not 0 < timeout <= MAX_JOIN_S:
            raise HTTPStatus(400, f"field 'timeout_s' must be a number of seconds in (0, "
                                  f"{MAX_JOIN_S:g}], got {str(timeout)[:40]!r}")
        if "url" not in body:
            raise HTTPStatus(400, "field 'url' is required (the generator server to add)")
        return self.join(body["url"], float(timeout))

    def _route_leave(self, query: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        _only(body, LEAVE_FIELDS)
        extra = sorted(set(query) - LEAVE_FIELDS)
        if extra:
            raise HTTPStatus(400, f"unknown query value {extra[0][:80]!r} (accepted: ['url'])")
        if "url" in body and "url" in query:
            raise HTTPStatus(400, "field 'url' given twice (body and query)")
        if "url" not in body and "url" not in query:
            raise HTTPStatus(400, "field 'url' is required (the generator server to remove)")
        return self.leave(body["url"] if "url" in body else query["url"])

    def _route_list(self, query: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
        return {"members": self.members, "events": list(self.events)}
