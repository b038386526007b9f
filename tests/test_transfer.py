"""The transfer service in one process (8 host devices): layouts, chunks, checksums, manifests
and verification, and publisher → puller round trips over each transport, including casts,
superseded versions, refused layouts and deadlines. The cross-process behaviour is in
``test_transfer_multiprocess.py``."""

import dataclasses
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import xxhash
from safetensors.numpy import load as load_safetensors

from rl_jax import native as native_build
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.weights import generator_rules
from rl_jax.models.config import ModelConfig
from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import ModelSpec
from rl_jax.transfer import checksum, finite
from rl_jax.transfer.chunks import Entry, parse_chunk, plan_chunks
from rl_jax.transfer.config import (STAGING_PREFIX, PublisherConfig, PullerConfig,
                                    remove_dead_owners_dirs)
from rl_jax.transfer.errors import (IntegrityError, LayoutError, NonFiniteWeights, TransferTimeout,
                                    TransportUnavailable)
from rl_jax.transfer.layout import Layout, flatten, shard_indices
from rl_jax.transfer.manifest import Manifest, ShardInfo, TensorInfo, verify
from rl_jax.transfer.publisher.core import Publisher
from rl_jax.transfer.puller.core import Puller
from rl_jax.transfer.puller.generator import GeneratorPuller
from rl_jax.transfer.pulling import run_with_deadline

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8)


def random_params(spec, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype),
                                                     s),
                        spec.abstract_params, spec.param_shardings)


def target_of(spec, dtype=None):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=s),
                        spec.abstract_params, spec.param_shardings)


@pytest.fixture(scope="module")
def specs():
    devices = jax.devices()
    trainer = ModelSpec(CONFIG, mesh=make_mesh(data=1, fsdp=4, tensor=1, devices=devices[:4]))
    tp2 = ModelSpec(CONFIG, mesh=make_mesh(data=1, fsdp=1, tensor=2, devices=devices[4:6]),
                    rules=generator_rules())
    single = ModelSpec(CONFIG, mesh=None, rules=generator_rules())
    return {"trainer": trainer, "tp2": tp2, "single": single}


@pytest.fixture
def publisher(tmp_path, specs):
    pub = Publisher(PublisherConfig(transports=("shm", "socket", "jax_transfer", "disk"),
                                    disk_dir=str(tmp_path / "disk"),
                                    staging_dir=str(tmp_path / "staging"), chunk_bytes=4096),
                    spec=specs["trainer"])
    yield pub
    pub.close()


def host(params):
    return {n: np.asarray(jax.device_get(v)) for n, v in flatten(params).items()}


# ---- layouts, chunks, checksums ----------------------------------------------------------------

def test_layout_indices_match_jax_shardings(specs):
    for name in ("trainer", "tp2", "single"):
        target = target_of(specs[name])
        layout = Layout.from_arrays(target)
        assert Layout.from_json(layout.to_json()) == layout
        for tensor, aval in flatten(target).items():
            assert layout.indices(tensor, aval.shape) == shard_indices(aval.sharding, aval.shape)
    keys = {Layout.from_arrays(target_of(specs[n])).key for n in specs}
    assert len(keys) == 3
    bf16 = Layout.from_arrays(target_of(specs["tp2"], jnp.bfloat16))
    assert bf16.key != Layout.from_arrays(target_of(specs["tp2"])).key


def test_layout_refuses_mixed_meshes(specs):
    shardings = {"a": specs["tp2"].param_shardings["embed"],
                 "b": specs["trainer"].param_shardings["embed"]}
    with pytest.raises(LayoutError, match="one mesh"):
        Layout.from_shardings(shardings)


def test_chunks_are_valid_aligned_safetensors():
    rng = np.random.default_rng(0)
    arrays = {"a#0": rng.standard_normal((3, 5)).astype(np.float32),
              "b#0": rng.integers(0, 9, (7,)).astype(np.int32),
              "c#1": rng.standard_normal((4, 4)).astype(np.float16)}
    entries = [Entry(n, a.dtype, a.shape) for n, a in arrays.items()]
    plans = plan_chunks(entries, chunk_bytes=130, metadata={"version": "3"})
    assert len(plans) == 2
    size = max(p.offset + p.nbytes for p in plans)
    buf = np.zeros(size, np.uint8)
    for p in plans:
        buf[p.offset:p.offset + len(p.header)] = np.frombuffer(p.header, np.uint8)
        for name, offset in p.entries.items():
            assert offset % 64 == 0
            raw = arrays[name].reshape(-1).view(np.uint8)
            buf[offset:offset + raw.size] = raw
        blob = buf[p.offset:p.offset + p.nbytes].tobytes()
        loaded = load_safetensors(blob)  # the reference reader accepts every chunk
        entries_, meta = parse_chunk(buf[p.offset:p.offset + p.nbytes])
        assert meta == {"version": "3"}
        for name in p.entries:
            np.testing.assert_array_equal(loaded[name], arrays[name])
            dtype, shape, start, stop = entries_[name]
            assert (dtype, shape) == (arrays[name].dtype, arrays[name].shape)
    with pytest.raises(IntegrityError, match="too short|claims|do not fit"):
        parse_chunk(buf[plans[0].offset:plans[0].offset + plans[0].nbytes - 8])


def test_checksums_catch_single_bit_flips_and_misplaced_shards():
    x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    d = checksum.digest(x, "xxh3_64")
    # The GIL-free path computes exactly the xxhash package's XXH3-64 of the C-order bytes.
    assert d == xxhash.xxh3_64(x.tobytes()).hexdigest()
    assert checksum.digest(x.T, "xxh3_64") == xxhash.xxh3_64(
        np.ascontiguousarray(x.T).tobytes()).hexdigest()
    for algorithm in checksum.ALGORITHMS:
        d = checksum.digest(x, algorithm)
        for threads in (0, 2):
            digests = checksum.Digests(algorithm, threads=threads)
            digests.add("x", x)
            digests.add("x.T", x.T)
            assert digests.result() == {"x": d, "x.T": checksum.digest(x.T, algorithm)}
        flipped = x.copy()
        flipped.reshape(-1).view(np.uint8)[1234] ^= 0x10
        assert checksum.digest(flipped, algorithm) != d
        a, b = ((0, 32), (0, 33)), ((32, 64), (0, 33))
        da, db = checksum.digest(x[:32], algorithm), checksum.digest(x[32:], algorithm)
        assert (checksum.combine([(a, da), (b, db)], algorithm)
                == checksum.combine([(b, db), (a, da)], algorithm))
        assert (checksum.combine([(a, db), (b, da)], algorithm)
                != checksum.combine([(a, da), (b, db)], algorithm))
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        checksum.digest(x, "md5")


