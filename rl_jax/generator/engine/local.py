"""The :class:`~rl_jax.generator.base.Generator` interface over an engine in this process (tests,
benchmarks, single-process runs): the same coroutines a rollout calls on an HTTP client.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rl_jax.generator.base import Generator
from rl_jax.generator.engine.weights import check_update, load_params, wait_for_swap
from rl_jax.generator.types import GenerateOutput, GenerateRequest


class LocalGenerator(Generator):
    """:class:`Generator` over an :class:`Engine` in this process.

    Args:
      engine: the engine (its scheduler thread is already running).
      owns_engine: shut the engine down on :meth:`close`.
    """

    def __init__(self, engine, *, owns_engine: bool = False):
        self.engine = engine
        self.owns_engine = owns_engine

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        return await asyncio.wrap_future(self.engine.submit(request))

    def update_weights(self, params: dict[str, Any], version: int) -> None:
        """Hands ``params`` (already placed like the engine's) to the engine directly; they are
        used from the next decode step on."""
        self.engine.update_weights(params, version)

    async def update_weights_from_disk(self, model_path, version=None, *,
                                       abort_all_requests=False, flush_cache=False) -> int:
        check_update(self.engine.config, model_path)
        runner = self.engine.runner
        _, params = await asyncio.to_thread(load_params, model_path, mesh=runner.mesh,
                                            rules=runner.rules, dtype=runner.dtype)
        version = self.engine.version + 1 if version is None else int(version)
        if abort_all_requests:
            await self.abort()
        self.engine.update_weights(params, version)
        if not await asyncio.to_thread(wait_for_swap, self.engine, params):
            raise RuntimeError("the engine did not apply the new weights")
        if flush_cache:
            await self.flush_cache()
        return version

    async def weight_version(self) -> int:
        return self.engine.version

    async def pause(self, mode: str = "abort") -> None:
        await asyncio.to_thread(self.engine.pause, mode)

    async def resume(self) -> None:
        await asyncio.to_thread(self.engine.resume)

    async def abort(self, rid: str | None = None) -> None:
        await asyncio.to_thread(self.engine.abort, rid)

    async def flush_cache(self) -> bool:
        return await asyncio.to_thread(self.engine.flush_cache)

    async def close(self) -> None:
        if self.owns_engine:
            await asyncio.to_thread(self.engine.shutdown)
