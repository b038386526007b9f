"""SGLang's distributed weight-update endpoints on this project's server, answering as SGLang
0.5.23 does, so that one sender (:class:`rl_jax.transfer.sglang.broadcast.SGLangWeightSender`)
drives
either server:

  POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size,
                                         group_name, backend}: joins the group (this server
                                         takes one rank whatever its mesh); 400 "already been
                                         created" for a name it holds
  POST /destroy_weights_update_group    {group_name}; 400 "does not exist" for an unknown one
  POST /begin_weight_update             opens the update session (400 when one is open)
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version,
                                         flush_cache, abort_all_requests}: only inside a
                                         session; receives one bucket of broadcast tensors
  POST /end_weight_update               closes the session (400 when none is open)

A bucket whose names, shapes or dtypes do not match the model, or that names an unknown group
or comes outside a session, is refused at once (400 with the reason) without taking part in its
broadcasts, so the sender stops within a poll. Where SGLang loads each bucket as it arrives,
this server assembles a whole version and swaps it in between two decode steps once its last
tensor is in (never a half-updated model, with or without a pause); the engine checks it as it
checks every update (finite values, dtypes, a version that does not go back). Answers are
``{"success", "message"}`` like SGLang's, 200 or 400. torch (gloo) is needed only when these
endpoints are called.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from rl_jax.generator.engine.weights import SWAP_TIMEOUT_S, wait_for_swap
from rl_jax.generator.json_body import ProtocolError
from rl_jax.generator.server.httpio import error_response, json_response
from rl_jax.generator.server.weight_endpoints import parse_version

log = logging.getLogger("rl_jax.generator.server")  # one logger for the server's modules

JOIN_TIMEOUT_S = 300.0


def _answer(success: bool, message: str, **extra: Any) -> web.Response:
    return json_response({"success": success, "message": message, **extra},
                         status=200 if success else 400)


def _string(body: dict[str, Any], name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ProtocolError(f"{name} must be a non-empty string of at most 256 characters, "
                            f"got {value!r:.60}")
    return value


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}], got {value!r:.60}")
    return value


class DistributedWeightEndpoints:
    """The endpoints above, for ``server`` (a ``GeneratorServer``: its engine, JSON body
    reader, liveness check, update lock and ``_install``)."""

    def __init__(self, server: Any):
        self.server = server
        # rl_jax.transfer.sglang.receiver.DistributedWeightReceiver, made on first use
        self._receiver = None
        self.session_open = False

    def routes(self) -> list[tuple[str, Any]]:
        return [("/init_weights_update_group", self.init_group),
                ("/destroy_weights_update_group", self.destroy_group),
                ("/begin_weight_update", self.begin),
                ("/end_weight_update", self.end),
                ("/update_weights_from_distributed", self.update)]

    def receiver(self):
        if self._receiver is None:
            from rl_jax.transfer.sglang.receiver import DistributedWeightReceiver
            engine = self.server.engine
            self._receiver = DistributedWeightReceiver(engine.config, engine.params)
        return self._receiver

    async def init_group(self, request):
        from rl_jax.transfer.errors import TransferError, TransportUnavailable
        body = await self.server._json_body(request)
        address = _string(body, "master_address")
        port = _integer(body, "master_port", 1, 65535)
        world_size = _integer(body, "world_size", 2, 1 << 16)
        rank = _integer(body, "rank_offset", 1, world_size - 1)
        name = _string(body, "group_name", "weight_update_group")
        backend = _string(body, "backend", "nccl")
        if backend != "gloo":
            return _answer(False, f"backend {backend!r} is not available on this server (a JAX "
                                  "engine on the host: gloo only)")
        self.server._require_alive()
        try:
            receiver = self.receiver()
            if name in receiver.groups:
                return _answer(False, "Failed to initialize custom process group: The specified "
                                      "group name has already been created, please use a "
                                      "different group name.")
            await asyncio.to_thread(receiver.init_group, address, port, rank, world_size, name,
                                    backend, JOIN_TIMEOUT_S)
        except (TransferError, TransportUnavailable, RuntimeError, ValueError) as e:
            return _answer(False, f"Failed to initialize custom process group: {e}.")
        return _answer(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request):
        from rl_jax.transfer.errors import TransferError, TransportUnavailable
        body = await self.server._json_body(request, optional=True)
        name = _string(body, "group_name", "weight_update_group")
        try:
            self.receiver().destroy_group(name)
        except (TransferError, TransportUnavailable) as e:
            return _answer(False, str(e))
        return _answer(True, "Succeeded to destroy custom process group.")

    async def begin(self, request):
        await self.server._json_body(request, optional=True)
        if self.session_open:
            return _answer(False, "a weight-update session is already open; call "
                                  "end_weight_update() first")
        self.session_open = True
        return _answer(True, "Success")

    async def end(self, request):
        await self.server._json_body(request, optional=True)
        if not self.session_open:
            return _answer(False, "no weight-update session is open; call "
                                  "begin_weight_update() first")
        self.session_open = False
        return _answer(True, "Success")

    async def update(self, request):
        from rl_jax.transfer.errors import TransferError, TransportUnavailable
        server = self.server
        body = await server._json_body(request)
        name = _string(body, "group_name", "weight_update_group")
        for flag in ("flush_cache", "abort_all_requests"):
            if body.get(flag) is not None and not isinstance(body[flag], bool):
                raise ProtocolError(f"{flag} must be true or false, got {body[flag]!r:.60}")
        if not self.session_open:
            return _answer(False, "update_weights_from_distributed must run between "
                                  "begin_weight_update() and end_weight_update()")
        server._require_alive()
        version = parse_version(body.get("weight_version"), server.engine.version)
        try:
            receiver = self.receiver()
            receiver.check_group(name)
            done = await asyncio.to_thread(receiver.receive, body.get("names"),
                                           body.get("dtypes"), body.get("shapes"), name, version)
        except (TransferError, TransportUnavailable, RuntimeError) as e:
            log.warning("refused a bucket of weight version %s: %s", version, e)
            return _answer(False, f"Failed to receive weights: {e}")
        if done is None:
            return _answer(True, "Succeeded to receive a bucket; more to come.",
                           weight_version=server.engine.version)
        params, _ = done
        if server._update_lock is None:
            server._update_lock = asyncio.Lock()
        async with server._update_lock:
            refused = await server._install(params, version, False)
            if refused is not None:
                return refused
            if body.get("abort_all_requests"):
                await asyncio.to_thread(server.engine.abort, None)
            if not await asyncio.to_thread(wait_for_swap, server.engine, params):
                return error_response(f"the engine did not apply the new weights within "
                                      f"{SWAP_TIMEOUT_S:.0f} s", "internal_error", 500)
            if body.get("flush_cache", True) and not await asyncio.to_thread(server.engine.flush_cache):
                return _answer(False, "Weights were updated, but the cache was not flushed "
                                      "because requests are still running or queued.")
        return _answer(True, "Succeeded to update parameter online.", weight_version=version)
