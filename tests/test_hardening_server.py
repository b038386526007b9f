"""Hostile clients of the generator: requests bounded before they cost memory or time (body
size and time, JSON depth, non-finite numbers, huge integers, out-of-range sampling values,
amplifying n x prompts, long texts), an event loop that stays responsive behind a big request,
slow and idle connections closed, a request that makes the engine raise failing alone, and
weight updates that would corrupt the policy refused while the old weights keep serving.

Servers here run in this process (a real aiohttp server on loopback around a real engine), so
that their limits can be set small and a test-only engine subclass can be served."""

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from generator_fixtures import http, write_checkpoints
from transfer_fixtures import LoopbackPeer
from rl_jax.generator.server import app as server_module
from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.weights import WeightsRefused
from rl_jax.generator.server.app import GeneratorServer
from rl_jax.generator.server.config import ServerConfig
from rl_jax.generator.types import GenerateRequest, RequestFailed, SamplingParams
from rl_jax.models.config import ModelConfig
from rl_jax.trainer.state import ModelSpec

MAX_WAITING = 64
POISON = [1, 13, 13, 13, 13]  # the prompt the test engine fails on


class PoisonEngine(Engine):
    """The real engine with one injected fault: admitting the prompt :data:`POISON` raises,
    as a bug in prefill or slot packing would (in its continuous batcher's ``_admit_to``,
    replaced before any request is submitted)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        admit_to = self._batcher._admit_to

        def poisoned(replica, groups):
            if any(list(g[0].request.input_ids) == POISON for g in groups):
                raise RuntimeError("injected admission failure")
            return admit_to(replica, groups)
        self._batcher._admit_to = poisoned


class UncheckedEngine(Engine):
    """The real engine without its sampling-range check: a ``top_k`` beyond int32 reaches the
    real slot packing, which raises (numpy refuses the overflow)."""

    def _check_sampling(self, sampling):
        pass


class LogRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


class InProcessServer:
    """``GeneratorServer.serve`` in a thread of this process, on a free loopback port."""

    def __init__(self, server: GeneratorServer):
        self.server = server
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{server.config.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if http(self.url, "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def _main(self):
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.server.serve(self._stop)
        asyncio.run(main())

    def close(self):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, engine_class=None, **overrides) -> InProcessServer:
    settings = dict(max_slots=8, max_seq_len=512, max_waiting=MAX_WAITING, warmup=False)
    config = ServerConfig(model=str(model), port=free_port(), **{**settings, **overrides})
    with contextlib.ExitStack() as stack:
        if engine_class is not None:
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(server_module, "Engine", engine_class)
        server = GeneratorServer.from_config(config)
    return InProcessServer(server)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def served(ckpts):
    running = start(ckpts["a"], keepalive_timeout_s=1.5, body_timeout_s=1.5,
                    max_request_bytes=1 << 20)
    yield running
    running.close()


@pytest.fixture
def server_log():
    handler = LogRecords()
    logger = logging.getLogger("rl_jax")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old)


def gen(url, ids, **sampling):
    sampling.setdefault("ignore_eos", True)
    status, data, _ = http(url, "/generate", {"input_ids": ids, "sampling_params": sampling,
                                              "return_logprob": True}, timeout=900)
    assert status == 200, data
    return data


# ---- requests are bounded before work is done ---------------------------------------------------

DEEP = b'{"input_ids": [1], "custom_params": ' + b"[" * 40 + b"]" * 40 + b"}"
DEEPER = b'{"input_ids": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = {  # name: (raw body, HTTP status, words the error names)
    "NaN temperature": (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', 400,
                        "sampling_params.temperature"),
    "Infinity top_p": (b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', 400,
                       "sampling_params.top_p"),
    "overflowing float": (b'{"input_ids": [1], "sampling_params": {"min_p": -1e999}}', 400,
                          "sampling_params.min_p"),
    "NaN in an ignored field": (b'{"input_ids": [1], "custom_labels": {"a": [NaN]}}', 400,
                                "custom_labels.a[0]"),
    "temperature 1e38 (its float32 reciprocal is subnormal)": (
        b'{"input_ids": [1], "sampling_params": {"temperature": 1e38}}', 400,
        "temperature must be at most"),
    "temperature at the float32 maximum": (
        b'{"input_ids": [1], "sampling_params": {"temperature": 3.4028234e38}}', 400,
        "temperature must be at most"),
    "stop as an object": (b'{"input_ids": [1], "sampling_params": {"stop": {}}}', 400,
                          "stop must be a string or a list of strings"),
    "stop_token_ids as an object": (b'{"input_ids": [1], "sampling_params": '
                                    b'{"stop_token_ids": {}}}', 400,
                                    "stop_token_ids must be a list"),
    "stream as a list": (b'{"input_ids": [1], "stream": []}', 400,
                         "stream must be true or false"),
    "return_text_in_logprobs as 0": (b'{"input_ids": [1], "return_text_in_logprobs": 0}', 400,
                                     "return_text_in_logprobs must be true or false"),
    "5000-digit top_k": (b'{"input_ids": [1], "sampling_params": {"top_k": ' + b"9" * 5000
                         + b"}}", 400, "sampling_params.top_k"),
    "100-digit token id": (b'{"input_ids": [1, ' + b"7" * 100 + b"]}", 400, "input_ids[1]"),
    "top_k beyond int32": (b'{"input_ids": [1], "sampling_params": {"top_k": 4294967296}}', 400,
                           "top_k"),
    "seed beyond int64": (b'{"input_ids": [1], "sampling_params": {"sampling_seed": '
                          + str(2 ** 64).encode() + b"}}", 400, "sampling_seed"),
    "max_new_tokens beyond int32": (b'{"input_ids": [1], "sampling_params": '
                                    b'{"max_new_tokens": 3000000000}}', 400, "max_new_tokens"),
    "logprob_start_len beyond int32": (b'{"input_ids": [1], "logprob_start_len": 9999999999}',
                                       400, "logprob_start_len"),
    "nesting 40 deep": (DEEP, 400, "custom_params[0]"),
    "nesting 100000 deep": (DEEPER, 400, "nests deeper"),
    "n x prompts above the queue, no tokens": (json.dumps({
        "input_ids": [[1, 2]] * 9, "sampling_params": {"n": 8, "max_new_tokens": 0}}).encode(),
        400, "n x prompts = 72"),
    "n above the queue, no tokens": (json.dumps({
        "input_ids": [1], "sampling_params": {"n": 10 ** 9, "max_new_tokens": 0}}).encode(),
        400, "sampling_params.n"),
    "prompts above the queue": (json.dumps({"text": ["ab"] * (MAX_WAITING + 1)}).encode(), 400,
                                "n x prompts"),
    "per-prompt n above the queue": (json.dumps({
        "text": ["ab", "cd"], "sampling_params": [{"n": 40}, {"n": 40}]}).encode(), 400,
        "n x prompts = 80"),
    "text too long to tokenise": (json.dumps({"text": "a" * 200_000}).encode(), 400,
                                  "text has 200000 characters"),
    "body over the size limit": (json.dumps({"input_ids": [1] * 400_000}).encode(), 413,
                                 "larger than"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_requests_are_refused_naming_the_field(served, server_log, name):
    raw, status, words = HOSTILE[name]
    start_load = http(served.url, "/get_load")[1]
    code, data, _ = http(served.url, "/generate", raw=raw)
    assert code == status, (name, code, data)
    assert words in data["error"]["message"], data
    # one warning line, no traceback, nothing queued
    mine = [r for r in server_log if r.name.startswith("rl_jax.generator")]
    assert [r.levelno for r in mine] == [logging.WARNING], [r.getMessage() for r in mine]
    assert mine[0].exc_info is None and "\n" not in mine[0].getMessage()
    assert http(served.url, "/get_load")[1] == start_load


def test_a_body_sent_without_its_length_is_bounded_too(served):
    def chunks():
        yield b'{"input_ids": ['
        for _ in range(200):
            yield b"1, " * 5000
        yield b"1]}"
    import urllib.request
    request = urllib.request.Request(served.url + "/generate", data=chunks(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Transfer-Encoding": "chunked"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413
    assert "larger than" in json.loads(info.value.read())["error"]["message"]


@pytest.mark.parametrize("raw", [
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface (routers probe with one)
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # past the line limit
])
def test_malformed_http_is_one_warning_line(served, server_log, raw):
    """A request aiohttp cannot parse is answered 400 and logged as one warning line naming
    the peer, without a traceback."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.0 400"), answer[:80]
    deadline = time.monotonic() + 5
    while not server_log and time.monotonic() < deadline:
        time.sleep(0.05)
    mine = [r for r in server_log if r.name.startswith("rl_jax.generator")]
    assert [r.levelno for r in mine] == [logging.WARNING], [r.getMessage() for r in mine]
    assert mine[0].exc_info is None and "\n" not in mine[0].getMessage()
    assert "malformed HTTP request from 127.0.0.1" in mine[0].getMessage()


