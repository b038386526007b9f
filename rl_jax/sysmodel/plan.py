"""The planner behind ``launch/plan.py``: recipe config + request → sweep → table, JSON, plots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rl_jax.sysmodel import plots
from rl_jax.sysmodel.accelerators import dtype_bytes, get_accelerator
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.invariants import Workload
from rl_jax.sysmodel.latency import MeasuredLatency, RooflineLatency
from rl_jax.sysmodel.lengths import EmpiricalLengths, LengthDistribution, LogNormalLengths
from rl_jax.sysmodel.memory import GiB, trainer_memory
from rl_jax.sysmodel.recipe import get, model_shape, recipe_value, rollout_settings
from rl_jax.sysmodel.simulator import MODES
from rl_jax.sysmodel.sweep import (SweepOptions, SweepResult, format_table,
                                  generator_memory_for, sweep)
from rl_jax.sysmodel.weightsync import PATHS, WeightSync, transfer_breakdown


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``None`` fields come from the recipe config (then defaults)."""

    accelerator: str
    num_accelerators: int
    max_lag: int | None = None
    modes: tuple[str, ...] = MODES
    dtype: str | None = None
    param_dtype: str | None = None
    mfu: float = 0.4
    decode_efficiency: float = 0.6
    prompt_len: int | None = None
    max_new_tokens: int | None = None
    median_length: float | None = None  # default: a quarter of max_new_tokens
    length_sigma: float = 0.8
    lengths_file: str = ""
    latency_file: str = ""
    latency_model: str | None = None
    trainer_tokens_per_s: float | None = None  # measured, per accelerator
    transfer_gbps: float | None = None  # GB/s one way per chip (measured; replaces the link)
    transfer_path: str = "direct"  # weight updates device to device, or staged through hosts
    tensor_parallel: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    steps: int = 12
    simulate_top: int = 2
    split_points: int = 8
    top: int = 10
    seed: int = 0
    kv_cache_bytes: int = 0  # a generator server's KV-cache budget (0: slots x max context)
    page_size: int = 64  # positions per page of that cache

    def validate(self):
        if self.num_accelerators < 2:
            raise SysModelError(f"--num_accelerators must be >= 2 (one trainer and one "
                                f"generator at least), got {self.num_accelerators}")
        if self.max_lag is not None and self.max_lag < 0:
            raise SysModelError(f"--max_lag must be >= 0, got {self.max_lag}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise SysModelError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
        if self.steps < 2:
            raise SysModelError(f"--steps must be >= 2, got {self.steps}")
        if self.transfer_path not in PATHS:
            raise SysModelError(f"--transfer_path must be one of {', '.join(PATHS)}, got "
                                f"{self.transfer_path!r}")
        if self.transfer_gbps is not None and self.transfer_gbps <= 0:
            raise SysModelError(f"--transfer_gbps must be > 0, got {self.transfer_gbps}")
        if self.kv_cache_bytes < 0:
            raise SysModelError(f"--kv_cache_bytes must be >= 0, got {self.kv_cache_bytes}")
        if self.page_size < 1:
            raise SysModelError(f"--page_size must be >= 1, got {self.page_size}")


@dataclasses.dataclass
class PlanReport:
    text: str
    files: dict[str, str]
    result: SweepResult
    summary: dict[str, Any]


def _lengths(req: PlanRequest, max_new_tokens: int) -> LengthDistribution:
    if req.lengths_file:
        return EmpiricalLengths.from_file(req.lengths_file)
    median = req.median_length or max(1.0, max_new_tokens / 4)
    return LogNormalLengths(median=median, sigma=req.length_sigma, max_length=max_new_tokens)


def _transfer_line(weight_bytes: float, accelerator, best, options: SweepOptions) -> str:
    """How the best layout's weight update is priced: its link by placement and the terms."""
    if best is None:
        return "weight transfer: no layout within the staleness limit"
    lay = best.layout
    sync = options.weight_sync
    if options.transfer_bandwidth:
        sync = dataclasses.replace(sync, link_efficiency=1.0)
    terms = transfer_breakdown(weight_bytes, num_train=lay.num_train,
                               num_servers=lay.num_servers, tensor_parallel=lay.tensor_parallel,
                               accelerator=accelerator,
                               link_bandwidth=options.transfer_bandwidth, sync=sync)
    where = "one host" if terms["same_host"] else "trainer and generators on different hosts"
    return (f"weight transfer ({sync.path} path, {where}): {terms['total_s']:.3g} s per update = "
            f"{terms['wire_s']:.3g} s over {terms['link']} "
            f"({terms['link_bandwidth'] / 1e9:,.1f} GB/s per chip x {sync.link_efficiency:g}) + "
            f"{terms['host_s']:.3g} s host staging + {terms['fixed_s']:.3g} s fixed")


def _describe(r) -> str:
    lay = r.layout
    where = (f"all {lay.num_train} chips generate then train" if lay.mode == "colocated" else
             f"{lay.num_train} train / {lay.num_generate} generate")
    return f"{lay.mode} ({where}, tp {lay.tensor_parallel}, {lay.slots_per_server} slots)"


def mode_choice(result: SweepResult) -> str:
    """Which mode the plan chose and why, with the best layout of the runner-up mode and its
    predicted step time beside it."""
    best = result.best
    if best is None:
        return "chosen: none (no layout within the staleness limit)"
    others = [r for r in result.simulated if r.layout.mode != best.layout.mode]
    step = best.row()["step_s"]
    text = f"chosen: {_describe(best)}, {step:.3g} s per step"
    sim = best.sim
    if best.layout.mode == "colocated":
        why = (f"one pool never waits for another; its phase switch costs {best.transfer_s:.3g} "
               "s per step")
    elif sim is not None:
        why = (f"the pools overlap (trainer idle {sim.trainer_idle_fraction:.0%}, generators "
               f"idle {sim.generator_idle_fraction:.0%}); bottleneck: "
               f"{best.estimate['bottleneck']}")
    else:
        why = f"bottleneck: {best.estimate['bottleneck']}"
    if not others:
        return f"{text} ({why}); no other mode within the staleness limit"
    runner = others[0]
    ratio = best.tokens_per_s / runner.tokens_per_s
    return (f"{text} ({why}); runner-up: {_describe(runner)}, {runner.row()['step_s']:.3g} s "
            f"per step ({ratio:.2f}x fewer tokens/s)")


def trainer_accumulation(config: Any) -> str:
    """How the recipe's trainer sums gradients (:data:`memory.ACCUMULATION`):
    ``trainer.micro_batch_rows`` streams fixed-shape micro-batches (``StreamingTrainStep``),
    ``trainer.num_microbatches > 1`` scans them in one program, else one batch."""
    if int(recipe_value(config, "trainer.micro_batch_rows")):
        return "streaming"
    return "scan" if int(recipe_value(config, "trainer.num_microbatches")) > 1 else "none"


def _memory_lines(shape, accelerator, best, workload: Workload,
                  options: SweepOptions) -> list[str]:
    """Memory per chip of the best layout's trainer and generator, term by term."""
    if best is None:
        return []
    lay = best.layout
    budget = accelerator.memory_capacity * options.memory_fraction
    attention = options.attention or ("materialised" if accelerator.name == "cpu" else "fused")
    rows = options.micro_batch_rows or lay.num_train
    trainer = trainer_memory(shape, batch=rows, seq=workload.max_context,
                             mesh=(1, lay.num_train, 1), dtype=options.dtype,
                             param_dtype=options.param_dtype, remat=options.remat,
                             logits_block=options.logits_block, attention=attention,
                             backend="cpu" if accelerator.name == "cpu" else "accelerator",
                             accumulation=options.accumulation, ema=options.ema,
                             lora_rank=options.lora_rank, lora_targets=options.lora_targets)
    generator = generator_memory_for(shape, options, lay.tensor_parallel,
                                     lay.slots_per_server, workload)
    adapters = (f", LoRA rank {options.lora_rank} over a frozen base"
                if options.lora_rank else "")
    return [f"trainer memory per chip (FSDP over {lay.num_train}{adapters}, {rows} rows x "
            f"{workload.max_context} tokens per micro-batch, remat {options.remat}, "
            f"{attention} attention): {trainer.describe()} of {budget / GiB:.1f} GiB usable",
            f"generator memory per chip (tp={lay.tensor_parallel}, {lay.slots_per_server} "
            f"slots x {workload.max_context} tokens, a KV pool of "
            f"{generator.notes['kv_tokens']} tokens): {generator.describe()} of "
            f"{budget / GiB:.1f} GiB usable"]


def run_plan(config: Any, req: PlanRequest, outdir: str | Path, *,
             base_dir: str | Path = ".") -> PlanReport:
    """Plans layouts for the recipe ``config``; writes ``plan.json``, ``latency.png``,
    ``split.png`` and ``utilisation.png`` into ``outdir`` and returns the printed text.

    Layouts whose trainer or generator does not fit a chip are refused (:mod:`memory`); the
    trainer's memory follows the config's ``model.remat``, ``trainer.micro_batch_rows``
    (default one row per trainer chip) and ``trainer.logits_block_size``."""
    req.validate()
    accelerator = get_accelerator(req.accelerator)
    shape = model_shape(config, base_dir=base_dir)
    settings = rollout_settings(config)
    max_lag = settings["max_lag"] if req.max_lag is None else req.max_lag
    max_new = int(req.max_new_tokens or settings["max_new_tokens"])
    prompt_len = int(req.prompt_len if req.prompt_len is not None else settings["prompt_len"])
    dtype = req.dtype or settings["dtype"] or "bfloat16"
    param_dtype = req.param_dtype or settings["param_dtype"] or "float32"
    for name in (dtype, param_dtype):
        dtype_bytes(name)  # an unknown dtype stops here with the known ones listed
    if dtype not in accelerator.peak_flops:
        raise SysModelError(f"{accelerator.name} lists no {dtype} peak (dtype "
                            f"{'requested' if req.dtype else 'of the config'}); choose --dtype "
                            f"from {sorted(accelerator.peak_flops)}")
    workload = Workload(prompt_len, int(settings["group_size"]), int(settings["groups_per_batch"]),
                        _lengths(req, max_new), int(max_lag))
    # The trainer's forward passes per token besides forward+backward: the remat recompute and
    # a reference model's when the loss has a KL to it (behaviour log-probs come from the
    # generators: no old-policy pass).
    remat = str(recipe_value(config, "model.remat"))
    forward_passes = float(remat == "full") + float(bool(get(config, "loss.options.kl_coef")))
    measured = None
    if req.latency_file:
        measured = MeasuredLatency.from_benchmark(req.latency_file, req.latency_model)
    options = SweepOptions(
        modes=tuple(req.modes), tensor_parallel=tuple(req.tensor_parallel),
        batches=tuple(req.batches), dtype=dtype, param_dtype=param_dtype, mfu=req.mfu,
        decode_efficiency=req.decode_efficiency,
        transfer_bandwidth=req.transfer_gbps * 1e9 if req.transfer_gbps else None,
        weight_sync=WeightSync(path=req.transfer_path),
        trainer_tokens_per_s_per_chip=req.trainer_tokens_per_s, measured_latency=measured,
        remat=remat, forward_passes=forward_passes,
        micro_batch_rows=int(recipe_value(config, "trainer.micro_batch_rows")) or None,
        accumulation=trainer_accumulation(config),
        ema=float(recipe_value(config, "trainer.ema_decay")) > 0,
        lora_rank=int(recipe_value(config, "lora.rank"))
        if bool(recipe_value(config, "lora.enabled")) else 0,
        lora_targets=tuple(recipe_value(config, "lora.targets")),
        kv_cache_bytes=req.kv_cache_bytes, page_size=req.page_size,
        logits_block=int(recipe_value(config, "trainer.logits_block_size")),
        num_steps=req.steps, simulate_top=req.simulate_top, split_points=req.split_points,
        seed=req.seed)
    result = sweep(shape, accelerator, req.num_accelerators, workload, options)

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / "plan.json"), "latency": str(out / "latency.png"),
             "split": str(out / "split.png"), "utilisation": str(out / "utilisation.png")}
    best = result.best
    tp = best.layout.tensor_parallel if best else 1
    roof = RooflineLatency(shape, accelerator, tp, dtype, req.decode_efficiency,
                           max_context=workload.max_context)
    context = prompt_len + workload.lengths.active_context
    ridge = roof.ridge_batch(context)
    plots.plot_latency(roof, context, files["latency"], measured=measured,
                       chosen_batch=best.layout.slots_per_server if best else None)
    plots.plot_split(result, files["split"])
    best_per_mode = []
    for mode in req.modes:
        mine = [r for r in result.simulated if r.layout.mode == mode]
        if mine:
            best_per_mode.append(mine[0])
    plots.plot_utilisation(best_per_mode, files["utilisation"])

    lines = [
        f"model: {shape.describe()}",
        f"accelerator: {accelerator.description} x{req.num_accelerators} ({dtype}; "
        f"{accelerator.flops(dtype) / 1e12:,.1f} TFLOP/s, "
        f"{accelerator.memory_bandwidth / 1e9:,.0f} GB/s, "
        f"{accelerator.memory_capacity / 1e9:,.0f} GB; source: {accelerator.source})",
        f"batch: {workload.groups_per_batch} prompts x {workload.group_size} samples, prompt "
        f"{prompt_len} tokens, max_lag {max_lag}"
        + (f" (defaults used for: {', '.join(settings['defaulted'])})"
           if settings["defaulted"] else ""),
        f"responses: {workload.lengths.describe()}",
        _transfer_line(shape.weight_bytes(dtype), accelerator, best, options),
        *_memory_lines(shape, accelerator, best, workload, options),
        f"decode roofline at tp={tp}: "
        + (f"memory-bound below batch {ridge:,.0f}, compute-bound above" if ridge < 1e12
           else "memory-bound at every batch (KV reads outweigh FLOPs)")
        + f"; KV cache holds {roof.max_batch} sequences of {workload.max_context} tokens"
        + (f"; measured latency {measured.source}" if measured else ""),
        mode_choice(result),
        "",
        format_table(result.simulated[:req.top],
                     f"best layouts (simulated {req.steps} steps; tok/s = trained tokens/s "
                     "after warm-up):"),
        "",
        format_table(best_per_mode, "best layout of each mode:"),
        "",
        format_table(result.frontier, "frontier (no layout has both more tok/s and lower mean "
                                      "staleness):"),
    ]
    if result.rejected:
        lines += ["", "rejected: " + "; ".join(f"{k} ({v})" for k, v in
                                               sorted(result.rejected.items()))]
    summary = {
        "model": dataclasses.asdict(shape), "params": shape.params,
        "accelerator": accelerator.to_dict(), "num_accelerators": req.num_accelerators,
        "workload": {"prompt_len": prompt_len, "group_size": workload.group_size,
                     "groups_per_batch": workload.groups_per_batch, "max_lag": max_lag,
                     "lengths": workload.lengths.summary()},
        "request": dataclasses.asdict(req),
        "best": best.row() if best else None,
        "choice": mode_choice(result),
        "frontier": [r.row() for r in result.frontier],
        "simulated": [r.row() for r in result.simulated],
        "rejected": result.rejected,
        "memory_budget_bytes": accelerator.memory_capacity * options.memory_fraction,
    }
    Path(files["json"]).write_text(json.dumps(summary, indent=1, default=str))
    lines += ["", "wrote " + ", ".join(files.values())]
    return PlanReport("\n".join(lines), files, result, summary)
