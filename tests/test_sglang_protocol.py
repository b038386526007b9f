"""SGLang's protocol as the project speaks it, against both servers: this project's generator
server and a real SGLang 0.5.23 server (CPU engine, its own environment). Every test runs once per
kind on one server of that kind, started from the same checkpoint.

What is checked: the client's calls and parsing (log-probs, ``n``, stop tokens, versions read from
``/model_info``, per-token versions from ``meta_info.weight_versions`` spans, a batch with
different ``n``, what each server says about itself and seeds); the distributed weight stream
(the group formed as SGLang forms it, the begin/end session, three versions: new weights change
the outputs, the original weights restore the baseline log-probs bit for bit, versions
reported); a multi-bucket update in the middle of a request, paused so that every token comes
from one whole version (tokens after the switch equal what the new weights produce from the same
prefix); a refused update failing at once with the server's reason; a restarted trainer joining
again under the same group name.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import numpy as np
import pytest

from generator_fixtures import http, write_checkpoints
from rl_jax.generator.client.core import GeneratorClient
from rl_jax.generator.client.identity import SUPPORTED_SGLANG_VERSIONS, UnsupportedServer, identify
from rl_jax.generator.engine.weights import load_params
from rl_jax.generator.types import GenerateRequest, SamplingParams
from rl_jax.sharding import make_mesh
from rl_jax.transfer.sglang.broadcast import ServerRefused, SGLangWeightSender
from sglang_fixtures import KINDS, greedy, start_server

pytest.importorskip("torch")

PROMPT = [5, 9, 12, 7, 20, 3]
_VERSIONS = itertools.count(1)  # versions only go up on a server (tests share one per kind)


def fresh_versions(n: int) -> list[int]:
    """``n`` weight versions above every one used so far."""
    return [next(_VERSIONS) for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("sglang_protocol"), names=("a", "b", "c"))


# Real SGLang takes ~30 s to start and its CPU engine is slow: its half of the tests is `slow`
# (the quick loop, -m "not slow", needs no SGLang environment).
@pytest.fixture(scope="module", params=[pytest.param(k, marks=[pytest.mark.slow] if k == "sglang"
                                                     else []) for k in KINDS])
def server(request, checkpoints, tmp_path_factory):
    """``(kind, url)`` of one server on checkpoint ``a`` (this project's split over two devices
    by tensor parallelism, so that the weights the trainer broadcasts from its 8-device FSDP
    layout land in another layout)."""
    logs = tmp_path_factory.mktemp(f"logs_{request.param}")
    kernel_calls = logs / "sgl_kernel_calls"  # what SGLang called of the CPU stand-in
    extra = ({"tensor_parallel": 2} if request.param == "rl_jax" else
             {"env": (("RL_JAX_SGL_KERNEL_CALLS", str(kernel_calls)),)})
    pool = start_server(request.param, checkpoints["a"], logs, **extra)
    try:
        yield request.param, pool.urls[0]
    finally:
        pool.stop()
    # The log is this user's only: SGLang writes its settings, API keys included, there.
    assert pool.log_files[0].stat().st_mode & 0o777 == 0o600
    # SGLang's CPU engine computed every layer with its own torch code: no stand-in of a CUDA
    # kernel was called (each raises, and notes its name here first).
    assert not kernel_calls.exists(), kernel_calls.read_text()


@pytest.fixture(scope="module")
def params(checkpoints):
    """Each checkpoint's parameters as the trainer holds them (FSDP over the 8 test devices)."""
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    return {name: load_params(path, mesh=mesh, rules=None, dtype="float32")
            for name, path in checkpoints.items()}


def _run(coro):
    return asyncio.run(coro)


async def _with_client(url, fn):
    async with GeneratorClient([url]) as client:
        return await fn(client)


# ---- the client ---------------------------------------------------------------------------------

def test_identity_and_versions(server):
    kind, url = server

    async def go(client):
        return await client.identify_servers(), await client.weight_versions()

    identities, versions = _run(_with_client(url, go))
    assert identities[url].kind == kind
    if kind == "sglang":
        assert identities[url].version in SUPPORTED_SGLANG_VERSIONS
        assert identities[url].honours_seed is False  # no --enable-deterministic-inference
    assert versions == {url: 0}