def test_a_body_that_lies_about_its_encoding_is_a_400(served, server_log):
    """``Content-Encoding: gzip`` on a plain body: a 400 naming the encoding, one warning line,
    no traceback; a body that is gzip is read as JSON."""
    import gzip
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()
    status, data, _ = http(served.url, "/generate", raw=body,
                           headers={"Content-Encoding": "gzip"})
    assert status == 400, data
    assert "does not decode as its Content-Encoding 'gzip'" in data["error"]["message"], data
    time.sleep(0.2)  # anything aiohttp would log after the answer
    mine = [r for r in server_log if r.name.startswith("rl_jax.generator")]
    assert [r.levelno for r in mine] == [logging.WARNING], [r.getMessage() for r in mine]
    assert mine[0].exc_info is None
    status, data, _ = http(served.url, "/generate", raw=gzip.compress(body),
                           headers={"Content-Encoding": "gzip"})
    assert status == 200 and data["meta_info"]["completion_tokens"] == 2, data


def test_weight_update_fields_are_checked_before_use(served, server_log):
    """A model path no filesystem can hold, a version that is not an integer, a pause mode
    of the wrong type: each a 400 naming the field, one warning line, nothing changed."""
    version = http(served.url, "/get_weight_version")[1]["weight_version"]
    cases = [
        ("/update_weights_from_disk", {"model_path": "a" * 100_000}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/tmp/" + "a" * 300},
         "cannot be read: File name too long"),
        ("/update_weights_from_disk", {"model_path": "/tmp/x\0y"}, "model_path"),
        *[("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": v},
           "weight_version") for v in (1.5, 7.0, "1.5", True, 2 ** 63, [])],
        ("/pause_generation", {"mode": {}}, "mode must be one of"),
    ]
    for path, body, words in cases:
        server_log.clear()
        status, data, _ = http(served.url, path, body)
        assert status == 400, (str(body)[:200], str(data)[:300])
        message = data.get("message") or data["error"]["message"]
        assert words in message and len(message) < 500, (str(body)[:200], message[:300])
        mine = [r for r in server_log if r.name.startswith("rl_jax.generator")]
        assert [r.levelno for r in mine] == [logging.WARNING], [r.getMessage() for r in mine]
    assert http(served.url, "/get_weight_version")[1]["weight_version"] == version
    assert http(served.url, "/get_server_info")[1]["paused"] is False

