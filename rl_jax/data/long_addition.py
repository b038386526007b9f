"""Addition of long numbers written plainly, ``"48213+90577="`` -> ``"138790"``: a task a small
model does poorly in its head once the numbers are long (the answer's first digit depends on
every carry), and exactly with a calculator. The tool-use recipe's task
(:mod:`rl_jax.envs.long_addition`, :mod:`rl_jax.envs.tool_use`).

A problem adds two ``n``-digit numbers (no leading zeros), ``n`` drawn from ``min_digits`` to
``max_digits`` with ``P(n) ∝ n ** -power`` (0: uniform). Example ``i`` of a split is a pure
function of ``(seed, split, i)``; an unordered operand pair belongs to the held-out split iff a
fixed hash of it falls below ``eval_fraction``
(:func:`~rl_jax.data.arithmetic.operand_pair_in_eval`), whatever the seed, so train and eval
never share a problem.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from rl_jax.data.arithmetic import check_split_fields, operand_pair_in_eval

_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
_PROMPT_RE = re.compile(r"(0|[1-9][0-9]{0,59})\+(0|[1-9][0-9]{0,59})=")


@dataclasses.dataclass(frozen=True)
class LongAdditionTask:
    """Attributes:
      min_digits, max_digits: the range of ``n`` (1 <= min <= max <= 60).
      power: ``P(n) ∝ n ** -power`` over that range (0: uniform).
      seed, split, eval_fraction: as the other synthetic tasks'.
    """

    min_digits: int = 2
    max_digits: int = 12
    power: float = 0.0
    seed: int = 0
    split: str = "train"
    eval_fraction: float = 0.1

    ALPHABET: ClassVar[str] = "0123456789+="
    EOS_TEXT: ClassVar[str] = "<eos>"

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= 60:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 60, got "
                             f"{self.min_digits}..{self.max_digits}")
        if not self.power >= 0:
            raise ValueError(f"power must be >= 0, got {self.power}")
        check_split_fields(self.split, self.eval_fraction, self.seed)

    @property
    def prompt_length(self) -> int:
        return 2 * self.max_digits + 2

    @property
    def max_answer_length(self) -> int:
        return self.max_digits + 1

    def with_split(self, split: str) -> LongAdditionTask:
        return dataclasses.replace(self, split=split)

    def operands(self, index: int) -> tuple[int, int]:
        index = int(index)
        if index < 0:
            raise ValueError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[self.split], index])))
        sizes = np.arange(self.min_digits, self.max_digits + 1)
        weights = sizes.astype(np.float64) ** -self.power
        n = int(rng.choice(sizes, p=weights / weights.sum()))
        low = 10 ** (n - 1) if n > 1 else 0
        for _ in range(_MAX_DRAWS):
            a, b = (int(rng.integers(low, 10 ** n)) for _ in range(2))
            if operand_pair_in_eval(a, b, self.eval_fraction) == (self.split == "eval"):
                return a, b
        raise RuntimeError(f"no {self.split} operand pair of {n} digits in {_MAX_DRAWS} draws")

    @staticmethod
    def format_prompt(a: int, b: int) -> str:
        return f"{a}+{b}="

    @staticmethod
    def parse_prompt(prompt: str) -> tuple[int, int]:
        m = _PROMPT_RE.fullmatch(prompt) if isinstance(prompt, str) else None
        if m is None:
            raise ValueError(f"not a long-addition prompt '123+456=': {str(prompt)[:80]!r}")
        return int(m[1]), int(m[2])

    def example(self, index: int) -> tuple[str, str]:
        a, b = self.operands(index)
        return self.format_prompt(a, b), str(a + b)

    def check(self, operands: tuple[int, int], completion: str) -> bool:
        """The completion is the sum's digits (one trailing ``<eos>`` allowed), nothing else."""
        text = completion.removesuffix(self.EOS_TEXT)
        return text.isascii() and text.isdigit() and len(text) <= 61 \
            and int(text) == sum(operands) and not (len(text) > 1 and text[0] == "0")