def test_unsupported_sglang_release_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedServer, match=r"SGLang 0\.4\.9.*supported: 0\.5\.23"):
        identify({"version": "0.4.9"}, "http://h:1")
    with pytest.raises(UnsupportedServer, match="reports no version"):
        identify({"model_path": "x"})
    assert identify({"version": "rl_jax-0.1.0"}).kind == "rl_jax"


def test_generate_logprobs_n_and_stop_tokens(server):
    kind, url = server
    ids, logprobs, meta = greedy(url, PROMPT, 12, http, ignore_eos=True)
    assert len(ids) == 12 and np.all(logprobs <= 0) and np.all(np.isfinite(logprobs))
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]
    stop = ids[4]
    first = ids.index(stop)

    async def go(client):
        request = GenerateRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12,
                                                         n=2, stop_token_ids=(stop,)))
        return await client.generate(request)

    outputs = _run(_with_client(url, go))
    assert len(outputs) == 2
    for out in outputs:
        assert out.output_ids == ids[:first + 1]
        assert out.finish_reason["type"] == "stop"
        assert out.output_versions == [0] * len(out.output_ids)
        np.testing.assert_allclose(out.output_logprobs, logprobs[:first + 1], atol=1e-5)


def test_a_batch_with_different_n_per_prompt(server):
    _, url = server

    async def go(client):
        requests = [GenerateRequest(PROMPT[:k], SamplingParams(temperature=1.0, max_new_tokens=4,
                                                               n=n, ignore_eos=True))
                    for k, n in ((3, 1), (4, 3), (5, 1), (6, 2))]
        return await client.generate_batch(requests)

    outputs = _run(_with_client(url, go))
    assert [len(o) for o in outputs] == [1, 3, 1, 2]
    assert [o[0].input_ids for o in outputs] == [PROMPT[:3], PROMPT[:4], PROMPT[:5], PROMPT]
    assert all(len(x.output_ids) == 4 for o in outputs for x in o)


def test_a_seeded_request_to_a_server_that_ignores_seeds_is_reported_once(server, caplog):
    kind, url = server

    async def go(client):
        await client.identify_servers()
        for seed in (1, 2):
            await client.generate(GenerateRequest(PROMPT, SamplingParams(
                temperature=1.0, max_new_tokens=2, seed=seed)))

    with caplog.at_level(logging.WARNING, logger="rl_jax.generator.client.identity"):
        _run(_with_client(url, go))
    warnings = [r for r in caplog.records if "ignores sampling seeds" in r.getMessage()]
    assert len(warnings) == (1 if kind == "sglang" else 0)


# ---- the distributed weight stream --------------------------------------------------------------

def _sender(url, params, **kw):
    kw.setdefault("bucket_bytes", 24 << 10)  # several buckets for the tiny model
    kw.setdefault("timeout_s", 120)
    return SGLangWeightSender([url], params["a"][0], master_address="127.0.0.1", **kw)


def _model_info_version(url) -> str:
    status, info, _ = http(url, "/model_info")
    assert status == 200, info
    return str(info["weight_version"])


def test_three_versions_change_and_restore_the_outputs_bit_for_bit(server, params):
    _, url = server
    base_ids, base_lp, _ = greedy(url, PROMPT, 16, http, ignore_eos=True)
    sender = _sender(url, params)
    try:
        seen = {}
        for version, name in zip(fresh_versions(3), "bca"):
            stats = sender.send(params[name][1], version)
            assert stats.buckets > 1 and stats.paused
            assert _model_info_version(url) == str(version)
            ids, lp, meta = greedy(url, PROMPT, 16, http, ignore_eos=True)
            assert meta["weight_versions"] == [{"version": str(version), "start": 0, "end": 16}]
            seen[name] = (ids, lp)
        assert not np.array_equal(seen["b"][1], base_lp)
        assert not np.array_equal(seen["c"][1], seen["b"][1])
        assert seen["a"][0] == base_ids
        np.testing.assert_array_equal(seen["a"][1], base_lp)  # bit for bit
    finally:
        sender.close()


