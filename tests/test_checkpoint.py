"""Orbax checkpoints: exact resume, restore onto another mesh, damaged checkpoints."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_jax.sharding import make_mesh
from rl_jax.trainer.checkpoint import Checkpointer, CheckpointRestoreError
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state, init_state,
                                  make_optimizer)
from rl_jax.trainer.step import batch_partition_spec, causal_lm_loss, global_batch, make_train_step
from trainer_fixtures import TINY, random_batch

TX = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))


def _setup(mesh_shape):
    spec = ModelSpec(TINY, mesh=make_mesh(*mesh_shape))
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    sharding = NamedSharding(spec.mesh, batch_partition_spec(spec))
    return spec, step, lambda seed: global_batch(random_batch(seed), sharding)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_is_bit_exact_and_reshards(tmp_path):
    spec, step, batch = _setup((2, 2, 2))
    state = init_state(TX, spec, spec.init_params(seed=0))
    with Checkpointer(tmp_path / "ckpt", keep=2) as ckpt:
        for seed in range(3):
            state, _ = step(state, batch(seed))
            ckpt.save(int(state.step), state, {"next_batch": seed + 1})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]  # keep=2
        _, want = step(state, batch(3))

        restored, meta, restored_step = ckpt.restore(abstract_state(TX, spec))
    assert restored_step == 3 and meta == {"next_batch": 3}
    assert int(restored.step) == 3
    for a, b in zip(_leaves(state), _leaves(restored)):
        np.testing.assert_array_equal(a, b)
    _, got = step(restored, batch(3))
    assert float(got["loss"]) == float(want["loss"])
    assert float(got["grad_norm"]) == float(want["grad_norm"])

    # The same checkpoint onto a different mesh shape (pure FSDP over 8 devices).
    spec8, step8, batch8 = _setup((1, 8, 1))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        resharded, _, _ = ckpt.restore(abstract_state(TX, spec8))
    wq = resharded.params["layers"]["wq"]
    assert wq.sharding.spec == spec8.param_shardings["layers"]["wq"].spec
    assert wq.sharding.mesh.shape["fsdp"] == 8
    for a, b in zip(_leaves(state), _leaves(resharded)):
        np.testing.assert_array_equal(a, b)
    _, got8 = step8(resharded, batch8(3))
    np.testing.assert_allclose(float(got8["loss"]), float(want["loss"]), rtol=1e-6)


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    spec, step, batch = _setup((1, 4, 2))
    state = init_state(TX, spec, spec.init_params(seed=0))
    with Checkpointer(tmp_path / "ckpt", keep=3, use_async=False) as ckpt:
        for seed in range(2):
            state, _ = step(state, batch(seed))
            ckpt.save(int(state.step), state, {"next_batch": seed + 1})
    # Damage every data file of the newest step.
    damaged = 0
    for f in (tmp_path / "ckpt" / "2").rglob("*"):
        if f.is_file() and "state" in f.parts and f.stat().st_size > 0:
            f.write_bytes(b"\x00garbage" * 4)
            damaged += 1
    assert damaged
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        restored, meta, restored_step = ckpt.restore(abstract_state(TX, spec))
    assert restored_step == 1 and meta == {"next_batch": 1} and int(restored.step) == 1


def test_no_restorable_checkpoint_is_a_clear_error(tmp_path):
    spec, _, _ = _setup((1, 4, 2))
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(CheckpointRestoreError, match="no checkpoints in"):
            ckpt.restore(abstract_state(TX, spec))
    state = init_state(TX, spec, spec.init_params(seed=0))
    with Checkpointer(tmp_path / "one", use_async=False) as ckpt:
        ckpt.save(0, state, {})
    for f in (tmp_path / "one" / "0").rglob("*"):
        if f.is_file() and "state" in f.parts:
            f.write_bytes(b"")
    with Checkpointer(tmp_path / "one") as ckpt:
        with pytest.raises(CheckpointRestoreError, match="could be restored"):
            ckpt.restore(abstract_state(TX, spec))


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (root only): a disk that fills up."""
    import os
    import subprocess
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                                            str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_full_disk_skips_saves_and_keeps_the_last_complete_checkpoint(small_disk, use_async):
    """Saves that find no room are skipped (the run goes on, partial files removed); the
    checkpoint written before stays restorable, and saving works again once there is room."""
    spec, step, batch = _setup((1, 4, 2))
    state = init_state(TX, spec, spec.init_params(seed=0))
    filler = small_disk / "filler"
    with Checkpointer(small_disk / "ckpt", keep=2, use_async=use_async) as ckpt:
        assert ckpt.save(0, state, {"next_batch": 0})
        ckpt.wait()
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(b"\0" * max(free - 4096, 0))  # leave less than a checkpoint
        for seed in range(2):
            state, _ = step(state, batch(seed))
            ckpt.save(int(state.step), state, {"next_batch": seed + 1})
        ckpt.wait()
        assert ckpt.failed_saves >= 1 and ckpt.all_steps() == [0]
        assert not list((small_disk / "ckpt").glob("*tmp*"))
        filler.unlink()
        state, _ = step(state, batch(2))
        assert ckpt.save(int(state.step), state, {"next_batch": 3})
        ckpt.wait()
        assert ckpt.all_steps() == [0, 3]
        restored, meta, at = ckpt.restore(abstract_state(TX, spec))
    assert at == 3 and meta == {"next_batch": 3}
    for a, b in zip(_leaves(state), _leaves(restored)):
        np.testing.assert_array_equal(a, b)
