"""Control operations a :class:`~rl_jax.generator.client.GeneratorClient` broadcasts to every
server up (pause, resume, abort, flush, weight updates and versions), and the client's errors.

:class:`BroadcastControl` is a mixin of the client: it uses the client's ``servers``, its
``_replay`` (the last weight update and pause, re-applied to a server that comes back up),
``_ensure_started``, ``_request``, ``_mark_down`` and ``check_health``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from rl_jax.generator.types import GeneratorError


class GeneratorRequestError(GeneratorError):
    """A server refused the request (HTTP 4xx); retrying elsewhere would not help."""

    def __init__(self, message: str, *, status: int, url: str):
        super().__init__(f"{url} answered {status}: {message}")
        self.status = status
        self.url = url


class GeneratorUnavailable(RuntimeError):
    """No server could serve the request (all down, or every attempt failed)."""


class ServerLeft(GeneratorUnavailable):
    """The server a request was running on left the pool (removed, or marked down) before it
    answered; the request was abandoned there and may be issued again elsewhere."""

    def __init__(self, message: str, *, url: str):
        super().__init__(message)
        self.url = url


class BroadcastControl:
    """The client's calls to every server (see the module docstring)."""

    async def broadcast(self, method: str, path: str, body: Any = None
                        ) -> dict[str, tuple[int, Any]]:
        """Sends one call to every server marked up; url → (status, body). Unreachable servers
        are marked down (and get the replayed state when they recover)."""
        await self._ensure_started()

        async def one(server):
            try:
                status, data, _ = await self._request(server, method, path, body)
                return status, data
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(server, repr(e))
                return None, repr(e)

        targets = [s for s in self.servers if s.healthy]
        if not targets:
            await self.check_health()
            targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise GeneratorUnavailable(f"{method} {path}: no generator server is up")
        results = dict(zip((s.url for s in targets), await asyncio.gather(*map(one, targets))))
        refused = {url: r for url, r in results.items() if r[0] is not None and r[0] >= 400}
        if refused:
            url, (status, data) = next(iter(refused.items()))
            if all(400 <= r[0] < 500 for r in refused.values()):
                raise GeneratorRequestError(f"{path}: {_message(data)}", status=status, url=url)
            raise GeneratorUnavailable(f"{path} failed on {sorted(refused)}: {_message(data)}")
        if all(r[0] is None for r in results.values()):
            raise GeneratorUnavailable(f"{path}: no server answered: {results}")
        return results

    async def update_weights_from_disk(self, model_path: str | Path, version: int | None = None,
                                       *, abort_all_requests: bool = False,
                                       flush_cache: bool = False) -> int:
        """Every server loads ``model_path`` (a directory each server can read) as ``version``
        (default: the highest current version + 1)."""
        if version is None:
            version = max(v for v in (await self.weight_versions()).values()) + 1
        body = {"model_path": str(model_path), "weight_version": str(int(version)),
                "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
        await self.broadcast("POST", "/update_weights_from_disk", body)
        self._replay["weights"] = ("/update_weights_from_disk", body)
        for s in self.servers:
            if s.healthy:
                s.weight_version = int(version)
        return int(version)

    async def update_weights_from_transfer(self, version: int, *, publisher_url: str | None = None,
                                           wait_s: float = 30.0, transport: str | None = None
                                           ) -> dict[str, int]:
        """Every server up pulls version ``version`` (or newer) from the weight publisher
        (``rl_jax.transfer``) and swaps it in between two decode steps; url → version now
        served. A server that was down pulls it when it comes back."""
        body: dict[str, Any] = {"weight_version": int(version), "wait_s": float(wait_s)}
        if publisher_url:
            body["publisher_url"] = publisher_url
        if transport:
            body["transport"] = transport
        results = await self.broadcast("POST", "/update_weights_from_transfer", body)
        self._replay["weights"] = ("/update_weights_from_transfer", body)
        versions = {}
        for server in self.servers:
            status, data = results.get(server.url, (None, None))
            if status == 200 and isinstance(data, dict) and "weight_version" in data:
                server.weight_version = int(data["weight_version"])
                versions[server.url] = server.weight_version
        return versions

    async def weight_versions(self) -> dict[str, int]:
        """url → weight version of every server up (-1 where it is not an integer)."""
        results = await self.broadcast("GET", "/get_weight_version")
        versions = {}
        for url, (status, data) in results.items():
            if status == 200 and isinstance(data, dict):
                try:
                    versions[url] = int(data.get("weight_version"))
                except (TypeError, ValueError):
                    versions[url] = -1
        return versions

    async def weight_version(self) -> int:
        return min((await self.weight_versions()).values())

    async def pause(self, mode: str = "abort") -> None:
        body = {"mode": mode}
        await self.broadcast("POST", "/pause_generation", body)
        self._replay["pause"] = body

    async def resume(self) -> None:
        self._replay.pop("pause", None)
        await self.broadcast("POST", "/continue_generation", {})

    async def abort(self, rid: str | None = None) -> None:
        await self.broadcast("POST", "/abort_request",
                             {"rid": rid or "", "abort_all": rid is None})

    async def flush_cache(self) -> bool:
        try:
            await self.broadcast("POST", "/flush_cache")
        except GeneratorRequestError:  # a server with running sequences refuses (400)
            return False
        return True


def _message(data: Any) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return f"{data!r:.500}"
