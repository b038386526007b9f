"""Code generation: run the completion's Python program against tests in the sandbox.

A completion's program (:func:`extract_program`) is the last fenced ```` ```python ```` block
(also ```` ```py ````, ```` ```python3 ```` or an untagged block); without a fence, the whole
completion if it parses as Python. Tests come with the prompt, in ``Prompt.info``:

* ``"tests"``: a list of ``{"stdin": str, "stdout": str}`` cases; the program runs once per case
  and its stdout must equal the expected one up to trailing whitespace on each line and trailing
  blank lines;
* ``"assert_tests"``: Python source, or a list of sources (e.g. ``assert solve(3, 4) == 7``),
  each one test: the program runs, then a harness in a separate process runs the test against
  the program's globals (:meth:`rl_jax.envs.sandbox.Sandbox.run` with ``tests``); it passes only
  if the test ran to its end. Values cross by value when they are plain data (numbers, strings,
  bytes, ranges, lists, tuples, sets, dicts, and subclasses of these such as ``Counter``); the
  program's other objects can be called and their attributes read, but a test that compares or
  iterates one (a generator, say) fails. Exiting early, killing the harness,
  printing, patching builtins or returning an always-equal object therefore fails the test.

Every run is a separate sandboxed process (:class:`rl_jax.envs.sandbox.Sandbox`): a program that
loops, forks, hogs memory, floods the disk or prints without end fails its test with the
sandbox's reason (``"timeout"``, ``"process_limit"``, ``"memory"``, ``"file_limit"``,
``"output_limit"``) and never affects the caller or other samples. Under a weaker isolation mode
(``namespaces``, ``rlimits``: allowed only when ``min_isolation`` or the deployment's
``RL_JAX_SANDBOX_MIN_ISOLATION`` lowers the minimum from ``bwrap``), a program that leaves files
or IPC objects on the host (``"host_files"``) earns 0 for the whole completion, no format reward
and no partial credit, however many tests it passed.

Multi-turn: with ``max_turns > 1``, a failing program gets an observation describing the first
failure (the test's input, expected and actual output and the end of stderr when
``feedback="full"``, only the reason when ``"reason"``) and the policy may answer with a new
program; non-final steps earn 0, the final step earns the reward of its program.

:class:`CodeTask` generates small stdin/stdout or function problems with reference solutions.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, EpisodeState, PromptLike, StepResult, as_prompt
from rl_jax.envs.sandbox import Sandbox
from rl_jax.envs.sandbox.limits import SandboxLimits, SandboxResult

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3", "")


def extract_program(completion: str) -> tuple[str | None, bool]:
    """``(source, fenced)``: the program in a completion, and whether it was in a code fence."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(completion)]
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python_blocks:
        return python_blocks[-1], True
    if blocks:
        return None, True  # fenced, but in another language
    try:
        ast.parse(completion)
    except (SyntaxError, ValueError):
        return None, False
    return (completion, False) if completion.strip() else (None, False)


def outputs_match(actual: str, expected: str) -> bool:
    """Equality up to trailing whitespace on each line and trailing blank lines."""
    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines
    return norm(actual) == norm(expected)


# ---------------------------------------------------------------------------------------------
# Synthetic problems.

@dataclasses.dataclass(frozen=True)
class _Template:
    name: str
    stdio_text: str
    function_text: str
    make_args: Callable[[np.random.Generator, int], tuple]
    solve: Callable[..., Any]
    format_input: Callable[..., str]
    format_output: Callable[[Any], str]


def _ints(rng, n, high):
    return [int(x) for x in rng.integers(-high, high + 1, n)]


def _word(rng, length):
    return "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, length))


def _list_input(xs):
    return f"{len(xs)}\n{' '.join(map(str, xs))}\n"


