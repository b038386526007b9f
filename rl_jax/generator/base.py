"""The one generator interface rollouts use, and its in-process implementation.

:class:`Generator` is what a rollout worker holds: ``generate`` a :class:`GenerateRequest` into
its ``n`` :class:`GenerateOutput`s (tokens, behaviour log-probs, per-token weight versions),
update the weights, and SGLang's control operations. Two implementations:
:class:`LocalGenerator` wraps an in-process :class:`Engine`; ``rl_jax.generator.client.
GeneratorClient`` talks HTTP to a pool of servers (this project's or real SGLang servers).
All methods are coroutines, so one rollout loop drives either.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_jax.generator.types import GenerateOutput, GenerateRequest


class Generator(abc.ABC):
    """Generation and weight updates, wherever the engine runs."""

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """The ``request.sampling.n`` completions of one prompt."""

    async def generate_many(self, requests: Sequence[GenerateRequest]
                            ) -> list[list[GenerateOutput]]:
        """Completions of several prompts, submitted concurrently, in request order."""
        return list(await asyncio.gather(*(self.generate(r) for r in requests)))

    async def generate_batch(self, requests: Sequence[GenerateRequest]
                             ) -> list[list[GenerateOutput]]:
        """Completions of several prompts submitted as one unit (over HTTP: one batch request
        to one server, instead of one exchange per prompt), in request order."""
        return await self.generate_many(requests)

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str | Path, version: int | None = None,
                                       *, abort_all_requests: bool = False,
                                       flush_cache: bool = False) -> int:
        """Swaps in the weights of an HF checkpoint directory (same model shape) between two
        decode steps; returns the new version (``version`` or the current one + 1)."""

    @abc.abstractmethod
    async def weight_version(self) -> int:
        """The version of the weights now in use (the lowest, for a pool)."""

    @abc.abstractmethod
    async def pause(self, mode: str = "abort") -> None:
        """SGLang's pause modes: ``abort`` finishes everything with reason ``abort``,
        ``retract`` requeues running sequences, ``in_place`` stops stepping."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continues after :meth:`pause`."""

    @abc.abstractmethod
    async def abort(self, rid: str | None = None) -> None:
        """Finishes request ``rid`` (every request when None) with reason ``abort``."""

    @abc.abstractmethod
    async def flush_cache(self) -> bool:
        """Clears the KV cache; False when sequences are running (nothing is done then)."""

    async def close(self) -> None:
        """Releases connections or the engine."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


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
        from rl_jax.generator.weights import check_update, load_params, wait_for_swap
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
