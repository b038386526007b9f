"""SGLang's own router (``pip install sglang-router``, a Rust binary) in front of two of this
project's servers: it registers them (probing /health, /server_info, /model_info), forwards
/generate with every field intact, passes 4xx answers through, streams, and broadcasts
/flush_cache."""

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from generator_fixtures import http, start_pool, write_checkpoints
from rl_jax.generator.launcher.pool import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (it is in the [test] extra: pip install -e '.[test]')")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"), names=("a",))["a"]


@pytest.fixture(scope="module")
def workers(ckpt, tmp_path_factory):
    pool = start_pool(ckpt, 2, tmp_path_factory.mktemp("logs"))
    yield pool.urls
    pool.stop()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    port = free_port()
    log_file = tmp_path_factory.mktemp("router") / "router.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
             "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:  # the router registers workers in the background
            assert process.poll() is None, f"router exited:\n{log_file.read_text()[-3000:]}"
            try:
                status, data, _ = http(url, "/workers", timeout=2)
                if status == 200 and sum(w["is_healthy"] for w in data["workers"]) == 2:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"router not ready:\n{log_file.read_text()[-3000:]}"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def counts(url):
    return http(url, "/get_server_info")[1]["http_requests"]


def generate(url, body):
    status, data, _ = http(url, "/generate", body)
    assert status == 200, data
    return data


def test_router_registers_both_workers(router, workers, ckpt):
    status, data, _ = http(router, "/workers")
    assert status == 200
    assert sorted(w["url"] for w in data["workers"]) == sorted(workers)
    assert {w["model_id"] for w in data["workers"]} == {str(ckpt)}
    for url in workers:  # what the router probes to discover a worker
        seen = counts(url)
        assert seen.get("/health", 0) >= 1 and seen.get("/server_info", 0) >= 1
        assert seen.get("/model_info", 0) >= 1


def test_generate_through_the_router_equals_a_direct_call(router, workers):
    body = {"input_ids": [1, 5, 9], "return_logprob": True, "rid": "via-router",
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 5,
                                "ignore_eos": True}}
    routed = generate(router, body)
    direct = generate(workers[0], {**body, "rid": "direct"})
    assert routed["output_ids"] == direct["output_ids"] and len(routed["output_ids"]) == 10
    meta = routed["meta_info"]
    assert meta["id"] == "via-router"
    assert meta["output_token_logprobs"] == direct["meta_info"]["output_token_logprobs"]
    assert meta["output_token_weight_versions"] == [0] * 10 and meta["weight_version"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 10}


def test_round_robin_spreads_requests_over_both_workers(router, workers):
    before = [counts(u).get("/generate", 0) for u in workers]
    for i in range(6):
        generate(router, {"input_ids": [1, 2 + i], "sampling_params": {"max_new_tokens": 3}})
    after = [counts(u).get("/generate", 0) for u in workers]
    assert [a - b for a, b in zip(after, before)] == [3, 3]


def test_batches_samples_and_text_through_the_router(router):
    data = generate(router, {"input_ids": [[1, 2], [1, 3, 4]], "return_logprob": True,
                             "sampling_params": {"max_new_tokens": 4, "n": 2, "ignore_eos": True}})
    assert [d["meta_info"]["prompt_tokens"] for d in data] == [2, 2, 3, 3]
    assert all(len(d["meta_info"]["output_token_logprobs"]) == 4 for d in data)
    data = generate(router, {"text": "12+34=", "sampling_params": {"max_new_tokens": 3}})
    assert data["meta_info"]["prompt_tokens"] == 6 and isinstance(data["text"], str)


def test_streaming_through_the_router(router):
    body = json.dumps({"input_ids": [1, 2, 3], "stream": True,
                       "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}).encode()
    request = urllib.request.Request(router + "/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [e[len("data: "):] for e in response.read().decode().split("\n\n")
                  if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(json.loads(events[0])["output_ids"]) == 5


def test_worker_4xx_passes_through_the_router(router, workers):
    status, data, _ = http(router, "/generate", {"input_ids": [1, 10_000]})
    assert status == 400 and "vocabulary" in data["error"]["message"]
    assert all(http(u, "/health")[0] == 200 for u in workers)


def test_flush_cache_is_forwarded_to_every_worker(router, workers):
    before = [counts(u).get("/flush_cache", 0) for u in workers]
    status, data, _ = http(router, "/flush_cache", method="POST")
    assert status == 200 and data["workers_flushed"] == 2, data
    assert [counts(u).get("/flush_cache", 0) - b for u, b in zip(workers, before)] == [1, 1]


def test_model_info_and_models_through_the_router(router, ckpt):
    status, info, _ = http(router, "/get_model_info")
    assert status == 200 and info["model_path"] == str(ckpt) and info["is_generation"]
    status, models, _ = http(router, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == str(ckpt)
