"""PNG plots of a plan: the decode latency curve, throughput and staleness over the
train/generate split, and simulated pool utilisation over time (matplotlib, imported lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rl_jax.sysmodel.latency import MeasuredLatency, RooflineLatency
from rl_jax.sysmodel.sweep import LayoutResult, SweepResult

MODE_COLORS = {"sync": "C3", "one_step_off": "C1", "async": "C0", "colocated": "C2"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_latency(roofline: RooflineLatency, context: float, path: str | Path, *,
                 measured: MeasuredLatency | None = None, chosen_batch: int | None = None):
    """Decode step latency and tokens/s of one server against batch size, with the memory-bound
    and compute-bound regimes shaded and the KV-capacity cap marked."""
    plt = _pyplot()
    cap = roofline.max_batch
    top = max(cap if cap else 1, 2 * int(min(roofline.ridge_batch(context), 1e6)), 64)
    batches = np.unique(np.geomspace(1, top, 200).astype(int))
    memory = np.array([roofline.memory_seconds(b, context) for b in batches])
    compute = np.array([roofline.compute_seconds(b, context) for b in batches])
    total = np.array([roofline.step_seconds(b, context) for b in batches])
    ridge = roofline.ridge_batch(context)
    fig, (ax, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(batches, total * 1e3, "k-", lw=2, label="roofline step (incl. TP all-reduces)")
    ax.plot(batches, memory * 1e3, "C0--", label="memory roof: bytes / bandwidth")
    ax.plot(batches, compute * 1e3, "C3--", label="compute roof: FLOPs / peak")
    for a in (ax, ax_tps):
        a.axvspan(1, min(ridge, top), color="C0", alpha=0.08, label="memory-bound")
        if ridge < top:
            a.axvspan(ridge, top, color="C3", alpha=0.08, label="compute-bound")
        if cap:
            a.axvline(cap, color="k", ls=":", label=f"KV-cache cap ({cap} seqs)")
        if chosen_batch:
            a.axvline(chosen_batch, color="C2", ls="-.", label=f"chosen batch {chosen_batch}")
    ax_tps.plot(batches, batches / total, "k-", lw=2, label="roofline tokens/s")
    if measured is not None:
        mb = np.asarray(measured.batches)
        ms = np.asarray(measured.seconds)
        ax.plot(mb, ms * 1e3, "o", color="C2", label="measured")
        ax_tps.plot(mb, mb / ms, "o", color="C2", label="measured")
    acc = roofline.accelerator
    title = (f"{roofline.shape.name or 'model'} on {acc.name} x{roofline.tensor_parallel} "
             f"({roofline.dtype}, efficiency {roofline.efficiency:.2f}, context {context:.0f})")
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences)",
           ylabel="step latency (ms)", title=title)
    ax_tps.set(xscale="log", yscale="log", xlabel="decode batch (sequences)",
               ylabel="decode tokens/s per server", title="throughput of one server")
    for a in (ax, ax_tps):
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_split(result: SweepResult, path: str | Path):
    """Per mode: best estimated tokens/s for each trainer size (line) and simulated points
    (markers); simulated mean and max staleness, with the limit."""
    plt = _pyplot()
    fig, (ax, ax_st) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, rows in result.by_split.items():
        color = MODE_COLORS.get(mode, "k")
        x = [r.layout.num_train for r in rows]
        ax.plot(x, [r.estimate["tokens_per_s"] for r in rows], "-", color=color, alpha=0.5,
                label=f"{mode} (estimate)")
        sims = [r for r in rows if r.sim is not None]
        ax.plot([r.layout.num_train for r in sims], [r.sim.steady_tokens_per_s for r in sims],
                "o", color=color, label=f"{mode} (simulated)")
        ax_st.plot([r.layout.num_train for r in sims], [r.sim.staleness_mean for r in sims],
                   "o-", color=color, label=f"{mode} mean")
        ax_st.plot([r.layout.num_train for r in sims], [r.sim.staleness_max for r in sims],
                   "^:", color=color, label=f"{mode} max")
    if result.best is not None:
        ax.plot([result.best.layout.num_train], [result.best.tokens_per_s], "*", color="k",
                ms=14, label="best layout")
    ax_st.axhline(result.staleness_limit, color="k", ls="--", label="staleness limit")
    ax.set(xlabel="trainer accelerators (the rest generate)", ylabel="trained tokens/s",
           title="throughput over the train/generate split")
    ax_st.set(xlabel="trainer accelerators (the rest generate)",
              ylabel="staleness (optimizer steps)", title="staleness over the split")
    for a in (ax, ax_st):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilisation(results: Sequence[LayoutResult], path: str | Path):
    """Simulated trainer busy share and generator slot occupancy over time, one panel per
    layout (e.g. the best layout of each mode)."""
    plt = _pyplot()
    results = [r for r in results if r.sim is not None]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.6 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        t = np.asarray(r.sim.timeline["t"])
        ax.fill_between(t, r.sim.timeline["trainer_busy"], step="mid", alpha=0.35, color="C3",
                        label=f"trainer busy (idle {r.sim.trainer_idle_fraction:.0%})")
        ax.plot(t, r.sim.timeline["generator_slots"], color="C0", drawstyle="steps-mid",
                label=f"generator slots decoding (mean {r.sim.generator_slot_utilisation:.0%})")
        for end in r.sim.step_end_s:
            ax.axvline(end, color="k", lw=0.4, alpha=0.3)
        lay = r.layout
        ax.set(ylim=(0, 1.05), ylabel="share", title=(
            f"{lay.mode}: {lay.num_train} train / {lay.num_generate} generate (tp {lay.tensor_parallel}, "
            f"{lay.num_servers} servers x {lay.slots_per_server} slots): "
            f"{r.sim.steady_tokens_per_s:,.0f} tok/s, staleness mean {r.sim.staleness_mean:.2f} "
            f"max {r.sim.staleness_max}"))
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time (s); thin lines: optimizer steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