def test_the_server_still_serves_after_hostile_requests(served):
    data = gen(served.url, [1, 2], max_new_tokens=3)
    assert data["meta_info"]["completion_tokens"] == 3
    assert http(served.url, "/get_load")[1]["load"] == 0


def test_health_stays_fast_while_a_big_request_is_handled(ckpts):
    """Tokenising a big batch, detokenising and serialising its answer run off the event loop:
    /health answers quickly meanwhile."""
    # Big enough that the request's phases (each of which would hold up every probe if it ran
    # on the event loop) last well beyond a scheduling hiccup of a busy 2-core host.
    running = start(ckpts["a"], max_waiting=4096)
    try:
        texts = ["abc defg hij 0123 " * 27] * 4096  # 486 characters each
        body = {"text": texts, "return_logprob": True, "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 0}}
        pool = concurrent.futures.ThreadPoolExecutor(1)
        start_time = time.perf_counter()
        big = pool.submit(http, running.url, "/generate", body, timeout=300)
        latencies = []
        while not big.done():
            t = time.perf_counter()
            assert http(running.url, "/health", timeout=30)[0] == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)
        elapsed = time.perf_counter() - start_time
        status, data, _ = big.result()
        assert status == 200 and len(data) == 4096, str(data)[:300]
        assert data[7]["meta_info"]["prompt_tokens"] == 486
        # The probes overlapped the big request, and none waited for it (with tokenising on
        # the event loop, a probe waits for the whole request).
        worst = max(latencies)
        assert len(latencies) >= 5 and worst < 1.5 and worst < elapsed / 4, (
            elapsed, sorted(latencies)[-5:])
        assert sorted(latencies)[len(latencies) // 2] < 0.5, sorted(latencies)
    finally:
        running.close()


# ---- slow and idle connections ------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Sends ``trickle`` one byte per second until the server closes the connection; the
    seconds that took (None if still open after ``seconds``)."""
    start_time = time.monotonic()
    sock.settimeout(0.05)
    sent = 0
    while time.monotonic() - start_time < seconds:
        if sent < len(trickle) and time.monotonic() - start_time >= sent:
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - start_time
            sent += 1
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - start_time
        if not data:
            return time.monotonic() - start_time
        if b"408" in data.split(b"\r\n", 1)[0]:  # a 408 answer, then the close
            continue
    return None


def test_slowloris_headers_are_cut_off(served):
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1]))) as sock:
        closed = _closed_within(sock, 10, b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: "
                                + b"a" * 100)
    assert closed is not None and closed < 4.0, closed  # keepalive_timeout_s=1.5


def test_an_idle_keepalive_connection_is_closed(served):
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        sock.settimeout(10)
        assert b"200" in sock.recv(65536).split(b"\r\n", 1)[0]
        closed = _closed_within(sock, 10)
    assert closed is not None and closed < 4.0, closed


def test_a_slow_body_is_cut_off(served):
    with socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        sock.settimeout(0.05)
        start_time, answer = time.monotonic(), b""
        while time.monotonic() - start_time < 10 and b"\r\n\r\n" not in answer:
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
            with contextlib.suppress(socket.timeout):
                answer += sock.recv(65536)
            time.sleep(0.2)
        elapsed = time.monotonic() - start_time
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert elapsed < 4.0, elapsed  # body_timeout_s=1.5


# ---- one failing request fails alone ------------------------------------------------------------

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def weights():
    spec = ModelSpec(CFG, mesh=None)
    return spec.init_params(0), spec.init_params(1)


def innocent_requests():
    """Long ones (running when the poison arrives) and short ones queued beside it: greedy
    and fixed seeds, filtered and not, n = 1 and n = 3."""
    long = [GenerateRequest([1, 5, 9], SamplingParams(max_new_tokens=60, seed=1,
                                                      ignore_eos=True), rid="long-0"),
            GenerateRequest([1, 7, 7], SamplingParams(max_new_tokens=50, temperature=0.0,
                                                      ignore_eos=True), rid="long-1")]
    queued = [GenerateRequest([1, 20, 3], SamplingParams(max_new_tokens=20, seed=5, n=3,
                                                         top_k=10, ignore_eos=True),
                              rid="queued-0"),
              GenerateRequest([1, 4], SamplingParams(max_new_tokens=15, temperature=0.0,
                                                     ignore_eos=True), rid="queued-1"),
              GenerateRequest(POISON[:3], SamplingParams(max_new_tokens=10, seed=9,
                                                         ignore_eos=True), rid="queued-2")]
    return long, queued


def run_engine(engine, poison: GenerateRequest | None):
    """Starts the long requests, then (admission paused) queues the poison among the short
    ones so that all are admitted in one scheduler pass; the innocents' outputs by rid."""
    long, queued = innocent_requests()
    futures = {r.rid: engine.submit(r) for r in long}
    while engine.stats["generated_tokens"] < 10:
        time.sleep(0.002)
    engine.pause("in_place")
    for r in queued[:2]:
        futures[r.rid] = engine.submit(r)
    poisoned = engine.submit(poison) if poison is not None else None
    futures[queued[2].rid] = engine.submit(queued[2])
    engine.resume()
    outputs = {rid: f.result(timeout=300) for rid, f in futures.items()}
    return outputs, poisoned


POISON_CONFIG = EngineConfig(max_slots=8, max_seq_len=96, max_waiting=MAX_WAITING)


@pytest.fixture(scope="module")
def unpoisoned(weights):
    """The innocent requests' outputs from the plain engine, without the poison."""
    reference = Engine(CFG, weights[0], engine_config=POISON_CONFIG)
    try:
        return run_engine(reference, None)[0]
    finally:
        reference.shutdown()


@pytest.mark.parametrize("engine_class, poison", [
    (PoisonEngine, GenerateRequest(POISON, SamplingParams(max_new_tokens=8, seed=3, n=2),
                                   rid="poison")),
    (UncheckedEngine, GenerateRequest([1, 5, 9], SamplingParams(max_new_tokens=8, seed=1,
                                                                top_k=2 ** 40), rid="poison")),
], ids=["injected", "top_k beyond int32"])
def test_a_failing_request_fails_alone(weights, unpoisoned, engine_class, poison):
    """The poison request gets the error; every other request, running or queued, finishes
    with the tokens it has in a run without the poison; the engine keeps serving."""
    expected = unpoisoned
    engine = engine_class(CFG, weights[0], engine_config=POISON_CONFIG)
    try:
        got, poisoned = run_engine(engine, poison)
        with pytest.raises(RequestFailed, match="failed in the engine"):
            poisoned.result(timeout=60)
        assert engine.alive and engine.stats["failed_requests"] == 1
        assert got.keys() == expected.keys()
        for rid in expected:
            assert [o.output_ids for o in got[rid]] == [o.output_ids for o in expected[rid]], rid
            assert [o.finish_reason for o in got[rid]] == [o.finish_reason
                                                          for o in expected[rid]], rid
            for a, b in zip(got[rid], expected[rid]):
                np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
        assert engine.load() == {"running": 0, "waiting": 0, "free_slots": 8}
        again = engine.generate(GenerateRequest([1, 4], SamplingParams(
            max_new_tokens=15, temperature=0.0, ignore_eos=True)), timeout=120)
        assert again[0].output_ids == expected["queued-1"][0].output_ids
    finally:
        engine.shutdown()


def test_a_failing_request_fails_alone_over_http(ckpts):
    """The same through the server: the poison request's HTTP call fails, concurrent innocent
    calls get exactly the tokens a server without the fault gives."""
    bodies = [{"input_ids": [1, 5 + i, 9], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 20, "ignore_eos": True,
                                   **({"temperature": 0} if i % 2 else {"sampling_seed": i})}}
              for i in range(6)]
    running = start(ckpts["a"], engine_class=PoisonEngine)
    try:
        # (the first call compiles: generous time on a loaded machine)
        expected = [http(running.url, "/generate", b, timeout=900)[1]["output_ids"]
                    for b in bodies]
        assert http(running.url, "/pause_generation", {"mode": "in_place"})[0] == 200
        pool = concurrent.futures.ThreadPoolExecutor(8)
        innocent = [pool.submit(http, running.url, "/generate", b, timeout=900) for b in bodies]
        poison = pool.submit(http, running.url, "/generate", {
            "input_ids": POISON, "sampling_params": {"max_new_tokens": 5}}, timeout=900)
        while http(running.url, "/get_load")[1]["waiting"] < 7:
            time.sleep(0.01)
        assert http(running.url, "/continue_generation", {})[0] == 200
        status, data, _ = poison.result(timeout=900)
        assert status == 500 and "injected admission failure" in data["error"]["message"]
        for b, f, want in zip(bodies, innocent, expected):
            status, data, _ = f.result(timeout=900)
            assert status == 200 and data["output_ids"] == want, (b, data)
        assert http(running.url, "/health")[0] == 200
    finally:
        running.close()


