"""The HTTP client of the generator pool against two real server processes: least-outstanding
balancing, broadcast control, no retries on 4xx, hung and killed servers (marked down, requests
retried elsewhere, re-probed, weights restored), the launcher, and the one generator interface
shared with the in-process engine."""

import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import ml_collections
import pytest

from generator_fixtures import http, start_pool, write_checkpoints
from rl_jax.generator.base import Generator
from rl_jax.generator.client.control import GeneratorRequestError, GeneratorUnavailable
from rl_jax.generator.client.core import ClientConfig, GeneratorClient
from rl_jax.generator.engine.local import LocalGenerator
from rl_jax.generator.launcher.pool import LaunchError, PoolConfig, ServerPool, server_command
from rl_jax.generator.protocol import parse_generate, request_json
from rl_jax.generator.responses import outputs_from_json
from rl_jax.generator.types import GenerateRequest, GeneratorError, SamplingParams


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def pool(ckpts, tmp_path_factory):
    servers = start_pool(ckpts["a"], 2, tmp_path_factory.mktemp("logs"))
    yield servers
    servers.stop()


def req(prompt=(1, 2, 3), **sampling):
    sampling.setdefault("ignore_eos", True)
    sampling.setdefault("max_new_tokens", 8)
    return GenerateRequest(list(prompt), SamplingParams(**sampling))


def run(coro):
    return asyncio.run(coro)


FAST_HEALTH = ClientConfig(health_check_interval=0.3, down_retry_interval=0.3,
                           health_timeout=0.5, request_timeout=60)


async def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def served(client):
    return [s["served"] for s in client.snapshot()]


def test_least_outstanding_balancing_spreads_load(pool):
    async def main():
        async with GeneratorClient(pool.urls) as client:
            outs = await client.generate_many([req((1, i + 3)) for i in range(8)])
            assert [len(o) for o in outs] == [1] * 8
            assert all(len(o[0].output_ids) == 8 for o in outs)
            assert served(client) == [4, 4]
            # A server busy with a long request gets no new work while the other is idle.
            long = asyncio.create_task(client.generate(req(max_new_tokens=500)))
            await wait_for(lambda: any(s.outstanding for s in client.servers))
            busy = next(i for i, s in enumerate(client.servers) if s.outstanding)
            before = served(client)
            for i in range(3):
                await client.generate(req((1, 9, i)))
            after = served(client)
            assert after[busy] == before[busy] and after[1 - busy] == before[1 - busy] + 3
            assert len((await long)[0].output_ids) == 500
    run(main())
    for url in pool.urls:  # both servers did decode work
        assert http(url, "/get_server_info")[1]["internal_states"][0]["generated_tokens"] > 0


def test_outputs_carry_logprobs_versions_and_n_samples(pool):
    async def main():
        async with GeneratorClient(pool.urls) as client:
            outs = await client.generate(req((1, 5, 7), n=3, max_new_tokens=6, seed=4))
            assert len(outs) == 3 and len({o.rid for o in outs}) == 3
            for o in outs:
                assert o.input_ids == [1, 5, 7] and len(o.output_ids) == 6
                assert len(o.output_logprobs) == 6 and all(lp <= 0 for lp in o.output_logprobs)
                assert o.output_versions == [0] * 6 and o.finish_reason["type"] == "length"
            again = await client.generate(req((1, 5, 7), n=3, max_new_tokens=6, seed=4))
            assert [o.output_ids for o in again] == [o.output_ids for o in outs]
    run(main())


