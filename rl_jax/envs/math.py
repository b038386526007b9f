"""Math answer checking: extract a final answer, compare it numerically and symbolically.

Extraction (:func:`extract_answer`): the content of the last ``\\boxed{...}`` (or ``\\fbox``),
with nested braces; without one, the last number in the text.

Comparison (:func:`answers_match`), after normalizing both sides (:func:`normalize_answer`:
``$``/``\\(\\)``, ``\\left``/``\\right``, spacing commands, ``\\text{...}`` units, degrees,
dollars, thousands separators ``1,234``, a leading ``x =``, a trailing period):

1. equal normalized strings;
2. both parsed into sympy by :mod:`rl_jax.envs.latex` (no ``eval``: LaTeX-ish text → Python-ish
   tokens → :mod:`ast` → sympy objects, only numbers, single-letter variables, ``pi e i oo``,
   ``+ - * / ^``, implicit multiplication, ``\\frac \\sqrt`` and a few functions; decimals become
   exact rationals; sizes and exponents are bounded so nothing explodes);
3. numbers: exactly equal, or within ``rel_tol`` (relative) / ``abs_tol``; when the reference is
   a decimal with ``d`` places, a candidate that rounds to it at ``d`` places; a percentage also
   matches its value over 100 (``50\\%`` ≡ ``0.5`` ≡ ``50``);
4. expressions with variables: equal at several random points, else ``simplify(a - b) == 0``
   under a time limit (SIGALRM, active only in a process's main thread — :class:`MathEnv` with
   ``num_workers > 0`` runs checks in worker processes where it always is);
5. tuples/lists elementwise (unbracketed lists such as ``1, 2`` in any order).

:class:`MathEnv` also generates a synthetic task (linear equations with rational solutions).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import multiprocessing
import re
import signal
import threading
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
import sympy

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike, as_prompt
from rl_jax.envs.latex import CONSTANTS, FUNCTIONS, TEXT_COMMANDS, ParseError, parse_math


# ---------------------------------------------------------------------------------------------
# Extraction and normalization.

def _boxed_contents(text: str) -> list[str]:
    out = []
    for match in re.finditer(r"\\(?:boxed|fbox)\b", text):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, start = 0, i + 1
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    out.append(text[start:j])
                    break
        elif i > match.end():  # "\boxed 5"
            out.append(re.match(r"[^\s$]*", text[i:])[0])
    return out


_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> tuple[str | None, bool]:
    """``(answer, boxed)``: the last ``\\boxed{}`` content, else the last number, else None."""
    boxed = [b for b in _boxed_contents(text) if b.strip()]
    if boxed:
        return boxed[-1].strip(), True
    numbers = _NUMBER_RE.findall(text)
    return (numbers[-1] if numbers else None), False


_UNIT_TAIL = re.compile(
    r"(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)(\s*)((?:[a-zA-Z]+\.?(?:\s*\^\s*\{?\d\}?)?\s*)+)")
# Units recognised when written right after the number ("5cm"); after a space any words are
# units ("12 apples"), since "2x" or "3xy" without a space are products.
_UNITS = frozenset("mm cm m km in ft yd mi mg g kg lb lbs oz ml l s sec min h hr hrs mph kph "
                   "kmh km/h".split())


def _strip_text_commands(s: str) -> str:
    pattern = re.compile(r"\\(?:%s)\s*\{([^{}]*)\}" % "|".join(TEXT_COMMANDS))
    while True:
        new = pattern.sub(lambda m: " " + m[1] + " ", s)
        if new == s:
            return s
        s = new


def normalize_answer(answer: str) -> tuple[str, bool]:
    """``(normalized text, is_percentage)`` of an extracted answer."""
    s = answer.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        while s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    s = s.replace("{,}", ",")
    for token in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ",
                  "\\$", "$", "~"):
        s = s.replace(token, " " if token in ("\\,", "\\;", "\\:", "\\ ", "~") else "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    percent = bool(re.search(r"\\?%\s*$", s))
    s = re.sub(r"\\?%", "", s)
    s = _strip_text_commands(s)
    if "=" in s and not re.search(r"[<>]|\\[lg]eq?", s):
        s = s.rsplit("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    unit = _UNIT_TAIL.fullmatch(s)
    if unit:
        words = re.findall(r"[a-zA-Z]+", unit[3])
        named = [w for w in words if w in FUNCTIONS or w in CONSTANTS or w in ("e", "i")]
        if not named and (unit[2] or all(w in _UNITS for w in words)):
            s = unit[1]
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<=\d) (?=\d{3}\b)", "", s)  # "1 000" after "\," was removed
    letter = re.fullmatch(r"\(?([A-Ea-e])\)?", s)
    if letter:
        s = letter[1].upper()
    return re.sub(r"\s+", " ", s).strip(), percent


# ---------------------------------------------------------------------------------------------
# Comparison.

class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raises _Timeout after ``seconds`` (main thread only; elsewhere no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _as_complex(expr) -> complex | None:
    try:
        value = complex(sympy.N(expr, 30))
    except (TypeError, ValueError, OverflowError):
        return None
    if not (np.isfinite(value.real) and np.isfinite(value.imag)):
        return None
    return value


def _close(a: complex, b: complex, rel_tol: float, abs_tol: float) -> bool:
    return abs(a - b) <= abs_tol + rel_tol * abs(b)


def _decimal_places(reference: str) -> int | None:
    m = re.fullmatch(r"-?\d*\.(\d+)", reference)
    return len(m[1]) if m else None


def _scalars_match(a, b, places, rel_tol, abs_tol, timeout) -> bool:
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return sympy.simplify(a - b) == 0 if not (a.is_number and b.is_number) else False
    symbols = a.free_symbols | b.free_symbols
    if not symbols:
        va, vb = _as_complex(a), _as_complex(b)
        if va is None or vb is None:
            return False
        if _close(va, vb, rel_tol, abs_tol):
            return True
        return places is not None and abs(va - vb) <= 0.5 * 10.0**-places * (1 + 1e-9)
    return _expressions_match(a, b, sorted(symbols, key=str), rel_tol, abs_tol, timeout)


def _expressions_match(a, b, symbols, rel_tol, abs_tol, timeout) -> bool:
    rng = np.random.default_rng(0)
    agreed = 0
    for _ in range(4):
        point = {s: sympy.Rational(int(rng.integers(1100, 2900)), 1000) for s in symbols}
        va, vb = _as_complex(a.subs(point)), _as_complex(b.subs(point))
        if va is None or vb is None:
            break
        if not _close(va, vb, max(rel_tol, 1e-9), max(abs_tol, 1e-12)):
            return False
        agreed += 1
    if agreed == 4:
        return True
    try:
        with _time_limit(timeout):
            return sympy.simplify(a - b) == 0
    except _Timeout:
        return False


def answers_match(given: str, reference: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9,
                  timeout: float = 2.0) -> bool:
    """Whether an extracted answer equals the reference answer (see the module docstring)."""
    g, g_percent = normalize_answer(given)
    r, r_percent = normalize_answer(reference)
    if not g or not r:
        return False
    if g == r or g.replace(" ", "") == r.replace(" ", ""):
        return True
    try:
        with _time_limit(timeout):
            a, b = parse_math(g), parse_math(r)
    except (ParseError, _Timeout, RecursionError):
        return False
    places = _decimal_places(r)
    candidates = [(a, b)]
    if g_percent and not isinstance(a, tuple):
        candidates.append((a / 100, b))
    if r_percent and not isinstance(b, tuple):
        candidates.append((a, b / 100))
    try:
        for x, y in candidates:
            if _values_match(x, y, g, r, places, rel_tol, abs_tol, timeout):
                return True
    except (TypeError, ValueError, RecursionError, _Timeout):
        return False
    return False


def _values_match(a, b, g, r, places, rel_tol, abs_tol, timeout) -> bool:
    if isinstance(a, tuple) != isinstance(b, tuple):
        return False
    if not isinstance(a, tuple):
        return _scalars_match(a, b, places, rel_tol, abs_tol, timeout)
    if len(a) != len(b):
        return False
    one = lambda x, y: _scalars_match(x, y, None, rel_tol, abs_tol, timeout)  # noqa: E731
    if all(one(x, y) for x, y in zip(a, b)):
        return True
    bracketed = g[:1] in "([" or r[:1] in "(["
    if bracketed or len(a) > 6:
        return False
    return any(all(one(x, y) for x, y in zip(perm, b)) for perm in itertools.permutations(a))


def check_math(completion: str, reference: str, *, timeout: float = 2.0,
               rel_tol: float = 1e-6) -> dict[str, Any]:
    """Extracts the answer from ``completion`` and compares it with ``reference``.

    Returns ``{"correct", "reason", "extracted", "boxed"}`` with ``reason`` in
    ``{"correct", "wrong_answer", "no_answer"}``.
    """
    extracted, boxed = extract_answer(completion)
    if extracted is None:
        return {"correct": False, "reason": "no_answer", "extracted": None, "boxed": False}
    correct = answers_match(extracted, reference, rel_tol=rel_tol, timeout=timeout)
    return {"correct": correct, "reason": "correct" if correct else "wrong_answer",
            "extracted": extracted, "boxed": boxed}


# ---------------------------------------------------------------------------------------------
# Synthetic task and the environment.

_SPLIT_CODES = {"train": 0, "eval": 1}


def _in_eval(a: int, b: int, c: int, eval_fraction: float) -> bool:
    digest = hashlib.blake2b(f"{a}x+{b}={c}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2.0**64


def latex_number(value: Fraction) -> str:
    """``"7"``, ``"-\\frac{7}{3}"``: a rational in LaTeX."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


