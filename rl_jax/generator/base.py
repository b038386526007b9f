"""The one generator interface rollouts use.

:class:`Generator` is what a rollout worker holds: ``generate`` a :class:`GenerateRequest` into
its ``n`` :class:`GenerateOutput`s (tokens, behaviour log-probs, per-token weight versions),
update the weights, and SGLang's control operations. Two implementations:
``rl_jax.generator.engine.local.LocalGenerator`` wraps an in-process engine;
``rl_jax.generator.client.core.
GeneratorClient`` talks HTTP to a pool of servers (this project's or real SGLang servers).
All methods are coroutines, so one rollout loop drives either.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from pathlib import Path

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
