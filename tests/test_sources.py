"""Tests of rl_jax.data.sources: file and generated prompt sources, and the prompt stream."""

import collections
import json
import pickle

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_jax import envs
from rl_jax.data.prompts import Prompt
from rl_jax.data.sources import (PositionedPrompt, SourceError, array_record_source, env_source,
                                 jsonl_source, parquet_source, prompt_dataset, shard_for_process,
                                 write_array_record)
from rl_jax.envs.base import Environment

RECORDS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3,
            "tests": [f"assert f({i})"]} for i in range(23)]


def _expected(i, info_keys=("level", "tests")):
    r = RECORDS[i]
    return Prompt(text=r["prompt"], answer=r["answer"], info={k: r[k] for k in info_keys},
                  index=i)


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def jsonl_path(tmp_path):
    return _write_jsonl(tmp_path / "prompts.jsonl", [json.dumps(r) for r in RECORDS])


@pytest.fixture
def parquet_path(tmp_path):
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path, row_group_size=5)
    return path


@pytest.fixture
def array_record_paths(tmp_path):
    paths = [tmp_path / "a.array_record", tmp_path / "b.array_record"]
    assert write_array_record(paths[0], RECORDS[:10]) == 10
    assert write_array_record(paths[1], RECORDS[10:]) == 13
    return paths


@pytest.fixture(params=["jsonl", "parquet", "array_record"])
def source_factory(request, jsonl_path, parquet_path, array_record_paths):
    return {"jsonl": lambda **kw: jsonl_source(jsonl_path, **kw),
            "parquet": lambda **kw: parquet_source(parquet_path, **kw),
            "array_record": lambda **kw: array_record_source(array_record_paths, **kw),
            }[request.param]


# ----------------------------------------------------------------------------- sources

def test_file_sources_round_trip(source_factory):
    ds = source_factory()
    assert isinstance(ds, grain.MapDataset)
    assert len(ds) == len(RECORDS)
    assert list(ds) == [_expected(i) for i in range(len(RECORDS))]


def test_file_sources_random_access_and_pickle(source_factory):
    ds = source_factory()
    for i in (17, 3, 22, 0, 10, 9, 3):
        assert ds[i] == _expected(i)
    copy = pickle.loads(pickle.dumps(ds))
    assert [copy[i] for i in (22, 1)] == [_expected(22), _expected(1)]


def test_file_sources_field_selection(source_factory):
    ds = source_factory(text_key="answer", answer_key=None, info_keys=["level"])
    assert ds[4] == Prompt(text="8", answer=None, info={"level": 1}, index=4)
    assert source_factory(info_keys=())[2].info == {}


def test_file_sources_missing_key(source_factory):
    with pytest.raises(SourceError, match="'question'"):
        source_factory(text_key="question")[0]
    with pytest.raises(SourceError, match="'difficulty'"):
        source_factory(info_keys=["difficulty"])[0]


def test_jsonl_skips_blank_lines_and_names_bad_lines(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [
        json.dumps({"prompt": "a", "answer": 1}),
        "",
        '{"prompt": "b", "answer": ',
        json.dumps({"answer": "c"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"prompt": 5, "answer": "d"}),
        json.dumps({"prompt": "e", "answer": 2.5}),
    ])
    ds = jsonl_source(path)
    assert len(ds) == 6
    assert ds[0] == Prompt(text="a", answer="1", info={}, index=0)
    assert ds[5].answer == "2.5"
    with pytest.raises(SourceError, match=rf"{path}, line 3: malformed JSON"):
        ds[1]
    with pytest.raises(SourceError, match=rf"{path}, line 4: missing field 'prompt'"):
        ds[2]
    with pytest.raises(SourceError, match=rf"{path}, line 5: .*JSON object, got list"):
        ds[3]
    with pytest.raises(SourceError, match=rf"{path}, line 6: .*'prompt' must be a string"):
        ds[4]


def test_array_record_names_bad_record(tmp_path):
    path = tmp_path / "bad.array_record"
    write_array_record(path, [{"prompt": "a", "answer": "1"}, {"answer": "2"}])
    ds = array_record_source([path])
    assert ds[0].text == "a"
    with pytest.raises(SourceError, match=rf"{path}, record 1: missing field 'prompt'"):
        ds[1]


def test_parquet_missing_column_fails_on_open(parquet_path):
    with pytest.raises(SourceError, match=rf"{parquet_path}: no column 'question'"):
        parquet_source(parquet_path, text_key="question")


def test_missing_and_invalid_files(tmp_path):
    missing = tmp_path / "nope"
    for make in (jsonl_source, parquet_source, array_record_source):
        with pytest.raises(FileNotFoundError, match="nope"):
            make(missing)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SourceError, match="holds no records"):
        jsonl_source(empty)
    not_parquet = _write_jsonl(tmp_path / "x.parquet", ["{}"])
    with pytest.raises(SourceError, match="not a readable Parquet file"):
        parquet_source(not_parquet)


def test_env_source():
    env = envs.get("arithmetic", num_digits=2)
    ds = env_source(env, split="eval", size=7)
    assert len(ds) == 7
    assert [ds[i] for i in (6, 0)] == [env.prompt(6, "eval"), env.prompt(0, "eval")]
    assert ds[3].split == "eval" and ds[3].index == 3
    infinite = env_source(env)
    assert len(infinite) > 2**62
    assert infinite[10**15] == env.prompt(10**15, "train")

    class ScoresOnly(Environment):
        async def score(self, prompt, completion):
            return 0.0, {"correct": False, "reason": "wrong_answer"}

    with pytest.raises(SourceError, match="ScoresOnly does not generate prompts"):
        env_source(ScoresOnly())
    with pytest.raises(SourceError, match="size"):
        env_source(env, size=0)


