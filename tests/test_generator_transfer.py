"""A generator server process pulls new weights from a trainer-side publisher through
``/update_weights_from_transfer`` (verified, swapped in flight) and generates with them; it
pulls only from the publisher it was started with, and a publisher that stalls holds its
update lock no longer than the pull's deadline."""

import concurrent.futures
import os
import secrets
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from generator_fixtures import http, start_pool, write_checkpoints
from rl_jax.models.hf import load_pretrained
from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import ModelSpec
from rl_jax.transfer.config import PublisherConfig
from rl_jax.transfer.publisher.core import Publisher


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module", autouse=True)
def token():
    """The publishers' token, in the environment the servers inherit."""
    previous = os.environ.get("RL_JAX_TRANSFER_TOKEN")
    os.environ["RL_JAX_TRANSFER_TOKEN"] = value = secrets.token_urlsafe(24)
    yield value
    if previous is None:
        os.environ.pop("RL_JAX_TRANSFER_TOKEN")
    else:
        os.environ["RL_JAX_TRANSFER_TOKEN"] = previous


@pytest.fixture(scope="module")
def publisher(checkpoints, tmp_path_factory):
    import jax
    new_model = load_pretrained(checkpoints["b"])
    spec = ModelSpec(new_model.config, mesh=make_mesh(data=1, fsdp=4, tensor=2))
    publisher = Publisher(PublisherConfig(transports=("shm", "socket", "delta"),
                                          staging_dir=str(tmp_path_factory.mktemp("staging"))),
                          spec=spec)
    publisher.model = new_model
    publisher.params = jax.device_put(nnx.to_pure_dict(nnx.state(new_model, nnx.Param)),
                                      spec.param_shardings)  # the trainer's FSDP layout
    yield publisher
    publisher.close()


@pytest.fixture(scope="module")
def server(checkpoints, publisher, tmp_path_factory):
    pool = start_pool(checkpoints["a"], 1, tmp_path_factory.mktemp("logs"),
                      publisher_url=publisher.url)
    yield pool.urls[0]
    pool.stop()


