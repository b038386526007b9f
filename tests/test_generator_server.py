"""The generator's HTTP server, run as a real subprocess on loopback: SGLang's endpoints and
shapes, batches and n > 1, log-prob triples that equal the trainer's, seeds, stop conditions,
streaming, bad requests, concurrency, weight updates from disk, pause modes, overload."""

import asyncio
import concurrent.futures
import json
import time
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from generator_fixtures import (EOS, MAX_SEQ_LEN, http, start_pool, tiny_config,
                                write_checkpoints)
from rl_jax.models.hf import load_pretrained, load_tokenizer

MAX_WAITING = 32


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"), wide=True)


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    pool = start_pool(ckpts["a"], 1, tmp_path_factory.mktemp("logs"),
                      max_waiting=MAX_WAITING)
    yield pool.urls[0]
    pool.stop()
    assert pool.processes[0].returncode == 0, pool.log_tail(0)


@pytest.fixture(scope="module")
def tokenizer(ckpts):
    return load_tokenizer(ckpts["a"])


def gen(url, ids, **sampling):
    sampling.setdefault("ignore_eos", True)
    status, data, _ = http(url, "/generate", {"input_ids": ids, "sampling_params": sampling,
                                              "return_logprob": True})
    assert status == 200, data
    return data


def wait_until(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def load(url):
    return http(url, "/get_load")[1]


def in_background(fn, *args, **kw):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kw)
    pool.shutdown(wait=False)
    return future


# ---- endpoints ----------------------------------------------------------------------------------