# ---- weights that would corrupt the policy are refused ------------------------------------------

def _corrupt(params, leaf_path: tuple, fn):
    out = jax.tree.map(lambda a: a, params)
    node = out
    for key in leaf_path[:-1]:
        node = node[key]
    node[leaf_path[-1]] = fn(node[leaf_path[-1]])
    return out


def _first_leaf_path(params) -> tuple:
    path, _ = jax.tree_util.tree_flatten_with_path(params)[0][0]
    return tuple(k.key for k in path)


@pytest.fixture(scope="module")
def guarded(weights):
    """One engine for the refusals (a refused update leaves it as it was)."""
    engine = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=64))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", ["nan", "inf", "int32", "bool", "shape", "missing"])
def test_corrupt_weights_are_refused_and_the_old_ones_kept(weights, guarded, name):
    engine = guarded
    request = GenerateRequest([1, 5, 9], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                        ignore_eos=True))
    before = engine.generate(request, timeout=300)[0]
    leaf = _first_leaf_path(weights[1])
    bad, words = {
        "nan": (_corrupt(weights[1], leaf, lambda a: a.at[(0,) * a.ndim].set(jnp.nan)),
                "non-finite"),
        "inf": (_corrupt(weights[1], leaf, lambda a: a.at[(-1,) * a.ndim].set(-jnp.inf)),
                "non-finite"),
        "int32": (_corrupt(weights[1], leaf, lambda a: a.astype(jnp.int32)), "int32"),
        "bool": (_corrupt(weights[1], leaf, lambda a: a > 0), "bool"),
        "shape": (_corrupt(weights[1], leaf, lambda a: a[..., :-1]), "wrong shapes"),
        "missing": ({k: v for k, v in weights[1].items() if k != leaf[0]}, "missing"),
    }[name]
    with pytest.raises(WeightsRefused, match=words) as info:
        engine.update_weights(bad, version=1)
    if name in ("nan", "inf", "int32", "bool"):
        assert ".".join(map(str, leaf)) in str(info.value)
    assert engine.version == 0 and engine.params is weights[0]
    after = engine.generate(request, timeout=300)[0]
    assert after.output_ids == before.output_ids and after.output_versions == [0] * 10