@pytest.mark.parametrize("pause_mode", ["retract", "in_place"])
def test_an_update_in_the_middle_of_a_request_gives_whole_versions_per_token(server, params,
                                                                           pause_mode):
    """Generation is paused around a multi-bucket update; the request that crosses it has two
    version spans, its tokens before the switch are the old weights' and, when the pause retracts
    it (its KV cache is computed again on resumption), its tokens after the switch are exactly
    what the new weights produce from the same prefix: a token sampled from a half-updated model
    would not be. (``in_place`` keeps the KV cache the old weights computed, as in-flight
    updates do, so only the spans and the old tokens are checked there.)"""
    _, url = server
    sender = _sender(url, params, pause_mode=pause_mode)
    version, new = fresh_versions(2)
    n_tokens = 400
    result = {}

    def generate():
        result["answer"] = greedy(url, PROMPT, n_tokens, http, ignore_eos=True)

    try:
        sender.send(params["a"][1], version)  # joins the group before the request starts
        old_ids, _, _ = greedy(url, PROMPT, n_tokens, http, ignore_eos=True)  # (compiles)
        start = time.perf_counter()
        greedy(url, PROMPT, n_tokens, http, ignore_eos=True)
        wait = (time.perf_counter() - start) / 4  # the update lands a quarter of the way in
        for attempt in range(4):
            thread = threading.Thread(target=generate)
            thread.start()
            time.sleep(wait)
            stats = sender.send(params["b"][1], new)
            assert stats.paused and stats.buckets > 1
            thread.join(120)
            ids, lp, meta = result["answer"]
            spans = meta["weight_versions"]
            if len(spans) > 1 or attempt == 3:
                break
            # The request ended (or had not started) before the pause: once more, sooner.
            wait /= 2
            version, new = fresh_versions(2)
            sender.send(params["a"][1], version)
        assert [s["version"] for s in spans] == [str(version), str(new)], spans
        switch = spans[1]["start"]
        assert 0 < switch < n_tokens
        assert ids[:switch] == old_ids[:switch]
        if pause_mode == "retract":
            again_ids, again_lp, _ = greedy(url, PROMPT + ids[:switch], n_tokens - switch, http,
                                            ignore_eos=True)
            assert again_ids == ids[switch:]
            np.testing.assert_allclose(again_lp, lp[switch:], atol=2e-5)

        async def parsed(client):  # the client reads the spans into per-token versions
            return await client.generate(GenerateRequest(PROMPT, SamplingParams(
                temperature=0.0, max_new_tokens=3)))

        out = _run(_with_client(url, parsed))[0]
        assert out.output_versions == [new] * len(out.output_ids)
    finally:
        sender.send(params["a"][1], fresh_versions(1)[0])
        sender.close()


def test_a_refused_update_fails_at_once_with_the_servers_reason(server, params):
    _, url = server
    sender = _sender(url, params, timeout_s=300)
    try:
        v = fresh_versions(3)
        sender.send(params["a"][1], v[0])
        # The server loses the group behind the sender's back: its next bucket is refused.
        status, answer, _ = http(url, "/destroy_weights_update_group",
                                 {"group_name": sender.group_name})
        assert status == 200, answer
        start = time.monotonic()
        with pytest.raises(ServerRefused, match=sender.group_name) as refused:
            sender.send(params["b"][1], v[1])
        assert time.monotonic() - start < 30, "the refusal waited for a broadcast time-out"
        assert refused.value.path == "/update_weights_from_distributed"
        assert _model_info_version(url) == str(v[0])
        # The next update joins again and goes through.
        sender.send(params["a"][1], v[2])
        assert _model_info_version(url) == str(v[2])
        # Generation was resumed after the refused update.
        assert len(greedy(url, PROMPT, 4, http, ignore_eos=True)[0]) == 4
    finally:
        sender.close()


def test_a_restarted_trainer_joins_again_under_the_same_group_name(server, params):
    _, url = server
    first = _sender(url, params)
    v = fresh_versions(2)
    first.send(params["b"][1], v[0])
    # The trainer dies: its end of the group is gone, the server still holds the group name.
    first.group.destroy()
    first.group = None
    second = _sender(url, params)
    try:
        second.send(params["a"][1], v[1])
        assert _model_info_version(url) == str(v[1])
    finally:
        second.close()
    status, answer, _ = http(url, "/destroy_weights_update_group",
                             {"group_name": second.group_name})
    assert status == 400 and "does not exist" in str(answer)  # close() freed it


def test_update_outside_a_session_is_refused(server):
    _, url = server
    status, answer, _ = http(url, "/update_weights_from_distributed", {
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]],
        "group_name": "nobody", "weight_version": "1000000"})
    assert status == 400 and "begin_weight_update" in answer["message"]
    assert _model_info_version(url) != "1000000"
    status, answer, _ = http(url, "/end_weight_update", {})
    assert status == 400 and "no weight-update session" in answer["message"]
