"""The elastic generator fleet: servers join and leave a running job.

End to end (real processes on loopback, ``python -m launch.train`` as a user runs it): an async
run starts with one generator server; a second one, started beside it, joins through the
trainer's control endpoint at one step and the first leaves at a later one. Every prompt the
run admitted is trained once or still pending in its last checkpoint, staleness stays within
``max_lag``, the new server ran the run's newest weights before it took a request and served
requests, and the run finishes every step.

Unit level: the control route's hostile inputs, and the dedupe of a prompt's late completions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from generator_fixtures import http
from rl_jax.generator.launcher.pool import PoolConfig, ServerPool, free_port

ROOT = Path(__file__).resolve().parents[1]
API_KEY, ADMIN_KEY, TOKEN = "fleet-api-key-0123456789", "fleet-admin-key-0123456789", \
    "fleet-transfer-token-0123456789"
STEPS, MAX_LAG = 12, 2


def metrics(workdir: Path) -> dict[int, dict]:
    path = workdir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []
    return {r["step"]: r for r in rows if "loss/loss" in r}


def admin(url: str, path: str, body=None, *, method: str | None = None, key: str = ADMIN_KEY):
    return http(url, path, body, method=method, headers={"Authorization": f"Bearer {key}"})


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}:\n" + \
            process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def generate_count(url: str) -> int:
    status, info, _ = admin(url, "/get_server_info", key=API_KEY)
    assert status == 200, info
    return int(info["http_requests"].get("/generate", 0))


@pytest.mark.timeout(600)
def test_a_server_joins_and_the_first_leaves_mid_run(tmp_path):
    from rl_jax.generator.auth import Keys
    from rl_jax.models.shapes import shape, write_random_checkpoint

    base = tmp_path / "base"
    write_random_checkpoint(shape("tiny"), base, dtype="float32")
    port = free_port()
    control = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(RL_JAX_API_KEY=API_KEY, RL_JAX_ADMIN_API_KEY=ADMIN_KEY,
               RL_JAX_TRANSFER_TOKEN=TOKEN)
    # The server that joins: started by hand (as on another host) with the run's keys, the
    # same model and the trainer's publisher, beside the run's own start-up.
    joining = ServerPool(PoolConfig(
        model=str(base), ports=(0,), max_slots=16, max_seq_len=64, dtype="float32",
        publisher_url=control, keys=Keys(API_KEY, ADMIN_KEY), startup_timeout=240,
        env=(("RL_JAX_TRANSFER_TOKEN", TOKEN),), log_dir=str(tmp_path / "joining")))
    joining.start(wait=False)
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={workdir}", f"--config.base.checkpoint={base}",
           f"--config.trainer.steps={STEPS}", f"--config.rollout.max_lag={MAX_LAG}",
           "--config.rollout.groups_per_batch=8", "--config.rollout.group_size=4",
           "--config.generator.max_slots=16", "--config.generator.warmup_shapes=False",
           "--config.eval.examples=16", "--config.eval.every=0", "--config.trainer.ema_decay=0",
           "--config.trainer.time_limit_s=0", "--config.rollout.filter_zero_signal=False",
           "--config.checkpoint.every=100", "--config.checkpoint.use_async=False",
           "--config.cpus.trainer=", "--config.cpus.generators=", "--config.cpus.rollout=",
           "--config.logging.tensorboard=False", f"--config.transfer.port={port}",
           # a slower trainer: the membership changes happen while steps remain
           "--config.trainer.step_delay_s=0.4"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        joining.wait_healthy()
        new = joining.urls[0]
        wait_for(lambda: 2 in metrics(workdir), "step 2", process)
        status, listed, _ = admin(control, "/v1/generators")
        assert status == 200 and len(listed["members"]) == 1, listed
        first = listed["members"][0]
        assert generate_count(new) == 0  # not a member yet: no request reached it
        joined_after = max(metrics(workdir))
        status, join, _ = admin(control, "/v1/generators", {"url": new})
        assert status == 200, join
        assert join["members"] == [first, new]
        # It pulled the run's weights (at least the version of a step recorded before it was
        # added, never the base's 0) before the rollout could send it a request.
        assert join["weight_version"] >= max(joined_after - MAX_LAG, 1)
        assert join["weight_version"] >= join["pool_version"]
        wait_for(lambda: max(metrics(workdir)) >= joined_after + 3, "steps after the join",
                 process)
        assert generate_count(new) > 0
        left_after = max(metrics(workdir))
        status, leave, _ = admin(control, "/v1/generators", {"url": first}, method="DELETE")
        assert status == 200, leave
        assert leave["members"] == [new] and leave["reissued"] >= 0
        # Requests written to its socket before the leave may still be read (and counted) by
        # it just after: count from the first step completed after the leave.
        wait_for(lambda: max(metrics(workdir)) >= left_after + 1 or process.poll() is not None,
                 "a step after the leave", process)
        sent_to_first = generate_count(first)
        wait_for(lambda: max(metrics(workdir)) >= left_after + 4 or process.poll() is not None,
                 "steps after the leave", process)
        assert generate_count(first) == sent_to_first  # nothing more went to it
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
        joining.stop()
    assert process.returncode == 0, out[-3000:]

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert summary["staleness/max"] <= MAX_LAG
    assert summary.get("gate/late", 0) == 0
    fleet = summary["fleet"]
    assert fleet["members"] == [new]
    assert [(e["action"], e["url"]) for e in fleet["events"]] == [("join", new),
                                                                  ("leave", first)]
    assert fleet["served"][new] > 0 and fleet["served"][first] > 0
    # Groups in flight on the server that left were issued again, never trained twice.
    assert summary.get("rollout/reissued_server_left", 0) <= leave["reissued"]
    assert summary.get("rollout/skipped_prompts", 0) == 0
    assert summary.get("rollout/late_completions_dropped", 0) == 0
    steps = metrics(workdir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for r in steps.values():
        assert np.isfinite(r["loss/loss"]) and r["staleness/batch_max"] <= MAX_LAG
    trained = [p for r in steps.values() for p in r["rollout/prompts"]]
    assert len(trained) == len(set(trained)) == STEPS * 8
    meta = json.loads((workdir / "checkpoints" / str(STEPS) / "metadata" / "metadata")
                      .read_text())
    pending = meta["rollout"]["pending"]
    assert len(pending) == len(set(pending)) and not set(pending) & set(trained)
    # every admitted prompt is trained exactly once or still pending at the end
    assert set(trained) | set(pending) == set(range(meta["rollout"]["next_position"]))


@pytest.fixture()
def router(tmp_path):
    """A real ``sglang-router`` with no workers yet."""
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (the [test] "
                        "extra)")
    port = free_port()
    log_file = tmp_path / "router.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--policy", "round_robin", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            assert process.poll() is None, f"router exited:\n{log_file.read_text()[-3000:]}"
            try:
                if http(url, "/workers", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "router not up"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.timeout(600)
def test_workers_join_and_leave_through_a_real_router(tmp_path, router):
    """The pool is a real sglang-router: the run's own server is put into it; a worker an
    operator adds to the router joins the run (weights first); the first server leaves
    through the control endpoint and the router drops it; requests went through the router."""
    from rl_jax.generator.auth import Keys
    from rl_jax.models.shapes import shape, write_random_checkpoint

    base = tmp_path / "base"
    write_random_checkpoint(shape("tiny"), base, dtype="float32")
    port = free_port()
    control = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(RL_JAX_API_KEY=API_KEY, RL_JAX_ADMIN_API_KEY=ADMIN_KEY,
               RL_JAX_TRANSFER_TOKEN=TOKEN)
    joining = ServerPool(PoolConfig(
        model=str(base), ports=(0,), max_slots=16, max_seq_len=64, dtype="float32",
        publisher_url=control, keys=Keys(API_KEY, ADMIN_KEY), startup_timeout=240,
        env=(("RL_JAX_TRANSFER_TOKEN", TOKEN),), log_dir=str(tmp_path / "joining")))
    joining.start(wait=False)
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={workdir}", f"--config.base.checkpoint={base}",
           f"--config.trainer.steps={STEPS}", f"--config.rollout.max_lag={MAX_LAG}",
           "--config.rollout.groups_per_batch=8", "--config.rollout.group_size=4",
           "--config.generator.max_slots=16", "--config.generator.warmup_shapes=False",
           f"--config.generator.router_url={router}", "--config.generator.router_poll_s=0.2",
           "--config.eval.examples=16", "--config.eval.every=0", "--config.trainer.ema_decay=0",
           "--config.trainer.time_limit_s=0", "--config.rollout.filter_zero_signal=False",
           "--config.checkpoint.every=100", "--config.checkpoint.use_async=False",
           "--config.cpus.trainer=", "--config.cpus.generators=", "--config.cpus.rollout=",
           "--config.logging.tensorboard=False", f"--config.transfer.port={port}",
           "--config.trainer.step_delay_s=0.4"]
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def workers():
        return sorted(w["url"] for w in http(router, "/workers")[1]["workers"])

    def members():
        return admin(control, "/v1/generators")[1]["members"]

    try:
        joining.wait_healthy()
        new = joining.urls[0]
        wait_for(lambda: 2 in metrics(workdir), "step 2", process)
        first, = members()
        assert workers() == [first]  # the run's own server was put into the router
        joined_after = max(metrics(workdir))
        # An operator adds a worker to the router: it joins the run.
        status, data, _ = admin(router, "/workers", {"url": new, "api_key": API_KEY})
        assert status == 202, data
        wait_for(lambda: members() == [first, new], "the router's worker to join", process)
        assert sorted(workers()) == sorted([first, new])
        wait_for(lambda: max(metrics(workdir)) >= joined_after + 3, "steps after the join",
                 process)
        left_after = max(metrics(workdir))
        status, leave, _ = admin(control, "/v1/generators", {"url": first}, method="DELETE")
        assert status == 200 and leave["members"] == [new], leave
        assert workers() == [new]  # taken out of the router
        # Requests written to its socket before the leave may still be read (and counted) by
        # it just after: count from the first step completed after the leave.
        wait_for(lambda: max(metrics(workdir)) >= left_after + 1 or process.poll() is not None,
                 "a step after the leave", process)
        sent_to_first = generate_count(first)
        wait_for(lambda: max(metrics(workdir)) >= left_after + 4 or process.poll() is not None,
                 "steps after the leave", process)
        assert generate_count(first) == sent_to_first
        assert generate_count(new) > 0
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
        joining.stop()
    assert process.returncode == 0, out[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["staleness/max"] <= MAX_LAG
    fleet = summary["fleet"]
    assert fleet["router"] == router and fleet["members"] == [new]
    events = [(e["action"], e["url"], e["source"]) for e in fleet["events"]]
    assert events == [("join", new, "router"), ("leave", first, "control")]
    join = fleet["events"][0]
    assert join["weight_version"] >= max(joined_after - MAX_LAG, 1)
    steps = metrics(workdir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss/loss"]) for r in steps.values())
    trained = [p for r in steps.values() for p in r["rollout/prompts"]]
    assert len(trained) == len(set(trained)) == STEPS * 8


# ---- the control route's hostile inputs ---------------------------------------------------------

@pytest.fixture()
def fleet_server():
    """A publisher's control server with the fleet routes, over a pool of two members (two
    free ports nothing listens on: no case here reaches a member)."""
    from rl_jax.generator.auth import Keys
    from rl_jax.generator.client.core import GeneratorClient
    from rl_jax.orchestrator.fleet import Fleet
    from rl_jax.orchestrator.pool import BackgroundLoop
    from rl_jax.orchestrator.weights import WeightSync
    from rl_jax.transfer.config import PublisherConfig
    from rl_jax.transfer.publisher.core import Publisher

    members = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    publisher = Publisher(PublisherConfig(transports=("shm",), auth_token=TOKEN))
    loop = BackgroundLoop("fleet-test")
    keys = Keys(API_KEY, ADMIN_KEY)
    control, rollout = (GeneratorClient(members, keys=keys) for _ in range(2))
    weights = WeightSync(publisher, control, loop)
    fleet = Fleet(control, loop, rollout, weights)
    publisher.add_routes(fleet.routes(), token=ADMIN_KEY, max_body_bytes=4096)
    yield publisher.url, members, fleet
    weights.close()
    loop.run(control.close(), timeout=10)
    loop.run(rollout.close(), timeout=10)
    loop.close()
    publisher.close()


@pytest.mark.parametrize("method, body, status, message", [
    ("POST", {}, 400, "field 'url' is required"),
    ("POST", {"url": 5}, 400, "field 'url' must be a generator server URL"),
    ("POST", {"url": "localhost:30000"}, 400, "field 'url' must be a generator server URL"),
    ("POST", {"url": "ftp://h:1"}, 400, "field 'url'"),
    ("POST", {"url": "http://h"}, 400, "field 'url'"),
    ("POST", {"url": "http://h:99999"}, 400, "field 'url'"),
    ("POST", {"url": "http://u:p@h:1"}, 400, "field 'url'"),
    ("POST", {"url": "http://h:1/generate"}, 400, "field 'url'"),
    ("POST", {"url": "http://h:1?x=1"}, 400, "field 'url'"),
    ("POST", {"url": "http://h:1", "weight": 3}, 400, "unknown field 'weight'"),
    ("POST", {"url": "http://h:1", "timeout_s": -1}, 400, "field 'timeout_s'"),
    ("POST", {"url": "http://h:1", "timeout_s": True}, 400, "field 'timeout_s'"),
    ("POST", {"url": "http://h:1", "timeout_s": 1e9}, 400, "field 'timeout_s'"),
    ("POST", {"url": "http://" + "h" * 3000 + ":1"}, 400, "of at most 2048 characters"),
    ("POST", {"url": "http://" + "h" * 5000 + ":1"}, 413, "exceeds the limit"),
    ("DELETE", {}, 400, "field 'url' is required"),
    ("DELETE", {"url": ["http://h:1"]}, 400, "field 'url' must be a generator server URL"),
    ("DELETE", {"url": "http://h:1", "force": True}, 400, "unknown field 'force'"),
    ("DELETE", {"url": "http://127.0.0.1:1"}, 404, "is not in the pool"),
])
def test_control_route_refuses_hostile_inputs(fleet_server, method, body, status, message):
    url, members, fleet = fleet_server
    got, data, _ = admin(url, "/v1/generators", body, method=method)
    assert got == status and message in data["error"], data
    assert fleet.members == members  # nothing changed


def test_control_route_checks_keys_members_and_servers(fleet_server):
    url, members, fleet = fleet_server
    # The admin key, not the API key or the transfer token
    for key in (API_KEY, TOKEN, ""):
        got, data, _ = admin(url, "/v1/generators", {"url": "http://h:1"}, key=key)
        assert got == 401 and "admin key" in data["error"], data
    got, data, _ = http(url, "/v1/generators", raw=b"[1, 2", method="POST",
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert got == 400 and "not valid JSON" in data["error"]
    got, data, _ = admin(url, "/v1/generators?url=http://h:1&x=2", method="DELETE")
    assert got == 400 and "'x'" in data["error"], data
    got, data, _ = admin(url, "/v1/generators?url=http://h:1", {"url": "http://h:1"},
                         method="DELETE")
    assert got == 400 and "given twice" in data["error"], data
    # already a member; not reachable (nothing listens there)
    got, data, _ = admin(url, "/v1/generators", {"url": members[0] + "/"})
    assert got == 409 and "already in the pool" in data["error"], data
    got, data, _ = admin(url, "/v1/generators", {"url": f"http://127.0.0.1:{free_port()}"})
    assert got == 502 and "unreachable" in data["error"], data
    assert fleet.members == members
    # leaving works by body or query; the last member cannot leave
    got, data, _ = admin(url, f"/v1/generators?url={members[0]}", method="DELETE")
    assert got == 200 and data["members"] == members[1:], data
    got, data, _ = admin(url, "/v1/generators", {"url": members[1]}, method="DELETE")
    assert got == 409 and "last one" in data["error"], data
    got, data, _ = admin(url, "/v1/generators")
    assert got == 200 and data["members"] == members[1:]
    assert [e["action"] for e in data["events"]] == ["leave"]
    # the publisher's own routes still take the transfer token, and only it
    assert http(url, "/v1/info", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert http(url, "/v1/info", headers={"Authorization": f"Bearer {ADMIN_KEY}"})[0] == 401


def test_a_join_while_the_run_starts_is_told_to_try_again():
    """Before the run's servers have its weights the fleet routes answer 503 (try again) to the
    admin key, and 401 to any other; the real routes replace them."""
    from rl_jax.orchestrator.fleet import Fleet
    from rl_jax.transfer.config import PublisherConfig
    from rl_jax.transfer.publisher.core import Publisher

    publisher = Publisher(PublisherConfig(transports=("shm",), auth_token=TOKEN))
    try:
        publisher.add_routes(Fleet.starting_routes(), token=ADMIN_KEY, max_body_bytes=4096)
        for method in ("POST", "DELETE", "GET"):
            got, data, _ = admin(publisher.url, "/v1/generators",
                                 None if method == "GET" else {"url": "http://h:1"},
                                 method=method)
            assert got == 503 and "starting" in data["error"] and data["retry_after_s"] > 0
        got, data, _ = admin(publisher.url, "/v1/generators", {"url": "http://h:1"}, key=TOKEN)
        assert got == 401 and "admin key" in data["error"], data
        publisher.add_routes({("GET", "/v1/generators"): lambda query, body: {"members": []}},
                             token=ADMIN_KEY)
        assert admin(publisher.url, "/v1/generators")[:2] == (200, {"members": []})
    finally:
        publisher.close()


# ---- late completions ---------------------------------------------------------------------------

def test_late_completions_of_a_superseded_attempt_are_dropped():
    from rl_jax.rollout.attempts import Attempts
    attempts = Attempts()
    first = attempts.current(7)
    assert first == 0 and attempts.current(8) == 0
    # the server of attempt 0 left: the prompt is issued again as attempt 1
    assert attempts.supersede(7) == 1
    second = attempts.current(7)
    assert attempts.accept(7, second)  # the re-issued attempt's completions are trained
    assert not attempts.accept(7, first)  # ... the removed server's, arriving late, are not
    assert not attempts.accept(7, second)  # ... and no attempt is trained twice
    assert attempts.accept(8, 0) and not attempts.accept(8, 0)
    assert attempts.current(7) == 2  # request ids are never reused


# ---- a request on a server that leaves ----------------------------------------------------------

class _StalledServer:
    """A loopback HTTP server that answers /health but holds every /generate until released,
    and records the request ids it is told to abort (a server that hangs, or one taken out of
    the pool while it works)."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.release, self.aborted, self.generating = threading.Event(), [], threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, data):
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._answer({})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/abort_request":
                    outer.aborted.append(body["rid"])
                elif self.path == "/generate":
                    outer.generating.set()
                    outer.release.wait(30)
                self._answer({})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.mark.parametrize("how", ["removed", "marked down"])
