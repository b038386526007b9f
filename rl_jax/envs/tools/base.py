"""The one tool interface: a name, a description, a JSON schema of the arguments, and an async
call bounded in time and in output.

A tool is called by :func:`call_tool`, which never raises for what the call does: a tool that
hangs past its time limit, raises, or returns more than its output limit gives a
:class:`ToolOutcome` whose ``reason`` says so (``"timeout"``, ``"error"``, and ``truncated``)
and whose ``text`` is what the policy sees. The arguments are checked against the schema before
the call (``jsonschema``), so a tool's ``run`` receives what its schema promises.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from typing import Any, ClassVar

import jsonschema

from rl_jax.envs.base import EnvError

REASONS = ("ok", "timeout", "error", "bad_arguments")


class ToolError(Exception):
    """Raised by a tool's :meth:`Tool.run` for a call it refuses or cannot complete (a bad
    expression, a program that failed); its message is what the policy sees."""


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one call gave.

    Attributes:
      text: what the policy sees (the output, or a one-line error), at most the tool's
        ``max_output_chars`` (then ending in a truncation mark).
      reason: one of :data:`REASONS`.
      truncated: the output was longer than ``max_output_chars``.
      seconds: wall time of the call.
    """

    text: str
    reason: str = "ok"
    truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


class Tool(abc.ABC):
    """Base class of tools.

    Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema of the arguments
    object, ``{"type": "object", "properties": ..., "required": ...}``) and implement
    :meth:`run`. ``timeout_s`` and ``max_output_chars`` bound every call.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self, *, timeout_s: float = 10.0, max_output_chars: int = 2000):
        if not timeout_s > 0:
            raise EnvError(f"tool {self.name!r}: timeout_s must be positive, got {timeout_s!r}")
        if not (isinstance(max_output_chars, int) and max_output_chars >= 16):
            raise EnvError(f"tool {self.name!r}: max_output_chars must be an integer >= 16, got "
                           f"{max_output_chars!r}")
        jsonschema.Draft202012Validator.check_schema(self.parameters)
        self.timeout_s, self.max_output_chars = float(timeout_s), max_output_chars
        self._validator = jsonschema.Draft202012Validator(self.parameters)

    @abc.abstractmethod
    async def run(self, arguments: dict[str, Any], session: dict[str, Any]) -> str:
        """The call's output. ``session`` is this episode's private state for the tool (empty at
        the episode's first call; a stateful tool keeps what it needs there)."""

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates list it (OpenAI's function format, which Qwen's and
        Hermes' templates render into the system prompt)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    def argument_error(self, arguments: Any) -> str | None:
        """The first schema violation of ``arguments`` (one line), or None."""
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where + ': ' if where else ''}{error.message}"[:300]

    async def close(self) -> None:
        """Releases what the tool holds (worker pools)."""


def clip(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters with a mark saying how much was dropped."""
    if len(text) <= limit:
        return text, False
    mark = f"\n... [{len(text) - limit} more characters]"
    keep = max(limit - len(mark), 0)
    return text[:keep] + mark, True


async def call_tool(tool: Tool, arguments: Any, session: dict[str, Any]) -> ToolOutcome:
    """``tool.run(arguments)`` contained: schema-checked, limited to ``tool.timeout_s`` and
    ``tool.max_output_chars``, any exception turned into an error outcome."""
    start = time.monotonic()
    problem = tool.argument_error(arguments)
    if problem is not None:
        return ToolOutcome(f"error: bad arguments for {tool.name}: {problem}", "bad_arguments")
    try:
        output = await asyncio.wait_for(tool.run(arguments, session), tool.timeout_s)
    except asyncio.TimeoutError:
        return ToolOutcome(f"error: {tool.name} timed out after {tool.timeout_s:g} s",
                           "timeout", seconds=time.monotonic() - start)
    except asyncio.CancelledError:
        raise
    except ToolError as e:
        text, truncated = clip(f"error: {e}", tool.max_output_chars)
        return ToolOutcome(text, "error", truncated, time.monotonic() - start)
    except Exception as e:  # a tool's own failure is the policy's observation, not the rollout's
        text, truncated = clip(f"error: {tool.name} failed: {type(e).__name__}: {e}",
                               tool.max_output_chars)
        return ToolOutcome(text, "error", truncated, time.monotonic() - start)
    if not isinstance(output, str):
        return ToolOutcome(f"error: {tool.name} returned {type(output).__name__}, not text",
                           "error", seconds=time.monotonic() - start)
    text, truncated = clip(output, tool.max_output_chars)
    return ToolOutcome(text, "ok", truncated, time.monotonic() - start)
