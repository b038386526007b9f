"""The real-shape async RL benchmark (``benchmarks/real_shape_run.py``) end to end at a reduced
shape: the recipe ``configs/shape_rl_cpu.py`` with ``model.shape=tiny`` (random weights), run by
``python -m launch.train`` with its generator server, then the decode measurement and the systems
model's prediction from what the run measured. The 0.5B run is the same command with
``--shape=qwen2.5-0.5b``; its results are committed in ``benchmarks/results/``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_async_run_at_a_named_shape_is_measured_and_predicted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
    steps, max_lag = 4, 1
    result = subprocess.run(
        [sys.executable, "benchmarks/real_shape_run.py", "--shape=tiny", f"--steps={steps}",
         "--warmup_steps=1", f"--workdir={tmp_path / 'runs'}",
         f"--results_dir={tmp_path / 'results'}",
         # pinning to cores 0 and 1 needs two of them; the path is the same without
         "--override=cpus.trainer=", "--override=cpus.generators=", "--override=cpus.rollout=",
         f"--override=rollout.max_lag={max_lag}",
         # one decode batch size to measure afterwards (8 slots: one batch decodes at a time)
         "--override=generator.max_slots=8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[run " in result.stdout and "first step" in result.stdout  # progress shown
    out = json.loads((tmp_path / "results" / "real_shape_run_tiny.json").read_text())
    assert (tmp_path / "results" / "real_shape_run_tiny.png").stat().st_size > 0
    assert out["shape"] == "tiny" and out["steps_completed"] == steps
    assert out["settings"]["mode"] == "async" and out["max_lag"] == max_lag
    # staleness within the bound, in the summary and in every step's batch
    assert out["staleness_max"] <= max_lag and out["staleness_within_max_lag"]
    assert sum(out["staleness_histogram"].values()) == steps * 2
    assert all(s["staleness_max"] <= max_lag for s in out["per_step"])
    assert [s["step"] for s in out["per_step"]] == list(range(1, steps + 1))
    # the systems model's prediction from the run's measurements
    for key in ("measured_step_s", "predicted_step_s"):
        assert math.isfinite(out[key]) and out[key] > 0, (key, out[key])
    assert all(math.isfinite(s["predicted_interval_s"]) and s["predicted_interval_s"] > 0
               for s in out["per_step"])
    inputs = out["prediction_inputs"]
    assert inputs["trainer_tokens_per_s"] > 0 and inputs["completion_len"] == 16
    assert all(v > 0 for v in inputs["decode_step_s"].values())
    assert out["predicted_staleness_max"] <= max_lag
    # memory of both processes, beside the systems model's terms
    peaks = out["memory"]["peak_rss_bytes"]
    assert peaks["trainer"] > 100e6 and peaks["generator"] > 100e6
    assert out["memory"]["peak_total_rss_bytes"] >= peaks["trainer"]
    assert out["memory"]["predicted"]["trainer"]["total"] > 0
    assert len(out["machine"]["load_average_before"]) == 3