@dataclasses.dataclass(frozen=True)
class LinearEquationTask:
    """``"Solve for x: 3x + 5 = 20."`` with a rational answer.

    Attributes:
      difficulty: coefficients are nonzero integers in ``[-10**difficulty, 10**difficulty]``.
      seed: selects the stream; example ``i`` is a pure function of ``(seed, split, i)``.
      eval_fraction: fraction of equations ``(a, b, c)`` held out (seed-free hash).
    """

    difficulty: int = 1
    seed: int = 0
    eval_fraction: float = 0.1

    def __post_init__(self):
        if not 1 <= self.difficulty <= 9:
            raise EnvError(f"difficulty must be in 1..9, got {self.difficulty}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise EnvError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    def coefficients(self, index: int, split: str) -> tuple[int, int, int]:
        if split not in _SPLIT_CODES:
            raise EnvError(f"split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
        if index < 0:
            raise EnvError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], int(index)])))
        high = 10**self.difficulty
        for _ in range(10_000):
            a, b, c = (int(x) for x in rng.integers(-high, high + 1, 3))
            if a not in (0, 1) and _in_eval(a, b, c, self.eval_fraction) == (split == "eval"):
                return a, b, c
        raise RuntimeError(f"no {split} equation found for {self}")

    def example(self, index: int, split: str = "train") -> tuple[str, str]:
        a, b, c = self.coefficients(index, split)
        sign = "+" if b >= 0 else "-"
        text = (f"Solve for x: {a}x {sign} {abs(b)} = {c}. "
                "Put your final answer in \\boxed{}.")
        return text, latex_number(Fraction(c - b, a))


