"""LoRA adapters to and from PEFT's format, and merged into a full HF checkpoint.

PEFT's layout (what ``PeftModel.save_pretrained`` writes for a Qwen2 / Llama causal LM and
``PeftModel.from_pretrained`` loads): ``adapter_config.json`` and ``adapter_model.safetensors``
holding, per layer ``i`` and target module,
``base_model.model.model.layers.{i}.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``; PEFT multiplies ``B·A`` by ``lora_alpha / r`` itself. Our ``A [L, in..., r]`` and
``B [L, r, out...]`` flatten their head axes in the order the HF weights do
(:func:`rl_jax.models.hf.hf_mappings`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import CheckpointError, _replace_dir, _to_host, save_pretrained
from rl_jax.models.lora import (A_SUFFIX, B_SUFFIX, TARGETS, LoraConfig, LoraConfigError,
                                adapter_specs, merge_adapters)
from rl_jax.models.transformer import Transformer, layer_param_specs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model.layers.{i}."


def peft_module(target: str) -> str:
    """Our target name (``"q"``) → its HF module name (``"q_proj"``)."""
    return TARGETS[target][2].split(".")[-1]


def peft_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json``'s content."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(peft_module(t) for t in lora.targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def peft_tensors(adapters: dict[str, Any], cfg: ModelConfig, lora: LoraConfig
                 ) -> dict[str, np.ndarray]:
    """Adapters (``{"layers": {"wq_lora_a": ..., ...}}``, possibly sharded) → PEFT's tensors."""
    layers = adapters["layers"]
    out = {}
    for target in lora.targets:
        weight, _, module = TARGETS[target]
        a = _to_host(layers[weight + A_SUFFIX])
        b = _to_host(layers[weight + B_SUFFIX])
        r = a.shape[-1]
        for i in range(cfg.num_layers):
            name = PEFT_PREFIX.format(i=i) + module
            out[name + ".lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[name + ".lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


def save_peft_adapter(path: str | os.PathLike, adapters: dict[str, Any], cfg: ModelConfig,
                      lora: LoraConfig, *, base_model: str = "") -> Path:
    """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` (atomically: a complete
    directory replaces any old one). Every process of a multi-process run must call it (the
    adapters are gathered collectively); only process 0 writes."""
    path = Path(path)
    tensors = peft_tensors(adapters, cfg, lora)
    if jax.process_index() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base_model), indent=2))
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_peft_adapter(path: str | os.PathLike, cfg: ModelConfig
                      ) -> tuple[dict[str, Any], LoraConfig]:
    """Reads a PEFT LoRA adapter of a model shaped ``cfg`` → ``(adapters as numpy stacks,
    its LoraConfig)``. Refuses (``CheckpointError``) what this model cannot apply: another
    PEFT type, per-module ranks or alphas, rsLoRA/DoRA, unknown modules, wrong shapes, or
    non-finite values."""
    path = Path(path)
    try:
        meta = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {ADAPTER_CONFIG}: {e}") from e
    if meta.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {meta.get('peft_type')!r} is not LORA")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if meta.get(key):
            raise CheckpointError(f"{path}: {key} adapters are not supported")
    if meta.get("rank_pattern") or meta.get("alpha_pattern") or meta.get("layers_to_transform"):
        raise CheckpointError(f"{path}: per-module ranks, alphas or layers are not supported")
    by_module = {peft_module(t): t for t in TARGETS}
    modules = meta.get("target_modules") or []
    if isinstance(modules, str) or any(m not in by_module for m in modules):
        raise CheckpointError(f"{path}: target_modules {modules!r}: each must be one of "
                              f"{sorted(by_module)}")
    try:
        lora = LoraConfig(rank=meta.get("r"), alpha=meta.get("lora_alpha"),
                          dropout=float(meta.get("lora_dropout") or 0.0),
                          targets=tuple(t for t in TARGETS if peft_module(t) in modules))
    except LoraConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e
    specs = adapter_specs(cfg, layer_param_specs(cfg), lora)
    layers: dict[str, np.ndarray] = {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="numpy") as f:
        names = set(f.keys())
        for target in lora.targets:
            weight, _, module = TARGETS[target]
            for suffix, part in ((A_SUFFIX, "lora_A"), (B_SUFFIX, "lora_B")):
                shape = specs[weight + suffix][0]
                stack = np.empty(shape, np.float32)
                for i in range(cfg.num_layers):
                    name = f"{PEFT_PREFIX.format(i=i)}{module}.{part}.weight"
                    if name not in names:
                        raise CheckpointError(f"{path}: missing tensor {name}")
                    x = f.get_tensor(name).astype(np.float32)
                    expected = ((lora.rank, int(np.prod(shape[1:-1]))) if part == "lora_A"
                                else (int(np.prod(shape[2:])), lora.rank))
                    if x.shape != expected:
                        raise CheckpointError(f"{path}: {name} has shape {x.shape}, expected "
                                              f"{expected}")
                    if not np.all(np.isfinite(x)):
                        raise CheckpointError(f"{path}: {name} holds non-finite values")
                    stack[i] = x.T.reshape(shape[1:])
                layers[weight + suffix] = stack
    return {"layers": layers}, lora


def save_merged(path: str | os.PathLike, model_config: ModelConfig, params: dict[str, Any],
                lora: LoraConfig, *, tokenizer=None, dtype: Any = None) -> Path:
    """Writes the full HF checkpoint of ``params`` (base + adapters in one nested dict) with
    every adapter merged into its weight (``W + alpha/r · A·B``; see
    :func:`rl_jax.models.lora.merge_adapters`) through :func:`rl_jax.models.hf.save_pretrained`."""
    merged = jax.jit(lambda p: merge_adapters(p, lora))(params)
    abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = {".".join(map(str, k)): v for k, v in _flat(merged)}
    state = nnx.map_state(lambda p, v: v.replace(flat[".".join(map(str, p))]), state)
    return save_pretrained(nnx.merge(graphdef, state), path, tokenizer=tokenizer, dtype=dtype)


def _flat(tree: dict[str, Any], prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, prefix + (key,))
        else:
            yield prefix + (key,), value
