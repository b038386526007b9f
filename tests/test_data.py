"""Tests of rl_jax.data: char tokenizer, arithmetic task, packing, grain LM pipeline."""

import pickle

import numpy as np
import pytest
from tokenizers import Tokenizer

from rl_jax.data.arithmetic import ArithmeticTask, operand_pair_in_eval
from rl_jax.data.lm import (eval_arrays, exact_match, example_dataset, examples_per_row, lm_batches,
                            max_example_length)
from rl_jax.data.packing import PACKED_KEYS, pack_sequences, packing_stats
from rl_jax.data.tokenizer import (alphabet_of, build_char_tokenizer, decode, encode,
                                   special_token_ids)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ArithmeticTask.ALPHABET)


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_ids(tok):
    assert special_token_ids(tok) == {"pad": 0, "bos": 1, "eos": 2}
    assert tok.get_vocab_size() == 3 + len(ArithmeticTask.ALPHABET)
    for i, c in enumerate(ArithmeticTask.ALPHABET):
        assert tok.token_to_id(c) == 3 + i
    assert [tok.token_to_id(s) for s in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert alphabet_of(tok) == ArithmeticTask.ALPHABET


def test_tokenizer_round_trip_including_whitespace():
    alphabet = "ab c\n\t0+="
    tok = build_char_tokenizer(alphabet)
    rng = np.random.default_rng(0)
    for _ in range(200):
        text = "".join(rng.choice(list(alphabet), size=rng.integers(0, 30)))
        ids = encode(tok, text)
        assert len(ids) == len(text)
        assert ids == [3 + alphabet.index(c) for c in text]
        assert decode(tok, ids) == text


def test_tokenizer_decode_specials(tok):
    ids = [1] + encode(tok, "12+3=") + [2, 0]
    assert decode(tok, ids) == "12+3="
    assert decode(tok, ids, skip_special_tokens=False) == "<bos>12+3=<eos><pad>"
    assert decode(tok, np.array(ids, np.int32)) == "12+3="


def test_tokenizer_rejects_unknown_characters(tok):
    with pytest.raises(ValueError, match=r"\['x'\].*not in the tokenizer's alphabet"):
        encode(tok, "12x+3")
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        encode(tok, "1<eos>")


def test_tokenizer_rejects_spelled_special_token():
    tok = build_char_tokenizer("<eos>")
    assert encode(tok, "soe") == [6, 5, 4]
    with pytest.raises(ValueError, match="special-token string"):
        encode(tok, "<eos>")


@pytest.mark.parametrize("alphabet, specials, message", [
    ("", ("<pad>", "<bos>", "<eos>"), "empty"),
    ("abca", ("<pad>", "<bos>", "<eos>"), "repeats"),
    ("ab", ("<pad>", "<bos>"), "at least 3"),
    ("ab", ("<pad>", "<bos>", "<pad>"), "specials repeat"),
    ("ab", ("<pad>", "<bos>", "a"), "also alphabet"),
])
def test_tokenizer_build_errors(alphabet, specials, message):
    with pytest.raises(ValueError, match=message):
        build_char_tokenizer(alphabet, specials)


def test_tokenizer_custom_specials():
    tok = build_char_tokenizer("01", specials=("[PAD]", "[BOS]", "[EOS]", "[SEP]"))
    assert special_token_ids(tok) == {"pad": 0, "bos": 1, "eos": 2}
    assert tok.token_to_id("[SEP]") == 3
    assert encode(tok, "10") == [5, 4]


def test_tokenizer_save_and_reload(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = Tokenizer.from_file(str(path))
    assert loaded.to_str() == tok.to_str()
    assert loaded.get_vocab() == tok.get_vocab()
    assert special_token_ids(loaded) == special_token_ids(tok)
    assert alphabet_of(loaded) == alphabet_of(tok)
    text = "0123456789+=9876+5="
    assert encode(loaded, text) == encode(tok, text)
    assert decode(loaded, encode(loaded, text)) == text
    with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
        encode(loaded, "a")


def test_tokenizer_pickles(tok):
    assert encode(pickle.loads(pickle.dumps(tok)), "12+3=") == encode(tok, "12+3=")


# ----------------------------------------------------------------------------- arithmetic

def test_formatting():
    task = ArithmeticTask(num_digits=3)
    assert task.format_prompt(123, 456) == "123+456="
    assert task.format_answer(123, 456) == "975"
    assert task.format_prompt(7, 12) == "007+012="
    assert task.format_answer(7, 12) == "91"
    assert task.format_answer(999, 999) == "8991"
    assert task.format_answer(0, 0) == "0"
    forward = ArithmeticTask(num_digits=3, reverse_answer=False)
    assert forward.format_answer(123, 456) == "579"
    assert forward.format_answer(999, 999) == "1998"
    assert (task.prompt_length, task.max_answer_length) == (8, 4)


@pytest.mark.parametrize("num_digits", [1, 2, 3, 5])
def test_examples_are_correct_sums(num_digits):
    task = ArithmeticTask(num_digits=num_digits, seed=3)
    for i in range(200):
        a, b = task.operands(i)
        assert 0 <= a < 10**num_digits and 0 <= b < 10**num_digits
        prompt, answer = task.example(i)
        assert prompt == task.prompt(i) and answer == task.answer(i)
        assert len(prompt) == task.prompt_length
        x, y = prompt[:-1].split("+")
        assert (int(x), int(y)) == (a, b)
        assert 1 <= len(answer) <= task.max_answer_length
        assert int(answer[::-1]) == a + b
        assert answer[-1] != "0" or answer == "0"  # no leading zero once un-reversed
        assert set(prompt + answer) <= set(task.ALPHABET)


def test_examples_are_deterministic_per_index():
    task = ArithmeticTask(seed=11)
    forward = [task.operands(i) for i in range(100)]
    backward = [task.operands(i) for i in reversed(range(100))][::-1]
    assert forward == backward
    assert forward == [ArithmeticTask(seed=11).operands(i) for i in range(100)]
    assert task.operands(10**15) == ArithmeticTask(seed=11).operands(10**15)
    assert task.operands(np.int64(5)) == task.operands(5)
    other = [ArithmeticTask(seed=12).operands(i) for i in range(100)]
    assert sum(a == b for a, b in zip(forward, other)) < 5
    assert len(set(forward)) > 95  # draws are not repeated


def test_train_and_eval_are_disjoint_across_seeds():
    def pairs(task, n):
        return {tuple(sorted(task.operands(i))) for i in range(n)}
    train = pairs(ArithmeticTask(seed=0, split="train"), 3000) | pairs(
        ArithmeticTask(seed=1, split="train"), 3000)
    evals = pairs(ArithmeticTask(seed=0, split="eval"), 1000) | pairs(
        ArithmeticTask(seed=1, split="eval"), 1000)
    assert len(evals) > 950
    assert not train & evals


def test_split_assignment_is_a_partition():
    # Every unordered 2-digit pair belongs to exactly one split, independently of order and seed.
    task_train, task_eval = ArithmeticTask(num_digits=2), ArithmeticTask(num_digits=2, split="eval")
    in_eval = 0
    for a in range(100):
        for b in range(a, 100):
            assert task_train.in_split(a, b) != task_eval.in_split(a, b)
            assert task_train.in_split(a, b) == task_train.in_split(b, a)
            in_eval += operand_pair_in_eval(a, b, 0.1)
    assert 0.07 < in_eval / 5050 < 0.13
    for i in range(300):
        assert task_train.in_split(*task_train.operands(i))
        assert task_eval.in_split(*task_eval.operands(i))
    assert task_train.with_split("eval") == task_eval


def test_check():
    task = ArithmeticTask(seed=5)
    a, b = task.operands(7)
    answer = task.answer(7)
    assert task.check(7, answer)
    assert task.check(7, answer + "<eos>")
    assert task.check((a, b), answer)
    assert task.check((123, 456), "975<eos>")
    assert not task.check((123, 456), "579")
    assert not task.check((123, 456), "975<eos><eos>")
    assert not task.check((123, 456), "9750")
    assert not task.check((123, 456), "975 ")
    assert not task.check((123, 456), "")
    assert not task.check(7, answer[:-1])


@pytest.mark.parametrize("kwargs", [dict(num_digits=0), dict(num_digits=19), dict(split="test"),
                                    dict(eval_fraction=0.0), dict(eval_fraction=1.0),
                                    dict(seed=-1)])
def test_task_validation(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


def test_negative_index():
    with pytest.raises(ValueError, match="non-negative"):
        ArithmeticTask().operands(-1)


# ----------------------------------------------------------------------------- packing

def _random_seqs(rng, n, max_len, vocab=50):
    return [list(rng.integers(3, vocab, size=rng.integers(1, max_len + 1))) for _ in range(n)]


def _check_packed(batch, seqs, masks, seq_len, pad_id, packed_ids):
    rows = batch["tokens"].shape[0]
    assert set(batch) == set(PACKED_KEYS)
    for key in PACKED_KEYS:
        assert batch[key].shape == (rows, seq_len)
    assert batch["loss_mask"].dtype == np.float32
    for key in ("tokens", "targets", "positions", "segment_ids", "sequence_index"):
        assert batch[key].dtype == np.int32
    seg, idx = batch["segment_ids"], batch["sequence_index"]
    # Every packed sequence's tokens appear exactly once, contiguously, with its own fields.
    assert sorted(set(idx[idx >= 0].tolist())) == sorted(packed_ids)
    assert (idx >= 0).sum() == sum(len(seqs[i]) for i in packed_ids)
    for i in packed_ids:
        r, cols = np.nonzero(idx == i)
        assert (r == r[0]).all()
        assert (np.diff(cols) == 1).all()
        r = r[0]
        n = len(seqs[i])
        np.testing.assert_array_equal(batch["tokens"][r, cols], seqs[i])
        np.testing.assert_array_equal(batch["positions"][r, cols], np.arange(n))
        assert len(set(seg[r, cols].tolist())) == 1 and seg[r, cols[0]] >= 1
        np.testing.assert_array_equal(batch["targets"][r, cols[:-1]], seqs[i][1:])
        assert batch["targets"][r, cols[-1]] == pad_id
        want = np.ones(n) if masks is None else np.asarray(masks[i], np.float32)
        np.testing.assert_array_equal(batch["loss_mask"][r, cols[:-1]], want[1:])
        assert batch["loss_mask"][r, cols[-1]] == 0
    for r in range(rows):
        used = seg[r] > 0
        n_used = used.sum()
        assert used[:n_used].all() and not used[n_used:].any()  # segments first, padding after
        ids = seg[r, :n_used]
        assert ids[0] == 1 if n_used else True
        assert ((np.diff(ids) == 0) | (np.diff(ids) == 1)).all()  # 1, 1, 2, 2, 2, 3, ...
        pad = ~used
        assert (batch["tokens"][r, pad] == pad_id).all()
        assert (batch["targets"][r, pad] == pad_id).all()
        assert (batch["loss_mask"][r, pad] == 0).all()
        assert (batch["positions"][r, pad] == 0).all()
        assert (idx[r, pad] == -1).all()


def _first_fit_decreasing_reference(lengths, capacity, num_rows):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads, rows, leftover = [], [], []
    for i in order:
        for r, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                loads[r] += lengths[i]
                rows[r].append(i)
                break
        else:
            if num_rows is None or len(loads) < num_rows:
                loads.append(lengths[i])
                rows.append([i])
            else:
                leftover.append(i)
    return rows, sorted(leftover)


@pytest.mark.parametrize("seed", range(4))
def test_pack_invariants_with_masks(seed):
    rng = np.random.default_rng(seed)
    seqs = _random_seqs(rng, 60, 40)
    masks = [list(rng.integers(0, 2, size=len(s)).astype(float) * rng.uniform(0.5, 2))
             for s in seqs]
    batch, leftover = pack_sequences(seqs, 64, loss_masks=masks, pad_id=0)
    assert leftover == []
    _check_packed(batch, seqs, masks, 64, 0, list(range(len(seqs))))


@pytest.mark.parametrize("seed", range(4))
def test_pack_matches_first_fit_decreasing_reference(seed):
    rng = np.random.default_rng(100 + seed)
    seqs = _random_seqs(rng, 80, 50)
    lengths = [len(s) for s in seqs]
    for num_rows in (None, 5, 20):
        batch, leftover = pack_sequences(seqs, 64, num_rows=num_rows, pad_id=7)
        rows, want_leftover = _first_fit_decreasing_reference(lengths, 64, num_rows)
        assert leftover == want_leftover
        assert batch["tokens"].shape[0] == (len(rows) if num_rows is None else num_rows)
        for r, members in enumerate(rows):
            got = [int(i) for i in dict.fromkeys(batch["sequence_index"][r].tolist()) if i >= 0]
            assert got == members
        packed = sorted(set(range(len(seqs))) - set(leftover))
        _check_packed(batch, seqs, None, 64, 7, packed)
        # Every leftover is longer than the room left in any row.
        room = 64 - (batch["segment_ids"] > 0).sum(axis=1)
        for i in leftover:
            assert lengths[i] > room.max()


def test_pack_fill_ratio():
    rng = np.random.default_rng(0)
    seqs = _random_seqs(rng, 400, 64)
    batch, _ = pack_sequences(seqs, 128)
    stats = packing_stats(batch)
    assert stats["num_sequences"] == 400
    assert stats["num_tokens"] == sum(map(len, seqs))
    lower_bound_rows = -(-stats["num_tokens"] // 128)
    assert batch["tokens"].shape[0] <= lower_bound_rows + 2
    assert stats["fill_ratio"] > 0.95
    assert stats["num_loss_tokens"] == stats["num_tokens"] - 400  # no target after a last token


def test_pack_too_long_and_bad_inputs():
    with pytest.raises(ValueError, match=r"longer than seq_len=8 \(#1: 9 tokens, #3: 12 tokens\)"):
        pack_sequences([[1] * 8, [1] * 9, [2], [3] * 12], 8)
    with pytest.raises(ValueError, match="empty"):
        pack_sequences([[1], []], 8)
    with pytest.raises(ValueError, match="loss mask 0 has 2 entries for a sequence of 3"):
        pack_sequences([[1, 2, 3]], 8, loss_masks=[[1, 1]])
    with pytest.raises(ValueError, match="1 loss masks for 2 sequences"):
        pack_sequences([[1], [2]], 8, loss_masks=[[1]])
    with pytest.raises(ValueError, match="seq_len"):
        pack_sequences([[1]], 0)


def test_shared_prefix_packing_lays_out_each_branch_as_its_full_sequence():
    """Every completion's branch sees the prefix then itself: reading each token's visible
    context (causal, own segment or its prefix segment) gives back ``prompt + completion`` with
    the right positions, and the prompt is written once per unit."""
    from rl_jax.data.packing import pack_shared_prefixes
    rng = np.random.default_rng(0)
    groups = []
    for g in range(7):
        prompt = rng.integers(3, 50, int(rng.integers(1, 9))).tolist()
        comps = [rng.integers(3, 50, int(rng.integers(1, 7))).tolist() for _ in range(4)]
        masks = [rng.uniform(0.5, 1.0, len(c)).tolist() for c in comps]
        groups.append((prompt, comps, masks))
    batch, leftover = pack_shared_prefixes(groups, seq_len=20)
    assert not leftover
    seqs = [(p, c, m) for p, cs, ms in groups for c, m in zip(cs, ms)]
    seen = set()
    for r in range(batch["tokens"].shape[0]):
        seg, pre, pos = batch["segment_ids"][r], batch["prefix_ids"][r], batch["positions"][r]
        for t in range(batch["tokens"].shape[1]):
            i = batch["sequence_index"][r, t]
            if i < 0:
                continue
            prompt, completion, mask = seqs[i]
            visible = [u for u in range(t + 1)
                       if seg[u] == seg[t] or (pre[t] > 0 and seg[u] == pre[t])]
            context = batch["tokens"][r, visible].tolist()
            j = pos[t] + 1 - len(prompt)  # the completion token this position predicts
            full = prompt + completion
            assert context == full[:len(prompt) + j]
            assert pos[visible].tolist() == list(range(len(prompt) + j))
            assert batch["targets"][r, t] == completion[j]
            np.testing.assert_allclose(batch["loss_mask"][r, t], mask[j], rtol=1e-6)
            seen.add((i, j))
    assert seen == {(i, j) for i, (_, c, _) in enumerate(seqs) for j in range(len(c))}
    # Fewer tokens than one sequence per sample (prompt + completion - 1 predicting tokens).
    assert (batch["segment_ids"] > 0).sum() < sum(len(p) + len(c) - 1 for p, c, _ in seqs)
    # Too few rows: the units that do not fit are reported by sequence.
    small, leftover = pack_shared_prefixes(groups, seq_len=20, num_rows=2)
    assert leftover and small["tokens"].shape == (2, 20)
    assert set(leftover).isdisjoint(set(small["sequence_index"][small["sequence_index"] >= 0]))
    with pytest.raises(ValueError, match="empty prompt"):
        pack_shared_prefixes([([], [[1]], [[1.0]])], seq_len=8)
    with pytest.raises(ValueError, match="exceed seq_len"):
        pack_shared_prefixes([([1] * 6, [[2] * 4], [[1.0] * 4])], seq_len=8)
    with pytest.raises(ValueError, match="mask 0 has 1 entries"):
        pack_shared_prefixes([([1, 2], [[2, 3]], [[1.0]])], seq_len=8)


def test_pack_edge_cases():
    batch, leftover = pack_sequences([], 16)
    assert batch["tokens"].shape == (0, 16) and leftover == []
    assert packing_stats(batch) == dict(num_sequences=0, num_tokens=0, num_loss_tokens=0,
                                        fill_ratio=0.0)
    batch, leftover = pack_sequences([[5, 6], [7]], 16, num_rows=0)
    assert batch["tokens"].shape == (0, 16) and leftover == [0, 1]
    batch, leftover = pack_sequences([[5, 6], [7]], 16, num_rows=3)
    assert batch["tokens"].shape == (3, 16) and leftover == []
    assert (batch["segment_ids"][1:] == 0).all()
    np.testing.assert_array_equal(batch["tokens"][0, :4], [5, 6, 7, 0])
    np.testing.assert_array_equal(batch["targets"][0, :4], [6, 0, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0, :4], [1, 0, 0, 0])
    np.testing.assert_array_equal(batch["positions"][0, :4], [0, 1, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0, :4], [1, 1, 2, 0])
    batch, _ = pack_sequences([np.arange(3, 11)], 8)  # exactly seq_len, numpy input
    np.testing.assert_array_equal(batch["tokens"][0], np.arange(3, 11))
    assert packing_stats(batch)["fill_ratio"] == 1.0


# ----------------------------------------------------------------------------- grain LM pipeline

def _segments(batch, r):
    """(tokens, targets, loss_mask) of each segment of row r."""
    seg = batch["segment_ids"][r]
    return [(batch["tokens"][r, seg == s], batch["targets"][r, seg == s],
             batch["loss_mask"][r, seg == s]) for s in range(1, seg.max() + 1)]


def test_example_dataset(tok):
    task = ArithmeticTask(seed=2)
    ds = example_dataset(task, tok)
    ex = ds[3]
    prompt, answer = task.example(3)
    np.testing.assert_array_equal(ex["tokens"], [1, *encode(tok, prompt + answer), 2])
    np.testing.assert_array_equal(ex["loss_mask"],
                                  [0] * (1 + len(prompt)) + [1] * (len(answer) + 1))
    all_tokens = example_dataset(task, tok, loss_on_all_tokens=True)[3]["loss_mask"]
    np.testing.assert_array_equal(all_tokens, [0] + [1] * (len(ex["tokens"]) - 1))


def test_lm_batches_content(tok):
    task = ArithmeticTask(seed=0)
    rows, seq_len = 6, 64
    ds = lm_batches(task, tok, rows_per_batch=rows, seq_len=seq_len, seed=1)
    per_row = examples_per_row(task, seq_len)
    assert per_row == seq_len // max_example_length(task) == 4
    for k in (0, 1, 10**12):
        batch = ds[k]
        assert set(batch) == set(PACKED_KEYS)
        assert all(v.shape == (rows, seq_len) for v in batch.values())
        stats = packing_stats(batch)
        assert stats["num_sequences"] == rows * per_row
        assert stats["fill_ratio"] > 0.7
        for r in range(rows):
            for tokens, targets, mask in _segments(batch, r):
                assert tokens[0] == 1 and tokens[-1] == 2
                text = decode(tok, tokens)
                prompt, completion = text.split("=")
                a, b = (int(x) for x in prompt.split("+"))
                assert task.in_split(a, b)
                assert task.check((a, b), completion)
                # The loss covers exactly the predictions of the answer and <eos>.
                assert decode(tok, targets[mask > 0], skip_special_tokens=False) == (
                    completion + "<eos>")
                assert set(mask.tolist()) <= {0.0, 1.0}


def test_lm_batches_determinism(tok):
    task = ArithmeticTask(seed=0)
    kwargs = dict(rows_per_batch=4, seq_len=48, seed=7)
    ds = lm_batches(task, tok, **kwargs)
    again = lm_batches(task, tok, **kwargs)
    for k in (0, 3, 123_456_789):
        for key in PACKED_KEYS:
            np.testing.assert_array_equal(ds[k][key], again[k][key])
    assert not np.array_equal(ds[0]["tokens"], ds[1]["tokens"])
    other_seed = lm_batches(task, tok, **{**kwargs, "seed": 8})
    assert not np.array_equal(ds[0]["tokens"], other_seed[0]["tokens"])
    other_task = lm_batches(ArithmeticTask(seed=1), tok, **kwargs)
    assert not np.array_equal(ds[0]["tokens"], other_task[0]["tokens"])
    # Resuming at step k (slicing, iterating, or a pickled copy) reads the same batches.
    resumed = iter(ds[5:].to_iter_dataset())
    for k in (5, 6):
        np.testing.assert_array_equal(next(resumed)["tokens"], ds[k]["tokens"])
    # grain datasets pickle (as multiprocess prefetch needs) only before first use.
    copy = pickle.loads(pickle.dumps(lm_batches(task, tok, **kwargs)))
    np.testing.assert_array_equal(copy[2]["targets"], ds[2]["targets"])


def test_lm_batches_loss_on_all_tokens(tok):
    batch = lm_batches(ArithmeticTask(), tok, rows_per_batch=2, seq_len=32, seed=0,
                       loss_on_all_tokens=True)[0]
    for r in range(2):
        for tokens, targets, mask in _segments(batch, r):
            np.testing.assert_array_equal(mask, [1] * (len(tokens) - 1) + [0])
            np.testing.assert_array_equal(targets[:-1], tokens[1:])


def test_lm_batches_errors(tok):
    task = ArithmeticTask(num_digits=3)
    with pytest.raises(ValueError, match="shorter than the longest example"):
        lm_batches(task, tok, rows_per_batch=2, seq_len=13, seed=0)
    with pytest.raises(ValueError, match="train split"):
        lm_batches(task.with_split("eval"), tok, rows_per_batch=2, seq_len=64, seed=0)
    with pytest.raises(ValueError, match="alphabet"):
        lm_batches(task, build_char_tokenizer("0123456789+"), rows_per_batch=2, seq_len=64, seed=0)


def test_eval_arrays(tok):
    task = ArithmeticTask(seed=4)
    n, seq_len = 100, 64
    batch = eval_arrays(task, tok, n, seq_len)
    evals = task.with_split("eval")
    assert batch["example_id"].shape == batch["tokens"].shape
    assert batch["example_id"].dtype == np.int32
    assert sorted(set(batch["example_id"][batch["example_id"] >= 0].tolist())) == list(range(n))
    assert packing_stats(batch)["num_sequences"] == n
    for e in range(n):
        slots = batch["example_id"] == e
        rows_of_e = np.nonzero(slots)[0]
        assert (rows_of_e == rows_of_e[0]).all()
        assert decode(tok, batch["targets"][slots], skip_special_tokens=False) == (
            evals.answer(e) + "<eos>")
        r = rows_of_e[0]
        prompt_and_answer = decode(tok, batch["tokens"][r, batch["sequence_index"][r] == e])
        assert prompt_and_answer == evals.prompt(e) + evals.answer(e)
    np.testing.assert_array_equal(batch["example_id"] >= 0, batch["loss_mask"] > 0)
    # Disjoint from what training reads.
    train = lm_batches(task, tok, rows_per_batch=8, seq_len=seq_len, seed=0)
    train_prompts = {decode(tok, t).split("=")[0] for k in range(3) for r in range(8)
                     for t, _, _ in _segments(train[k], r)}
    eval_prompts = {evals.prompt(e)[:-1] for e in range(n)}
    assert not train_prompts & eval_prompts
    assert np.array_equal(eval_arrays(task, tok, n, seq_len)["tokens"], batch["tokens"])


def test_eval_arrays_row_padding(tok):
    batch = eval_arrays(ArithmeticTask(), tok, 10, 32, rows_multiple_of=8)
    assert batch["tokens"].shape == (8, 32)
    assert packing_stats(batch)["num_sequences"] == 10
    assert (batch["example_id"][5:] == -1).all() and (batch["sequence_index"][5:] == -1).all()


def test_exact_match(tok):
    n = 30
    batch = eval_arrays(ArithmeticTask(), tok, n, 64)
    perfect = batch["targets"].copy()
    assert exact_match(batch, n, predicted=perfect).all()
    assert exact_match(batch, n, is_argmax=np.ones_like(perfect, bool)).all()
    wrong = perfect.copy()
    wrong[batch["example_id"] < 0] = 5  # predictions outside answers do not count
    assert exact_match(batch, n, predicted=wrong).all()
    for e in (0, 17):
        r, c = np.nonzero(batch["example_id"] == e)
        wrong[r[-1], c[-1]] = 0  # the <eos> prediction is part of the exact match
    result = exact_match(batch, n, predicted=wrong)
    assert not result[0] and not result[17] and result.sum() == n - 2
    np.testing.assert_array_equal(exact_match(batch, n, is_argmax=wrong == perfect), result)
    with pytest.raises(ValueError, match="does not match"):
        exact_match(batch, n, predicted=perfect[:1])
    with pytest.raises(ValueError, match="exactly one"):
        exact_match(batch, n)