def test_a_batch_goes_in_one_exchange_per_n(pool):
    async def main():
        async with GeneratorClient(pool.urls) as client:
            requests = [req((1, 5, 7), max_new_tokens=3 + i, seed=10 + i, n=1 + i % 2)
                        for i in range(4)]
            before = sum(served(client))
            outs = await client.generate_batch(requests)
            # one exchange per n (SGLang needs one n per batch), each with one server
            assert sum(served(client)) == before + 2
            assert [len(o) for o in outs] == [1, 2, 1, 2]
            assert [[len(x.output_ids) for x in o] for o in outs] == [[3], [4, 4], [5], [6, 6]]
            # The same completions as the prompts sent one by one.
            alone = [await client.generate(r) for r in requests]
            assert ([[x.output_ids for x in o] for o in outs] ==
                    [[x.output_ids for x in o] for o in alone])
            with pytest.raises(GeneratorError, match="duplicate request ids"):
                await client.generate_batch([
                    GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="same"),
                    GenerateRequest([1, 3], SamplingParams(max_new_tokens=2), rid="same")])
    run(main())


def test_broadcast_operations_reach_every_server(pool, ckpts):
    def states(path, key):
        return [http(url, path)[1][key] for url in pool.urls]

    async def main():
        async with GeneratorClient(pool.urls) as client:
            await client.pause("in_place")
            assert states("/get_server_info", "paused") == [True, True]
            await client.resume()
            assert states("/get_server_info", "paused") == [False, False]
            assert await client.flush_cache() is True
            await client.abort()  # abort_all on every server
            assert await client.update_weights_from_disk(ckpts["b"], 3) == 3
            assert states("/get_weight_version", "weight_version") == [3, 3]
            assert states("/get_model_info", "model_path") == [str(ckpts["b"])] * 2
            assert await client.weight_version() == 3
            outs = await client.generate_many([req((1, i + 2)) for i in range(4)])
            assert all(o[0].output_versions == [3] * 8 for o in outs)
            # Without a version: the pool's highest + 1.
            assert await client.update_weights_from_disk(ckpts["a"]) == 4
            assert states("/get_weight_version", "weight_version") == [4, 4]
            with pytest.raises(GeneratorRequestError, match="does not exist"):
                await client.update_weights_from_disk("/no/such/checkpoint", 5)
            assert states("/get_weight_version", "weight_version") == [4, 4]
    run(main())


def test_4xx_is_raised_and_not_retried(pool):
    async def main():
        async with GeneratorClient(pool.urls) as client:
            with pytest.raises(GeneratorRequestError) as info:
                await client.generate(req((1, 10_000)))
            assert info.value.status == 400 and "vocabulary" in str(info.value)
            assert client.stats["attempts"] == 1 and client.stats["retries"] == 0
            with pytest.raises(GeneratorRequestError, match="max_seq_len"):
                await client.generate(req(max_new_tokens=10_000))
            assert client.stats["attempts"] == 2 and client.stats["retries"] == 0
            assert [s["healthy"] for s in client.snapshot()] == [True, True]
    run(main())


def test_hung_server_is_marked_down_reprobed_and_given_the_latest_weights(pool, ckpts):
    async def main():
        async with GeneratorClient(pool.urls, FAST_HEALTH) as client:
            await client.check_health()
            pool.kill(0, signal.SIGSTOP)
            try:
                await wait_for(lambda: not client.servers[0].healthy, what="server 0 down")
                outs = await client.generate_many([req((1, i + 2)) for i in range(4)])
                assert len(outs) == 4 and client.servers[0].served == 0
                # A weight update while server 0 is down reaches server 1 only...
                await client.update_weights_from_disk(ckpts["b"], 10)
                assert http(pool.urls[1], "/get_weight_version")[1]["weight_version"] == 10
            finally:
                pool.kill(0, signal.SIGCONT)
            # ...and is re-applied to server 0 when it answers again.
            await wait_for(lambda: client.servers[0].healthy, what="server 0 back up")
            assert http(pool.urls[0], "/get_weight_version")[1]["weight_version"] == 10
            assert client.stats["recovered"] == 1
            outs = await client.generate_many([req((1, i + 2)) for i in range(4)])
            assert client.servers[0].served > 0
            assert all(o[0].output_versions == [10] * 8 for o in outs)
    run(main())


