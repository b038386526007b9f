r"""An asynchronous RL run at a real model's shape on this machine: memory, staleness, and the
step time against the systems model's prediction.

Runs ``configs/shape_rl_cpu.py`` at ``--shape`` (a name of ``rl_jax.models.shapes``; random
weights) with ``python -m launch.train``, as a user would: the trainer process, its generator
server process, every new version streamed to the server in flight, staleness bounded by
``rollout.max_lag``. While it runs, the resident memory of each process of the run is sampled
from ``/proc`` (``VmRSS``, and the kernel's own high-water mark ``VmHWM``), with the machine's
available memory; the run's output is shown as it comes. After it:

1. the generator's decode step time is measured at the decode batch sizes the run used, in the
   generator's dtype, on the generator's core (a separate process loading the run's base
   weights): the systems model's latency curve;
2. the run is predicted by :func:`rl_jax.sysmodel.predict.predict_run` from what the run itself
   measured: the trainer's tokens/s in its train steps and its serial work per step (publishing
   a version, logging), the servers' weight-update time, the generator's in-flight swap work,
   the client's overhead per group, the prompt and completion tokens of its batches;
3. measured and predicted step time (the mean interval between optimizer steps after
   ``--warmup_steps``) are compared (aim: within 25%), staleness against ``max_lag``, and each
   process's peak memory beside the systems model's memory terms.

    python benchmarks/real_shape_run.py --shape=qwen2.5-0.5b [--steps=6]
        [--override=rollout.max_new_tokens=32 ...] [--workdir=runs/real_shape_run]

The run does not start when the systems model's memory for it (trainer, generator, staged
versions) exceeds what the machine has available (``--allow_overcommit``), and its processes are
the first an out-of-memory kill would take (``oom_score_adj``), not other work on the machine.

Writes ``results/real_shape_run_<shape>.json`` and ``.png`` (per-step time measured and
predicted, staleness, memory). The trainer does not report its compiled step's memory; the
systems model's trainer terms stand beside the measured peak instead.
"""

from __future__ import annotations

import collections
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECIPE = ROOT / "configs" / "shape_rl_cpu.py"

_SHAPE = flags.DEFINE_string("shape", "qwen2.5-0.5b", "A named shape (rl_jax.models.shapes).")
_STEPS = flags.DEFINE_integer("steps", 0, "Optimizer steps (0: the recipe's).")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Steps left out of the step-time comparison "
                               "(the first batch's generation, first executions).")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "More recipe settings, KEY=VALUE "
                                       "(as --config.KEY=VALUE of launch.train).")
_WORKDIR = flags.DEFINE_string("workdir", str(ROOT / "runs" / "real_shape_run"), "Where the run "
                               "writes (a directory per shape; its random base weights are "
                               "kept for the next run of the same shape).")
_RESULTS_DIR = flags.DEFINE_string("results_dir", str(RESULTS), "Where the JSON and PNG go.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 3600.0, "Longest the run may take.")
_OVERCOMMIT = flags.DEFINE_bool("allow_overcommit", False, "Start the run even when the systems "
                                "model's memory for it exceeds the memory available now (an "
                                "out-of-memory kill on a shared machine may hit other work).")
_INTERVAL = flags.DEFINE_float("memory_interval_s", 0.5, "Seconds between memory samples.")
_MEASURE = flags.DEFINE_string("measure_decode", "", "Internal: print the decode-step latency "
                               "curve of this HF checkpoint as JSON and exit (with --dtype, "
                               "--batches, --prompt_len, --new_tokens, --max_seq_len).")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Internal (--measure_decode).")
_BATCHES = flags.DEFINE_list("batches", ["8"], "Internal (--measure_decode).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 9, "Internal (--measure_decode).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 16, "Internal (--measure_decode).")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 32, "Internal (--measure_decode).")


# ---- the run's recipe ---------------------------------------------------------------------------

def recipe_overrides() -> list[str]:
    """``KEY=VALUE`` settings of the run beyond the recipe file: shape, steps, ``--override``."""
    out = [f"model.shape={_SHAPE.value}"]
    if _STEPS.value:
        out.append(f"trainer.steps={_STEPS.value}")
    return out + list(_OVERRIDES.value)