def test_block_checksum_is_the_digest_of_its_blocks_digests_whatever_the_threads():
    """``xxh3_64_blocks``: XXH3-64 of every 1 MiB block, then of those digests; the same on
    any number of threads, and a flipped bit in any block (first, middle, short last) shows."""
    assert checksum.DEFAULT_ALGORITHM == "xxh3_64_blocks"
    x = np.random.default_rng(1).standard_normal(
        (5 * checksum.BLOCK_BYTES + 4096) // 4).astype(np.float32).reshape(-1, 8)
    raw = x.tobytes()
    blocks = [xxhash.xxh3_64_intdigest(raw[i:i + checksum.BLOCK_BYTES])
              for i in range(0, len(raw), checksum.BLOCK_BYTES)]
    assert len(blocks) == 6
    want = xxhash.xxh3_64(np.array(blocks, "<u8").tobytes()).hexdigest()
    assert checksum.digest(x) == want
    big = np.tile(x, (3, 1))  # 16 blocks+: several tasks of UNIT_BLOCKS
    for threads in (0, 1, 2):
        digests = checksum.Digests(threads=threads)
        digests.add("x", x)
        digests.add("big", big)
        digests.add("empty", np.zeros((0, 4), np.float32))
        assert digests.result() == {"x": want, "big": checksum.digest(big),
                                    "empty": checksum.digest(np.zeros(0, np.uint8))}
    for pos in (0, 3 * checksum.BLOCK_BYTES + 17, len(raw) - 1):
        flipped = x.copy()
        flipped.reshape(-1).view(np.uint8)[pos] ^= 0x01
        assert checksum.digest(flipped) != want


def _manifest_for(arrays):
    tensors = []
    for name, value in sorted(arrays.items()):
        full = tuple((0, d) for d in value.shape)
        digest = checksum.digest(np.asarray(value))
        tensors.append(TensorInfo(name, tuple(value.shape), np.dtype(value.dtype).name,
                                  checksum.combine([(full, digest)]),
                                  (ShardInfo(full, digest, value.nbytes),)))
    return Manifest.from_json(Manifest(7, "k", checksum.DEFAULT_ALGORITHM, "h", tuple(tensors),
                                       {}).to_json())


def test_verify_refuses_every_kind_of_mismatch():
    arrays = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(4, jnp.int32)}
    manifest = _manifest_for(arrays)
    verify(manifest, arrays)
    cases = [({"w": arrays["w"]}, r"missing tensor\(s\) \['b'\]"),
             ({**arrays, "x": arrays["b"]}, r"unexpected tensor\(s\) \['x'\]"),
             ({**arrays, "w": arrays["w"].reshape(4, 3)}, r"w: shape \(4, 3\) != manifest"),
             ({**arrays, "w": arrays["w"].astype(jnp.bfloat16)}, "w: dtype bfloat16 != manifest"),
             ({**arrays, "w": arrays["w"].at[1, 2].add(1)}, "w: checksum mismatch in 1 shard")]
    for bad, message in cases:
        with pytest.raises(IntegrityError, match=message) as e:
            verify(manifest, bad)
        assert "version 7" in str(e.value) and "refused" in str(e.value)


# ---- publisher → puller in one process ---------------------------------------------------------

@pytest.mark.parametrize("transport", ["shm", "socket", "jax_transfer", "disk"])
def test_round_trip_into_tensor_parallel_layout(publisher, specs, transport):
    puller = Puller(publisher.url, target_of(specs["tp2"]), transports=[transport])
    puller.register()
    assert puller.pull(-1) is None  # nothing published yet
    for version in (1, 2):
        params = random_params(specs["trainer"], version)
        stats = publisher.publish(params, version)
        assert stats.version == version and not stats.errors
        update = puller.pull(version - 1)
        assert update.version == version and update.metrics.transport == transport
        got, want = host(update.params), host(params)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        for name, value in flatten(update.params).items():
            assert value.sharding == flatten(specs["tp2"].param_shardings)[name]
        assert update.metrics.bytes >= update.manifest.nbytes > 0
    assert puller.pull(2) is None


def test_cast_to_the_generator_dtype(publisher, specs):
    puller = Puller(publisher.url, target_of(specs["single"], jnp.bfloat16),
                    transports=["socket", "jax_transfer"])
    puller.register()
    params = random_params(specs["trainer"], 5)
    publisher.publish(params, 5)
    want = {n: v.astype(ml_dtypes.bfloat16) for n, v in host(params).items()}
    for transport in ("socket", "jax_transfer"):
        update = puller.pull(4, transport=transport)
        got = host(update.params)
        for n in want:
            assert got[n].dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got[n].view(np.uint16), want[n].view(np.uint16))


def test_superseded_while_pulling_restarts_on_the_newest(publisher, specs):
    puller = Puller(publisher.url, target_of(specs["single"]), transports=["shm"])
    puller.register()
    publisher.publish(random_params(specs["trainer"], 1), 1)
    newest = random_params(specs["trainer"], 3)

    def publish_twice():  # rewrites the slot being read: version 1's stamp changes
        puller.hooks.pop("mid_pull")
        publisher.publish(random_params(specs["trainer"], 2), 2)
        publisher.publish(newest, 3)

    puller.hooks["mid_pull"] = publish_twice
    update = puller.pull(0)
    assert update.version == 3 and update.metrics.attempts == 2
    assert update.metrics.versions_skipped == 2
    got, want = host(update.params), host(newest)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_shm_weights_alias_a_slot_nobody_rewrites_while_they_live(publisher, specs):
    """shm pulls are zero-copy: the arrays alias the publisher's staging slot, which stays
    locked (and intact) while they live, however many versions follow; then it is reused."""
    import gc
    puller = Puller(publisher.url, target_of(specs["single"]), transports=["shm"])
    puller.register()
    first = random_params(specs["trainer"], 1)
    publisher.publish(first, 1)
    held = puller.pull(0)
    slot = held.manifest.transports["shm"]["file"]
    array = flatten(held.params)["layers.wq"]
    with open(slot, "rb") as f:  # the array's bytes are the slot's bytes
        f.seek(held.manifest.tensors[[t.name for t in held.manifest.tensors].index(
            "layers.wq")].shards[0].offset)
        assert f.read(64) == np.asarray(array).tobytes()[:64]
    files = set()
    for version in (2, 3, 4):
        publisher.publish(random_params(specs["trainer"], version), version)
        update = puller.pull(version - 1)
        files.add(update.manifest.transports["shm"]["file"])
        del update
        gc.collect()
    assert slot not in files  # never rewritten while held...
    got, want = host(held.params), host(first)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    del held, array, got
    gc.collect()
    reused = set()
    for version in (5, 6):
        publisher.publish(random_params(specs["trainer"], version), version)
        reused.add(puller.poll(version - 1).transports["shm"]["file"])
    assert slot in reused  # ...and reused once released
    assert len(list(Path(slot).parent.glob("slot*.safetensors"))) == 3


