"""Sorting a list of integers as a reward environment.

A task with an exact, cheap check whose difficulty grows smoothly with the list's length and
the numbers' size: the model must reproduce every number (no dropping, no duplicating) in order.
Instances are drawn uniformly: ``num_items`` integers in ``[0, max_value]`` (repeats allowed).
Example ``i`` of a split is a pure function of ``(seed, split, i)``; an instance belongs to the
eval split iff a seed-free hash of its sorted numbers is below ``eval_fraction``, so the splits
never share a multiset of numbers.

Prompt styles: ``"compact"`` (``"31,7,19="``, alphabet :attr:`SortingEnv.ALPHABET`, for
character tokenizers; the completion is ``"7,19,31"``) and ``"instruct"`` (an instruction asking
for the list inside ``<answer></answer>``). ``descending=True`` asks for the reverse order
(compact prompts then end in ``">"``, e.g. ``"31,7,19>"``).

An answer is the content of the last ``<answer>...</answer>``, else the last non-empty line;
it must be comma-separated decimal integers written canonically (ASCII digits, no sign, no
leading zeros), spaces around commas allowed. Completions longer than
:data:`MAX_COMPLETION_CHARS` and numbers with more digits than :data:`MAX_VALUE` score 0 without
being converted, so hostile answers cost little and never reach Python's limit on the digits of
an ``int``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, ClassVar

import numpy as np

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt

MAX_COMPLETION_CHARS = 65_536
MAX_ITEMS = 64
MAX_VALUE = 10**9
_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
_COMPACT_RE = re.compile(r"^(\d+(?:,\d+)*)([=>])$")
_INSTRUCT_RE = re.compile(r"in (ascending|descending) order: \[([\d,\s]+)\]")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"0|[1-9][0-9]*")


def instance_in_eval(numbers: list[int], eval_fraction: float) -> bool:
    """Whether an instance belongs to the held-out split (a fixed, seed-free hash)."""
    key = ",".join(map(str, sorted(numbers)))
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2.0**64


def parse_prompt(text: str) -> tuple[list[int], bool]:
    """``(numbers, descending)`` of a compact or instruct prompt.

    Raises:
      EnvError: if the text is in neither format.
    """
    compact = _COMPACT_RE.match(text)
    if compact is not None:
        return [int(x) for x in compact[1].split(",")], compact[2] == ">"
    instruct = _INSTRUCT_RE.search(text)
    if instruct is None:
        raise EnvError(f"not a sorting prompt: {text[:200]!r}")
    return [int(x) for x in re.findall(r"\d+", instruct[2])], instruct[1] == "descending"


def extract_list(completion: str, eos_text: str = "<eos>") -> str | None:
    """The answer text of a completion (last ``<answer>`` tag, else last non-empty line)."""
    tagged = _ANSWER_TAG_RE.findall(completion)
    if tagged:
        text = tagged[-1]
    else:
        lines = [line for line in completion.removesuffix(eos_text).splitlines() if line.strip()]
        if not lines:
            return None
        text = lines[-1]
    return text.strip() or None


def parse_list(text: str, max_digits: int) -> list[int] | None:
    """The integers of a comma-separated answer, or None unless every item is a canonical
    decimal integer of at most ``max_digits`` digits."""
    items = [item.strip() for item in text.split(",")]
    if any(len(item) > max_digits or _NUMBER_RE.fullmatch(item) is None for item in items):
        return None
    return [int(item) for item in items]


@dataclasses.dataclass(frozen=True)
class SortingTask:
    """Generator of sorting instances.

    Attributes:
      num_items: numbers per list (2..64).
      max_value: numbers are drawn uniformly from ``[0, max_value]`` (1..10^9).
      descending: ask for the largest number first.
      seed: selects the instance stream.
      eval_fraction: fraction of instances held out for the eval split.
      style: ``"compact"`` or ``"instruct"`` prompts.
    """

    num_items: int = 5
    max_value: int = 99
    descending: bool = False
    seed: int = 0
    eval_fraction: float = 0.1
    style: str = "compact"

    ALPHABET: ClassVar[str] = "0123456789,=>"

    def __post_init__(self):
        if not 2 <= self.num_items <= MAX_ITEMS:
            raise EnvError(f"num_items must be in 2..{MAX_ITEMS}, got {self.num_items}")
        if not 1 <= self.max_value <= MAX_VALUE:
            raise EnvError(f"max_value must be in 1..{MAX_VALUE}, got {self.max_value}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise EnvError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.style not in ("compact", "instruct"):
            raise EnvError(f"style must be 'compact' or 'instruct', got {self.style!r}")
        if self.seed < 0:
            raise EnvError(f"seed must be non-negative, got {self.seed}")

    def numbers(self, index: int, split: str) -> list[int]:
        """The unsorted numbers of example ``index`` of ``split``."""
        if split not in _SPLIT_CODES:
            raise EnvError(f"split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
        index = int(index)
        if index < 0:
            raise EnvError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], index])))
        for _ in range(_MAX_DRAWS):
            numbers = [int(x) for x in rng.integers(0, self.max_value, self.num_items,
                                                    endpoint=True)]
            if instance_in_eval(numbers, self.eval_fraction) == (split == "eval"):
                return numbers
        raise RuntimeError(f"no {split} sorting instance found in {_MAX_DRAWS} draws for {self}")

    def format_prompt(self, numbers: list[int]) -> str:
        if self.style == "compact":
            return ",".join(map(str, numbers)) + (">" if self.descending else "=")
        order = "descending" if self.descending else "ascending"
        return (f"Sort these numbers in {order} order: [{', '.join(map(str, numbers))}]. Keep "
                "repeated numbers. Give only the sorted list, comma-separated, inside "
                "<answer></answer>, for example <answer>1, 2, 3</answer>.")

    @staticmethod
    def format_answer(numbers: list[int], descending: bool) -> str:
        return ",".join(map(str, sorted(numbers, reverse=descending)))


class SortingEnv(Environment):
    """Exact-match reward for sorting a list of integers.

    Args:
      format_reward: reward of a well-formed list that is wrong (another multiset of numbers, or
        the right numbers out of order); 0 disables it.
      **task_kwargs: :class:`SortingTask` fields (``num_items``, ``max_value``, ``descending``,
        ``seed``, ``eval_fraction``, ``style``).

    Reward: 1 for the given numbers, each as often as given, in the asked order; else
    ``format_reward`` for a well-formed list; else 0. ``info["reason"]``: ``"correct"``,
    ``"no_answer"``, ``"too_long"``, ``"bad_format"``, ``"wrong_numbers"`` or ``"not_sorted"``.
    """

    name: ClassVar[str] = "sorting"
    ALPHABET: ClassVar[str] = SortingTask.ALPHABET

    def __init__(self, *, format_reward: float = 0.0, **task_kwargs: Any):
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        self.task = SortingTask(**task_kwargs)
        self.format_reward = float(format_reward)

    def prompt(self, index: int, split: str = "train") -> Prompt:
        numbers = self.task.numbers(index, split)
        return Prompt(text=self.task.format_prompt(numbers),
                      answer=self.task.format_answer(numbers, self.task.descending),
                      info={"numbers": numbers, "descending": self.task.descending},
                      index=int(index), split=split)

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        prompt = as_prompt(prompt)
        if "numbers" in prompt.info:
            numbers = [int(x) for x in prompt.info["numbers"]]
            descending = bool(prompt.info.get("descending", False))
        else:
            numbers, descending = parse_prompt(prompt.text)
        expected = sorted(numbers, reverse=descending)
        info: dict[str, Any] = {"expected": self.task.format_answer(numbers, descending)}

        def fail(reason: str, reward: float = 0.0) -> tuple[float, dict[str, Any]]:
            return reward, {**info, "correct": False, "reason": reason}

        if len(completion) > MAX_COMPLETION_CHARS:
            return fail("too_long")
        text = extract_list(completion)
        if text is None:
            return fail("no_answer")
        given = parse_list(text, max_digits=len(str(MAX_VALUE)))
        if given is None:
            return fail("bad_format")
        if given == expected:
            return 1.0, {**info, "correct": True, "reason": "correct"}
        if sorted(given) != sorted(numbers):
            return fail("wrong_numbers", self.format_reward)
        return fail("not_sorted", self.format_reward)