def test_every_floating_dtype_may_hold_weights(weights):
    from rl_jax.generator.engine.weights import check_weights
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        check_weights(jax.tree.map(lambda a: a.astype(dtype), weights[1]), weights[0])
    with pytest.raises(WeightsRefused, match="complex64"):
        check_weights(jax.tree.map(lambda a: a.astype(jnp.complex64), weights[1]), weights[0])


def test_versions_may_not_go_back_unless_allowed(weights):
    engine = Engine(CFG, weights[0], version=5,
                    engine_config=EngineConfig(max_slots=4, max_seq_len=64))
    try:
        with pytest.raises(WeightsRefused, match="older than version 5"):
            engine.update_weights(weights[1], version=4)
        assert engine.version == 5
        engine.update_weights(weights[1], version=5)  # the same version again is no step back
        assert engine.wait_for_version(5) and engine.params is not None
        engine.update_weights(weights[0], version=3, allow_older=True)
        deadline = time.monotonic() + 60
        while engine.version != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.params is weights[0]
    finally:
        engine.shutdown()


def _nan_checkpoint(source, target):
    import shutil
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_the_server_refuses_corrupt_weights_and_says_why(ckpts, tmp_path, served):
    url = served.url
    version = http(url, "/get_weight_version")[1]["weight_version"]
    before = gen(url, [1, 8, 9], max_new_tokens=8, temperature=0)
    bad = _nan_checkpoint(ckpts["b"], tmp_path / "nan")
    status, data, _ = http(url, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and data["success"] is False and "non-finite" in data["message"], data
    assert data["weight_version"] == version
    status, data, _ = http(url, "/update_weights_from_disk", {"model_path": str(ckpts["b"]),
                                                              "weight_version": version - 1})
    assert status == 400 and "older than" in data["message"], data
    assert http(url, "/get_weight_version")[1]["weight_version"] == version
    after = gen(url, [1, 8, 9], max_new_tokens=8, temperature=0)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_weight_versions"] == [version] * 8
    # going back on purpose
    status, data, _ = http(url, "/update_weights_from_disk", {
        "model_path": str(ckpts["a"]), "weight_version": version - 1, "allow_older": True})
    assert status == 200 and data["weight_version"] == version - 1, data
    assert gen(url, [1, 8, 9], max_new_tokens=8, temperature=0)["output_ids"] == \
        before["output_ids"]


# ---- the weight publisher a server pulls from -------------------------------------------------

class FakePublisher(LoopbackPeer):
    """A loopback HTTP peer posing as a weight publisher: it records every request it gets
    (head and body) and answers each with ``answer`` (raw bytes), sent ``trickle`` bytes at a
    time every ``pause_s`` seconds when ``trickle`` is set."""

    def __init__(self, answer: bytes, trickle: int = 0, pause_s: float = 0.0):
        self.answer, self.trickle, self.pause_s = answer, trickle, pause_s
        self.requests: list[bytes] = []
        self.closed_at: list[float] = []  # when each connection was closed by the puller
        super().__init__()

    def serve(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            self.requests.append(data)
            try:
                if not self.trickle:
                    conn.sendall(self.answer)
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1)
                    return
                for i in range(0, len(self.answer), self.trickle):
                    if self._stop.wait(self.pause_s):
                        return
                    conn.sendall(self.answer[i:i + self.trickle])
            except OSError:  # the puller closed the connection
                self.closed_at.append(time.monotonic())

    @property
    def received(self) -> bytes:
        return b"".join(self.requests)


def json_answer(data, status: str = "200 OK") -> bytes:
    raw = json.dumps(data).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(raw)}\r\nConnection: close\r\n\r\n").encode() + raw