def test_killed_server_is_detected_and_requests_retried(pool):
    async def main():
        config = ClientConfig(health_check_interval=60, down_retry_interval=0.3,
                              health_timeout=0.5, request_timeout=60, retry_backoff=0.01)
        async with GeneratorClient(pool.urls, config) as client:
            long = asyncio.create_task(client.generate(req(max_new_tokens=400)))
            await wait_for(lambda: any(s.outstanding for s in client.servers))
            victim = next(i for i, s in enumerate(client.servers) if s.outstanding)
            # Frozen at once (the request must not finish first: 400 tokens take well under a
            # second), then killed with the request in flight.
            pool.kill(victim, signal.SIGSTOP)
            pool.kill(victim, signal.SIGKILL)
            outs = await long  # its connection broke: retried on the other server
            assert len(outs[0].output_ids) == 400
            assert not client.servers[victim].healthy
            assert client.stats["retries"] >= 1 and client.stats["marked_down"] == 1
            outs = await client.generate_many([req((1, i + 2)) for i in range(6)])
            assert len(outs) == 6 and client.servers[victim].served == 0
            # Restarted, it is found by the periodic re-probe and used again.
            await asyncio.to_thread(pool.start_server, victim)
            await wait_for(lambda: client.servers[victim].healthy, what="the restarted server")
            await client.generate_many([req((1, i + 2)) for i in range(4)])
            assert client.servers[victim].served > 0
    run(main())


