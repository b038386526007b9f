"""The sidecar (rl_jax.transfer.sglang.sidecar) brings a real SGLang server (0.5.23, CPU engine)
to the versions a trainer-side Publisher publishes, through both hand-offs: new weights change
its greedy outputs and log-probs, the old ones restore them bit for bit, ``/model_info`` follows
the versions; through its command line and HTTP front, bad requests get 400/403, and a corrupted
or non-finite version is refused while the server keeps serving the version it had."""

import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from generator_fixtures import http, server_env, write_checkpoints
from rl_jax.generator.engine.weights import load_params
from rl_jax.transfer.config import PublisherConfig
from rl_jax.transfer.publisher.core import Publisher
from rl_jax.transfer.sglang.sidecar import SGLangSidecar
from sglang_fixtures import greedy, start_server

PROMPT = [1, 3, 4, 5, 6, 7]
NEW_TOKENS = 8

# Real SGLang takes ~30 s to start: outside the quick loop (-m "not slow").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def token(monkeypatch_module):
    """The publisher's token, in the environment the sidecar's process inherits."""
    monkeypatch_module.setenv("RL_JAX_TRANSFER_TOKEN", secrets.token_urlsafe(24))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def params(checkpoints):
    return {name: load_params(path, mesh=None, rules=None, dtype="float32")[1]
            for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    pool = start_server("sglang", checkpoints["a"], tmp_path_factory.mktemp("logs"))
    yield pool.urls[0]
    pool.stop()


@pytest.fixture(scope="module")
def publisher(token, tmp_path_factory):
    config = PublisherConfig(transports=("shm", "socket"),
                             staging_dir=str(tmp_path_factory.mktemp("staging")))
    with Publisher(config) as publisher:
        yield publisher


@pytest.fixture(scope="module")
def baseline(server):
    """Greedy ids and log-probs of checkpoint a, as the server serves it at start."""
    ids, logprobs, _ = greedy(server, PROMPT, NEW_TOKENS, http)
    return ids, logprobs


def served_version(server) -> str:
    status, info, _ = http(server, "/model_info")
    assert status == 200, info
    return info["weight_version"]


def publish(publisher, params, version):
    publisher.publish(jax.tree.map(jnp.asarray, params), version)


@pytest.mark.parametrize("handoff", ["disk", "tensor"])
def test_versions_reach_sglang(server, publisher, params, baseline, handoff, tmp_path):
    sidecar = SGLangSidecar(publisher.url, server, handoff=handoff, shm_dir=str(tmp_path))
    try:
        version = int(served_version(server))
        assert sidecar.update() is None  # registers its layout; nothing newer is published
        for _ in range(3):  # each of its two images written three times (see _to_tensor)
            version += 1
            publish(publisher, params["b"], version)
            update = sidecar.update(min_version=version, wait_s=30)
            assert update.version == version and update.metrics.bytes > 0
            assert served_version(server) == str(version)
            ids, logprobs, _ = greedy(server, PROMPT, NEW_TOKENS, http)
            assert ids != baseline[0] and not np.array_equal(logprobs, baseline[1])

            version += 1
            publish(publisher, params["a"], version)
            assert sidecar.update(min_version=version, wait_s=30).version == version
            assert served_version(server) == str(version)
            ids, logprobs, _ = greedy(server, PROMPT, NEW_TOKENS, http)
            assert ids == baseline[0]
            np.testing.assert_array_equal(logprobs, baseline[1])  # bit for bit
    finally:
        sidecar.close()
    assert not sidecar.root.exists()


@pytest.fixture
def front(server, publisher, tmp_path):
    """The sidecar as its command line runs it, on a free port, with an admin key."""
    (tmp_path / "admin").write_text("k3y\n")
    command = [sys.executable, "-m", "rl_jax.transfer.sglang.sidecar", f"--server_url={server}",
               f"--publisher_url={publisher.url}", "--port=0", f"--shm_dir={tmp_path}",
               f"--admin_api_key_file={tmp_path / 'admin'}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **dict(server_env())})
    try:
        line = process.stdout.readline()  # the ready line, or "" when it failed to start
        assert line.startswith("rl_jax sglang sidecar ready at "), (line, process.poll())
        yield line.split()[-1]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    assert not list(tmp_path.glob("rl_jax-sglang-sidecar-*"))  # it cleaned up


def update_through(front, body, key="k3y"):
    return http(front, "/update_weights_from_transfer", body,
                headers={"Authorization": f"Bearer {key}"})[:2]


def test_front_refuses_bad_versions_and_keeps_serving(front, server, publisher, params,
                                                      baseline):
    assert http(front, "/health")[0] == 200
    status, body = update_through(front, {"wait_s": 0}, key="wrong")
    assert status == 403, body
    for bad in ({"wait_s": -1}, {"weight_version": "x"}, {"transport": 3}, [1]):
        status, body = update_through(front, bad)
        assert status == 400 and "error" in body, (bad, body)
    status, body = update_through(front, {"publisher_url": "http://127.0.0.1:9"})
    assert status == 403, body

    status, body = update_through(front, {"wait_s": 0})  # registers; brings it to the newest
    assert status == 200 and body["success"], body
    good = int(served_version(server))
    publish(publisher, params["a"], good + 1)
    status, body = update_through(front, {"weight_version": good + 1, "wait_s": 30})
    assert status == 200 and body["weight_version"] == good + 1, body
    good += 1
    status, body = update_through(front, {"weight_version": good})
    assert status == 200 and body["message"].startswith("already"), body

    publisher.faults["corrupt"] = {"version": good + 1, "tensor": "layers.wq"}
    publish(publisher, params["b"], good + 1)
    status, body = update_through(front, {"weight_version": good + 1, "wait_s": 30})
    assert status == 400 and not body["success"] and body["weight_version"] == good, body
    assert "checksum" in body["message"] or "digest" in body["message"], body
    publisher.faults.clear()

    nan = jax.tree.map(np.array, params["b"])
    nan["layers"]["w_up"][0, 0, 0] = np.nan
    publish(publisher, nan, good + 2)
    status, body = update_through(front, {"weight_version": good + 2, "wait_s": 30})
    assert status == 400 and "non-finite" in body["message"], body

    assert served_version(server) == str(good)
    ids, logprobs, _ = greedy(server, PROMPT, NEW_TOKENS, http)
    assert ids == baseline[0]
    np.testing.assert_array_equal(logprobs, baseline[1])

    publish(publisher, params["b"], good + 3)  # a good version after the refusals goes through
    status, body = update_through(front, {"weight_version": good + 3, "wait_s": 30})
    assert status == 200 and body["weight_version"] == good + 3, body
    assert greedy(server, PROMPT, NEW_TOKENS, http)[0] != baseline[0]


def test_a_runs_sidecar_pool_restarts_a_dead_sidecar_on_its_port(server, publisher, params,
                                                                 checkpoints, tmp_path):
    """The run's sidecars (rl_jax.orchestrator.sidecars): started beside the server with its
    keys in private files, ready once they answer; one killed is restarted on the same port
    (the run's weight client keeps its URL) and takes the next version; stop removes its
    tmpfs images and key files."""
    from rl_jax.generator.auth import Keys
    from rl_jax.generator.client.core import ClientConfig, GeneratorClient
    from rl_jax.orchestrator.pool import BackgroundLoop
    from rl_jax.orchestrator.sidecars import SidecarPool
    from rl_jax.transfer.config import default_staging_dir

    def images():
        return set(Path(default_staging_dir()).glob("rl_jax-sglang-sidecar-*"))

    before = images()
    pool = SidecarPool([server], publisher_url=publisher.url, model_dir=checkpoints["a"],
                       keys=Keys(None, "adm1n"), log_dir=tmp_path)
    loop = BackgroundLoop("sidecar-test")
    try:
        pool.start()
        url = pool.urls[0]
        assert http(url, "/health")[0] == 200
        assert (pool._secrets / "admin_api_key_file").stat().st_mode & 0o777 == 0o600
        client = GeneratorClient([url], ClientConfig(), keys=Keys(None, "adm1n"))
        version = int(served_version(server)) + 1
        publish(publisher, params["b"], version)
        got = loop.run(client.update_weights_from_transfer(version, wait_s=30), timeout=120)
        assert got == {url: version} and served_version(server) == str(version)

        pool.kill(0)
        assert pool.restart_dead() == [0] and pool.restarts == [1]
        pool.wait_ready([0])
        assert pool.urls[0] == url and http(url, "/health")[0] == 200
        publish(publisher, params["a"], version + 1)
        got = loop.run(client.update_weights_from_transfer(version + 1, wait_s=30), timeout=120)
        assert got == {url: version + 1} and served_version(server) == str(version + 1)
        loop.run(client.close(), timeout=30)
    finally:
        secrets_dir = pool._secrets
        pool.stop()
        loop.close()
    assert all(p.poll() is not None for p in pool.processes)
    assert secrets_dir is not None and not secrets_dir.exists()
    assert images() <= before  # each sidecar removed its images (the killed one's stay: below)
    assert "Traceback" not in pool.tail(0, 200)
