"""Countdown: reach a target number from given numbers with + − × ÷ and parentheses.

Rules (checked by :func:`check_expression`): the answer is one arithmetic expression over
non-negative integer literals, binary ``+ - * /`` (also ``× ÷ −``) and parentheses; no unary
minus, no other characters. With ``use_all=True`` (the default, as in TinyZero's countdown) each
given number is used exactly once; with ``use_all=False`` at most once. Arithmetic is exact
(``fractions.Fraction``), so ``(1/3)*3`` is exactly 1 and intermediate fractions are allowed.
Expressions are parsed by a small recursive-descent parser, never by ``eval``.

Instances (:class:`CountdownTask`) are generated solvable: numbers are drawn uniformly in
``[1, max_number]`` and combined by a random expression tree whose intermediate results are
positive integers (exact division only); the tree's value is the target, and the tree is the
reference answer. Difficulty: ``num_numbers`` and ``max_number``. Example ``i`` of a split is a
pure function of ``(seed, split, i)``; an instance belongs to the eval split iff a seed-free hash
of its (sorted numbers, target) is below ``eval_fraction``.

Prompt styles: ``"compact"`` (``"3,7,25,50;125="``, for character tokenizers, alphabet
:attr:`CountdownTask.ALPHABET`; the completion is the expression) and ``"instruct"`` (a
natural-language instruction asking for the expression inside ``<answer></answer>``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt

_SPLIT_CODES = {"train": 0, "eval": 1}
_MAX_DRAWS = 10_000
MAX_EXPRESSION_CHARS = 256
_MAX_DEPTH = 32
_CANONICAL_OPS = {"×": "*", "÷": "/", "−": "-", "x": "*", "X": "*"}
_COMPACT_RE = re.compile(r"^(\d+(?:,\d+)*);(\d+)=$")
_INSTRUCT_RE = re.compile(r"numbers \[([\d,\s]+)\].*?equals (\d+)", re.DOTALL)
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ExpressionError(ValueError):
    """An answer that is not a well-formed countdown expression."""


def _tokenize(text: str) -> list[str]:
    tokens, i = [], 0
    while i < len(text):
        c = _CANONICAL_OPS.get(text[i], text[i])
        if c.isspace():
            i += 1
        elif c in "+-*/()":
            tokens.append(c)
            i += 1
        elif c.isdigit() and c.isascii():
            j = i
            while j < len(text) and text[j].isdigit() and text[j].isascii():
                j += 1
            tokens.append(text[i:j])
            i = j
        else:
            raise ExpressionError(f"character {text[i]!r} is not allowed")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*;  term := factor (('*'|'/') factor)*;
    factor := INT | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self._expr(0)
        if self._peek() is not None:
            raise ExpressionError(f"unexpected {self._peek()!r} after a complete expression")
        return value

    def _expr(self, depth: int) -> Fraction:
        value = self._term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self, depth: int) -> Fraction:
        value = self._factor(depth)
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self._factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ZeroDivisionError("division by zero")
            else:
                value = value / rhs
        return value

    def _factor(self, depth: int) -> Fraction:
        token = self._peek()
        if token is None:
            raise ExpressionError("expression ends early")
        self.pos += 1
        if token == "(":
            if depth >= _MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {_MAX_DEPTH}")
            value = self._expr(depth + 1)
            if self._peek() != ")":
                raise ExpressionError("unbalanced parentheses")
            self.pos += 1
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise ExpressionError(f"expected a number or '(', got {token!r}")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of a countdown expression and the integer literals it uses, in order.

    Raises:
      ExpressionError: for a disallowed character, bad syntax, or more than
        :data:`MAX_EXPRESSION_CHARS` characters.
      ZeroDivisionError: for a division by zero.
    """
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_tokenize(text))
    value = parser.parse()
    return value, parser.numbers


