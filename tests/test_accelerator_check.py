"""benchmarks/accelerator_check.py on this CPU with the tiny shape, and the named shapes it
takes (rl_jax.models.shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_jax.models.config import ConfigError
from rl_jax.models.shapes import SHAPES, shape, shape_names
from rl_jax.sysmodel import ModelShape

ROOT = Path(__file__).resolve().parents[1]

# Parameter counts of the published checkpoints (their safetensors totals).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352,
    "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_shapes_have_the_published_parameter_counts(name):
    cfg = shape(name)
    assert cfg.num_params() == PUBLISHED_PARAMS[name]
    # the systems model counts the same parameters
    assert ModelShape.from_model_config(cfg).params == PUBLISHED_PARAMS[name]


def test_shape_lookup_is_case_insensitive_takes_aliases_and_overrides():
    assert shape("Qwen2.5-0.5B") == SHAPES["qwen2.5-0.5b"]
    assert shape("qwen2-1.5b") == SHAPES["qwen2.5-1.5b"]
    assert shape("qwen3-0.6b", max_position_embeddings=4096).max_position_embeddings == 4096
    with pytest.raises(ConfigError, match="unknown model shape 'gpt-5'.*qwen2.5-0.5b"):
        shape("gpt-5")
    with pytest.raises(ConfigError, match=r"unknown ModelConfig fields \['hidden'\]"):
        shape("tiny", hidden=3)
    assert "llama-3.1-8b" in shape_names()


def test_named_shapes_round_trip_through_hf_config():
    from rl_jax.models.config import ModelConfig
    for name in ("qwen2.5-0.5b", "qwen3-1.7b", "llama-3.2-1b", "llama-3.1-8b"):
        cfg = shape(name)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, name


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
        assert row["attention_used"] == "xla"
    [train] = entry["trainer"]
    assert "error" not in train, train
    assert 0 < train["mfu"] < 1.5 and train["tokens_per_s"] > 0
    assert train["compiled_peak_bytes"] > 0
    assert entry["trainer_attention"]["implementation"] == "xla"
    pub = entry["publication"]
    assert "error" not in pub, pub
    assert pub["version_bytes"] == 4 * SHAPES["tiny"].num_params()
    assert pub["end_to_end_gbps"] > 0
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
