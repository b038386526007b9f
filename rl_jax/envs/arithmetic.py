"""Multi-digit addition as a reward environment, around the synthetic ``ArithmeticTask``.

Wraps :class:`rl_jax.data.arithmetic.ArithmeticTask`. Prompts are ``"123+456="``; the expected
completion is the sum (reversed when ``reverse_answer``), optionally followed by ``"<eos>"``.
The difficulty knob is ``num_digits``; the eval split holds out operand pairs (see the task's
docstring). The character alphabet for a tokenizer is :attr:`ArithmeticEnv.ALPHABET`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from rl_jax.data.arithmetic import ArithmeticTask
from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt

_PROMPT_RE = re.compile(r"^(\d+)\+(\d+)=$")


class ArithmeticEnv(Environment):
    """Exact-match reward for addition.

    Args:
      num_digits: digits per operand (1..18), the difficulty knob.
      reverse_answer: expect the sum least-significant digit first.
      seed: selects the prompt stream.
      eval_fraction: fraction of operand pairs held out for the eval split.
      format_reward: reward of a wrong answer made only of digits (the right format).
      partial_credit: reward a wrong answer with the fraction of answer positions it got right
        (``matching / max(len(expected), len(given))``), if that beats ``format_reward``.

    Reward: 1 for the exact answer, else as above, else 0.
    """

    name: ClassVar[str] = "arithmetic"
    ALPHABET: ClassVar[str] = ArithmeticTask.ALPHABET
    EOS_TEXT: ClassVar[str] = ArithmeticTask.EOS_TEXT

    def __init__(self, num_digits: int = 3, *, reverse_answer: bool = True, seed: int = 0,
                 eval_fraction: float = 0.1, format_reward: float = 0.0,
                 partial_credit: bool = False):
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        self.task = ArithmeticTask(num_digits=num_digits, reverse_answer=reverse_answer,
                                   seed=seed, split="train", eval_fraction=eval_fraction)
        self.format_reward = float(format_reward)
        self.partial_credit = bool(partial_credit)

    def prompt(self, index: int, split: str = "train") -> Prompt:
        task = self.task.with_split(split)
        a, b = task.operands(index)
        return Prompt(text=task.format_prompt(a, b), answer=task.format_answer(a, b),
                      info={"operands": (a, b)}, index=int(index), split=split)

    def _operands(self, prompt: Prompt) -> tuple[int, int]:
        if "operands" in prompt.info:
            a, b = prompt.info["operands"]
            return int(a), int(b)
        match = _PROMPT_RE.match(prompt.text)
        if match is None:
            raise EnvError(f"not an addition prompt of the form '123+456=': {prompt.text!r}")
        return int(match[1]), int(match[2])

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        a, b = self._operands(as_prompt(prompt))
        expected = self.task.format_answer(a, b)
        if self.task.check((a, b), completion):
            return 1.0, {"correct": True, "reason": "correct", "expected": expected}
        given = completion.removesuffix(self.EOS_TEXT)
        well_formed = given.isdigit() and given.isascii()
        reward = self.format_reward if well_formed else 0.0
        if self.partial_credit and given:
            matching = sum(x == y for x, y in zip(given, expected))
            reward = max(reward, matching / max(len(expected), len(given)))
        return reward, {"correct": False, "reason": "wrong_answer" if well_formed else "bad_format",
                        "expected": expected}
