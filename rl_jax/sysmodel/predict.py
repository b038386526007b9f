"""Prediction of one measured run from measured inputs, for validating the model against real
runs (the orchestrator benchmark compares this with what it measured)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rl_jax.sysmodel.invariants import Workload, steady_state
from rl_jax.sysmodel.latency import MeasuredLatency, TrainerModel
from rl_jax.sysmodel.lengths import EmpiricalLengths, SequenceLengths
from rl_jax.sysmodel.simulator import SimConfig, SimResult, simulate


@dataclasses.dataclass
class RunPrediction:
    """What :func:`predict_run` returns. Rates are trained tokens (prompt + completion) per
    second over the whole run (``tokens_per_s``) and after warm-up (``steady_tokens_per_s``);
    idle fractions are shares of the run's wall time; staleness is per group, in versions."""

    tokens_per_s: float
    steady_tokens_per_s: float
    completion_tokens_per_s: float
    trainer_idle_fraction: float
    generator_idle_fraction: float
    generator_slot_utilisation: float
    staleness_max: int
    staleness_mean: float
    staleness_histogram: dict[int, int]
    wall_s: float
    estimate: dict[str, Any]  # the closed-form steady state, for comparison
    sim: SimResult

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "sim"}
        out["staleness_histogram"] = {str(k): v for k, v in self.staleness_histogram.items()}
        return out


def predict_run(*, decode_latency: Mapping[int, float] | Sequence[tuple[int, float]],
                trainer_tokens_per_s: float, response_lengths: Sequence[int], prompt_len: int,
                group_size: int, groups_per_batch: int, max_lag: int, mode: str,
                num_servers: int, slots_per_server: int, num_steps: int = 20,
                weight_transfer_s: float = 0.0, trainer_step_overhead_s: float = 0.0,
                prefill_s_per_token: float = 0.0, swap_pause_s: float = 0.0,
                group_overhead_s: float = 0.0, startup_s: float = 0.0,
                ordered_lengths: bool = False, shared_group_length: bool = False,
                shared_prompts: bool = False, warmup_steps: int | None = None,
                seed: int = 0) -> RunPrediction:
    """Predicts throughput, idle fractions and staleness of a run from measurements.

    Args:
      decode_latency: measured decode-step seconds of one server by batch size,
        ``{batch: seconds}`` or ``[(batch, seconds), ...]``.
      trainer_tokens_per_s: measured trainer throughput (whole trainer pool) on the tokens of a
        batch (prompt + completion of every sample).
      response_lengths: measured completion lengths in tokens (resampled with replacement, or
        with ``ordered_lengths`` drawn in this order: a run's prompts replayed).
      prompt_len: prompt tokens per sample.
      group_size, groups_per_batch: samples per prompt, prompts per optimizer step.
      max_lag: staleness bound (versions); async admission obeys it.
      mode: ``"sync"``, ``"one_step_off"`` or ``"async"``.
      num_servers, slots_per_server: generator servers and their concurrent sequences.
      num_steps: optimizer steps to simulate (the run's length).
      weight_transfer_s: seconds from the end of an optimizer step until the servers can use
        the new weights.
      trainer_step_overhead_s: fixed seconds per optimizer step beyond token processing.
      prefill_s_per_token: server seconds per prompt token of a newly started sample.
      swap_pause_s: decode pause of a server applying weights in flight (async).
      group_overhead_s: seconds from a group's last sample leaving the server until the
        trainer's side has it (client, HTTP, scoring).
      startup_s: seconds a real run spends before its first batch beyond generating it
        (connections, first requests); added to the whole run's wall time, not to the steady
        state.
      ordered_lengths: draw ``response_lengths`` in order instead of resampling them.
      shared_group_length: one length per group (per prompt) instead of one per sample.
      shared_prompts: a group's prompt is trained once, not once per sample (the recipe's
        ``rollout.share_prompts``); ``trainer_tokens_per_s`` then counts it once too.
      warmup_steps: steps left out of ``steady_tokens_per_s`` (default: automatic).
      seed: seed of the length resampling.
    """
    latency = MeasuredLatency.from_points(decode_latency, source="measured")
    trainer = TrainerModel(trainer_tokens_per_s, trainer_step_overhead_s, source="measured")
    lengths = (SequenceLengths(response_lengths) if ordered_lengths
               else EmpiricalLengths.from_values(response_lengths))
    cfg = SimConfig(mode=mode, prompt_len=prompt_len, group_size=group_size,
                    groups_per_batch=groups_per_batch, max_lag=max_lag, num_servers=num_servers,
                    slots_per_server=slots_per_server, num_steps=num_steps,
                    weight_transfer_s=weight_transfer_s, swap_pause_s=swap_pause_s,
                    prefill_s_per_token=prefill_s_per_token,
                    group_overhead_s=group_overhead_s, warmup_steps=warmup_steps,
                    shared_group_length=shared_group_length,
                    shared_prompts=shared_prompts, seed=seed)
    sim = simulate(cfg, latency, trainer, lengths)
    workload = Workload(prompt_len, group_size, groups_per_batch, lengths, max_lag,
                        shared_prompts)
    estimate = steady_state(mode, latency=latency, trainer=trainer, workload=workload,
                            num_servers=num_servers, slots_per_server=slots_per_server,
                            weight_transfer_s=weight_transfer_s,
                            prefill_s_per_token=prefill_s_per_token,
                            run_samples=num_steps * workload.samples_per_batch)
    if startup_s < 0:
        raise ValueError(f"startup_s must be >= 0, got {startup_s}")
    wall = sim.wall_s + startup_s
    stretch = sim.wall_s / wall if wall > 0 else 1.0  # rates and busy shares over the longer wall
    return RunPrediction(
        tokens_per_s=sim.tokens_per_s * stretch, steady_tokens_per_s=sim.steady_tokens_per_s,
        completion_tokens_per_s=sim.completion_tokens_per_s * stretch,
        trainer_idle_fraction=1 - (1 - sim.trainer_idle_fraction) * stretch,
        generator_idle_fraction=1 - (1 - sim.generator_idle_fraction) * stretch,
        generator_slot_utilisation=sim.generator_slot_utilisation * stretch,
        staleness_max=sim.staleness_max, staleness_mean=sim.staleness_mean,
        staleness_histogram=sim.staleness_histogram, wall_s=wall, estimate=estimate,
        sim=sim)