_TEMPLATES = (
    _Template("add", "reads two integers a and b on one line and prints a + b",
              "solve(a, b) that returns a + b",
              lambda rng, d: tuple(_ints(rng, 2, 10**(2 * d))), lambda a, b: a + b,
              lambda a, b: f"{a} {b}\n", str),
    _Template("max", "reads n on the first line and n integers on the second, and prints the "
              "largest", "solve(xs) that returns the largest integer in the list xs",
              lambda rng, d: (_ints(rng, int(rng.integers(1, 4 * d + 2)), 10**d),),
              max, _list_input, str),
    _Template("sort", "reads n on the first line and n integers on the second, and prints them "
              "in increasing order separated by spaces",
              "solve(xs) that returns the list xs sorted in increasing order",
              lambda rng, d: (_ints(rng, int(rng.integers(1, 4 * d + 2)), 10**d),),
              sorted, _list_input, lambda xs: " ".join(map(str, xs))),
    _Template("reverse", "reads a word and prints it reversed",
              "solve(s) that returns the string s reversed",
              lambda rng, d: (_word(rng, int(rng.integers(1, 5 * d + 2))),),
              lambda s: s[::-1], lambda s: f"{s}\n", str),
    _Template("vowels", "reads a word and prints how many of its letters are vowels (aeiou)",
              "solve(s) that returns how many letters of s are vowels (aeiou)",
              lambda rng, d: (_word(rng, int(rng.integers(1, 5 * d + 2))),),
              lambda s: sum(c in "aeiou" for c in s), lambda s: f"{s}\n", str),
    _Template("fib", "reads n and prints the n-th Fibonacci number (F(0) = 0, F(1) = 1)",
              "solve(n) that returns the n-th Fibonacci number (F(0) = 0, F(1) = 1)",
              lambda rng, d: (int(rng.integers(0, 20 * d + 1)),),
              lambda n: _fib(n), lambda n: f"{n}\n", str),
    _Template("digits", "reads a non-negative integer and prints the sum of its digits",
              "solve(n) that returns the sum of the decimal digits of n >= 0",
              lambda rng, d: (int(rng.integers(0, 10**(3 * d))),),
              lambda n: sum(map(int, str(n))), lambda n: f"{n}\n", str),
)


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


_SPLIT_CODES = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True)
class CodeTask:
    """Small programming problems with generated tests.

    Attributes:
      difficulty: 1..5; scales value ranges and list/word lengths.
      num_tests: test cases per problem (the first is shown in the prompt as an example).
      style: ``"stdio"`` (a program reading stdin) or ``"function"`` (a function ``solve``
        checked by asserts).
      seed: selects the stream; problem ``i`` is a pure function of ``(seed, split, i)``.

    The eval split draws its problems from a separate stream; problems are instances of a fixed
    set of templates, so the split holds out test inputs, not problem kinds.
    """

    difficulty: int = 1
    num_tests: int = 3
    style: str = "stdio"
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.difficulty <= 5:
            raise EnvError(f"difficulty must be in 1..5, got {self.difficulty}")
        if self.num_tests < 1:
            raise EnvError(f"num_tests must be at least 1, got {self.num_tests}")
        if self.style not in ("stdio", "function"):
            raise EnvError(f"style must be 'stdio' or 'function', got {self.style!r}")

    def prompt(self, index: int, split: str = "train") -> Prompt:
        if split not in _SPLIT_CODES:
            raise EnvError(f"split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
        if index < 0:
            raise EnvError(f"example index must be non-negative, got {index}")
        rng = np.random.Generator(np.random.Philox(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], int(index)])))
        t = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
        cases = [t.make_args(rng, self.difficulty) for _ in range(self.num_tests)]
        if self.style == "stdio":
            tests = [{"stdin": t.format_input(*args),
                      "stdout": t.format_output(t.solve(*args)) + "\n"} for args in cases]
            text = (f"Write a Python program that {t.stdio_text}.\n\nExample input:\n"
                    f"{tests[0]['stdin']}\nExample output:\n{tests[0]['stdout']}\n"
                    "Answer with the program in a ```python code block.")
            info = {"tests": tests, "template": t.name}
        else:
            asserts = [f"assert solve({', '.join(map(repr, args))}) == {t.solve(*args)!r}"
                       for args in cases]
            text = (f"Write a Python function {t.function_text}.\n\nFor example: "
                    f"{asserts[0][len('assert '):]}\n\n"
                    "Answer with the function in a ```python code block.")
            info = {"assert_tests": asserts, "template": t.name}
        return Prompt(text=text, info=info, index=int(index), split=split)


