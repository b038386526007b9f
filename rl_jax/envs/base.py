"""The one environment interface: prompts in, rewards out, optionally over several turns.

Text is the currency: an environment receives a prompt and a completion as strings and owns
their parsing. A :class:`Prompt` carries the text together with what the environment needs to
judge it (a reference answer, unit tests, the puzzle's numbers); environments whose prompts
describe themselves (arithmetic, countdown) also accept a bare ``str``.

Single-turn use::

    reward, info = await env.score(prompt, completion)

Multi-turn use: an episode starts with :meth:`Environment.reset`; each policy turn is passed to
:meth:`Environment.step`, which returns a :class:`StepResult`. A non-final step carries an
``observation`` that the rollout appends to the context before generation continues; the tokens
of that observation were written by the environment, not the policy, and are masked out of the
loss (:func:`build_loss_mask`). The episode's reward is the sum of its step rewards.
Single-turn environments end every episode at the first step. A multi-turn environment's
``step`` calls :meth:`EpisodeState.check_running`, computes its :class:`StepResult` and returns
it through :meth:`EpisodeState.record`, which keeps the transcript.

Every ``info`` dict has ``"correct"`` (bool: the task was solved) and ``"reason"`` (a short
machine-readable word: ``"correct"``, ``"wrong_answer"``, ``"no_answer"``, ``"timeout"``, ...).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from rl_jax.data.prompts import Prompt, PromptGenerator


class EnvError(ValueError):
    """Bad environment configuration or input (an unknown name, a prompt missing its answer)."""


PromptLike = Prompt | str


def as_prompt(prompt: PromptLike) -> Prompt:
    """``prompt`` itself, or a :class:`Prompt` holding the text of a bare string."""
    if isinstance(prompt, Prompt):
        return prompt
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    raise EnvError(f"a prompt must be a str or a Prompt, got {type(prompt).__name__}")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The outcome of one policy turn.

    Attributes:
      reward: this step's reward (the episode's reward is the sum over steps).
      done: whether the episode has ended.
      observation: text the rollout appends before the next turn (None when ``done``).
      info: diagnostics, with ``"correct"`` and ``"reason"`` as for :meth:`Environment.score`.
    """

    reward: float
    done: bool
    observation: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.done and self.observation is not None:
            raise EnvError("a final step (done=True) cannot carry an observation")
        if not self.done and self.observation is None:
            raise EnvError("a non-final step (done=False) needs an observation to continue from")


@dataclasses.dataclass
class EpisodeState:
    """Mutable state of one multi-turn episode.

    Attributes:
      prompt: the episode's prompt.
      turn: policy turns taken so far.
      transcript: ``(source, text)`` pairs after the prompt, ``source`` in
        ``{"policy", "environment"}``.
      total_reward: sum of the step rewards so far.
      done: whether the episode has ended.
      data: environment-private state.
    """

    prompt: Prompt
    turn: int = 0
    transcript: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    total_reward: float = 0.0
    done: bool = False
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def context(self) -> str:
        """The prompt text followed by every turn so far: what the policy continues from."""
        return self.prompt.text + "".join(text for _, text in self.transcript)

    def check_running(self) -> None:
        """Raises :class:`EnvError` if the episode has ended (call first in ``step``)."""
        if self.done:
            raise EnvError("step() called on an episode that has ended")

    def record(self, completion: str, result: StepResult) -> StepResult:
        """Appends a policy turn and its result (observation, reward, end); returns ``result``."""
        self.check_running()
        self.turn += 1
        self.transcript.append(("policy", completion))
        self.total_reward += result.reward
        self.done = result.done
        if result.observation is not None:
            self.transcript.append(("environment", result.observation))
        return result


class Environment(PromptGenerator, abc.ABC):
    """Base class of reward environments.

    Subclasses implement :meth:`score`; multi-turn ones also override :meth:`step`.
    Generated tasks implement :meth:`prompt` (deterministic in ``(seed, split, index)``).
    """

    name: ClassVar[str] = ""
    max_turns: int = 1

    @abc.abstractmethod
    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        """``(reward, info)`` of a completion; never raises because the completion is bad."""

    async def reset(self, prompt: PromptLike) -> EpisodeState:
        """A fresh episode on ``prompt``."""
        return EpisodeState(prompt=as_prompt(prompt))

    async def step(self, state: EpisodeState, completion: str) -> StepResult:
        """Applies one policy turn and records it with :meth:`EpisodeState.record`;
        single-turn environments score it and end the episode."""
        state.check_running()
        reward, info = await self.score(state.prompt, completion)
        return state.record(completion, StepResult(float(reward), True, None, info))

    async def close(self) -> None:
        """Releases worker pools; the environment cannot be used afterwards."""


