"""Held-out evaluation through the generator pool: greedy decoding of a fixed set of prompts from
the environment's eval split, scored by the environment.

Run on the servers, so it measures exactly what the policy generates; every result carries the
weight versions that produced it (in ``async`` mode a periodic eval runs on whatever version the
servers hold, at most ``max_lag`` behind the trainer; the final one waits for the last version).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable, Sequence

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import Environment, score_many
from rl_jax.generator.base import Generator
from rl_jax.generator.client.control import ServerLeft
from rl_jax.generator.types import GenerateRequest, SamplingParams

MAX_REISSUES = 8  # times one part of an evaluation is sent again after its server left


@dataclasses.dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of prompts whose greedy completion the environment marks correct
    reward: float  # mean reward
    examples: int
    min_version: int  # oldest weight version among the generated tokens
    max_version: int
    seconds: float

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/reward": self.reward,
                f"{prefix}/version": float(self.min_version), f"{prefix}/seconds": self.seconds}


def held_out_prompts(env: Environment, count: int, max_draws: int = 100) -> list[Prompt]:
    """The first ``count`` distinct prompts of the environment's eval split (fixed across runs;
    fewer if the split has fewer within ``max_draws · count`` indices)."""
    prompts: dict[str, Prompt] = {}
    for i in range(count * max_draws):
        if len(prompts) == count:
            break
        prompt = env.prompt(i, "eval")
        prompts.setdefault(prompt.text, prompt)
    return list(prompts.values())


async def evaluate(generator: Generator, env: Environment, prompts: Sequence[Prompt], *,
                   encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                   max_new_tokens: int, tag: str = "eval",
                   concurrency: int = 64, batch: int = 16) -> EvalResult:
    """Greedy completions of ``prompts`` (at most ``concurrency`` at a time, sent ``batch`` to a
    request: one HTTP exchange for several prompts), scored."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1)
    size = max(1, min(batch, concurrency))
    limit = asyncio.Semaphore(max(1, concurrency // size))

    async def part(first: int) -> list:
        async with limit:
            for attempt in itertools.count():
                # A new request id per attempt: the server that left may still run the old one.
                requests = [GenerateRequest(encode(p.text), sampling,
                                            rid=f"{tag}-{i}" + (f"-{attempt}" if attempt else ""))
                            for i, p in enumerate(prompts[first:first + size], first)]
                try:
                    return [outs[0] for outs in await generator.generate_batch(requests)]
                except ServerLeft:  # its server left the pool: sent again to another one
                    if attempt >= MAX_REISSUES:
                        raise

    parts = await asyncio.gather(*(part(i) for i in range(0, len(prompts), size)))
    outputs = [o for p in parts for o in p]
    scores = await score_many(env, list(prompts), [decode(o.output_ids) for o in outputs])
    versions = [v for o in outputs for v in o.output_versions] or [-1]
    n = max(len(prompts), 1)
    return EvalResult(accuracy=sum(bool(info.get("correct")) for _, info in scores) / n,
                      reward=sum(r for r, _ in scores) / n, examples=len(prompts),
                      min_version=min(versions), max_version=max(versions),
                      seconds=loop.time() - start)
