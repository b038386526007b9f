"""Train step: micro-batching and sharding leave loss and update unchanged; non-finite guard;
optimizer schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, init_state, learning_rate_at,
                                  learning_rate_schedule, make_optimizer, set_learning_rate)
from rl_jax.trainer.step import (batch_partition_spec, causal_lm_loss, global_batch,
                                 make_train_step, split_microbatches, StreamingTrainStep)
from trainer_fixtures import TINY, random_batch

TX = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20))


def _two_steps(mesh, num_micro, remat="none"):
    spec = ModelSpec(TINY, mesh=mesh, remat=remat)
    state = init_state(TX, spec, spec.init_params(seed=0))
    step = make_train_step(spec, TX, causal_lm_loss, num_microbatches=num_micro)
    sharding = spec.replicated() if mesh is None else NamedSharding(mesh, batch_partition_spec(spec))
    out = []
    for seed in (1, 2):
        state, metrics = step(state, global_batch(random_batch(seed), sharding))
        out.append({k: float(v) for k, v in metrics.items()})
    return state, out


def _params(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.fixture(scope="module")
def reference():
    return _two_steps(None, 1)


@pytest.mark.parametrize("mesh_shape,num_micro", [(None, 4), ((2, 2, 2), 1), ((1, 4, 2), 2),
                                                  ((8, 1, 1), 1)])
def test_microbatching_and_sharding_match_single_device(reference, mesh_shape, num_micro):
    ref_state, ref_metrics = reference
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    state, metrics = _two_steps(mesh, num_micro)
    _assert_same_steps(state, metrics, ref_state, ref_metrics)


def _assert_same_steps(state, metrics, ref_state, ref_metrics):
    for got, want in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm", "denominator", "nll_sum", "correct_tokens"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    for got, want in zip(_params(state), _params(ref_state)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert int(state.step) == 2 and int(state.skipped) == 0


def test_remat_gives_same_update(reference):
    ref_state, ref_metrics = reference
    state, metrics = _two_steps(None, 1, remat="full")
    np.testing.assert_allclose(metrics[1]["loss"], ref_metrics[1]["loss"], rtol=1e-6)
    for got, want in zip(_params(state), _params(ref_state)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_non_finite_step_is_skipped_and_counted():
    spec = ModelSpec(TINY, mesh=make_mesh(2, 2, 2))
    sharding = NamedSharding(spec.mesh, batch_partition_spec(spec))
    state = init_state(TX, spec, spec.init_params(seed=0))
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    state, _ = step(state, global_batch(random_batch(1), sharding))
    before = _params(state)
    opt_before = [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]
    bad = random_batch(2)
    bad = bad.replace(loss_mask=np.where(np.arange(16) == 3, np.nan, bad.loss_mask)
                      .astype(np.float32))
    new, metrics = step(state, global_batch(bad, sharding))
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert int(new.step) == 1 and int(new.skipped) == 1
    for a, b in zip(before, _params(new)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(opt_before, jax.tree.leaves(new.opt_state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    # A finite batch afterwards trains normally.
    newer, metrics = step(new, global_batch(random_batch(3), sharding))
    assert int(metrics["skipped"]) == 0 and int(newer.step) == 2 and int(newer.skipped) == 1


def test_all_masked_batch_gives_zero_loss_and_no_nan():
    spec = ModelSpec(TINY, mesh=None)
    state = init_state(TX, spec, spec.init_params(seed=0))
    step = make_train_step(spec, TX, causal_lm_loss, donate=False)
    batch = random_batch(1)
    batch = batch.replace(loss_mask=np.zeros_like(batch.loss_mask))
    new, metrics = step(state, global_batch(batch, spec.replicated()))
    assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
    assert int(new.step) == 1


def test_params_and_optimizer_state_are_created_sharded():
    spec = ModelSpec(TINY, mesh=make_mesh(1, 4, 2))
    state = init_state(TX, spec, spec.init_params(seed=0))
    wq = state.params["layers"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    # Each device holds 1/8 of the array.
    assert wq.addressable_shards[0].data.size * 8 == wq.size
    adam = state.opt_state[1][0]
    assert adam.mu["layers"]["wq"].sharding == wq.sharding
    assert adam.nu["layers"]["w_down"].sharding == state.params["layers"]["w_down"].sharding
    assert adam.count.sharding.is_fully_replicated


def test_schedule_warms_up_then_decays():
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=10, total_steps=110,
                          final_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == pytest.approx(0.1)  # the first update already moves
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(110)) == pytest.approx(0.1)
    assert float(lr(60)) < 1.0


def test_progress_schedule_matches_the_step_schedule_and_follows_progress():
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=10, total_steps=110,
                          final_lr_ratio=0.1, schedule_on="progress")
    by_steps = learning_rate_schedule(cfg)
    for step in (0, 4, 9):  # warm-up by updates
        assert learning_rate_at(cfg, step, 0.5) == pytest.approx(float(by_steps(step)))
    assert learning_rate_at(cfg, 10, 0.0) == pytest.approx(1.0)
    assert learning_rate_at(cfg, 10, 0.5) == pytest.approx(0.55)
    assert learning_rate_at(cfg, 50, 1.0) == pytest.approx(0.1)
    assert learning_rate_at(cfg, 50, 3.0) == pytest.approx(0.1)  # past the end: the floor
    with pytest.raises(ValueError, match="schedule_on"):
        OptimizerConfig(schedule_on="time")


def test_progress_schedule_sets_the_rate_each_update_uses():
    """Two models, one stepped with the rate set to r, the other with a step schedule whose
    value is r at that update: the same parameters (the rate is what the update uses)."""
    spec = ModelSpec(TINY, mesh=None)
    progress = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=20,
                               schedule_on="progress")
    tx = make_optimizer(progress)
    fixed = make_optimizer(OptimizerConfig(learning_rate=3e-3, warmup_steps=0, total_steps=1,
                                           final_lr_ratio=1.0))
    a = init_state(tx, spec, spec.init_params(seed=0))
    b = init_state(fixed, spec, spec.init_params(seed=0))
    step_a = make_train_step(spec, tx, causal_lm_loss, donate=False)
    step_b = make_train_step(spec, fixed, causal_lm_loss, donate=False)
    for seed in (1, 2):
        a = a.replace(opt_state=set_learning_rate(a.opt_state, 3e-3))
        a, _ = step_a(a, random_batch(seed))
        b, _ = step_b(b, random_batch(seed))
    for x, y in zip(_params(a), _params(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    moved = a.replace(opt_state=set_learning_rate(a.opt_state, 0.0))
    still, _ = step_a(moved, random_batch(3))
    for x, y in zip(_params(still), _params(a)):
        np.testing.assert_array_equal(x, y)


def test_ess_update_scale_shrinks_the_step_by_the_batch_ess():
    from rl_jax.trainer.step import ess_update_scale
    scale = ess_update_scale(power=1.0)
    # ratios 1, 1, 1, 1: ESS 1; ratios 2, 0, 0, 0: (Σw)² / (N Σw²) = 4 / 16.
    np.testing.assert_allclose(scale({"tokens": 4.0, "ratio_sum": 4.0, "ratio_sq_sum": 4.0}), 1)
    np.testing.assert_allclose(scale({"tokens": 4.0, "ratio_sum": 2.0, "ratio_sq_sum": 4.0}),
                               0.25)
    np.testing.assert_allclose(ess_update_scale(0.5)({"tokens": 4.0, "ratio_sum": 2.0,
                                                      "ratio_sq_sum": 4.0}), 0.5)
    both = {"tokens": 4.0, "ratio_sum": 4.0, "ratio_sq_sum": 4.0,
            "behaviour_ratio_sum": 2.0, "behaviour_ratio_sq_sum": 4.0}
    np.testing.assert_allclose(scale(both), 0.25)  # π_prox / μ when the loss reports it
    np.testing.assert_allclose(scale({"tokens": 4.0, "ratio_sum": 1e-3,
                                      "ratio_sq_sum": 1.0}), 0.05)  # the floor
    np.testing.assert_allclose(scale({"tokens": 0.0, "ratio_sum": 0.0, "ratio_sq_sum": 0.0}), 1)
    # In a train step the update is scaled: with a scale of 0 nothing moves.
    spec = ModelSpec(TINY, mesh=None)
    state = init_state(TX, spec, spec.init_params(seed=0))
    frozen = make_train_step(spec, TX, causal_lm_loss, donate=False,
                             update_scale=lambda m: jnp.zeros(()))
    after, metrics = frozen(state, random_batch(1))
    assert float(metrics["update_scale"]) == 0.0 and int(after.step) == 1
    for x, y in zip(_params(after), _params(state)):
        np.testing.assert_array_equal(x, y)


def test_microbatch_split_draws_rows_from_every_shard():
    import jax.numpy as jnp
    x = jnp.arange(8)
    micro = split_microbatches(x, 2)
    assert micro.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        split_microbatches(jnp.arange(6), 4)


def _streaming_two_steps(mesh, micro_rows, batch_rows=(8, 8)):
    spec = ModelSpec(TINY, mesh=mesh)
    state = init_state(TX, spec, spec.init_params(seed=0))
    step = StreamingTrainStep(spec, TX, causal_lm_loss, micro_rows=micro_rows)
    out = []
    for seed, rows in zip((1, 2), batch_rows):
        host = jax.tree.map(np.asarray, random_batch(seed, batch=rows))
        state, metrics = step(state, host)
        out.append({k: float(v) for k, v in metrics.items()})
    return state, out, step


@pytest.mark.parametrize("mesh_shape,micro_rows", [(None, 2), (None, 8), ((2, 2, 2), 4),
                                                   ((8, 1, 1), 8)])
def test_streaming_step_matches_whole_batch_step(reference, mesh_shape, micro_rows):
    ref_state, ref_metrics = reference
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    state, metrics, step = _streaming_two_steps(mesh, micro_rows)
    _assert_same_steps(state, metrics, ref_state, ref_metrics)
    assert len(step._programs) == 1  # one micro-batch shape, compiled once


def test_streaming_step_takes_any_multiple_of_the_micro_batch():
    # Batches of 4 and then 12 rows go through the same compiled programs; each step equals the
    # whole-batch step on the same rows.
    spec = ModelSpec(TINY, mesh=None)
    step = StreamingTrainStep(spec, TX, causal_lm_loss, micro_rows=4)
    whole = make_train_step(spec, TX, causal_lm_loss, donate=False)
    state = init_state(TX, spec, spec.init_params(seed=0))
    for seed, rows in ((3, 4), (4, 12)):
        host = jax.tree.map(np.asarray, random_batch(seed, batch=rows))
        want_state, want = whole(state, global_batch(host, spec.replicated()))
        state, got = step(state, host)
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=1e-5)
        for a, b in zip(_params(state), _params(want_state)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert len(step._programs) == 1
    with pytest.raises(ValueError, match="not a positive multiple of micro_rows=4"):
        step(state, jax.tree.map(np.asarray, random_batch(5, batch=6)))


def test_streaming_step_warm_up_changes_nothing():
    # warm() runs the compiled programs once on zeros: the state is untouched, and the steps
    # after it are bit-for-bit those of a step that was never warmed.
    spec = ModelSpec(TINY, mesh=None)
    hosts = [jax.tree.map(np.asarray, random_batch(seed, batch=8)) for seed in (1, 2)]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape[1:]), x.dtype), hosts[0])
    results = []
    for warm in (False, True):
        step = StreamingTrainStep(spec, TX, causal_lm_loss, micro_rows=4)
        state = init_state(TX, spec, spec.init_params(seed=0))
        if warm:
            before = _params(state)
            assert step.warm(state.params, abstract) > 0
            assert int(state.step) == 0
            for a, b in zip(_params(state), before):
                np.testing.assert_array_equal(a, b)
        losses = []
        for host in hosts:
            state, metrics = step(state, host)
            losses.append(float(metrics["loss"]))
        results.append((losses, _params(state)))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_streaming_step_skips_a_non_finite_update():
    spec = ModelSpec(TINY, mesh=None)
    step = StreamingTrainStep(spec, TX, causal_lm_loss, micro_rows=4)
    state = init_state(TX, spec, spec.init_params(seed=0))
    before = _params(state)
    host = jax.tree.map(np.asarray, random_batch(6, batch=8))
    host = host.replace(loss_mask=np.where(host.loss_mask > 0, np.inf, 0.0).astype(np.float32))
    state, metrics = step(state, host)
    assert int(state.step) == 0 and int(state.skipped) == 1 and int(metrics["skipped"]) == 1
    for a, b in zip(_params(state), before):
        np.testing.assert_array_equal(a, b)
