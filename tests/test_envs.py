"""Reward environments: the async interface, multi-turn masking, arithmetic, countdown, math
answer checking, reward shaping and group statistics. Sandbox and code tests: test_sandbox.py."""

import asyncio
import time
from fractions import Fraction

import numpy as np
import pytest

import rl_jax.envs as envs
from rl_jax.data.arithmetic import ArithmeticTask
from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import (EnvError, Environment, EpisodeState, Segment, StepResult,
                              build_loss_mask, run_episode, score_many)
from rl_jax.envs.countdown import (CountdownTask, ExpressionError, check_expression,
                                   evaluate_expression, extract_expression, parse_prompt)
from rl_jax.envs.math import (LinearEquationTask, answers_match, check_math, extract_answer,
                              normalize_answer)
from rl_jax.envs.shaping import (RewardShaping, SolveRateTracker, drop_zero_signal_groups,
                                 group_statistics, linear_length_penalty, overlong_penalty,
                                 zero_signal)
from rl_jax.envs.sorting import (MAX_COMPLETION_CHARS, SortingTask,
                                 parse_prompt as parse_sorting_prompt)

run = asyncio.run


# ---------------------------------------------------------------------------------------------
# Interface, registry, batching, multi-turn.

class _SleepyEnv(Environment):
    """Reward = len(completion); records how many scores ran at once."""

    def __init__(self):
        self.active = self.peak = 0

    async def score(self, prompt, completion):
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.01)
        self.active -= 1
        return float(len(completion)), {"correct": True, "reason": "correct"}


class _GuessEnv(Environment):
    """Multi-turn: guess a number; the environment answers "higher"/"lower"."""

    max_turns = 5

    async def score(self, prompt, completion):
        correct = completion.strip() == prompt.answer
        return float(correct), {"correct": correct, "reason": "correct" if correct else "wrong"}

    async def step(self, state, completion):
        state.check_running()
        reward, info = await self.score(state.prompt, completion)
        if info["correct"] or state.turn + 1 >= self.max_turns:
            return state.record(completion, StepResult(reward, True, None, info))
        hint = " higher\n" if int(completion) < int(state.prompt.answer) else " lower\n"
        return state.record(completion, StepResult(0.0, False, hint, info))


def test_registry():
    assert {"arithmetic", "countdown", "math", "code", "sorting", "scratchpad", "long_addition",
            "tool_use", "delayed"} <= set(envs.names())
    assert isinstance(envs.get("arithmetic", num_digits=2), envs.arithmetic.ArithmeticEnv)
    with pytest.raises(EnvError, match="unknown environment 'nope'.*arithmetic"):
        envs.get("nope")
    envs.register("sleepy_test", _SleepyEnv)
    with pytest.raises(EnvError, match="already registered"):
        envs.register("sleepy_test", _SleepyEnv)
    assert isinstance(envs.get("sleepy_test"), _SleepyEnv)


def test_score_many_keeps_order_and_bounds_concurrency():
    env = _SleepyEnv()
    completions = ["x" * i for i in range(40)]
    results = run(score_many(env, ["p"] * 40, completions, max_concurrency=7))
    assert [r for r, _ in results] == [float(i) for i in range(40)]
    assert env.peak == 7
    with pytest.raises(EnvError, match="2 prompts but 1 completions"):
        run(score_many(env, ["a", "b"], ["c"]))


def test_single_turn_step_scores_and_ends():
    env = envs.get("arithmetic", num_digits=2)
    prompt = env.prompt(0)

    async def go():
        state = await env.reset(prompt)
        result = await env.step(state, prompt.answer)
        assert result.done and result.reward == 1.0 and result.observation is None
        assert state.done and state.turn == 1 and state.total_reward == 1.0
        with pytest.raises(EnvError, match="ended"):
            await env.step(state, "1")
    run(go())


def test_step_result_validates_observation():
    with pytest.raises(EnvError, match="final step"):
        StepResult(1.0, True, "more")
    with pytest.raises(EnvError, match="needs an observation"):
        StepResult(0.0, False, None)