def extract_expression(completion: str, eos_text: str = "<eos>") -> str | None:
    """The answer expression in a completion, or None if there is none.

    The content of the last ``<answer>...</answer>`` if present, else the last non-empty line
    (``eos_text`` stripped). A trailing ``= value`` is dropped.
    """
    tagged = _ANSWER_TAG_RE.findall(completion)
    if tagged:
        text = tagged[-1]
    else:
        if completion.endswith(eos_text):
            completion = completion[:-len(eos_text)]
        lines = [line for line in completion.splitlines() if line.strip()]
        if not lines:
            return None
        text = lines[-1]
    text = text.split("=")[0].strip()
    return text or None


def check_expression(expression: str, numbers: list[int], target: int, *,
                     use_all: bool = True) -> tuple[bool, str, Fraction | None]:
    """``(correct, reason, value)`` of an expression for the instance ``(numbers, target)``.

    ``reason`` is ``"correct"``, ``"parse_error"``, ``"division_by_zero"``, ``"wrong_numbers"``
    or ``"wrong_value"``; ``value`` is None when the expression cannot be evaluated.
    """
    try:
        value, used = evaluate_expression(expression)
    except ExpressionError:
        return False, "parse_error", None
    except ZeroDivisionError:
        return False, "division_by_zero", None
    used_counts, given_counts = collections.Counter(used), collections.Counter(numbers)
    ok_numbers = used_counts == given_counts if use_all else used_counts <= given_counts
    if not ok_numbers:
        return False, "wrong_numbers", value
    if value != target:
        return False, "wrong_value", value
    return True, "correct", value