TRANSFER_TOKEN = "transfer-token-of-the-trainers-publisher-0123"
API_KEY, ADMIN_KEY = "hardening-api-key-0123456789", "hardening-admin-key-0123456789"


def test_the_transfer_token_goes_only_to_the_configured_publisher(ckpts, monkeypatch):
    """A keyed server's admin (or anyone, were the server unkeyed) naming another publisher
    is refused before any connection: the transfer token never reaches that address, and
    nothing of what it would answer comes back. The configured publisher does get it."""
    from rl_jax.generator.auth import Keys
    monkeypatch.setenv("RL_JAX_TRANSFER_TOKEN", TRANSFER_TOKEN)
    secret = "internal-service-answer-0123456789"
    mine = FakePublisher(json_answer({"version": 0, "error": "nothing yet"}, "503 Busy"))
    foreign = FakePublisher(json_answer({"transports": [secret], "host_id": secret}))
    running = start(ckpts["a"], keys=Keys(API_KEY, ADMIN_KEY), publisher_url=mine.url)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        for named in (foreign.url, foreign.url.removeprefix("http://"),
                      foreign.url.replace("127.0.0.1", "localhost")):
            status, data, _ = http(running.url, "/update_weights_from_transfer",
                                   {"publisher_url": named, "wait_s": 0}, headers=admin)
            assert status == 403, data
            assert "pulls only from its publisher" in data["error"]["message"], data
            assert mine.url in data["error"]["message"] and secret not in json.dumps(data)
        time.sleep(0.2)
        assert foreign.requests == []  # never contacted, so never sent the token
        status, data, _ = http(running.url, "/update_weights_from_transfer", {"wait_s": 0},
                               headers=admin)
        assert status == 400 and not data["success"], data
        assert f"Authorization: Bearer {TRANSFER_TOKEN}".encode() in mine.received
    finally:
        running.close()
        mine.close()
        foreign.close()


