"""Tool-using episodes around any single-turn task: the policy may call tools (Hermes-format
``<tool_call>`` blocks, :mod:`rl_jax.envs.tools.calls`) over several turns, each call's result
comes back as a tool turn, and the first turn without a call is its answer, scored by the task.

An episode::

    prompt  ->  policy: "...<tool_call>{...}</tool_call>"  (generation stops at </tool_call>)
            ->  environment: "<tool_response>...</tool_response>" (masked out of the loss)
            ->  policy: "...answer"  ->  the task's score of that last turn

A malformed call (bad JSON, unknown tool, wrong arguments, a call in the middle of a word, more
calls than allowed, an unclosed block) is answered with an error in the tool turn, as a tool's
own failure (time-out, crash, oversized output) is: the episode goes on, nothing raises, and
``info`` counts them (``tool_calls``, ``format_errors``, ``format_error/<reason>``,
``tool_errors``). An episode that reaches ``max_turns`` still calling gets the task's score of
an empty answer.

Rewards: the task's, plus ``format_penalty`` (<= 0) per malformed call and ``call_bonus`` per
well-formed call (0 by default: the answer alone decides).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, EpisodeState, PromptLike, StepResult
from rl_jax.envs.tools import get as get_tool
from rl_jax.envs.tools.base import Tool, call_tool
from rl_jax.envs.tools.calls import CLOSE, STYLES, parse_turn, render_results


class ToolUseEnv(Environment):
    """Args:
      task: the single-turn environment whose prompts the episodes start from and whose
        ``score`` judges the final turn (``rl_jax.envs.get("tool_use", task=NAME,
        task_kwargs={...})`` builds it from its name).
      tools: tool names, or ``{name: kwargs}`` (``rl_jax.envs.tools.get``), or tools.
      max_turns: policy turns per episode (calls included).
      max_calls_per_turn: well-formed calls run per turn.
      style: how results come back (:data:`rl_jax.envs.tools.calls.STYLES`: ``"qwen"``'s chat
        turns, or ``"plain"`` lines).
      format_penalty, call_bonus: reward shaping per malformed / well-formed call.
    """

    name: ClassVar[str] = "tool_use"
    # A turn ends at a call's end: the rollout stops generation there (when it is one token).
    stop_texts: ClassVar[tuple[str, ...]] = (CLOSE,)

    def __init__(self, task: Environment, *,
                 tools: Sequence[str] | Mapping[str, Mapping[str, Any]] | Sequence[Tool] = (
                     "calculator",),
                 max_turns: int = 4, max_calls_per_turn: int = 1, style: str = "plain",
                 format_penalty: float = 0.0, call_bonus: float = 0.0):
        if not isinstance(task, Environment) or task.max_turns != 1:
            raise EnvError("the task of a tool-use episode must be a single-turn environment")
        if not (isinstance(max_turns, int) and 1 <= max_turns <= 64):
            raise EnvError(f"max_turns must be an integer in [1, 64], got {max_turns!r}")
        if not (isinstance(max_calls_per_turn, int) and 1 <= max_calls_per_turn <= 16):
            raise EnvError(f"max_calls_per_turn must be in [1, 16], got {max_calls_per_turn!r}")
        if style not in STYLES:
            raise EnvError(f"unknown style {style!r}; known: {sorted(STYLES)}")
        if format_penalty > 0 or call_bonus < 0:
            raise EnvError("format_penalty must be <= 0 and call_bonus >= 0")
        self.task, self.max_turns = task, max_turns
        self.max_calls_per_turn, self.style = max_calls_per_turn, style
        self.format_penalty, self.call_bonus = float(format_penalty), float(call_bonus)
        if isinstance(tools, Mapping):
            made = [get_tool(n, **dict(kw or {})) for n, kw in tools.items()]
        else:
            made = [t if isinstance(t, Tool) else get_tool(str(t)) for t in tools]
        self.tools: dict[str, Tool] = {}
        for tool in made:
            if tool.name in self.tools:
                raise EnvError(f"tool {tool.name!r} is given twice")
            self.tools[tool.name] = tool

    # ---- prompts: the task's ----------------------------------------------------------------

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return self.task.prompt(index, split)

    def __getattr__(self, name: str):  # the task's own attributes (ALPHABET, EOS_TEXT, ...)
        if name.startswith("_") or name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)

    # ---- episodes -----------------------------------------------------------------------------

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        """A single turn (evaluation without tools): the task's score of ``completion``, or 0
        with reason ``"tool_call"`` when it calls a tool."""
        parsed = parse_turn(completion, self.tools, max_calls=self.max_calls_per_turn)
        if parsed.called:
            return 0.0, {"correct": False, "reason": "tool_call"}
        return await self.task.score(prompt, completion)

    async def reset(self, prompt: PromptLike) -> EpisodeState:
        state = await super().reset(prompt)
        state.data.update(sessions={name: {} for name in self.tools}, tool_calls=0,
                          format_errors=0, tool_errors=0, reasons={}, shaping=0.0)
        return state

    async def step(self, state: EpisodeState, completion: str) -> StepResult:
        state.check_running()
        data = state.data
        parsed = parse_turn(completion, self.tools, max_calls=self.max_calls_per_turn)
        if not parsed.called:
            reward, info = await self.task.score(state.prompt, completion)
            return state.record(completion, StepResult(
                float(reward) + data["shaping"], True, None, {**info, **self._counts(data)}))
        for error in parsed.errors:
            data["format_errors"] += 1
            data["reasons"][error.reason] = data["reasons"].get(error.reason, 0) + 1
        outcomes = await asyncio.gather(*(call_tool(self.tools[c.name], c.arguments,
                                                    data["sessions"][c.name])
                                          for c in parsed.calls))
        data["tool_calls"] += len(parsed.calls)
        data["tool_errors"] += sum(not o.ok for o in outcomes)
        data["shaping"] += self.format_penalty * len(parsed.errors) \
            + self.call_bonus * len(parsed.calls)
        # Results in the order the blocks were written.
        results = sorted([(c.span, o.text) for c, o in zip(parsed.calls, outcomes)]
                         + [(e.span, e.message()) for e in parsed.errors])
        if state.turn + 1 >= self.max_turns:  # no turn left to answer in
            reward, info = await self.task.score(state.prompt, "")
            return state.record(completion, StepResult(
                float(reward) + data["shaping"], True, None,
                {**info, "correct": False, "reason": "turn_limit", **self._counts(data)}))
        return state.record(completion, StepResult(
            0.0, False, render_results([text for _, text in results], self.style)))

    @staticmethod
    def _counts(data: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": data["tool_calls"], "format_errors": data["format_errors"],
                "tool_errors": data["tool_errors"],
                **{f"format_error/{k}": v for k, v in sorted(data["reasons"].items())}}

    async def close(self) -> None:
        for tool in self.tools.values():
            await tool.close()
        await self.task.close()
