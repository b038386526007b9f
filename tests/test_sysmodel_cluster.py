"""The systems model at cluster scale: trainer work per token, data-parallel collectives, the
decode step's fixed cost, paged generators, colocated jobs, and the validation against published
RL step times of other systems (benchmarks/sysmodel_cases.json)."""

import json
import math
import sys
from pathlib import Path

import pytest

from rl_jax.models.shapes import shape as model_config
from rl_jax.sysmodel import cluster
from rl_jax.sysmodel.accelerators import get_accelerator
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.latency import TrainerModel
from rl_jax.sysmodel.lengths import ConstantLengths
from rl_jax.sysmodel.shape import ModelShape
from rl_jax.sysmodel.simulator import SimConfig, simulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN7B = ModelShape.from_model_config(model_config("qwen2.5-7b"), name="qwen2.5-7b")
H100 = get_accelerator("h100")


def test_trainer_work_counts_every_forward_pass():
    seq = 2048.0
    train = QWEN7B.train_flops_per_token(seq)
    plain = cluster.TrainerWork(logprob_passes=0, remat="none")
    assert cluster.trainer_flops_per_token(QWEN7B, plain, seq) == pytest.approx(train)
    full = cluster.TrainerWork(logprob_passes=1, reference=True, remat="full")
    # forward+backward is three forwards; old log-probs, reference and recompute add one each
    assert cluster.trainer_flops_per_token(QWEN7B, full, seq) == pytest.approx(train * 6 / 3)
    fast = TrainerModel.from_flops(QWEN7B, H100, 8, mfu=0.4, seq_len=seq)
    slow = TrainerModel.from_flops(QWEN7B, H100, 8, mfu=0.4, seq_len=seq, forward_passes=3)
    assert fast.tokens_per_s / slow.tokens_per_s == pytest.approx(2.0)
    with pytest.raises(SysModelError, match="remat"):
        cluster.TrainerWork(remat="some")


def test_data_parallel_collectives_take_the_network_across_hosts():
    work = cluster.TrainerWork(model_parallel=1, shard_params=True)
    one_host = cluster.trainer_comm_seconds(QWEN7B, H100, 8, work)
    two_hosts = cluster.trainer_comm_seconds(QWEN7B, H100, 16, work)
    share = QWEN7B.params * 2
    # FSDP: two all-gathers and a reduce-scatter, ring traffic (n-1)/n of the buffer
    assert one_host == pytest.approx(3 * (7 / 8 * share / H100.link_bandwidth
                                          + H100.collective_latency_s * 14))
    assert two_hosts > 4 * one_host  # 50 GB/s per GPU across hosts against 450 within
    replicated = cluster.TrainerWork(model_parallel=1, shard_params=False)
    assert cluster.trainer_comm_seconds(QWEN7B, H100, 8, replicated) == pytest.approx(
        one_host * 2 / 3)
    assert cluster.trainer_comm_seconds(QWEN7B, H100, 4, cluster.TrainerWork(
        model_parallel=4)) == 0.0  # one replica: nothing to reduce


def test_tensor_parallelism_all_reduces_activations_per_token():
    one = cluster.TrainerWork(model_parallel=4, tensor_parallel=1, remat="none",
                              logprob_passes=0)
    four = cluster.TrainerWork(model_parallel=4, tensor_parallel=4, remat="none",
                               logprob_passes=0)
    assert cluster.tensor_parallel_seconds_per_token(QWEN7B, H100, one) == 0.0
    # forward and backward: four all-reduces of [D] per layer, ring 2(tp-1)/tp
    expected = QWEN7B.num_layers * 4 * 1.5 * QWEN7B.hidden_size * 2 / H100.link_bandwidth
    assert cluster.tensor_parallel_seconds_per_token(QWEN7B, H100, four) == pytest.approx(
        expected)
    slower = cluster.trainer_model(QWEN7B, H100, 8, four, seq_len=1024, optimizer_steps=1)
    faster = cluster.trainer_model(QWEN7B, H100, 8, one, seq_len=1024, optimizer_steps=1)
    assert slower.tokens_per_s < faster.tokens_per_s
    with pytest.raises(SysModelError, match="divide"):
        cluster.TrainerWork(model_parallel=4, tensor_parallel=3)


def test_decode_step_has_its_fixed_cost_and_matches_both_fitted_points():
    # the fit passes through both batch-1 measurements it was made from
    for roofline_ms, measured_ms in ((0.29, 1.13), (10.3, 13.3)):
        fitted = roofline_ms / cluster.DECODE_EFFICIENCY + cluster.DECODE_STEP_OVERHEAD_S * 1e3
        assert fitted == pytest.approx(measured_ms, rel=1e-6)
    latency = cluster.decode_latency(QWEN7B, H100, 1, max_context=4096)
    bare = latency.memory_seconds(1, 100)
    assert latency.step_seconds(1, 100) == pytest.approx(bare + cluster.DECODE_STEP_OVERHEAD_S)


