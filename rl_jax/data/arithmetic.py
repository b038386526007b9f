"""Synthetic addition: ``"123+456="`` → ``"975"`` (the sum, least-significant digit first).

Operands are uniform in ``[0, 10**num_digits)`` and written zero-padded to ``num_digits`` digits,
so every prompt has ``2 * num_digits + 2`` characters; the sum is written without leading zeros
(``1..num_digits + 1`` characters), reversed when ``reverse_answer`` (the order in which a
left-to-right model can compute the carries).

Example ``i`` of a split is a pure function of ``(seed, split, i)``: its operands come from a Philox
generator seeded by ``SeedSequence([seed, split, i])``, so any example can be regenerated alone.
Train and eval are disjoint as problems: an unordered operand pair belongs to the eval split iff a
fixed hash of it (independent of the seed) falls below ``eval_fraction``; each split rejects the
other split's pairs. ``a+b`` and ``b+a`` therefore always land in the same split.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar

import numpy as np

_SPLIT_CODES = {"train": 0, "eval": 1}
# Draws before giving up on finding a pair of the requested split (only reachable when a split
# holds almost no pairs, e.g. one-digit operands with a tiny eval_fraction).
_MAX_DRAWS = 10_000


def operand_pair_in_eval(a: int, b: int, eval_fraction: float) -> bool:
    """Whether the unordered pair ``{a, b}`` belongs to the held-out split.

    A fixed 64-bit hash of the pair, read as a fraction of ``2**64``, is compared with
    ``eval_fraction``; it does not depend on any seed or on the number of digits.
    """
    lo, hi = (a, b) if a <= b else (b, a)
    digest = hashlib.blake2b(f"{lo}+{hi}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2.0**64


def check_split_fields(split: str, eval_fraction: float, seed: int) -> None:
    """Raises ``ValueError`` naming the field unless ``split`` is "train" or "eval",
    ``0 < eval_fraction < 1`` and ``seed >= 0`` (what every split-hashed synthetic task needs)."""
    if split not in _SPLIT_CODES:
        raise ValueError(f"split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Addition of two ``num_digits``-digit numbers, with exact-match checking.

    Attributes:
      num_digits: digits per operand (1..18); the difficulty knob.
      reverse_answer: write the sum least-significant digit first.
      seed: selects the example stream; the train/eval assignment of pairs does not depend on it.
      split: ``"train"`` or ``"eval"``.
      eval_fraction: fraction of unordered operand pairs held out for eval.
    """

    num_digits: int = 3
    reverse_answer: bool = True
    seed: int = 0
    split: str = "train"
    eval_fraction: float = 0.1

    ALPHABET: ClassVar[str] = "0123456789+="
    EOS_TEXT: ClassVar[str] = "<eos>"

    def __post_init__(self):
        if not 1 <= self.num_digits <= 18:
            raise ValueError(f"num_digits must be in 1..18, got {self.num_digits}")
        check_split_fields(self.split, self.eval_fraction, self.seed)

    # Lengths, in characters.
    @property
    def prompt_length(self) -> int:
        """Characters in every prompt: ``2 * num_digits + 2``."""
        return 2 * self.num_digits + 2

    @property
    def max_answer_length(self) -> int:
        """Most characters in an answer: ``num_digits + 1``."""
        return self.num_digits + 1

    def with_split(self, split: str) -> ArithmeticTask:
        """The same task (digits, seed, eval fraction) on another split."""
        return dataclasses.replace(self, split=split)

    def in_split(self, a: int, b: int) -> bool:
        """Whether the pair ``(a, b)`` can occur in this task's split."""
        return operand_pair_in_eval(a, b, self.eval_fraction) == (self.split == "eval")

    def operands(self, index: int) -> tuple[int, int]:
        """The operand pair of example ``index`` (any non-negative integer)."""
        index = int(index)
        if index < 0:
            raise ValueError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[self.split], index])))
        high = 10**self.num_digits
        for _ in range(_MAX_DRAWS):
            a, b = (int(x) for x in rng.integers(0, high, size=2))
            if self.in_split(a, b):
                return a, b
        raise RuntimeError(f"no {self.split} operand pair found in {_MAX_DRAWS} draws for "
                           f"num_digits={self.num_digits}, eval_fraction={self.eval_fraction}")

    def format_prompt(self, a: int, b: int) -> str:
        """``"{a}+{b}="`` with both operands zero-padded to ``num_digits``."""
        n = self.num_digits
        return f"{a:0{n}d}+{b:0{n}d}="

    def format_answer(self, a: int, b: int) -> str:
        """The sum's decimal digits, reversed if ``reverse_answer``."""
        text = str(a + b)
        return text[::-1] if self.reverse_answer else text

    def example(self, index: int) -> tuple[str, str]:
        """``(prompt, answer)`` of example ``index``."""
        a, b = self.operands(index)
        return self.format_prompt(a, b), self.format_answer(a, b)

    def prompt(self, index: int) -> str:
        """The prompt of example ``index``, e.g. ``"123+456="``."""
        return self.format_prompt(*self.operands(index))

    def answer(self, index: int) -> str:
        """The expected completion of example ``index``, e.g. ``"975"``."""
        return self.format_answer(*self.operands(index))

    def check(self, index_or_operands: int | tuple[int, int], completion: str) -> bool:
        """Exact match of a completion against the answer.

        Args:
          index_or_operands: an example index of this split, or an operand pair ``(a, b)``.
          completion: the generated text; one trailing ``"<eos>"`` is allowed, nothing else.
        """
        if isinstance(index_or_operands, tuple):
            a, b = (int(x) for x in index_or_operands)
        else:
            a, b = self.operands(index_or_operands)
        if completion.endswith(self.EOS_TEXT):
            completion = completion[:-len(self.EOS_TEXT)]
        return completion == self.format_answer(a, b)
