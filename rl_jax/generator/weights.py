"""The generator's weights: sharding rules and meshes, loading checkpoints, checking new weights
before a swap (:func:`check_weights`) and awaiting swaps.

Everything here sits below the engine's front ends (the HTTP server, the in-process
:class:`rl_jax.generator.base.LocalGenerator`), which both load and swap weights through it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.generator.types import GeneratorError
from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import CheckpointError, load_pretrained, read_config
from rl_jax.sharding import ShardingRules

SWAP_TIMEOUT_S = 300.0
# Fields that may differ between checkpoints served by one engine (its compiled functions
# close over everything else).
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


class WeightsRefused(GeneratorError):
    """New weights that would corrupt the policy (wrong structure, shapes or dtype, non-finite
    values, an older version); the engine keeps serving the weights it has."""


def generator_rules() -> ShardingRules:
    """Tensor parallelism only: weights split over ``tensor``, sequences over ``data``."""
    return ShardingRules({"vocab": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                          "mlp": "tensor", "act_batch": "data", "act_heads": "tensor",
                          "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor"})


def make_generator_meshes(tensor_parallel: int, data_parallel: int) -> list:
    """One ``(data=1, fsdp=1, tensor=tp)`` mesh per data-parallel replica, over consecutive
    devices (replica ``i`` on devices ``i·tp .. (i+1)·tp - 1``)."""
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


@jax.jit
def _finite_leaves(leaves: list) -> jax.Array:
    """``[L]`` bool: whether every value of each leaf is finite (one program over the tree, one
    small read-back)."""
    import jax.numpy as jnp
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def _leaf_names(tree) -> list[str]:
    return [jax.tree_util.keystr(path, simple=True, separator=".")
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_weights(params: dict[str, Any], reference: dict[str, Any], *, finite: bool = True):
    """Refuses (:class:`WeightsRefused`, naming the leaves) ``params`` that differ from
    ``reference`` in tree structure or shapes, hold a dtype that cannot hold weights (anything
    but floating point), or (with ``finite``) hold a non-finite value. The finiteness check
    runs on the device the weights live on: one jitted reduction over the whole tree."""
    got, want = jax.tree.structure(params), jax.tree.structure(reference)
    if got != want:
        missing = sorted(set(_leaf_names(reference)) - set(_leaf_names(params)))
        extra = sorted(set(_leaf_names(params)) - set(_leaf_names(reference)))
        raise WeightsRefused(f"new weights do not match the engine's parameter tree (missing "
                             f"{missing[:5]}, unexpected {extra[:5]})")
    names = _leaf_names(params)
    leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(reference)
    shapes = [f"{n}: {tuple(a.shape)} (serving {tuple(b.shape)})"
              for n, a, b in zip(names, leaves, ref_leaves) if tuple(a.shape) != tuple(b.shape)]
    if shapes:
        raise WeightsRefused(f"new weights have wrong shapes: {'; '.join(shapes[:5])}")
    dtypes = [f"{n}: {np.dtype(a.dtype).name}" for n, a in zip(names, leaves)
              if not jax.numpy.issubdtype(a.dtype, jax.numpy.floating)]  # bfloat16 included
    if dtypes:
        raise WeightsRefused(f"new weights have dtypes that cannot hold weights (floating point "
                             f"only): {'; '.join(dtypes[:5])}")
    if not finite:
        return
    flags = np.asarray(_finite_leaves(leaves))
    if not flags.all():
        bad = [n for n, ok in zip(names, flags) if not ok]
        raise WeightsRefused(f"new weights hold non-finite values (NaN or infinity) in "
                             f"{len(bad)} tensor(s): {bad[:5]}")


def wait_for_swap(engine, params, timeout: float = SWAP_TIMEOUT_S) -> bool:
    """Waits until ``engine`` (an :class:`rl_jax.generator.engine.Engine`) decodes with
    ``params``; False when ``timeout`` seconds pass first or the engine stops."""
    deadline = time.monotonic() + timeout
    while engine.params is not params:
        if time.monotonic() > deadline or not engine.alive:
            return False
        time.sleep(0.002)
    return True
