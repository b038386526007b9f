"""Long addition written out column by column: a task whose answers need variable-length reasoning.

A problem adds two ``n``-digit numbers; ``n`` varies from problem to problem (``min_digits`` to
``max_digits``, small sizes more likely: the mass of a truncated power law ``n ** -power``), so
the written work, and the completion's length, follows the problem: 12 characters per column,
25 to 301 in all. The prompt gives the columns lined up, units first, each after the letter of
its place (``a`` units, ``b`` tens, ...); the completion works through them, one step per column,
carrying as it goes::

    507 + 219:  prompt      a79b01c52=
                completion  a:7+9+0=1,6;b:0+1+1=0,2;c:5+2+0=0,7;

A step is ``<letter>:<digit of A>+<digit of B>+<carry in>=<carry out>,<digit>;``. The answer is
the number the steps spell: their digits, units first, under the last step's carry
(``726`` above). Every fact a step needs is its own column in the prompt (found by its letter)
or the step before it, however long the problem: what makes a long problem harder is only that
it has more columns to get right.

Example ``i`` of a split is a pure function of ``(seed, split, i)`` (a Philox generator seeded by
``SeedSequence([seed, split, i])``); an unordered operand pair belongs to the held-out split iff
a fixed hash of it falls below ``eval_fraction`` (:func:`operand_pair_in_eval`), whatever the
seed, so train and eval never share a problem.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import numpy as np

from rl_jax.data.arithmetic import check_split_fields, operand_pair_in_eval

_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
LETTERS = "abcdefghijklmnopqrstuvwxyz"
STEP_CHARS = 12  # "a:7+9+0=1,6;"
# ASCII digits only ([0-9]: \d takes any script's digits).
_STEP_RE = re.compile(r"([a-z]):([0-9])\+([0-9])\+([0-9])=([0-9]),([0-9]);")
_WORK_RE = re.compile(r"(?:[a-z]:[0-9]\+[0-9]\+[0-9]=[0-9],[0-9];)+")
_PROMPT_RE = re.compile(r"(?:[a-z][0-9][0-9])+=")


@dataclasses.dataclass(frozen=True)
class ScratchpadAdditionTask:
    """Addition of two ``n``-digit numbers with a written column-by-column trace.

    Attributes:
      min_digits, max_digits: the range of ``n`` (1 <= min <= max <= 26).
      power: ``P(n) ∝ n ** -power`` over that range (0: uniform); the defaults give a median of
        5 digits (61 characters of work, with ``<eos>``), a 95th percentile of 21 (253) and a
        mean of 83.
      seed: selects the example stream; the train/eval assignment does not depend on it.
      split: ``"train"`` or ``"eval"``.
      eval_fraction: fraction of operand pairs held out.
    """

    min_digits: int = 2
    max_digits: int = 25
    power: float = 1.3
    seed: int = 0
    split: str = "train"
    eval_fraction: float = 0.1

    ALPHABET: ClassVar[str] = "0123456789+=:,;" + LETTERS
    VARIABLE_LENGTH: ClassVar[bool] = True  # training batches are filled by tokens
    EOS_TEXT: ClassVar[str] = "<eos>"

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= len(LETTERS):
            raise ValueError(f"need 1 <= min_digits <= max_digits <= {len(LETTERS)}, got "
                             f"{self.min_digits}..{self.max_digits}")
        if not self.power >= 0:
            raise ValueError(f"power must be >= 0, got {self.power}")
        check_split_fields(self.split, self.eval_fraction, self.seed)

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def digit_probabilities(self) -> np.ndarray:
        """``P(n)`` for ``n`` in ``min_digits..max_digits``."""
        n = np.arange(self.min_digits, self.max_digits + 1, dtype=np.float64)
        weights = n ** -self.power
        return weights / weights.sum()

    @property
    def prompt_length(self) -> int:
        """Most characters in a prompt (``3 * max_digits + 1``)."""
        return 3 * self.max_digits + 1

    @property
    def max_answer_length(self) -> int:
        """Most characters in a completion (the work of the largest problem)."""
        return STEP_CHARS * self.max_digits

    def with_split(self, split: str) -> ScratchpadAdditionTask:
        return dataclasses.replace(self, split=split)

    def in_split(self, a: int, b: int) -> bool:
        return operand_pair_in_eval(a, b, self.eval_fraction) == (self.split == "eval")

    # ---- examples -------------------------------------------------------------------------------

    def operands(self, index: int) -> tuple[int, int, int]:
        """``(a, b, n)`` of example ``index``: two ``n``-digit numbers (leading zeros allowed)."""
        index = int(index)
        if index < 0:
            raise ValueError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[self.split], index])))
        n = int(rng.choice(np.arange(self.min_digits, self.max_digits + 1),
                           p=self.digit_probabilities))
        for _ in range(_MAX_DRAWS):
            a, b = (int("".join(map(str, rng.integers(0, 10, size=n)))) for _ in range(2))
            if self.in_split(a, b):
                return a, b, n
        raise RuntimeError(f"no {self.split} operand pair of {n} digits in {_MAX_DRAWS} draws")

    @staticmethod
    def format_prompt(a: int, b: int, n: int) -> str:
        """The columns, units first: ``<letter><digit of a><digit of b>`` each, then ``=``."""
        da, db = f"{a:0{n}d}"[::-1], f"{b:0{n}d}"[::-1]
        return "".join(LETTERS[i] + da[i] + db[i] for i in range(n)) + "="

    @staticmethod
    def format_completion(a: int, b: int, n: int) -> str:
        """The whole written work (what the supervised recipe trains on)."""
        da, db = f"{a:0{n}d}"[::-1], f"{b:0{n}d}"[::-1]
        steps, carry = [], 0
        for i in range(n):
            column = int(da[i]) + int(db[i]) + carry
            steps.append(f"{LETTERS[i]}:{da[i]}+{db[i]}+{carry}={column // 10},{column % 10};")
            carry = column // 10
        return "".join(steps)

    def example(self, index: int) -> tuple[str, str]:
        """``(prompt, completion)`` of example ``index``."""
        a, b, n = self.operands(index)
        return self.format_prompt(a, b, n), self.format_completion(a, b, n)

    # ---- checking -------------------------------------------------------------------------------

    @staticmethod
    def parse_prompt(prompt: str) -> tuple[int, int, int]:
        """``(a, b, n)`` of a prompt written by :meth:`format_prompt`; ``ValueError`` otherwise."""
        if not isinstance(prompt, str) or not _PROMPT_RE.fullmatch(prompt):
            raise ValueError(f"not a scratchpad addition prompt: {str(prompt)[:80]!r}")
        n = (len(prompt) - 1) // 3
        if prompt[0:-1:3] != LETTERS[:n]:
            raise ValueError(f"the columns of a scratchpad addition prompt must be lettered "
                             f"a, b, c, ... in order: {prompt[:80]!r}")
        a, b = int(prompt[1:-1:3][::-1]), int(prompt[2:-1:3][::-1])
        return a, b, n

    def stated_answer(self, completion: str, n: int) -> int | None:
        """The number the completion's work spells, if it is exactly ``n`` well-formed steps
        lettered ``a, b, c, ...`` in order (one trailing ``<eos>`` allowed); else None."""
        text = completion.removesuffix(self.EOS_TEXT)
        if len(text) != STEP_CHARS * n or not _WORK_RE.fullmatch(text):
            return None
        steps = _STEP_RE.findall(text)
        if "".join(s[0] for s in steps) != LETTERS[:n]:
            return None
        digits = "".join(s[5] for s in steps)[::-1]
        return int(steps[-1][4] + digits)

    def check(self, operands: tuple[int, int, int], completion: str) -> bool:
        """Whether the completion's work spells the sum (see :meth:`stated_answer`)."""
        a, b, n = operands
        return self.stated_answer(completion, n) == a + b
