"""Servers of either kind for the protocol tests: this project's generator server or a real
SGLang server (its own environment, made by ``tools/sglang_cpu/install.sh``), started on one
checkpoint by the same launcher (:class:`rl_jax.generator.launcher.pool.ServerPool`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from generator_fixtures import MAX_SEQ_LEN, server_env
from rl_jax.generator.launcher.pool import PoolConfig, ServerPool, sglang_cpu_settings

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("rl_jax", "sglang")


def sglang_python() -> str:
    """The python of the SGLang environment the README's test command installs; a failure (not
    a skip) naming the install command when it is missing."""
    python = ROOT / ".venv-sglang" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"real SGLang is not installed at {python.parent.parent}: run "
                    f"`bash tools/sglang_cpu/install.sh .venv-sglang` (the README's test command "
                    "does)", pytrace=False)
    return str(python)


def pool_config(kind: str, model: Path, log_dir: Path, **kw) -> PoolConfig:
    """One server of ``kind`` on ``model`` (float32, 8 slots, the tests' context length)."""
    common = dict(model=str(model), kind=kind, ports=(0,), max_slots=8, max_seq_len=MAX_SEQ_LEN,
                  dtype="float32", startup_timeout=240, log_dir=str(log_dir))
    if kind == "rl_jax":
        return PoolConfig(**common, env=server_env(), **kw)
    env, args = sglang_cpu_settings()
    return PoolConfig(**common, python=sglang_python(), env=env + kw.pop("env", ()),
                      extra_args=args + tuple(kw.pop("extra_args", ())), **kw)


def start_server(kind: str, model: Path, log_dir: Path, **kw) -> ServerPool:
    return ServerPool(pool_config(kind, model, log_dir, **kw)).start()


def greedy(url: str, prompt: list[int], max_new_tokens: int, http, **params):
    """``(token ids, log-probs, meta_info)`` of one greedy completion."""
    status, data, _ = http(url, "/generate", {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **params}})
    assert status == 200, data
    triples = data["meta_info"]["output_token_logprobs"]
    return (list(data["output_ids"]), np.array([t[0] for t in triples], np.float64),
            data["meta_info"])