def test_unproducible_layout_is_refused_with_a_clear_error(publisher, specs):
    bad = dict(target_of(specs["single"]))
    bad["extra"] = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=bad["embed"].sharding)
    broken = Puller(publisher.url, bad, transports=["socket"])
    good = Puller(publisher.url, target_of(specs["single"]), transports=["socket"])
    broken.register()
    good.register()
    stats = publisher.publish(random_params(specs["trainer"], 1), 1)
    assert broken.layout_key in stats.errors
    with pytest.raises(LayoutError, match=r"unknown \['extra'\]"):
        broken.pull(0)
    assert good.pull(0).version == 1


def test_transport_address_count_mismatch_is_refused_not_aborted(publisher, specs):
    puller = Puller(publisher.url, target_of(specs["single"]),
                    config=PullerConfig(num_transport_addresses=2), transports=["jax_transfer"])
    puller.register()
    publisher.publish(random_params(specs["trainer"], 1), 1)
    with pytest.raises(TransportUnavailable, match="transport addresses"):
        puller.pull(0)


def test_versions_must_increase(publisher, specs):
    params = random_params(specs["trainer"], 1)
    publisher.publish(params, 4)
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(params, 4)


def test_deadline_abandons_a_hung_pull():
    release = threading.Event()
    abandoned = []
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="within 0.2 s"):
        run_with_deadline(release.wait, 0.2, "hung pull", on_abandon=lambda: abandoned.append(1))
    assert time.monotonic() - start < 2 and abandoned == [1]
    release.set()
    assert run_with_deadline(lambda: 5, 1.0, "quick") == 5


def test_generator_puller_feeds_a_live_engine(publisher, specs):
    spec = specs["tp2"]
    engine = Engine(CONFIG, random_params(spec, 0), version=0, mesh=spec.mesh,
                    rules=generator_rules())
    try:
        gp = GeneratorPuller(publisher.url, transports=["jax_transfer"])
        gp.puller(engine.params).register()
        assert gp.pull_latest(engine) is None
        params = random_params(specs["trainer"], 1)
        publisher.publish(params, 1)
        update = gp.pull_latest(engine)
        assert engine.version == 0  # pulling changes nothing by itself
        engine.update_weights(update.params, update.version)
        assert engine.wait_for_version(1, 30)
        gp.start(engine, wait_s=5.0)
        publisher.publish(random_params(specs["trainer"], 2), 2)
        newest = random_params(specs["trainer"], 3)
        publisher.publish(newest, 3)
        assert engine.wait_for_version(3, 30)
        gp.stop()
        got, want = host(engine.params), host(newest)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        assert gp.stats()["updates"] >= 2 and gp.stats()["failures"] == 0
    finally:
        engine.shutdown()


def _poisoned(params, name: str, position: int, value: float):
    """``params`` with ``value`` at flat ``position`` (negative: from the end) of tensor
    ``name`` (a dotted path), the other tensors as they are."""
    def poison(path, a):
        if jax.tree_util.keystr(path, simple=True, separator=".") != name:
            return a
        bad = np.asarray(jax.device_get(a)).copy()
        bad.reshape(-1)[position] = value
        return jax.device_put(bad, a.sharding)
    return jax.tree_util.tree_map_with_path(poison, params)