# ---------------------------------------------------------------------------------------------
# The environment.

def _assert_tests(prompt: Prompt) -> list[str]:
    tests = prompt.info.get("assert_tests") or []
    return [tests] if isinstance(tests, str) else list(tests)


@dataclasses.dataclass(frozen=True)
class _TestOutcome:
    passed: bool
    reason: str
    test: int
    result: SandboxResult
    stdin: str | None = None
    expected: str | None = None


class CodeEnv(Environment):
    """Reward for programs, by running them against tests in a sandbox.

    Args:
      sandbox: the worker pool to run programs on; by default one is made from ``limits``,
        ``max_concurrency``, ``isolation`` and ``min_isolation`` (see :class:`Sandbox`: ``"auto"``
        refuses to start without bubblewrap; ``"namespaces"`` or ``"rlimits"`` must be asked for
        by name and allowed by ``min_isolation``, which the environment variable
        ``RL_JAX_SANDBOX_MIN_ISOLATION`` may forbid) and closed by :meth:`close`.
      reward_mode: ``"all"`` (1 if every test passes; stops at the first failure) or
        ``"fraction"`` (the fraction of tests passed; runs them all, concurrently).
      format_reward: reward of a failing program that was in a code fence and parses.
      max_turns: policy turns per episode (> 1 gives feedback after a failure).
      feedback: ``"full"`` or ``"reason"`` (what a multi-turn observation reveals).
      difficulty, num_tests, style, seed: the synthetic :class:`CodeTask`.

    ``info`` has ``correct``, ``reason`` (``"correct"``, ``"no_code"``, ``"syntax_error"``,
    ``"wrong_answer"`` or a sandbox reason), ``passed``, ``total`` and, on failure,
    ``failure`` (the first failing test: index, reason, detail, stdout/stderr excerpts).
    """

    name: ClassVar[str] = "code"

    def __init__(self, *, sandbox: Sandbox | None = None, limits: SandboxLimits | None = None,
                 max_concurrency: int | None = None, isolation: str = "auto",
                 min_isolation: str | None = None, reward_mode: str = "all",
                 format_reward: float = 0.0, max_turns: int = 1, feedback: str = "full",
                 difficulty: int = 1, num_tests: int = 3, style: str = "stdio", seed: int = 0):
        if reward_mode not in ("all", "fraction"):
            raise EnvError(f"reward_mode must be 'all' or 'fraction', got {reward_mode!r}")
        if not 0.0 <= format_reward < 1.0:
            raise EnvError(f"format_reward must be in [0, 1), got {format_reward}")
        if max_turns < 1:
            raise EnvError(f"max_turns must be at least 1, got {max_turns}")
        if feedback not in ("full", "reason"):
            raise EnvError(f"feedback must be 'full' or 'reason', got {feedback!r}")
        self._owns_sandbox = sandbox is None
        self.sandbox = sandbox or Sandbox(limits, max_concurrency=max_concurrency,
                                          isolation=isolation, min_isolation=min_isolation)
        self.reward_mode = reward_mode
        self.format_reward = float(format_reward)
        self.max_turns = int(max_turns)
        self.feedback = feedback
        self.task = CodeTask(difficulty=difficulty, num_tests=num_tests, style=style, seed=seed)

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return self.task.prompt(index, split)

    async def close(self) -> None:
        if self._owns_sandbox:
            await asyncio.get_running_loop().run_in_executor(None, self.sandbox.close)

    async def _run_test(self, source: str, prompt: Prompt, test: int) -> _TestOutcome:
        cases = list(prompt.info.get("tests", ()))
        if test < len(cases):
            case = cases[test]
            result = await self.sandbox.run(source, case.get("stdin", ""))
            if not result.ok:
                return _TestOutcome(False, result.reason, test, result, case.get("stdin", ""),
                                    case["stdout"])
            passed = outputs_match(result.stdout, case["stdout"])
            return _TestOutcome(passed, "correct" if passed else "wrong_answer", test, result,
                                case.get("stdin", ""), case["stdout"])
        assert_code = _assert_tests(prompt)[test - len(cases)]
        result = await self.sandbox.run(source, tests=[assert_code])
        if result.ok:
            return _TestOutcome(True, "correct", test, result)
        return _TestOutcome(False, "wrong_answer" if result.reason == "test_failed"
                            else result.reason, test, result)

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        prompt = as_prompt(prompt)
        num_cases = len(prompt.info.get("tests", ()))
        total = num_cases + len(_assert_tests(prompt))
        if total == 0:
            raise EnvError("CodeEnv needs Prompt.info['tests'] (stdin/stdout cases) or "
                           f"Prompt.info['assert_tests']; got keys {sorted(prompt.info)}")
        for i, case in enumerate(prompt.info.get("tests", ())):
            if not isinstance(case, dict) or not isinstance(case.get("stdout"), str):
                raise EnvError(f"test {i} must be a dict with a 'stdout' string (and optionally "
                               f"'stdin'), got {case!r}"[:300])
        for i, test in enumerate(_assert_tests(prompt)):
            if not isinstance(test, str):
                raise EnvError(f"assert test {i} must be a string of Python source, got "
                               f"{test!r}"[:300])
        source, fenced = extract_program(completion)
        info: dict[str, Any] = {"passed": 0, "total": total, "fenced": fenced}
        if source is None:
            return 0.0, {**info, "correct": False, "reason": "no_code"}
        try:
            ast.parse(source)
        except (SyntaxError, ValueError) as e:
            return (self.format_reward if fenced else 0.0), {
                **info, "correct": False, "reason": "syntax_error",
                "failure": {"test": None, "reason": "syntax_error", "detail": str(e)}}
        if self.reward_mode == "all":
            outcomes = []
            for test in range(total):
                outcomes.append(await self._run_test(source, prompt, test))
                if not outcomes[-1].passed:
                    break
        else:
            outcomes = await asyncio.gather(*(self._run_test(source, prompt, t)
                                              for t in range(total)))
        passed = sum(o.passed for o in outcomes)
        correct = passed == total
        reward = 1.0 if correct else (passed / total if self.reward_mode == "fraction" else 0.0)
        info.update(passed=passed, correct=correct)
        failure = next((o for o in outcomes if not o.passed), None)
        damage = next((o for o in outcomes if o.reason == "host_files"), None)
        if damage is not None:  # nothing is paid for a program that damaged the host
            failure, reward = damage, 0.0
        if failure is None:
            info["reason"] = "correct"
        else:
            info["reason"] = failure.reason
            info["failure"] = {"test": failure.test, "reason": failure.reason,
                               "detail": failure.result.detail, "stdin": failure.stdin,
                               "expected": failure.expected,
                               "stdout": failure.result.stdout[:1000],
                               "stderr": failure.result.stderr[-1000:]}
            if fenced and damage is None:
                reward = max(reward, self.format_reward)
        return reward, info

    async def step(self, state: EpisodeState, completion: str) -> StepResult:
        state.check_running()
        reward, info = await self.score(state.prompt, completion)
        if info["correct"] or state.turn + 1 >= self.max_turns:
            return state.record(completion, StepResult(reward, True, None, info))
        return state.record(completion, StepResult(0.0, False, self._feedback_text(info), info))

    def _feedback_text(self, info: dict[str, Any]) -> str:
        failure = info.get("failure") or {}
        reason = info["reason"].replace("_", " ")
        text = f"\n\nYour program failed ({reason})"
        if self.feedback == "full" and failure:
            if failure.get("stdin") is not None:
                text += (f" on the input:\n{failure['stdin']}\nExpected output:\n"
                         f"{failure['expected']}\nYour output:\n{failure['stdout'][:500]}")
            if failure.get("stderr"):
                text += f"\nError output (end):\n{failure['stderr'][-500:]}"
            if failure.get("detail") and not failure.get("stderr"):
                text += f"\n{failure['detail']}"
        return text.rstrip() + "\n\nPlease write a corrected program.\n"
