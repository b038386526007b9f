"""Long addition written out digit by digit: a task whose answers need variable-length reasoning.

A problem adds two ``n``-digit numbers; ``n`` varies from problem to problem (``min_digits`` to
``max_digits``, small sizes more likely: the mass of a truncated power law ``n ** -power``), so
the written work, and the completion's length, follows the problem: 12 characters per digit,
26 to 300 and more. Every digit carries an index letter (``a`` for the units, ``b`` for
the tens, ...), so a small model finds the digits of one column by their letter, as a person
finds them by lining the numbers up::

    prompt      c5b0a7+c2b1a9=
    completion  a7+9+0=16;b0+1+1=02;c5+2+0=07;|c7b1a6

One step per column, units first: ``<letter><digit of A>+<digit of B>+<carry in>=<two-digit
column sum>;`` (the sum's first digit is the carry out, its second the result's digit), then
``|`` and the result, most significant digit first, each digit after its letter (a final carry
gets the next letter: ``|d1c0...``). The answer checked is the result after the last ``|``.

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

from rl_jax.data.arithmetic import operand_pair_in_eval

_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
LETTERS = "abcdefghijklmnopqrstuvwxyz"
STEP_CHARS = 10  # "a7+9+0=16;"
_RESULT_RE = re.compile(r"(?:[a-z][0-9])+")  # ASCII digits only (\d takes any script's)


@dataclasses.dataclass(frozen=True)
class ScratchpadAdditionTask:
    """Addition of two ``n``-digit numbers with a written column-by-column trace.

    Attributes:
      min_digits, max_digits: the range of ``n`` (1 <= min <= max <= 25).
      power: ``P(n) ∝ n ** -power`` over that range (0: uniform); the defaults give a median of
        5 digits (62 characters of completion), a 95th percentile of 21 (254) and a mean of 87.
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

    ALPHABET: ClassVar[str] = "0123456789+=;|" + LETTERS
    EOS_TEXT: ClassVar[str] = "<eos>"

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= len(LETTERS) - 1:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= {len(LETTERS) - 1}, got "
                             f"{self.min_digits}..{self.max_digits}")
        if not self.power >= 0:
            raise ValueError(f"power must be >= 0, got {self.power}")
        if self.split not in _SPLIT_CODES:
            raise ValueError(f"split must be one of {sorted(_SPLIT_CODES)}, got {self.split!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def digit_probabilities(self) -> np.ndarray:
        """``P(n)`` for ``n`` in ``min_digits..max_digits``."""
        n = np.arange(self.min_digits, self.max_digits + 1, dtype=np.float64)
        weights = n ** -self.power
        return weights / weights.sum()

    @property
    def prompt_length(self) -> int:
        """Most characters in a prompt (``4 * max_digits + 2``)."""
        return 4 * self.max_digits + 2

    @property
    def max_answer_length(self) -> int:
        """Most characters in a completion (the trace of the largest problem)."""
        return self.completion_length(self.max_digits, carry=True)

    @staticmethod
    def completion_length(n: int, *, carry: bool) -> int:
        """Characters of the completion of an ``n``-digit problem (with a final carry or not)."""
        return STEP_CHARS * n + 1 + 2 * (n + int(carry))

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
    def tagged(digits: str) -> str:
        """``"507"`` → ``"c5b0a7"``: each digit after the letter of its place."""
        k = len(digits)
        return "".join(LETTERS[k - 1 - i] + d for i, d in enumerate(digits))

    def format_prompt(self, a: int, b: int, n: int) -> str:
        return f"{self.tagged(f'{a:0{n}d}')}+{self.tagged(f'{b:0{n}d}')}="

    def format_result(self, a: int, b: int, n: int) -> str:
        """The tagged sum, ``n`` digits plus a final carry when there is one."""
        total = a + b
        width = n + 1 if total >= 10**n else n
        return self.tagged(f"{total:0{width}d}")

    def format_completion(self, a: int, b: int, n: int) -> str:
        """The whole written work and result (what the supervised recipe trains on)."""
        da, db = f"{a:0{n}d}"[::-1], f"{b:0{n}d}"[::-1]
        steps, carry = [], 0
        for i in range(n):
            column = int(da[i]) + int(db[i]) + carry
            steps.append(f"{LETTERS[i]}{da[i]}+{db[i]}+{carry}={column:02d};")
            carry = column // 10
        return "".join(steps) + "|" + self.format_result(a, b, n)

    def example(self, index: int) -> tuple[str, str]:
        """``(prompt, completion)`` of example ``index``."""
        a, b, n = self.operands(index)
        return self.format_prompt(a, b, n), self.format_completion(a, b, n)

    # ---- checking -------------------------------------------------------------------------------

    @staticmethod
    def parse_prompt(prompt: str) -> tuple[int, int, int]:
        """``(a, b, n)`` of a prompt written by :meth:`format_prompt`; ``ValueError`` otherwise."""
        match = re.fullmatch(r"((?:[a-z][0-9])+)\+((?:[a-z][0-9])+)=", prompt)
        if match is None:
            raise ValueError(f"not a scratchpad addition prompt: {prompt[:80]!r}")
        a, b = match[1][1::2], match[2][1::2]
        if len(a) != len(b) or match[1] != ScratchpadAdditionTask.tagged(a) \
                or match[2] != ScratchpadAdditionTask.tagged(b):
            raise ValueError(f"malformed scratchpad addition prompt: {prompt[:80]!r}")
        return int(a), int(b), len(a)

    def final_result(self, completion: str) -> str | None:
        """The result the completion states: what follows its last ``|`` (one trailing
        ``<eos>`` allowed), if it is a well-formed tagged number; else None."""
        text = completion.removesuffix(self.EOS_TEXT)
        if "|" not in text:
            return None
        result = text.rsplit("|", 1)[1]
        return result if _RESULT_RE.fullmatch(result) else None

    def check(self, operands: tuple[int, int, int], completion: str) -> bool:
        """Whether the completion's final result is the sum, exactly as :meth:`format_result`
        writes it (the work before it is not graded)."""
        return self.final_result(completion) == self.format_result(*operands)