@pytest.mark.parametrize("answer,words", [
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 46\r\n\r\n"
     b"<html>internal-answer-secret-0123456789</html>", "200 with 46 bytes of 'text/html'"),
    (json_answer({"transports": 5, "host_id": "internal-answer-secret-0123456789"}),
     "not a publisher"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 209715200\r\n\r\n",
     "209715200 bytes of 'application/json'"),
])
def test_a_configured_publisher_answering_junk_is_a_400_that_echoes_nothing(ckpts, answer,
                                                                           words):
    """Whatever answers at the server's own publisher address: the update is refused with a
    400 saying what the answer was (status, size, content type), never its content, and the
    old weights keep serving."""
    junk = FakePublisher(answer)
    running = start(ckpts["a"], publisher_url=junk.url, pull_on_start=False)
    try:
        status, data, _ = http(running.url, "/update_weights_from_transfer", {"wait_s": 0})
        assert status == 400 and not data["success"], data
        assert words in data["message"], data
        assert "internal-answer-secret" not in json.dumps(data) and "<html>" not in data["message"]
        assert http(running.url, "/get_weight_version")[1]["weight_version"] == 0
    finally:
        running.close()
        junk.close()


def test_no_answer_ever_holds_a_nan(served, monkeypatch):
    """Were a temperature the sampler cannot divide by let through (the bound lifted here),
    its NaN log-probs would not be written as the non-JSON token ``NaN``: the answer is
    refused as a 500 saying why, plain or streamed. The bound itself sits just below where
    that starts."""
    from rl_jax.generator import types
    body = {"input_ids": [1, 5], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 2, "temperature": 1e38, "ignore_eos": True}}
    assert gen(served.url, [1, 5], max_new_tokens=2, temperature=types.MAX_TEMPERATURE)
    monkeypatch.setattr(types, "MAX_TEMPERATURE", 3.5e38)
    status, data, _ = http(served.url, "/generate", body, timeout=900)
    assert status == 500 and "non-finite" in data["error"]["message"], data
    status, text, _ = http(served.url, "/generate", {**body, "stream": True}, timeout=900)
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert status == 200 and events[-1] == "[DONE]", text
    for event in events[:-1]:  # strict JSON: NaN or Infinity would raise here
        parsed = json.loads(event, parse_constant=lambda c, e=event: pytest.fail(f"{c} in {e}"))
        assert "non-finite" in parsed["error"]["message"], parsed
    assert gen(served.url, [1, 2], max_new_tokens=3)["meta_info"]["completion_tokens"] == 3


def test_a_checkpoint_of_integers_is_refused_before_it_is_cast(ckpts, tmp_path, served):
    """An int8 tensor in a checkpoint (a quantised one without its scales, or a corrupted
    one) is refused by its stored dtype, before the load would cast it to floats."""
    import shutil
    bad = tmp_path / "int8"
    shutil.copytree(ckpts["b"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = min(tensors)
    tensors[name] = np.clip(tensors[name] * 100, -127, 127).astype(np.int8)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    version = http(served.url, "/get_weight_version")[1]["weight_version"]
    status, data, _ = http(served.url, "/update_weights_from_disk", {"model_path": str(bad)})
    assert status == 400 and data["success"] is False, data
    assert "floating point only" in data["message"] and f"{name}: I8" in data["message"], data
    assert http(served.url, "/get_weight_version")[1]["weight_version"] == version