class DroppingProxy:
    """A TCP proxy in front of one real server that, once, delivers a ``/generate`` request and
    then drops the client's connection while keeping the server's open: the server runs the
    request and never learns that its client is gone (a broken path, not a dead server)."""

    def __init__(self, backend_url: str):
        host, port = backend_url.rsplit("/", 1)[-1].split(":")
        self.backend = (host, int(port))
        self.dropped = 0
        self.held: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self):
        self.server.close()
        for writer in self.held:
            writer.close()

    async def _serve(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection(*self.backend)

        async def downstream():
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        back = asyncio.create_task(downstream())
        try:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()
                if not self.dropped and data.startswith(b"POST /generate"):
                    self.dropped += 1
                    await asyncio.sleep(0.2)  # the whole request reaches the server
                    back.cancel()
                    self.held.append(up_writer)  # the server's side stays open
                    writer.transport.abort()
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        back.cancel()
        up_writer.close()
        writer.close()


def test_a_request_cut_off_after_delivery_is_retried_under_its_rid(pool):
    """The connection breaks after the server took the request: the retry reaches the same
    server (the only one) while the first attempt is still there (queued: the server is paused
    until the retry is under way), so the client frees the rid on that server before retrying;
    without that the retry is refused as a duplicate."""
    backend = pool.urls[0]

    async def main():
        proxy = DroppingProxy(backend)
        url = await proxy.start()
        config = ClientConfig(health_check_interval=60, down_retry_interval=0.05,
                              health_timeout=2, request_timeout=60, retry_backoff=0.01)
        try:
            async with GeneratorClient([url], config) as client:
                request = GenerateRequest([1, 2, 3], SamplingParams(
                    max_new_tokens=30, ignore_eos=True, seed=5), rid="cut-off-once")
                task = asyncio.create_task(client.generate(request))
                await wait_for(lambda: client.stats["retries"] >= 1 or task.done(),
                               what="the retry")
                await asyncio.to_thread(http, backend, "/continue_generation", {})
                outs = await task
                assert proxy.dropped == 1 and client.stats["retries"] == 1
                assert outs[0].rid == "cut-off-once" and len(outs[0].output_ids) == 30
                assert outs[0].finish_reason["type"] == "length"
        finally:
            await proxy.close()
            http(backend, "/continue_generation", {})

    assert http(backend, "/pause_generation", {"mode": "in_place"})[0] == 200
    run(main())


def test_no_server_up_raises_unavailable(tmp_path):
    async def main():
        config = ClientConfig(max_attempts=2, retry_backoff=0.01, health_timeout=0.5,
                              down_retry_interval=0.2, unavailable_wait_s=1.0)
        async with GeneratorClient(["http://127.0.0.1:9"], config) as client:
            start = time.monotonic()
            with pytest.raises(GeneratorUnavailable, match="2 attempts.*no healthy server"):
                await client.generate(req())
            # the first attempt found the server refusing connections, the second waited for it
            assert time.monotonic() - start >= 1.0
            assert client.stats["waited_for_a_server"] > 0
    run(main())


def test_a_request_waits_for_a_server_to_come_back(pool):
    """Every server marked down at once (as a loaded host's probes time out) does not fail a
    request: it waits for one to answer again."""
    async def main():
        config = dataclasses.replace(FAST_HEALTH, unavailable_wait_s=60.0)
        async with GeneratorClient(pool.urls, config) as client:
            await client.check_health()
            for i in range(2):
                pool.kill(i, signal.SIGSTOP)
            try:
                await wait_for(lambda: not any(s.healthy for s in client.servers),
                               what="both servers down")
                request = asyncio.create_task(client.generate(req()))
                await asyncio.sleep(1.5)
                assert not request.done()
            finally:
                for i in range(2):
                    pool.kill(i, signal.SIGCONT)
            outs = await request
            assert len(outs[0].output_ids) == 8 and client.stats["waited_for_a_server"] > 0
    run(main())


# ---- launcher -----------------------------------------------------------------------------------

def test_pool_config_from_a_config_block():
    block = ml_collections.ConfigDict({"kind": "rl_jax", "model": "/ckpt", "ports": [1, 2],
                                       "max_slots": 4, "env": {"A": "1"}})
    config = PoolConfig.from_config(block)
    assert config.ports == (1, 2) and config.max_slots == 4 and config.env == (("A", "1"),)
    with pytest.raises(LaunchError, match="unknown generator pool settings"):
        PoolConfig.from_config({"model": "/ckpt", "slots": 4})
    with pytest.raises(LaunchError, match="kind"):
        PoolConfig(model="/ckpt", kind="vllm")


def test_server_commands():
    ours = PoolConfig(model="/ckpt", ports=(31000,), max_slots=16, max_seq_len=256)
    assert server_command(ours, 31000) == [
        sys.executable, "-m", "rl_jax.generator.server.serve", "--model=/ckpt", "--host=127.0.0.1",
        "--port=31000", "--max_slots=16", "--max_seq_len=256", "--max_waiting=4096",
        "--dtype=float32", "--tensor_parallel=1", "--data_parallel=1", "--weight_version=0",
        f"--parent_pid={os.getpid()}", "--num_continuous_decode_steps=1"]
    sglang = PoolConfig(model="Qwen/Qwen3-0.6B", kind="sglang", host="0.0.0.0",
                        ports=(30001, 30002), tensor_parallel=2, data_parallel=2,
                        dtype="bfloat16",
                        max_slots=64, max_seq_len=4096, weight_version=7,
                        extra_args=("--mem-fraction-static", "0.8"))
    assert server_command(sglang, 30002, 1) == [
        sys.executable, "-m", "rl_jax.generator.launcher.orphan_guard",
        f"--parent_pid={os.getpid()}",
        "--", sys.executable, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-0.6B",
        "--host", "0.0.0.0", "--port", "30002", "--tp-size", "2", "--dp-size", "2",
        "--base-gpu-id", "4",
        "--dtype", "bfloat16", "--max-running-requests", "64", "--context-length", "4096",
        "--weight-version", "7", "--mem-fraction-static", "0.8"]
    assert ServerPool(sglang).urls == ["http://0.0.0.0:30001", "http://0.0.0.0:30002"]
    # Multi-step decoding, under each kind's flag name
    steps = dict(decode_steps=4)
    assert "--num_continuous_decode_steps=4" in server_command(
        PoolConfig(model="/ckpt", **steps), 31000)
    # one step too, explicitly: the server's own default depends on its backend
    assert "--num_continuous_decode_steps=1" in server_command(PoolConfig(model="/ckpt"), 31000)
    cmd = server_command(PoolConfig(model="m", kind="sglang", **steps), 30001)
    assert cmd[cmd.index("--num-continuous-decode-steps") + 1] == "4"
    # A lower CPU priority, for either kind (outermost, so that it covers taskset too)
    assert server_command(PoolConfig(model="/ckpt", nice=7), 31000)[:4] == [
        "nice", "-n", "7", sys.executable]
    assert server_command(PoolConfig(model="m", kind="sglang", nice=3, cpu_cores="1"),
                          30001)[:6] == ["nice", "-n", "3", "taskset", "-c", "1"]
    for bad in (-1, 20, 1.5, True):
        with pytest.raises(LaunchError, match="generator nice must be an integer from 0"):
            PoolConfig(model="/ckpt", nice=bad)


def test_sglang_kind_needs_the_python_of_sglangs_own_environment(tmp_path):
    assert importlib.util.find_spec("sglang") is None  # never in the trainer's environment
    with pytest.raises(LaunchError, match=r"give generator\.python.*tools/sglang_cpu"):
        ServerPool(PoolConfig(model="m", kind="sglang", ports=(30001,))).start()
    for python in (str(tmp_path / "missing" / "python"), str(tmp_path)):
        with pytest.raises(LaunchError, match="is not an executable"):
            ServerPool(PoolConfig(model="m", kind="sglang", ports=(30001,),
                                  python=python)).start()
    command = ServerPool(PoolConfig(model="m", kind="sglang", ports=(30001,),
                                    python="/opt/sglang/bin/python")).commands()[0]
    # SGLang under the guard that ends it with this process (rl_jax.generator.launcher.orphan_guard)
    guard = command[:command.index("--")]
    assert guard[1:] == ["-m", "rl_jax.generator.launcher.orphan_guard",
                         f"--parent_pid={os.getpid()}"]
    assert command[len(guard) + 1:][:3] == ["/opt/sglang/bin/python", "-m",
                                            "sglang.launch_server"]


def test_a_pool_makes_its_temporary_log_directory_only_when_it_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes directories
    pool = ServerPool(PoolConfig(model="m", ports=(30001, 30002)))
    pool.commands()
    assert list(tmp_path.iterdir()) == []  # built, never started: nothing left behind
    assert pool.log_files == [pool.log_dir / "rl_jax-server-0.log",
                              pool.log_dir / "rl_jax-server-1.log"]
    assert pool.log_dir.parent == tmp_path and pool.log_dir.name.startswith("rl_jax-generators-")
    assert pool.log_dir.stat().st_mode & 0o777 == 0o700


def test_a_crashing_server_is_reported_with_its_log(tmp_path):
    pool = ServerPool(PoolConfig(model=str(tmp_path / "missing"), ports=(0,),
                                 log_dir=str(tmp_path), startup_timeout=120))
    with pytest.raises(LaunchError, match="does not exist"):
        pool.start()
    assert pool.processes[0].returncode == 2


# ---- one interface for the local engine and the HTTP pool ---------------------------------------

async def rollout_round(generator: Generator, new_weights) -> tuple[list, int]:
    """What a rollout worker does with any generator."""
    groups = await generator.generate_many([req((1, 4, 5), n=2, seed=1), req((1, 6), seed=2)])
    version = await generator.update_weights_from_disk(new_weights, 42)
    later = await generator.generate(req((1, 4, 5), seed=1))
    assert version == 42 and await generator.weight_version() == 42
    assert later[0].output_versions == [42] * 8
    return groups, version


def test_local_engine_and_http_pool_behind_one_interface(pool, ckpts):
    from rl_jax.generator.server.app import GeneratorServer
    from rl_jax.generator.server.config import ServerConfig

    async def main():
        async with GeneratorClient(pool.urls) as client:
            # back to checkpoint a under a newer version (versions never go back)
            await client.update_weights_from_disk(ckpts["a"], 11)
            remote, _ = await rollout_round(client, ckpts["b"])
        server = GeneratorServer.from_config(ServerConfig(
            model=str(ckpts["a"]), max_slots=8, max_seq_len=512, warmup=False))
        async with LocalGenerator(server.engine, owns_engine=True) as local:
            here, _ = await rollout_round(local, ckpts["b"])
        for r, h in zip(remote, here):
            assert [o.output_ids for o in r] == [o.output_ids for o in h]
    run(main())


# ---- wire format ------------------------------------------------------------------------------

def test_request_bodies_use_sglang_names():
    body = request_json(GenerateRequest([1, 2], SamplingParams(
        max_new_tokens=5, temperature=0.5, top_k=4, stop_token_ids=(7,), n=2, seed=9),
        rid="r1"))
    assert body == {"input_ids": [1, 2], "rid": "r1", "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.5, "top_p": 1.0, "top_k": 4, "min_p": 0.0,
        "ignore_eos": False, "n": 2, "stop_token_ids": [7], "sampling_seed": 9}}