def test_multi_turn_episode_transcript():
    guesses = iter(["3", "9", "7"])

    async def policy(state: EpisodeState) -> str:
        return next(guesses)

    state = run(run_episode(_GuessEnv(), Prompt("guess:", answer="7"), policy))
    assert state.done and state.turn == 3 and state.total_reward == 1.0
    assert state.transcript == [("policy", "3"), ("environment", " higher\n"), ("policy", "9"),
                                ("environment", " lower\n"), ("policy", "7")]
    assert state.context() == "guess:3 higher\n9 lower\n7"


def test_build_loss_mask_masks_environment_tokens():
    tokens = build_loss_mask([
        Segment([1, 2, 3], "prompt"),
        Segment([10, 11], "policy", logprobs=[-0.1, -0.2], versions=[4, 5]),
        Segment([20, 21, 22], "environment"),
        Segment([12], "policy", logprobs=[-0.3], versions=[6]),
    ])
    np.testing.assert_array_equal(tokens.token_ids, [1, 2, 3, 10, 11, 20, 21, 22, 12])
    np.testing.assert_array_equal(tokens.loss_mask, [0, 0, 0, 1, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(tokens.logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3], rtol=1e-6)
    # Non-policy tokens inherit the previous policy version (the first one before any).
    np.testing.assert_array_equal(tokens.versions, [4, 4, 4, 4, 5, 5, 5, 5, 6])
    assert tokens.prompt_length == 3
    assert tokens.token_ids.dtype == np.int32 and tokens.loss_mask.dtype == bool

    bare = build_loss_mask([Segment([1], "prompt"), Segment([2, 3], "policy")])
    np.testing.assert_array_equal(bare.versions, [-1, -1, -1])
    np.testing.assert_array_equal(bare.loss_mask, [0, 1, 1])


@pytest.mark.parametrize("segments, message", [
    ([Segment([1], "user")], "source must be one of"),
    ([Segment([1], "policy"), Segment([2], "prompt")], "prompt segment after"),
    ([Segment([1, 2], "policy", logprobs=[0.0])], "1 logprobs for 2 tokens"),
    ([Segment([1], "environment", versions=[3])], "versions given on a 'environment'"),
    ([Segment([1], "policy", logprobs=[0.0]), Segment([2], "policy")], "some policy segments"),
])
def test_build_loss_mask_errors(segments, message):
    with pytest.raises(EnvError, match=message):
        build_loss_mask(segments)


# ---------------------------------------------------------------------------------------------
# Arithmetic.

def test_arithmetic_env_wraps_task():
    env = envs.get("arithmetic", num_digits=3, seed=5)
    task = ArithmeticTask(num_digits=3, seed=5)
    for i in range(20):
        p = env.prompt(i)
        assert (p.text, p.answer) == task.example(i)
        assert env.prompt(i) == p  # deterministic
        assert run(env.score(p, p.answer))[0] == 1.0
        assert run(env.score(p.text, p.answer + "<eos>"))[0] == 1.0  # parsed from the text
    eval_pairs = {tuple(sorted(env.prompt(i, "eval").info["operands"])) for i in range(50)}
    train_pairs = {tuple(sorted(env.prompt(i).info["operands"])) for i in range(500)}
    assert not eval_pairs & train_pairs


def test_arithmetic_rewards():
    env = envs.get("arithmetic", num_digits=3, reverse_answer=False, format_reward=0.1,
                   partial_credit=True)
    assert run(env.score("123+456=", "579")) == (1.0, {"correct": True, "reason": "correct",
                                                       "expected": "579"})
    reward, info = run(env.score("123+456=", "578"))
    assert reward == pytest.approx(2 / 3) and info["reason"] == "wrong_answer"
    assert run(env.score("123+456=", "abc"))[0] == 0.0
    strict = envs.get("arithmetic", num_digits=3, format_reward=0.1)
    assert run(strict.score("123+456=", "111"))[0] == 0.1
    assert run(strict.score("123+456=", "5 79"))[1]["reason"] == "bad_format"
    with pytest.raises(EnvError, match="not an addition prompt"):
        run(strict.score("what is 1+1?", "2"))


# ---------------------------------------------------------------------------------------------
# Countdown.

@pytest.mark.parametrize("text, value, numbers", [
    ("1+2*3", 7, [1, 2, 3]),
    ("(1+2)*3", 9, [1, 2, 3]),
    ("8/3*3", 8, [8, 3, 3]),          # exact: no float rounding
    ("1/3+1/6", Fraction(1, 2), [1, 3, 1, 6]),
    ("10-4-3", 3, [10, 4, 3]),        # left-associative
    ("100/10/5", 2, [100, 10, 5]),
    ("(25 − 5) × 4 ÷ 2", 40, [25, 5, 4, 2]),
    ("((((7))))", 7, [7]),
])
def test_countdown_evaluate(text, value, numbers):
    assert evaluate_expression(text) == (value, numbers)


@pytest.mark.parametrize("text", [
    "", "1+", "(1+2", "1+2)", "-1+2", "2**3", "1 2", "__import__('os').system('ls')",
    "1+2; 3", "abs(3)", "1.5*2", "(" * 40 + "1" + ")" * 40, "1+" * 200 + "1",
])
def test_countdown_rejects_malformed(text):
    with pytest.raises(ExpressionError):
        evaluate_expression(text)


def test_countdown_check_rules():
    nums = [3, 7, 25, 50]
    assert check_expression("(25-3)*7-50", nums, 104)[1] == "correct"
    assert check_expression("50+25+7+3", nums, 85) == (True, "correct", 85)
    assert check_expression("50+25+7", nums, 82)[1] == "wrong_numbers"    # 3 unused
    assert check_expression("50+25+7", nums, 82, use_all=False)[0]       # at most once
    assert check_expression("50+50+7+3", nums, 110)[1] == "wrong_numbers"  # 50 twice
    assert check_expression("50+25+7+3", nums, 84)[1] == "wrong_value"
    assert check_expression("50/(25-25)+7+3", nums, 1)[1] == "division_by_zero"
    assert check_expression("50 + x", nums, 1)[1] == "parse_error"
    assert check_expression("(7-3)/(50/25)", nums, 2)[0]


@pytest.mark.parametrize("completion, expected", [
    ("3+4", "3+4"),
    ("3+4<eos>", "3+4"),
    ("let me think\n(3+4)*2 = 14\n", "(3+4)*2"),
    ("<answer>1+2</answer> then <answer> (3*4) </answer>", "(3*4)"),
    ("   \n", None),
])
def test_countdown_extract(completion, expected):
    assert extract_expression(completion) == expected


@pytest.mark.parametrize("num_numbers, max_number", [(2, 10), (3, 25), (4, 25), (6, 100)])
def test_countdown_generator_solvable_and_deterministic(num_numbers, max_number):
    task = CountdownTask(num_numbers=num_numbers, max_number=max_number, seed=3)
    for split in ("train", "eval"):
        t = task.with_split(split)
        for i in range(25):
            numbers, target, solution = t.instance(i)
            assert (numbers, target, solution) == t.instance(i)
            assert len(numbers) == num_numbers and all(1 <= n <= max_number for n in numbers)
            assert 1 <= target <= task.max_target
            assert check_expression(solution, numbers, target) == (True, "correct", target)
    assert task.instance(0) != CountdownTask(num_numbers, max_number, seed=4).instance(0)
    train = {(tuple(sorted(n)), t) for n, t, _ in map(task.instance, range(200))}
    held = {(tuple(sorted(n)), t) for n, t, _ in map(task.with_split("eval").instance, range(50))}
    assert not train & held


def test_countdown_env_and_prompt_styles():
    env = envs.get("countdown", num_numbers=3, format_reward=0.1, seed=1)
    p = env.prompt(7)
    assert parse_prompt(p.text) == (p.info["numbers"], p.info["target"])
    assert set(p.text) <= set(CountdownTask.ALPHABET)
    assert run(env.score(p.text, p.answer + "<eos>"))[0] == 1.0
    assert run(env.score(p, "1+1"))[0] == 0.1                 # parses, wrong numbers
    assert run(env.score(p, "hello"))[1]["reason"] == "parse_error"
    assert run(env.score(p, ""))[1]["reason"] == "no_answer"
    instruct = envs.get("countdown", num_numbers=3, style="instruct", seed=1)
    q = instruct.prompt(7)
    assert parse_prompt(q.text) == (p.info["numbers"], p.info["target"])
    assert run(instruct.score(q.text, f"so... <answer>{q.answer}</answer>"))[0] == 1.0
    with pytest.raises(EnvError, match="not a countdown prompt"):
        run(env.score("what?", "1"))


# ---------------------------------------------------------------------------------------------
# Sorting.

@pytest.mark.parametrize("num_items, max_value, descending", [(2, 9, False), (5, 99, True),
                                                              (12, 10**9, False)])
def test_sorting_generator_deterministic_in_range_and_split(num_items, max_value, descending):
    env = envs.get("sorting", num_items=num_items, max_value=max_value, descending=descending,
                   seed=3)
    for split in ("train", "eval"):
        for i in range(25):
            p = env.prompt(i, split)
            assert env.prompt(i, split) == p
            numbers = p.info["numbers"]
            assert len(numbers) == num_items and all(0 <= n <= max_value for n in numbers)
            assert parse_sorting_prompt(p.text) == (numbers, descending)
            assert set(p.text) <= set(SortingTask.ALPHABET)
            assert p.answer == ",".join(map(str, sorted(numbers, reverse=descending)))
            assert run(env.score(p, p.answer)) == (1.0, {"expected": p.answer, "correct": True,
                                                        "reason": "correct"})
            assert run(env.score(p.text, p.answer + "<eos>"))[0] == 1.0  # parsed from the text
    other = envs.get("sorting", num_items=num_items, max_value=max_value, seed=4)
    assert other.prompt(0).info["numbers"] != env.prompt(0).info["numbers"]
    train = {tuple(sorted(env.prompt(i).info["numbers"])) for i in range(300)}
    held = {tuple(sorted(env.prompt(i, "eval").info["numbers"])) for i in range(50)}
    assert not train & held


def test_sorting_rewards_and_prompt_styles():
    env = envs.get("sorting", format_reward=0.1)
    assert run(env.score("31,7,19,7=", "7,7,19,31"))[0] == 1.0
    assert run(env.score("31,7,19,7=", "7, 7 ,19,  31<eos>"))[0] == 1.0  # spaces around commas
    assert run(env.score("31,7,19,7>", "31,19,7,7"))[0] == 1.0           # descending
    for completion, reason in [("7,19,31", "wrong_numbers"),          # a repeat dropped
                               ("7,7,7,19,31", "wrong_numbers"),      # one added
                               ("7,7,19,30", "wrong_numbers"),
                               ("31,19,7,7", "not_sorted"),           # the other order
                               ("31,7,19,7", "not_sorted")]:          # the prompt echoed
        assert run(env.score("31,7,19,7=", completion)) == (
            0.1, {"expected": "7,7,19,31", "correct": False, "reason": reason})
    instruct = envs.get("sorting", style="instruct", descending=True, seed=2)
    q = instruct.prompt(4)
    assert "descending" in q.text
    assert parse_sorting_prompt(q.text) == (q.info["numbers"], True)
    listed = ", ".join(q.answer.split(","))
    assert run(instruct.score(q.text, f"Sorted:\n<answer>{listed}</answer>"))[0] == 1.0
    assert run(instruct.score(q, f"<answer>{listed}</answer> <answer>1</answer>"))[0] == 0.0
    with pytest.raises(EnvError, match="not a sorting prompt"):
        run(env.score("sort these please", "1,2"))
    for bad, field in [(dict(num_items=1), "num_items"), (dict(max_value=0), "max_value"),
                       (dict(max_value=10**10), "max_value"), (dict(style="chat"), "style"),
                       (dict(eval_fraction=1.0), "eval_fraction"), (dict(seed=-1), "seed"),
                       (dict(format_reward=1.0), "format_reward")]:
        with pytest.raises(EnvError, match=field):
            envs.get("sorting", **bad)
    with pytest.raises(EnvError, match="split"):
        env.prompt(0, "test")


@pytest.mark.parametrize("completion, reason", [
    ("", "no_answer"), ("  \n\t\n", "no_answer"), ("<answer>  </answer>", "no_answer"),
    ("-7,7,19,31", "bad_format"),            # a sign
    ("07,7,19,31", "bad_format"),            # a leading zero
    ("7,7,19,31,", "bad_format"),            # an empty item
    ("7;7;19;31", "bad_format"), ("7 7 19 31", "bad_format"), ("7.0,7,19,31", "bad_format"),
    ("1e1,7,19,31", "bad_format"), ("\u0667,7,19,31", "bad_format"),  # Arabic-Indic 7
    ("7,7,19,31\x00", "bad_format"), ("[7, 7, 19, 31]", "bad_format"),
    ("31,7,19,7=", "bad_format"),            # the prompt echoed with its '='
    ("9" * 5000, "bad_format"),              # beyond Python's int() digit limit
    ("1," * (MAX_COMPLETION_CHARS // 2) + "1", "too_long"),
    ("<answer>7,7,19,31</answer>" * 5000, "too_long"),
    ("7,7,19,31\nno, wait", "bad_format"),   # the last line is the answer
])
def test_sorting_hostile_answers_score_zero_quickly(completion, reason):
    env = envs.get("sorting", format_reward=0.1)
    start = time.perf_counter()
    reward, info = run(env.score("31,7,19,7=", completion))
    assert (reward, info["correct"], info["reason"]) == (0.0, False, reason)
    assert time.perf_counter() - start < 0.5


# ---------------------------------------------------------------------------------------------
# Math answers.

@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", ("42", True)),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", ("\\frac{1}{\\sqrt{2}}", True)),
    ("first \\boxed{1} then \\boxed{ {2} }", ("{2}", True)),
    ("\\boxed 7 is it", ("7", True)),
    ("\\fbox{x+1}", ("x+1", True)),
    ("there are 1,234 apples and 5.5 pears.", ("5.5", False)),
    ("we get -3/4", ("-3/4", False)),
    ("\\boxed{unclosed 12", ("12", False)),
    ("no digits here", (None, False)),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


MATCHES = [
    # fractions, decimals, LaTeX
    ("\\frac{1}{2}", "0.5"), ("1/2", "\\frac12"), ("\\dfrac{3}{4}", "0.75"),
    ("-\\frac{7}{3}", "-7/3"), ("\\frac{-7}{3}", "-\\frac{7}{3}"), ("12", "12.0"),
    ("\\frac{1}{3}", "0.333"),            # reference given to 3 places
    ("0.1+0.2", "0.3"),
    # formatting noise
    ("1,234", "1234"), ("1{,}234.5", "1234.5"), ("1\\,000", "1000"), ("$5$", "5"),
    ("\\$12.50", "12.5"), ("x = 5", "5"), ("90^\\circ", "90"), ("90^{\\circ}", "90"),
    ("5 \\text{ cm}", "5"), ("5cm", "5"), ("12 apples", "12"), ("5 \\text{cm}^2", "5"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("\\text{(B)}", "B"), ("7.", "7"),
    # percentages
    ("50\\%", "0.5"), ("50\\%", "50"), ("50", "50\\%"), ("12.5%", "0.125"),
    # symbolic
    ("2\\sqrt{3}", "\\sqrt{12}"), ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"), ("2^{10}", "1024"),
    ("x^2+2x+1", "(x+1)^2"), ("2x", "x2"), ("\\sqrt[3]{8}", "2"), ("e^{i\\pi}", "-1"),
    ("\\frac{\\sqrt{3}}{2}", "\\sin(\\pi/3)"), ("\\pi", "3.14159265"), ("2\\pi", "2pi"),
    ("3+4i", "4i+3"), ("\\sin x", "sin(x)"), ("y = 2x + 1", "1 + 2x"),
    ("\\frac{x^2-1}{x-1}", "x+1"), ("\\ln(e^2)", "2"), ("\\infty", "\\infty"),
    # lists
    ("(1, 2)", "(1,2)"), ("2, 1", "1, 2"),
]

MISMATCHES = [
    ("3", "4"), ("0.333", "\\frac{1}{3}"), ("0.3333", "1/3"), ("(x+1)^2", "x^2+1"),
    ("(2, 1)", "(1, 2)"), ("1, 2", "1, 2, 3"), ("3xy", "3"), ("2x", "2"), ("-5", "5"),
    ("\\pi", "3.1415"), ("1e5", "100000"), ("", "1"), ("5", ""), ("\\infty", "-\\infty"),
    ("x", "y"), ("\\frac{1}{0}", "1"),
]


@pytest.mark.parametrize("given, reference", MATCHES)
def test_answers_match(given, reference):
    assert answers_match(given, reference)


@pytest.mark.parametrize("given, reference", MISMATCHES)
def test_answers_mismatch(given, reference):
    assert not answers_match(given, reference)


@pytest.mark.parametrize("given", [
    "__import__('os').system('echo pwned')",     # never evaluated
    "10^{10^{10}}", "9^{9^{9}}", "2^{2^{2^{2^{2}}}}", "(" * 300 + "1" + ")" * 300,
    "x^{100000}", "\\frac{" * 50 + "1" + "}{2}" * 50, "\\unknowncmd{3}", "1" * 5000,
])
def test_pathological_answers_are_rejected_fast(given):
    start = time.monotonic()
    assert not answers_match(given, "1")
    assert time.monotonic() - start < 2.0


def test_normalize_answer_reports_percent():
    assert normalize_answer("\\$1{,}234\\%") == ("1234", True)
    assert normalize_answer("\\(x = \\frac{1}{2}\\)") == ("\\frac{1}{2}", False)


def test_math_env():
    env = envs.get("math", format_reward=0.1)
    prompt = Prompt("What is 1/2 + 1/4?", answer="\\frac{3}{4}")
    assert run(env.score(prompt, "... = 0.75, so \\boxed{\\dfrac34}"))[0] == 1.0
    assert run(env.score(prompt, "\\boxed{0.7}")) == (
        0.1, {"correct": False, "reason": "wrong_answer", "extracted": "0.7", "boxed": True})
    assert run(env.score(prompt, "it is 0.75"))[0] == 1.0           # last-number fallback
    assert run(env.score(prompt, "no idea"))[1]["reason"] == "no_answer"
    boxed_only = envs.get("math", require_boxed=True)
    assert run(boxed_only.score(prompt, "it is 0.75"))[0] == 0.0
    with pytest.raises(EnvError, match="Prompt.answer"):
        run(env.score("What is 1/2 + 1/4?", "\\boxed{0.75}"))


def test_linear_equation_task():
    task = LinearEquationTask(difficulty=2, seed=1)
    env = envs.get("math", difficulty=2, seed=1)
    for i in range(20):
        text, answer = task.example(i)
        assert task.example(i) == (text, answer) and env.prompt(i).answer == answer
        a, b, c = task.coefficients(i, "train")
        assert Fraction(c - b, a) * a + b == c
        assert check_math(f"\\boxed{{{float(Fraction(c - b, a))!r}}}", answer)["correct"] or (
            abs(float(Fraction(c - b, a))) > 1e6)
    held = {task.coefficients(i, "eval") for i in range(30)}
    assert not held & {task.coefficients(i, "train") for i in range(300)}


def test_math_env_worker_processes():
    env = envs.get("math", num_workers=1)
    prompt = Prompt("?", answer="\\frac{\\sqrt{3}}{2}")

    async def go():
        results = await score_many(env, [prompt] * 3, ["\\boxed{\\sin(\\pi/3)}",
                                                        "\\boxed{0.866}", "\\boxed{1}"])
        await env.close()
        return results
    assert [r for r, _ in run(go())] == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# Shaping and group statistics.

def test_length_penalties():
    assert linear_length_penalty(0, 100) == 0.0
    assert linear_length_penalty(50, 100, coef=0.5) == -0.25
    assert linear_length_penalty(500, 100) == -1.0
    # DAPO: free up to 80 tokens, linear to -1 at 100, -1 beyond.
    assert [overlong_penalty(n, 100, 20) for n in (10, 80, 90, 100, 101)] == [
        0.0, 0.0, -0.5, -1.0, -1.0]
    shaping = RewardShaping(length_penalty="overlong", max_tokens=100, cache_tokens=20,
                            truncated_reward=0.0)
    assert shaping.apply(1.0, 90) == 0.5
    assert shaping.apply(1.0, 100, truncated=True) == 0.0
    only_correct = RewardShaping(length_penalty="linear", max_tokens=10, length_coef=0.1,
                                 penalize_correct_only=True)
    assert only_correct.apply(0.0, 10) == 0.0 and only_correct.apply(1.0, 10) == 0.9
    with pytest.raises(EnvError, match="length_penalty must be"):
        RewardShaping(length_penalty="quadratic")


def test_group_statistics_and_filtering():
    rewards = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1], [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 1, 1]]
    stats = group_statistics(rewards)
    np.testing.assert_array_equal(stats.zero_signal, [1, 1, 0, 1, 0])
    np.testing.assert_allclose(stats.solve_rate, [1, 0, 0.5, 0, 0.5])
    assert stats.solve_rate_band == pytest.approx(2 / 5)
    metrics = stats.metrics()
    assert metrics["groups/zero_signal"] == 3 and metrics["groups/all_solved"] == 1
    assert metrics["groups/none_solved"] == 2 and metrics["groups/count"] == 5
    solved = [[True] * 4, [False] * 4, [True, False, False, True], [False] * 4, [False] * 4]
    assert group_statistics(rewards, solved).solve_rate_band == pytest.approx(1 / 5)
    kept, dropped = drop_zero_signal_groups(["a", "b", "c", "d", "e"], rewards)
    assert kept == ["c", "e"] and dropped == 3
    np.testing.assert_array_equal(zero_signal(np.zeros((2, 3))), [True, True])
    assert group_statistics([]).solve_rate_band == 0.0


def test_solve_rate_tracker():
    tracker = SolveRateTracker(window=4, revisit_every=3)
    assert not tracker.should_skip("p")          # nothing known
    tracker.update("p", [True, True])
    assert tracker.solve_rate("p") is None and not tracker.should_skip("p")
    tracker.update("p", [True, True])
    assert tracker.solve_rate("p") == 1.0
    assert [tracker.should_skip("p") for _ in range(6)] == [True, True, False, True, True, False]
    tracker.update("p", [False])                 # window slides: 3 of 4 solved
    assert tracker.solve_rate("p") == 0.75 and not tracker.should_skip("p")
    tracker.update(("q", 1), [False] * 4)
    assert tracker.should_skip(("q", 1))
    state = tracker.state_dict()
    restored = SolveRateTracker(window=4, revisit_every=3)
    restored.load_state_dict(state)
    assert restored.solve_rate("p") == 0.75 and restored.solve_rate(("q", 1)) == 0.0
    assert restored.metrics()["solve_rate_tracker/never_solved"] == 1
    small = SolveRateTracker(window=2, max_prompts=2)
    for key in "abc":
        small.update(key, [True, True])
    assert small.solve_rate("a") is None and small.solve_rate("c") == 1.0


# ---- long addition and the delayed wrapper -------------------------------------------------

def test_long_addition_scores_exact_sums_and_refuses_hostile_answers():
    env = envs.get("long_addition", min_digits=2, max_digits=12)
    prompt = env.prompt(7)
    a, b = prompt.info["operands"]
    assert prompt.text == f"{a}+{b}=" and env.prompt(7).text == prompt.text
    run = asyncio.run
    assert run(env.score(prompt, str(a + b)))[0] == 1.0
    assert run(env.score(prompt, str(a + b) + "<eos>"))[0] == 1.0
    for hostile in ["0" + str(a + b), str(a + b) + " ", "٣" * 5, str(a + b + 1), "",
                    "9" * 100000, f"{a}+{b}", str(a + b) + "<eos><eos>"]:
        reward, info = run(env.score(prompt, hostile))
        assert reward == 0.0 and not info["correct"] and info["reason"], hostile
    train = {env.prompt(i).text for i in range(300)}
    held_out = {env.prompt(i, "eval").text for i in range(300)}
    assert not train & held_out
    sizes = {len(str(env.prompt(i).info["operands"][0])) for i in range(300)}
    assert sizes == set(range(2, 13))
    with pytest.raises(EnvError, match="long_addition"):
        envs.get("long_addition", min_digits=5, max_digits=3)
    with pytest.raises(EnvError, match="long-addition prompt"):
        run(env.score("12+x=", "1"))


def test_delayed_env_stalls_only_while_its_control_file_says_so(tmp_path):
    import json
    import time
    control = tmp_path / "control.json"
    env = envs.get("delayed", task="arithmetic", task_kwargs={"num_digits": 2}, control=control)
    prompt = env.prompt(0)
    answer = prompt.answer
    start = time.monotonic()
    assert asyncio.run(env.score(prompt, answer))[0] == 1.0
    assert time.monotonic() - start < 0.3  # no file: no delay
    control.write_text(json.dumps({"delay_s": 0.6, "until": time.time() + 30}))
    env._read_at = -1.0
    start = time.monotonic()
    assert asyncio.run(env.score(prompt, answer))[0] == 1.0
    assert time.monotonic() - start >= 0.6
    control.write_text("{not json")
    env._read_at = -1.0
    assert env.delay_s() == 0.0
    assert env.ALPHABET == env.task.ALPHABET
    with pytest.raises(EnvError, match="control"):
        envs.get("delayed")