@pytest.mark.parametrize("transport", ["shm", "socket", "disk"])
def test_non_finite_versions_are_refused_by_the_puller_on_every_host_transport(
        publisher, specs, transport):
    """A NaN or an infinity anywhere (first or last value of a tensor, one shard of several)
    makes the pull fail with NonFiniteWeights naming the tensor; a later finite version comes
    through and says it was checked, so that the engine skips its own pass."""
    puller = Puller(publisher.url, target_of(specs["tp2"]), transports=[transport])
    puller.register()
    clean = random_params(specs["trainer"], 1)
    names = sorted(host(clean))
    cases = [(names[0], 0, np.nan), (names[-1], -1, -np.inf), (names[len(names) // 2], 5,
                                                                  np.inf)]
    version = 0
    for name, position, value in cases:
        version += 1
        publisher.publish(_poisoned(clean, name, position, value), version)
        with pytest.raises(NonFiniteWeights, match=name.replace(".", r"\.")) as info:
            puller.pull(version - 1)
        assert f"version {version}" in str(info.value)
    publisher.publish(clean, version + 1)
    update = puller.pull(version)
    assert update.version == version + 1 and update.finite_checked
    got, want = host(update.params), host(clean)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_device_to_device_pulls_leave_the_finiteness_check_to_the_engine(publisher, specs):
    puller = Puller(publisher.url, target_of(specs["tp2"]), transports=["jax_transfer"])
    puller.register()
    clean = random_params(specs["trainer"], 1)
    name = sorted(host(clean))[0]
    publisher.publish(_poisoned(clean, name, 0, np.nan), 1)
    update = puller.pull(0)
    assert not update.finite_checked
    engine = Engine(CONFIG, random_params(specs["tp2"], 0), version=0, mesh=specs["tp2"].mesh,
                    rules=generator_rules())
    try:
        with pytest.raises(ValueError, match="non-finite"):
            engine.update_weights(update.params, update.version,
                                  finite_checked=update.finite_checked)
        assert engine.version == 0
    finally:
        engine.shutdown()


def test_a_generator_puller_skips_a_poisoned_version_and_the_engine_keeps_serving(
        publisher, specs, monkeypatch):
    """The background loop of a live engine: a non-finite version is refused by the puller
    (the engine keeps its weights), the next finite one is applied without the engine's own
    device-side pass (the puller checked it)."""
    import rl_jax.generator.engine.weights as weights_module
    spec = specs["single"]
    engine = Engine(CONFIG, random_params(spec, 0), version=0, rules=generator_rules())
    passes = []
    device_check = weights_module._finite_leaves
    monkeypatch.setattr(weights_module, "_finite_leaves",
                        lambda leaves: (passes.append(1), device_check(leaves))[1])
    try:
        gp = GeneratorPuller(publisher.url, transports=["shm"])
        gp.puller(engine.params).register()
        clean = random_params(specs["trainer"], 2)
        publisher.publish(_poisoned(clean, sorted(host(clean))[-1], -1, np.nan), 1)
        with pytest.raises(NonFiniteWeights):
            gp.pull_latest(engine)
        assert engine.version == 0 and gp.stats()["failures"] == 1
        gp.start(engine, wait_s=5.0)
        publisher.publish(clean, 2)
        assert engine.wait_for_version(2, 30)
        gp.stop()
        got, want = host(engine.params), host(clean)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        assert passes == []
    finally:
        engine.shutdown()


def test_the_publisher_finds_non_finite_values_while_staging_and_pullers_trust_it(
        publisher, specs, monkeypatch):
    """Staging copies find the NaN (stats, manifest); shm and socket pullers refuse the version
    from the manifest without reading the values again; with the publisher's check off they
    read them themselves and refuse it all the same."""
    pullers = {t: Puller(publisher.url, target_of(specs["tp2"]), transports=[t])
               for t in ("shm", "socket")}
    for p in pullers.values():
        p.register()
    clean = random_params(specs["trainer"], 1)
    name = sorted(host(clean))[1]
    stats = publisher.publish(_poisoned(clean, name, 7, np.nan), 1)
    assert stats.nonfinite == (name,)
    manifest = pullers["shm"].poll(0)
    assert {t.name: t.finite for t in manifest.tensors} == {
        n: n != name for n in host(clean)}
    reads = []
    real = finite.all_finite
    monkeypatch.setattr(finite, "all_finite",
                        lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    for p in pullers.values():
        with pytest.raises(NonFiniteWeights, match=name):
            p.pull(0)
    assert reads == []  # the publisher's finding was enough
    monkeypatch.setattr(publisher, "config", dataclasses.replace(publisher.config,
                                                                 check_finite=False))
    stats = publisher.publish(_poisoned(clean, name, -1, np.inf), 2)
    assert stats.nonfinite == ()
    assert all(t.finite is None for t in pullers["shm"].poll(1).tensors)
    for p in pullers.values():
        with pytest.raises(NonFiniteWeights, match=name):
            p.pull(1)
    assert reads  # read by the puller this time


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_copies_that_check_finiteness_copy_exactly_and_find_every_non_finite_value(dtype):
    """``copy_finite`` over the layouts staging copies: whole arrays, column blocks (strided
    rows), blocks of a stacked weight, void pieces; the copy is bit-exact and the answer is
    numpy's, with the value anywhere (first, last, inside a row's tail)."""
    dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    rng = np.random.default_rng(0)
    full = rng.standard_normal((3, 40, 96)).astype(dtype)
    cases = {"whole": (slice(None),) * 3, "columns": (slice(None), slice(None), slice(32, 64)),
             "rows": (slice(1, 2), slice(8, 40), slice(None)),
             "odd columns": (slice(None), slice(3, 5), slice(5, 37))}
    for label, box in cases.items():
        for where in (None, "first", "last", "middle"):
            src = full.copy()
            view = src[box]
            if where is not None:
                position = {"first": (0, 0, 0), "last": tuple(n - 1 for n in view.shape),
                            "middle": tuple(n // 2 for n in view.shape)}[where]
                view[position] = [np.nan, np.inf, -np.inf][hash(where) % 3]
            dst = np.zeros(view.shape, dtype)
            ok = finite.copy_finite(dst, view)
            assert ok == (where is None), (label, where)
            assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(view).view(np.uint8))
            assert finite.all_finite(view) == (where is None)
    piece = np.dtype((np.void, 32 * dtype.itemsize))  # staging's column blocks as void pieces
    src = full.copy()
    src[2, 39, 63] = np.nan
    dst = np.zeros((3, 40, 32), dtype)
    assert not finite.copy_finite(dst.view(piece), src.view(piece)[:, :, 1:2], dtype)
    assert np.array_equal(dst.view(np.uint8), np.ascontiguousarray(src[:, :, 32:64])
                          .view(np.uint8))


def test_copies_that_cast_check_what_the_destination_holds():
    src = np.array([1.0, 70000.0, -3.0], np.float32)  # finite, beyond float16's range
    dst = np.zeros(3, np.float16)
    assert not finite.copy_finite(dst, src) and np.isinf(dst[1])
    assert finite.copy_finite(np.zeros(3, ml_dtypes.bfloat16), src)
    assert finite.copy_finite(np.zeros(3, np.int32), src)  # not floating: nothing to check


# Only a machine without a C compiler skips the kernel's cases; where one exists, a kernel that
# fails to build makes them fail.
NO_C_COMPILER = pytest.mark.skipif(native_build.compiler("c") is None,
                                   reason="no C compiler for the finiteness kernel")


@pytest.mark.parametrize("native", [pytest.param(True, marks=NO_C_COMPILER), False])
def test_the_bfloat16_cast_is_ml_dtypes_bit_for_bit(native, monkeypatch):
    """float32 -> bfloat16 (the generator's dtype) in the C kernel: round to nearest even,
    NaNs to the signed quiet NaN, overflow to infinity (counted as non-finite), over random
    bit patterns and the edges, contiguous and as column blocks; the same without it."""
    if not native:
        monkeypatch.setitem(finite._state, "library", None)
    rng = np.random.default_rng(0)
    edges = np.array([0x7f7fffff, 0x7f7f8000, 0x7f7f7fff, 0xff7f8000, 0x7f800000, 0xff800000,
                      0x7fc00000, 0x7f800001, 0xffc12345, 0, 0x80000000, 1, 0x8000, 0x18000,
                      0x3f808000, 0x3f818000], np.uint32)
    bits = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
                           edges])
    x = bits.view(np.float32)
    with np.errstate(all="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    got = np.zeros(x.shape, ml_dtypes.bfloat16)
    assert not finite.copy_finite(got, x)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    normal = rng.standard_normal((300, 64)).astype(np.float32)
    block = np.zeros((300, 32), ml_dtypes.bfloat16)
    assert finite.copy_finite(block, normal[:, 16:48])
    np.testing.assert_array_equal(block.view(np.uint16),
                                  normal[:, 16:48].astype(ml_dtypes.bfloat16).view(np.uint16))
    normal[299, 47] = 3.3961776e38  # finite in float32, infinite once rounded to bfloat16
    assert not finite.copy_finite(block, normal[:, 16:48])
    copy = finite.raw_copier(ml_dtypes.bfloat16, np.float32)
    assert (copy is None) == (not native)
    if copy is not None:
        out = np.zeros(1000, ml_dtypes.bfloat16)
        assert copy(out.ctypes.data, x.ctypes.data, 1000) == bool(np.isfinite(want[:1000]).all())
        np.testing.assert_array_equal(out.view(np.uint16), want[:1000].view(np.uint16))


@NO_C_COMPILER
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_streaming_copies_are_exact_and_find_non_finite_values_anywhere(dtype):
    """``finite.stream_copier`` (non-temporal stores where the CPU has them, the plain loop
    elsewhere): bit-exact at every destination offset within a cache line and at lengths around
    the vector loop's 128-byte steps, a non-finite value found in the unaligned head, the
    vector body and the tail, nothing written beyond the run."""
    dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    copy = finite.stream_copier(dtype)
    assert copy is not None
    width = dtype.itemsize
    rng = np.random.default_rng(1)
    values = rng.standard_normal(4096).astype(dtype)
    for offset in range(0, 64, width):  # the destination's misalignment, in bytes
        for count in (0, 1, 63 // width, 128 // width, 128 // width + 1, 1000, 4000):
            for where in (None, 0, count // 2, count - 1):
                if where is not None and not 0 <= where < count:
                    continue
                src = values[:count].copy()
                if where is not None:
                    src[where] = [np.nan, np.inf, -np.inf][where % 3]
                buffer = np.full(count * width + 192, 0xA5, np.uint8)
                start = (-buffer.ctypes.data) % 64 + offset
                dst = buffer[start:start + count * width].view(dtype)
                assert copy(dst.ctypes.data, src.ctypes.data, count) == (where is None), \
                    (offset, count, where)
                assert np.array_equal(dst.view(np.uint8), src.view(np.uint8))
                assert (buffer[:start] == 0xA5).all()
                assert (buffer[start + count * width:] == 0xA5).all()


@NO_C_COMPILER
def test_finiteness_without_the_native_kernel_gives_the_same_answers(monkeypatch):
    """Where the C kernel cannot be built (no compiler, RL_JAX_NATIVE_FINITE=0) numpy copies
    and checks, with the same results."""
    native = finite._library()
    assert native is not None, "the C kernel should build on this machine (cc is installed)"
    monkeypatch.setitem(finite._state, "library", None)
    rng = np.random.default_rng(1)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        src = rng.standard_normal((64, 48)).astype(dtype)
        for bad in (None, np.nan, -np.inf):
            if bad is not None:
                src[63, 40] = bad
            dst = np.zeros((64, 16), dtype)
            assert finite.copy_finite(dst, src[:, 32:]) == (bad is None)
            assert np.array_equal(dst, src[:, 32:], equal_nan=True)
            assert finite.all_finite(src[:, ::3]) == (bad is None or 40 % 3 != 0)


def test_without_a_c_compiler_finiteness_falls_back_to_numpy(tmp_path):
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import logging, sys
        import numpy as np
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from rl_jax.transfer import finite
        a = np.ones(1000, np.float32)
        a[999] = np.nan
        print("answers", finite.copy_finite(np.empty_like(a), a), finite._library())
    """)
    env = {"PATH": str(tmp_path), "CC": "", "RL_JAX_KERNEL_CACHE": str(tmp_path / "cache"),
           "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "answers False None" in result.stdout
    assert "no C compiler found" in result.stdout


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_host_finiteness_matches_numpy_on_every_16_bit_pattern(dtype):
    patterns = np.arange(1 << 16, dtype=np.uint16)
    values = patterns.view(np.dtype(getattr(ml_dtypes, dtype, dtype)))
    expected = np.isfinite(values.astype(np.float32))
    assert 0 < expected.sum() < len(values)
    for bits, ok in zip(patterns[::97], expected[::97]):  # single values
        assert finite.all_finite(np.array([bits], np.uint16).view(values.dtype)) == ok
    finite_values = values[expected]
    assert finite.all_finite(finite_values)
    for bad in values[~expected][::13]:  # one non-finite value among every finite one
        mixed = finite_values.copy()
        mixed[len(mixed) // 3] = bad
        assert not finite.all_finite(mixed)
        assert not finite.raw_finite(mixed.view(np.uint8), values.dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_host_finiteness_of_wide_floats_at_the_edges(dtype):
    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    edges = np.array([0.0, -0.0, info.max, -info.max, info.tiny, -info.smallest_subnormal,
                      1.0, -1.0], dtype)
    assert finite.all_finite(edges)
    unsigned = np.dtype(f"uint{8 * dtype.itemsize}")
    exponent = int(np.array(np.inf, dtype).view(unsigned))
    sign = 1 << (8 * dtype.itemsize - 1)
    for bits in (exponent, exponent + 1, sign | exponent, sign | (exponent + 12345),
                 sign - 1, 2 * sign - 1):  # +-inf, NaNs, the largest patterns of each sign
        mixed = edges.copy()
        mixed.view(unsigned)[3] = bits
        assert finite.all_finite(mixed) == bool(np.isfinite(mixed).all()), hex(bits)
    assert finite.all_finite(np.arange(6, dtype=np.int32))  # not floating: nothing to check
    strided = np.zeros((4, 4), dtype)[:, ::2]
    strided[1, 1] = np.nan
    assert not finite.all_finite(strided)


def test_stale_staging_of_dead_publishers_is_removed(tmp_path):
    dead = tmp_path / "rl_jax-transfer-999999999-abcd"
    alive = tmp_path / f"rl_jax-transfer-{os.getpid()}-abcd"
    other = tmp_path / "something-else"
    for d in (dead, alive, other):
        d.mkdir()
    remove_dead_owners_dirs(tmp_path, STAGING_PREFIX)
    assert not dead.exists() and alive.exists() and other.exists()


def test_an_owner_that_exited_unreaped_is_dead(tmp_path):
    """A killed owner that nobody reaped yet (a zombie: ``kill(pid, 0)`` still succeeds, as for
    a sidecar whose wrapper was killed with it) leaves its directory to be removed."""
    import subprocess
    import sys

    from rl_jax.procs import process_alive
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(child.pid, 0)  # still there to signal: exited, not reaped
        assert not process_alive(child.pid) and process_alive(os.getpid())
        owned = tmp_path / f"{STAGING_PREFIX}{child.pid}-abcd"
        owned.mkdir()
        remove_dead_owners_dirs(tmp_path, STAGING_PREFIX)
        assert not owned.exists()
    finally:
        child.wait()
    assert not process_alive(child.pid)


def test_host_buffers_in_use_by_live_arrays_are_never_reused():
    from rl_jax.transfer.transports.sockets import HostBufferPool
    pool = HostBufferPool(max_buffers=2)
    first = pool.get(1 << 16)
    live = jax.device_put(first[:4096].view(np.float32), jax.devices()[0])
    assert np.asarray(live).ctypes.data == first.ctypes.data  # aliased, not copied
    del first
    second = pool.get(1 << 16)
    assert np.asarray(live).ctypes.data != second.ctypes.data
    del second
    third = pool.get(1 << 16)  # the second buffer is free again: reused
    assert np.asarray(live).ctypes.data != third.ctypes.data
    del live, third
    assert len(pool._bases) == 2


def test_crc32_fallback_when_xxhash_is_missing(monkeypatch, tmp_path, specs):
    monkeypatch.setattr(checksum, "DEFAULT_ALGORITHM", "crc32")
    with Publisher(PublisherConfig(transports=("shm", "socket"),
                                   staging_dir=str(tmp_path))) as pub:
        puller = Puller(pub.url, target_of(specs["tp2"]), transports=["shm", "socket"])
        puller.register()
        params = random_params(specs["trainer"], 1)
        pub.publish(params, 1)
        for transport in ("shm", "socket"):
            update = puller.pull(0, transport=transport)
            assert update.manifest.algorithm == "crc32"
            got, want = host(update.params), host(params)
            assert all(np.array_equal(got[n], want[n]) for n in want)


def test_staging_and_verifying_on_worker_threads_gives_the_same_bytes(tmp_path, specs):
    with Publisher(PublisherConfig(transports=("shm",), staging_dir=str(tmp_path),
                                   staging_threads=2)) as pub:
        puller = Puller(pub.url, target_of(specs["tp2"]), transports=["shm"],
                        config=PullerConfig(digest_threads=2))
        puller.register()
        params = random_params(specs["trainer"], 1)
        pub.publish(params, 1)
        update = puller.pull(0)
        got, want = host(update.params), host(params)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        pub.faults["corrupt"] = {"version": 2, "tensor": "layers.wq"}
        pub.publish(random_params(specs["trainer"], 2), 2)
        with pytest.raises(IntegrityError, match="layers.wq"):
            puller.pull(1)


@pytest.mark.parametrize("threads", [0, 2])
def test_staging_copies_and_hashes_block_by_block_across_layouts(tmp_path, threads):
    """Multi-block shards staged from 8 FSDP shards into other layouts: row cuts (contiguous
    runs, copied and hashed block by block, also split across threads), column cuts (strided
    sources, assembled in slabs of rows, as column blocks or, with a cast or narrow blocks,
    element by element) and casts; the slot holds exactly the target shards and every digest
    equals the digest of those bytes."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rl_jax.transfer.publisher.shard_geometry import host_shards, plan_job
    from rl_jax.transfer.publisher.staging import HostStaging
    devices = np.array(jax.devices()[:8])
    src_mesh = jax.sharding.Mesh(devices.reshape(8, 1), ("fsdp", "tp"))
    rng = np.random.default_rng(3)
    values = {"rows": rng.standard_normal((1024, 1030)).astype(np.float32),  # 4 MiB, 8 row cuts
              "cols": rng.standard_normal((512, 1024)).astype(np.float32),
              "vec": rng.standard_normal(3 * checksum.BLOCK_BYTES // 4 + 5).astype(np.float32),
              "odd": rng.standard_normal((8, 3, 5)).astype(np.float32),
              "stacked": rng.standard_normal((4, 2048, 128)).astype(np.float32),
              "cast_cols": rng.standard_normal((256, 512)).astype(np.float32),
              "narrow": rng.standard_normal((64, 64)).astype(np.float32)}
    src_specs = {"rows": P("fsdp", None), "cols": P(None, "fsdp"), "vec": P(), "odd": P("fsdp"),
                 "stacked": P(None, "fsdp", None), "cast_cols": P(None, "fsdp"),
                 "narrow": P(None, "fsdp")}
    flat = {n: jax.device_put(v, NamedSharding(src_mesh, src_specs[n])) for n, v in values.items()}
    layout = Layout(("data", "tensor"), (1, 2),
                    {"rows": P("tensor", None), "cols": P("tensor", None), "vec": P(),
                     "odd": P(None, None, None), "stacked": P(None, None, "tensor"),
                     "cast_cols": P(), "narrow": P()},
                    dtypes={"rows": "float32", "cols": "float32", "vec": "bfloat16",
                            "odd": "float32", "stacked": "float32", "cast_cols": "bfloat16",
                            "narrow": "float32"})
    staging = HostStaging(tmp_path / "slots")
    infos, description, slot = staging.stage(5, flat, layout, 1 << 20, "xxh3_64_blocks",
                                             threads)
    slot_bytes = np.fromfile(description["file"], np.uint8)
    for info in infos:
        want_full = values[info.name].astype(ml_dtypes.bfloat16
                                             if info.name in ("vec", "cast_cols") else np.float32)
        assert info.dtype == want_full.dtype.name
        for shard in info.shards:
            want = np.ascontiguousarray(want_full[tuple(slice(a, b) for a, b in shard.index)])
            got = slot_bytes[shard.offset:shard.offset + shard.nbytes]
            assert np.array_equal(got, want.reshape(-1).view(np.uint8)), info.name
            assert shard.checksum == checksum.digest(want), info.name
    assert {len(i.shards) for i in infos if i.name in ("rows", "cols")} == {2}
    staging.close()
    # Which path each took: rows as one run per overlapping source, stacked (cut along its
    # middle axis) as one run per layer and source, cols (512-byte pieces) in one strided copy.
    dst = np.empty((512, 1030), np.float32)
    assert len(plan_job(dst, ((0, 512), (0, 1030)), host_shards(flat["rows"])).runs) == 4
    dst = np.empty((4, 2048, 128), np.float32)
    assert len(plan_job(dst, ((0, 4), (0, 2048), (0, 128)),
                        host_shards(flat["stacked"])).runs) == 32
    cols = plan_job(np.empty((256, 1024), np.float32), ((0, 256), (0, 1024)),
                    host_shards(flat["cols"]))
    assert cols.runs is None
    # Its 512-byte column blocks are copied as one void element per row (the last box field);
    # a cast, or blocks under 64 bytes, keep the element-wise strided copy.
    assert {box[-1].itemsize for box in cols.boxes} == {512}
    cast = plan_job(np.empty((256, 512), ml_dtypes.bfloat16), ((0, 256), (0, 512)),
                    host_shards(flat["cast_cols"]))
    narrow = plan_job(np.empty((64, 64), np.float32), ((0, 64), (0, 64)),
                      host_shards(flat["narrow"]))
    assert {box[-1] for box in cast.boxes + narrow.boxes} == {None}


def test_staging_plans_once_per_layout_and_rewrites_only_the_version(tmp_path):
    """A layout's chunk headers, shard places and copy geometry are planned once: later versions
    (in any slot) rewrite only the header's version digits and the shards' bytes, and a slot
    that held another layout gets that layout's headers back."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rl_jax.transfer.chunks import parse_chunk
    from rl_jax.transfer.publisher.staging import HostStaging, header_version
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4), ("fsdp",))
    rng = np.random.default_rng(7)

    def model(shapes, seed):
        values = {n: np.random.default_rng(seed + k).standard_normal(s).astype(np.float32)
                  for k, (n, s) in enumerate(sorted(shapes.items()))}
        specs = {n: P(None, "fsdp") if v.ndim == 2 else P() for n, v in values.items()}
        return values, {n: jax.device_put(v, NamedSharding(mesh, specs[n]))
                        for n, v in values.items()}

    small = {"a": (64, 256), "b": (300,)}
    large = {"a": (512, 1024), "b": (300,), "c": (8, 4096)}
    layouts = {id(small): Layout((), (), {n: P() for n in small}),
               id(large): Layout((), (), {n: P() for n in large})}
    staging = HostStaging(tmp_path / "slots")
    for version, shapes in enumerate([small, small, large, small, large, small, small], 1):
        values, flat = model(shapes, int(rng.integers(1 << 30)))
        infos, description, slot = staging.stage(version, flat, layouts[id(shapes)], 1 << 16,
                                                 "xxh3_64_blocks", 2)
        staging.commit(slot)
        data = np.fromfile(description["file"], np.uint8)
        for chunk in description["chunks"]:
            _, meta = parse_chunk(data[chunk["offset"]:chunk["offset"] + chunk["nbytes"]])
            assert meta["version"] == header_version(version)
        for info in infos:
            (shard,) = info.shards
            got = data[shard.offset:shard.offset + shard.nbytes]
            assert np.array_equal(got, values[info.name].reshape(-1).view(np.uint8))
            assert shard.checksum == checksum.digest(values[info.name])
    assert len(description["chunks"]) > 1
    assert len(staging._plans) == 2  # one per layout, reused by every later version and slot
    staging.close()


# ---- streamed versions (shm): verified while they are written -----------------------------------

# Shards of several 1 MiB checksum blocks, FSDP-cut on their last axis (strided copies) and on
# their first (contiguous runs).
STREAM_CONFIG = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture
def streaming(tmp_path):
    devices = jax.devices()
    trainer = ModelSpec(STREAM_CONFIG, mesh=make_mesh(data=1, fsdp=4, tensor=1,
                                                      devices=devices[:4]))
    single = ModelSpec(STREAM_CONFIG, mesh=None, rules=generator_rules())
    pub = Publisher(PublisherConfig(transports=("shm",), staging_dir=str(tmp_path / "staging"),
                                    staging_threads=2))
    puller = Puller(pub.url, target_of(single), transports=["shm"],
                    config=PullerConfig(timeout_s=30))
    puller.register()
    yield pub, puller, trainer
    pub.close()


def _pull_in_background(puller, after):
    box = {}

    def run():
        try:
            box["update"] = puller.pull(after, wait_s=30)
        except Exception as e:  # re-raised by the test
            box["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_streamed_version_is_verified_while_written_and_arrives_bit_exact(streaming):
    """A puller already waiting gets the version announced before it is staged, verifies each
    checksum block as the publisher marks it written, and ends with the very bytes and
    checksums of a pull made after the publish."""
    pub, puller, trainer = streaming
    started = threading.Event()
    events = []
    puller.hooks["stream_start"] = lambda: (events.append("verify"), started.set())
    lay_out = puller.arrays_from_chunks

    def arrays_from_chunks(*args, **kw):
        events.append("arrays")
        return lay_out(*args, **kw)

    puller.arrays_from_chunks = arrays_from_chunks
    seen = []

    def after_announce(version):  # its checksums are not in the manifest yet
        seen.append(puller.poll(version - 1).tensors[0].checksum)
        assert started.wait(10), "the puller did not start on the announced version"

    pub.hooks["after_announce"] = after_announce
    for version in (1, 2, 3):
        started.clear()
        params = random_params(trainer, version)
        thread, box = _pull_in_background(puller, version - 1)
        time.sleep(0.05)
        pub.publish(params, version)
        thread.join(30)
        update = box["update"]
        assert update.version == version and update.metrics.attempts == 1
        got, want = host(update.params), host(params)
        assert all(np.array_equal(got[n], want[n]) for n in want)
        final = puller.poll(version - 1)  # the manifest once staged: checksums in it
        assert "progress" not in final.transports["shm"]
        assert [t.checksum for t in update.manifest.tensors] == \
            [t.checksum for t in final.tensors]
        del update, box
    assert seen == ["pending"] * 3
    # Each version's arrays were laid out once, before its bytes were written: they alias the
    # slot (the bit-exact check above would fail on arrays copied before the publisher wrote).
    assert events == ["arrays", "verify"] * 3


def test_long_polls_wait_without_spinning_and_a_publish_lets_them_through(streaming):
    """Pullers long-polling for a version sleep until it is announced (several at once do not
    wake each other up), and all get the version once it is."""
    pub, puller, trainer = streaming
    boxes = [_pull_in_background(puller, 0) for _ in range(3)]
    time.sleep(0.2)
    puller.register()  # wakes the long polls, which find nothing newer and wait again
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.2  # three idle long polls for a second
    assert pub._polling[puller.layout_key] == 3
    params = random_params(trainer, 1)
    pub.publish(params, 1)
    for thread, box in boxes:
        thread.join(30)
        assert box["update"].version == 1
    del boxes


def test_pull_reports_reach_the_publisher_in_order_through_one_sender(streaming):
    """Every pull posts its report (version, transport, bytes, seconds) to the publisher; the
    reports of successive pulls arrive in order, sent by one thread rather than one each."""
    pub, puller, trainer = streaming
    senders = lambda: {t for t in threading.enumerate() if t.name == "transfer-report"}  # noqa: E731
    before = senders()
    for version in (1, 2, 3, 4):
        pub.publish(random_params(trainer, version), version)
        update = puller.pull(version - 1, wait_s=10)
        assert update.version == version
        del update
    deadline = time.monotonic() + 10
    while len(pub.reports) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    reports = list(pub.reports)
    assert [r["version"] for r in reports] == [1, 2, 3, 4]
    assert all(r["ok"] and r["transport"] == "shm" and r["bytes"] > 0 and r["seconds"] > 0
               and r["puller_id"] == puller.puller_id for r in reports)
    assert len(senders() - before) <= 1  # other tests' pullers may still have theirs


def test_streamed_block_corrupted_after_hashing_is_refused(streaming):
    pub, puller, trainer = streaming
    pub.publish(random_params(trainer, 1), 1)
    first = puller.pull(0)
    started = threading.Event()
    puller.hooks["stream_start"] = started.set
    pub.hooks["after_announce"] = lambda v: started.wait(10)
    pub.faults["corrupt"] = {"version": 2, "tensor": "embed"}
    thread, box = _pull_in_background(puller, 1)
    time.sleep(0.05)
    pub.publish(random_params(trainer, 2), 2)
    thread.join(30)
    assert started.is_set()
    error = box.get("error")
    assert isinstance(error, IntegrityError), box
    assert "version 2" in str(error) and "embed" in str(error)
    got, want = host(first.params), host(random_params(trainer, 1))  # the old weights intact
    assert all(np.array_equal(got[n], want[n]) for n in want)
    pub.faults.clear()
    pub.publish(random_params(trainer, 3), 3)
    assert puller.pull(2).version == 3


def test_streamed_version_with_a_non_finite_value_is_refused_block_by_block(streaming):
    """Each checksum block of a streamed version is checked for non-finite values right after
    it is hashed: a NaN in the last block of a multi-block tensor refuses the version."""
    pub, puller, trainer = streaming
    clean = random_params(trainer, 1)
    name = max(host(clean).items(), key=lambda kv: kv[1].nbytes)[0]
    assert host(clean)[name].nbytes >= 2 * checksum.BLOCK_BYTES  # NaN in its last block
    started = threading.Event()
    puller.hooks["stream_start"] = started.set
    pub.hooks["after_announce"] = lambda v: started.wait(10)
    thread, box = _pull_in_background(puller, 0)
    time.sleep(0.05)
    pub.publish(_poisoned(clean, name, -1, np.nan), 1)
    thread.join(30)
    assert started.is_set()
    assert isinstance(box.get("error"), NonFiniteWeights), box
    assert name in str(box["error"]) and "version 1" in str(box["error"])
    started.clear()
    thread, box = _pull_in_background(puller, 1)
    time.sleep(0.05)
    pub.publish(clean, 2)
    thread.join(30)
    assert started.is_set() and box["update"].version == 2 and box["update"].finite_checked
    got, want = host(box["update"].params), host(clean)
    assert all(np.array_equal(got[n], want[n]) for n in want)


def test_streamed_pull_restarts_when_superseded_and_times_out_on_a_stalled_publisher(
        streaming):
    pub, puller, trainer = streaming
    started, go = threading.Event(), threading.Event()

    def stream_start():  # holds the streamed version 1 while 2 and 3 supersede it
        started.set()
        assert go.wait(30)

    puller.hooks["stream_start"] = stream_start
    pub.hooks["after_announce"] = lambda v: started.wait(10)
    thread, box = _pull_in_background(puller, 0)
    time.sleep(0.05)
    pub.publish(random_params(trainer, 1), 1)
    assert started.is_set()
    pub.hooks.clear()
    puller.hooks.clear()
    pub.publish(random_params(trainer, 2), 2)
    newest = random_params(trainer, 3)
    pub.publish(newest, 3)
    go.set()
    thread.join(30)
    update = box["update"]
    assert update.version == 3 and update.metrics.attempts == 2
    got, want = host(update.params), host(newest)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    del update, box
    # A publisher that announces and never writes: the pull gives up at its deadline.
    slow = Puller(pub.url, target_of(ModelSpec(STREAM_CONFIG, mesh=None,
                                               rules=generator_rules())),
                  transports=["shm"], config=PullerConfig(timeout_s=1.0))
    slow.register()
    release = threading.Event()
    pub.hooks["after_announce"] = lambda v: release.wait(30)
    thread, box = _pull_in_background(slow, 3)
    time.sleep(0.05)
    publisher_thread = threading.Thread(target=pub.publish, args=(random_params(trainer, 4), 4))
    publisher_thread.start()
    thread.join(30)
    release.set()
    publisher_thread.join(30)
    assert isinstance(box.get("error"), TransferTimeout), box


def test_a_disk_version_being_loaded_is_kept_until_its_loader_is_done(publisher, specs):
    """Servers loading a version from disk may take longer than the trainer takes to publish
    two more: the version they read stays until they are done, then goes."""
    disk = Path(publisher.config.disk_dir)
    publisher.publish(random_params(specs["trainer"], 1), 1)
    with publisher.holding_disk(1) as path:
        assert Path(path) == disk / "v1"
        for version in (2, 3, 4):
            publisher.publish(random_params(specs["trainer"], version), version)
        assert (disk / "v1" / "model.safetensors").is_file()  # held
        assert not (disk / "v2").exists()  # not held: dropped as before
    assert sorted(p.name for p in disk.glob("v*")) == ["v3", "v4"]
