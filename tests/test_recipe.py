"""The tiny LM recipe end to end through its absl launcher: trains, checkpoints, resumes after a
lost checkpoint to the same losses, exports an HF checkpoint, refuses bad configs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.models.hf import load_pretrained, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config.trainer.steps=6", "--config.checkpoint.every=3", "--config.logging.every=1",
         "--config.logging.eval_every=3", "--config.data.rows_per_batch=4",
         "--config.data.eval_examples=32", "--config.model.hidden_size=32",
         "--config.model.intermediate_size=64", "--config.model.num_layers=2",
         "--config.model.head_dim=8", "--config.checkpoint.use_async=False"]


def _launch(workdir: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py",
         f"--workdir={workdir}", *SMALL, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.slow
def test_recipe_trains_exports_and_resumes_exactly(tmp_path):
    full = tmp_path / "full"
    proc = _launch(full)
    assert "exported" in proc.stdout
    summary = json.loads((full / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["skipped_steps"] == 0
    assert (full / "training.png").stat().st_size > 0
    losses = _losses(full)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1]

    model = load_pretrained(full / "hf")
    tokenizer = load_tokenizer(full / "hf")
    assert model.config.vocab_size == tokenizer.get_vocab_size()
    assert model.config.eos_token_id == tokenizer.token_to_id("<eos>")

    # A crash that lost the step-6 checkpoint: the rerun resumes from step 3 and reproduces
    # steps 4..6 exactly.
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "6")
    shutil.rmtree(crashed / "hf")
    (crashed / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (full / "metrics.jsonl").read_text().splitlines()[:3]))
    _launch(crashed)
    resumed = _losses(crashed)
    assert resumed == losses
    a = load_pretrained(full / "hf")
    b = load_pretrained(crashed / "hf")
    np.testing.assert_array_equal(np.asarray(a.layers.wq[...]), np.asarray(b.layers.wq[...]))


@pytest.mark.parametrize("override,message", [
    ("--config.data.rows_per_batch=6", "not divisible by trainer.num_microbatches=4"),
    ("--config.trainer.stepz=3", "stepz"),
    ("--config.mesh.fsdp=3", "needs 3 devices"),
    ("--config.model.num_kv_heads=3", "not a multiple of num_kv_heads=3"),
])
def test_bad_config_stops_with_a_clear_message(tmp_path, override, message):
    extra = [override] + (["--config.trainer.num_microbatches=4"] if "rows_per" in override else [])
    proc = _launch(tmp_path / "bad", *extra, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