def test_a_request_on_a_server_that_leaves_raises_server_left_at_once(how):
    """The client abandons a request whose server leaves the pool (removed from another
    thread, or marked down by a failed health check) instead of waiting for its answer, aborts
    it there, and raises ServerLeft: the rollout issues the prompt again elsewhere."""
    import asyncio

    from rl_jax.generator.client.control import ServerLeft
    from rl_jax.generator.client.core import ClientConfig, GeneratorClient
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.orchestrator.pool import BackgroundLoop

    stalled = _StalledServer()
    other = f"http://127.0.0.1:{free_port()}"  # the pool's other member (never reached)
    loop = BackgroundLoop("leave-test")
    client = GeneratorClient([stalled.url, other], ClientConfig(health_check_interval=3600))
    client.servers[1].healthy = False
    # No background health probe during the test: a probe of the stalled server that timed out
    # on a loaded machine would mark it down and abandon the request before it is removed.
    for server in client.servers:
        server.next_probe = time.monotonic() + 3600
    try:
        request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4), rid="prompt-5-0")
        future = loop.submit(client.generate(request))
        assert stalled.generating.wait(30)
        start = time.monotonic()
        if how == "removed":
            assert client.remove_server(stalled.url) == 1  # one request was in flight there
            assert [s.url for s in client.servers] == [other]
        else:
            server = client.servers[0]
            loop.run(asyncio.sleep(0))  # on the client's loop, as a failed probe does
            loop.loop.call_soon_threadsafe(client._mark_down, server, "health check failed")
        with pytest.raises(ServerLeft, match="left the pool while request prompt-5-0 ran"):
            future.result(timeout=20)
        assert time.monotonic() - start < 5  # not the request's timeout
        deadline = time.monotonic() + 10
        while stalled.aborted != ["prompt-5-0"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stalled.aborted == ["prompt-5-0"]
        assert client.stats["abandoned"] == 1
    finally:
        stalled.close()
        loop.run(client.close(), timeout=10)
        loop.close()
