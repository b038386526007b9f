"""Tool calls in the Hermes format that Qwen2.5 / Qwen3 chat templates use, parsed from a policy
turn, and tool results rendered as the tool turn those templates write::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 + 456"}}
    </tool_call>

    <tool_response>
    579
    </tool_response>

:func:`parse_turn` never raises for what the policy wrote: every block that is not a well-formed
call of a known tool with valid arguments becomes a :class:`CallError` whose ``reason`` (one of
:data:`FORMAT_ERRORS`) is counted as a metric and whose message is shown to the policy.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
FORMAT_ERRORS = (
    "unclosed",        # <tool_call> without its </tool_call> (or another <tool_call> first)
    "stray_close",     # </tool_call> without a <tool_call> before it
    "mid_word",        # <tool_call> right after a letter or digit
    "too_long",        # the block is longer than the limit
    "bad_json",        # the block is not one JSON value (NaN and Infinity are not JSON)
    "not_an_object",   # the JSON value is not an object
    "missing_name",    # no "name" string
    "bad_arguments_field",  # "arguments" is neither an object nor a string holding one
    "unknown_tool",    # the name is not one of the episode's tools
    "bad_arguments",   # the arguments do not match the tool's schema
    "several_calls",   # more calls in one turn than allowed
)
_TAG = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]  # of the whole block in the turn's text


@dataclasses.dataclass(frozen=True)
class CallError:
    reason: str  # one of FORMAT_ERRORS
    detail: str
    span: tuple[int, int]

    def message(self) -> str:
        return f"error: {self.reason.replace('_', ' ')}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A policy turn: its well-formed calls, its malformed blocks, and its text outside them."""

    calls: tuple[ToolCall, ...]
    errors: tuple[CallError, ...]
    text: str

    @property
    def called(self) -> bool:
        """The turn tried to call a tool (well-formed or not): the episode goes on."""
        return bool(self.calls or self.errors)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _decode(body: str, tools: Mapping[str, Any], span: tuple[int, int]
            ) -> ToolCall | CallError:
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        return CallError("bad_json", str(e)[:200], span)
    if not isinstance(value, dict):
        return CallError("not_an_object", f"got {type(value).__name__}", span)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return CallError("missing_name", 'the call needs a "name" string', span)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return CallError("bad_arguments_field", '"arguments" must be an object', span)
    if name not in tools:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return CallError("unknown_tool", f"no tool named {shown!r}; tools: "
                         f"{', '.join(sorted(tools))}", span)
    checker = getattr(tools[name], "argument_error", None)
    problem = checker(arguments) if checker is not None else None
    if problem is not None:
        return CallError("bad_arguments", f"{name}: {problem}", span)
    return ToolCall(name, arguments, span)


def parse_turn(text: str, tools: Mapping[str, Any], *, max_calls: int = 1,
               max_call_chars: int = 16384) -> ParsedTurn:
    """The calls in one policy turn.

    Args:
      tools: name -> :class:`~rl_jax.envs.tools.base.Tool` (its ``argument_error`` checks the
        arguments) of the tools this episode offers.
      max_calls: well-formed calls run per turn; those beyond it are ``several_calls`` errors.
      max_call_chars: the longest block (between the tags) parsed.
    """
    calls: list[ToolCall] = []
    errors: list[CallError] = []
    outside: list[str] = []
    start: int | None = None  # of the open block's <tool_call>
    last = 0  # end of the text already assigned
    for m in _TAG.finditer(text):
        if m.group() == OPEN:
            if start is not None:  # a second <tool_call> before the first closed
                errors.append(CallError("unclosed", f"{OPEN} at character {start} was not "
                                        f"closed before the next {OPEN}", (start, m.start())))
            else:
                outside.append(text[last:m.start()])
            start, last = m.start(), m.start()
            continue
        if start is None:
            errors.append(CallError("stray_close", f"{CLOSE} at character {m.start()} without "
                                    f"a {OPEN} before it", (m.start(), m.end())))
            outside.append(text[last:m.start()])
            last = m.end()
            continue
        span, body = (start, m.end()), text[start + len(OPEN):m.start()]
        start, last = None, m.end()
        if span[0] > 0 and (text[span[0] - 1].isalnum() or text[span[0] - 1] == "_"):
            errors.append(CallError("mid_word", f"{OPEN} must not follow a letter or digit",
                                    span))
        elif len(body) > max_call_chars:
            errors.append(CallError("too_long", f"the call has {len(body)} characters (at most "
                                    f"{max_call_chars})", span))
        else:
            decoded = _decode(body.strip(), tools, span)
            if isinstance(decoded, CallError):
                errors.append(decoded)
            elif len(calls) >= max_calls:
                errors.append(CallError("several_calls", f"at most {max_calls} call(s) a turn; "
                                        f"this one ({decoded.name}) was not run", span))
            else:
                calls.append(decoded)
    if start is not None:
        errors.append(CallError("unclosed", f"{OPEN} at character {start} was not closed",
                                (start, len(text))))
    else:
        outside.append(text[last:])
    return ParsedTurn(tuple(calls), tuple(errors), "".join(outside))


# How the results of a turn's calls go back to the policy: the tool turn of each chat format.
# "qwen": the assistant turn (stopped at </tool_call>) is closed, the results come in a user
# turn of <tool_response> blocks, and a new assistant turn opens (Qwen2.5's template).
STYLES = {
    "qwen": ("<|im_end|>\n<|im_start|>user\n", "\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "plain": ("\n", "\n", "\n"),
}


def render_results(results: Sequence[str], style: str = "qwen") -> str:
    """The observation that carries ``results`` (one text per call or call error, in order)."""
    if style not in STYLES:
        raise ValueError(f"unknown tool-turn style {style!r}; known: {sorted(STYLES)}")
    before, between, after = STYLES[style]
    # A result cannot close its own block or open a call: it is the environment's text.
    blocks = [f"{RESPONSE_OPEN}\n" + r.replace(RESPONSE_CLOSE, "</tool_response >")
              .replace(OPEN, "<tool_call >") + f"\n{RESPONSE_CLOSE}" for r in results]
    return before + between.join(blocks) + after


def render_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A well-formed call block, as a policy writes one (supervised traces, tests)."""
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": dict(arguments)}) + f"\n{CLOSE}"