def test_a_paged_engine_holds_sequences_by_live_tokens():
    lengths = cluster.lognormal_with_mean(2000, 0.8, 16000)
    paged = cluster.generator_slots(QWEN7B, H100, 1, engine="paged", prompt_len=200,
                                    lengths=lengths, max_running=100_000)
    own = cluster.generator_slots(QWEN7B, H100, 1, engine="rl_jax", prompt_len=200,
                                  lengths=lengths)
    assert paged > 5 * own  # a slot at the longest context vs the live tokens
    capped = cluster.generator_slots(QWEN7B, H100, 1, engine="paged", prompt_len=200,
                                     lengths=lengths, max_running=256)
    assert capped == 256
    with pytest.raises(SysModelError, match="engine"):
        cluster.generator_slots(QWEN7B, H100, 1, engine="tgi", prompt_len=1, lengths=lengths)


def test_lognormal_with_mean_hits_the_mean_under_the_clip():
    lengths = cluster.lognormal_with_mean(3000, 1.2, 8192)
    assert lengths.mean == pytest.approx(3000, rel=1e-6)
    assert lengths.truncated_fraction > 0.05
    with pytest.raises(SysModelError):
        cluster.lognormal_with_mean(9000, 0.8, 8192)


def test_colocated_is_sync_on_one_pool_with_its_phase_switch():
    from rl_jax.sysmodel.latency import MeasuredLatency
    latency = MeasuredLatency.from_points({1: 0.01, 64: 0.02})
    trainer = TrainerModel(tokens_per_s=10_000)
    lengths = ConstantLengths(100)
    runs = {}
    for mode, switch in (("sync", 0.0), ("colocated", 5.0)):
        cfg = SimConfig(mode, prompt_len=10, group_size=4, groups_per_batch=8, max_lag=0,
                        num_servers=2, slots_per_server=16, num_steps=4,
                        weight_transfer_s=switch, warmup_steps=1)
        runs[mode] = simulate(cfg, latency, trainer, lengths)
    assert runs["colocated"].step_s == pytest.approx(runs["sync"].step_s + 5.0)
    assert runs["colocated"].staleness_max == 0


def test_a_job_is_checked_and_priced():
    lengths = cluster.lognormal_with_mean(1000, 0.8, 4000)
    base = dict(shape=QWEN7B, accelerator=H100, chips=16, prompts_per_step=64,
                samples_per_prompt=8, prompt_len=200, lengths=lengths)
    with pytest.raises(SysModelError, match="trainer_chips"):
        cluster.RLJob(mode="one_step_off", **base)
    with pytest.raises(SysModelError, match="exceed"):
        cluster.RLJob(mode="async", trainer_chips=12, generator_chips=8, **base)
    with pytest.raises(SysModelError, match="multiple of"):
        cluster.RLJob(mode="colocated", generator_tp=3, **base)
    colocated = cluster.predict_step(cluster.RLJob(mode="colocated", **base))
    split = cluster.predict_step(cluster.RLJob(mode="one_step_off", trainer_chips=8,
                                               generator_chips=8, **base))
    assert colocated["servers"] == 16 and split["servers"] == 8
    assert colocated["switch_s"] > 0 and split["switch_s"] == 0
    # one step off overlaps the pools: never slower than generating then training on half
    assert split["step_s"] <= split["train_s"] + colocated["step_s"] * 2
    assert math.isfinite(colocated["step_s"]) and colocated["step_s"] > colocated["train_s"]


# ---- the published cases -------------------------------------------------------------------------

def _validation():
    from benchmarks import sysmodel_validation
    return sysmodel_validation


def test_every_case_names_its_source_and_every_assumption_its_reason():
    data = json.loads((ROOT / "benchmarks" / "sysmodel_cases.json").read_text())
    modelled = [c for c in data["cases"] if "model_inputs" in c]
    assert len(modelled) >= 8 and len({c["system"] for c in modelled}) >= 3
    for case in data["cases"]:
        assert case["source_url"] and case["quote"] and case["value"] > 0, case["id"]
    for case in modelled:
        for key, item in case["model_inputs"].items():
            assert isinstance(item, dict) and item.get("why"), (case["id"], key)


def test_predictions_match_the_committed_validation():
    """A regression check on the model: every modelled case predicts what the committed results
    say (benchmarks/results/sysmodel_validation.json; rerun the benchmark to update them)."""
    validation = _validation()
    committed = json.loads((ROOT / "benchmarks" / "results" /
                            "sysmodel_validation.json").read_text())
    rows = validation.evaluate(validation.load_cases())
    assert [r["id"] for r in rows] == [r["id"] for r in committed["rows"]]
    for row, old in zip(rows, committed["rows"]):
        assert row["predicted_s"] == pytest.approx(old["predicted_s"], rel=0.02), row["id"]
    assert validation.summary(rows)["within_25pct"] == committed["summary"]["within_25pct"]