def test_info_and_health_endpoints(server, ckpts):
    for path in ("/health", "/health_generate"):
        status, data, _ = http(server, path)
        assert status == 200 and data["status"] == "ok", (path, data)
    for path in ("/get_model_info", "/model_info"):
        status, info, _ = http(server, path)
        assert status == 200
        assert info["model_path"] == str(ckpts["a"]) and info["is_generation"] is True
        assert info["weight_version"] == http(server, "/get_weight_version")[1]["weight_version"]
    for path in ("/get_server_info", "/server_info"):
        status, info, _ = http(server, path)
        assert status == 200 and info["dp_size"] == 1 and info["tp_size"] == 1
        assert info["max_running_requests"] == 8 and info["context_length"] == MAX_SEQ_LEN
        assert info["num_continuous_decode_steps"] == 1
        assert info["prefill_attention_backend"] == "xla"  # no fused prompt kernel on CPU
        # CPU seconds per thread since start: the scheduler's and XLA's among them
        assert info["cpu_seconds_by_thread"]["engine"] > 0
        assert sum(info["cpu_seconds_by_thread"].values()) > 1.0  # it loaded and compiled
        # what loading and compiling left is frozen out of the garbage collector
        assert info["gc"]["frozen_objects"] > 10_000
        assert len(info["gc"]["collections"]) == len(info["gc"]["max_pause_s"]) == 3
    status, models, _ = http(server, "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == str(ckpts["a"])
    assert http(server, "/get_load")[1]["load"] == 0
    status, data, _ = http(server, "/no_such_endpoint")
    assert status == 404 and "no_such_endpoint" in data["error"]["message"]
    status, data, _ = http(server, "/generate", method="GET")
    assert status == 405 and data["error"]["message"]


def test_output_logprob_triples_equal_the_trainers(server, ckpts):
    prompt = [1, 5, 9, 12]
    data = gen(server, prompt, max_new_tokens=12, temperature=1.0, sampling_seed=3)
    meta = data["meta_info"]
    ids = data["output_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 12 == len(ids)
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] == 0 and meta["id"]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == ids and all(t[2] is None for t in triples)
    assert meta["output_token_weight_versions"] == [0] * 12 and meta["weight_version"] == 0
    model = load_pretrained(ckpts["a"])
    seq = prompt + ids
    ref, _ = model.token_logprobs(jnp.asarray([seq[:-1]]), jnp.asarray([seq[1:]]))
    np.testing.assert_allclose([t[0] for t in triples], np.asarray(ref[0, len(prompt) - 1:]),
                               atol=1e-4)


@pytest.fixture(scope="module")
def tp_server(ckpts, tmp_path_factory):
    pool = start_pool(ckpts["a"], 1, tmp_path_factory.mktemp("tp-logs"), tensor_parallel=2)
    yield pool.urls[0]
    pool.stop()


def test_tensor_parallel_server_gives_the_same_samples(server, tp_server):
    assert http(tp_server, "/get_server_info")[1]["tp_size"] == 2
    for seed in (1, 2):
        kw = dict(max_new_tokens=20, sampling_seed=seed, top_k=10)
        one, two = gen(server, [1, 4, 6, 8], **kw), gen(tp_server, [1, 4, 6, 8], **kw)
        assert one["output_ids"] == two["output_ids"]
        np.testing.assert_allclose([t[0] for t in one["meta_info"]["output_token_logprobs"]],
                                   [t[0] for t in two["meta_info"]["output_token_logprobs"]],
                                   atol=1e-4)


def test_data_parallel_server_serves_a_batch_and_updates_every_replica(server, ckpts,
                                                                       tmp_path_factory):
    """Two replicas on two host devices (--data_parallel=2): a batch spread over both gives the
    samples one replica gives, and a weight update reaches both."""
    pool = start_pool(ckpts["a"], 1, tmp_path_factory.mktemp("dp-logs"), data_parallel=2)
    try:
        url = pool.urls[0]
        assert http(url, "/get_server_info")[1]["dp_size"] == 2
        prompts = [[1, 4 + i, 6, 8] for i in range(6)]
        body = {"input_ids": prompts, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 14, "sampling_seed": 5, "n": 2,
                                    "ignore_eos": True}}
        status, got, _ = http(url, "/generate", body)
        assert status == 200, got
        want = http(server, "/generate", body)[1]
        assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
        np.testing.assert_allclose(
            [t[0] for g in got for t in g["meta_info"]["output_token_logprobs"]],
            [t[0] for w in want for t in w["meta_info"]["output_token_logprobs"]], atol=1e-5)
        status, data, _ = http(url, "/update_weights_from_disk", {"model_path": str(ckpts["b"])})
        assert status == 200 and data["weight_version"] == 1, data
        status, after, _ = http(url, "/generate", body)
        assert status == 200, after
        model = load_pretrained(ckpts["b"])
        for prompt, out in zip([p for p in prompts for _ in range(2)], after):
            assert out["meta_info"]["output_token_weight_versions"] == [1] * 14
            seq = prompt + out["output_ids"]
            ref, _ = model.token_logprobs(jnp.asarray([seq[:-1]]), jnp.asarray([seq[1:]]))
            np.testing.assert_allclose([t[0] for t in out["meta_info"]["output_token_logprobs"]],
                                       np.asarray(ref[0, len(prompt) - 1:]), atol=1e-4)
    finally:
        pool.stop()
    assert pool.processes[0].returncode == 0, pool.log_tail(0)


