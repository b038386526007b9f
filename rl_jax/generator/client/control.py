"""Control operations a :class:`~rl_jax.generator.client.core.GeneratorClient` broadcasts to every
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

from rl_jax.generator.client.identity import ServerIdentity, identify
from rl_jax.generator.types import GeneratorError

# Where a server reports the weight version it serves, in the order asked: SGLang 0.5 and this
# project's servers in /model_info, older SGLang servers at /get_weight_version.
VERSION_PATHS = ("/model_info", "/get_weight_version")


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

    async def read_version(self, server: Any) -> tuple[int | None, int | None]:
        """``(HTTP status, weight version)`` of one server (a ``ServerState``): ``/model_info``'s
        ``weight_version`` (SGLang 0.5 and this project's servers), else ``/get_weight_version``
        (older SGLang servers, where ``/model_info`` is missing); the version is -1 where it is not
        an integer (SGLang's "default" before any update) and None where the server refused.
        Raises aiohttp/asyncio errors when the server cannot be reached."""
        status = None
        for path in VERSION_PATHS:
            status, data, _ = await self._request(server, "GET", path,
                                                  timeout=self.config.health_timeout)
            if status == 404:
                continue
            if status != 200 or not isinstance(data, dict) or "weight_version" not in data:
                return status, None
            try:
                return status, int(data["weight_version"])
            except (TypeError, ValueError):
                return status, -1
        return status, None

    async def weight_versions(self) -> dict[str, int]:
        """url → weight version of every server up (-1 where it is not an integer); servers that
        cannot be reached are marked down and left out."""
        await self._ensure_started()
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            await self.check_health()
            targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise GeneratorUnavailable("weight versions: no generator server is up")

        async def one(server):
            try:
                return await self.read_version(server)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_down(server, repr(e))
                return None, None

        results = await asyncio.gather(*map(one, targets))
        refused = [(s.url, status) for s, (status, _) in zip(targets, results)
                   if status is not None and status != 200]
        if refused:
            url, status = refused[0]
            if 400 <= status < 500:
                raise GeneratorRequestError(f"{VERSION_PATHS[0]}: refused", status=status,
                                            url=url)
            raise GeneratorUnavailable(f"weight versions: {refused} answered with an error")
        versions = {s.url: v for s, (_, v) in zip(targets, results) if v is not None}
        if not versions:
            raise GeneratorUnavailable("weight versions: no server answered")
        return versions

    async def identify_servers(self) -> dict[str, ServerIdentity]:
        """url → :class:`~rl_jax.generator.client.identity.ServerIdentity` of every server up,
        from its ``/server_info``; raises ``UnsupportedServer`` for an SGLang release this
        project does not support. Kept on each server's state (seeded requests sent to a server
        that ignores seeds are reported once)."""
        results = await self.broadcast("GET", "/server_info")
        found = {url: identify(data, url) for url, (status, data) in results.items()
                 if status == 200}
        for server in self.servers:
            if server.url in found:
                server.identity = found[server.url]
        return found

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
