"""Long addition with written work as a reward environment (:mod:`rl_jax.data.scratchpad`).

Prompts are ``"c5b0a7+c2b1a9="`` (every digit after the letter of its place); a completion writes
the columns out and ends with ``|`` and the tagged sum. Only the stated result is graded: the
work before it is the policy's own business, and its length follows the problem (2 to 25 digits,
26 to 314 characters).
"""

from __future__ import annotations

from typing import Any, ClassVar

from rl_jax.data.prompts import Prompt
from rl_jax.data.scratchpad import ScratchpadAdditionTask
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt


class ScratchpadEnv(Environment):
    """Exact-result reward for long addition with a scratchpad.

    Args:
      min_digits, max_digits, power: the problem sizes (see :class:`ScratchpadAdditionTask`).
      seed: selects the prompt stream.
      eval_fraction: fraction of operand pairs held out for the eval split.
      format_reward: reward of a wrong but well-formed result (one ``|``, then tagged digits).

    Reward: 1 for the exact result; ``format_reward`` for a well-formed wrong one; 0 otherwise,
    including completions that state more than one result (a ``|`` more than once).
    ``info["digits"]`` is the problem's size.
    """

    name: ClassVar[str] = "scratchpad"
    ALPHABET: ClassVar[str] = ScratchpadAdditionTask.ALPHABET
    EOS_TEXT: ClassVar[str] = ScratchpadAdditionTask.EOS_TEXT

    def __init__(self, min_digits: int = 2, max_digits: int = 25, *, power: float = 1.3,
                 seed: int = 0, eval_fraction: float = 0.1, format_reward: float = 0.0):
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        try:
            self.task = ScratchpadAdditionTask(min_digits=min_digits, max_digits=max_digits,
                                               power=power, seed=seed, split="train",
                                               eval_fraction=eval_fraction)
        except ValueError as e:
            raise EnvError(str(e)) from None
        self.format_reward = float(format_reward)

    def prompt(self, index: int, split: str = "train") -> Prompt:
        task = self.task.with_split(split)
        a, b, n = task.operands(index)
        return Prompt(text=task.format_prompt(a, b, n), answer=task.format_result(a, b, n),
                      info={"operands": (a, b, n)}, index=int(index), split=split)

    def _operands(self, prompt: Prompt) -> tuple[int, int, int]:
        if "operands" in prompt.info:
            a, b, n = prompt.info["operands"]
            return int(a), int(b), int(n)
        try:
            return ScratchpadAdditionTask.parse_prompt(prompt.text)
        except ValueError as e:
            raise EnvError(str(e)) from None

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        a, b, n = self._operands(as_prompt(prompt))
        expected = self.task.format_result(a, b, n)
        info: dict[str, Any] = {"expected": expected, "digits": n}
        if not isinstance(completion, str):
            return 0.0, {**info, "correct": False, "reason": "bad_format"}
        if completion.count("|") > 1:
            return 0.0, {**info, "correct": False, "reason": "several_answers"}
        stated = self.task.final_result(completion)
        if stated is None:
            reason = "no_answer" if "|" not in completion else "bad_format"
            return 0.0, {**info, "correct": False, "reason": reason}
        if stated == expected:
            return 1.0, {**info, "correct": True, "reason": "correct"}
        return self.format_reward, {**info, "correct": False, "reason": "wrong_answer"}