def test_text_input_returns_text(server, tokenizer):
    status, data, _ = http(server, "/generate", {
        "text": "abc", "return_logprob": True, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert status == 200, data
    assert data["meta_info"]["prompt_tokens"] == 3
    assert data["text"] == tokenizer.decode(data["output_ids"])
    assert [t[2] for t in data["meta_info"]["output_token_logprobs"]] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in data["output_ids"]]
    status, batch, _ = http(server, "/generate", {"text": ["ab", "c"],
                                                  "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 1]


def test_batch_with_n_samples_is_prompt_major(server):
    prompts = [[1, 4, 4], [1, 7, 8, 9, 10]]
    status, data, _ = http(server, "/generate", {
        "input_ids": prompts, "rid": "batch", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "n": 3, "ignore_eos": True}})
    assert status == 200, data
    assert [d["meta_info"]["prompt_tokens"] for d in data] == [3, 3, 3, 5, 5, 5]
    assert [d["meta_info"]["id"] for d in data] == [f"batch_{i}-{j}" for i in range(2)
                                                   for j in range(3)]
    # The n samples of a prompt share its prefill: samples after the first reuse it.
    assert [d["meta_info"]["cached_tokens"] for d in data] == [0, 3, 3, 0, 5, 5]
    assert all(len(d["meta_info"]["output_token_logprobs"]) == 5 for d in data)
    # Per-prompt sampling params and a single prompt with n > 1 (a list, as in SGLang).
    status, data, _ = http(server, "/generate", {
        "input_ids": prompts, "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                                  {"max_new_tokens": 4, "ignore_eos": True}]})
    assert status == 200 and [d["meta_info"]["completion_tokens"] for d in data] == [2, 4]
    data = gen(server, [1, 2, 3], max_new_tokens=2, n=2)
    assert isinstance(data, list) and len(data) == 2
    data = gen(server, [1] * MAX_SEQ_LEN, max_new_tokens=0)
    assert data["output_ids"] == [] and data["meta_info"]["finish_reason"]["type"] == "length"


def test_seeds_reproduce_across_requests_and_batches(server):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=20)
    first = gen(server, [1, 3, 5], sampling_seed=11, **kw)
    again = gen(server, [1, 3, 5], sampling_seed=11, **kw)
    other = gen(server, [1, 3, 5], sampling_seed=12, **kw)
    assert first["output_ids"] == again["output_ids"]
    assert first["meta_info"]["output_token_logprobs"] == again["meta_info"][
        "output_token_logprobs"]
    assert first["output_ids"] != other["output_ids"]
    # With filters: the sampled distribution's log-probs, and the unfiltered ones beside them.
    sampled = [t[0] for t in first["meta_info"]["output_token_logprobs"]]
    unfiltered = first["meta_info"]["output_token_unfiltered_logprobs"]
    assert len(unfiltered) == len(sampled) == 16
    assert all(u <= s + 1e-6 for s, u in zip(sampled, unfiltered))
    assert "output_token_unfiltered_logprobs" not in gen(
        server, [1, 3, 5], max_new_tokens=4, sampling_seed=11)["meta_info"]
    status, batch, _ = http(server, "/generate", {
        "input_ids": [[1, 9, 9, 9], [1, 3, 5]],
        "sampling_params": {**kw, "seed": 11, "ignore_eos": True}})
    assert status == 200 and batch[1]["output_ids"] == first["output_ids"]


def test_stop_token_ids_and_stop_strings(server, tokenizer):
    ref = gen(server, [1, 6, 7], max_new_tokens=24, temperature=0)["output_ids"]
    k = next(i for i in range(4, len(ref)) if tokenizer.decode([ref[i]]))
    stop = ref[k]
    data = gen(server, [1, 6, 7], max_new_tokens=24, temperature=0, stop_token_ids=[stop])
    cut = ref.index(stop)
    assert data["output_ids"] == ref[:cut + 1]
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert data["text"] == tokenizer.decode(ref[:cut])  # the matched token is trimmed
    # Stop strings: tokens up to the one completing the string; text up to the string.
    char = tokenizer.decode([stop])
    status, data, _ = http(server, "/generate", {"input_ids": [1, 6, 7], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [char, "zzzz"]}})
    assert status == 200
    ids = data["output_ids"]
    assert data["meta_info"]["finish_reason"] == {"type": "stop", "matched": char}
    assert ids == ref[:len(ids)] and len(ids) <= k + 1
    assert char in tokenizer.decode(ids) and char not in tokenizer.decode(ids[:-1])
    assert data["text"] == tokenizer.decode(ids)[:tokenizer.decode(ids).index(char)]
    assert len(data["meta_info"]["output_token_weight_versions"]) == len(ids)
    status, kept, _ = http(server, "/generate", {"input_ids": [1, 6, 7], "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": char,
        "no_stop_trim": True}})
    assert kept["text"] == tokenizer.decode(ids) and kept["output_ids"] == ids
    assert http(server, "/get_model_info")[1]["eos_token_ids"] == [EOS]


def test_every_sglang_field_at_its_default_is_accepted(server):
    body = {
        "input_ids": [1, 2, 3], "rid": "all-fields", "return_logprob": True,
        "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
        "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
        "lora_path": None, "lora_id": None, "session_params": None, "session_id": "s1",
        "custom_logit_processor": None, "return_hidden_states": False,
        "return_routed_experts": False, "return_entropy": False, "modalities": None,
        "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7,
        "data_parallel_rank": 0, "routed_dp_rank": None, "priority": 3, "extra_key": "k",
        "cache_salt": None, "no_logs": False, "custom_labels": {"a": "b"}, "routing_key": "r",
        "conversation_id": "c", "background": False, "return_bytes": False,
        "some_future_sglang_field": {"x": 1},
        "sampling_params": {
            "max_new_tokens": 3, "temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
            "structural_tag": None, "stop": None, "stop_token_ids": None, "stop_regex": None,
            "ignore_eos": True, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "no_stop_trim": False,
            "custom_params": None, "stream_interval": 1, "logit_bias": None,
            "sampling_seed": 5}}
    status, data, _ = http(server, "/generate", body)
    assert status == 200, data
    assert data["meta_info"]["id"] == "all-fields" and len(data["output_ids"]) == 3
    status, data, _ = http(server, "/generate", {
        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": None, "temperature": None}})
    assert status == 200  # null means default; max_new_tokens null fills the context
    assert data["meta_info"]["completion_tokens"] <= MAX_SEQ_LEN - 2


BAD_REQUESTS = {
    "bad json": (None, b"{not json"),
    "not an object": ([1, 2, 3], None),
    "no input": ({"sampling_params": {}}, None),
    "text and input_ids": ({"text": "a", "input_ids": [1]}, None),
    "empty input_ids": ({"input_ids": []}, None),
    "string token ids": ({"input_ids": ["a", "b"]}, None),
    "float token ids": ({"input_ids": [1.5, 2]}, None),
    "bool token ids": ({"input_ids": [True, 2]}, None),
    "token id outside vocab": ({"input_ids": [1, 10_000]}, None),
    "negative token id": ({"input_ids": [1, -3]}, None),
    "batch with a bad prompt": ({"input_ids": [[1, 2], [1, 999]]}, None),
    "negative max_new_tokens": ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
                                None),
    "string max_new_tokens": ({"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}},
                              None),
    "too long": ({"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}}, None),
    "negative temperature": ({"input_ids": [1], "sampling_params": {"temperature": -1}}, None),
    "top_p zero": ({"input_ids": [1], "sampling_params": {"top_p": 0}}, None),
    "n zero": ({"input_ids": [1], "sampling_params": {"n": 0}}, None),
    "sampling_params not an object": ({"input_ids": [1], "sampling_params": 3}, None),
    "unknown sampling field": ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, None),
    "repetition penalty": ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}},
                           None),
    "regex": ({"input_ids": [1], "sampling_params": {"regex": "[a-z]+"}}, None),
    "stop_token_ids outside vocab": ({"input_ids": [1], "sampling_params": {
        "stop_token_ids": [5000]}}, None),
    "lora": ({"input_ids": [1], "lora_path": "adapter"}, None),
    "image": ({"input_ids": [1], "image_data": "http://x/y.png"}, None),
    "input logprobs": ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0},
                       None),
    "top logprobs": ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 3}, None),
    "rid list length": ({"input_ids": [[1], [2]], "rid": ["x"]}, None),
    "duplicate rids": ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, None),
    "untokenizable text": ({"text": "ABC"}, None),
    "stream not bool": ({"input_ids": [1], "stream": "yes"}, None),
    "n above the queue limit": ({"input_ids": [1], "sampling_params": {"n": MAX_WAITING + 1}},
                                None),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_generate_requests_get_400_with_a_message(server, name):
    body, raw = BAD_REQUESTS[name]
    status, data, _ = http(server, "/generate", body, raw=raw)
    assert status == 400, (name, status, data)
    assert data["error"]["type"] == "invalid_request_error" and len(data["error"]["message"]) > 8


