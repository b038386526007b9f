"""Systems model: formulas on hand-computed cases, the simulator against closed forms, the sweep's
staleness limit, and the planner CLI."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.sysmodel.accelerators import CATALOGUE, Accelerator, get_accelerator
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.invariants import Workload, balance, max_staleness_estimate, steady_state
from rl_jax.sysmodel.latency import MeasuredLatency, RooflineLatency, TrainerModel
from rl_jax.sysmodel.lengths import (ConstantLengths, EmpiricalLengths, LogNormalLengths,
                                     SequenceLengths)
from rl_jax.sysmodel.predict import predict_run
from rl_jax.sysmodel.recipe import model_shape, rollout_settings
from rl_jax.sysmodel.shape import QWEN2_1_5B, ModelShape
from rl_jax.sysmodel.simulator import SimConfig, simulate
from rl_jax.sysmodel.sweep import SweepOptions, sweep
from rl_jax.sysmodel.weightsync import WeightSync, weight_transfer_seconds

REPO = Path(__file__).resolve().parents[1]

# hidden 8, MLP 16, 2 layers, 2 heads / 1 KV head of 4, vocabulary 10, untied.
SMALL = ModelShape(hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=4, vocab_size=10)
TOY_CHIP = Accelerator(name="toy", description="toy", peak_flops={"bfloat16": 1e6},
                       memory_bandwidth=1e5, memory_capacity=1e5, interconnect_bandwidth=2e3,
                       interconnect="toy link", collective_latency_s=1e-3, source="test")


# ---- formulas
# -------------------------------------------------------------------------------------

def test_shape_counts_by_hand():
    # per layer: q,k,v 8*4*(2+2)=128, o 2*4*8=64, MLP 3*8*16=384, norms 16 -> 592
    assert SMALL.layer_params == 592
    assert SMALL.dense_params == 2 * 592 + 8
    assert SMALL.params == 1192 + 2 * 80
    assert SMALL.matmul_params == 1192 + 80
    assert SMALL.train_flops_per_token(6) == 6 * 1272 + 12 * 2 * 2 * 4 * 6
    assert SMALL.decode_flops_per_token(10) == 2 * 1272 + 4 * 2 * 2 * 4 * 10
    assert SMALL.kv_bytes_per_token("bfloat16") == 2 * 2 * 1 * 4 * 2
    assert SMALL.weight_bytes("float32") == 4 * 1352


def test_shape_matches_the_model_code():
    from rl_jax.models.config import ModelConfig
    cfg = ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128, architecture="Qwen2ForCausalLM",
                      tie_word_embeddings=True, attention_bias=True)
    assert QWEN2_1_5B.params == cfg.num_params()
    assert ModelShape.from_model_config(cfg).params == cfg.num_params()
    assert 1.5e9 < QWEN2_1_5B.params < 1.6e9


def test_roofline_by_hand():
    roof = RooflineLatency(SMALL, TOY_CHIP, tensor_parallel=1, dtype="bfloat16", max_context=16)
    # bytes: weights read 1272*2, embedding rows 8*2 per sequence, KV 32 per cached token
    b, c = 3, 5.0
    assert roof.step_bytes(b, c) == 1272 * 2 + b * 16 + b * (c + 1) * 32
    assert roof.memory_seconds(b, c) == pytest.approx(roof.step_bytes(b, c) / 1e5)
    assert roof.compute_seconds(b, c) == pytest.approx(b * SMALL.decode_flops_per_token(c) / 1e6)
    assert roof.step_seconds(b, c) == max(roof.memory_seconds(b, c), roof.compute_seconds(b, c))
    ridge = roof.ridge_batch(c)
    assert roof.memory_seconds(ridge, c) == pytest.approx(roof.compute_seconds(ridge, c))
    assert 1 < ridge < roof.max_batch
    assert roof.bound(math.floor(ridge), c) == "memory"
    assert roof.bound(math.ceil(ridge) + 1, c) == "compute"
    # capacity: 0.9 * 1e5 bytes minus weights 1352*2, over 16 tokens * 32 bytes per sequence
    assert roof.max_batch == int((0.9e5 - 2704) // (16 * 32))
    tp2 = RooflineLatency(SMALL, TOY_CHIP, tensor_parallel=2, dtype="bfloat16", max_context=16)
    comm = 2 * 2 * (1e-3 + 2 * 1 / 2 * b * 8 * 2 / 1e3)  # 2 all-reduces/layer, one-way link
    assert tp2.comm_seconds(b) == pytest.approx(comm)
    assert tp2.step_seconds(b, c) == pytest.approx(
        max(roof.memory_seconds(b, c), roof.compute_seconds(b, c)) / 2 + comm)
    # one KV head cannot be split: each TP chip keeps all of it
    assert tp2.kv_bytes_per_token_per_chip() == SMALL.kv_bytes_per_token()
    with pytest.raises(SysModelError, match="float32"):
        RooflineLatency(SMALL, TOY_CHIP, dtype="float32")


def test_measured_latency(tmp_path):
    lat = MeasuredLatency.from_points({4: 2.0, 1: 1.0, 8: 4.0})
    assert lat.step_seconds(1, 0) == 1.0 and lat.step_seconds(2, 0) == pytest.approx(4 / 3)
    assert lat.step_seconds(16, 0) == pytest.approx(8.0)  # last slope, 0.5 s per sequence
    assert lat.step_seconds(0, 0) == 0.0
    intercept, slope = MeasuredLatency.from_points([(1, 1.5), (3, 2.5)]).affine_fit()
    assert (intercept, slope) == pytest.approx((1.0, 0.5))
    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"models": [
        {"model": "a", "rows": [{"batch": 1, "engine_step_s": 0.1}, {"batch": 2,
                                                                      "engine_step_s": 0.15}]},
        {"model": "b", "rows": [{"batch": 1, "engine_step_s": 0.3}]}]}))
    assert MeasuredLatency.from_benchmark(path).seconds == (0.1, 0.15)
    assert MeasuredLatency.from_benchmark(path, "b").seconds == (0.3,)
    with pytest.raises(SysModelError, match="no model 'c'"):
        MeasuredLatency.from_benchmark(path, "c")
    with pytest.raises(SysModelError, match="increasing"):
        MeasuredLatency((2, 2), (1.0, 1.0))


def test_trainer_model_from_flops():
    t = TrainerModel.from_flops(SMALL, TOY_CHIP, 4, mfu=0.5, seq_len=6, dtype="bfloat16",
                                param_dtype="float32")
    assert t.tokens_per_s == pytest.approx(4 * 1e6 * 0.5 / SMALL.train_flops_per_token(6))
    # AdamW update: 28 bytes per float32 parameter, over 4 chips' bandwidth
    assert t.step_overhead_s == pytest.approx(1352 * 28 / (4 * 1e5))
    assert t.step_seconds(100) == pytest.approx(100 / t.tokens_per_s + t.step_overhead_s)
    assert TrainerModel.from_measured(1000.0, 3).tokens_per_s == 3000.0


def test_invariants_by_hand():
    b = balance(production_per_s=50.0, consumption_per_s=100.0)
    assert b["bottleneck"] == "generators" and b["throughput_per_s"] == 50.0
    assert b["trainer_idle_fraction"] == pytest.approx(0.5)
    assert b["generator_idle_fraction"] == 0.0
    assert max_staleness_estimate(10.0, 3.0) == 4
    assert max_staleness_estimate(9.0, 3.0) == 3
    # 4 servers of tp 2 receive 1e9 bytes at 1e8 B/s per chip: 5 s each; 2 trainer chips send
    # 4e9 bytes at 2e8 B/s: 20 s (the bare link: full line rate, no fixed cost).
    wire = WeightSync.wire_only()
    assert weight_transfer_seconds(1e9, num_train=2, num_servers=4, tensor_parallel=2,
                                   link_bandwidth=1e8, sync=wire) == pytest.approx(20.0)
    assert weight_transfer_seconds(1e9, num_train=16, num_servers=4, tensor_parallel=2,
                                   link_bandwidth=1e8, sync=wire) == pytest.approx(5.0)


def test_length_distributions(tmp_path):
    ln = LogNormalLengths(median=100, sigma=0.5, max_length=400)
    assert ln.p50 == pytest.approx(100)
    assert ln.p99 == pytest.approx(100 * math.exp(0.5 * 2.3263479), rel=1e-6)
    draws = ln.sample(np.random.default_rng(0), 200_000)
    assert draws.min() >= 1 and draws.max() <= 400
    assert ln.mean == pytest.approx(draws.mean(), rel=0.01)
    assert ln.truncated_fraction == pytest.approx((draws == 400).mean(), abs=0.002)
    assert ln.active_context == pytest.approx((draws.astype(float) ** 2).mean()
                                              / (2 * draws.mean()), rel=0.02)
    emp = EmpiricalLengths.from_values([5, 1, 3])
    assert emp.lengths == (1, 3, 5) and emp.mean == 3 and emp.max_length == 5
    (tmp_path / "h.json").write_text(json.dumps({"histogram": {"2": 3, "10": 1}}))
    assert EmpiricalLengths.from_file(tmp_path / "h.json").lengths == (2, 2, 2, 10)
    with pytest.raises(SysModelError):
        EmpiricalLengths.from_values([])


def test_catalogue_and_lookup(tmp_path):
    for name, acc in CATALOGUE.items():
        assert acc.source.count("http") >= 1, name
        assert acc.flops("bfloat16") > 1e14 and acc.memory_bandwidth > 5e11
        assert acc.memory_capacity >= 16e9 and acc.interconnect_bandwidth > 1e11
    assert get_accelerator("V5E").name == "tpu_v5e"
    with pytest.raises(SysModelError, match="unknown accelerator 'a100'"):
        get_accelerator("a100")
    path = tmp_path / "chip.json"
    path.write_text(json.dumps(TOY_CHIP.to_dict()))
    assert get_accelerator(str(path)) == TOY_CHIP


def test_measure_cpu_quickly(tmp_path):
    acc = get_accelerator("cpu", cpu_cache=tmp_path / "cpu.json")
    assert acc.flops("float32") > 1e8 and acc.memory_bandwidth > 1e8
    assert (tmp_path / "cpu.json").is_file()
    assert get_accelerator("cpu", cpu_cache=tmp_path / "cpu.json") == acc  # read back


# ---- simulator against closed forms --------------------------------------------------------------

FLAT = MeasuredLatency.from_points({1: 0.01, 1024: 0.01})  # 10 ms per step at any batch


def run(mode, *, tokens_per_s, lengths=ConstantLengths(10), servers=2, slots=8, group=4,
        groups=4, max_lag=2, steps=12, **kw):
    cfg = SimConfig(mode, prompt_len=5, group_size=group, groups_per_batch=groups,
                    max_lag=max_lag, num_servers=servers, slots_per_server=slots, num_steps=steps,
                    **kw)
    return simulate(cfg, FLAT, TrainerModel(tokens_per_s), lengths)


def test_sync_constant_lengths_closed_form():
    # 16 samples of 5 + 10 tokens on 16 slots: generation 10 steps x 10 ms, training 240 tokens
    # at 1000 tok/s, transfer 0.05 s.
    r = run("sync", tokens_per_s=1000.0, weight_transfer_s=0.05)
    step = 0.1 + 0.24 + 0.05
    assert r.tokens_per_s == pytest.approx(240 / step * (12 * step) / (12 * step - 0.05))
    assert r.steady_tokens_per_s == pytest.approx(240 / step)
    assert r.trainer_idle_fraction == pytest.approx(1 - 12 * 0.24 / (12 * step - 0.05))
    assert r.staleness_max == 0 and r.staleness_histogram == {0: 48}
    # twice the samples per slot: two waves of generation
    r2 = run("sync", tokens_per_s=1000.0, slots=4)
    assert r2.steady_tokens_per_s == pytest.approx(240 / (0.2 + 0.24))
    # the client's overhead per group delays every sync step by exactly that much
    r3 = run("sync", tokens_per_s=1000.0, group_overhead_s=0.03)
    assert r3.steady_tokens_per_s == pytest.approx(240 / (0.1 + 0.03 + 0.24))


def test_shared_prompts_are_trained_once_per_group():
    # rollout.share_prompts: 4 groups of 4 samples of 5 + 10 tokens train 4 x (5 + 40) = 180
    # tokens per batch, not 240 (generation 10 steps x 10 ms, training at 1000 tok/s).
    r = run("sync", tokens_per_s=1000.0, shared_prompts=True)
    assert r.steady_tokens_per_s == pytest.approx(180 / (0.1 + 0.18))
    assert r.step_s == pytest.approx(0.1 + 0.18)
    w = Workload(prompt_len=5, group_size=4, groups_per_batch=4, lengths=ConstantLengths(10),
                 max_lag=0, shared_prompts=True)
    assert w.tokens_per_batch == pytest.approx(180)
    p = predict_run(decode_latency={1: 0.01, 64: 0.01}, trainer_tokens_per_s=1000.0,
                    response_lengths=[10] * 8, prompt_len=5, group_size=4, groups_per_batch=4,
                    max_lag=0, mode="sync", num_servers=2, slots_per_server=8, num_steps=6,
                    shared_prompts=True)
    assert p.steady_tokens_per_s == pytest.approx(180 / 0.28)
    assert p.estimate["tokens_per_s"] == pytest.approx(180 / 0.28)


def test_group_overhead_is_hidden_by_async_when_training_bound():
    # generation 0.1 s + overhead 0.05 s per batch < training 0.24 s: async stays trainer-bound
    r = run("async", tokens_per_s=1000.0, steps=30, group_overhead_s=0.05)
    assert r.steady_tokens_per_s == pytest.approx(240 / 0.24, rel=1e-6)


def test_one_step_off_overlaps_generation_and_training():
    r = run("one_step_off", tokens_per_s=1000.0)  # train 0.24 s > generate 0.1 s
    assert r.steady_tokens_per_s == pytest.approx(240 / 0.24)
    assert r.staleness_max == 1 and r.staleness_histogram == {0: 4, 1: 44}
    r = run("one_step_off", tokens_per_s=24000.0)  # train 0.01 s < generate 0.1 s
    assert r.steady_tokens_per_s == pytest.approx(240 / 0.1)


def test_async_generation_bound_trainer_idles():
    # generation of a batch 0.1 s >> training 0.01 s: trainer idle ~ 1 - train/gen
    r = run("async", tokens_per_s=24000.0, steps=30)
    assert r.steady_tokens_per_s == pytest.approx(240 / 0.1, rel=1e-6)
    assert r.trainer_idle_fraction == pytest.approx(1 - 0.01 / 0.1, abs=0.01)
    assert r.generator_idle_fraction < 0.02
    assert r.staleness_max <= 2


def test_async_training_bound_generators_idle():
    # training 2.4 s per batch >> generation 0.1 s: tokens/s is the trainer's; generators idle
    r = run("async", tokens_per_s=100.0, steps=20)
    assert r.steady_tokens_per_s == pytest.approx(100.0, rel=1e-6)
    assert r.generator_idle_fraction == pytest.approx(1 - 0.1 / 2.4, abs=0.01)
    assert r.trainer_idle_fraction < 0.01
    # a full buffer: every sample waits until the bound
    assert r.staleness_max == 2 and r.staleness_histogram[2] > 40


@pytest.mark.parametrize("max_lag", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_async_never_exceeds_max_lag(max_lag, seed):
    lengths = LogNormalLengths(median=20, sigma=1.0, max_length=200)
    r = run("async", tokens_per_s=3000.0, lengths=lengths, servers=3, slots=6, group=3,
            groups=5, max_lag=max_lag, steps=25, seed=seed, weight_transfer_s=0.03,
            swap_pause_s=0.002, prefill_s_per_token=1e-4)
    assert r.staleness_max <= max_lag
    assert sum(r.staleness_histogram.values()) == 25 * 5
    assert 0 <= r.trainer_idle_fraction <= 1 and 0 <= r.generator_idle_fraction <= 1
    # async never loses to sync on the same layout
    s = run("sync", tokens_per_s=3000.0, lengths=lengths, servers=3, slots=6, group=3,
            groups=5, max_lag=max_lag, steps=25, seed=seed, weight_transfer_s=0.03,
            prefill_s_per_token=1e-4)
    assert r.steady_tokens_per_s >= 0.95 * s.steady_tokens_per_s


def test_timeline_integrates_to_busy_time():
    r = run("sync", tokens_per_s=1000.0)
    dt = r.timeline["t"][1] - r.timeline["t"][0]
    busy = sum(r.timeline["trainer_busy"]) * dt
    assert busy == pytest.approx((1 - r.trainer_idle_fraction) * r.wall_s, rel=1e-6)


def test_predict_run_matches_the_closed_form():
    p = predict_run(decode_latency={1: 0.01, 64: 0.01}, trainer_tokens_per_s=1000.0,
                    response_lengths=[10] * 8, prompt_len=5, group_size=4, groups_per_batch=4,
                    max_lag=0, mode="sync", num_servers=2, slots_per_server=8, num_steps=6)
    assert p.steady_tokens_per_s == pytest.approx(240 / 0.34)
    assert p.staleness_max == 0 and p.staleness_mean == 0
    assert p.estimate["tokens_per_s"] == pytest.approx(240 / 0.34)
    assert json.dumps(p.to_dict())
    # A start-up cost lengthens the whole run (same tokens over a longer wall), not the steady
    # state; the pools' busy seconds are unchanged.
    late = predict_run(decode_latency={1: 0.01, 64: 0.01}, trainer_tokens_per_s=1000.0,
                       response_lengths=[10] * 8, prompt_len=5, group_size=4,
                       groups_per_batch=4, max_lag=0, mode="sync", num_servers=2,
                       slots_per_server=8, num_steps=6, startup_s=1.0)
    assert late.wall_s == pytest.approx(p.wall_s + 1.0)
    assert late.tokens_per_s * late.wall_s == pytest.approx(p.tokens_per_s * p.wall_s)
    assert late.steady_tokens_per_s == p.steady_tokens_per_s
    assert (1 - late.trainer_idle_fraction) * late.wall_s == pytest.approx(
        (1 - p.trainer_idle_fraction) * p.wall_s)
    with pytest.raises(ValueError, match="startup_s"):
        predict_run(decode_latency={1: 0.01}, trainer_tokens_per_s=1000.0,
                    response_lengths=[10], prompt_len=5, group_size=1, groups_per_batch=1,
                    max_lag=0, mode="sync", num_servers=1, slots_per_server=1, startup_s=-1)


def test_replayed_per_prompt_lengths_give_the_sync_closed_form():
    """Lengths replayed in order, one per group: sync waits for each batch's own longest
    sample, then trains its tokens (decode 10 ms per step at any batch, 1000 tokens/s)."""
    seq = SequenceLengths([5, 20, 40])
    assert list(seq.sample(None, 4)) == [5, 20, 40, 5] and seq.max_length == 40
    assert seq.restart().sample(None, 1)[0] == 5
    p = predict_run(decode_latency={1: 0.01, 64: 0.01}, trainer_tokens_per_s=1000.0,
                    response_lengths=[5, 20, 40], prompt_len=2, group_size=4,
                    groups_per_batch=1, max_lag=0, mode="sync", num_servers=1,
                    slots_per_server=8, num_steps=3, ordered_lengths=True,
                    shared_group_length=True)
    want = sum(n * 0.01 + 4 * (n + 2) / 1000 for n in (5, 20, 40))
    assert p.wall_s == pytest.approx(want, rel=1e-6)
    assert p.tokens_per_s == pytest.approx(4 * (65 + 6) / want, rel=1e-6)


def test_steady_state_async_staleness_bound():
    # 10-token responses at 1 s per decode step; 1 step of training is fast: without the bound a
    # sample would span many versions, with max_lag 2 the step is at least 10 s / 2.
    w = Workload(prompt_len=0, group_size=1, groups_per_batch=1, lengths=ConstantLengths(10),
                 max_lag=2)
    est = steady_state("async", latency=MeasuredLatency.from_points({1: 1.0}),
                       trainer=TrainerModel(1e6), workload=w, num_servers=1,
                       slots_per_server=4)
    assert est["step_s"] == pytest.approx(5.0)
    assert est["bottleneck"] == "staleness bound"


# ---- sweep ---------------------------------------------------------------------------------------

def sweep_workload(max_lag):
    return Workload(prompt_len=128, group_size=4, groups_per_batch=8,
                    lengths=LogNormalLengths(200, 0.8, 1024), max_lag=max_lag)


@pytest.mark.parametrize("max_lag", [0, 3])
def test_sweep_honours_the_staleness_limit(max_lag):
    opts = SweepOptions(num_steps=5, simulate_top=1, split_points=3, batches=(8, 32),
                        tensor_parallel=(1, 2))
    res = sweep(QWEN2_1_5B, get_accelerator("h100"), 8, sweep_workload(max_lag), opts)
    assert res.best is not None and res.staleness_limit == max_lag
    assert all(r.sim.staleness_max <= max_lag for r in res.simulated)
    modes = {r.layout.mode for r in res.simulated}
    assert ("one_step_off" in modes) == (max_lag >= 1)
    assert res.best.tokens_per_s == max(r.tokens_per_s for r in res.simulated)
    assert res.best in res.frontier
    # every layout takes the 8 chips: split between the pools, or one pool doing both
    assert all(r.chips == 8 for r in res.evaluated)
    assert all(r.layout.num_train == r.layout.num_generate == 8 for r in res.evaluated
               if r.layout.mode == "colocated")
    assert "colocated" in {r.layout.mode for r in res.evaluated}
    staleness = [r.sim.staleness_mean for r in res.frontier]
    assert staleness == sorted(staleness)


def test_sweep_rejects_impossible_budgets():
    with pytest.raises(SysModelError, match="at least 2"):
        sweep(QWEN2_1_5B, get_accelerator("h100"), 1, sweep_workload(1))
    huge = ModelShape(hidden_size=16384, intermediate_size=53248, num_layers=126, num_heads=128,
                      num_kv_heads=8, head_dim=128, vocab_size=128256)  # 405B parameters
    with pytest.raises(SysModelError, match="no layout"):
        sweep(huge, get_accelerator("tpu_v5e"), 4, sweep_workload(1))


# ---- recipe config and CLI -----------------------------------------------------------------------

def test_model_shape_from_configs(tmp_path):
    from ml_collections import ConfigDict
    c = ConfigDict({"model": {"shape": {"hidden_size": 64, "intermediate_size": 128,
                                        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "head_dim": 16, "vocab_size": 100,
                                        "tie_word_embeddings": True}}})
    assert model_shape(c).params == ModelShape(64, 128, 2, 4, 2, 16, 100, True).params
    settings = rollout_settings(c)
    assert settings["group_size"] == 8 and "group_size" in settings["defaulted"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True}))
    c = ConfigDict({"base": {"checkpoint": str(ckpt)}, "rollout": {"group_size": 16}})
    assert model_shape(c).params == QWEN2_1_5B.params
    assert rollout_settings(c)["group_size"] == 16
    sys.path.insert(0, str(REPO))
    from rl_jax.sysmodel.recipe import load_config_file
    tiny = model_shape(load_config_file(REPO / "configs" / "tiny_lm.py"))
    assert tiny.vocab_size == 15 and tiny.hidden_size == 128


def plan_cli(*args, cwd=REPO):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "launch.plan", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_cli_runs_and_plots(tmp_path):
    config = tmp_path / "recipe.py"
    config.write_text(
        "from ml_collections import ConfigDict\n\n"
        "def get_config():\n"
        "    return ConfigDict({'mode': 'async', 'model': {'dtype': 'bfloat16', 'shape': dict(\n"
        "        hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,\n"
        "        num_kv_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True)},\n"
        "        'rollout': {'group_size': 4, 'groups_per_batch': 8, 'max_new_tokens': 512,\n"
        "                    'max_lag': 2, 'prompt_len': 64}})\n")
    fast = ["--steps=4", "--split_points=3", "--simulate_top=1", "--batches=8,32", "--tp=1,2"]
    procs = {
        "tiny": plan_cli("--config=configs/tiny_lm.py", "--accelerator=h100",
                         "--num_accelerators=4", "--max_lag=2", f"--outdir={tmp_path / 'tiny'}",
                         *fast),
        "custom": plan_cli(f"--config={config}", "--accelerator=tpu_v5e",
                           "--num_accelerators=16", f"--outdir={tmp_path / 'custom'}", *fast),
    }
    bad = {
        "unknown accelerator": plan_cli(f"--config={config}", "--accelerator=a100",
                                        "--num_accelerators=8", f"--outdir={tmp_path / 'x'}"),
        "num_accelerators must be >= 2": plan_cli(
            f"--config={config}", "--accelerator=h100", "--num_accelerators=1",
            f"--outdir={tmp_path / 'x'}"),
        "max_lag must be >= 0": plan_cli(f"--config={config}", "--accelerator=h100",
                                         "--num_accelerators=8", "--max_lag=-1",
                                         f"--outdir={tmp_path / 'x'}"),
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err[-2000:])
        assert "best layouts" in out and "frontier" in out
        for png in ("latency.png", "split.png", "utilisation.png"):
            assert (tmp_path / name / png).stat().st_size > 10_000
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        assert plan["best"]["staleness_max"] <= 2
    for message, proc in bad.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (message, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_aot_compile_check_of_a_small_target():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pools_bench", REPO / "benchmarks" / "pools.py")
    pools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pools)
    r = pools.aot_check("tiny", (1, 4, 2), batch=8, seq=32, microbatches=2, remat="none")
    assert r["ok"], r.get("error")
    mem = r["per_device_bytes"]
    batch_bytes = 5 * 8 * 32 * 4 / 4  # five [B, T] 4-byte arrays, rows split over fsdp=4
    assert mem["argument"] == pytest.approx(r["expected_state_bytes_per_device"] + batch_bytes,
                                            rel=0.05)
    assert mem["peak_estimate"] >= mem["argument"]