def test_answers_of_real_sglang_servers_are_read():
    """SGLang has no per-token versions and reports ``weight_version`` as a string."""
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2))
    answer = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "id": "x1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
        "completion_tokens": 2, "cached_tokens": 1, "e2e_latency": 0.25,
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, "b"]],
        "weight_version": "default"}}
    [out] = outputs_from_json(answer, request)
    assert out.output_ids == [5, 6] and out.output_logprobs == [-0.5, -0.25]
    assert out.output_versions == [-1, -1] and out.input_ids == [1, 2, 3] and out.rid == "x1"
    assert out.cached_tokens == 1 and out.e2e_latency == 0.25
    answer["meta_info"]["weight_version"] = "7"
    assert outputs_from_json(answer, request)[0].output_versions == [7, 7]
    assert out.output_unfiltered_logprobs is None
    answer["meta_info"]["output_token_unfiltered_logprobs"] = [-0.75, -0.5]
    assert outputs_from_json(answer, request)[0].output_unfiltered_logprobs == [-0.75, -0.5]
    answer["meta_info"]["output_token_unfiltered_logprobs"] = [-0.75]
    with pytest.raises(GeneratorError, match="one log-prob per output token"):
        outputs_from_json(answer, request)
    answer["meta_info"]["output_token_unfiltered_logprobs"] = [-0.75, {"x": 1}]
    with pytest.raises(GeneratorError, match="not a number"):
        outputs_from_json(answer, request)
    del answer["meta_info"]["output_token_unfiltered_logprobs"]
    answer["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(GeneratorError, match="differ"):
        outputs_from_json(answer, request)
    del answer["meta_info"]["output_token_logprobs"]
    with pytest.raises(GeneratorError, match="return_logprob"):
        outputs_from_json(answer, request)


def test_lenient_servers_ignore_what_strict_ones_refuse():
    body = {"input_ids": [1, 2], "lora_path": "adapter",
            "sampling_params": {"repetition_penalty": 1.2, "regex": "a+"}}
    with pytest.raises(GeneratorError, match="lora_path"):
        parse_generate(body, tokenize=None, vocab_size=10)
    parsed = parse_generate(body, tokenize=None, vocab_size=10, strict=False)
    assert parsed.items[0].request.input_ids == [1, 2] and not parsed.as_list


def test_servers_exit_when_their_launcher_dies(ckpts, tmp_path):
    """A killed launcher (e.g. a test run stopped by a timeout) leaves no servers behind. (The
    server also runs at a lower CPU priority, ``nice``, which is checked on the way.)"""
    script = (
        "import sys, time\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from generator_fixtures import start_pool\n"
        "pool = start_pool(sys.argv[2], 1, sys.argv[3], nice=5)\n"
        "print(pool.urls[0], pool.processes[0].pid, flush=True)\n"
        "time.sleep(600)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(ckpts["a"]),
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        url, pid = launcher.stdout.readline().split()
        assert http(url, "/health")[0] == 200
        # started at the lower CPU priority it was given
        assert os.getpriority(os.PRIO_PROCESS, int(pid)) == os.getpriority(
            os.PRIO_PROCESS, 0) + 5
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while _pid_alive(int(pid)):
        assert time.monotonic() < deadline, "the orphaned server is still running"
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (an exited orphan may linger as a zombie if nobody reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_answers_that_are_not_completions_are_refused():
    """Token ids outside the vocabulary, log-probs above 0 or not numbers, and lengths that
    disagree are errors naming the problem (the client then tries another server)."""
    from rl_jax.generator.responses import outputs_from_json
    from rl_jax.generator.types import GenerateRequest, GeneratorError, SamplingParams
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2), rid="r")

    def answer(ids, triples):
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": triples,
                                                 "weight_version": 1}}
    good = outputs_from_json(answer([5, 6], [[-0.5, 5, None], [-1.0, 6, None]]), request, 64)
    assert good[0].output_ids == [5, 6] and good[0].output_logprobs == [-0.5, -1.0]
    for data, words in [
            (answer([5, 99], [[-0.5, 5, None], [-1.0, 99, None]]), "outside the vocabulary"),
            (answer([5, -1], [[-0.5, 5, None], [-1.0, -1, None]]), "outside the vocabulary"),
            (answer([5, 6], [[3.5, 5, None], [-1.0, 6, None]]), "not a log"),
            (answer([5, 6], [[float("nan"), 5, None], [-1.0, 6, None]]), "not a log"),
            (answer([5, 6], [["x", 5, None], [-1.0, 6, None]]), "not \\[log-prob"),
            (answer([5, 6], [[-0.5, 5, None]]), "1 log-probs for 2 tokens"),
            (answer(["a", 6], [[-0.5, 5, None], [-1.0, 6, None]]), "malformed"),
            (answer([5, 6], [[-0.5], [-1.0, 6]]), "not \\[log-prob")]:
        with pytest.raises(GeneratorError, match=words):
            outputs_from_json(data, request, 64)