@pytest.mark.parametrize("path,body", [
    ("/update_weights_from_disk", {}),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "gguf"}),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v2-final"}),
    ("/pause_generation", {"mode": "sleep"}),
    ("/abort_request", {}),
    ("/abort_request", {"rid": 5}),
])
def test_bad_control_requests_get_400(server, path, body):
    status, data, _ = http(server, path, body)
    assert status == 400, (path, body, data)
    assert data["error"]["message"]


def test_server_is_healthy_after_bad_requests(server):
    assert http(server, "/health")[0] == 200
    assert gen(server, [1, 2], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2
    assert load(server)["load"] == 0


def test_streaming_sends_events_then_done(server):
    body = json.dumps({"input_ids": [[1, 2], [1, 3]], "stream": True, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True}}
                      ).encode()
    request = urllib.request.Request(server + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.read().decode().split("\n\n")
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["index"] for c in chunks) == [0, 1, 2, 3]
    assert all(len(c["output_ids"]) == 4 for c in chunks)


def test_concurrent_requests_all_complete(server):
    def one(i):
        return gen(server, [1, 3 + i % 20], max_new_tokens=8 + i, sampling_seed=i)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [r["meta_info"]["completion_tokens"] for r in results] == [8 + i for i in range(16)]
    assert len({r["meta_info"]["id"] for r in results}) == 16