# ----------------------------------------------------------------------------- stream

def _source_indices(ds):
    return [e.source_index for e in ds]


def test_stream_shuffle_is_deterministic_and_a_permutation(jsonl_path):
    source = jsonl_source(jsonl_path)
    a = prompt_dataset(source, seed=3, shard_by_process=False)
    b = prompt_dataset(source, seed=3, shard_by_process=False)
    c = prompt_dataset(source, seed=4, shard_by_process=False)
    assert len(a) == len(RECORDS)
    assert _source_indices(a) == _source_indices(b)
    assert _source_indices(a) != _source_indices(c)
    assert sorted(_source_indices(a)) == list(range(len(RECORDS)))
    assert _source_indices(a) != list(range(len(RECORDS)))
    unshuffled = prompt_dataset(source, seed=3, shuffle=False, shard_by_process=False)
    assert _source_indices(unshuffled) == list(range(len(RECORDS)))
    for element in a:
        assert isinstance(element, PositionedPrompt)
        assert element.prompt == _expected(element.source_index)


def test_stream_epochs_repeat_with_new_order(jsonl_path):
    n = len(RECORDS)
    ds = prompt_dataset(jsonl_source(jsonl_path), seed=0, num_epochs=3,
                        shard_by_process=False)
    assert len(ds) == 3 * n
    elements = list(ds)
    assert [e.position for e in elements] == list(range(3 * n))
    assert [e.global_position for e in elements] == list(range(3 * n))
    assert [e.epoch for e in elements] == [p // n for p in range(3 * n)]
    epochs = [_source_indices(elements[k * n:(k + 1) * n]) for k in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert epochs[0] != epochs[1]
    forever = prompt_dataset(jsonl_source(jsonl_path), seed=0, num_epochs=None,
                             shard_by_process=False)
    assert len(forever) > 2**62
    assert _source_indices(forever[k] for k in range(3 * n)) == sum(epochs, [])
    assert forever[1000 * n + 5].epoch == 1000


def test_stream_positions_re_read_the_same_element(parquet_path):
    ds = prompt_dataset(parquet_source(parquet_path), seed=7, num_epochs=2,
                        process_index=1, process_count=3)
    elements = list(ds)
    for p in (0, 5, len(ds) - 1):
        assert ds[p] == elements[p]
        assert elements[p].position == p
    assert list(pickle.loads(pickle.dumps(ds))) == elements


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_stream_shards_are_disjoint_and_cover_each_epoch(array_record_paths, num_epochs):
    n = len(RECORDS)
    source = array_record_source(array_record_paths)
    whole = prompt_dataset(source, seed=11, num_epochs=num_epochs, shard_by_process=False)
    shards = [prompt_dataset(source, seed=11, num_epochs=num_epochs, process_index=k,
                             process_count=2) for k in range(2)]
    assert [len(s) for s in shards] == [(num_epochs * n + 1) // 2, num_epochs * n // 2]
    by_global = {}
    for k, shard in enumerate(shards):
        for position, element in enumerate(shard):
            assert element.position == position
            assert element.global_position == 2 * position + k
            assert element.global_position not in by_global
            by_global[element.global_position] = element
    assert sorted(by_global) == list(range(num_epochs * n))
    for g, element in by_global.items():
        assert (element.epoch, element.source_index, element.prompt) == (
            whole[g].epoch, whole[g].source_index, whole[g].prompt)
    per_epoch = collections.Counter((e.epoch, e.source_index) for e in by_global.values())
    assert per_epoch == collections.Counter(
        (epoch, i) for epoch in range(num_epochs) for i in range(n))


def test_shard_for_process_helper():
    ds = grain.MapDataset.range(10)
    assert list(shard_for_process(ds, 0, 2)) == [0, 2, 4, 6, 8]
    assert list(shard_for_process(ds, 1, 2)) == [1, 3, 5, 7, 9]
    assert list(shard_for_process(ds, 2, 3)) == [2, 5, 8]
    assert list(shard_for_process(ds)) == list(range(10))  # one JAX process in tests
    with pytest.raises(SourceError, match="process_index"):
        shard_for_process(ds, 2, 2)
    with pytest.raises(SourceError, match="both"):
        shard_for_process(ds, 0, None)


def test_stream_over_generated_prompts():
    env = envs.get("countdown")
    ds = prompt_dataset(env_source(env), seed=5, num_epochs=None, process_index=0,
                        process_count=2)
    first = [ds[p] for p in range(4)]
    assert first == [ds[p] for p in range(4)]
    for element in first:
        assert element.prompt == env.prompt(element.source_index, "train")
        assert element.epoch == 0
    finite = prompt_dataset(env_source(env, size=6), seed=5, num_epochs=2,
                            shard_by_process=False)
    assert sorted(_source_indices(finite)) == sorted(list(range(6)) * 2)
    with pytest.raises(SourceError, match="infinite source"):
        prompt_dataset(env_source(env), seed=0, num_epochs=2)


def test_stream_argument_errors(jsonl_path):
    source = jsonl_source(jsonl_path)
    for bad in (0, -1, 1.5):
        with pytest.raises(SourceError, match="num_epochs"):
            prompt_dataset(source, seed=0, num_epochs=bad)


def test_stream_through_grain_iterators(jsonl_path):
    ds = prompt_dataset(jsonl_source(jsonl_path), seed=2, num_epochs=2, process_index=0,
                        process_count=2)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    assert [e.position for e in it] == list(range(len(ds)))