def test_a_server_answering_garbage_is_skipped_then_distrusted(pool):
    """A server behind a proxy that corrupts every completion (token ids outside the
    vocabulary): each of its answers is refused and the request goes to the other server; after
    ``max_malformed`` such answers it gets no more requests."""
    from aiohttp import web

    async def main():
        upstream = pool.urls[0]
        corrupted = []

        async def forward(request):
            body = await request.read()
            async with aiohttp.ClientSession() as session:
                headers = {k: v for k, v in request.headers.items()
                           if k.lower() in ("authorization", "content-type")}
                async with session.request(request.method, upstream + request.path_qs,
                                           data=body, headers=headers) as answer:
                    payload, status = await answer.read(), answer.status
            if request.path == "/generate" and status == 200:
                data = json.loads(payload)
                for item in data if isinstance(data, list) else [data]:
                    item["output_ids"][0] = 10**6
                    item["meta_info"]["output_token_logprobs"][0][1] = 10**6
                payload = json.dumps(data).encode()
                corrupted.append(1)
            return web.Response(body=payload, status=status, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        proxy = f"http://127.0.0.1:{runner.addresses[0][1]}"
        config = dataclasses.replace(FAST_HEALTH, vocab_size=64, max_malformed=3,
                                     max_attempts=3)
        outs = []
        try:
            async with GeneratorClient([proxy, pool.urls[1]], config) as client:
                deadline = time.monotonic() + 60
                while len(corrupted) < 3:  # between them, health checks bring it back up
                    assert time.monotonic() < deadline, client.snapshot()
                    outs.append(await client.generate(req(max_new_tokens=4)))
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # time for a health check to find it up again
                for _ in range(6):
                    outs.append(await client.generate(req(max_new_tokens=4)))
                state = {s["url"]: s for s in client.snapshot()}
        finally:
            await runner.cleanup()
        return outs, state, corrupted

    outs, state, corrupted = run(main())
    assert all(o[0].output_ids and max(o[0].output_ids) < 64 for o in outs)
    assert state[pool.urls[1]]["served"] == len(outs)
    assert state[[u for u in state if u != pool.urls[1]][0]]["malformed"] == 3
    assert len(corrupted) == 3  # distrusted after the third: no request reached it again
