"""Train state (parameters, optimizer state, counters), its shardings, and the optimizer.

Parameters are kept as a plain nested dict of arrays (``{"embed": ..., "layers": {"wq": ...}}``)
so that checkpoints, weight transfer and checksums see ordinary pytrees; :class:`ModelSpec` turns
such a dict back into an NNX module inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_jax.models.build import abstract_model, iter_params, param_shardings
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import ShardingRules

Params = dict[str, Any]


@flax.struct.dataclass
class TrainState:
    """``step`` counts applied optimizer updates (the policy version); ``skipped`` counts steps
    whose loss or gradient was not finite and that were therefore not applied."""

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    skipped: jax.Array


SCHEDULE_CLOCKS = ("steps", "progress")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule.

    ``schedule_on``: ``"steps"`` decays over ``total_steps`` optimizer updates (the schedule is
    part of the optimizer); ``"progress"`` decays over the run's progress, a fraction in
    ``[0, 1]`` the caller sets before every update (e.g. the larger of steps done over
    ``total_steps`` and wall time over a time limit, so that a run stopped by its time limit
    ends its schedule when it ends): the learning rate is then an input of the optimizer state
    (:func:`set_learning_rate`), computed by :func:`learning_rate_at`.
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    final_lr_ratio: float = 0.1  # cosine decays to learning_rate * final_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    schedule_on: str = "steps"

    def __post_init__(self):
        if self.schedule_on not in SCHEDULE_CLOCKS:
            raise ValueError(f"schedule_on must be one of {SCHEDULE_CLOCKS}, got "
                             f"{self.schedule_on!r}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warm-up over ``warmup_steps`` (the first update already uses
    ``learning_rate / warmup_steps``), then cosine decay to ``learning_rate * final_lr_ratio``."""
    first = cfg.learning_rate / max(cfg.warmup_steps, 1)
    if cfg.total_steps <= cfg.warmup_steps:
        return optax.linear_schedule(first, cfg.learning_rate, max(cfg.warmup_steps - 1, 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=first, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.final_lr_ratio)


def learning_rate_at(cfg: OptimizerConfig, step: int, progress: float) -> float:
    """The ``"progress"`` schedule's learning rate for update ``step`` (0-based) at run progress
    ``progress`` in ``[0, 1]``: linear warm-up over the first ``warmup_steps`` updates (as
    :func:`learning_rate_schedule`), then cosine decay from ``learning_rate`` at progress 0 to
    ``learning_rate * final_lr_ratio`` at progress 1."""
    peak = cfg.learning_rate
    if step < cfg.warmup_steps:
        first = peak / cfg.warmup_steps
        return first + (peak - first) * step / cfg.warmup_steps
    q = min(max(float(progress), 0.0), 1.0)
    end = peak * cfg.final_lr_ratio
    return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * q))


def set_learning_rate(opt_state: optax.OptState, learning_rate: float) -> optax.OptState:
    """``opt_state`` of a ``"progress"`` optimizer with its learning rate set (placed like the
    value it replaces)."""
    def visit(node):
        if isinstance(node, (optax.InjectStatefulHyperparamsState,
                             optax.InjectHyperparamsState)):
            old = node.hyperparams["learning_rate"]
            new = jnp.asarray(learning_rate, old.dtype)
            sharding = getattr(old, "sharding", None)
            new = jax.device_put(new, sharding) if sharding is not None else new
            return node._replace(hyperparams={**node.hyperparams, "learning_rate": new})
        if isinstance(node, tuple):
            parts = [visit(x) for x in node]
            return type(node)(*parts) if hasattr(node, "_fields") else tuple(parts)
        return node
    return visit(opt_state)


