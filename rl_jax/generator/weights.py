"""The generator's weights: sharding rules and meshes, loading checkpoints, checking and awaiting
swaps.

Everything here sits below the engine's front ends (the HTTP server, the in-process
:class:`rl_jax.generator.base.LocalGenerator`), which both load and swap weights through it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import CheckpointError, load_pretrained, read_config
from rl_jax.sharding import ShardingRules

SWAP_TIMEOUT_S = 300.0
# Fields that may differ between checkpoints served by one engine (its compiled functions
# close over everything else).
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def generator_rules() -> ShardingRules:
    """Tensor parallelism only: weights split over ``tensor``, sequences over ``data``."""
    return ShardingRules({"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "act_batch": "data", "act_heads": "tensor",
                          "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"})


def make_generator_meshes(tensor_parallel: int, data_parallel: int) -> list:
    """One ``(data=1, fsdp=1, tensor=tp)`` mesh per data-parallel replica, over consecutive
    devices (replica ``i`` on devices ``i·tp .. (i+1)·tp - 1``)."""
    import jax

    from rl_jax.sharding import ShardingError, make_mesh
    devices = jax.devices()
    need = tensor_parallel * data_parallel
    if len(devices) < need:
        raise ShardingError(f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} "
                            f"needs {need} devices, {len(devices)} are available")
    return [make_mesh(data=1, fsdp=1, tensor=tensor_parallel,
                      devices=devices[i * tensor_parallel:(i + 1) * tensor_parallel])
            for i in range(data_parallel)]


def load_params(model_dir: str | Path, *, mesh, rules, dtype) -> tuple[ModelConfig, dict]:
    """Reads an HF checkpoint into the engine's parameter dict, placed for ``mesh``."""
    from flax import nnx
    model = load_pretrained(model_dir, mesh, dtype, rules=rules)
    return model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def incompatibilities(current: ModelConfig, new: ModelConfig) -> list[str]:
    """Why ``new`` cannot replace ``current`` in a running engine ([] when it can)."""
    return [f"{f.name}: {getattr(current, f.name)!r} -> {getattr(new, f.name)!r}"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in _TOKEN_FIELDS and getattr(current, f.name) != getattr(new, f.name)]


def check_update(current: ModelConfig, model_dir: str | Path) -> ModelConfig:
    """The config of ``model_dir`` if its weights can be swapped into an engine serving
    ``current``; raises :class:`CheckpointError` otherwise."""
    new = read_config(model_dir)
    problems = incompatibilities(current, new)
    if problems:
        raise CheckpointError(f"checkpoint {str(model_dir)!r} does not match the served model "
                              f"({'; '.join(problems)})")
    return new


def wait_for_swap(engine, params, timeout: float = SWAP_TIMEOUT_S) -> bool:
    """Waits until ``engine`` (an :class:`rl_jax.generator.engine.Engine`) decodes with
    ``params``; False when ``timeout`` seconds pass first or the engine stops."""
    deadline = time.monotonic() + timeout
    while engine.params is not params:
        if time.monotonic() > deadline or not engine.alive:
            return False
        time.sleep(0.002)
    return True
