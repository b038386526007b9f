r"""Learning studies of the RL recipe: what limits held-out accuracy over a run, and how each
knob (batch size, staleness bound, loss, normalisation, filtering, temperature, schedule) moves
the curve.

Every run is a real run of ``configs/tiny_rl.py`` (trainer and generator server in their own
processes, each on its own core) from one shared base policy, limited by RL wall time, with the
recipe's held-out evaluation (greedy, ``eval.examples`` problems): periodic in the run, or (the
``modes`` study's default, ``--snapshot_every``) of the policy snapshots the run writes, after
it, so that evaluating does not take generator time from one mode's rollout and not another's.
A run is a variant
(a name and its ``--config.KEY=VALUE`` overrides) and a seed; variants come from a study:

  ``plateau``    the recipe's defaults against the knobs that move its ceiling
  ``staleness``  ``max_lag`` in {0, 1, 2, 4, 8, 16} x losses (GRPO + token TIS, decoupled PPO,
                 CISPO, M2PO, and GRPO + TIS with the learning rate scaled by the batch's ESS),
                 each run with a slowed trainer (``trainer.step_delay_s``) so that the generator
                 runs ahead and the bound is reached
  ``defaults``   the recipe exactly as the README runs it (the seeds' spread)
  ``ceiling``    full-length runs of the changes that may lift the end of the curve
  ``tools``      the tool-use recipe (``--recipe=configs/tool_rl.py``) with and without its tool
  ``modes``      the recipe in ``async``, ``one_step_off`` and ``sync`` mode (with
                 ``--reference=sync``: each mode's time to sync's final accuracy; with
                 ``--peers=FILE``: TRL's runs of the same task beside them)

and ``--variants=NAME,...`` keeps some of them. Per run, the per-step records give what changes
as the curve flattens: the fraction of groups with no reward signal, entropy, learning rate,
staleness, importance-ratio ESS, clipped fraction, gradient norm and the k3 KL between the
generator's behaviour log-probs and the trainer's (staleness plus numerical mismatch).

Writes ``results/learning_study/<study>.json`` (per run: held-out curve, time to each target,
final accuracy, per-step series) and ``<study>.png`` (one panel per quantity, one colour per
variant, one line per seed).

    python benchmarks/learning_study.py --study=plateau [--seeds=0,1] [--time_limit_s=300]
        [--variants=defaults,filter] [--base=DIR] [--override=KEY=VALUE]
        [--recipe=configs/tiny_rl_sglang.py] [--out=NAME]
    python benchmarks/learning_study.py --by_step=NAME,NAME --out=PLOT   # accuracy per step

    python benchmarks/learning_study.py --study=modes --recipe=configs/scratchpad_rl.py \
        --seeds=0,1,2 --reference=sync --peers=benchmarks/results/learning_study/trl_scratchpad.json

``--recipe`` runs another recipe (``configs/tiny_rl_sglang.py``: the tiny one with a real SGLang
server as the generator, from the same base; ``configs/scratchpad_rl.py``: long completions), each
from its supervised recipe's base, trained once into ``<workdir>/bases/``; ``--by_step`` compares results per optimizer step (the check that a
generator's log-probs and versions train the policy as this project's server's do).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "learning_study"

_STUDY = flags.DEFINE_enum("study", "plateau", ["plateau", "ceiling", "staleness", "defaults",
                                                "modes", "tools"],
                           "Which set of variants to run.")
_VARIANTS = flags.DEFINE_list("variants", [], "Only these variants of the study (default all).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (config.seed) of every variant.")
_TIME = flags.DEFINE_float("time_limit_s", 0.0, "RL wall-time limit of every run (0: the "
                           "study's default).")
_BASE = flags.DEFINE_string("base", "", "Base policy (HF dir); default: the recipe's, trained "
                            "once into the work directory.")
_WORKDIR = flags.DEFINE_string("workdir", str(ROOT / "runs" / "learning_study"),
                               "Where the runs write.")
_TARGETS = flags.DEFINE_list("targets", ["0.5", "0.8", "0.9", "0.93"],
                             "Held-out accuracies whose first crossing is timed.")
_EXTRA = flags.DEFINE_multi_string("override", [], "More KEY=VALUE config overrides for every "
                                   "run.")
_OUT = flags.DEFINE_string("out", "", "Result name (default: the study's name).")
_SNAPSHOTS = flags.DEFINE_integer(
    "snapshot_every", -1, "Measure held-out accuracy outside the runs: each run writes its policy "
    "every this many steps (export.every) with its wall time and runs no periodic evals; after it, "
    "the base, every snapshot and the final export are evaluated in this process "
    "(rl_jax.orchestrator.offline_eval). 0: the recipe's periodic evals on the servers; -1: 20 "
    "for --study=modes (a periodic eval takes generator time from the rollout in the overlapped "
    "modes only), 0 otherwise.")
_REPORT = flags.DEFINE_bool("report", False, "Run nothing: print the markdown table of the "
                            "result already written (results/learning_study/<out>.json).")
_RECIPE = flags.DEFINE_string("recipe", "configs/tiny_rl.py", "The recipe every run starts from "
                              "(e.g. configs/tiny_rl_sglang.py: the same with a real SGLang "
                              "server); its base policy is the one its base.lm_config trains.")
_BY_STEP = flags.DEFINE_list("by_step", [], "Run nothing: plot held-out accuracy against the "
                             "optimizer step for these results (results/learning_study/"
                             "<name>.json, e.g. defaults_own,defaults_sglang) into <out>.png, "
                             "up to the fewest steps any of their runs made, and print the "
                             "accuracy of each run at a few steps.")
_FROM_RUNS = flags.DEFINE_bool("from_runs", False, "Run nothing: summarize and plot the runs "
                                "already in --workdir (e.g. after changing the plots).")
_PEERS = flags.DEFINE_list("peers", [], "Result files of peer systems run on the same task "
                           "(benchmarks/trl_baseline.py's JSON): their runs join the plot, the "
                           "table and the comparison with --reference.")
_REFERENCE = flags.DEFINE_string("reference", "", "A variant (or peer run name): every run is "
                                 "also timed to the median final accuracy of its seeds, and "
                                 "the summary gives each variant's speed-up to it (median over "
                                 "seeds), e.g. --reference=sync in the modes study.")
CHECKPOINTS_S = (60, 120, 300, 570)

# The staleness study slows the trainer (seconds of sleep per step) so that the generator runs
# ahead of it and samples reach the staleness bound; every lag gets the same delay. Its batches
# are 16 prompts x 8, so that lag 16 (17 batches in flight) stays within the rollout's
# admission cap (3/4 of the server's queue: 384 groups of 8).
STALE_DELAY_S = 0.25
STALE_BATCH = 16
STALE_LAGS = (0, 1, 2, 4, 8, 16)
STALE_LOSSES = {
    "grpo_tis": ("loss.name=grpo", "loss.options.correction=tis"),
    "decoupled_ppo": ("loss.name=decoupled_ppo",),
    "cispo": ("loss.name=cispo",),
    "m2po": ("loss.name=m2po",),
    # GRPO + token TIS with every step's learning rate scaled by the batch's ESS.
    "grpo_tis_ess": ("loss.name=grpo", "loss.options.correction=tis", "trainer.ess_lr_power=1"),
}


def stale_overrides(loss_overrides: tuple[str, ...], lag: int) -> tuple[str, ...]:
    return (*loss_overrides, f"rollout.max_lag={lag}", f"rollout.groups_per_batch={STALE_BATCH}",
            f"trainer.step_delay_s={STALE_DELAY_S}")


def study_variants(study: str) -> dict[str, tuple[str, ...]]:
    """``{variant name: config overrides}`` of a study."""
    if study == "defaults":
        return {"defaults": ()}
    if study == "tools":
        # The tool-use recipe (configs/tool_rl.py) with its calculator, and with no tool at
        # all (every call then an unknown tool): what the tool is worth.
        return {"tools": (), "no_tools": ("env.kwargs.tools=()",)}
    if study == "modes":
        # The same recipe asynchronous (in-flight updates, max_lag), one step off, synchronous.
        return {mode: (f"mode={mode}",) for mode in ("async", "one_step_off", "sync")}
    if study == "plateau":
        return {
            "defaults": (),
            # The recipe before these studies: every prompt packed with each completion, no
            # filtering, the cosine schedule over trainer.steps=400 (the run ends there).
            "previous": ("rollout.share_prompts=False", "rollout.filter_zero_signal=False",
                         "optimizer.schedule_on=steps", "trainer.steps=400"),
            "no_shared_prompts": ("rollout.share_prompts=False",),
            "no_filter": ("rollout.filter_zero_signal=False",),
            "batch32": ("rollout.groups_per_batch=32",),
            "batch128": ("rollout.groups_per_batch=128",),
            "dr_grpo": ("loss.name=dr_grpo", "rollout.advantage=dr_grpo"),
            "temperature_0.7": ("rollout.temperature=0.7",),
            "max_lag_0": ("rollout.max_lag=0",),
            "max_lag_4": ("rollout.max_lag=4",),
            # The generator decodes up to 256 sequences at once instead of 64.
            "slots256": ("generator.max_slots=256",),
        }
    if study == "ceiling":
        # Full-length runs of the changes that may lift the end of the curve: more signal per
        # generated sample late in the run, when most groups are all right.
        return {
            "defaults": (),
            "no_filter": ("rollout.filter_zero_signal=False",),
            "batch32": ("rollout.groups_per_batch=32",),
            "batch32_no_filter": ("rollout.groups_per_batch=32",
                                  "rollout.filter_zero_signal=False"),
            "group16": ("rollout.groups_per_batch=32", "rollout.group_size=16"),
            "lr_floor_0.3": ("optimizer.final_lr_ratio=0.3",),
            "batch32_lr_floor_0.3": ("rollout.groups_per_batch=32",
                                     "optimizer.final_lr_ratio=0.3"),
            "batch16": ("rollout.groups_per_batch=16",),
        }
    variants = {}
    for loss, overrides in STALE_LOSSES.items():
        for lag in STALE_LAGS:
            variants[f"{loss}/lag{lag}"] = stale_overrides(overrides, lag)
    # A variant name may also be given as LOSS/lagN for any N.
    return variants


def default_time_limit(study: str) -> float:
    """The recipe's own time budget for ``defaults``; the study's fixed one otherwise."""
    if study in ("defaults", "modes", "tools"):
        from rl_jax.recipe.checks import load_recipe_file
        return float(load_recipe_file(ROOT / _RECIPE.value).trainer.time_limit_s)
    return {"ceiling": 570.0, "plateau": 300.0, "staleness": 90.0}[study]


def ensure_base(workdir: Path) -> Path:
    """The recipe's base policy, trained once into ``workdir/base`` as the recipe does."""
    if _BASE.value:
        return Path(_BASE.value).absolute()
    import importlib.util
    from rl_jax.orchestrator.rl import ensure_base_checkpoint
    spec = importlib.util.spec_from_file_location("recipe", ROOT / _RECIPE.value)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    config = recipe.get_config()
    # One base per supervised recipe and its overrides (recipes that share one share it).
    key = "_".join([Path(config.base.lm_config).stem, *config.base.lm_overrides])
    return ensure_base_checkpoint(config, workdir / "bases" / key.replace("=", ""))


