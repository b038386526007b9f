"""Supervised traces of tool-using episodes, for the base policy of the tool-use recipe
(``configs/tool_lm.py`` -> ``configs/tool_rl.py``): long additions
(:class:`~rl_jax.data.long_addition.LongAdditionTask`) answered either in the head or through
the calculator, in exactly the text :class:`~rl_jax.envs.tool_use.ToolUseEnv` exchanges with a
policy (its call format, its rendering of results and of errors).

Example ``i`` is, by a draw of ``(seed, split, i)``:

- with probability ``1 - tool_fraction``, the sum written directly: ``"48213+90577=" ->
  "138790<eos>"`` (correct, but a small model cannot learn long sums this way);
- otherwise a call, its result, and the sum copied from it::

      48213+90577=<tool_call>
      {"name": "calculator", "arguments": {"expression": "48213+90577"}}
      </tool_call>|
      <tool_response>
      138790
      </tool_response>
      |138790<eos>

  and with probability ``malformed_fraction`` the call is first written wrongly (an argument
  misnamed, the JSON unclosed, the tool misnamed), answered with the environment's error, then
  written correctly.

:meth:`ToolTraces.example_segments` marks the environment's text (between the ``|`` above) as
not trained on; the policy's text and ``<eos>`` are.
"""

from __future__ import annotations

import dataclasses
import json
import string
from typing import ClassVar

import numpy as np

from rl_jax.data.long_addition import LongAdditionTask
from rl_jax.envs.tools.calculator import Calculator
from rl_jax.envs.tools.calls import (CLOSE, OPEN, RESPONSE_CLOSE, RESPONSE_OPEN, STYLES,
                                     parse_turn, render_call, render_results)

_SPLIT_CODES = {"train": 0, "eval": 1}
_TOOL = "calculator"


def _malformed_calls(expression: str) -> tuple[str, ...]:
    return (
        f"{OPEN}\n" + json.dumps({"name": _TOOL, "arguments": {"expr": expression}})
        + f"\n{CLOSE}",
        f"{OPEN}\n" + json.dumps({"name": _TOOL, "arguments": {"expression": expression}})[:-1]
        + f"\n{CLOSE}",
        f"{OPEN}\n" + json.dumps({"name": "calc", "arguments": {"expression": expression}})
        + f"\n{CLOSE}",
    )


@dataclasses.dataclass(frozen=True)
class ToolTraces:
    """The supervised task (the interface of :mod:`rl_jax.data.lm`'s tasks, with segments).

    Attributes:
      min_digits, max_digits, power, seed, split, eval_fraction: the additions'
        (:class:`~rl_jax.data.long_addition.LongAdditionTask`).
      tool_fraction: examples that use the calculator.
      malformed_fraction: of those, the ones whose first call is malformed.
      style: how results are rendered (as the environment's ``style``).
    """

    min_digits: int = 2
    max_digits: int = 12
    power: float = 0.0
    seed: int = 0
    split: str = "train"
    eval_fraction: float = 0.1
    tool_fraction: float = 0.3
    malformed_fraction: float = 0.25
    style: str = "plain"

    # Every printable ASCII character: what calls, results and error messages are written in.
    ALPHABET: ClassVar[str] = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    WORDS: ClassVar[tuple[str, ...]] = (OPEN, CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
    EOS_TEXT: ClassVar[str] = "<eos>"
    VARIABLE_LENGTH: ClassVar[bool] = True  # training batches are filled by tokens

    def __post_init__(self):
        for name in ("tool_fraction", "malformed_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.style not in STYLES:
            raise ValueError(f"unknown style {self.style!r}; known: {sorted(STYLES)}")
        self.additions  # checks the addition fields

    @property
    def additions(self) -> LongAdditionTask:
        return LongAdditionTask(min_digits=self.min_digits, max_digits=self.max_digits,
                                power=self.power, seed=self.seed, split=self.split,
                                eval_fraction=self.eval_fraction)

    @property
    def prompt_length(self) -> int:
        return self.additions.prompt_length

    @property
    def max_answer_length(self) -> int:
        """Most characters of a trace (a malformed call, its error, the call, the result, the
        answer), counted as characters: an upper bound on its tokens."""
        n = self.max_digits
        expression = "9" * n + "+" + "9" * n
        longest_error = max(len(self._error(bad)) for bad in _malformed_calls(expression))
        call = render_call(_TOOL, {"expression": expression})
        return (len(call) + 16) + longest_error + len(call) + len(
            render_results(["9" * (n + 1)], self.style)) + n + 1

    def with_split(self, split: str) -> ToolTraces:
        return dataclasses.replace(self, split=split)

    def _error(self, bad_call: str) -> str:
        parsed = parse_turn(bad_call, {_TOOL: Calculator()})
        assert parsed.errors and not parsed.calls, bad_call
        return render_results([parsed.errors[0].message()], self.style)

    def example_segments(self, index: int) -> tuple[str, list[tuple[str, bool]]]:
        """``(prompt, [(text, trained), ...])`` of example ``index`` (``<eos>`` not included)."""
        task = self.additions
        a, b = task.operands(index)
        prompt, answer = task.format_prompt(a, b), str(a + b)
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence(
            [self.seed, _SPLIT_CODES[self.split], int(index), 1])))
        if rng.random() >= self.tool_fraction:
            return prompt, [(answer, True)]
        expression = f"{a}+{b}"
        segments: list[tuple[str, bool]] = []
        if rng.random() < self.malformed_fraction:
            bad = _malformed_calls(expression)[int(rng.integers(3))]
            segments += [(bad, True), (self._error(bad), False)]
        segments += [(render_call(_TOOL, {"expression": expression}), True),
                     (render_results([answer], self.style), False), (answer, True)]
        return prompt, segments

    def example(self, index: int) -> tuple[str, str]:
        """``(prompt, completion)``: the whole trace as text."""
        prompt, segments = self.example_segments(index)
        return prompt, "".join(text for text, _ in segments)
