"""The ``delta`` transport: versions rebuilt from the puller's last one and compressed XORs,
exactly; whole chunks when the publisher no longer holds the base; a corrupted base or delta
caught by the digests and the version fetched whole; hostile delta requests refused."""

import json
import urllib.error
import urllib.request

import jax
import ml_dtypes
import numpy as np
import pytest

from rl_jax.generator.engine.weights import generator_rules
from rl_jax.models.config import ModelConfig
from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import ModelSpec
from rl_jax.transfer.config import PublisherConfig, PullerConfig
from rl_jax.transfer.layout import flatten
from rl_jax.transfer.publisher.core import Publisher
from rl_jax.transfer.puller.core import Puller

CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.fixture
def setup(tmp_path):
    devices = jax.devices()
    trainer = ModelSpec(CONFIG, mesh=make_mesh(data=1, fsdp=4, tensor=1, devices=devices[:4]))
    single = ModelSpec(CONFIG, mesh=None, rules=generator_rules())
    pub = Publisher(PublisherConfig(transports=("delta",), staging_dir=str(tmp_path / "st"),
                                    chunk_bytes=16384), spec=trainer)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, ml_dtypes.bfloat16, sharding=s),
        single.abstract_params, single.param_shardings)
    puller = Puller(pub.url, target, transports=["delta"], config=PullerConfig(timeout_s=60))
    puller.register()
    yield pub, puller, trainer
    pub.close()


def versions(trainer, count, lr=1e-4, seed=0):
    """Float32 master weights moved by a small step each version, as an optimizer moves them:
    in bfloat16 most values stay bit-identical from one version to the next."""
    rng = np.random.default_rng(seed)
    master = {n: rng.standard_normal(a.shape).astype(np.float32) * 0.02
              for n, a in flatten(trainer.abstract_params).items()}
    shardings = flatten(trainer.param_shardings)
    out = []
    for _ in range(count):
        out.append({n: jax.device_put(v, shardings[n]) for n, v in master.items()})
        master = {n: v + lr * np.sign(rng.standard_normal(v.shape)).astype(np.float32)
                  for n, v in master.items()}
    return out


def publish(pub, flat, version):
    from rl_jax.transfer.layout import unflatten
    pub.publish(unflatten(flat), version)


def check(update, flat):
    got = flatten(update.params)
    for name, value in flat.items():
        want = np.asarray(value).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint16),
                                      want.view(np.uint16), err_msg=name)


def delta_of(puller):
    return puller._pulls["delta"]


def test_versions_rebuilt_from_deltas_are_exact_and_ship_a_fraction_of_the_bytes(setup):
    pub, puller, trainer = setup
    flats = versions(trainer, 4)
    sizes = []
    for v, flat in enumerate(flats, 1):
        publish(pub, flat, v)
        update = puller.pull(v - 1, wait_s=30)
        assert update.version == v
        check(update, flat)
        sizes.append(update.metrics.bytes)
    stats = delta_of(puller).stats
    assert stats["refetched_versions"] == 0 and stats["delta_chunks"] > 0
    full = sizes[0]  # the first version comes whole (no base)
    assert all(s < 0.5 * full for s in sizes[1:]), sizes


def test_a_base_the_publisher_no_longer_holds_comes_whole(setup):
    pub, puller, trainer = setup
    flats = versions(trainer, 5, seed=1)
    publish(pub, flats[0], 1)
    check(puller.pull(0, wait_s=30), flats[0])
    for v in (2, 3, 4):  # the slot that held version 1 is rewritten meanwhile
        publish(pub, flats[v - 1], v)
    before = dict(delta_of(puller).stats)
    update = puller.pull(1, wait_s=30)
    assert update.version == 4
    check(update, flats[3])
    stats = delta_of(puller).stats
    assert stats["whole_chunks"] > before["whole_chunks"]
    assert stats["delta_chunks"] == before["delta_chunks"]


def test_a_corrupted_base_is_caught_by_the_digests_and_the_version_comes_whole(setup):
    pub, puller, trainer = setup
    flats = versions(trainer, 2, seed=2)
    publish(pub, flats[0], 1)
    check(puller.pull(0, wait_s=30), flats[0])
    base = delta_of(puller)._base[0]
    base[base.size // 2] ^= 0x40  # a bit flipped in the bytes the next delta applies to
    publish(pub, flats[1], 2)
    update = puller.pull(1, wait_s=30)
    check(update, flats[1])
    assert delta_of(puller).stats["refetched_versions"] == 1


def _get(puller, pub, path, token=True):
    headers = puller.client.headers() if token else {}
    request = urllib.request.Request(pub.url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_hostile_delta_requests_are_refused_with_the_reason(setup):
    pub, puller, trainer = setup
    flats = versions(trainer, 2, seed=3)
    publish(pub, flats[0], 1)
    puller.pull(0, wait_s=30)
    publish(pub, flats[1], 2)
    status, manifest = puller.client.request("GET", "/v1/manifest",
                                             query={"layout": puller.layout_key, "after": 1})
    assert status == 200
    chunk = manifest["transports"]["staging"]["chunks"][0]
    q = f"/v1/delta?layout={puller.layout_key}&offset={chunk['offset']}&nbytes={chunk['nbytes']}"
    status, body = _get(puller, pub, q + "&version=2&base=1")
    assert status == 200 and len(body) < chunk["nbytes"]
    assert _get(puller, pub, q + "&version=2&base=1", token=False)[0] == 401
    status, body = _get(puller, pub, q + "&version=2&base=2")
    assert status == 400 and b"not older" in body
    status, body = _get(puller, pub, q + "&version=2&base=0")
    assert status == 410 and b"base version 0" in body
    status, body = _get(puller, pub, q + "&version=2&base=x1")
    assert status == 400
    status, body = _get(puller, pub, f"/v1/delta?layout={puller.layout_key}&version=2&base=1"
                             f"&offset=1&nbytes={chunk['nbytes']}")
    assert status == 400 and b"no chunk" in body
    assert json.loads(_get(puller, pub, q + "&version=9&base=1")[1])["error"]
