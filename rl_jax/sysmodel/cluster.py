"""One RL step of a job laid out the way the systems users run lay it out: colocated (one pool
that generates, then trains), or split into a trainer pool and a generator pool (synchronous,
one step off, asynchronous), with SGLang/vLLM-style paged generators or this project's.

A job (:class:`RLJob`) fixes the model, the chips, the mode and its split, the RL batch (prompts
× samples, split into optimizer mini-batches), the response lengths and the trainer's work per
token; :func:`predict_step` prices one RL step (one batch) by simulating a few of them
(:mod:`rl_jax.sysmodel.simulator`). The terms:

- **Trainer work per trained token** (:func:`trainer_flops_per_token`): forward and backward
  (``6·N_mm`` + attention), every log-probability forward pass the loss needs before the update
  (the old policy's, recomputed unless the rollout's own log-probs are used, and a reference
  model's when the loss has a KL to it: ``2·N_mm`` + attention each), and the recompute of the
  remat policy (``full``: one more forward; ``dots`` keeps the matmul outputs: none of the
  matmuls; ``none``), at ``mfu`` of the trainer chips' dense peak.
- **Data-parallel communication per optimizer step** (:func:`trainer_comm_seconds`): with
  ``model_parallel`` chips holding one replica (tensor × pipeline parallel) and the rest
  data-parallel (``dp``), a gradient reduce-scatter and a parameter all-gather of the replica's
  share in the gradient dtype, plus, with FSDP (``shard_params``), one more all-gather for the
  backward pass; ring traffic ``(dp−1)/dp`` of the buffer per chip, over the within-host link
  while the data-parallel group fits in a host, else the across-host network. Counted as not
  overlapped with compute. The AdamW update reads and writes the state once (memory-bound).
  Tensor parallelism adds its activation all-reduces per trained token
  (:func:`tensor_parallel_seconds_per_token`).
- **Decode** (:class:`~rl_jax.sysmodel.latency.RooflineLatency`): the roofline at ``efficiency``
  plus a fixed cost per step (kernel launches, sampling, scheduling) and the tensor-parallel
  all-reduces. Both constants are fitted once on two measurements
  (:data:`DECODE_EFFICIENCY`, :data:`DECODE_STEP_OVERHEAD_S`).
- **Generator memory per engine** (:func:`generator_slots`): ``"paged"`` (SGLang, vLLM): one
  copy of the weights, and a KV pool of ``memory_fraction`` of the chip's memory minus the
  weights, filled by live tokens (a sequence holds its prompt and, on average over its life, half
  of its response), capped by the engine's ``max_running`` requests; ``"rl_jax"``: this project's
  server (:func:`~rl_jax.sysmodel.memory_serving.generator_memory`: a cache at the longest
  context for every slot).
- **Colocated** (``mode="colocated"``): every chip generates, then every chip trains; each phase
  switch frees the other's memory (:func:`phase_switch_seconds`: the engine's weights back
  on-chip after training, the trainer's state off and on when it is offloaded, over the
  chip-host link) and the new weights are copied into the engine in place (a chip-local copy).

Times in seconds, bytes, FLOP/s; lengths in tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rl_jax.sysmodel.accelerators import Accelerator, dtype_bytes
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.latency import RooflineLatency, TrainerModel
from rl_jax.sysmodel.lengths import LengthDistribution, LogNormalLengths
from rl_jax.sysmodel.shape import ModelShape
from rl_jax.sysmodel.simulator import SimConfig, simulate

MODES = ("colocated", "sync", "one_step_off", "async")
ENGINES = ("paged", "rl_jax")
REMAT = ("full", "dots", "none")

# Decode step = roofline / DECODE_EFFICIENCY + DECODE_STEP_OVERHEAD_S (+ TP all-reduces), fitted
# on two batch-1 points: this project's engine on one H100 at qwen2.5-0.5b (1.13 ms per step
# against a 0.29 ms memory roofline; docs/performance.md, "One H100") and vLLM 0.23 serving
# Llama-3.1-8B on one A100 40GB (about 75 tokens/s, i.e. 13.3 ms per step, against a 10.3 ms
# roofline at 1,555 GB/s; https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on).
# Two points, two unknowns: 1 / efficiency = (13.3 - 1.13) / (10.3 - 0.29).
DECODE_EFFICIENCY = (10.3 - 0.29) / (13.3 - 1.13)  # 0.82
DECODE_STEP_OVERHEAD_S = 1.13e-3 - 0.29e-3 / DECODE_EFFICIENCY  # 0.78 ms


@dataclasses.dataclass(frozen=True)
class TrainerWork:
    """What the trainer computes per trained token and how its chips share the model.

    Attributes:
      logprob_passes: forward passes of the policy before the update (1: the old policy's
        log-probs recomputed, as verl and NeMo-RL do by default; 0: the rollout's own used).
      reference: a reference model's forward pass (a KL term to it in the loss or the reward).
      remat: ``full`` (one more forward in the backward pass), ``dots`` or ``none``.
      mfu: fraction of the dense peak the trainer's matmuls reach.
      model_parallel: chips holding one replica (tensor × pipeline × context parallel); the
        rest are data-parallel.
      tensor_parallel: the tensor-parallel part of ``model_parallel`` (its activations are
        all-reduced twice per layer in every forward pass and twice in the backward).
      shard_params: parameters sharded over the data-parallel chips (FSDP / ZeRO-3: gathered
        for the forward and again for the backward pass).
      grad_dtype: dtype of the gradient and parameter collectives.
      offload: the trainer's parameters and optimizer state leave the chips while they
        generate (colocated).
    """

    logprob_passes: int = 1
    reference: bool = False
    remat: str = "full"
    mfu: float = 0.4
    model_parallel: int = 1
    tensor_parallel: int = 1
    shard_params: bool = True
    grad_dtype: str = "bfloat16"
    offload: bool = False

    def __post_init__(self):
        if self.remat not in REMAT:
            raise SysModelError(f"remat must be one of {REMAT}, got {self.remat!r}")
        if self.logprob_passes < 0:
            raise SysModelError(f"logprob_passes must be >= 0, got {self.logprob_passes}")
        if not 0 < self.mfu <= 1:
            raise SysModelError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.model_parallel < 1:
            raise SysModelError(f"model_parallel must be >= 1, got {self.model_parallel}")
        if self.tensor_parallel < 1 or self.model_parallel % self.tensor_parallel:
            raise SysModelError(f"tensor_parallel={self.tensor_parallel} must divide "
                                f"model_parallel={self.model_parallel}")
        dtype_bytes(self.grad_dtype)

    @property
    def forward_passes(self) -> float:
        """Forward passes per token besides the one of forward+backward."""
        return self.logprob_passes + int(self.reference) + (self.remat == "full")


def trainer_flops_per_token(shape: ModelShape, work: TrainerWork, seq_len: float) -> float:
    """FLOPs per trained token: forward+backward plus the extra forward passes."""
    train = shape.train_flops_per_token(seq_len)
    return train + work.forward_passes * train / 3


def trainer_comm_seconds(shape: ModelShape, accelerator: Accelerator, chips: int,
                         work: TrainerWork) -> float:
    """Seconds of data-parallel collectives per optimizer step (see the module docstring)."""
    dp = chips // work.model_parallel
    if dp <= 1:
        return 0.0
    share = shape.params * dtype_bytes(work.grad_dtype) / work.model_parallel
    collectives = 3 if work.shard_params else 2
    per_host = accelerator.chips_per_host
    within = per_host is None or chips <= per_host
    bandwidth = accelerator.link_bandwidth if within else accelerator.network_bandwidth
    latency = accelerator.collective_latency_s * 2 * (dp - 1)
    return collectives * ((dp - 1) / dp * share / bandwidth + latency)


def tensor_parallel_seconds_per_token(shape: ModelShape, accelerator: Accelerator,
                                      work: TrainerWork, dtype: str = "bfloat16") -> float:
    """Seconds of tensor-parallel all-reduces one replica spends per trained token: two per
    layer in every forward pass (forward+backward's own and :attr:`TrainerWork.forward_passes`)
    and two in the backward, each of the token's ``[D]`` activations, ring traffic
    ``2·(tp−1)/tp`` of it, over the within-host link (a tensor-parallel group sits in a host)."""
    tp = work.tensor_parallel
    if tp <= 1:
        return 0.0
    all_reduces = 2 * (1 + work.forward_passes) + 2
    buffer = shape.hidden_size * dtype_bytes(dtype)
    return (shape.num_layers * all_reduces * 2 * (tp - 1) / tp * buffer
            / accelerator.link_bandwidth)


def trainer_model(shape: ModelShape, accelerator: Accelerator, chips: int, work: TrainerWork,
                  *, seq_len: float, optimizer_steps: int, dtype: str = "bfloat16",
                  param_dtype: str = "float32") -> TrainerModel:
    """The trainer pool's step time for one RL batch: its tokens at the work per token, and per
    optimizer step the collectives and the AdamW update."""
    peak = accelerator.flops(dtype) * chips * work.mfu
    replicas = max(1, chips // work.model_parallel)
    seconds_per_token = (trainer_flops_per_token(shape, work, seq_len) / peak
                         + tensor_parallel_seconds_per_token(shape, accelerator, work, dtype)
                         / replicas)
    tokens_per_s = 1 / seconds_per_token
    p = dtype_bytes(param_dtype)
    update = shape.params * ((2 * p + 8) + (p + 8)) / (chips * accelerator.memory_bandwidth)
    per_step = trainer_comm_seconds(shape, accelerator, chips, work) + update
    return TrainerModel(tokens_per_s, optimizer_steps * per_step,
                        source=f"{chips}x {accelerator.name}, MFU {work.mfu:.2f}, "
                               f"{1 + work.forward_passes:g} passes per token")


def decode_latency(shape: ModelShape, accelerator: Accelerator, tensor_parallel: int, *,
                   max_context: int, dtype: str = "bfloat16",
                   memory_fraction: float = 0.9) -> RooflineLatency:
    """The decode step model: roofline at the fitted efficiency plus the fixed cost per step."""
    return RooflineLatency(shape, accelerator, tensor_parallel=tensor_parallel, dtype=dtype,
                           efficiency=DECODE_EFFICIENCY, memory_fraction=memory_fraction,
                           max_context=max_context, step_overhead_s=DECODE_STEP_OVERHEAD_S)


def generator_slots(shape: ModelShape, accelerator: Accelerator, tensor_parallel: int, *,
                    engine: str, prompt_len: float, lengths: LengthDistribution,
                    memory_fraction: float = 0.85, max_running: int = 1024,
                    dtype: str = "bfloat16") -> int:
    """Concurrent sequences one server holds.

    ``paged``: the KV pool (``memory_fraction`` of each chip's memory less its share of the
    weights) over the live tokens of a sequence (its prompt and half its mean response), capped
    by ``max_running``. ``rl_jax``: this project's server, a cache at the longest context for
    every slot (:class:`~rl_jax.sysmodel.latency.RooflineLatency.max_batch`)."""
    if engine not in ENGINES:
        raise SysModelError(f"generator engine must be one of {ENGINES}, got {engine!r}")
    latency = RooflineLatency(shape, accelerator, tensor_parallel=tensor_parallel, dtype=dtype,
                              memory_fraction=memory_fraction,
                              max_context=int(prompt_len + lengths.max_length))
    if engine == "rl_jax":
        return latency.max_batch
    room = (accelerator.memory_capacity * memory_fraction - latency.weight_bytes_per_chip())
    if room <= 0:
        return 0
    live = prompt_len + lengths.mean / 2
    return int(min(max_running, room // (live * latency.kv_bytes_per_token_per_chip())))


def phase_switch_seconds(shape: ModelShape, accelerator: Accelerator, chips: int,
                         tensor_parallel: int, work: TrainerWork, *,
                         dtype: str = "bfloat16", param_dtype: str = "float32") -> float:
    """Seconds a colocated pool spends per RL step switching phases: the engine's weights
    offloaded and reloaded (sleep/wake), the trainer's state offloaded and reloaded when
    ``work.offload``, each over the chip-host link, and the new weights copied into the engine
    (chip-local, at memory bandwidth)."""
    link = accelerator.host_link_bandwidth or accelerator.link_bandwidth
    engine = shape.weight_bytes(dtype) / tensor_parallel
    seconds = 2 * engine / link + 2 * engine / accelerator.memory_bandwidth
    if work.offload:
        p = dtype_bytes(param_dtype)
        state = shape.params * (p + 8) / chips
        seconds += 2 * state / link
    return seconds


@dataclasses.dataclass(frozen=True)
class PagedLatency:
    """A roofline decode latency whose batch cap is a paged engine's (by live tokens)."""

    roofline: RooflineLatency
    max_batch: int

    def step_seconds(self, batch: int, context: float) -> float:
        return self.roofline.step_seconds(batch, context)

    def prefill_seconds_per_token(self, prompt_len: float) -> float:
        return self.roofline.prefill_seconds_per_token(prompt_len)


@dataclasses.dataclass(frozen=True)
class RLJob:
    """One RL job as laid out on a cluster.

    ``trainer_chips`` / ``generator_chips`` split the chips (ignored when colocated: all of them
    do both). ``prompts_per_step × samples_per_prompt`` samples make one RL step, trained in
    ``optimizer_steps`` mini-batches. ``max_lag`` bounds an async job's staleness."""

    shape: ModelShape
    accelerator: Accelerator
    mode: str
    chips: int
    prompts_per_step: int
    samples_per_prompt: int
    prompt_len: float
    lengths: LengthDistribution
    work: TrainerWork = TrainerWork()
    trainer_chips: int | None = None
    generator_chips: int | None = None
    generator_tp: int = 1
    engine: str = "paged"
    max_running: int = 1024
    memory_fraction: float = 0.85
    optimizer_steps: int = 1
    max_lag: int = 1
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.mode not in MODES:
            raise SysModelError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "colocated":
            if not self.trainer_chips or not self.generator_chips:
                raise SysModelError(f"a {self.mode} job needs trainer_chips and "
                                    "generator_chips")
            if self.trainer_chips + self.generator_chips > self.chips:
                raise SysModelError(f"{self.trainer_chips} trainer + {self.generator_chips} "
                                    f"generator chips exceed the job's {self.chips}")
        if self.generator_pool % self.generator_tp:
            raise SysModelError(f"{self.generator_pool} generator chips are not a multiple of "
                                f"generator_tp={self.generator_tp}")

    @property
    def generator_pool(self) -> int:
        return self.chips if self.mode == "colocated" else int(self.generator_chips)

    @property
    def trainer_pool(self) -> int:
        return self.chips if self.mode == "colocated" else int(self.trainer_chips)


def lognormal_with_mean(mean: float, sigma: float, max_length: int) -> LogNormalLengths:
    """The clipped log-normal of ``sigma`` and ``max_length`` whose mean is ``mean``."""
    if not 1 <= mean < max_length:
        raise SysModelError(f"mean response length {mean} must be in [1, {max_length})")
    lo, hi = 1.0, float(max_length)
    for _ in range(100):  # the clipped mean grows with the median: bisect
        mid = math.sqrt(lo * hi)
        if LogNormalLengths(mid, sigma, max_length).mean < mean:
            lo = mid
        else:
            hi = mid
    return LogNormalLengths(math.sqrt(lo * hi), sigma, max_length)


def predict_step(job: RLJob, *, steps: int = 4, seed: int = 0) -> dict[str, Any]:
    """Seconds per RL step of ``job`` in steady state, with its parts: ``train_s`` (the
    trainer's step on one batch), ``switch_s`` (colocated), ``slots`` per server, ``servers``,
    and the simulation's idle fractions and staleness."""
    shape, acc, work = job.shape, job.accelerator, job.work
    seq_len = job.prompt_len + job.lengths.mean
    trainer = trainer_model(shape, acc, job.trainer_pool, work, seq_len=seq_len,
                            optimizer_steps=job.optimizer_steps, dtype=job.dtype)
    tp = job.generator_tp
    servers = job.generator_pool // tp
    slots = generator_slots(shape, acc, tp, engine=job.engine, prompt_len=job.prompt_len,
                            lengths=job.lengths, memory_fraction=job.memory_fraction,
                            max_running=job.max_running, dtype=job.dtype)
    if slots < 1:
        raise SysModelError(f"{shape.name or 'the model'} does not fit a generator server of "
                            f"{tp} {acc.name}")
    latency = decode_latency(shape, acc, tp, dtype=job.dtype,
                             max_context=int(job.prompt_len + job.lengths.max_length),
                             memory_fraction=job.memory_fraction)
    if job.engine == "paged":  # the pool's capacity is by live tokens, not by slot count
        latency = PagedLatency(latency, slots)
    switch_s = 0.0
    transfer_s = 0.0
    if job.mode == "colocated":
        switch_s = phase_switch_seconds(shape, acc, job.chips, tp, work, dtype=job.dtype)
        trainer = dataclasses.replace(trainer,
                                      step_overhead_s=trainer.step_overhead_s + switch_s)
    sim_mode = "sync" if job.mode == "colocated" else job.mode
    prefill = latency.prefill_seconds_per_token(job.prompt_len)
    cfg = SimConfig(mode=sim_mode, prompt_len=int(round(job.prompt_len)),
                    group_size=job.samples_per_prompt, groups_per_batch=job.prompts_per_step,
                    max_lag=max(job.max_lag, 1 if sim_mode == "one_step_off" else 0),
                    num_servers=servers, slots_per_server=slots, num_steps=steps,
                    weight_transfer_s=transfer_s, prefill_s_per_token=prefill,
                    warmup_steps=1, seed=seed)
    result = simulate(cfg, latency, trainer, job.lengths)
    tokens = job.prompts_per_step * job.samples_per_prompt * seq_len
    return {"step_s": result.step_s, "train_s": trainer.step_seconds(tokens),
            "switch_s": switch_s, "servers": servers, "slots": slots,
            "trainer_idle_fraction": result.trainer_idle_fraction,
            "generator_idle_fraction": result.generator_idle_fraction,
            "staleness_max": result.staleness_max, "mode": job.mode}
