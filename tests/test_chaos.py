"""The chaos soak (tools/chaos.py), short: a few minutes of the tiny recipe on two servers with a
few faults of every kind, overlapping; every invariant of its records must hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_short_chaos_soak_keeps_every_invariant(tmp_path):
    # The recipe's own base (trained first, about a minute): a random one earns no reward, so
    # every group would be dropped for want of signal and no step would train.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "tools/chaos.py", "--duration_s=150", "--mean_gap_s=5", "--seed=3",
         f"--workdir={tmp_path / 'runs'}", "--out=short",
         f"--results_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1700)
    report = json.loads((tmp_path / "short.json").read_text()) \
        if (tmp_path / "short.json").exists() else None
    assert report is not None, out.stdout[-3000:] + out.stderr[-3000:]
    failed = {k: v for k, v in report["invariants"].items() if not v["ok"]}
    assert not failed and out.returncode == 0, (failed, out.stdout[-2000:])
    kinds = set(report["fault_counts"])
    assert len(kinds) >= 8, report["fault_counts"]  # root mounts: all ten
    assert report["restarts"] or "kill_trainer" not in kinds
    assert report["steps"] > 20 and (tmp_path / "short.png").stat().st_size > 0
