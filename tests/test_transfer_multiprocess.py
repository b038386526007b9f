"""The transfer service across real OS processes on loopback.

A trainer process with an 8-device CPU mesh (FSDP) publishes; generator processes with one
device and with two devices (tensor parallel: another layout) pull into a live engine. Weights
must arrive bit for bit over every transport, versions only move forward, a slow generator skips
to the newest, corrupted data is refused, and dead peers block nobody.
"""

import time

import pytest

from rl_jax.transfer.config import STAGING_PREFIX, default_staging_dir, remove_dead_owners_dirs
from transfer_procs import Worker

# Processes of a trainer and two generators, shared by the module's tests in order (each
# continues from the versions the one before published): all `slow`, so that `-m "not slow"`
# never keeps a later test without the earlier ones.
pytestmark = pytest.mark.slow

TRANSPORTS = ["shm", "socket", "jax_transfer", "disk"]
CHUNK = 256 << 10  # ~6 safetensors chunks per version: a pull can be cut between two


def trainer(transports, disk="-", name="trainer"):
    return Worker("trainer", 8, ",".join(transports), disk, CHUNK, name=name)


def generator(url, devices, timeout=60.0, connections=2, name="generator",
              transports=",".join(TRANSPORTS)):
    return Worker("generator", devices, devices, url, timeout, connections, transports,
                  name=name)


@pytest.fixture(scope="module", autouse=True)
def _remove_staging_of_killed_publishers():
    yield
    remove_dead_owners_dirs(default_staging_dir(), STAGING_PREFIX)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    t = trainer(TRANSPORTS, disk)
    workers = [t]
    try:
        url = t.reply()["url"]
        gens = {"g1": generator(url, 1, name="g1"), "g2": generator(url, 2, name="g2")}
        workers += list(gens.values())
        layouts = {name: g.reply()["layout"] for name, g in gens.items()}
        assert layouts["g1"] != layouts["g2"]
        assert t.ask(cmd="wait_layouts", n=2)["ok"]
        yield {"trainer": t, "url": url, **gens}
    finally:
        for w in workers:
            w.close()


def _publish(cluster, version, **kw):
    out = cluster["trainer"].ask(cmd="publish", version=version, **kw)
    assert "error" not in out, out
    assert not out["errors"], out
    assert out["trainer_specs"]["layers.wq"] == "P(None, 'fsdp', 'tensor', None)"  # fsdp=8
    return out["hashes"]


def test_every_transport_bit_exact_into_both_layouts(cluster):
    for version in (1, 2):
        expected = _publish(cluster, version)
        for g, devices in (("g1", [0]), ("g2", [0, 1])):
            for transport in TRANSPORTS:
                out = cluster[g].ask(cmd="pull", transport=transport,
                                     again=transport != TRANSPORTS[0])
                assert out.get("pulled") == version, (g, transport, out)
                assert out["hashes"] == expected, (g, transport)
                assert out["devices"] == devices
                assert out["metrics"]["transport"] == transport
                assert out["metrics"]["bytes"] > 1_000_000 and out["metrics"]["gbps"] > 0
            if g == "g2":  # tensor parallel layout of the generator, not the trainer's FSDP
                assert out["specs"]["layers.wq"] == "P(None, None, 'tensor', None)"
        # Nothing newer: no pull, version unchanged.
        for g in ("g1", "g2"):
            assert cluster[g].ask(cmd="pull") == {"version": version, "pulled": None}


def test_versions_only_move_forward_and_slow_generators_skip(cluster):
    cluster["trainer"].send(cmd="publish", version=2)
    assert "version 2 is not newer than the published 2" in cluster["trainer"].reply()["error"]
    for version in (3, 4, 5):
        expected = _publish(cluster, version)
    g1 = cluster["g1"].ask(cmd="pull", transport="shm")
    g2 = cluster["g2"].ask(cmd="pull", transport="jax_transfer")
    for out in (g1, g2):
        assert out["pulled"] == 5 and out["hashes"] == expected
        assert out["metrics"]["versions_skipped"] == 2
        assert out["metrics"]["previous_version"] == 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_data_is_refused_and_old_version_kept(cluster, transport):
    version = {"shm": 10, "socket": 20, "jax_transfer": 30, "disk": 40}[transport]
    good = _publish(cluster, version)
    for g in ("g1", "g2"):
        assert cluster[g].ask(cmd="pull", transport=transport)["pulled"] == version
    _publish(cluster, version + 1, corrupt="layers.wq")
    for g in ("g1", "g2"):
        out = cluster[g].ask(cmd="pull", transport=transport)
        assert out["version"] == version, out
        assert out["error"].startswith("IntegrityError") and "layers.wq" in out["error"]
        assert "checksum mismatch" in out["error"]
        assert cluster[g].ask(cmd="hashes")["hashes"] == good
    fixed = _publish(cluster, version + 2)
    for g in ("g1", "g2"):
        out = cluster[g].ask(cmd="pull", transport=transport)
        assert out["pulled"] == version + 2 and out["hashes"] == fixed


