"""benchmarks/accelerator_check.py on this CPU with the tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rl_jax.models.shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]


def test_accelerator_check_runs_on_cpu_and_writes_the_comparison(tmp_path):
    out = tmp_path / "pools"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accelerator_check.py"), "--shape=tiny",
           "--dtype=float32", "--batches=1,8", "--attention=xla", "--train=2x32",
           "--repeats=1", f"--out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [path] = list((out / "checks").glob("*.json"))
    record = json.loads(path.read_text())
    assert record["env"]["backend"] == "cpu"
    entry = record["shapes"]["tiny"]
    assert [r["batch"] for r in entry["decode"]] == [1, 8]
    for row in entry["decode"]:
        assert "error" not in row, row
        assert row["raw_tok_s"] > 0 and row["engine_tok_s"] > 0
        # a measured step cannot beat the roofline of the ceilings measured in the same run
        assert 0 < row["raw_over_memory_roofline"] < 1.5, row
        assert row["attention_used"] == "xla" and row["prefill_attention_used"] == "xla"
        assert row["prefill_tok_s"] > 0
    [train] = entry["trainer"]
    assert "error" not in train, train
    assert 0 < train["mfu"] < 1.5 and train["tokens_per_s"] > 0
    assert train["compiled_peak_bytes"] > 0
    # the systems model's memory (rl_jax.sysmodel.memory) against what XLA compiled
    assert abs(train["predicted_peak_bytes"] / train["compiled_peak_bytes"] - 1) < 0.15, train
    assert entry["trainer_attention"]["implementation"] == "xla"
    pub = entry["publication"]
    assert "error" not in pub, pub
    assert pub["version_bytes"] == 4 * SHAPES["tiny"].num_params()
    assert pub["end_to_end_gbps"] > 0 and pub["transport"] == "shm"
    # device memory to device memory, no host bounce: measured beside shm
    direct = entry["publication_by_transport"]["jax_transfer"]
    assert "error" not in direct, direct
    assert direct["version_bytes"] == pub["version_bytes"] and direct["end_to_end_gbps"] > 0
    assert set(entry["summary"]) == {"decode", "trainer", "publication"}
    table = (out / "comparison.md").read_text()
    assert "## Accelerator check" in table and "| tiny | float32 |" in table
    assert (out / "checks" / path.name.replace(".json", ".md")).is_file()


def test_accelerator_check_refuses_unknown_parts_and_shapes(tmp_path):
    script = str(ROOT / "benchmarks" / "accelerator_check.py")
    proc = subprocess.run([sys.executable, script, "--parts=decode,warp", f"--out={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown parts ['warp']" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--shape=gpt-5", f"--out={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown model shape 'gpt-5'" in proc.stderr
