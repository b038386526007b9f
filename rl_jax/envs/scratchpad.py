"""Long addition with written work as a reward environment (:mod:`rl_jax.data.scratchpad`).

Prompts line the two numbers' columns up, units first (``"a79b01c52="`` for 507 + 219); a
completion works through the columns, one step each (``"a:7+9+0=1,6;b:0+1+1=0,2;..."``), and its
answer is the number those steps spell. Its length follows the problem (2 to 25 digits, 25 to 301
tokens).
"""

from __future__ import annotations

from typing import Any, ClassVar

from rl_jax.data.prompts import Prompt
from rl_jax.data.scratchpad import ScratchpadAdditionTask
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt


class ScratchpadEnv(Environment):
    """Exact-answer reward for long addition with written work.

    Args:
      min_digits, max_digits, power: the problem sizes (see :class:`ScratchpadAdditionTask`).
      seed: selects the prompt stream.
      eval_fraction: fraction of operand pairs held out for the eval split.
      format_reward: reward of well-formed work (one step per column, lettered in order) whose
        answer is wrong.

    Reward: 1 when the work spells the sum; ``format_reward`` for well-formed work that does
    not; 0 otherwise: a step too many or too few, steps out of order, anything after the work
    but one ``<eos>``. ``info["digits"]`` is the problem's size.
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
        return Prompt(text=task.format_prompt(a, b, n), answer=str(a + b),
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
        info: dict[str, Any] = {"expected": str(a + b), "digits": n}
        stated = (self.task.stated_answer(completion, n) if isinstance(completion, str)
                  else None)
        if stated is None:
            return 0.0, {**info, "correct": False, "reason": "bad_format"}
        if stated == a + b:
            return 1.0, {**info, "correct": True, "reason": "correct"}
        return self.format_reward, {**info, "correct": False, "reason": "wrong_answer"}
