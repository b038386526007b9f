"""The long-addition task with written work: its format, sizes and splits, its reward against
hostile completions, and the supervised recipe's token-filled batches."""

import asyncio

import numpy as np
import pytest

from rl_jax import envs
from rl_jax.data.lm import lm_batches
from rl_jax.data.scratchpad import ScratchpadAdditionTask
from rl_jax.data.tokenizer import build_char_tokenizer, special_token_ids
from rl_jax.envs.base import EnvError

TASK = ScratchpadAdditionTask()


def score(env, prompt, completion):
    return asyncio.run(env.score(prompt, completion))


def test_the_work_is_written_column_by_column_with_carries():
    assert TASK.format_prompt(507, 219, 3) == "a79b01c52="
    work = "a:7+9+0=1,6;b:0+1+1=0,2;c:5+2+0=0,7;"
    assert TASK.format_completion(507, 219, 3) == work
    assert TASK.stated_answer(work, 3) == 726
    # the last step's carry leads the answer; leading zeros of the operands are written
    assert TASK.format_prompt(95, 8, 2) == "a58b90="
    assert TASK.format_completion(95, 8, 2) == "a:5+8+0=1,3;b:9+0+1=1,0;"
    assert TASK.stated_answer("a:5+8+0=1,3;b:9+0+1=1,0;<eos>", 2) == 103
    assert TASK.parse_prompt("a79b01c52=") == (507, 219, 3)
    for bad in ("a79b01c5=", "b79a01c52=", "a79b01c52", "507+219=", "a79b01c52=x", "a79a01=",
                "a79b0١c52="):
        with pytest.raises(ValueError):
            ScratchpadAdditionTask.parse_prompt(bad)


def test_lengths_follow_the_problem_and_vary_tenfold():
    """Median >= 60 tokens, p95/p50 >= 4 (no ignore_eos: the written work's own length)."""
    lengths = []
    for i in range(3000):
        a, b, n = TASK.operands(i)
        completion = TASK.format_completion(a, b, n)
        assert TASK.check((a, b, n), completion)
        lengths.append(len(completion) + 1)  # + <eos>
    p50, p95 = np.percentile(lengths, [50, 95])
    assert p50 >= 60 and p95 / p50 >= 4, (p50, p95)
    assert max(lengths) <= TASK.max_answer_length + 1


def test_examples_are_pure_and_the_splits_disjoint():
    assert TASK.example(123) == ScratchpadAdditionTask().example(123)
    assert TASK.example(123) != ScratchpadAdditionTask(seed=1).example(123)
    held_out = TASK.with_split("eval")
    train = {tuple(sorted(TASK.operands(i)[:2])) for i in range(3000)}
    test = {tuple(sorted(held_out.operands(i)[:2])) for i in range(300)}
    assert not train & test
    assert all(held_out.in_split(*held_out.operands(i)[:2]) for i in range(50))
    for bad in (dict(min_digits=0), dict(min_digits=5, max_digits=4), dict(max_digits=27),
                dict(power=-1.0), dict(split="test"), dict(eval_fraction=1.0)):
        with pytest.raises(ValueError):
            ScratchpadAdditionTask(**bad)