def load_recipe(overrides: list[str]):
    """The typed recipe the run will parse (``rl_jax.recipe``)."""
    from rl_jax.recipe.checks import apply_overrides, load_recipe_file, parse
    config = load_recipe_file(RECIPE)
    apply_overrides(config, overrides, what="--override")
    return parse(config)


# ---- memory of the run's processes --------------------------------------------------------------

def _status_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in KiB ({} once it has gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from each process's parent in ``/proc/*/stat``)."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "(comm) state"
        children[ppid].append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "trainer"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return "generator" if "rl_jax.generator.server.serve" in cmdline else "other"


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class MemorySampler:
    """Samples every ``interval`` seconds the resident memory of ``root`` and its descendants:
    each process's peak (the kernel's ``VmHWM``, kept from the last sample before it exits), the
    largest sum over the run's processes, and the machine's least available memory."""

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.peak: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        self.peak_total = 0
        self.min_available = _available_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            total = 0
            for pid in _descendants(self.root):
                status = _status_kib(pid)
                if not status:
                    continue
                if pid not in self.roles:
                    self.roles[pid] = _role(pid, self.root)
                peak = max(status.get("VmHWM", 0), status.get("VmRSS", 0)) * 1024
                self.peak[pid] = max(self.peak.get(pid, 0), peak)
                total += status.get("VmRSS", 0) * 1024
            self.peak_total = max(self.peak_total, total)
            self.min_available = min(self.min_available, _available_bytes())
            self._stop.wait(self.interval)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        by_role: dict[str, list[int]] = collections.defaultdict(list)
        for pid, peak in self.peak.items():
            by_role[self.roles[pid]].append(peak)
        return {"peak_rss_bytes": {role: max(peaks) for role, peaks in by_role.items()},
                "processes": {role: len(peaks) for role, peaks in by_role.items()},
                "peak_total_rss_bytes": self.peak_total,
                "min_available_bytes": self.min_available}


# ---- the run ----------------------------------------------------------------------------------

def _first_to_go():
    """In the run's process before it starts (its servers inherit it): the process an
    out-of-memory kill takes first, before other work sharing the machine."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def run(workdir: Path, overrides: list[str]) -> tuple[dict, list[dict], dict, float]:
    """Runs the recipe in ``workdir`` (removing an earlier run's outputs, keeping its random base
    weights); returns its summary, per-step records, memory peaks and wall seconds."""
    if workdir.exists():
        for entry in workdir.iterdir():
            if entry.name != "base":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    cmd = [sys.executable, "-m", "launch.train", f"--config={RECIPE}", f"--workdir={workdir}",
           *[f"--config.{o}" for o in overrides]]
    print(f"[run] {' '.join(cmd[1:])}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            preexec_fn=_first_to_go)
    sampler = MemorySampler(proc.pid, _INTERVAL.value)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    timer = threading.Timer(_TIMEOUT.value, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:  # tqdm's carriage returns arrive as lines of their own
            line = line.rstrip()
            if line:
                tail.append(line)
                print(f"[run {time.perf_counter() - start:6.0f} s] {line}", flush=True)
        proc.wait()
    finally:
        timer.cancel()
        memory = sampler.close()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}) after {wall:.0f} s:\n"
                         + "\n".join(tail))
    summary = json.loads((workdir / "summary.json").read_text())
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x]
    steps = {r["step"]: r for r in records if "loss/loss" in r}
    return summary, [steps[k] for k in sorted(steps)], memory, wall


# ---- the decode latency curve -------------------------------------------------------------------

def measure_decode_curve(model_dir: str) -> dict[int, float]:
    """Seconds per decode step of one engine (the server's, in ``--dtype``) at each of
    ``--batches`` sequences, over the contexts a ``--new_tokens`` completion of a
    ``--prompt_len`` prompt passes through: (a long request - a short one) / the extra tokens,
    best of three each, so that the prefill cancels out."""
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.engine.weights import generator_rules, load_params
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.models.config import DTYPES, eos_ids
    dtype = DTYPES[_DTYPE.value]
    batches = sorted(int(b) for b in _BATCHES.value)
    cfg, params = load_params(model_dir, mesh=None, rules=generator_rules(), dtype=dtype)
    engine = Engine(cfg, params, rules=generator_rules(), dtype=dtype, eos_token_ids=eos_ids(cfg),
                    engine_config=EngineConfig(max_slots=max(batches),
                                               max_seq_len=_MAX_SEQ_LEN.value))
    prompt = [int(x) for x in np.arange(_PROMPT_LEN.value) % 200 + 32]
    long, short = _NEW_TOKENS.value, max(2, _NEW_TOKENS.value // 4)
    curve = {}
    try:
        for batch in batches:
            def timed(tokens: int, repeats: int = 3) -> float:
                request = GenerateRequest(prompt, SamplingParams(
                    max_new_tokens=tokens, ignore_eos=True, n=batch, seed=0, temperature=1.0))
                best = math.inf
                for _ in range(repeats):
                    start = time.perf_counter()
                    engine.generate(request, timeout=1800)
                    best = min(best, time.perf_counter() - start)
                return best
            timed(long, 1)  # compiles the shapes of both
            timed(short, 1)
            curve[batch] = (timed(long) - timed(short)) / (long - short)
            print(f"decode batch {batch}: {curve[batch] * 1e3:.1f} ms per step", file=sys.stderr,
                  flush=True)
    finally:
        engine.shutdown()
    return curve


def decode_curve(recipe, base: Path, batches: list[int], prompt_len: int) -> dict[int, float]:
    """:func:`measure_decode_curve` in its own process on the generator's cores."""
    cores = recipe.cpus.generators
    pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
    cmd = [*pin, sys.executable, __file__, f"--measure_decode={base}",
           f"--dtype={recipe.generator.dtype}", f"--batches={','.join(map(str, batches))}",
           f"--prompt_len={prompt_len}", f"--new_tokens={recipe.rollout.max_new_tokens}",
           f"--max_seq_len={recipe.generator.max_seq_len}"]
    print(f"[decode] measuring decode steps at batches {batches} ({recipe.generator.dtype}"
          f"{', cores ' + cores if pin else ''})", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(dict(recipe.generator.env))  # the server's environment
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"decode measurement failed:\n{out.stderr[-3000:]}")
    for line in out.stderr.splitlines():
        if line.startswith("decode batch"):
            print(f"[decode] {line}", flush=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


# ---- measured and predicted ----------------------------------------------------------------------

def step_intervals(records: list[dict]) -> list[float]:
    """Seconds between the ends of consecutive optimizer steps (the first from the loop's
    start)."""
    walls = [r["wall_s"] for r in records]
    return [walls[0]] + [b - a for a, b in zip(walls, walls[1:])]


def run_inputs(recipe, summary: dict, records: list[dict], warmup: int) -> dict:
    """The systems model's inputs as this run measured them (steps after ``warmup``)."""
    timed = records[warmup:] or records
    intervals = step_intervals(records)[warmup:] or step_intervals(records)
    trained = sum(r["trainer/tokens_per_s"] * r["trainer/step_s"] for r in timed)
    rate = trained / max(sum(r["trainer/step_s"] for r in timed), 1e-9)
    # The trainer's own serial work per step beyond its train step and its waits for a batch
    # (publishing the version, logging, checkpoint bookkeeping). The train step's speed is
    # the async run's own, with the rollout's host threads sharing its core: nothing is added
    # for them.
    serial = float(np.median([i - r["trainer/step_s"] - r["trainer/wait_s"]
                              for i, r in zip(intervals, timed)]))
    # From a step's end (its version published) until the servers run it: the pull, checks and
    # re-layout; the trainer's publish is in its serial work already.
    updates = [r["weights/update_s"] for r in timed if "weights/update_s" in r]
    counters = summary.get("generator_counters", {})
    swaps = max(counters.get("weight_updates", 0), 1)
    # Generator-core work per in-flight update (checks, re-layout, swap): decoding pauses
    # for it on a one-core server.
    swap_pause = sum(counters.get(k, 0) for k in ("weight_check_ms", "weight_prepare_ms",
                                                  "weight_swap_ms")) / swaps / 1e3
    groups = recipe.rollout.groups_per_batch
    samples = groups * recipe.rollout.group_size
    steps = max(summary["steps"], 1)
    completion = summary["completion_tokens"] / (steps * samples)
    prompt_tokens = (summary["trained_tokens"] - summary["completion_tokens"]) / steps
    prompt_len = prompt_tokens / (groups if recipe.rollout.share_prompts else samples)
    return {"trainer_tokens_per_s": rate, "trainer_step_overhead_s": max(serial, 0.0),
            "weight_transfer_s": float(np.median(updates)) if updates else 0.0,
            "swap_pause_s": swap_pause,
            "group_overhead_s": summary.get("rollout/client_overhead_s", 0.0) / max(
                summary.get("rollout/timed_groups", 0.0), 1.0),
            "prompt_len": prompt_len, "completion_len": completion}


def predict(recipe, inputs: dict, curve: dict[int, float], steps: int, warmup: int):
    """:func:`rl_jax.sysmodel.predict.predict_run` of this run from its measured inputs."""
    from rl_jax.sysmodel.predict import predict_run
    r = recipe.rollout
    lengths = [max(1, round(inputs["completion_len"]))] * ((steps + r.max_lag + 2)
                                                          * r.groups_per_batch * r.group_size)
    return predict_run(
        decode_latency=curve, trainer_tokens_per_s=inputs["trainer_tokens_per_s"],
        response_lengths=lengths, prompt_len=max(0, round(inputs["prompt_len"])),
        group_size=r.group_size, groups_per_batch=r.groups_per_batch,
        max_lag=r.max_lag if recipe.mode == "async" else (1 if recipe.mode == "one_step_off"
                                                          else 0),
        mode=recipe.mode, num_servers=max(len(recipe.generator.urls),
                                          recipe.generator.num_servers),
        slots_per_server=recipe.generator.max_slots, num_steps=steps,
        weight_transfer_s=inputs["weight_transfer_s"],
        trainer_step_overhead_s=inputs["trainer_step_overhead_s"],
        swap_pause_s=inputs["swap_pause_s"], group_overhead_s=inputs["group_overhead_s"],
        ordered_lengths=True, shared_prompts=r.share_prompts, warmup_steps=warmup)


def predicted_memory(recipe) -> dict:
    """The systems model's trainer and generator bytes (one device each) for this recipe, and
    what the run needs of this machine: both, plus what no compiled program holds
    (``sysmodel.memory.host_memory``: the publisher's staging slots, each process's runtime)."""
    from rl_jax.models.shapes import shape
    from rl_jax.sysmodel.memory import trainer_memory
    from rl_jax.sysmodel.memory_serving import generator_memory, host_memory
    from rl_jax.sysmodel.shape import ModelShape
    model = ModelShape.from_model_config(shape(recipe.model.shape))
    t = recipe.trainer
    accumulation = ("streaming" if t.micro_batch_rows
                    else "scan" if t.num_microbatches > 1 else "none")
    trainer = trainer_memory(model, batch=t.micro_batch_rows or 1,
                             seq=recipe.rollout.seq_len, dtype=recipe.model.dtype,
                             param_dtype=recipe.model.param_dtype, remat=recipe.model.remat,
                             logits_block=t.logits_block_size, backend="cpu",
                             accumulation=accumulation, ema=t.ema_decay > 0)
    generator = generator_memory(model, max_slots=recipe.generator.max_slots,
                                 max_seq_len=recipe.generator.max_seq_len,
                                 dtype=recipe.generator.dtype)
    servers = max(len(recipe.generator.urls), recipe.generator.num_servers)
    host = host_memory(model, publish_dtype=recipe.generator.dtype, processes=1 + servers)
    machine = trainer.total + servers * generator.total + host.total
    return {"trainer": trainer.to_dict(), "generator": generator.to_dict(),
            "host": host.to_dict(), "trainer_describe": trainer.describe(),
            "generator_describe": generator.describe(),
            "staging_bytes": host.terms["staging"], "machine_bytes": machine}


# ---- report ----------------------------------------------------------------------------------

def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["per_step"]
    x = [s["step"] for s in steps]
    warm = result["warmup_steps"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(x, [s["interval_s"] for s in steps], "o-", label="measured interval")
    ax.plot(x, [s["train_step_s"] for s in steps], ".:", label="measured train step")
    ax.plot(x, [s["predicted_interval_s"] for s in steps], "s--", label="predicted interval")
    ax.axhline(result["measured_step_s"], color="tab:blue", lw=0.8,
               label=f"measured mean after step {warm}")
    ax.axhline(result["predicted_step_s"], color="tab:orange", lw=0.8,
               label=f"predicted ({result['relative_error']:+.0%})")
    ax.axvspan(0.5, warm + 0.5, color="0.9")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("seconds")
    ax.set_title(f"{result['shape']}: time per step")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(x, [s["staleness_max"] for s in steps], "o-", label="batch max")
    ax.plot(x, [s["staleness_mean"] for s in steps], ".-", label="batch mean")
    ax.axhline(result["max_lag"], color="red", ls=":", label="max_lag")
    ax.set_ylim(-0.2, result["max_lag"] + 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("staleness (versions)")
    ax.set_title("staleness")
    ax.legend(fontsize=7)
    ax = axes[2]
    memory = result["memory"]
    roles = [r for r in ("trainer", "generator") if r in memory["peak_rss_bytes"]]
    gib = 2 ** 30
    at = np.arange(len(roles))
    ax.bar(at - 0.2, [memory["peak_rss_bytes"][r] / gib for r in roles], width=0.4,
           color="tab:blue", label="peak resident (process)")
    ax.bar(at + 0.2, [memory["predicted"][r]["total"] / gib for r in roles], width=0.4,
           color="tab:orange", label="systems model (arrays)")
    ax.set_xticks(at, roles)
    ax.legend(fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(f"memory (machine {result['machine']['memory_bytes'] / gib:.0f} GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    if _MEASURE.value:
        print(json.dumps(measure_decode_curve(_MEASURE.value)))
        return
    overrides = recipe_overrides()
    recipe = load_recipe(overrides)
    steps, warmup = recipe.trainer.steps, _WARMUP.value
    if steps <= warmup:
        raise SystemExit(f"--steps={steps} leaves no step after --warmup_steps={warmup}")
    name = recipe.model.shape
    workdir = Path(_WORKDIR.value) / name
    planned = predicted_memory(recipe)
    available = _available_bytes()
    gib = 2 ** 30
    print(f"memory: the run needs ~{planned['machine_bytes'] / gib:.1f} GiB (systems model: "
          f"trainer {planned['trainer']['total'] / gib:.1f}, generator "
          f"{planned['generator']['total'] / gib:.1f}, staged versions "
          f"{planned['staging_bytes'] / gib:.1f}, runtimes); {available / gib:.1f} GiB "
          "available", flush=True)
    if planned["machine_bytes"] > available and not _OVERCOMMIT.value:
        raise SystemExit(f"not started: the run needs ~{planned['machine_bytes'] / gib:.1f} GiB "
                         f"and this machine has {available / gib:.1f} GiB available "
                         "(--allow_overcommit starts it anyway)")
    load_before = os.getloadavg()
    summary, records, memory, wall = run(workdir, overrides)
    load_after = os.getloadavg()
    # Every decode batch the server can run (powers of two from 8 up to its slots).
    slots = recipe.generator.max_slots
    batches = sorted({min(8 << k, slots) for k in range(max(slots.bit_length() - 3, 1))})
    inputs = run_inputs(recipe, summary, records, warmup)
    curve = decode_curve(recipe, workdir / "base" / "hf", batches,
                         max(1, round(inputs["prompt_len"])))
    prediction = predict(recipe, inputs, curve, steps, warmup)
    intervals = step_intervals(records)
    measured = float(np.mean(intervals[warmup:]))
    predicted = float(prediction.sim.step_s)
    ends = prediction.sim.step_end_s
    predicted_intervals = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    error = predicted / measured - 1
    max_lag = summary["max_lag"]
    memory["predicted"] = planned
    memory["available_before_bytes"] = available
    per_step = [{"step": r["step"], "wall_s": r["wall_s"], "interval_s": i,
                 "predicted_interval_s": p, "train_step_s": r["trainer/step_s"],
                 "wait_s": r["trainer/wait_s"], "publish_s": r["weights/publish_s"],
                 "weights_update_s": r.get("weights/update_s"),
                 "trained_tokens": r["trainer/tokens_per_s"] * r["trainer/step_s"],
                 "staleness_max": r["staleness/batch_max"],
                 "staleness_mean": r["staleness/batch_mean"]}
                for r, i, p in zip(records, intervals, predicted_intervals)]
    from rl_jax.models.shapes import shape
    result = {
        "benchmark": "real_shape_run", "shape": name, "params": shape(name).num_params(),
        "command": "python benchmarks/real_shape_run.py " + " ".join(sys.argv[1:]),
        "recipe": str(RECIPE.relative_to(ROOT)), "overrides": overrides,
        "settings": {"mode": recipe.mode, "max_lag": recipe.rollout.max_lag, "steps": steps,
                     "groups_per_batch": recipe.rollout.groups_per_batch,
                     "group_size": recipe.rollout.group_size,
                     "max_new_tokens": recipe.rollout.max_new_tokens,
                     "seq_len": recipe.rollout.seq_len,
                     "micro_batch_rows": recipe.trainer.micro_batch_rows,
                     "model_dtype": recipe.model.dtype,
                     "param_dtype": recipe.model.param_dtype, "remat": recipe.model.remat,
                     "generator_dtype": recipe.generator.dtype,
                     "max_slots": recipe.generator.max_slots,
                     "max_seq_len": recipe.generator.max_seq_len,
                     "generator_env": dict(recipe.generator.env)},
        "warmup_steps": warmup, "max_lag": max_lag, "steps_completed": summary["steps"],
        "run_wall_s": wall, "loop_wall_s": summary["wall_s"],
        "time_to_first_step_s": summary.get("time_to_first_step_s"),
        "measured_step_s": measured, "predicted_step_s": predicted,
        "relative_error": error, "within_25_percent": abs(error) <= 0.25,
        "measured_step_s_median": float(np.median(intervals[warmup:])),
        "staleness_max": summary["staleness/max"],
        "staleness_histogram": summary["staleness_histogram"],
        "staleness_within_max_lag": summary["staleness/max"] <= max_lag,
        "predicted_staleness_max": prediction.staleness_max,
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "generator_idle_fraction": summary.get("generator_idle_fraction"),
        "predicted_trainer_idle_fraction": prediction.trainer_idle_fraction,
        "predicted_generator_idle_fraction": prediction.generator_idle_fraction,
        "prediction_inputs": {**inputs, "decode_step_s": {str(k): v for k, v in curve.items()}},
        "prediction": prediction.to_dict(),
        "memory": memory, "per_step": per_step,
        "generator_decode_batches": summary.get("generator_decode_batches", {}),
        "generator_counters": summary.get("generator_counters", {}),
        "trainer_seconds": summary["trainer_seconds"], "weights": summary.get("weights", {}),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "load_average_before": load_before, "load_average_after": load_after,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    print(f"\n{name}: {result['params'] / 1e6:.0f}M parameters, {steps} steps of "
          f"{recipe.rollout.groups_per_batch} x {recipe.rollout.group_size} samples, "
          f"{recipe.rollout.max_new_tokens} new tokens, mode {recipe.mode}, max_lag {max_lag}; "
          f"run {wall:.0f} s (first step {summary.get('time_to_first_step_s') or 0:.0f} s "
          "after launch)")
    print(f"measured in the run: trainer {inputs['trainer_tokens_per_s']:.1f} tokens/s + "
          f"{inputs['trainer_step_overhead_s']:.2f} s serial per step, weights reach the server "
          f"in {inputs['weight_transfer_s']:.2f} s, {inputs['swap_pause_s']:.2f} s of swap work "
          f"per update, prompt {inputs['prompt_len']:.1f} + completion "
          f"{inputs['completion_len']:.1f} tokens; decode " + ", ".join(
              f"batch {b}: {t * 1e3:.0f} ms" for b, t in sorted(curve.items())))
    print(f"step time after {warmup} warm-up steps: measured {measured:.2f} s, predicted "
          f"{predicted:.2f} s ({error:+.1%}; aim within 25%)")
    print(f"staleness max {summary['staleness/max']:.0f} (max_lag {max_lag}; predicted "
          f"{prediction.staleness_max}); trainer idle {summary['trainer_idle_fraction']:.2f} "
          f"(predicted {prediction.trainer_idle_fraction:.2f})")
    print("peak resident memory: " + ", ".join(
        f"{role} {b / gib:.2f} GiB" for role, b in memory["peak_rss_bytes"].items())
        + f"; all the run's processes together {memory['peak_total_rss_bytes'] / gib:.2f} GiB, "
        f"least available {memory['min_available_bytes'] / gib:.2f} GiB of "
        f"{result['machine']['memory_bytes'] / gib:.1f}")
    print(f"systems model, one device each: trainer {memory['predicted']['trainer_describe']}; "
          f"generator {memory['predicted']['generator_describe']}")
    results = Path(_RESULTS_DIR.value)
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"real_shape_run_{name}.json"
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and .png")


if __name__ == "__main__":
    app.run(main)
