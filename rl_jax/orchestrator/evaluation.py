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
    # Multi-turn episodes: turns and tool use (rl_jax.rollout.batching.episode_metrics).
    extras: dict[str, float] = dataclasses.field(default_factory=dict)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/reward": self.reward,
                f"{prefix}/version": float(self.min_version), f"{prefix}/seconds": self.seconds,
                **{f"{prefix}/{k}": v for k, v in self.extras.items()}}


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
                   concurrency: int = 64, batch: int = 16,
                   encode_observation: Callable[[str], list[int]] | None = None,
                   turn_stop_token_ids: Sequence[int] = ()) -> EvalResult:
    """Greedy completions of ``prompts`` (at most ``concurrency`` at a time, sent ``batch`` to a
    request: one HTTP exchange for several prompts), scored; for a multi-turn environment,
    greedy episodes (turns end at ``turn_stop_token_ids`` or end-of-sequence, observations
    encoded by ``encode_observation``, all within ``max_new_tokens``)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    if getattr(env, "max_turns", 1) > 1:
        return await _evaluate_episodes(
            generator, env, prompts, encode=encode, decode=decode,
            encode_observation=encode_observation or encode, max_new_tokens=max_new_tokens,
            tag=tag, concurrency=concurrency, stops=tuple(turn_stop_token_ids), start=start)
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


async def _evaluate_episodes(generator: Generator, env: Environment, prompts: Sequence[Prompt],
                             *, encode, decode, encode_observation, max_new_tokens: int,
                             tag: str, concurrency: int, stops: tuple[int, ...],
                             start: float) -> EvalResult:
    limit = asyncio.Semaphore(max(1, concurrency))

    async def episode(i: int, prompt: Prompt):
        async with limit:
            for attempt in itertools.count():
                try:
                    return await _greedy_episode(generator, env, prompt, encode(prompt.text),
                                                 decode, encode_observation, max_new_tokens,
                                                 stops, f"{tag}-{i}" + (f"-{attempt}" if attempt
                                                                        else ""))
                except ServerLeft:  # its server left the pool: run again on another one
                    if attempt >= MAX_REISSUES:
                        raise

    done = await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))
    from rl_jax.rollout.batching import episode_metrics
    versions = [v for _, _, vs in done for v in vs] or [-1]
    n = max(len(prompts), 1)
    return EvalResult(accuracy=sum(bool(info.get("correct")) for _, info, _ in done) / n,
                      reward=sum(r for r, _, _ in done) / n, examples=len(prompts),
                      min_version=min(versions), max_version=max(versions),
                      seconds=asyncio.get_running_loop().time() - start,
                      extras=episode_metrics([info for _, info, _ in done]))


async def _greedy_episode(generator: Generator, env: Environment, prompt: Prompt,
                          ids: list[int], decode, encode_observation, max_new_tokens: int,
                          stops: tuple[int, ...], rid: str):
    state = await env.reset(prompt)
    context, versions, info = list(ids), [], {}
    while not state.done and state.turn < env.max_turns:
        remaining = max_new_tokens - (len(context) - len(ids))
        if remaining <= 0:
            break
        sampling = SamplingParams(max_new_tokens=remaining, temperature=0.0, n=1,
                                  stop_token_ids=stops)
        out = (await generator.generate(GenerateRequest(context, sampling,
                                                        rid=f"{rid}-{state.turn}")))[0]
        context += out.output_ids
        versions += out.output_versions
        result = await env.step(state, decode(out.output_ids))
        info = result.info
        if result.observation is not None:
            context += encode_observation(result.observation)
    info = {**info, "turns": state.turn}
    if not state.done:
        info.update(correct=False, reason="length")
    return state.total_reward, info, versions
