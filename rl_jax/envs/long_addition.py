"""Long addition written plainly as a reward environment (:class:`rl_jax.data.long_addition.
LongAdditionTask`): prompts ``"48213+90577="``, reward 1 for exactly the sum's digits (one
trailing ``<eos>`` allowed). The task of the tool-use recipe (``configs/tool_rl.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

from rl_jax.data.long_addition import LongAdditionTask
from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt


class LongAdditionEnv(Environment):
    """Args: ``min_digits``, ``max_digits``, ``power``, ``seed``, ``eval_fraction`` as
    :class:`~rl_jax.data.long_addition.LongAdditionTask` takes them."""

    name: ClassVar[str] = "long_addition"
    ALPHABET: ClassVar[str] = LongAdditionTask.ALPHABET
    EOS_TEXT: ClassVar[str] = LongAdditionTask.EOS_TEXT

    def __init__(self, min_digits: int = 2, max_digits: int = 12, *, power: float = 0.0,
                 seed: int = 0, eval_fraction: float = 0.1):
        try:
            self.task = LongAdditionTask(min_digits=min_digits, max_digits=max_digits,
                                         power=power, seed=seed, eval_fraction=eval_fraction)
        except ValueError as e:
            raise EnvError(f"long_addition: {e}") from None

    def prompt(self, index: int, split: str = "train") -> Prompt:
        task = self.task.with_split(split)
        a, b = task.operands(index)
        return Prompt(text=task.format_prompt(a, b), answer=str(a + b),
                      info={"operands": (a, b)}, index=int(index), split=split)

    def _operands(self, prompt: Prompt) -> tuple[int, int]:
        if "operands" in prompt.info:
            a, b = prompt.info["operands"]
            return int(a), int(b)
        try:
            return self.task.parse_prompt(prompt.text)
        except ValueError as e:
            raise EnvError(str(e)) from None

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        a, b = self._operands(as_prompt(prompt))
        if self.task.check((a, b), completion):
            return 1.0, {"correct": True, "reason": "correct"}
        given = completion.removesuffix(self.EOS_TEXT)
        reason = "no_answer" if not given.strip() else \
            "wrong_answer" if given.isascii() and given.isdigit() else "bad_format"
        return 0.0, {"correct": False, "reason": reason}
