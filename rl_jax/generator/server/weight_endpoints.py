"""The HTTP server's weight-update endpoints: ``/update_weights_from_disk`` (an HF checkpoint of
the served shape) and ``/update_weights_from_transfer`` (a pull from the trainer's publisher,
:mod:`rl_jax.transfer`), and the pull of the newest published version before serving.

Every path hands the new weights to ``Engine.update_weights``, which checks them
(:func:`rl_jax.generator.engine.weights.check_weights`); a refusal is a 400 saying why while the old
weights keep serving. Updates are serialised by one lock, and each answers once the engine
decodes with the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from rl_jax.generator.engine.weights import (SWAP_TIMEOUT_S, WeightsRefused, check_update,
                                             load_params, wait_for_swap)
from rl_jax.generator.json_body import INT64, ProtocolError
from rl_jax.generator.responses import error_json
from rl_jax.generator.server.httpio import (EngineStopped, error_response, json_response,
                                            log_refused)
from rl_jax.models.hf import CheckpointError

log = logging.getLogger("rl_jax.generator.server")  # one logger for the server's modules

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer model_path names no file


def parse_version(value: Any, current: int) -> int:
    """A request's ``weight_version``: an integer within int64, or a string of one (SGLang
    sends strings); None → current + 1. Anything else (``1.5``, ``true``, ``"1.5"``) is a
    :class:`ProtocolError`, never rounded."""
    if value is None:
        return current + 1
    text = value.strip() if isinstance(value, str) else None
    digits = text[1:] if text and text[0] in "+-" else text
    if isinstance(value, bool) or not (
            type(value) is int or digits and digits.isascii() and digits.isdigit()
            and len(digits) <= 19):
        raise ProtocolError(f"weight_version must be an integer (this engine counts optimizer "
                            f"steps), got {value!r:.60}")
    version = int(value)
    if not INT64[0] <= version <= INT64[1]:
        raise ProtocolError(f"weight_version must lie within int64, got {value!r:.60}")
    return version


class WeightUpdateEndpoints:
    """The weight-update endpoints of :class:`rl_jax.generator.server.app.GeneratorServer` (a mixin:
    they use the server's ``engine``, ``config``, ``mesh``/``rules``/``dtype``, ``_pullers``,
    ``_update_lock``, ``model_path``, ``_json_body`` and ``_require_alive``)."""

    def pull_initial_weights(self):
        """Pulls the newest version published at ``config.publisher_url``, if newer than the
        loaded one; a publisher that cannot be reached is logged and the loaded weights kept."""
        from rl_jax.transfer.puller.generator import GeneratorPuller
        from rl_jax.transfer.errors import TransferError
        url = self.config.publisher_url
        puller = self._pullers.setdefault(url, GeneratorPuller(url))
        try:
            update = puller.pull_latest(self.engine, wait_s=0.0)
        except (TransferError, OSError) as e:
            log.warning("no initial weights from %s (serving version %d): %s", url,
                        self.engine.version, e)
            return
        if update is not None:
            try:
                self.engine.update_weights(update.params, update.version,
                                           finite_checked=update.finite_checked)
            except WeightsRefused as e:
                log.warning("initial weights from %s refused (serving version %d): %s", url,
                            self.engine.version, e)
                return
            if not wait_for_swap(self.engine, update.params):
                raise EngineStopped("the engine did not apply the initial weights")
            log.info("pulled initial weight version %d from %s", update.version, url)

    async def update_weights_from_disk(self, request):
        """Loads an HF checkpoint of the same shape and swaps it in between two decode steps;
        running sequences continue under the new version (no pause needed)."""
        body = await self._json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (an HF checkpoint directory) is required")
        if len(path) > MAX_PATH_CHARS or "\0" in path:
            raise ProtocolError(f"model_path must be a directory path of at most "
                                f"{MAX_PATH_CHARS} characters without NUL bytes, got "
                                f"{len(path)} characters")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise ProtocolError(f"load_format={load_format!r} is not supported "
                                f"(HF safetensors directories only: auto or safetensors)")
        for name in ("abort_all_requests", "flush_cache", "allow_older"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise ProtocolError(f"{name} must be true or false, got {body[name]!r:.60}")
        self._require_alive()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            version = parse_version(body.get("weight_version"), self.engine.version)
            try:
                check_update(self.engine.config, path)
                _, params = await asyncio.to_thread(load_params, path, mesh=self.mesh,
                                                    rules=self.rules, dtype=self.dtype)
            except CheckpointError as e:
                log_refused(request, 400, str(e))
                return json_response({"success": False, "message": str(e),
                                       **error_json(str(e), "invalid_request_error", 400)},
                                      status=400)
            start = time.perf_counter()
            refused = await self._install(params, version, bool(body.get("allow_older")))
            if refused is not None:
                return refused
            if body.get("abort_all_requests"):
                await asyncio.to_thread(self.engine.abort, None)
            swapped = await asyncio.to_thread(wait_for_swap, self.engine, params)
            if not swapped:
                return error_response(f"the engine did not apply the new weights within "
                              f"{SWAP_TIMEOUT_S:.0f} s", "internal_error", 500)
            if body.get("flush_cache", True):
                await asyncio.to_thread(self.engine.flush_cache)
            self.model_path = path
        return json_response({
            "success": True, "num_paused_requests": 0, "weight_version": version,
            "message": f"Succeeded to update model weights from {path}; weight version "
                       f"{version} (swapped in {1000 * (time.perf_counter() - start):.0f} ms)."})

    async def update_weights_from_transfer(self, request):
        """Pulls the newest weights from the trainer's publisher (rl_jax.transfer) straight into
        the engine's shardings, verifies their checksums, and swaps them in between two decode
        steps. Body: ``publisher_url`` (the server's own, ``--publisher_url``: its transfer token is
        bound to it, and any other is refused with 403 before a connection is made),
        ``weight_version`` (pull at least this version), ``wait_s`` (wait this long for a
        newer version), ``transport``."""
        from rl_jax.transfer.puller.generator import GeneratorPuller
        from rl_jax.transfer.errors import PublisherNotAllowed, TransferError
        from rl_jax.transfer.puller.generator import pinned_publisher

        body = await self._json_body(request, optional=True)
        try:
            url = pinned_publisher(body.get("publisher_url"), self.config.publisher_url)
        except PublisherNotAllowed as e:
            return error_response(str(e), "forbidden", 403)
        except ValueError as e:
            raise ProtocolError(f"publisher_url: {e}") from None
        wait_s = body.get("wait_s", 0.0)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or wait_s < 0:
            raise ProtocolError(f"wait_s must be a non-negative number, got {wait_s!r}")
        if wait_s > 3600:
            raise ProtocolError(f"wait_s must be at most 3600 s, got {wait_s!r:.60}")
        transport = body.get("transport")
        if transport is not None and not isinstance(transport, str):
            raise ProtocolError(f"transport must be a string, got {transport!r:.60}")
        allow_older = body.get("allow_older", False)
        if not isinstance(allow_older, bool):
            raise ProtocolError(f"allow_older must be true or false, got {allow_older!r:.60}")
        min_version = body.get("weight_version")
        if min_version is not None:
            min_version = parse_version(min_version, self.engine.version)
        self._require_alive()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if min_version is not None and self.engine.version >= min_version:
                return json_response({"success": True, "weight_version": self.engine.version,
                                       "message": f"already at version {self.engine.version}"})
            puller = self._pullers.setdefault(url, GeneratorPuller(url))
            try:
                update = await asyncio.to_thread(puller.pull_latest, self.engine,
                                                 wait_s=float(wait_s), min_version=min_version,
                                                 transport=transport)
            except TransferError as e:
                return json_response({"success": False, "message": str(e),
                                       "weight_version": self.engine.version,
                                       **error_json(str(e), "transfer_error", 400)}, status=400)
            if update is None:
                return json_response({"success": True, "weight_version": self.engine.version,
                                       "message": "no newer version was published"})
            start = time.perf_counter()
            refused = await self._install(update.params, update.version, allow_older,
                                          finite_checked=update.finite_checked)
            if refused is not None:
                return refused
            if not await asyncio.to_thread(wait_for_swap, self.engine, update.params):
                return error_response(f"the engine did not apply the new weights within "
                              f"{SWAP_TIMEOUT_S:.0f} s", "internal_error", 500)
            swap_ms = 1000 * (time.perf_counter() - start)
        return json_response({"success": True, "weight_version": update.version,
                               "swap_ms": swap_ms, "transfer": update.metrics.to_json(),
                               "message": f"pulled weight version {update.version}"})

    async def _install(self, params, version: int, allow_older: bool, *,
                       finite_checked: bool = False) -> web.Response | None:
        """Hands new weights to the engine, which checks them (off the event loop); the 400
        answer saying why when it refuses them (the old weights keep serving), else None."""
        try:
            await asyncio.to_thread(self.engine.update_weights, params, version,
                                    allow_older=allow_older, finite_checked=finite_checked)
        except WeightsRefused as e:
            log.warning("refused weight version %d (serving version %d): %s", version,
                        self.engine.version, e)
            return json_response({"success": False, "message": str(e),
                                   "weight_version": self.engine.version,
                                   **error_json(str(e), "invalid_request_error", 400)},
                                  status=400)
        return None
