"""Closed-form steady-state relations between the pools (no simulation).

- *balance*: the trainer consumes samples at ``R_t = batch_samples / step_seconds``; the
  generators produce them at ``R_g``. Throughput is ``min(R_t, R_g)``; the ratio says which pool
  idles and by how much (``1 − min/max`` of the faster one's time).
- *staleness*: a response that takes ``T_long`` seconds to generate spans
  ``⌈T_long / T_step⌉`` optimizer steps, so its oldest token is that many versions old when it
  is consumed; it must not exceed ``max_lag``, or the admission rule throttles generation.
  When generation outpaces training, finished groups queue and every sample ages up to the
  bound: staleness then sits at ``max_lag``.
- *weight transfer*: every server must receive all weights; a server of ``tp`` chips receives
  ``W / tp`` per chip, and the trainer's ``n_train`` chips together send ``servers · W``, over
  the within-host link or the across-host network as the layout's placement decides, plus the
  host-staging and fixed costs of a real update (:mod:`rl_jax.sysmodel.weightsync`).

Times in seconds, rates in samples/s or tokens/s as named.
"""

from __future__ import annotations

import dataclasses
import math

from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.latency import DecodeLatency, TrainerModel
from rl_jax.sysmodel.lengths import LengthDistribution


@dataclasses.dataclass(frozen=True)
class Workload:
    """One optimizer step's worth of RL data and the staleness bound."""

    prompt_len: int
    group_size: int
    groups_per_batch: int
    lengths: LengthDistribution
    max_lag: int
    shared_prompts: bool = False  # a group's prompt is trained once (rollout.share_prompts)

    def __post_init__(self):
        if self.group_size < 1 or self.groups_per_batch < 1:
            raise SysModelError(f"group_size and groups_per_batch must be >= 1, got "
                                f"{self.group_size}, {self.groups_per_batch}")
        if self.max_lag < 0:
            raise SysModelError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.prompt_len < 0:
            raise SysModelError(f"prompt_len must be >= 0, got {self.prompt_len}")

    @property
    def samples_per_batch(self) -> int:
        return self.group_size * self.groups_per_batch

    @property
    def tokens_per_sample(self) -> float:
        """Mean trained tokens per sample: its completion and its prompt, or its share of the
        group's one prompt with ``shared_prompts``."""
        prompt = self.prompt_len / self.group_size if self.shared_prompts else self.prompt_len
        return prompt + self.lengths.mean

    @property
    def tokens_per_batch(self) -> float:
        return self.samples_per_batch * self.tokens_per_sample

    @property
    def max_context(self) -> int:
        return self.prompt_len + self.lengths.max_length


def balance(production_per_s: float, consumption_per_s: float) -> dict[str, float | str]:
    """Production/consumption ratio of two rates in the same unit, the bottleneck pool and the
    idle share of the other pool's time in steady state."""
    if production_per_s <= 0 or consumption_per_s <= 0:
        raise SysModelError("rates must be > 0 to compare them")
    ratio = production_per_s / consumption_per_s
    return {"ratio": ratio, "throughput_per_s": min(production_per_s, consumption_per_s),
            "bottleneck": "generators" if ratio < 1 else "trainer",
            "trainer_idle_fraction": max(0.0, 1 - ratio),
            "generator_idle_fraction": max(0.0, 1 - 1 / ratio)}


def max_staleness_estimate(longest_generation_s: float, step_s: float) -> int:
    """``⌈longest generation time / optimizer step time⌉`` (versions a sample spans)."""
    if step_s <= 0:
        raise SysModelError(f"optimizer step time must be > 0, got {step_s}")
    return int(math.ceil(longest_generation_s / step_s - 1e-9))


def generation_rate(latency: DecodeLatency, *, num_servers: int, batch: int, workload: Workload,
                    prefill_s_per_token: float = 0.0) -> float:
    """Samples/s of the pool with every server keeping ``batch`` slots busy: a slot turns over
    once per mean response length of decode steps, and each new sample's prefill stalls its
    server ``prompt_len · prefill_s_per_token``."""
    mean_len = workload.lengths.mean
    step = latency.step_seconds(batch, workload.prompt_len + workload.lengths.active_context)
    per_server = batch / (mean_len * step + batch * workload.prompt_len * prefill_s_per_token)
    return num_servers * per_server