class StalledPublisher:
    """A listening socket that accepts every connection and never answers (nor closes)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for conn in self.accepted:
            conn.close()


STALL_BOUND_S = 3.0  # the stalled server's pull deadline (RL_JAX_TRANSFER_TIMEOUT_S)


@pytest.fixture(scope="module")
def stalled_server(checkpoints, tmp_path_factory):
    stalled = StalledPublisher()
    os.environ["RL_JAX_TRANSFER_TIMEOUT_S"] = str(STALL_BOUND_S)  # copied by the pool
    try:
        pool = start_pool(checkpoints["a"], 1, tmp_path_factory.mktemp("stalled-logs"),
                          publisher_url=stalled.url)
    finally:
        os.environ.pop("RL_JAX_TRANSFER_TIMEOUT_S")
    yield pool.urls[0], stalled
    pool.stop()
    stalled.close()


def test_pull_from_publisher_swaps_verified_weights(server, publisher):
    new_model, params = publisher.model, publisher.params
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The server registers its layout and long-polls; the trainer then publishes.
        pending = pool.submit(http, server, "/update_weights_from_transfer",
                              {"publisher_url": publisher.url, "wait_s": 60})
        publisher.wait_for_layouts(1, timeout=60)
        publisher.publish(params, 7)
        status, body, _ = pending.result(timeout=120)
    assert status == 200 and body["success"], body
    assert body["weight_version"] == 7 and body["transfer"]["bytes"] > 0
    status, info, _ = http(server, "/get_weight_version")
    assert info["weight_version"] == 7

    prompt = [1, 3, 4, 5]
    status, out, _ = http(server, "/generate", {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3,
                            "ignore_eos": True}})
    assert status == 200, out
    ids = out["output_ids"]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert out["meta_info"]["output_token_weight_versions"] == [7] * len(ids)
    tokens = jnp.asarray([prompt + ids[:-1]])
    want, _ = new_model.token_logprobs(tokens, jnp.asarray([prompt[1:] + ids]))
    np.testing.assert_allclose(got, np.asarray(want[0, len(prompt) - 1:]), atol=1e-4)

    # Nothing newer: success, version unchanged (the publisher named without its scheme
    # is the same publisher).
    status, body, _ = http(server, "/update_weights_from_transfer",
                           {"publisher_url": publisher.url.split("//")[1]})
    assert status == 200 and body["weight_version"] == 7, body


def test_a_server_asked_for_the_delta_transport_pulls_changed_bytes(server, publisher):
    """``transport="delta"`` (the recipe's ``transfer.transport``): the server's puller
    registers with it; its first version comes whole, the next as compressed XORs of what
    changed (here one tensor of the model), rebuilt exactly."""
    import jax
    params = publisher.params
    bodies = []
    for version, scale in ((20, 0.0), (21, 1e-3)):
        flat = dict(params)
        flat["embed"] = jax.tree.map(lambda x: x + scale, params["embed"])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(http, server, "/update_weights_from_transfer",
                                  {"publisher_url": publisher.url, "wait_s": 60,
                                   "transport": "delta"})
            time.sleep(0.5)  # registered and waiting
            publisher.publish(flat, version)
            status, body, _ = pending.result(timeout=120)
        assert status == 200 and body["success"] and body["weight_version"] == version, body
        assert body["transfer"]["transport"] == "delta"
        bodies.append(body)
    assert bodies[1]["transfer"]["bytes"] < 0.5 * bodies[0]["transfer"]["bytes"], bodies
    status, body, _ = http(server, "/update_weights_from_transfer",
                           {"publisher_url": publisher.url, "transport": "pigeon"})
    assert status == 400 and "unknown transport 'pigeon'" in body["message"], body


def test_transfer_errors_keep_the_old_version(server, publisher):
    status, before, _ = http(server, "/get_weight_version")
    status, body, _ = http(server, "/update_weights_from_transfer", {"wait_s": -1,
                                                                     "publisher_url": "x"})
    assert status == 400 and "publisher_url" in body["error"]["message"]
    status, body, _ = http(server, "/update_weights_from_transfer", {"wait_s": -1})
    assert status == 400 and "wait_s" in body["error"]["message"]
    status, after, _ = http(server, "/get_weight_version")
    assert after["weight_version"] == before["weight_version"]
    assert http(server, "/health")[0] == 200


def test_a_pull_from_another_publisher_is_refused(server, publisher, tmp_path):
    other = Publisher(PublisherConfig(transports=("socket",), staging_dir=str(tmp_path)))
    try:
        other.publish(publisher.params, 100)
        status, before, _ = http(server, "/get_weight_version")
        for url in (other.url, "http://127.0.0.1:9", other.url.split("//")[1]):
            status, body, _ = http(server, "/update_weights_from_transfer",
                                   {"publisher_url": url, "wait_s": 0})
            assert status == 403, body
            assert "pulls only from its publisher" in body["error"]["message"]
            assert publisher.url in body["error"]["message"]
        assert other.layouts() == {}  # never contacted
        status, after, _ = http(server, "/get_weight_version")
        assert after["weight_version"] == before["weight_version"]
    finally:
        other.close()


def test_a_stalled_publisher_holds_the_update_lock_no_longer_than_the_deadline(
        stalled_server):
    url, stalled = stalled_server
    status, before, _ = http(url, "/get_weight_version")
    assert stalled.accepted  # the server tried to pull at start, and still started

    def update():
        start = time.monotonic()
        status, body, _ = http(url, "/update_weights_from_transfer", {"wait_s": 0},
                               timeout=60)
        return status, body, time.monotonic() - start

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(update) for _ in range(2)]
        # Meanwhile the server keeps generating with its old weights.
        status, out, _ = http(url, "/generate", {
            "input_ids": [1, 3, 4], "sampling_params": {"max_new_tokens": 4,
                                                        "ignore_eos": True}})
        assert status == 200 and out["meta_info"]["weight_version"] == before["weight_version"]
        results = [p.result(timeout=60) for p in pending]
    # Each pull is cut at the bound; the second one waited for the lock and got it back.
    for status, body, took in results:
        assert status == 400 and not body["success"], body
        assert "did not" in body["message"] and "deadline" in body["message"] \
            or "did not finish within" in body["message"], body
        assert took <= 2 * STALL_BOUND_S + 4.0, took
    assert time.monotonic() - start <= 2 * STALL_BOUND_S + 4.0
    assert min(took for *_, took in results) >= STALL_BOUND_S - 0.5
    status, after, _ = http(url, "/get_weight_version")
    assert after["weight_version"] == before["weight_version"]
    assert http(url, "/health")[0] == 200
