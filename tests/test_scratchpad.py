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
    assert TASK.format_prompt(507, 219, 3) == "c5b0a7+c2b1a9="
    assert TASK.format_completion(507, 219, 3) == "a7+9+0=16;b0+1+1=02;c5+2+0=07;|c7b2a6"
    # a final carry gets the next letter; leading zeros of the operands are written
    assert TASK.format_completion(95, 8, 2) == "a5+8+0=13;b9+0+1=10;|c1b0a3"
    assert TASK.format_prompt(95, 8, 2) == "b9a5+b0a8="
    assert TASK.parse_prompt("c5b0a7+c2b1a9=") == (507, 219, 3)
    for bad in ("c5b0a7+b1a9=", "a5b0c7+c2b1a9=", "c5b0a7+c2b1a9", "507+219=", "c5b0a7+c2b1a9=x"):
        with pytest.raises(ValueError):
            ScratchpadAdditionTask.parse_prompt(bad)


def test_lengths_follow_the_problem_and_vary_tenfold():
    """Median >= 60 characters, p95/p50 >= 4 (no ignore_eos: the written work's own length)."""
    lengths = []
    for i in range(3000):
        a, b, n = TASK.operands(i)
        completion = TASK.format_completion(a, b, n)
        assert len(completion) == TASK.completion_length(n, carry=a + b >= 10**n)
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
    for bad in (dict(min_digits=0), dict(min_digits=5, max_digits=4), dict(max_digits=26),
                dict(power=-1.0), dict(split="test"), dict(eval_fraction=1.0)):
        with pytest.raises(ValueError):
            ScratchpadAdditionTask(**bad)


def test_the_reward_grades_only_the_stated_result_and_refuses_hacks():
    env = envs.get("scratchpad", format_reward=0.1)
    prompt = env.prompt(7)
    a, b, n = prompt.info["operands"]
    right = env.task.format_completion(a, b, n)
    result = env.task.format_result(a, b, n)
    assert score(env, prompt, right) == (1.0, {"expected": result, "digits": n,
                                                "correct": True, "reason": "correct"})
    assert score(env, prompt, right + "<eos>")[0] == 1.0
    assert score(env, prompt.text, "|" + result)[0] == 1.0  # the work is not graded
    wrong = env.task.tagged(str(a + b + 1).zfill(len(result) // 2))
    hostile = {
        right + "|" + wrong: (0.0, "several_answers"),        # two results: never credited
        wrong and ("|" + wrong + "|" + result): (0.0, "several_answers"),
        right[:right.index("|")]: (0.0, "no_answer"),        # work, no result
        right + "0": (0.0, "bad_format"),                      # trailing junk
        right.replace("|", "| "): (0.0, "bad_format"),
        "|" + result[1::2]: (0.0, "bad_format"),               # digits without their letters
        "|" + result.upper(): (0.0, "bad_format"),
        "|" + "".join(result[i:i + 2] for i in range(len(result) - 2, -1, -2)): (
            0.1, "wrong_answer"),                              # places in the wrong order
        "|" + wrong: (0.1, "wrong_answer"),
        "": (0.0, "no_answer"),
        "|" * 10_000: (0.0, "several_answers"),
        "a" * 100_000 + "|" + result + "<eos><eos>": (0.0, "bad_format"),
        "|" + result + "\x00": (0.0, "bad_format"),
        "|" + "a١": (0.0, "bad_format"),                       # a non-ASCII digit
    }
    for completion, (reward, reason) in hostile.items():
        got, info = score(env, prompt, completion)
        assert (got, info["reason"]) == (reward, reason), completion[:60]
        assert info["correct"] is False
    with pytest.raises(EnvError, match="not a scratchpad addition prompt"):
        score(env, "12+34=", "|a6b4")
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
