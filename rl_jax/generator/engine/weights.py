"""The generator's weights: sharding rules and meshes, loading checkpoints, checking new weights
before a swap (:func:`check_weights`), laying them out for decode off the decode path
(:class:`WeightPreparer`) and awaiting swaps.

Everything here sits below the engine's front ends (the HTTP server, the in-process
:class:`rl_jax.generator.engine.local.LocalGenerator`), which both load and swap weights through it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.generator.types import GeneratorError
from rl_jax.models.config import ModelConfig
from rl_jax.models.hf import CheckpointError, load_pretrained, read_config
from rl_jax.sharding import ShardingRules

log = logging.getLogger(__name__)

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


class WeightPreparer:
    """Lays new weights out for decode in a helper thread, off the decode path.

    The engine offers checked weights (:meth:`offer`); the thread places them on every replica's
    mesh and builds their decode layout (``replica.runner.prepare``) -- the newest offer only,
    when several came meanwhile -- and leaves them in :attr:`pending` (``(params, version, [(the
    replica's params, its decode weights)] per replica)``), notifying ``ready``, for the
    scheduler to :meth:`take` and swap in between two decode steps. Weights the scheduler
    replaced come back through :meth:`retire` and are freed by the thread, outside the lock and
    the scheduler. A layout that fails is logged and counted (``weight_update_errors``); the
    engine keeps its weights. :meth:`offer`, :meth:`take`, :meth:`retire` and :meth:`stop` are
    called holding the lock of ``ready``.

    Args:
      replicas: the engine's data-parallel replicas (``place`` and ``runner.prepare``).
      mutex: the engine's lock.
      ready: the engine's condition on ``mutex``, notified when new weights are ready.
      stats: the engine's counters (``weight_prepare_ms``, ``weight_update_errors``).
    """

    def __init__(self, replicas: list, mutex: threading.RLock, ready: threading.Condition,
                 stats: dict[str, int]):
        self._replicas = replicas
        self._ready = ready
        self._wake = threading.Condition(mutex)  # the helper waits on this
        self.stats = stats
        self._to_prepare: list[tuple[dict[str, Any], int]] = []
        self._retired: list[Any] = []
        self.pending: tuple[dict[str, Any], int, list] | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-weights", daemon=True)
        self._thread.start()

    def offer(self, params: dict[str, Any], version: int):
        """Queues ``params`` (version ``version``) to be laid out; supersedes older offers."""
        self._to_prepare.append((params, version))
        self._wake.notify_all()

    def take(self) -> tuple[dict[str, Any], int, list] | None:
        """The weights laid out and not yet taken, or None."""
        pending, self.pending = self.pending, None
        return pending

    def retire(self, old: Any):
        """Hands over replaced weights, to be freed by the helper thread."""
        self._retired.append(old)
        self._wake.notify_all()

    def stop(self):
        self._stop = True
        self._wake.notify_all()

    def join(self, timeout: float):
        self._thread.join(timeout=timeout)

    def _loop(self):
        while True:
            with self._wake:
                while not self._stop and not self._to_prepare and not self._retired:
                    self._wake.wait()
                if self._stop:
                    return
                retired, self._retired = self._retired, []
                job = self._to_prepare[-1] if self._to_prepare else None  # newest supersedes
                self._to_prepare.clear()
            del retired  # frees replaced weights here, outside the lock and the scheduler
            if job is None:
                continue
            params, version = job
            start = time.perf_counter()
            try:
                prepared = []
                for replica in self._replicas:
                    placed = replica.place(params)
                    prepared.append((placed, replica.runner.prepare(placed)))
                jax.block_until_ready(prepared)
            except Exception:  # keep serving with the current weights
                log.exception("laying out weights version %d for decode failed", version)
                self.stats["weight_update_errors"] += 1
                continue
            self.stats["weight_prepare_ms"] += int((time.perf_counter() - start) * 1000)
            with self._ready:
                self.pending = (params, version, prepared)
                self._ready.notify_all()


def wait_for_swap(engine, params, timeout: float = SWAP_TIMEOUT_S) -> bool:
    """Waits until ``engine`` (an :class:`rl_jax.generator.engine.core.Engine`) decodes with
    ``params``; False when ``timeout`` seconds pass first or the engine stops."""
    deadline = time.monotonic() + timeout
    while engine.params is not params:
        if time.monotonic() > deadline or not engine.alive:
            return False
        time.sleep(0.002)
    return True