def test_generator_killed_mid_pull_blocks_nobody(cluster):
    version = 100
    _publish(cluster, version)
    # Two more generators with g1's layout die in the middle of their pulls.
    doomed = [generator(cluster["url"], 1, name=f"doomed-{t}")
              for t in ("socket", "jax_transfer", "shm")]
    try:
        for w, transport in zip(doomed, ("socket", "jax_transfer", "shm")):
            w.reply()
            w.send(cmd="pull", transport=transport, die_mid_pull=True)
        for w in doomed:
            assert w.wait_exit(60) == -9
    finally:
        for w in doomed:
            w.kill()
    start = time.monotonic()
    expected = _publish(cluster, version + 1)
    assert time.monotonic() - start < 30
    for g, transport in (("g1", "socket"), ("g1", "jax_transfer"), ("g2", "socket"),
                         ("g2", "jax_transfer")):
        out = cluster[g].ask(cmd="pull", transport=transport, again=transport != "socket")
        assert out["pulled"] == version + 1 and out["hashes"] == expected, (g, transport, out)


def test_publisher_killed_mid_publish_keeps_generators_on_old_version(tmp_path):
    trainer_k = trainer(["shm", "socket", "jax_transfer"], name="trainer-k")
    workers = [trainer_k]
    try:
        url = trainer_k.reply()["url"]
        gen = generator(url, 2, timeout=10.0, name="gen-k")
        workers.append(gen)
        gen.reply()
        v1 = trainer_k.ask(cmd="publish", version=1)["hashes"]
        assert gen.ask(cmd="pull", transport="socket")["hashes"] == v1
        # Dies after staging version 2, before announcing it.
        trainer_k.send(cmd="publish", version=2, die_before_announce=True)
        assert trainer_k.wait_exit(60) == -9
        out = gen.ask(cmd="pull", transport="socket", wait=1.0)
        assert out["version"] == 1 and out["error"].startswith("PublisherUnavailable"), out
        assert gen.ask(cmd="hashes")["hashes"] == v1
    finally:
        for w in workers:
            w.close()


def test_publisher_killed_while_streaming_a_version_keeps_generators_on_old_version():
    """shm-only layouts get a version announced before it is written; a generator streaming
    it sees the publisher's process gone and keeps its weights."""
    trainer_k = trainer(["shm"], name="trainer-k")
    workers = [trainer_k]
    try:
        url = trainer_k.reply()["url"]
        gen = generator(url, 1, timeout=30.0, name="gen-k", transports="shm")
        workers.append(gen)
        gen.reply()
        v1 = trainer_k.ask(cmd="publish", version=1)["hashes"]
        assert gen.ask(cmd="pull")["hashes"] == v1
        gen.send(cmd="pull", wait=30.0)  # waiting for version 2 when it is announced
        time.sleep(0.5)
        trainer_k.send(cmd="publish", version=2, die_after_announce=True)
        assert trainer_k.wait_exit(60) == -9
        start = time.monotonic()
        out = gen.reply(timeout=60)
        assert out["version"] == 1 and out["error"].startswith("PublisherUnavailable"), out
        assert "exited while writing version 2" in out["error"], out
        assert time.monotonic() - start < 20  # noticed, not left to the deadline
        assert gen.ask(cmd="hashes")["hashes"] == v1
    finally:
        for w in workers:
            w.close()


@pytest.mark.parametrize("transport", ["socket", "jax_transfer"])
def test_publisher_killed_mid_pull_keeps_generators_on_old_version(transport):
    """The generator stops mid-pull (socket: one chunk in, one connection, the rest not yet
    requested; jax_transfer: ticket issued, pull not started: ~1 MB moves in well under a
    millisecond, too fast to interrupt reliably), the publisher is killed, the pull resumes."""
    trainer_k = trainer(["shm", "socket", "jax_transfer"], name="trainer-k")
    workers = [trainer_k]
    try:
        url = trainer_k.reply()["url"]
        gen = generator(url, 1, timeout=8.0, connections=1, name="gen-k")
        workers.append(gen)
        gen.reply()
        v1 = trainer_k.ask(cmd="publish", version=1)["hashes"]
        assert gen.ask(cmd="pull", transport=transport)["hashes"] == v1
        trainer_k.ask(cmd="publish", version=2)
        gen.send(cmd="pull", transport=transport, block_mid_pull=True)
        assert gen.reply()["mid_pull"]
        trainer_k.kill()
        gen.send(cmd="go on")
        out = gen.reply(timeout=60)
        assert out["version"] == 1, out
        # The socket sees the connection refused; a jax pull sees its connection closed (or,
        # if it never notices, hits the puller's deadline).
        expected = {"socket": ("PublisherUnavailable",),
                    "jax_transfer": ("PublisherUnavailable", "TransferTimeout")}
        assert out["error"].startswith(expected[transport]), out
        assert gen.ask(cmd="hashes")["hashes"] == v1
    finally:
        for w in workers:
            w.close()