def _decay_mask(params: Params) -> Params:
    """Weight decay on matrices and embeddings only, not on norms or biases."""
    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not ("norm" in name or name.startswith("b"))
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW with warm-up/cosine schedule and optional global-norm clipping."""
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    if cfg.schedule_on == "progress":
        parts.append(optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
            learning_rate=learning_rate_at(cfg, 0, 0.0), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
            weight_decay=cfg.weight_decay, mask=_decay_mask))
    else:
        parts.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                                 eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask))
    return optax.chain(*parts)


class ModelSpec:
    """Everything static about a model: its graph, abstract parameters and their shardings.

    ``attention`` picks the attention kernel of the training graph (``"auto"``: by backend; see
    :mod:`rl_jax.models.fused_attention`).
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh | None, rules: ShardingRules | None =
                 None, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 remat: str = "none", scan_layers: bool = True, attention: str = "auto"):
        self.config = config
        self.mesh = mesh
        self.rules = rules or ShardingRules.default()
        self.dtype = dtype
        self.param_dtype = param_dtype
        abstract = abstract_model(config, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                                  rules=self.rules, remat=remat, scan_layers=scan_layers,
                                  attention=attention)
        self.graphdef, self._template = nnx.split(abstract)
        self.abstract_params: Params = nnx.to_pure_dict(self._template)
        self.param_shardings: Params = nnx.to_pure_dict(
            param_shardings(self._template, mesh, self.rules))
        self.param_logical_axes: dict[str, tuple[str, ...]] = {
            name: var.get_metadata().get("logical_axes") for name, var in iter_params(self._template)}

    def merge(self, params: Params) -> Transformer:
        """An NNX model over ``params`` (works on traced arrays inside jit)."""
        flat = dict(_flatten(params))
        state = nnx.map_state(lambda path, v: v.replace(flat[".".join(map(str, path))]),
                              self._template)
        return nnx.merge(self.graphdef, state)

    def split(self, model: Transformer) -> Params:
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def init_params(self, seed: int) -> Params:
        """Random parameters, materialised directly in their sharded layout."""
        def init():
            model = Transformer(self.config, rngs=nnx.Rngs(seed), dtype=self.dtype,
                                param_dtype=self.param_dtype, mesh=self.mesh, rules=self.rules)
            return nnx.to_pure_dict(nnx.state(model, nnx.Param))

        return jax.jit(init, out_shardings=self.param_shardings)()

    def replicated(self) -> Any:
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, PartitionSpec())


def _flatten(tree: Params, prefix: str = ""):
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def opt_state_shardings(tx: optax.GradientTransformation, spec: ModelSpec) -> Any:
    """Optimizer-state shardings: moments follow their parameter, counters are replicated."""
    abstract = jax.eval_shape(tx.init, spec.abstract_params)
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract, spec.param_shardings,
        transform_non_params=lambda _: spec.replicated())


def state_shardings(tx: optax.GradientTransformation, spec: ModelSpec) -> TrainState:
    rep = spec.replicated()
    return TrainState(step=rep, params=spec.param_shardings,
                      opt_state=opt_state_shardings(tx, spec), skipped=rep)


def abstract_state(tx: optax.GradientTransformation, spec: ModelSpec) -> TrainState:
    """``ShapeDtypeStruct``s with shardings for the whole train state (restore targets)."""
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=spec.abstract_params,
                        opt_state=jax.eval_shape(tx.init, spec.abstract_params),
                        skipped=jax.ShapeDtypeStruct((), jnp.int32))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, state_shardings(tx, spec))


def init_state(tx: optax.GradientTransformation, spec: ModelSpec, params: Params) -> TrainState:
    """A fresh train state around ``params`` (already sharded), created in its sharded layout."""
    shardings = state_shardings(tx, spec)

    def build(p):
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                          skipped=jnp.zeros((), jnp.int32))

    return jax.jit(build, out_shardings=shardings)(params)


# ---- an exponential moving average of the parameters -------------------------------------------

def ema_decay_at(decay: float, updates: int) -> float:
    """The averaging weight of the ``updates``-th update: ``min(decay, (1 + n) / (10 + n))``, so
    that the average follows the first updates closely instead of staying near the
    starting parameters (the form of TensorFlow's ``ExponentialMovingAverage(num_updates)``)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
    return min(decay, (1.0 + updates) / (10.0 + updates))


@functools.partial(jax.jit, donate_argnums=0)
def ema_update(average: Params, params: Params, decay: jax.Array) -> Params:
    """``decay · average + (1 − decay) · params``, leaf by leaf, computed in float32 and kept in
    each leaf's dtype and sharding; ``average`` is donated (the caller swaps the result in)."""
    def one(a, p):
        mixed = decay * a.astype(jnp.float32) + (1.0 - decay) * p.astype(jnp.float32)
        return mixed.astype(a.dtype)

    return jax.tree.map(one, average, params)