def steady_state(mode: str, *, latency: DecodeLatency, trainer: TrainerModel, workload: Workload,
                 num_servers: int, slots_per_server: int, weight_transfer_s: float = 0.0,
                 prefill_s_per_token: float = 0.0, run_samples: int | None = None
                 ) -> dict[str, float | str]:
    """First-order throughput and staleness of a layout in ``mode`` (``sync``,
    ``one_step_off``, ``async``, ``colocated``: as ``sync`` on one pool, ``weight_transfer_s``
    its phase switch); the simulator refines it with the length distribution's interplay with
    batching.

    Returns: ``tokens_per_s`` (trained tokens), ``step_s``, ``train_s``, ``generate_s`` (one
    batch), ``staleness_estimate`` (bounded by the mode) and ``staleness_ungated``
    (``⌈T_longest / T_step⌉``), ``bottleneck``.
    """
    n = workload.samples_per_batch
    lengths = workload.lengths
    longest = lengths.quantile(1 - 1 / (run_samples or 16 * n))
    train_s = trainer.step_seconds(workload.tokens_per_batch)
    total_slots = num_servers * slots_per_server
    if mode in ("sync", "one_step_off", "colocated"):
        # One batch spread over the servers; the step ends with its longest response, and the
        # batch shrinks as responses finish (the mean occupancy is about mean/longest).
        occupancy = min(slots_per_server, math.ceil(n / num_servers))
        waves = math.ceil(n / total_slots)
        batch_longest = lengths.expected_max(n)
        mean_batch = max(1, round(occupancy * min(1.0, lengths.mean / batch_longest)))
        context = workload.prompt_len + lengths.active_context
        generate_s = (waves * batch_longest * latency.step_seconds(mean_batch, context)
                      + occupancy * waves * workload.prompt_len * prefill_s_per_token)
        if mode in ("sync", "colocated"):
            step_s = generate_s + train_s + weight_transfer_s
            staleness = 0
        else:
            step_s = max(generate_s, train_s + weight_transfer_s)
            staleness = 1
        bottleneck = "generators" if generate_s >= train_s + weight_transfer_s else "trainer"
    elif mode == "async":
        # Production at full slots and consumption bound the step from below; so does the
        # max_lag rule: a cohort admitted at version g is consumed by g + max_lag, so max_lag
        # steps must cover its longest generation (with max_lag 0, generation and training
        # alternate). Slots run at the occupancy the throughput implies (Little's law), which
        # sets the decode step time; a few fixed-point iterations settle it.
        context = workload.prompt_len + lengths.active_context
        consume = n / train_s
        produce = generation_rate(latency, num_servers=num_servers, batch=slots_per_server,
                                  workload=workload, prefill_s_per_token=prefill_s_per_token)
        free_s = max(n / produce, n / consume)
        cohort_longest = lengths.expected_max(n)
        batch = slots_per_server
        for _ in range(4):
            decode_s = latency.step_seconds(batch, context)
            gated_s = (cohort_longest * decode_s / workload.max_lag if workload.max_lag
                       else cohort_longest * decode_s + train_s)
            step_s = max(free_s, gated_s)
            in_flight = n / step_s * lengths.mean * decode_s
            batch = int(min(slots_per_server, max(1, math.ceil(in_flight / num_servers))))
        generate_s = n / produce
        bottleneck = ("staleness bound" if gated_s > free_s
                      else "generators" if produce < consume else "trainer")
        ungated = max_staleness_estimate(longest * decode_s, free_s)
        # Faster generation than training fills the buffer: samples age up to the bound.
        staleness = min(ungated, workload.max_lag) if bottleneck == "generators" \
            else workload.max_lag
        return {"tokens_per_s": workload.tokens_per_batch / step_s, "step_s": step_s,
                "train_s": train_s, "generate_s": generate_s, "transfer_s": weight_transfer_s,
                "staleness_estimate": staleness, "staleness_ungated": ungated,
                "bottleneck": bottleneck, "occupancy": batch / slots_per_server}
    else:
        raise SysModelError(f"unknown mode {mode!r}")
    return {"tokens_per_s": workload.tokens_per_batch / step_s, "step_s": step_s,
            "train_s": train_s, "generate_s": generate_s, "transfer_s": weight_transfer_s,
            "staleness_estimate": staleness, "staleness_ungated": staleness,
            "bottleneck": bottleneck, "occupancy": mean_batch / slots_per_server}
