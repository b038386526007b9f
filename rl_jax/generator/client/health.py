"""Health of the servers a :class:`~rl_jax.generator.client.core.GeneratorClient` talks to:
probes every ``health_check_interval`` for healthy servers and every ``down_retry_interval`` for
servers marked down; a server that comes back gets the last weight update and pause again before
it takes a request (a restarted server never serves stale weights). A mixin of the client: it
uses the client's ``servers``, ``config``, ``stats``, ``_request`` and ``_replay``."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

HEALTH_TICK_S = 0.05


class HealthChecks:
    """Probing, marking down and recovering servers (see the module docstring)."""

    def _mark_down(self, server: Any, reason: str):
        if server.healthy:
            log.warning("generator server %s is down: %s", server.url, reason)
            self.stats["marked_down"] += 1
            self._signal_lost(server.url)  # its requests in flight go elsewhere
        server.healthy = False
        server.failures += 1
        server.next_probe = time.monotonic() + self.config.down_retry_interval

    def _probe_soon(self, server: Any):
        server.next_probe = time.monotonic()

    async def _probe(self, server: Any) -> bool:
        lock = self._probe_locks.setdefault(server.url, asyncio.Lock())
        if lock.locked():  # a probe (maybe restoring weights) is under way: share its result
            async with lock:
                return server.healthy
        async with lock:
            return await self._probe_unlocked(server)

    async def _probe_unlocked(self, server: Any) -> bool:
        try:
            status, data, _ = await self._request(server, "GET", "/health",
                                                  timeout=self.config.health_timeout)
            ok = status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, data = False, repr(e)
        if ok and not server.healthy:
            ok = await self._recover(server)
            if ok:
                log.warning("generator server %s is back up", server.url)
                self.stats["recovered"] += 1
        if ok:
            server.healthy, server.failures = True, 0
            server.next_probe = time.monotonic() + self.config.health_check_interval
        else:
            self._mark_down(server, f"health check failed: {data!r:.200}")
        return ok

    async def _recover(self, server: Any) -> bool:
        """Re-applies the last weight update and pause to a server that was down."""
        try:
            weights = self._replay.get("weights")
            if weights is not None:
                path, weights = weights
                status, current = await self.read_version(server)
                behind = path == "/update_weights_from_transfer" and isinstance(current, int) \
                    and current >= int(weights["weight_version"])
                if status != 200 or (str(current) != str(weights["weight_version"])
                                     and not behind):
                    status, data, _ = await self._request(server, "POST", path, weights)
                    if status != 200:
                        log.error("cannot restore weights on %s: %s", server.url, data)
                        return False
            pause = self._replay.get("pause")
            if pause is not None:
                status, _, _ = await self._request(server, "POST", "/pause_generation", pause)
                if status != 200:
                    return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        return True

    async def _health_loop(self):
        while True:
            now = time.monotonic()
            due = [s for s in self.servers if s.next_probe <= now]
            if due:
                await asyncio.gather(*(self._probe(s) for s in due))
            # Short ticks (no asyncio.wait_for: cancelling it can hang on Python 3.11) so that a
            # probe scheduled by a failure runs within HEALTH_TICK_S.
            wait = min(s.next_probe for s in self.servers) - time.monotonic()
            await asyncio.sleep(min(max(wait, 0.0), HEALTH_TICK_S))

    async def check_health(self) -> dict[str, bool]:
        """Probes every server now; url → healthy."""
        await self._ensure_started()
        results = await asyncio.gather(*(self._probe(s) for s in self.servers))
        return {s.url: ok for s, ok in zip(self.servers, results)}
