r"""Time from launch to the end of the first RL step of ``configs/tiny_rl.py``: a run with an
empty compilation cache (what a first run on a machine pays), then the same run again (its
programs loaded from JAX's persistent compilation cache, ``compilation_cache_dir``).

Each run is the README's main job stopped after one step (``--config.trainer.steps=1``) from a
base policy trained once; the figure is ``time_to_first_step_s`` of its ``summary.json`` (wall
seconds since the process started). Prints both and writes ``results/startup.json``.

    python benchmarks/startup.py [--base=DIR] [--repeats=1]
"""

from __future__ import annotations

import json
import os
import platform
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


def run_once(workdir: Path, base: Path, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={workdir}", f"--config.base.checkpoint={base}",
           "--config.trainer.steps=1", "--config.trainer.time_limit_s=0",
           f"--config.compilation_cache_dir={cache}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    summary = json.loads((workdir / "summary.json").read_text())
    return {"time_to_first_step_s": summary["time_to_first_step_s"]}


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
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps({
        "host": platform.node(), "cpus": os.cpu_count(),
        "command": "python benchmarks/startup.py " + " ".join(sys.argv[1:]), "runs": rows},
        indent=1))


if __name__ == "__main__":
    app.run(main)