def snapshot_every() -> int:
    if _SNAPSHOTS.value >= 0:
        return _SNAPSHOTS.value
    return 20 if _STUDY.value == "modes" else 0


OFFLINE_EVAL = "offline_eval.json"  # in a run's workdir: its curve measured outside the run
_BASE_ACCURACY: dict[str, float] = {}  # per base directory: evaluated once per study


def evaluate_offline(out: Path, overrides: tuple[str, ...], base: Path) -> None:
    """The run's curve from its snapshots: ``[(0, 0, base), (wall_s, step, accuracy) per
    snapshot, (wall_s, steps, final export)]``, written to ``<run>/offline_eval.json``."""
    from rl_jax.orchestrator.offline_eval import checkpoint_accuracies
    from rl_jax.orchestrator.snapshots import list_snapshots
    from rl_jax.recipe.checks import apply_overrides, load_recipe_file
    config = load_recipe_file(ROOT / _RECIPE.value)
    apply_overrides(config, [*_EXTRA.value, *overrides], what="the study's overrides")
    summary = json.loads((out / "summary.json").read_text())
    snapshots = list_snapshots(out)
    dirs = [path for _, path in snapshots] + [out / "hf"]
    known = str(base) in _BASE_ACCURACY
    start = time.perf_counter()
    results = checkpoint_accuracies(config, ([] if known else [base]) + dirs)
    evaluated = len(results)
    if not known:
        _BASE_ACCURACY[str(base)] = results.pop(0).accuracy
    curve = [(0.0, 0, _BASE_ACCURACY[str(base)])]
    curve += [(meta["wall_s"], meta["step"], r.accuracy) for (meta, _), r in
              zip(snapshots, results)]
    curve.append((float(summary["wall_s"]), int(summary["steps"]), results[-1].accuracy))
    (out / OFFLINE_EVAL).write_text(json.dumps({
        "curve": curve, "examples": results[-1].examples,
        "seconds": time.perf_counter() - start}))
    print(f"  {evaluated} checkpoints evaluated outside the run in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def read_run(name: str, overrides: tuple[str, ...], seed: int, out: Path) -> dict:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((out / "summary.json").read_text())
    if (out / OFFLINE_EVAL).is_file():  # the held-out curve measured outside the run
        curve = json.loads((out / OFFLINE_EVAL).read_text())["curve"]
        records = [r for r in records if "eval/accuracy" not in r]
        records += [{"wall_s": w, "step": k, "eval/accuracy": a} for w, k, a in curve]
        summary = {**summary, "eval_after": curve[-1][2], "offline_eval": True}
    run = summarize(records, summary)
    run.update(name=name, seed=seed, overrides=list(overrides),
               # how stale the trained samples were (optimizer steps: count), and what each
               # pool spent waiting for the other
               staleness_histogram=summary.get("staleness_histogram", {}),
               trainer_idle_fraction=summary.get("trainer_idle_fraction"),
               generator_idle_fraction=summary.get("generator_idle_fraction"),
               trained_tokens_per_s=summary.get("trained_tokens_per_s"))
    return run


def run_one(name: str, overrides: tuple[str, ...], seed: int, base: Path, workdir: Path,
            time_limit: float) -> dict:
    out = workdir / (_OUT.value or _STUDY.value) / f"{name.replace('/', '_')}_seed{seed}"
    if _FROM_RUNS.value:
        return read_run(name, overrides, seed, out)
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    # The recipe as the README runs it, but for the base policy (shared), the seed and the
    # time limit (the recipe's own unless the study sets another).
    every = snapshot_every()
    offline = ("eval.every=0", f"export.every={every}") if every else ()
    cmd = [sys.executable, "-m", "launch.train", f"--config={_RECIPE.value}",
           f"--workdir={out}", f"--config.base.checkpoint={base}", f"--config.seed={seed}",
           f"--config.trainer.time_limit_s={time_limit}",
           *[f"--config.{o}" for o in (*_EXTRA.value, *overrides, *offline)]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    print(f"[{name} seed {seed}] {' '.join(cmd[4:])}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    if every:
        evaluate_offline(out, overrides, base)
    run = read_run(name, overrides, seed, out)
    print(f"[{name} seed {seed}] {time.perf_counter() - start:.0f} s, {run['steps']} steps: "
          f"held-out {run['curve'][0][2]:.3f} -> {run['final_accuracy']:.3f}; time to "
          + ", ".join(f"{t}: {v if v is None else round(v)}" for t, v in
                      run["time_to"].items()), flush=True)
    return run


SERIES = {  # panel name: metrics.jsonl key (zero-signal groups: among the groups generated,
    # when dynamic filtering drops them before the batch; else in the batch)
    "zero-signal groups": "groups/zero_signal",
    "sampled accuracy": "rollout/accuracy",
    "entropy (nats/token)": "loss/entropy_mean",
    "learning rate": "learning_rate",
    "staleness (mean)": "staleness/batch_mean",
    "ratio ESS (pi / mu)": "loss/ratio_ess",
    "clipped fraction": "loss/clipped_fraction",
    "grad norm": "loss/grad_norm",
    "KL(behaviour || trainer)": "loss/policy_kl_mean",
}
# Panels shown when a run logged them: completion lengths and completions written by two or
# more weight versions (long completions), turns and tool use (multi-turn recipes).
OPTIONAL_SERIES = {
    "completion length p50 (tokens)": "completions/length_p50",
    "completion length p95 (tokens)": "completions/length_p95",
    "completions over >= 2 versions": "completions/multi_version",
    "tool calls per episode": "tools/calls_per_episode",
    "well-formed call fraction": "tools/well_formed",
    "malformed calls per episode": "tools/format_errors_per_episode",
    "turns per episode": "episodes/turns_mean",
    "held-out: well-formed calls": "eval/tools/well_formed",
    "held-out: episodes calling": "eval/tools/episodes_calling",
}


MAX_POINTS = 240  # per stored series: block means of consecutive steps beyond that


def compact(points: list) -> list:
    """``[(wall_s, value)]`` → at most :data:`MAX_POINTS` block means, 4 significant digits."""
    k = max(1, -(-len(points) // MAX_POINTS))
    out = []
    for i in range(0, len(points), k):
        block = np.asarray(points[i:i + k], np.float64)
        out.append([float(f"{x:.4g}") for x in block.mean(axis=0)])
    return out


def summarize(records: list[dict], summary: dict) -> dict:
    """Held-out curve ``[(wall_s, step, accuracy)]``, times to the targets, per-step series."""
    curve = [(float(r.get("wall_s", 0.0)), int(r["step"]), float(r["eval/accuracy"]))
             for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "loss/loss" in r]
    time_to = {}
    for target in _TARGETS.value:
        hit = next((w for w, _, a in curve if a >= float(target)), None)
        time_to[target] = hit
    evals = [r for r in records if "eval/accuracy" in r]
    series = {key: [(float(r.get("wall_s", 0.0)), float(r[key]))
                    for r in (evals if key.startswith("eval/") else steps) if key in r]
              for key in (*SERIES.values(), *OPTIONAL_SERIES.values(),
                          "groups/zero_signal_generated", "loss/behaviour_ratio_ess",
                          "loss/behaviour_kl_mean")}
    # Losses that weigh by π_prox/μ (decoupled PPO, a TIS correction) take their ratio against
    # π_prox (1 with one update per batch): the staleness shows in the behaviour ratio.
    if series["loss/behaviour_ratio_ess"]:
        series["loss/ratio_ess"] = series["loss/behaviour_ratio_ess"]
    # KL(μ ‖ π_θ) at the sampled tokens, whatever the loss's ratio is taken against (runs
    # from before that metric existed keep the loss's own policy KL).
    if series["loss/behaviour_kl_mean"]:
        series["loss/policy_kl_mean"] = series["loss/behaviour_kl_mean"]
    if series["groups/zero_signal_generated"]:
        series["groups/zero_signal"] = series["groups/zero_signal_generated"]
    series = {key: compact(points) for key, points in series.items()
              if points or key not in OPTIONAL_SERIES.values()}
    final = summary.get("eval_after", curve[-1][2] if curve else float("nan"))
    return dict(curve=curve, time_to=time_to, final_accuracy=float(final),
                steps=len(steps), wall_s=float(summary.get("wall_s", 0.0)), series=series,
                best_accuracy=max((a for _, _, a in curve), default=float("nan")))


def plot(runs: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["name"] for r in runs))
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}
    panels = ["held-out accuracy", *SERIES,
              *(p for p, key in OPTIONAL_SERIES.items() if any(r["series"].get(key)
                                                               for r in runs))]
    keys = {**SERIES, **OPTIONAL_SERIES}
    cols = 5
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for r in runs:
            if panel == "held-out accuracy":
                xs, ys = [w for w, _, _ in r["curve"]], [a for _, _, a in r["curve"]]
            else:
                pts = r["series"].get(keys[panel], [])
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                if len(ys) > 20:  # block means are still noisy: a running mean of 5
                    ys = np.convolve(ys, np.ones(5) / 5, mode="valid").tolist()
                    xs = xs[2:-2]
            label = r["name"] if r["seed"] == runs[[x["name"] for x in runs].index(
                r["name"])]["seed"] else None
            ax.plot(xs, ys, color=colors[r["name"]], lw=1.2, label=label)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("RL wall time (s)", fontsize=8)
        ax.tick_params(labelsize=7)
        if panel in ("grad norm", "KL(behaviour || trainer)"):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_lag(summary: dict, path: Path, title: str):
    """Staleness study: per loss, final accuracy, time to the first target, mean ESS and mean
    KL(behaviour || trainer) against ``max_lag``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    losses: dict[str, list] = {}
    for name, entry in summary.items():
        loss, _, lag = name.partition("/lag")
        if lag.isdigit():
            losses.setdefault(loss, []).append((int(lag), entry))
    first = _TARGETS.value[0]
    panels = [("final held-out accuracy", lambda e: e["final_mean"]),
              (f"seconds to {first}", lambda e: np.mean([t for t in e[f"time_to_{first}"]
                                                          if t is not None] or [np.nan])),
              ("mean staleness", lambda e: e["mean_staleness/batch_mean"]),
              ("mean ratio ESS", lambda e: e["mean_loss/ratio_ess"]),
              ("mean KL(behaviour || trainer)", lambda e: e["mean_loss/policy_kl_mean"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (label, value) in zip(axes, panels):
        for loss, points in sorted(losses.items()):
            points.sort(key=lambda p: p[0])
            ys = [value(e) for _, e in points]
            ax.plot([lag for lag, _ in points], [np.nan if y is None else y for y in ys],
                    marker="o", label=loss)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("max_lag")
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def aggregate(runs: list[dict]) -> dict:
    """Per variant: mean and spread over seeds of the final accuracy and times to targets."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        finals = [r["final_accuracy"] for r in mine]
        entry = {"seeds": [r["seed"] for r in mine], "final_accuracy": finals,
                 "final_mean": float(np.mean(finals)), "final_min": float(np.min(finals)),
                 "final_max": float(np.max(finals)), "steps": [r["steps"] for r in mine]}
        for target in _TARGETS.value:
            times = [r["time_to"][target] for r in mine]
            entry[f"time_to_{target}"] = times
        for key in ("staleness/batch_mean", "loss/ratio_ess", "loss/policy_kl_mean",
                    "groups/zero_signal", "loss/clipped_fraction"):
            vals = [v for r in mine for _, v in r["series"].get(key, [])]
            entry[f"mean_{key}"] = float(np.mean(vals)) if vals else None
        out[name] = entry
    return out


def first_time_at(curve: list, accuracy: float) -> float | None:
    """The RL wall time of the first held-out evaluation at or above ``accuracy``."""
    return next((w for w, _, a in curve if a >= accuracy - 1e-9), None)


def peer_runs(paths: list[str]) -> list[dict]:
    """Runs of peer systems (``trl_baseline.py`` results) shaped like this study's."""
    runs = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            curve = [tuple(p) for p in r["curve"]]
            runs.append(dict(name=r["name"], seed=r["seed"], curve=curve, series={},
                             final_accuracy=float(r["final_accuracy"]), steps=r["steps"],
                             wall_s=r["wall_s"], peer=str(path),
                             time_to={t: first_time_at(curve, float(t)) for t in _TARGETS.value},
                             best_accuracy=max(a for _, _, a in curve)))
    return runs


def compare_to(runs: list[dict], reference: str) -> dict:
    """Each variant against ``reference``: the reference's median final accuracy, every run's
    time to reach it, and the speed-up (the reference's median time to its own final accuracy
    over the variant's median time to it; None when a variant's median run never reaches it)."""
    ref = [r for r in runs if r["name"] == reference]
    if not ref:
        return {}
    target = float(np.median([r["final_accuracy"] for r in ref]))

    def median_time(mine, window=1):
        times = [first_time_at(smoothed(r["curve"], window), target) for r in mine]
        times = sorted(float("inf") if t is None else t for t in times)
        middle = times[len(times) // 2] if len(times) % 2 else float(np.mean(
            times[len(times) // 2 - 1:len(times) // 2 + 1]))
        return times, middle

    _, ref_time = median_time(ref)
    _, ref_smooth = median_time(ref, SMOOTH)
    out = {"reference": reference, "target_accuracy": target, "reference_time_s": ref_time,
           "reference_smoothed_time_s": ref_smooth}
    for name in dict.fromkeys(r["name"] for r in runs):
        mine = [r for r in runs if r["name"] == name]
        times, middle = median_time(mine)
        smooth_times, smooth = median_time(mine, SMOOTH)
        out[name] = {"times_s": [None if t == float("inf") else t for t in times],
                     "median_time_s": None if middle == float("inf") else middle,
                     "speedup": None if middle in (0.0, float("inf")) else ref_time / middle,
                     # the same on each curve's running mean of SMOOTH evaluations, which one
                     # lucky evaluation of a flat, noisy curve cannot decide
                     "smoothed_times_s": [None if t == float("inf") else t
                                          for t in smooth_times],
                     "smoothed_speedup": None if smooth in (0.0, float("inf"))
                     or ref_smooth == float("inf") else ref_smooth / smooth,
                     "accuracy_at_s": {str(t): float(np.median([
                         a for a in (accuracy_at(r["curve"], t) for r in mine)
                         if a is not None])) for t in (150, 300, 450, 600)}}
    return out


SMOOTH = 3  # evaluations in the running mean of compare_to's smoothed times


def smoothed(curve: list, window: int) -> list:
    """``curve`` with each accuracy replaced by the mean of it and the ``window - 1``
    evaluations before it (the base's point at 0 s kept as it is)."""
    if window <= 1:
        return curve
    out = [curve[0]] if curve else []
    trained = curve[1:]
    for i in range(len(trained)):
        lo = max(0, i - window + 1)
        out.append((trained[i][0], trained[i][1],
                    float(np.mean([a for _, _, a in trained[lo:i + 1]]))))
    return out


def accuracy_at(curve: list, seconds: float) -> float | None:
    """The last held-out accuracy measured at or before ``seconds`` of RL."""
    seen = [a for w, _, a in curve if w <= seconds]
    return seen[-1] if seen else None


def report(result: dict) -> str:
    """A markdown table: per run, held-out accuracy at the checkpoints, the final one, the
    times to the targets, and the means of staleness, ESS and the behaviour KL."""
    marks = [t for t in CHECKPOINTS_S if t <= result["time_limit_s"] + 5]
    head = (["run", "seed", "steps"] + [f"acc@{t}s" for t in marks] + ["final"]
            + [f"t({x})" for x in _TARGETS.value] + ["staleness", "ESS", "KL(mu||pi)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["runs"]:
        def mean(key):
            vals = [v for _, v in r["series"].get(key, [])]
            return f"{np.mean(vals):.3g}" if vals else "-"
        cells = [r["name"], str(r["seed"]), str(r["steps"])]
        cells += ["-" if (a := accuracy_at(r["curve"], t)) is None else f"{a:.3f}"
                  for t in marks]
        cells.append(f"{r['final_accuracy']:.3f}")
        cells += ["-" if r["time_to"][x] is None else f"{r['time_to'][x]:.0f}"
                  for x in _TARGETS.value]
        cells += [mean("staleness/batch_mean"), mean("loss/ratio_ess"),
                  mean("loss/policy_kl_mean")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_by_step(names: list[str], path: Path) -> str:
    """Held-out accuracy against the optimizer step of the runs of the results ``names``, up to
    the fewest steps any run made (one colour per result, one line per seed); returns a table of
    each run's accuracy at the evaluation nearest to a few steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = {n: json.loads((RESULTS / f"{n}.json").read_text()) for n in names}
    last = min(r["curve"][-1][1] for res in results.values() for r in res["runs"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    marks = [s for s in (0, 25, 50, 100, 150, 200, 250, 300, 400) if s <= last]
    lines = ["| result | recipe | seed | " + " | ".join(f"step {s}" for s in marks) + " |",
             "|---|---|---|" + "---|" * len(marks)]
    for i, (name, res) in enumerate(results.items()):
        recipe = res.get("recipe", "configs/tiny_rl.py")
        for j, r in enumerate(res["runs"]):
            pts = [(step, acc) for _, step, acc in r["curve"] if step <= last]
            ax.plot(*zip(*pts), color=plt.cm.tab10(i), lw=1.2,
                    label=f"{name} ({recipe})" if j == 0 else None)
            at = [min(pts, key=lambda p: abs(p[0] - s))[1] for s in marks]
            lines.append(f"| {name} | {recipe} | {r['seed']} | "
                         + " | ".join(f"{a:.3f}" for a in at) + " |")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"held-out accuracy per step, first {last} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "\n".join(lines)


def main(argv):
    del argv
    study = _STUDY.value
    if _BY_STEP.value:
        name = _OUT.value or "by_step"
        print(plot_by_step(_BY_STEP.value, RESULTS / f"{name}.png"))
        print(f"wrote {RESULTS / name}.png")
        return
    if _REPORT.value:
        print(report(json.loads((RESULTS / f"{_OUT.value or study}.json").read_text())))
        return
    variants = study_variants(study)
    if _VARIANTS.value and study == "staleness":
        for name in _VARIANTS.value:
            loss, _, lag = name.partition("/lag")
            if name not in variants and loss in STALE_LOSSES and lag.isdigit():
                variants[name] = stale_overrides(STALE_LOSSES[loss], int(lag))
    if _VARIANTS.value:
        unknown = sorted(set(_VARIANTS.value) - set(variants))
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown} of study {study}: {list(variants)}")
        variants = {k: v for k, v in variants.items() if k in _VARIANTS.value}
    time_limit = _TIME.value or default_time_limit(study)
    workdir = Path(_WORKDIR.value).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    base = None if _FROM_RUNS.value else ensure_base(workdir)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = _OUT.value or study
    runs: list[dict] = []

    peers = peer_runs(_PEERS.value)

    def write() -> dict:  # after every run: a study cut short keeps what it measured
        everything = runs + peers
        result = {
            "study": study, "recipe": _RECIPE.value, "time_limit_s": time_limit,
            "seeds": _SEEDS.value,
            "extra_overrides": _EXTRA.value, "host": platform.node(), "cpus": os.cpu_count(),
            "command": " ".join(["python", "benchmarks/learning_study.py",
                                 *[a for a in sys.argv[1:] if a != "--from_runs"]]),
            "summary": aggregate(everything), "runs": everything,
            **({"compared_to": compare_to(everything, _REFERENCE.value)}
               if _REFERENCE.value else {}),
        }
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
        plot(everything, RESULTS / f"{name}.png",
             f"{study}: {_RECIPE.value}, {time_limit:.0f} s of RL per run, seeds "
             f"{','.join(_SEEDS.value)}")
        if study == "staleness":
            plot_by_lag(result["summary"], RESULTS / f"{name}_by_lag.png",
                        f"staleness: {time_limit:.0f} s per run, trainer slowed by "
                        f"{STALE_DELAY_S} s a step, {STALE_BATCH} prompts x 8 a batch")
        return result

    for seed in [int(s) for s in _SEEDS.value]:  # seeds outermost: drift hits every variant
        for variant, overrides in variants.items():
            runs.append(run_one(variant, overrides, seed, base, workdir, time_limit))
            result = write()
    print(report(result))
    if "compared_to" in result:
        print(json.dumps(result["compared_to"], indent=1))
    print(f"wrote {RESULTS / name}.json and .png")


if __name__ == "__main__":
    app.run(main)
