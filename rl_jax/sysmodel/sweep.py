"""Layout sweep: how to split a budget of accelerators between the trainer and the generators.

A layout is (mode, trainer chips, generator chips, tensor-parallel degree per server, slots per
server). For every layout in the budget the sweep

1. rejects what cannot run, counting the reasons: a generator server whose memory
   (:func:`memory.generator_memory`: weights, decode layout, KV cache of its slots at the
   workload's longest context, the weight-update copy, prefill) exceeds the chip's budget; a
   trainer whose step (:func:`memory.trainer_memory`: state, gradients, saved activations and
   the largest transient, FSDP over its chips) exceeds it; heads not divisible by TP;
   one-step-off with ``max_lag < 1``;
2. estimates steady-state throughput in closed form (:func:`invariants.steady_state`), with
   each layout's weight update priced over the link its placement picks (within one host, or
   across hosts when the layout needs more chips than a host holds; :mod:`weightsync`);
3. simulates the best estimates of each mode, plus the best layout of each of a few train/generate
   splits (for the split plot), with the discrete-event simulator;
4. returns the best simulated layout whose staleness stays within the limit, and the Pareto
   frontier of simulated layouts over (steady tokens/s, mean staleness).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rl_jax.sysmodel.accelerators import Accelerator
from rl_jax.sysmodel.cluster import TrainerWork, phase_switch_seconds
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.invariants import Workload, steady_state
from rl_jax.sysmodel.latency import MeasuredLatency, RooflineLatency, TrainerModel
from rl_jax.sysmodel.memory import LORA_TARGETS, GiB, trainer_memory
from rl_jax.sysmodel.memory_serving import generator_memory
from rl_jax.sysmodel.shape import ModelShape
from rl_jax.sysmodel.simulator import MODES, SimConfig, SimResult, simulate
from rl_jax.sysmodel.weightsync import WeightSync, transfer_breakdown


@dataclasses.dataclass(frozen=True)
class Layout:
    mode: str
    num_train: int
    num_generate: int  # chips of the generator pool: num_servers × tensor_parallel
    tensor_parallel: int
    num_servers: int
    slots_per_server: int


@dataclasses.dataclass
class LayoutResult:
    """A layout with its closed-form estimate and, when simulated, the simulation."""

    layout: Layout
    estimate: dict[str, Any]
    transfer_s: float
    sim: SimResult | None = None
    transfer_link: str = ""  # the link the weight update takes (placement)
    trainer_bytes: float = 0.0  # per trainer chip (memory.trainer_memory)
    generator_bytes: float = 0.0  # per generator chip (memory.generator_memory)
    trainer: TrainerModel | None = dataclasses.field(default=None, repr=False)
    latency: Any = dataclasses.field(default=None, repr=False)

    @property
    def chips(self) -> int:
        """Chips the layout takes: one pool for both phases when colocated."""
        lay = self.layout
        return lay.num_train if lay.mode == "colocated" else lay.num_train + lay.num_generate

    @property
    def tokens_per_s(self) -> float:
        """Steady-state trained tokens/s: simulated when available, else estimated."""
        return self.sim.steady_tokens_per_s if self.sim else self.estimate["tokens_per_s"]

    @property
    def staleness_max(self) -> float:
        return self.sim.staleness_max if self.sim else self.estimate["staleness_estimate"]

    @property
    def staleness_mean(self) -> float:
        return self.sim.staleness_mean if self.sim else self.estimate["staleness_estimate"]

    def row(self) -> dict[str, Any]:
        """One line of the plan table."""
        lay, sim = self.layout, self.sim
        out = {"mode": lay.mode, "train": lay.num_train, "generate": lay.num_generate,
               "tp": lay.tensor_parallel, "servers": lay.num_servers,
               "slots": lay.slots_per_server, "tokens_per_s": self.tokens_per_s,
               "tokens_per_s_per_chip": self.tokens_per_s / self.chips,
               "estimate_tokens_per_s": self.estimate["tokens_per_s"],
               "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max,
               "staleness_ungated": self.estimate["staleness_ungated"],
               "bottleneck": self.estimate["bottleneck"], "transfer_s": self.transfer_s,
               "transfer_link": self.transfer_link,
               "trainer_gib_per_chip": self.trainer_bytes / GiB,
               "generator_gib_per_chip": self.generator_bytes / GiB,
               "step_s": sim.step_s if sim else self.estimate["step_s"]}
        if sim:
            out.update(trainer_idle=sim.trainer_idle_fraction,
                       generator_idle=sim.generator_idle_fraction,
                       slot_utilisation=sim.generator_slot_utilisation)
        return out


def generator_memory_for(shape: ModelShape, opt: SweepOptions, tensor_parallel: int,
                         slots: int, workload: Workload):
    """:func:`memory.generator_memory` of one server of a layout."""
    return generator_memory(shape, tensor_parallel=tensor_parallel, max_slots=slots,
                            max_seq_len=workload.max_context, dtype=opt.dtype,
                            prefill_tokens=min(opt.prefill_tokens,
                                               slots * workload.max_context),
                            prefill_len=workload.prompt_len, page_size=opt.page_size,
                            kv_cache_bytes=opt.kv_cache_bytes)


@dataclasses.dataclass
class SweepResult:
    best: LayoutResult | None
    frontier: list[LayoutResult]
    simulated: list[LayoutResult]
    evaluated: list[LayoutResult]  # every feasible layout, estimated
    by_split: dict[str, list[LayoutResult]]  # per mode: best estimate per trainer size
    rejected: dict[str, int]
    staleness_limit: int


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """Knobs of the sweep. ``decode_efficiency`` scales the decode roofline, ``mfu`` the
    trainer's peak; ``weight_sync`` prices weight updates (the link by each layout's placement:
    the accelerator's within-host link when the layout fits on one host, its across-host network
    otherwise); ``transfer_bandwidth`` (bytes/s one way per chip, measured) replaces that link
    and its efficiency; measured inputs replace the first-principles models.

    Memory (:mod:`memory`): a trainer compiles its step for ``micro_batch_rows`` rows (default
    one per trainer chip) of the workload's longest sample, with ``remat``, ``logits_block``
    and ``attention`` (default: fused kernels on accelerators, materialised scores on a CPU);
    a generator server holds ``slots`` sequences of that length and prefills up to
    ``prefill_tokens`` prompt tokens at once, its KV cache a pool of ``kv_cache_bytes`` when
    given (weights and pool must fit; a pool that cannot hold one sequence of the longest
    context is refused). Either must fit in ``memory_fraction`` of a chip.
    """

    modes: tuple[str, ...] = MODES
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    mfu: float = 0.4
    # Forward passes per trained token besides forward+backward (a reference model's, the old
    # policy's log-probs recomputed, the remat recompute): cluster.TrainerWork.forward_passes.
    forward_passes: float = 0.0
    decode_efficiency: float = 0.6
    memory_fraction: float = 0.9
    remat: str = "full"  # the trainer's layer rematerialisation
    micro_batch_rows: int | None = None  # rows per trainer micro-batch (default one per chip)
    # how the trainer sums micro-batches' gradients (memory.ACCUMULATION) and whether it keeps a
    # parameter average (trainer.ema_decay > 0)
    accumulation: str = "none"
    ema: bool = False
    # low-rank adapters train over a frozen base (lora.enabled): their rank and targets
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    logits_block: int = 4096
    attention: str | None = None  # trainer attention: "materialised"/"fused" (None: by chip)
    prefill_tokens: int = 2048  # prompt tokens per generator prefill (engine.max_prefill_tokens)
    # A generator server's KV-cache budget (bytes per server, its --kv_cache_bytes) in pages of
    # page_size positions; 0: every slot holds the longest context (slots x max_context).
    kv_cache_bytes: int = 0
    page_size: int = 64
    transfer_bandwidth: float | None = None
    weight_sync: WeightSync = WeightSync()
    trainer_tokens_per_s_per_chip: float | None = None
    measured_latency: MeasuredLatency | None = None
    staleness_limit: int | None = None  # default: the workload's max_lag
    num_steps: int = 12
    simulate_top: int = 2  # per mode
    split_points: int = 8  # per mode, for the split plot
    max_splits: int = 128  # trainer sizes tried (evenly spread when the budget is larger)
    seed: int = 0


def _trainer_sizes(total: int, limit: int) -> list[int]:
    sizes = list(range(1, total))
    if len(sizes) <= limit:
        return sizes
    return sorted({int(round(x)) for x in np.geomspace(1, total - 1, limit)})


def sweep(shape: ModelShape, accelerator: Accelerator, num_accelerators: int,
          workload: Workload, options: SweepOptions | None = None) -> SweepResult:
    """Evaluates every layout of ``num_accelerators`` chips (see the module docstring)."""
    opt = options or SweepOptions()
    if num_accelerators < 2:
        raise SysModelError(f"a layout needs at least 2 accelerators (one per pool), got "
                            f"{num_accelerators}")
    unknown = [m for m in opt.modes if m not in MODES]
    if unknown or not opt.modes:
        raise SysModelError(f"unknown modes {unknown}; choose from {MODES}")
    limit = workload.max_lag if opt.staleness_limit is None else opt.staleness_limit
    rejected: collections.Counter = collections.Counter()
    sync = opt.weight_sync
    if opt.transfer_bandwidth:
        sync = dataclasses.replace(sync, link_efficiency=1.0)
    tps = (1,) if opt.measured_latency is not None else opt.tensor_parallel

    budget_bytes = accelerator.memory_capacity * opt.memory_fraction
    budget = f"{budget_bytes / GiB:.1f} GiB"
    servers_options = []  # (tp, batch, latency model, prefill s/token, swap s, bytes per chip)
    first_misfit: dict[int, tuple[int, float]] = {}
    for tp in tps:
        if shape.num_heads % tp:
            rejected[f"{shape.num_heads} heads not divisible by tp={tp}"] += 1
            continue
        roof = RooflineLatency(shape, accelerator, tp, opt.dtype, opt.decode_efficiency,
                               opt.memory_fraction, workload.max_context)
        latency = opt.measured_latency or roof
        prefill = 0.0 if opt.measured_latency else roof.prefill_seconds_per_token(
            workload.prompt_len)
        swap = 2 * roof.weight_bytes_per_chip() / accelerator.memory_bandwidth
        for batch in opt.batches:
            memory = generator_memory_for(shape, opt, tp, batch, workload)
            if memory.notes["kv_tokens"] < workload.max_context:
                rejected[f"the KV-cache budget ({opt.kv_cache_bytes / GiB:.2f} GiB per server) "
                         f"holds {memory.notes['kv_tokens']} tokens, fewer than one sequence "
                         f"of {workload.max_context}"] += 1
                continue
            need = memory.total
            if need > budget_bytes:
                # One reason per tp, naming the fewest slots tried (batches ascend).
                first = first_misfit.setdefault(tp, (batch, need))
                rejected[f"generator memory does not fit at tp={tp} ({first[1] / GiB:.1f} GiB "
                         f"per chip at {first[0]} slots, the fewest refused; > {budget})"] += 1
                continue
            servers_options.append((tp, batch, latency, prefill, swap, need))

    evaluated: list[LayoutResult] = []
    attention = opt.attention or ("materialised" if accelerator.name == "cpu" else "fused")
    trainer_misfits: list[tuple[int, float]] = []  # (chips, bytes per chip)
    for num_train in _trainer_sizes(num_accelerators, opt.max_splits):
        rows = opt.micro_batch_rows or num_train
        trainer_bytes = trainer_memory(
            shape, batch=rows, seq=workload.max_context, mesh=(1, num_train, 1),
            dtype=opt.dtype, param_dtype=opt.param_dtype, remat=opt.remat,
            logits_block=opt.logits_block, attention=attention,
            backend="cpu" if accelerator.name == "cpu" else "accelerator",
            accumulation=opt.accumulation, ema=opt.ema, lora_rank=opt.lora_rank,
            lora_targets=opt.lora_targets).total
        if trainer_bytes > budget_bytes:
            trainer_misfits.append((num_train, trainer_bytes))
            continue
        if opt.trainer_tokens_per_s_per_chip:
            trainer = TrainerModel.from_measured(opt.trainer_tokens_per_s_per_chip, num_train)
        else:
            trainer = TrainerModel.from_flops(shape, accelerator, num_train, mfu=opt.mfu,
                                              seq_len=workload.tokens_per_sample,
                                              dtype=opt.dtype, param_dtype=opt.param_dtype,
                                              forward_passes=opt.forward_passes)
        num_generate = num_accelerators - num_train
        for tp, batch, latency, prefill, swap, generator_bytes in servers_options:
            servers = num_generate // tp
            if servers < 1 or num_generate % tp:
                continue
            priced = transfer_breakdown(
                shape.weight_bytes(opt.dtype), num_train=num_train, num_servers=servers,
                tensor_parallel=tp, accelerator=accelerator,
                link_bandwidth=opt.transfer_bandwidth, sync=sync)
            transfer = priced["total_s"]
            for mode in opt.modes:
                if mode == "colocated":
                    continue  # one pool of every chip: below
                if mode == "one_step_off" and limit < 1:
                    rejected["one_step_off needs a staleness limit >= 1"] += 1
                    continue
                estimate = steady_state(
                    mode, latency=latency, trainer=trainer, workload=workload,
                    num_servers=servers, slots_per_server=batch, weight_transfer_s=transfer,
                    prefill_s_per_token=prefill,
                    run_samples=opt.num_steps * workload.samples_per_batch)
                estimate.update(swap_s=swap, prefill_s_per_token=prefill)
                layout = Layout(mode, num_train, num_generate, tp, servers, batch)
                evaluated.append(LayoutResult(layout, estimate, transfer, trainer=trainer,
                                              latency=latency, transfer_link=priced["link"],
                                              trainer_bytes=trainer_bytes,
                                              generator_bytes=generator_bytes))
    if "colocated" in opt.modes:
        evaluated += _colocated(shape, accelerator, num_accelerators, workload, opt,
                                servers_options, rejected, budget_bytes, attention)
    if trainer_misfits:  # one reason, naming the most chips refused (sizes ascend)
        chips, need = trainer_misfits[-1]
        rejected[f"trainer memory does not fit on {chips} chip{'s' if chips > 1 else ''}"
                 f"{' or fewer' if len(trainer_misfits) > 1 else ''} (FSDP, remat {opt.remat}: "
                 f"{need / GiB:.1f} GiB per chip > {budget})"] = len(trainer_misfits)
    if not evaluated:
        raise SysModelError(f"no layout of {num_accelerators} x {accelerator.name} can run this "
                            f"model: {dict(rejected)}")

    def run(result: LayoutResult) -> LayoutResult:
        if result.sim is None:
            lay = result.layout
            cfg = SimConfig(lay.mode, workload.prompt_len, workload.group_size,
                            workload.groups_per_batch, min(workload.max_lag, limit),
                            lay.num_servers, lay.slots_per_server, num_steps=opt.num_steps,
                            weight_transfer_s=result.transfer_s,
                            swap_pause_s=result.estimate["swap_s"],
                            prefill_s_per_token=result.estimate["prefill_s_per_token"],
                            shared_prompts=workload.shared_prompts, seed=opt.seed)
            result.sim = simulate(cfg, result.latency, result.trainer, workload.lengths)
        return result

    simulated: dict[int, LayoutResult] = {}
    by_split: dict[str, list[LayoutResult]] = {}
    for mode in opt.modes:
        mine = sorted((r for r in evaluated if r.layout.mode == mode),
                      key=lambda r: -r.estimate["tokens_per_s"])
        if not mine:
            continue
        for r in mine[:opt.simulate_top]:
            simulated[id(r)] = run(r)
        best_per_split: dict[int, LayoutResult] = {}
        for r in mine:
            best_per_split.setdefault(r.layout.num_train, r)
        splits = sorted(best_per_split)
        picks = {splits[int(i)] for i in np.linspace(0, len(splits) - 1,
                                                     min(opt.split_points, len(splits)))}
        picks.add(mine[0].layout.num_train)
        for n in picks:
            simulated[id(best_per_split[n])] = run(best_per_split[n])
        by_split[mode] = [best_per_split[n] for n in splits]

    within = [r for r in simulated.values() if r.sim.staleness_max <= limit]
    ranked = sorted(within, key=lambda r: -r.tokens_per_s)
    frontier = []
    for r in sorted(within, key=lambda r: (r.sim.staleness_mean, -r.tokens_per_s)):
        if not frontier or r.tokens_per_s > frontier[-1].tokens_per_s:
            frontier.append(r)
    return SweepResult(best=ranked[0] if ranked else None, frontier=frontier, simulated=ranked,
                       evaluated=evaluated, by_split=by_split, rejected=dict(rejected),
                       staleness_limit=limit)


def _colocated(shape: ModelShape, accelerator: Accelerator, chips: int, workload: Workload,
               opt: SweepOptions, servers_options: list, rejected: collections.Counter,
               budget_bytes: float, attention: str) -> list[LayoutResult]:
    """Colocated layouts: every chip generates, then trains (its servers of each tensor-parallel
    degree and batch that fit); the phase switch of :func:`cluster.phase_switch_seconds`, with
    the trainer's state offloaded while the engine holds the chips."""
    rows = opt.micro_batch_rows or chips
    trainer_bytes = trainer_memory(
        shape, batch=rows, seq=workload.max_context, mesh=(1, chips, 1), dtype=opt.dtype,
        param_dtype=opt.param_dtype, remat=opt.remat, logits_block=opt.logits_block,
        attention=attention, backend="cpu" if accelerator.name == "cpu" else "accelerator",
        accumulation=opt.accumulation, ema=opt.ema, lora_rank=opt.lora_rank,
        lora_targets=opt.lora_targets).total
    if trainer_bytes > budget_bytes:
        rejected[f"colocated: trainer memory does not fit on {chips} chips "
                 f"({trainer_bytes / GiB:.1f} GiB per chip)"] += 1
        return []
    if opt.trainer_tokens_per_s_per_chip:
        trainer = TrainerModel.from_measured(opt.trainer_tokens_per_s_per_chip, chips)
    else:
        trainer = TrainerModel.from_flops(shape, accelerator, chips, mfu=opt.mfu,
                                          seq_len=workload.tokens_per_sample, dtype=opt.dtype,
                                          param_dtype=opt.param_dtype,
                                          forward_passes=opt.forward_passes)
    out = []
    for tp, batch, latency, prefill, swap, generator_bytes in servers_options:
        if chips % tp:
            continue
        switch = phase_switch_seconds(shape, accelerator, chips, tp, TrainerWork(offload=True),
                                      dtype=opt.dtype, param_dtype=opt.param_dtype)
        estimate = steady_state("colocated", latency=latency, trainer=trainer,
                                workload=workload, num_servers=chips // tp,
                                slots_per_server=batch, weight_transfer_s=switch,
                                prefill_s_per_token=prefill,
                                run_samples=opt.num_steps * workload.samples_per_batch)
        estimate.update(swap_s=swap, prefill_s_per_token=prefill)
        out.append(LayoutResult(Layout("colocated", chips, chips, tp, chips // tp, batch),
                                estimate, switch, trainer=trainer, latency=latency,
                                transfer_link="phase switch (host link, chip-local copy)",
                                trainer_bytes=trainer_bytes,
                                generator_bytes=generator_bytes))
    return out


def format_table(results: Sequence[LayoutResult], title: str = "") -> str:
    """A fixed-width table of plan rows."""
    head = (f"{'mode':<12} {'train':>5} {'gen':>5} {'tp':>3} {'srv':>4} {'slots':>5} | "
            f"{'tok/s':>11} {'tok/s/chip':>10} {'est tok/s':>11} | {'stale mean':>10} "
            f"{'max':>4} {'ungated':>7} | {'trainer idle':>12} {'gen idle':>8} {'slots used':>10}"
            f" | {'step s':>8} {'xfer s':>7} {'bottleneck':>10}")
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in results:
        row = r.row()
        idle = (f"{row['trainer_idle']:12.1%} {row['generator_idle']:8.1%} "
                f"{row['slot_utilisation']:10.1%}" if "trainer_idle" in row else
                f"{'-':>12} {'-':>8} {'-':>10}")
        lines.append(
            f"{row['mode']:<12} {row['train']:>5} {row['generate']:>5} {row['tp']:>3} "
            f"{row['servers']:>4} {row['slots']:>5} | {row['tokens_per_s']:>11,.0f} "
            f"{row['tokens_per_s_per_chip']:>10,.0f} {row['estimate_tokens_per_s']:>11,.0f} | "
            f"{row['staleness_mean']:>10.2f} {row['staleness_max']:>4.0f} "
            f"{row['staleness_ungated']:>7} | {idle} | {row['step_s']:>8.3g} "
            f"{row['transfer_s']:>7.2g} {row['bottleneck']:>10}")
    return "\n".join(lines)
