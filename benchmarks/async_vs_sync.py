r"""Async vs one-step-off vs sync RL on the same cores, with long-tailed completion lengths.

Runs the RL recipe (``configs/tiny_rl.py`` by default) once per mode, each a real run (trainer
process pinned to one core, generator server pinned to the other), with lognormal completion
lengths generated with ``ignore_eos`` (p99/p50 >= 8; one per sample, as samples of one prompt
differ in length, or with ``--noper_sample_lengths`` one per prompt), and reports side by side:
trained tokens/s (and the ratio to sync), wall time to a target held-out accuracy, each pool's
idle fraction, and the staleness distribution.

Learning is measured outside the runs: each run writes its policy every ``--snapshot_every``
steps (``export.every``) with the wall time it had then, and runs no periodic evals (on the
servers, an eval takes generator time from the rollout in the overlapped modes only); after the
runs, every snapshot of each mode's reported run is evaluated greedily on ``--eval_examples``
held-out problems in this process. The target accuracy (unless given) is the base policy's plus
half of what the sync run gained (the mean of its last three snapshots), and each mode's time
to it is the wall time of its first snapshot at or above it; beside it, the time at which the
accuracy averaged over three consecutive snapshots first reaches it, which one lucky evaluation
of a noisy curve cannot decide.

A run named ``MODE/KEY=VALUE`` is that mode with one more config override
(``MODE/K1=V1/K2=V2``: with two), measured beside the others (by default ``async`` without
batch prefetching, ``trainer.prefetch=False``). Writes ``results/async_vs_sync.json`` and
``results/async_vs_sync.png``.

It also prints what bounds the overlapped modes: the most any overlap can gain over the sync run
(its training seconds against its waiting seconds), and the same bound with the trainer at the
speed it actually had in the async run (trained tokens per second of train steps). The two pools
share one machine: when both run at once, the trainer also shares the cache and memory bandwidth
with the generator and its core with the rollout client, so it trains slower than in sync mode.

    python benchmarks/async_vs_sync.py [--steps=100] [--modes=sync,one_step_off,async]
        [--base=DIR] [--target_accuracy=0.6] [--quick]
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

_STEPS = flags.DEFINE_integer("steps", 100, "Optimizer steps per mode.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of every mode, interleaved (each mode once, "
                                "then again); a mode is reported by its median run, since this "
                                "machine's speed drifts by ~10% between runs.")
_MODES = flags.DEFINE_list("modes", ["sync", "one_step_off", "async",
                                     "async/trainer.prefetch=False"],
                           "Runs: a mode, or MODE/KEY=VALUE[/KEY=VALUE...] for that mode with "
                           "more config overrides (a variant measured beside the others).")
_BASE = flags.DEFINE_string("base", "", "Base policy (HF dir); default: the recipe's base "
                            "policy, trained once into the work directory.")
_WORKDIR = flags.DEFINE_string("workdir", str(ROOT / "runs" / "bench_async_vs_sync"),
                               "Where the runs write.")
_TARGET = flags.DEFINE_float("target_accuracy", 0.0, "Held-out accuracy whose first crossing "
                             "is timed (0: the base accuracy plus half of the sync run's gain).")
_EVAL_EXAMPLES = flags.DEFINE_integer("eval_examples", 1024, "Held-out problems each snapshot "
                                      "is evaluated on (the standard error of an accuracy p is "
                                      "sqrt(p (1 - p) / n): 0.012 at p = 0.2).")
_SNAPSHOT_EVERY = flags.DEFINE_integer("snapshot_every", 0, "Steps between policy snapshots "
                                       "(0: a twentieth of the steps).")
_MAX_LAG = flags.DEFINE_integer("max_lag", 4, "Staleness bound of the async run.")
_MEDIAN = flags.DEFINE_float("median", 16.0, "Median completion tokens.")
_SIGMA = flags.DEFINE_float("sigma", 1.5, "Sigma of log completion length (p99/p50 = "
                            "exp(2.326 sigma)).")
_MAX_LEN = flags.DEFINE_integer("max_len", 256, "Longest completion (tokens).")
_PER_SAMPLE = flags.DEFINE_bool("per_sample_lengths", True, "One length per completion (each "
                                "sample of a group its own); false: one per prompt, shared by "
                                "its group.")
_QUICK = flags.DEFINE_bool("quick", False, "Few steps, small batches (a smoke run).")
_EXTRA = flags.DEFINE_multi_string("override", [], "More --config.x=y overrides for every run.")
_MEASURE = flags.DEFINE_string("measure_decode", "", "Internal: print the decode-step latency "
                               "curve of this HF checkpoint as JSON and exit.")
_GROUPS = flags.DEFINE_integer("groups_per_batch", 8, "Prompts per optimizer step.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "Samples per prompt.")
_LR = flags.DEFINE_float("learning_rate", 1e-4, "Peak learning rate of every run (the recipe's "
                         "5e-4 is for its 512 samples per step; small batches need less).")
_MICRO_ROWS = flags.DEFINE_integer("micro_batch_rows", 0, "Rows per trainer micro-batch (0: "
                                   "about 256 token slots, the size whose activations stay in a "
                                   "CPU core's L2 cache).")
_RESULTS_DIR = flags.DEFINE_string("results_dir", str(RESULTS), "Where the JSON and PNG go.")
_SLOTS = 64
PROMPT_TOKENS = 16  # at most, for the recipe's arithmetic prompts


def batch_shape() -> tuple[int, int]:
    """(prompts, samples per prompt) of one optimizer step."""
    return (8, 4) if _QUICK.value else (_GROUPS.value, _GROUP_SIZE.value)


def seq_len() -> int:
    """Rows of the training batch and the servers' context: the longest sample (prompt +
    completion) rounded up to a multiple of 64."""
    return -(-(_MAX_LEN.value + PROMPT_TOKENS) // 64) * 64


def micro_rows() -> int:
    """Trainer micro-batch rows: the flag, or rows of about 256 token slots in all."""
    return _MICRO_ROWS.value or max(1, 256 // seq_len())


def measure_decode_curve(model_dir: str) -> dict[int, float]:
    """Seconds per decode step of one engine by batch size (the generator's latency curve), on
    the cores this process may use."""
    import jax.numpy as jnp

    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.engine.weights import generator_rules, load_params
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.models.config import eos_ids
    cfg, params = load_params(model_dir, mesh=None, rules=generator_rules(), dtype=jnp.float32)
    engine = Engine(cfg, params, rules=generator_rules(), dtype=jnp.float32,
                    eos_token_ids=eos_ids(cfg),
                    engine_config=EngineConfig(max_slots=_SLOTS, max_seq_len=seq_len()))
    curve = {}
    try:
        for batch in (1, 2, 4, 8, 16, 32, 64):
            def timed(tokens: int) -> float:
                request = GenerateRequest([1, 5, 6, 13, 7, 8, 14], SamplingParams(
                    max_new_tokens=tokens, ignore_eos=True, n=batch, seed=0))
                best = math.inf
                for _ in range(3):
                    start = time.perf_counter()
                    engine.generate(request, timeout=600)
                    best = min(best, time.perf_counter() - start)
                return best
            # Mean step over the contexts a completion passes through (prefill cancels out).
            longest = min(_MAX_LEN.value, seq_len() - PROMPT_TOKENS)
            timed(longest)  # compiles every length bucket of this batch size
            curve[batch] = (timed(longest) - timed(16)) / (longest - 16)
    finally:
        engine.shutdown()
    return curve


def run_mode(label: str, base: Path, workdir: Path, steps: int, repeat: int = 0) -> dict:
    """One RL run, ``label`` being a mode or ``MODE/KEY=VALUE[/KEY=VALUE...]`` (that mode with
    the overrides ``--config.KEY=VALUE``); returns its summary and per-step records."""
    mode, *variant = label.split("/")
    out = workdir / (label.replace("/", "_") + (f"_{repeat}" if repeat else ""))
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    groups, group_size = batch_shape()
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={out}", f"--config.base.checkpoint={base}", f"--config.mode={mode}",
           f"--config.trainer.steps={steps}", f"--config.rollout.max_lag={_MAX_LAG.value}",
           f"--config.rollout.groups_per_batch={groups}",
           f"--config.rollout.group_size={group_size}",
           f"--config.optimizer.learning_rate={_LR.value}",
           f"--config.rollout.lengths.median={_MEDIAN.value}",
           f"--config.rollout.lengths.sigma={_SIGMA.value}",
           f"--config.rollout.lengths.max={_MAX_LEN.value}",
           f"--config.rollout.lengths.per_sample={_PER_SAMPLE.value}",
           f"--config.rollout.seq_len={seq_len()}", f"--config.generator.max_seq_len={seq_len()}",
           f"--config.generator.max_slots={_SLOTS}", "--config.eval.examples=128",
           f"--config.trainer.micro_batch_rows={micro_rows()}",
           "--config.eval.every=0", f"--config.export.every={snapshot_every(steps)}",
           "--config.checkpoint.every=1000000",
           *[f"--config.{o}" for o in _EXTRA.value],
           *[f"--config.{v}" for v in variant]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    print(f"[{label}] {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{label} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    print(f"[{label}] done in {time.perf_counter() - start:.0f} s: "
          f"{summary['trained_tokens_per_s']:.0f} trained tokens/s", flush=True)
    return {"summary": summary, "records": records, "workdir": out}


def snapshot_every(steps: int) -> int:
    return _SNAPSHOT_EVERY.value or max(steps // 20, 1)


def held_out_accuracies(model_dirs: list[Path], examples: int) -> list[float]:
    """Greedy held-out accuracy of each HF checkpoint in ``model_dirs`` (same architecture), on
    the recipe's first ``examples`` eval-split problems, with one engine in this process."""
    sys.path.insert(0, str(ROOT))
    from configs.tiny_rl import get_config
    from rl_jax.orchestrator.offline_eval import checkpoint_accuracies
    c = get_config()
    results = checkpoint_accuracies(c, model_dirs, examples=examples, slots=128,
                                    max_seq_len=2 * PROMPT_TOKENS + c.eval.max_new_tokens)
    return [r.accuracy for r in results]


def learning_curves(runs: dict, base: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Per run, ``(wall_s, version, held-out accuracy)`` of the base policy (at 0 s) and of
    every snapshot, all evaluated on the same ``--eval_examples`` problems."""
    from rl_jax.orchestrator.snapshots import list_snapshots
    snapshots = {mode: list_snapshots(run["workdir"]) for mode, run in runs.items()}
    dirs = [base] + [path for found in snapshots.values() for _, path in found]
    print(f"evaluating the base policy and {len(dirs) - 1} snapshots on "
          f"{_EVAL_EXAMPLES.value} held-out problems ...", flush=True)
    start = time.perf_counter()
    accuracies = iter(held_out_accuracies(dirs, _EVAL_EXAMPLES.value))
    base_acc = next(accuracies)
    print(f"  done in {time.perf_counter() - start:.0f} s; base policy {base_acc:.3f}")
    return {mode: [(0.0, 0, base_acc)] + [(meta["wall_s"], meta["version"], next(accuracies))
                                         for meta, _ in found]
            for mode, found in snapshots.items()}


# Snapshots averaged for the smoothed time to the target (see :func:`time_to`).
SMOOTH = 3


def time_to(curve: list[tuple[float, int, float]], target: float,
            window: int = 1) -> float | None:
    """Wall seconds of the first snapshot at or above ``target``; with ``window > 1``, of the
    first snapshot whose accuracy, averaged with that of the ``window - 1`` snapshots before it
    (never the base policy's), is at or above ``target``, so that a single lucky evaluation of a
    noisy curve cannot decide it."""
    trained = [(wall, acc) for wall, version, acc in curve if version > 0]
    return next((trained[i][0] for i in range(window - 1, len(trained))
                 if np.mean([acc for _, acc in trained[i - window + 1:i + 1]]) >= target), None)


def response_lengths(prompts: int) -> list[int]:
    """The completion lengths the runs are given, in stream order: per prompt position, one per
    sample (or one for the whole group)."""
    from rl_jax.rollout.request_plan import LognormalLengths
    length_of = LognormalLengths(_MEDIAN.value, _SIGMA.value, _MAX_LEN.value)
    samples = batch_shape()[1] if _PER_SAMPLE.value else 1
    return [length_of(p, i) for p in range(prompts) for i in range(samples)]


def measured_lengths(n: int = 20000) -> dict:
    lengths = np.array(response_lengths(-(-n // (batch_shape()[1] if _PER_SAMPLE.value else 1))))
    p50, p99 = np.percentile(lengths, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "p99_over_p50": float(p99 / p50),
            "mean": float(lengths.mean())}


def predict(runs: dict, base: Path, steps: int, lengths: dict) -> dict:
    """The systems model's prediction of each run from this machine's measured curves, printed
    beside what was measured."""
    from rl_jax.sysmodel.predict import predict_run
    cores = ["taskset", "-c", "1"] if (os.cpu_count() or 1) > 1 else []
    out = subprocess.run([*cores, sys.executable, __file__, f"--measure_decode={base}"],
                         cwd=ROOT, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    if out.returncode != 0:
        print(f"decode curve measurement failed:\n{out.stderr[-2000:]}")
        return {}
    curve = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    print("decode step latency (s) by batch: " +
          ", ".join(f"{b}: {t * 1e3:.2f} ms" for b, t in sorted(curve.items())))
    # The completion lengths the runs were given, replayed in stream order (enough positions for
    # every batch and the groups admitted ahead of it).
    response = response_lengths((steps + _MAX_LAG.value + 2) * batch_shape()[0])
    reference = runs.get("sync") or next(iter(runs.values()))
    # Trained tokens over seconds in train steps, past the first two steps (compilation).
    timed = [r for r in reference["records"] if "trainer/step_s" in r][2:]
    trainer_rate = float(sum(r["trainer/tokens_per_s"] * r["trainer/step_s"] for r in timed) /
                         max(sum(r["trainer/step_s"] for r in timed), 1e-9))
    transfer = [r["weights/total_s"] for r in reference["records"]
                if "weights/total_s" in r][2:]
    # The trainer's own serial work per step beyond the train step (packing the batch,
    # publishing, metrics and logging): its seconds neither training nor waiting.
    s = reference["summary"]
    sec, steps_run = s["trainer_seconds"], max(len(timed) + 2, 1)
    pack = float(np.median([r.get("trainer/pack_s", 0.0) for r in timed])) if timed else 0.0
    serial = (s["wall_s"] - sec["training"] - sec["waiting"] - sec["syncing"]) / steps_run + pack
    # The rollout side's CPU work per step in the trainer's process (client, scoring, weight
    # sync), measured while the sync trainer waited; in the overlapped modes it shares the
    # trainer's core with the train step.
    client_cpu = max(sec.get("cpu_while_idle", 0.0) / steps_run - pack, 0.0)
    # Per group between the server's engine and the trainer's side (HTTP, decoding, scoring).
    group_overhead = s.get("rollout/client_overhead_s", 0.0) / max(
        s.get("rollout/timed_groups", 0.0), 1.0)
    # Before the first batch, beyond generating it: connections and first requests.
    waits = [r["trainer/wait_s"] for r in reference["records"] if "trainer/wait_s" in r]
    startup = max(waits[0] - float(np.median(waits)), 0.0) if waits else 0.0
    print(f"measured in the {'sync' if 'sync' in runs else 'first'} run: trainer "
          f"{trainer_rate:.0f} tokens/s + {serial * 1e3:.1f} ms serial work per step, rollout "
          f"client {client_cpu * 1e3:.1f} ms CPU per step, weights "
          f"{np.median(transfer) * 1e3 if transfer else 0:.1f} ms to reach the server, "
          f"{group_overhead * 1e3:.1f} ms per group outside the engine, start-up "
          f"{startup:.2f} s")
    predictions = {}
    print(f"\n{'mode':<30}{'measured tok/s':>15}{'predicted':>11}{'error':>8}"
          f"{'stale max meas/pred':>21}")
    for mode, run in runs.items():
        s = run["summary"]
        p = predict_run(decode_latency=curve, trainer_tokens_per_s=trainer_rate,
                        response_lengths=response, prompt_len=7, group_size=batch_shape()[1],
                        groups_per_batch=batch_shape()[0], max_lag=s["max_lag"],
                        mode=s["mode"],
                        num_servers=1, slots_per_server=_SLOTS, num_steps=steps,
                        weight_transfer_s=float(np.median(transfer)) if transfer else 0.0,
                        trainer_step_overhead_s=serial + (
                            # the rollout client runs in the trainer's process, on its core:
                            # overlapped with training, its work per batch slows each step
                            client_cpu if s["mode"] != "sync" else 0.0),
                        group_overhead_s=group_overhead, startup_s=startup,
                        ordered_lengths=True, shared_group_length=not _PER_SAMPLE.value)
        error = p.tokens_per_s / s["trained_tokens_per_s"] - 1
        predictions[mode] = {**p.to_dict(), "measured_tokens_per_s": s["trained_tokens_per_s"],
                             "relative_error": error,
                             "measured_staleness_max": s["staleness/max"]}
        print(f"{mode:<30}{s['trained_tokens_per_s']:>15.0f}{p.tokens_per_s:>11.0f}"
              f"{error:>+8.0%}{s['staleness/max']:>12.0f} / {p.staleness_max}")
    return {"decode_curve": {str(k): v for k, v in curve.items()},
            "trainer_tokens_per_s": trainer_rate, "modes": predictions}


def main(argv):
    del argv
    if _MEASURE.value:
        print(json.dumps(measure_decode_curve(_MEASURE.value)))
        return
    workdir = Path(_WORKDIR.value)
    workdir.mkdir(parents=True, exist_ok=True)
    steps = 8 if _QUICK.value else _STEPS.value
    if _BASE.value:
        base = Path(_BASE.value)
    else:  # the recipe's own base policy (trained once into the work directory)
        from rl_jax.orchestrator.rl import ensure_base_checkpoint
        sys.path.insert(0, str(ROOT))
        from configs.tiny_rl import get_config
        base = ensure_base_checkpoint(get_config(), workdir)
    lengths = measured_lengths()
    print(f"completion lengths: p50 {lengths['p50']:.0f}, p99 {lengths['p99']:.0f} "
          f"(p99/p50 {lengths['p99_over_p50']:.1f}), mean {lengths['mean']:.1f} tokens")
    repeats = 1 if _QUICK.value else max(1, _REPEATS.value)
    every: dict[str, list[dict]] = {mode: [] for mode in _MODES.value}
    for repeat in range(repeats):
        for mode in _MODES.value:
            every[mode].append(run_mode(mode, base, workdir, steps, repeat))
    # Each mode by its median run (the lower middle one of an even count).
    runs = {mode: sorted(rs, key=lambda r: r["summary"]["trained_tokens_per_s"])[
        (len(rs) - 1) // 2] for mode, rs in every.items()}
    curves = learning_curves(runs, base)
    base_acc = next(iter(curves.values()))[0][2]
    # The accuracy sync ends at: the mean of its last three snapshots (one is noisy).
    sync_end = (float(np.mean([acc for _, _, acc in curves["sync"][-3:]]))
                if "sync" in curves else None)
    fractions = (0.25, 0.5, 0.75)
    targets = ({f: base_acc + f * (sync_end - base_acc) for f in fractions}
               if sync_end is not None else {})
    target = _TARGET.value or targets.get(0.5, base_acc + 0.02)
    sync_rate = runs["sync"]["summary"]["trained_tokens_per_s"] if "sync" in runs else None
    rows = []
    for mode, run in runs.items():
        s = run["summary"]
        rows.append({
            "mode": mode, "max_lag": s["max_lag"], "steps": s["steps"], "wall_s": s["wall_s"],
            "trained_tokens_per_s": s["trained_tokens_per_s"],
            "trained_tokens_per_s_runs": [r["summary"]["trained_tokens_per_s"]
                                          for r in every[mode]],
            "vs_sync": s["trained_tokens_per_s"] / sync_rate if sync_rate else None,
            "time_to_target_s": time_to(curves[mode], target),
            f"time_to_target_mean{SMOOTH}_s": time_to(curves[mode], target, SMOOTH),
            "time_to_fraction_of_sync_gain_s": {str(f): time_to(curves[mode], t)
                                                for f, t in targets.items()},
            "learning_curve": [{"wall_s": w, "version": v, "accuracy": a}
                               for w, v, a in curves[mode]],
            "trainer_idle_fraction": s["trainer_idle_fraction"],
            "generator_idle_fraction": s["generator_idle_fraction"],
            "staleness_max": s["staleness/max"], "staleness_mean": s["staleness/mean"],
            "staleness_histogram": s["staleness_histogram"],
            "accuracy_before": base_acc,
            "accuracy_after": curves[mode][-1][2],
            # The trainer's own speed: trained tokens per second spent in train steps.
            "trainer_tokens_per_s_training": s["trained_tokens"] / max(
                s["trainer_seconds"]["training"], 1e-9),
            # CPU seconds per thread over the steps (trainer process, generator servers), and
            # how many cores they kept busy on average
            "trainer_cpu_seconds": s.get("trainer_cpu_seconds", {}),
            "generator_cpu_seconds": s.get("generator_cpu_seconds", {}),
            "cores_busy": (sum(s.get("trainer_cpu_seconds", {}).values())
                           + sum(s.get("generator_cpu_seconds", {}).values()))
            / max(s["wall_s"], 1e-9),
            # the generators' decode steps per decode batch size
            "decode_batches": s.get("generator_decode_batches", {}),
            "generator_counters": s.get("generator_counters", {}),
        })
    print(f"\ntarget held-out accuracy {target:.3f} (base {base_acc:.3f}"
          + (f", sync ends at {sync_end:.3f}" if sync_end is not None else "")
          + f"; {_EVAL_EXAMPLES.value} problems); lengths p99/p50 "
          f"{lengths['p99_over_p50']:.1f}")
    print(f"{'mode':<30}{'tok/s':>8}{'vs sync':>9}{'t->target':>11}{'trainer idle':>14}"
          f"{'gen idle':>10}{'stale max':>11}{'stale mean':>12}{'acc':>14}")
    for r in rows:
        ttt = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "-"
        print(f"{r['mode']:<30}{r['trained_tokens_per_s']:>8.0f}"
              f"{(r['vs_sync'] or math.nan):>9.2f}{ttt:>11}{r['trainer_idle_fraction']:>14.2f}"
              f"{(r['generator_idle_fraction'] or math.nan):>10.2f}{r['staleness_max']:>11.0f}"
              f"{r['staleness_mean']:>12.2f}"
              f"{r['accuracy_before']:>7.2f}->{r['accuracy_after']:.2f}")
    if targets:
        print("wall seconds to a fraction of the sync run's accuracy gain: " + "; ".join(
            f"{r['mode']} " + ", ".join(
                f"{float(f):.0%} {'-' if t is None else f'{t:.1f}'}"
                for f, t in r["time_to_fraction_of_sync_gain_s"].items()) for r in rows))
    print("CPU seconds over the steps, by thread (median run of each mode; XLA's pool is "
          "tf_XLAEigen):")
    for r in rows:
        top = lambda d: ", ".join(f"{k} {v:.2f}" for k, v in list(d.items())[:4])  # noqa: E731
        print(f"  {r['mode']:<28} trainer [{top(r['trainer_cpu_seconds'])}]; generators "
              f"[{top(r['generator_cpu_seconds'])}]; {r['cores_busy']:.2f} cores busy")
    print("Decode steps by decode batch size (median run of each mode):")
    for r in rows:
        counts = {int(b): n for b, n in r["decode_batches"].items()}
        if counts:
            mean = sum(b * n for b, n in counts.items()) / sum(counts.values())
            print(f"  {r['mode']:<28} "
                  + ", ".join(f"{b}: {n}" for b, n in sorted(counts.items()))
                  + f" (mean batch {mean:.1f}; "
                  f"{r['generator_counters'].get('compactions', 0)} compactions)")
    bound = None
    if "sync" in runs:
        # Overlap can at best hide the shorter of the two phases of a sync step.
        sec = runs["sync"]["summary"]["trainer_seconds"]
        train, other = sec["training"], sec["waiting"] + sec["syncing"] + sec["publishing"]
        bound = (train + other) / max(train, other, 1e-9)
        print(f"sync run: {train:.1f} s training, {other:.1f} s waiting for generation and "
              f"weights -> any overlap of the two is at most {bound:.2f}x sync")
    speeds = {r["mode"]: r["trainer_tokens_per_s_training"] for r in rows}
    print("trainer tokens/s while training: " + ", ".join(
        f"{mode} {rate:.0f}" + (f" ({rate / speeds['sync']:.2f}x sync)"
                                if "sync" in speeds and mode != "sync" else "")
        for mode, rate in speeds.items()))
    bound_at_speed = None
    if bound is not None and "async" in speeds:
        # The same bound with the trainer at the speed it had in the async run: when both pools
        # run at once they share the machine's cache and memory bandwidth, and the trainer's
        # core also runs the rollout client.
        sec = runs["sync"]["summary"]["trainer_seconds"]
        total = sec["training"] + sec["waiting"] + sec["syncing"] + sec["publishing"]
        train_async = runs["sync"]["summary"]["trained_tokens"] / speeds["async"]
        bound_at_speed = total / max(train_async, 1e-9)
        print(f"  with the trainer at its async-run speed, overlap can give at most "
              f"{bound_at_speed:.2f}x sync")
    if repeats > 1:
        print(f"trained tokens/s of each of the {repeats} runs (the median one is reported): " +
              "; ".join(f"{r['mode']} " + ", ".join(f"{x:.0f}" for x in
                                                    r["trained_tokens_per_s_runs"])
                        for r in rows))
    if "async" in runs and sync_rate:
        if repeats > 1 and "sync" in every:
            pairs = [a["summary"]["trained_tokens_per_s"] / b["summary"]["trained_tokens_per_s"]
                     for a, b in zip(every["async"], every["sync"])]
            print("async / sync of each repeat (runs back to back): " +
                  ", ".join(f"{x:.2f}" for x in pairs))
        ratio = runs["async"]["summary"]["trained_tokens_per_s"] / sync_rate
        worst = max(r["summary"]["staleness/max"] for r in every["async"])
        print(f"async / sync trained tokens/s (medians): {ratio:.2f} (aim >= 1.8); async max "
              f"staleness over every run {worst:.0f} <= max_lag {_MAX_LAG.value}")
        times = {r["mode"]: r["time_to_target_s"] for r in rows}
        smoothed = {r["mode"]: r[f"time_to_target_mean{SMOOTH}_s"] for r in rows}
        if "sync" in times:
            show = lambda t: "not reached" if t is None else f"{t:.1f} s"  # noqa: E731
            print(f"time to held-out accuracy {target:.3f}: async {show(times['async'])}, "
                  f"sync {show(times['sync'])} (aim: async sooner); with the accuracy averaged "
                  f"over {SMOOTH} snapshots: async {show(smoothed['async'])}, "
                  f"sync {show(smoothed['sync'])}")
    result = {"benchmark": "async_vs_sync", "steps": steps, "repeats": repeats,
              "quick": _QUICK.value,
              "lengths": {"median": _MEDIAN.value, "sigma": _SIGMA.value,
                          "max": _MAX_LEN.value, "per_sample": _PER_SAMPLE.value, **lengths},
              "target_accuracy": target, "base_accuracy": base_acc, "sync_end_accuracy": sync_end,
              "eval_examples": _EVAL_EXAMPLES.value, "snapshot_every": snapshot_every(steps),
              "overrides": list(_EXTRA.value),
              "micro_batch_rows": micro_rows(),
              "batch": {"groups_per_batch": batch_shape()[0], "group_size": batch_shape()[1]},
              "rows": rows, "overlap_bound_vs_sync": bound,
              "overlap_bound_at_async_trainer_speed": bound_at_speed, "machine": {
                  "cpus": os.cpu_count(), "python": platform.python_version(),
                  "load_average": os.getloadavg()}}
    predictions = predict(runs, base, steps, lengths)
    result["predictions"] = predictions
    results = Path(_RESULTS_DIR.value)
    results.mkdir(parents=True, exist_ok=True)
    name = "async_vs_sync_quick" if _QUICK.value else "async_vs_sync"
    (results / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(rows, target, results / f"{name}.png")
    print(f"wrote {results / name}.json and .png")


def plot(rows: list[dict], target: float, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    # one color per run in every panel (variants: the ones after the modes' own)
    named = {"sync": "tab:gray", "one_step_off": "tab:blue", "async": "tab:green"}
    spare = iter(["tab:olive", "tab:purple", "tab:orange", "tab:red", "tab:brown", "tab:pink"])
    colors = {r["mode"]: named.get(r["mode"]) or next(spare, "tab:cyan") for r in rows}
    ax.bar([r["mode"].replace("/", "\n") for r in rows],
           [r["trained_tokens_per_s"] for r in rows], color=[colors[r["mode"]] for r in rows])
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("trained tokens/s")
    ax.set_title("throughput (same cores)")
    ax = axes[1]
    for r in rows:
        ax.plot([p["wall_s"] for p in r["learning_curve"]],
                [p["accuracy"] for p in r["learning_curve"]], marker=".", label=r["mode"],
                color=colors[r["mode"]])
    ax.axhline(target, color="black", linestyle=":", linewidth=1, label="target")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy (policy snapshots)")
    ax.legend(fontsize=7)
    ax = axes[2]
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        hist = {int(k): v for k, v in r["staleness_histogram"].items()}
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        ax.bar([k + i * width for k in ks], [hist[k] / total for k in ks], width=width,
               label=r["mode"], color=colors[r["mode"]])
    ax.set_xlabel("staleness (optimizer steps)")
    ax.set_ylabel("fraction of groups")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