def instance_in_eval(numbers: list[int], target: int, eval_fraction: float) -> bool:
    """Whether an instance belongs to the held-out split (a fixed, seed-free hash)."""
    key = ",".join(map(str, sorted(numbers))) + f";{target}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2.0**64


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Generator of solvable countdown instances.

    Attributes:
      num_numbers: numbers per instance (2..8).
      max_number: numbers are drawn uniformly from ``[1, max_number]``.
      max_target: targets lie in ``[1, max_target]``.
      seed: selects the instance stream.
      split: ``"train"`` or ``"eval"``.
      eval_fraction: fraction of instances held out for eval.
      style: ``"compact"`` or ``"instruct"`` prompts.
      use_all: each number must be used exactly once (else at most once).
    """

    num_numbers: int = 4
    max_number: int = 25
    max_target: int = 1000
    seed: int = 0
    split: str = "train"
    eval_fraction: float = 0.1
    style: str = "compact"
    use_all: bool = True

    ALPHABET: ClassVar[str] = "0123456789+-*/()=,; "

    def __post_init__(self):
        if not 2 <= self.num_numbers <= 8:
            raise EnvError(f"num_numbers must be in 2..8, got {self.num_numbers}")
        if not 1 <= self.max_number <= 10_000:
            raise EnvError(f"max_number must be in 1..10000, got {self.max_number}")
        if self.max_target < 1:
            raise EnvError(f"max_target must be at least 1, got {self.max_target}")
        if self.split not in _SPLIT_CODES:
            raise EnvError(f"split must be one of {sorted(_SPLIT_CODES)}, got {self.split!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise EnvError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.style not in ("compact", "instruct"):
            raise EnvError(f"style must be 'compact' or 'instruct', got {self.style!r}")
        if self.seed < 0:
            raise EnvError(f"seed must be non-negative, got {self.seed}")

    def with_split(self, split: str) -> CountdownTask:
        return dataclasses.replace(self, split=split)

    def instance(self, index: int) -> tuple[list[int], int, str]:
        """``(numbers, target, solution)`` of example ``index``."""
        index = int(index)
        if index < 0:
            raise EnvError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[self.split], index])))
        for _ in range(_MAX_DRAWS):
            numbers = [int(x) for x in rng.integers(1, self.max_number + 1, self.num_numbers)]
            target, solution = self._random_tree(numbers, rng)
            if (1 <= target <= self.max_target
                    and instance_in_eval(numbers, target, self.eval_fraction)
                    == (self.split == "eval")):
                return numbers, target, solution
        raise RuntimeError(f"no {self.split} countdown instance found in {_MAX_DRAWS} draws for "
                           f"{self}")

    @staticmethod
    def _random_tree(numbers: list[int], rng: np.random.Generator) -> tuple[int, str]:
        """Combines the numbers pairwise in random order with random valid operations."""
        items = [(n, str(n)) for n in numbers]
        while len(items) > 1:
            i, j = (int(k) for k in rng.choice(len(items), size=2, replace=False))
            (a, ta), (b, tb) = items[i], items[j]
            ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
            op = ops[int(rng.integers(len(ops)))]
            value = {"+": a + b, "*": a * b, "-": a - b, "/": a // b if b else 0}[op]
            items = [x for k, x in enumerate(items) if k not in (i, j)]
            items.append((value, f"({ta}{op}{tb})"))
        value, text = items[0]
        return value, text[1:-1] if text.startswith("(") else text

    def format_prompt(self, numbers: list[int], target: int) -> str:
        if self.style == "compact":
            return ",".join(map(str, numbers)) + f";{target}="
        rule = "each number exactly once" if self.use_all else "each number at most once"
        return (f"Using the numbers [{', '.join(map(str, numbers))}], create an expression that "
                f"equals {target}. You can use +, -, *, / and parentheses, {rule}. Think step "
                "by step, then give only the expression inside <answer></answer>, for example "
                "<answer>(1 + 2) * 3</answer>.")

    def example(self, index: int) -> tuple[str, str]:
        """``(prompt, reference solution)`` of example ``index``."""
        numbers, target, solution = self.instance(index)
        return self.format_prompt(numbers, target), solution


def parse_prompt(text: str) -> tuple[list[int], int]:
    """``(numbers, target)`` from a compact or instruct prompt.

    Raises:
      EnvError: if the text is in neither format.
    """
    match = _COMPACT_RE.match(text) or _INSTRUCT_RE.search(text)
    if match is None:
        raise EnvError(f"not a countdown prompt: {text[:200]!r}")
    return [int(x) for x in re.findall(r"\d+", match[1])], int(match[2])


class CountdownEnv(Environment):
    """Reward for countdown answers.

    Args:
      format_reward: reward of an answer that parses as an expression but is wrong (wrong value
        or wrong numbers); 0 disables it.
      **task_kwargs: :class:`CountdownTask` fields (``num_numbers``, ``max_number``, ``seed``,
        ``style``, ``use_all``, ...).

    Reward: 1 if the expression uses the numbers by the rules and equals the target, else
    ``format_reward`` if it parses, else 0.
    """

    name: ClassVar[str] = "countdown"

    def __init__(self, *, format_reward: float = 0.0, **task_kwargs: Any):
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        self.task = CountdownTask(**task_kwargs)
        self.format_reward = float(format_reward)
        self.ALPHABET = self.task.ALPHABET

    def prompt(self, index: int, split: str = "train") -> Prompt:
        task = self.task.with_split(split)
        numbers, target, solution = task.instance(index)
        return Prompt(text=task.format_prompt(numbers, target), answer=solution,
                      info={"numbers": numbers, "target": target}, index=int(index), split=split)

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        prompt = as_prompt(prompt)
        if "numbers" in prompt.info:
            numbers, target = list(prompt.info["numbers"]), int(prompt.info["target"])
        else:
            numbers, target = parse_prompt(prompt.text)
        expression = extract_expression(completion)
        info: dict[str, Any] = {"target": target, "expression": expression}
        if expression is None:
            return 0.0, {**info, "correct": False, "reason": "no_answer", "value": None}
        correct, reason, value = check_expression(expression, numbers, target,
                                                  use_all=self.task.use_all)
        info.update(correct=correct, reason=reason, value=None if value is None else str(value))
        if correct:
            return 1.0, info
        return (self.format_reward if reason in ("wrong_value", "wrong_numbers") else 0.0), info
