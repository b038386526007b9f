r"""Time from launch to the end of the first RL step of ``configs/tiny_rl.py``: a run with an
empty compilation cache (what a first run on a machine pays), then the same run again (its
programs loaded from JAX's persistent compilation cache, ``compilation_cache_dir``).

Each run is the README's main job stopped after one step (``--config.trainer.steps=1``) from a
base policy trained once; the figure is ``time_to_first_step_s`` of its ``summary.json`` (wall
seconds since the process started). A third run, warm, goes on for ``--steps`` steps with
``JAX_LOG_COMPILES=1`` and counts the XLA compilations after the warm-up (the trainer's after
its first step, each server's after it reported ready): each would stall the run. Prints all
three and writes ``results/startup.json``.

    python benchmarks/startup.py [--base=DIR] [--repeats=1] [--steps=40]
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
_BASE = flags.DEFINE_string("base", "", "Base policy (HF dir); default: the recipe's, trained "
                            "once into runs/startup/base.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Cold/warm pairs to run.")
_STEPS = flags.DEFINE_integer("steps", 40, "Steps of the run that logs compilations.")


COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec")


def run_once(workdir: Path, base: Path, cache: Path, steps: int = 1,
             log_compiles: bool = False) -> dict:
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={workdir}", f"--config.base.checkpoint={base}",
           f"--config.trainer.steps={steps}", "--config.trainer.time_limit_s=0",
           f"--config.compilation_cache_dir={cache}"]
    # One stream, unbuffered: the compilations' log lines stay in order with the progress output.
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1"} if log_compiles \
        else None
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=1800, env=env)
    if out.returncode:
        raise SystemExit(f"run failed:\n{out.stdout[-4000:]}")
    summary = json.loads((workdir / "summary.json").read_text())
    row = {"time_to_first_step_s": summary["time_to_first_step_s"], "steps": steps}
    if log_compiles:
        # After warm-up: the trainer's once its first step is done, each server's once it
        # reported ready (every compilation there is a stall of the run).
        trainer = compiles_after(out.stdout, "first step")
        servers = [compiles_after(log.read_text(errors="replace"), "ready at")
                   for log in sorted((workdir / "generators").glob("*.log"))]
        row["compiles_after_warmup"] = {"trainer": trainer, "servers": servers}
    return row


def compiles_after(text: str, marker: str) -> list[list]:
    """``[program, seconds]`` of each XLA compilation logged after the first line holding
    ``marker`` (none when the marker never appears)."""
    at = text.find(marker)
    if at < 0:
        return []
    return [[m.group(1), float(m.group(2))] for m in COMPILED.finditer(text, at)]


def main(argv):
    del argv
    sys.path.insert(0, str(ROOT))
    from configs import tiny_rl
    from rl_jax.orchestrator.rl import ensure_base_checkpoint
    work = ROOT / "runs" / "startup"
    work.mkdir(parents=True, exist_ok=True)
    base = Path(_BASE.value) if _BASE.value else ensure_base_checkpoint(tiny_rl.get_config(),
                                                                        work)
    rows = []
    for r in range(_REPEATS.value):
        cache = Path(tempfile.mkdtemp(prefix="rl_jax-xla-"))
        try:
            for kind in ("cold", "warm"):
                workdir = work / f"{kind}_{r}"
                shutil.rmtree(workdir, ignore_errors=True)
                row = {"run": kind, "repeat": r, **run_once(workdir, base, cache)}
                rows.append(row)
                print(f"{kind} cache: first step {row['time_to_first_step_s']:.1f} s after "
                      "launch", flush=True)
            # A longer warm run that logs XLA's compilations: none should follow the warm-up.
            workdir = work / f"compiles_{r}"
            shutil.rmtree(workdir, ignore_errors=True)
            row = {"run": "warm, compilations logged", "repeat": r,
                   **run_once(workdir, base, cache, steps=_STEPS.value, log_compiles=True)}
            rows.append(row)
            found = row["compiles_after_warmup"]
            print(f"{_STEPS.value} steps: {len(found['trainer'])} compilation(s) in the trainer "
                  f"after its first step, {[len(s) for s in found['servers']]} in the "
                  "server(s) after they reported ready", flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps({
        "host": platform.node(), "cpus": os.cpu_count(),
        "command": "python benchmarks/startup.py " + " ".join(sys.argv[1:]), "runs": rows},
        indent=1))


if __name__ == "__main__":
    app.run(main)