def _check_in_worker(completion: str, reference: str, timeout: float, rel_tol: float):
    return check_math(completion, reference, timeout=timeout, rel_tol=rel_tol)


class MathEnv(Environment):
    """Reward for math answers against a reference (``Prompt.answer``).

    Args:
      format_reward: reward of a wrong answer given in ``\\boxed{}``.
      require_boxed: only a ``\\boxed{}`` answer counts (no last-number fallback).
      timeout: seconds allowed for one symbolic comparison.
      rel_tol: relative tolerance of numeric comparison.
      num_workers: 0 checks in the caller's thread; ``n > 0`` uses ``n`` worker processes
        (spawned; the timeout is then always enforced and the event loop never blocks).
      difficulty, seed, eval_fraction: the synthetic :class:`LinearEquationTask`.

    Reward: 1 if the extracted answer matches, else ``format_reward`` if it was boxed, else 0.
    """

    name: ClassVar[str] = "math"

    def __init__(self, *, format_reward: float = 0.0, require_boxed: bool = False,
                 timeout: float = 2.0, rel_tol: float = 1e-6, num_workers: int = 0,
                 difficulty: int = 1, seed: int = 0, eval_fraction: float = 0.1):
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        if num_workers < 0:
            raise EnvError(f"num_workers must be non-negative, got {num_workers}")
        self.format_reward = float(format_reward)
        self.require_boxed = bool(require_boxed)
        self.timeout = float(timeout)
        self.rel_tol = float(rel_tol)
        self.task = LinearEquationTask(difficulty=difficulty, seed=seed,
                                       eval_fraction=eval_fraction)
        self._pool = None
        if num_workers:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                num_workers, mp_context=multiprocessing.get_context("spawn"))

    def prompt(self, index: int, split: str = "train") -> Prompt:
        text, answer = self.task.example(index, split)
        return Prompt(text=text, answer=answer, index=int(index), split=split)

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        prompt = as_prompt(prompt)
        if prompt.answer is None:
            raise EnvError("MathEnv needs Prompt.answer (the reference answer); got a prompt "
                           f"without one: {prompt.text[:100]!r}")
        if self.require_boxed and not _boxed_contents(completion):
            return 0.0, {"correct": False, "reason": "no_answer", "extracted": None,
                         "boxed": False}
        if self._pool is None:
            info = check_math(completion, prompt.answer, timeout=self.timeout,
                              rel_tol=self.rel_tol)
        else:
            future = asyncio.get_running_loop().run_in_executor(
                self._pool, _check_in_worker, completion, prompt.answer, self.timeout,
                self.rel_tol)
            try:
                info = await asyncio.wait_for(future, self.timeout * 3 + 5)
            except asyncio.TimeoutError:
                return 0.0, {"correct": False, "reason": "timeout", "extracted": None,
                             "boxed": False}
        if info["correct"]:
            return 1.0, info
        return (self.format_reward if info["boxed"] else 0.0), info

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