def test_the_reward_checks_the_answer_the_work_spells_and_refuses_hacks():
    env = envs.get("scratchpad", format_reward=0.1)
    prompt = next(p for p in (env.prompt(i) for i in range(100)) if p.info["operands"][2] >= 4)
    a, b, n = prompt.info["operands"]
    right = env.task.format_completion(a, b, n)
    assert score(env, prompt, right) == (1.0, {"expected": str(a + b), "digits": n,
                                                "correct": True, "reason": "correct"})
    assert score(env, prompt, right + "<eos>")[0] == 1.0
    assert score(env, prompt.text, right)[0] == 1.0  # the prompt parsed from its text
    steps = [right[i:i + 12] for i in range(0, len(right), 12)]
    # the digits of A and B the work restates are not graded, only what it adds up to
    restated = "".join(s[:2] + "0+0+" + s[6:] for s in steps)
    assert score(env, prompt, restated)[0] == 1.0
    flipped = right[:-2] + str((int(right[-2]) + 1) % 10) + ";"
    hostile = {
        flipped: (0.1, "wrong_answer"),
        right[:-12]: (0.0, "bad_format"),                      # a column left out
        right + steps[-1]: (0.0, "bad_format"),                # a column too many
        right + right: (0.0, "bad_format"),                    # two answers
        "".join(reversed(steps)): (0.0, "bad_format"),         # columns out of order
        right + "0": (0.0, "bad_format"),                      # trailing junk
        right + "<eos><eos>": (0.0, "bad_format"),
        right.replace(";", "; ", 1): (0.0, "bad_format"),
        right.upper(): (0.0, "bad_format"),
        right.replace("1", "١"): (0.0, "bad_format"),          # non-ASCII digits
        right[:-1] + "\x00": (0.0, "bad_format"),
        "": (0.0, "bad_format"),
        str(a + b): (0.0, "bad_format"),                        # the bare answer
        "a" * 100_000: (0.0, "bad_format"),
    }
    for completion, (reward, reason) in hostile.items():
        got, info = score(env, prompt, completion)
        assert (got, info["reason"]) == (reward, reason), completion[:60]
        assert info["correct"] is False
    with pytest.raises(EnvError, match="not a scratchpad addition prompt"):
        score(env, "12+34=", right)
    with pytest.raises(EnvError, match="format_reward"):
        envs.get("scratchpad", format_reward=1.0)
    with pytest.raises(EnvError, match="max_digits"):
        envs.get("scratchpad", max_digits=40)


def test_supervised_batches_are_filled_by_tokens_and_pure_in_their_index():
    tokenizer = build_char_tokenizer(TASK.ALPHABET)
    batches = lm_batches(TASK, tokenizer, rows_per_batch=4, seq_len=512, seed=3)
    first, again = batches[5], lm_batches(TASK, tokenizer, rows_per_batch=4, seq_len=512,
                                          seed=3)[5]
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert first["tokens"].shape == (4, 512)
    used = (first["segment_ids"] > 0).sum()
    examples = len(np.unique(first["sequence_index"][first["segment_ids"] > 0]))
    # Filled by tokens: many examples of very different lengths, most of the slots used.
    assert examples >= 8 and used >= 0.75 * 4 * 512, (examples, used)
    bos = special_token_ids(tokenizer)["bos"]
    assert (first["tokens"] == bos).sum() == examples
    assert not np.array_equal(batches[5]["tokens"], batches[6]["tokens"])


def test_the_trl_peer_runs_the_recipes_settings():
    """``benchmarks/trl_baseline.py`` (run in its own venv, without JAX) copies the settings of
    ``configs/scratchpad_rl.py`` it can match: they must not drift apart."""
    import ast
    from pathlib import Path

    from rl_jax.recipe.checks import load_recipe_file

    root = Path(__file__).resolve().parents[1]
    source = ast.parse((root / "benchmarks" / "trl_baseline.py").read_text())
    peer, examples = None, None
    for node in ast.walk(source):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "RECIPE":
            # literals and dict(...) calls only: evaluated with nothing else in scope
            peer = eval(compile(ast.Expression(node.value), "RECIPE", "eval"),
                        {"__builtins__": {}, "dict": dict})
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "DEFINE_integer"
                and node.args and getattr(node.args[0], "value", "") == "eval_examples"):
            examples = node.args[1].value
    assert peer is not None and examples is not None
    c = load_recipe_file(root / "configs" / "scratchpad_rl.py")
    assert peer["env"] == c.env.name and peer["env_kwargs"] == dict(c.env.kwargs)
    assert (peer["group_size"], peer["groups_per_batch"], peer["max_new_tokens"],
            peer["temperature"]) == (c.rollout.group_size, c.rollout.groups_per_batch,
                                     c.rollout.max_new_tokens, c.rollout.temperature)
    o = c.optimizer
    assert (peer["learning_rate"], peer["warmup_steps"], peer["final_lr_ratio"], peer["b1"],
            peer["b2"], peer["adam_eps"], peer["weight_decay"], peer["max_grad_norm"]) == (
        o.learning_rate, o.warmup_steps, o.final_lr_ratio, o.b1, o.b2, o.eps, o.weight_decay,
        o.max_grad_norm)
    assert examples == c.eval.examples
