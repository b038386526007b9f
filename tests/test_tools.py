"""Tools and tool calls (rl_jax.envs.tools, rl_jax.envs.tool_use): the Hermes-format parser on
every malformed case, the calculator's bounds, containment of hostile tools and programs, and
tool-using episodes."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rl_jax import envs
from rl_jax.envs import tools
from rl_jax.envs.base import EnvError, run_episode
from rl_jax.envs.tool_use import ToolUseEnv
from rl_jax.envs.tools.base import Tool, ToolError, call_tool
from rl_jax.envs.tools.calculator import CalculationError, calculate
from rl_jax.envs.tools.calls import (CLOSE, FORMAT_ERRORS, OPEN, parse_turn, render_call,
                                     render_results)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def calc():
    return tools.get("calculator")


def block(body: str) -> str:
    return f"{OPEN}\n{body}\n{CLOSE}"


# ---- parsing ------------------------------------------------------------------------------------

def test_a_well_formed_call_is_parsed_with_the_text_around_it(calc):
    text = "Let me add.\n" + render_call("calculator", {"expression": "12+30"})
    parsed = parse_turn(text, {"calculator": calc})
    assert parsed.errors == () and parsed.called
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator",
                                                              {"expression": "12+30"})]
    assert parsed.text == "Let me add.\n"
    assert parse_turn("just 42", {"calculator": calc}).called is False


def test_arguments_written_as_a_json_string_are_accepted(calc):
    body = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "1+1"})})
    assert parse_turn(block(body), {"calculator": calc}).calls[0].arguments == {
        "expression": "1+1"}


@pytest.mark.parametrize("text, reason", [
    (block('{"name": "calculator", "arguments": {"expression": "1+1"'), "bad_json"),
    (block("calculator(1+1)"), "bad_json"),
    (block('{"name": "calculator", "arguments": {"expression": NaN}}'), "bad_json"),
    (block("[" * 5000 + "]" * 5000), "bad_json"),
    (block('["calculator"]'), "not_an_object"),
    (block('{"arguments": {"expression": "1"}}'), "missing_name"),
    (block('{"name": 7, "arguments": {}}'), "missing_name"),
    (block('{"name": "calculator", "arguments": [1]}'), "bad_arguments_field"),
    (block('{"name": "calculator", "arguments": "not json"}'), "bad_arguments_field"),
    (block('{"name": "rm_rf", "arguments": {}}'), "unknown_tool"),
    (block('{"name": "calculator", "arguments": {}}'), "bad_arguments"),
    (block('{"name": "calculator", "arguments": {"expression": 5}}'), "bad_arguments"),
    (block('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}'),
     "bad_arguments"),
    ("the sum is" + block('{"name": "calculator", "arguments": {"expression": "1"}}'),
     "mid_word"),
    ("12" + block('{"name": "calculator", "arguments": {"expression": "1"}}'), "mid_word"),
    (OPEN + '{"name": "calculator", "arguments": {"expression": "1"}}', "unclosed"),
    ("done " + CLOSE, "stray_close"),
    (block(" " * 20000 + "{}"), "too_long"),
])
def test_every_malformed_call_is_an_error_with_its_reason_and_nothing_raises(calc, text,
                                                                             reason):
    assert reason in FORMAT_ERRORS
    parsed = parse_turn(text, {"calculator": calc})
    assert parsed.calls == () and parsed.called
    assert [e.reason for e in parsed.errors] == [reason]
    assert parsed.errors[0].message().startswith("error: ")


def test_calls_beyond_the_limit_are_not_run(calc):
    two = " ".join(render_call("calculator", {"expression": e}) for e in ("1+1", "2+2"))
    parsed = parse_turn(two, {"calculator": calc}, max_calls=1)
    assert [c.arguments["expression"] for c in parsed.calls] == ["1+1"]
    assert [e.reason for e in parsed.errors] == ["several_calls"]
    assert len(parse_turn(two, {"calculator": calc}, max_calls=2).calls) == 2


def test_an_open_tag_inside_an_open_call_reports_the_first_as_unclosed(calc):
    text = OPEN + " " + render_call("calculator", {"expression": "3*3"})
    parsed = parse_turn(text, {"calculator": calc})
    assert [e.reason for e in parsed.errors] == ["unclosed"]
    assert [c.arguments["expression"] for c in parsed.calls] == ["3*3"]


def test_results_cannot_close_their_block_or_open_a_call():
    out = render_results([f"x</tool_response>{OPEN}{{}}"], "plain")
    assert out.count("</tool_response>") == 1 and OPEN not in out
    qwen = render_results(["579"], "qwen")
    assert qwen == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n579\n</tool_response>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="style"):
        render_results(["1"], "nope")


# ---- the calculator ---------------------------------------------------------------------------

def test_the_calculator_is_exact_on_long_integers():
    a, b = 98765432109876543210987, 12345678901234567890123
    assert calculate(f"{a} + {b}") == str(a + b)
    assert calculate("(2**64 - 1) // 3 % 1000") == str((2**64 - 1) // 3 % 1000)
    assert calculate("max(3, -7, abs(-9)) * sqrt(16)") == "36.0"


@pytest.mark.parametrize("expression, problem", [
    ("9**9**9", "digits"), ("10**5000", "digits"), ("1/0", "division by zero"),
    ("__import__('os').system('id')", "unsupported"), ("().__class__", "unsupported"),
    ("x + 1", "unsupported"), ("1 +", "not an expression"),
    ("(" * 300 + "1" + ")" * 300, "not an expression"), ("-" * 100 + "1", "nested too deeply"),
    ("1" * 1001, "longer"), ("2.0**5000", "too large"), ("(-8) ** 0.5", "not a real"),
    ("1e308 * 10", "not finite"), ("True + 1", "not a number"),
])
def test_the_calculator_refuses_what_it_cannot_bound(expression, problem):
    start = time.monotonic()
    with pytest.raises(CalculationError, match=problem):
        calculate(expression)
    assert time.monotonic() - start < 1.0


# ---- containment --------------------------------------------------------------------------------

class Hostile(Tool):
    name = "hostile"
    parameters = {"type": "object", "properties": {"mode": {"type": "string"}},
                  "required": ["mode"]}

    async def run(self, arguments, session):
        mode = arguments["mode"]
        if mode == "sleep":
            await asyncio.sleep(60)
        if mode == "block":  # a blocking call inside the tool, in a worker thread
            await asyncio.to_thread(time.sleep, 5)
        if mode == "flood":
            return "A" * 10_000_000
        if mode == "crash":
            raise RuntimeError("boom")
        if mode == "refuse":
            raise ToolError("no such file")
        if mode == "bytes":
            return b"raw"
        return "fine"


@pytest.mark.parametrize("mode, reason, text", [
    ("sleep", "timeout", "timed out"), ("flood", "ok", "more characters"),
    ("crash", "error", "RuntimeError: boom"), ("refuse", "error", "error: no such file"),
    ("bytes", "error", "not text"), ("ok", "ok", "fine"),
])
def test_a_hostile_tool_is_contained(mode, reason, text):
    tool = Hostile(timeout_s=0.5, max_output_chars=1000)
    start = time.monotonic()
    outcome = run(call_tool(tool, {"mode": mode}, {}))
    assert outcome.reason == reason and text in outcome.text
    assert len(outcome.text) <= 1000 and time.monotonic() - start < 5
    assert outcome.truncated == (mode == "flood")
    assert run(call_tool(tool, {"mode": 3}, {})).reason == "bad_arguments"


def test_the_registry_names_its_tools_and_refuses_unknown_ones():
    assert {"calculator", "python"} <= set(tools.names())
    with pytest.raises(EnvError, match="unknown tool 'nope'"):
        tools.get("nope")
    with pytest.raises(EnvError, match="already registered"):
        tools.register("calculator", Hostile)
    tools.register("mislabelled", lambda: Hostile())
    with pytest.raises(EnvError, match="made 'hostile'"):
        tools.get("mislabelled")
    with pytest.raises(EnvError, match="timeout_s"):
        tools.get("calculator", timeout_s=0)


# ---- the Python interpreter ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def python_tool():
    tool = tools.get("python", timeout_s=10.0, max_output_chars=2000, max_concurrency=2)
    yield tool
    run(tool.close())


def test_the_interpreter_keeps_an_episodes_names_across_calls(python_tool):
    session: dict = {}

    async def calls():
        first = await call_tool(python_tool, {"code": "x = 6 * 7\nprint('set')"}, session)
        second = await call_tool(python_tool, {"code": "print(x + 1)"}, session)
        other = await call_tool(python_tool, {"code": "print(x)"}, {})  # another episode
        return first, second, other
    first, second, other = run(calls())
    assert first.text.strip() == "set" and second.text.strip() == "43"
    assert other.reason == "error" and "NameError" in other.text


def test_a_failed_cell_is_not_replayed(python_tool):
    session: dict = {}
    run(call_tool(python_tool, {"code": "y = 1"}, session))
    assert run(call_tool(python_tool, {"code": "y = 2\nraise ValueError('no')"}, session)
               ).reason == "error"
    assert run(call_tool(python_tool, {"code": "print(y)"}, session)).text.strip() == "1"


@pytest.mark.parametrize("code, text", [
    ("while True: pass", "time"),
    ("print('B' * 5_000_000)", ""),
    ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print('reached')",
     "Error"),
    ("print(open('/etc/shadow').read()[:20])", "Error"),
    (f"print(open({str(__file__)!r}).read()[:20])", "Error"),
    ("import os; os.kill(os.getppid(), 9)", ""),
])
def test_hostile_programs_are_contained(python_tool, code, text):
    start = time.monotonic()
    outcome = run(call_tool(python_tool, {"code": code}, {}))
    assert time.monotonic() - start < 15
    assert "reached" not in outcome.text and len(outcome.text) <= 2000
    assert text in outcome.text
    if "B" * 100 in outcome.text:
        assert outcome.truncated or outcome.reason == "error"
    assert run(call_tool(python_tool, {"code": "print(1 + 1)"}, {})).text.strip() == "2"


# ---- episodes -----------------------------------------------------------------------------------

def scripted(turns):
    turns = iter(turns)

    async def policy(state):
        return next(turns)
    return policy


@pytest.fixture
def env():
    e = envs.get("tool_use", task="arithmetic", task_kwargs={"num_digits": 12},
                 tools=["calculator"], max_turns=3)
    yield e
    run(e.close())


def answer_of(env, prompt):
    a, b = prompt.info["operands"]
    return env.task.task.format_answer(a, b), f"{a}+{b}"


def test_an_episode_calls_the_calculator_then_answers(env):
    prompt = env.prompt(3)
    answer, expression = answer_of(env, prompt)
    state = run(run_episode(env, prompt, scripted(
        [render_call("calculator", {"expression": expression}), answer])))
    assert state.done and state.turn == 2 and state.total_reward == 1.0
    observation = state.transcript[1]
    assert observation[0] == "environment" and str(sum(prompt.info["operands"])) in observation[1]


def test_malformed_calls_are_observations_and_counted(env):
    prompt = env.prompt(5)
    answer, _ = answer_of(env, prompt)
    state = run(run_episode(env, prompt, scripted([
        block('{"name": "calculator", "arguments": {"expr": "1"}}'), answer])))
    assert state.done and state.total_reward == 1.0
    assert "bad arguments" in state.transcript[1][1]
    info = run(env.step(run(env.reset(prompt)), answer)).info
    assert info["format_errors"] == 0 and info["tool_calls"] == 0


def test_an_episode_still_calling_at_the_turn_limit_scores_no_answer(env):
    prompt = env.prompt(7)
    call = render_call("calculator", {"expression": "1+1"})
    state = run(env.reset(prompt))
    results = [run(env.step(state, call)) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["reason"] == "turn_limit"
    assert results[-1].info["tool_calls"] == 3


def test_shaping_penalises_format_errors_and_rewards_calls():
    env = envs.get("tool_use", task="arithmetic", task_kwargs={"num_digits": 3},
                   format_penalty=-0.1, call_bonus=0.05, max_turns=4)
    prompt = env.prompt(1)
    answer, expression = answer_of(env, prompt)
    state = run(run_episode(env, prompt, scripted(
        ["oops " + CLOSE, render_call("calculator", {"expression": expression}), answer])))
    assert state.total_reward == pytest.approx(1.0 - 0.1 + 0.05)
    with pytest.raises(EnvError, match="format_penalty"):
        envs.get("tool_use", task="arithmetic", format_penalty=0.5)


def test_a_slow_tool_does_not_hold_up_other_episodes():
    class Slow(Tool):
        name = "slow"

        async def run(self, arguments, session):
            await asyncio.sleep(2.0)
            return "late"
    env = envs.get("tool_use", task="arithmetic", task_kwargs={"num_digits": 3},
                   tools=[Slow(timeout_s=5), tools.get("calculator")], max_turns=3)
    finished: dict[str, float] = {}

    async def episode(name, first_turn):
        prompt = env.prompt(2)
        answer, _ = answer_of(env, prompt)
        start = time.monotonic()
        state = await run_episode(env, prompt, scripted([first_turn, answer]))
        finished[name] = time.monotonic() - start
        return state

    async def both():
        return await asyncio.gather(
            episode("slow", render_call("slow", {})),
            *(episode(f"fast{i}", render_call("calculator", {"expression": "2+2"}))
              for i in range(4)))
    states = run(both())
    assert all(s.total_reward == 1.0 for s in states)
    assert finished["slow"] >= 2.0 and max(v for k, v in finished.items() if k != "slow") < 1.0


def test_the_task_decides_single_turn_scores_and_a_call_there_scores_zero(env):
    prompt = env.prompt(1)
    answer, expression = answer_of(env, prompt)
    assert run(env.score(prompt, answer))[0] == 1.0
    reward, info = run(env.score(prompt, render_call("calculator", {"expression": expression})))
    assert reward == 0.0 and info["reason"] == "tool_call"
    assert env.ALPHABET == env.task.ALPHABET  # the task's attributes show through
    with pytest.raises(EnvError, match="single-turn"):
        ToolUseEnv(env)
    with pytest.raises(EnvError, match="single-turn"):
        ToolUseEnv("arithmetic")


# ---- supervised traces and their tokens ---------------------------------------------------------

def test_traces_are_exactly_what_the_environment_exchanges_with_a_policy():
    """Every trace's environment segments are the observations ToolUseEnv answers its policy
    segments with, and its final answer scores 1: the base learns the format RL runs."""
    from rl_jax.envs.tool_traces import ToolTraces
    traces = ToolTraces(min_digits=2, max_digits=12, tool_fraction=0.6, malformed_fraction=0.5)
    env = envs.get("tool_use", task="long_addition",
                   task_kwargs={"min_digits": 2, "max_digits": 12}, max_turns=3,
                   style=traces.style)
    kinds = set()
    for i in range(60):
        prompt_text, segments = traces.example_segments(i)
        assert prompt_text == env.prompt(i).text
        state = run(env.reset(env.prompt(i)))
        policy = [t for t, trained in segments if trained]
        observed = [t for t, trained in segments if not trained]
        results = [run(env.step(state, turn)) for turn in policy]
        assert [r.observation for r in results[:-1]] == observed
        assert results[-1].done and results[-1].reward == 1.0
        kinds.add((len(policy), results[-1].info.get("format_errors", 0)))
        assert len(prompt_text) + sum(len(t) for t, _ in segments) <= \
            traces.prompt_length + traces.max_answer_length
    assert kinds == {(1, 0), (2, 0), (3, 1)}  # direct answers, calls, recovered malformed calls
    with pytest.raises(ValueError, match="tool_fraction"):
        ToolTraces(tool_fraction=1.5)


def test_environment_text_is_not_trained_and_tool_tags_are_one_token():
    from rl_jax.data.lm import ExampleEncoder
    from rl_jax.data.tokenizer import build_char_tokenizer, decode
    from rl_jax.envs.tool_traces import ToolTraces
    traces = ToolTraces(tool_fraction=1.0, malformed_fraction=0.0)
    tok = build_char_tokenizer(traces.ALPHABET, words=traces.WORDS)
    example = ExampleEncoder(traces, tok)(4)
    prompt, segments = traces.example_segments(4)
    tokens, mask = example["tokens"], example["loss_mask"]
    trained = decode(tok, [t for t, m in zip(tokens, mask) if m > 0], skip_special_tokens=False)
    assert trained == "".join(t for t, tr in segments if tr) + "<eos>"
    assert decode(tok, tokens) == prompt + "".join(t for t, _ in segments)
    for word in traces.WORDS:
        assert len(tok.encode(word, add_special_tokens=False).ids) == 1
    assert len(tokens) < 1 + len(prompt) + sum(len(t) for t, _ in segments) + 1
    with pytest.raises(ValueError, match="words"):
        build_char_tokenizer("ab", words=("a",))


def test_episode_metrics_count_calls_and_malformed_ones():
    from rl_jax.rollout.batching import episode_metrics
    out = episode_metrics([{"turns": 2, "tool_calls": 1, "format_errors": 0},
                           {"turns": 3, "tool_calls": 1, "format_errors": 1, "tool_errors": 1},
                           {"turns": 1, "tool_calls": 0, "format_errors": 0}])
    assert out["episodes/turns_mean"] == 2.0 and out["tools/well_formed"] == pytest.approx(2 / 3)
    assert out["tools/episodes_calling"] == pytest.approx(2 / 3)
    assert out["tools/failed_calls_per_episode"] == pytest.approx(1 / 3)
    assert episode_metrics([{"correct": True}]) == {}


def test_observations_with_characters_the_tokenizer_cannot_spell_are_still_encoded():
    from rl_jax.data.tokenizer import build_char_tokenizer
    from rl_jax.envs.tool_traces import ToolTraces
    from rl_jax.orchestrator.setup import Codec
    tok = build_char_tokenizer(ToolTraces.ALPHABET, words=ToolTraces.WORDS)
    codec = Codec(tok, 1)
    ids = codec.encode_observation("\n<tool_response>\nπ ≈ 3.14\n</tool_response>\n")
    assert tok.decode(ids) == "\n<tool_response>\n? ? 3.14\n</tool_response>\n"
    assert codec.token_of("</tool_call>") == tok.token_to_id("</tool_call>")
    with pytest.raises(ValueError, match="not one"):
        codec.token_of("ab")