async def score_many(env: Environment, prompts: Sequence[PromptLike],
                     completions: Sequence[str], *,
                     max_concurrency: int = 64) -> list[tuple[float, dict[str, Any]]]:
    """Scores ``completions[i]`` against ``prompts[i]`` concurrently, in order.

    At most ``max_concurrency`` scores run at once (environments with their own worker pools,
    like the code sandbox, bound their own work further). An exception from one score is raised
    after the others have finished.
    """
    if len(prompts) != len(completions):
        raise EnvError(f"{len(prompts)} prompts but {len(completions)} completions")
    if max_concurrency < 1:
        raise EnvError(f"max_concurrency must be at least 1, got {max_concurrency}")
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(prompt, completion):
        async with semaphore:
            return await env.score(prompt, completion)

    results = await asyncio.gather(*(one(p, c) for p, c in zip(prompts, completions)),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def run_episode(env: Environment, prompt: PromptLike,
                      policy: Callable[[EpisodeState], Awaitable[str]], *,
                      max_turns: int | None = None) -> EpisodeState:
    """Alternates ``policy`` (the context so far → a completion) and ``env.step`` to the end.

    The episode ends when the environment says so, or after ``max_turns`` policy turns
    (default ``env.max_turns``); the returned state holds the transcript and total reward.
    """
    state = await env.reset(prompt)
    limit = env.max_turns if max_turns is None else max_turns
    while not state.done and state.turn < limit:
        await env.step(state, await policy(state))
    return state


# ---------------------------------------------------------------------------------------------
# Token-level assembly of multi-turn episodes.

SEGMENT_SOURCES = ("prompt", "policy", "environment")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of tokens with one author.

    Attributes:
      token_ids: ``[L]`` token ids.
      source: ``"prompt"`` (only at the start), ``"policy"`` or ``"environment"``.
      logprobs: ``[L]`` behaviour log-probs (nats) of policy tokens, if known.
      versions: ``[L]`` policy versions of policy tokens, if known.
    """

    token_ids: Sequence[int]
    source: str
    logprobs: Sequence[float] | None = None
    versions: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class EpisodeTokens:
    """A multi-turn episode as flat arrays.

    Attributes:
      token_ids: ``[T]`` int32, all segments in order.
      loss_mask: ``[T]`` bool, True exactly on policy tokens.
      logprobs: ``[T]`` float32 behaviour log-probs; 0 where ``loss_mask`` is False.
      versions: ``[T]`` int32 policy versions. A non-policy token takes the version of the latest
        policy token before it (the first policy token's if none), so that the minimum over a
        sample is the oldest version that wrote any of it; -1 everywhere if there is no policy
        token or no versions were given.
      prompt_length: tokens in the leading prompt segments (the completion starts there).
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    prompt_length: int


def build_loss_mask(segments: Sequence[Segment]) -> EpisodeTokens:
    """Concatenates tagged segments and marks which tokens the loss may train on.

    Raises:
      EnvError: for an unknown source, a prompt segment after a non-prompt one, per-token
        arrays whose length differs from the segment's, or log-probs/versions given on some
        policy segments but not others.
    """
    ids, mask, logprobs, versions = [], [], [], []
    prompt_length, seen_completion = 0, False
    policy = [s for s in segments if s.source == "policy"]
    has_logprobs = _all_or_none(policy, "logprobs")
    has_versions = _all_or_none(policy, "versions")
    for i, seg in enumerate(segments):
        if seg.source not in SEGMENT_SOURCES:
            raise EnvError(f"segment {i}: source must be one of {SEGMENT_SOURCES}, got "
                           f"{seg.source!r}")
        n = len(seg.token_ids)
        if seg.source == "prompt":
            if seen_completion:
                raise EnvError(f"segment {i}: a prompt segment after the completion started; "
                               "tag text the environment inserts as 'environment'")
            prompt_length += n
        else:
            seen_completion = True
        for name in ("logprobs", "versions"):
            values = getattr(seg, name)
            if values is not None and len(values) != n:
                raise EnvError(f"segment {i}: {len(values)} {name} for {n} tokens")
            if values is not None and seg.source != "policy":
                raise EnvError(f"segment {i}: {name} given on a {seg.source!r} segment")
        is_policy = seg.source == "policy"
        ids.extend(int(t) for t in seg.token_ids)
        mask.extend([is_policy] * n)
        logprobs.extend(seg.logprobs if is_policy and has_logprobs else [0.0] * n)
        versions.extend(seg.versions if is_policy and has_versions else [None] * n)
    mask_arr = np.asarray(mask, dtype=bool)
    return EpisodeTokens(
        token_ids=np.asarray(ids, dtype=np.int32),
        loss_mask=mask_arr,
        logprobs=np.where(mask_arr, np.asarray(logprobs, dtype=np.float32), 0.0).astype(
            np.float32),
        versions=_fill_versions(versions) if has_versions and policy else
        np.full(len(ids), -1, dtype=np.int32),
        prompt_length=prompt_length,
    )


def _all_or_none(policy_segments: Sequence[Segment], name: str) -> bool:
    given = [getattr(s, name) is not None for s in policy_segments]
    if any(given) and not all(given):
        raise EnvError(f"{name} given on some policy segments but not on others")
    return bool(given) and all(given)


def _fill_versions(versions: list[int | None]) -> np.ndarray:
    first = next(v for v in versions if v is not None)
    out, last = [], first
    for v in versions:
        last = last if v is None else int(v)
        out.append(last)
    return np.asarray(out, dtype=np.int32)
