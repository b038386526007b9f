"""Shared builders for the generator server, client and router tests: tiny HF checkpoints with a
character tokenizer, server pools on free loopback ports, and a small blocking HTTP helper."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from rl_jax.data.tokenizer import build_char_tokenizer
from rl_jax.generator.launcher.pool import PoolConfig, ServerPool
from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import hf_mappings, save_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +="
EOS = 2
MAX_SEQ_LEN = 512


def tiny_config(vocab: int, hidden: int = 32) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       bos_token_id=1, eos_token_id=EOS, pad_token_id=0)


def write_random_checkpoint(cfg: ModelConfig, path: Path, tokenizer, seed: int) -> Path:
    """An HF checkpoint of ``cfg`` with random weights drawn in NumPy (no model is built, so
    nothing is compiled): matrices ~ N(0, 1/fan_in), norms 1."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for m in hf_mappings(cfg).values():
        names = [m.hf_name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in m.hf_name \
            else [m.hf_name]
        for name in names:
            if len(m.hf_shape) == 1:
                tensors[name] = np.ones(m.hf_shape, np.float32)
            else:
                std = 1.0 if "embed" in name else m.hf_shape[-1] ** -0.5
                tensors[name] = rng.normal(0, std, m.hf_shape).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf("float32")))
    save_tokenizer(tokenizer, path, cfg)
    return path


def write_checkpoints(root: Path, names=("a", "b"), wide: bool = False) -> dict[str, Path]:
    """Checkpoints ``a``, ``b``, ... of one shape (seeds 0, 1, ...) with ``tokenizer.json``;
    with ``wide``, also one with another hidden size."""
    tok = build_char_tokenizer(ALPHABET)
    cfg = tiny_config(tok.get_vocab_size())
    paths = {name: write_random_checkpoint(cfg, root / name, tok, seed)
             for seed, name in enumerate(names)}
    if wide:
        paths["wide"] = write_random_checkpoint(tiny_config(cfg.vocab_size, hidden=48),
                                                root / "wide", tok, 99)
    return paths


def server_env() -> tuple[tuple[str, str], ...]:
    """Servers use one CPU device (the tests' 8 fake devices would only slow them down)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "")
    return (("XLA_FLAGS", flags), ("JAX_PLATFORMS", "cpu"), ("TOKENIZERS_PARALLELISM", "false"))


def start_pool(model: Path, count: int, log_dir: Path, *, extra_args=(), **kw) -> ServerPool:
    config = PoolConfig(model=str(model), ports=(0,) * count, max_slots=8,
                        max_seq_len=MAX_SEQ_LEN, extra_args=tuple(extra_args), env=server_env(),
                        startup_timeout=180, log_dir=str(log_dir), **kw)
    return ServerPool(config).start()


def http(url: str, path: str, body=None, *, method: str | None = None, raw: bytes | None = None,
         timeout: float = 120.0, headers: dict[str, str] | None = None):
    """``(status, parsed JSON or text, headers)`` of one request, whatever its HTTP status
    (transport errors and timeouts raise ``OSError``); ``headers`` are added to the request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method or (
        "POST" if data is not None else "GET"),
        headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text, headers = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as e:
        status, text, headers = e.code, e.read().decode(), e.headers
    try:
        return status, json.loads(text), headers
    except json.JSONDecodeError:
        return status, text, headers