# ---- control ------------------------------------------------------------------------------------

def test_flush_cache_and_abort_request(server):
    for method in ("GET", "POST"):
        status, data, _ = http(server, "/flush_cache", method=method)
        assert status == 200 and data["success"], data
    assert http(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        queued = in_background(gen, server, [1, 2, 3], max_new_tokens=50)
        wait_until(lambda: load(server)["waiting"] == 1, what="the request to queue")
        assert http(server, "/abort_request", {"rid": "not-running"})[0] == 200
        assert not queued.done()
        # Batch requests are aborted by the rid they were sent with.
        batch = in_background(http, server, "/generate", {
            "input_ids": [[1, 4], [1, 5]], "rid": "grp", "sampling_params": {
                "max_new_tokens": 50}})
        wait_until(lambda: load(server)["waiting"] == 3, what="the batch to queue")
        assert http(server, "/abort_request", {"rid": "grp"})[0] == 200
        status, data, _ = batch.result(timeout=30)
        assert status == 200 and [d["meta_info"]["finish_reason"]["type"] for d in data] == [
            "abort", "abort"]
        assert http(server, "/abort_request", {"abort_all": True})[0] == 200
        data = queued.result(timeout=30)
        assert data["meta_info"]["finish_reason"]["type"] == "abort"
        assert data["output_ids"] == []
    finally:
        assert http(server, "/continue_generation", {})[0] == 200


def test_a_client_that_goes_away_has_its_request_aborted(server):
    def aborted():
        return http(server, "/get_server_info")[1]["internal_states"][0].get(
            "aborted_requests", 0)

    before = aborted()
    assert http(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with pytest.raises(OSError):  # the client's timeout closes the connection
            http(server, "/generate", {"input_ids": [1, 2, 3]}, timeout=0.5)
        wait_until(lambda: aborted() == before + 1 and load(server)["waiting"] == 0,
                   what="the abandoned request to be aborted")
    finally:
        assert http(server, "/continue_generation", {})[0] == 200


def _running_then_frozen(server, **sampling):
    """Starts a long request and pauses (in place) while it is decoding: queued while paused,
    it is admitted in the scheduler pass that resumes, before a pause sent after the resume
    returned can apply. 400 tokens of the tiny model take about a tenth of a second, so on a
    loaded machine the request may finish before that pause arrives: then it is tried again."""
    for _ in range(10):
        assert http(server, "/pause_generation", {"mode": "in_place"})[0] == 200
        future = in_background(gen, server, [1, 5, 6], max_new_tokens=400, **sampling)
        wait_until(lambda: load(server)["waiting"] == 1, what="the request to be queued")
        assert http(server, "/continue_generation", {})[0] == 200
        assert http(server, "/pause_generation", {"mode": "in_place"})[0] == 200
        if load(server)["running"] == 1:
            assert not future.done()
            return future
        future.result(timeout=60)  # it finished before the pause: try again
    assert http(server, "/continue_generation", {})[0] == 200
    raise AssertionError("every request finished before it could be paused")


def test_pause_in_place_and_retract_keep_requests(server):
    reference = gen(server, [1, 5, 6], max_new_tokens=400, sampling_seed=21)
    future = _running_then_frozen(server, sampling_seed=21)
    try:
        status, data, _ = http(server, "/flush_cache", method="POST")
        assert status == 400 and not data["success"]  # sequences are running
        assert http(server, "/pause_generation", {"mode": "retract"})[0] == 200
        assert load(server)["running"] == 0 and load(server)["waiting"] == 1
        time.sleep(0.2)
        assert not future.done()
    finally:
        assert http(server, "/continue_generation", {})[0] == 200
    data = future.result(timeout=60)
    assert data["meta_info"]["finish_reason"]["type"] == "length"
    # Recomputing the retracted KV under the same weights gives the same tokens.
    assert data["output_ids"] == reference["output_ids"]
    np.testing.assert_allclose([t[0] for t in data["meta_info"]["output_token_logprobs"]],
                               [t[0] for t in reference["meta_info"]["output_token_logprobs"]],
                               atol=1e-4)


def test_pause_abort_finishes_running_requests(server):
    future = _running_then_frozen(server)
    try:
        assert http(server, "/pause_generation", {"mode": "abort"})[0] == 200
        data = future.result(timeout=30)
        assert data["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(data["output_ids"]) < 400
        assert len(data["meta_info"]["output_token_logprobs"]) == len(data["output_ids"])
    finally:
        assert http(server, "/continue_generation", {})[0] == 200
    assert gen(server, [1, 2], max_new_tokens=3)["meta_info"]["finish_reason"]["type"] == "length"


def test_update_weights_from_disk(server, ckpts):
    version = http(server, "/get_weight_version")[1]["weight_version"]
    before = gen(server, [1, 8, 9], max_new_tokens=12, temperature=0)
    # An in-flight request keeps its KV cache and continues under the new version.
    running = _running_then_frozen(server, temperature=0)
    try:
        status, data, _ = http(server, "/update_weights_from_disk", {
            "model_path": str(ckpts["b"]), "weight_version": str(version + 5),
            "flush_cache": True})
        assert status == 200 and data["success"] and data["weight_version"] == version + 5, data
    finally:
        assert http(server, "/continue_generation", {})[0] == 200
    versions = running.result(timeout=60)["meta_info"]["output_token_weight_versions"]
    assert versions[0] == version and versions[-1] == version + 5
    assert versions == sorted(versions)
    assert http(server, "/get_weight_version")[1]["weight_version"] == version + 5
    assert http(server, "/get_model_info")[1]["model_path"] == str(ckpts["b"])
    after = gen(server, [1, 8, 9], max_new_tokens=12, temperature=0)
    assert after["meta_info"]["weight_version"] == version + 5
    assert after["meta_info"]["output_token_weight_versions"] == [version + 5] * 12
    assert after["meta_info"]["output_token_logprobs"] != before["meta_info"][
        "output_token_logprobs"]
    # Incompatible or missing checkpoints are refused; the served weights stay.
    for path, words in ((ckpts["wide"], "hidden_size"), ("/no/such/dir", "does not exist")):
        status, data, _ = http(server, "/update_weights_from_disk", {"model_path": str(path)})
        assert status == 400 and not data["success"] and words in data["message"], data
    assert http(server, "/get_weight_version")[1]["weight_version"] == version + 5
    # Back to the first checkpoint (no version given: current + 1): same outputs as before.
    status, data, _ = http(server, "/update_weights_from_disk", {"model_path": str(ckpts["a"])})
    assert status == 200 and data["weight_version"] == version + 6
    again = gen(server, [1, 8, 9], max_new_tokens=12, temperature=0)
    assert again["output_ids"] == before["output_ids"]


def test_overload_answers_503_and_recovers(server):
    assert http(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(MAX_WAITING) as pool:
            queued = [pool.submit(gen, server, [1, 2 + i % 30], max_new_tokens=4)
                      for i in range(MAX_WAITING)]
            wait_until(lambda: load(server)["waiting"] == MAX_WAITING, what="a full queue")
            status, data, headers = http(server, "/generate", {"input_ids": [1, 2]})
            assert status == 503 and data["error"]["type"] == "overloaded"
            assert headers["Retry-After"]
            assert http(server, "/health")[0] == 200
            assert http(server, "/continue_generation", {})[0] == 200
            assert all(f.result(timeout=60)["meta_info"]["completion_tokens"] == 4
                       for f in queued)
    finally:
        http(server, "/continue_generation", {})
    assert gen(server, [1, 2], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_a_stopped_engine_answers_503_instead_of_hanging(ckpts):
    from aiohttp.test_utils import TestClient, TestServer

    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig

    server = GeneratorServer.from_config(ServerConfig(model=str(ckpts["a"]), max_slots=2,
                                                      max_seq_len=32, warmup=False))
    server.engine.shutdown()

    async def main():
        async with TestClient(TestServer(server.app())) as client:
            for method, path, body in (("GET", "/health", None),
                                       ("POST", "/generate", {"input_ids": [1, 2]}),
                                       ("POST", "/pause_generation", {"mode": "abort"}),
                                       ("POST", "/flush_cache", None)):
                response = await asyncio.wait_for(client.request(method, path, json=body), 10)
                assert response.status == 503, (path, await response.text())
                assert (await response.json())["error"]["type"] == "unavailable"

    asyncio.run(main())


def test_shape_warmup_leaves_nothing_to_compile_when_the_cache_shrinks(ckpts):
    """After ``warmup_shapes``, a long sequence that grows the attended length to its longest
    and then short ones that shrink it again run without a single compilation (each would stall
    decoding for a fraction of a second on a CPU core); the attended length follows the pages
    of the longest running sequence's bucket."""
    from jax import monitoring

    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig
    from rl_jax.generator.types import GenerateRequest, SamplingParams

    server = GeneratorServer.from_config(ServerConfig(
        model=str(ckpts["a"]), max_slots=8, max_seq_len=128, page_size=16, warmup=True,
        warmup_shapes=True))
    engine, runner = server.engine, server.engine.runner
    compiles, lengths = [], []

    def count(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    def request(tokens):
        return GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=tokens, ignore_eos=True,
                                                         seed=tokens))

    monitoring.register_event_duration_secs_listener(count)
    try:
        start = engine.stats["generated_tokens"]
        long_ = engine.submit(request(120))
        while engine.stats["generated_tokens"] - start < 75:  # past 64 positions
            time.sleep(0.001)
        medium = engine.submit(request(60))
        assert runner.kv_len == 128
        long_.result(timeout=120)
        while not medium.done():  # the cache shrinks from 128 to 64 when the long one ends
            lengths.append(runner.kv_len)
            time.sleep(0.001)
        assert lengths and lengths[-1] in (32, 64), lengths
        engine.generate(request(2), timeout=120)  # and to 16
        assert runner.kv_len == 16
        assert compiles == []
    finally:
        monitoring.unregister_event_duration_listener(count)
        server.engine.shutdown()


def test_shape_warmup_covers_every_data_parallel_replica(ckpts):
    """``warmup_shapes`` with two replicas: each replica compiles the same decode shapes (every
    batch bucket of its own slots, every cache length), not just the first one."""
    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig

    server = GeneratorServer.from_config(ServerConfig(
        model=str(ckpts["a"]), max_slots=8, max_seq_len=32, data_parallel=2, page_size=16,
        warmup=True, warmup_shapes=True))
    try:
        first, second = (runner._compiled for runner in server.engine.runners)
        assert {batch for batch, _, _, _ in first} == {4}  # 8 slots: 4 per replica
        assert {length for _, length, _, _ in first} == {16, 32}
        assert {steps for _, _, _, steps in first} == {1}
        assert first == second
    finally:
        server.engine.shutdown()


def test_automatic_dtype_and_decode_steps_follow_the_backend():
    from rl_jax.generator.server.config import (ACCELERATOR_DECODE_STEPS, ServerConfig,
                                                resolve_auto)

    default = ServerConfig(model="m")
    assert (default.dtype, default.decode_steps) == ("auto", 0)
    cpu = resolve_auto(default, backend="cpu")
    assert (cpu.dtype, cpu.decode_steps) == ("float32", 1)
    for backend in ("gpu", "tpu"):
        accel = resolve_auto(default, backend=backend)
        assert (accel.dtype, accel.decode_steps) == ("bfloat16", ACCELERATOR_DECODE_STEPS)
    explicit = ServerConfig(model="m", dtype="float16", decode_steps=3)
    assert resolve_auto(explicit, backend="gpu") == explicit
    assert resolve_auto(ServerConfig(model="m", dtype="float32"), backend="tpu").dtype == \
        "float32"
    assert resolve_auto(default).dtype == "float32"  # this machine's JAX backend: a CPU


def test_the_kv_cache_budget_bounds_requests_with_a_400_naming_it(ckpts):
    """A server whose KV cache is 4 pages of 16 tokens (``kv_cache_bytes``): a request that
    could never fit gets a 400 naming the cache's size, one that fits is served, and the server
    reports the cache's tokens as SGLang's ``max_total_num_tokens``; a ``mem_fraction_static``
    that leaves nothing beside the weights is refused at startup."""
    from aiohttp.test_utils import TestClient, TestServer

    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig, kv_cache_budget
    from rl_jax.models.config import ConfigError

    page = ModelRunner.page_bytes(tiny_config(64), 16, jnp.float32)  # the checkpoints' shape
    server = GeneratorServer.from_config(ServerConfig(
        model=str(ckpts["a"]), max_slots=2, max_seq_len=256, page_size=16,
        kv_cache_bytes=4 * page, warmup=False))

    async def main():
        async with TestClient(TestServer(server.app())) as client:
            response = await client.post("/generate", json={
                "input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 100}})
            assert response.status == 400, await response.text()
            message = (await response.json())["error"]["message"]
            assert "KV-cache pages of 16 tokens" in message and "4 pages" in message, message
            response = await client.post("/generate", json={
                "input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 50,
                                                           "ignore_eos": True}})
            assert response.status == 200, await response.text()
            assert (await response.json())["meta_info"]["completion_tokens"] == 50
            info = await (await client.get("/get_server_info")).json()
            assert info["max_total_num_tokens"] == 64 and info["page_size"] == 16
            assert info["kv_cache_bytes"] == 4 * page

    try:
        asyncio.run(main())
    finally:
        server.engine.shutdown()
    assert kv_cache_budget(0.5, 10 << 30, 2 << 30) == 3 << 30
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        kv_cache_budget(0.1, 10 << 30, 2 << 30)
    with pytest.raises(ConfigError, match="mem_fraction_static=1e-09"):
        GeneratorServer.from_config(ServerConfig(model=str(ckpts["a"]), max_slots=2,
                                                 max_seq_len=64, mem_fraction_static=1e-9,
                                                 warmup=False))
    with pytest.raises(ConfigError, match="not both"):
        GeneratorServer.from_config(ServerConfig(model=str(ckpts["a"]), kv_cache_bytes=page,
                                                 mem_fraction_static=0.5, warmup=False))
