"""A generator server process pulls new weights from a trainer-side publisher through
``/update_weights_from_transfer`` (verified, swapped in flight) and generates with them."""

import concurrent.futures

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from generator_fixtures import http, start_pool, write_checkpoints
from rl_jax.models import load_pretrained
from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import ModelSpec
from rl_jax.transfer import Publisher, PublisherConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    pool = start_pool(checkpoints["a"], 1, tmp_path_factory.mktemp("logs"))
    yield pool.urls[0]
    pool.stop()


def test_pull_from_publisher_swaps_verified_weights(server, checkpoints, tmp_path):
    new_model = load_pretrained(checkpoints["b"])
    spec = ModelSpec(new_model.config, mesh=make_mesh(data=1, fsdp=4, tensor=2))
    import jax
    params = jax.device_put(nnx.to_pure_dict(nnx.state(new_model, nnx.Param)),
                            spec.param_shardings)  # the trainer's FSDP layout
    publisher = Publisher(PublisherConfig(transports=("shm", "socket"),
                                          staging_dir=str(tmp_path / "staging")), spec=spec)
    try:
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

        # Nothing newer: success, version unchanged.
        status, body, _ = http(server, "/update_weights_from_transfer",
                               {"publisher_url": publisher.url})
        assert status == 200 and body["weight_version"] == 7
    finally:
        publisher.close()


def test_transfer_errors_keep_the_old_version(server):
    status, before, _ = http(server, "/get_weight_version")
    status, body, _ = http(server, "/update_weights_from_transfer",
                           {"publisher_url": "http://127.0.0.1:9", "wait_s": 0})
    assert status == 400 and not body["success"] and body["message"]
    status, body, _ = http(server, "/update_weights_from_transfer", {"wait_s": -1,
                                                                     "publisher_url": "x"})
    assert status == 400 and "wait_s" in body["error"]["message"]
    status, after, _ = http(server, "/get_weight_version")
    assert after["weight_version"] == before["weight_version"]
    assert http(server, "/health")[0] == 200
