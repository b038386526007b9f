"""Train state (parameters, optimizer state, counters), its shardings, and the optimizer.

Parameters are kept as a plain nested dict of arrays (``{"embed": ..., "layers": {"wq": ...}}``)
so that checkpoints, weight transfer and checksums see ordinary pytrees; :class:`ModelSpec` turns
such a dict back into an NNX module inside a jitted function.

With low-rank adapters (``ModelSpec(lora=...)``, :mod:`rl_jax.models.lora`) the state's
``params`` are the adapters only: gradients, optimizer state and checkpoints cover them alone.
The frozen base weights ride in ``TrainState.frozen`` in the compute dtype, sharded by the same
rules; they take no gradient and are not written in checkpoints (a restore is given them).
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
from rl_jax.models.lora import LoraConfig, is_adapter
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import ShardingRules

Params = dict[str, Any]


@flax.struct.dataclass
class TrainState:
    """``step`` counts applied optimizer updates (the policy version); ``skipped`` counts steps
    whose loss or gradient was not finite and that were therefore not applied; ``frozen``: the
    weights the model reads but does not train (a LoRA run's base; empty otherwise)."""

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    skipped: jax.Array
    frozen: Params = flax.struct.field(default_factory=dict)


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
    :mod:`rl_jax.models.fused_attention`). With ``lora``, ``abstract_params`` /
    ``param_shardings`` describe the trainable adapters only and ``frozen_abstract`` /
    ``frozen_shardings`` the base, held in the compute ``dtype``; without, the frozen ones are
    empty.
    """

    def __init__(self, config: ModelConfig, *, mesh: Mesh | None, rules: ShardingRules | None =
                 None, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 remat: str = "none", scan_layers: bool = True, attention: str = "auto",
                 lora: LoraConfig | None = None):
        self.config = config
        self.mesh = mesh
        self.rules = rules or ShardingRules.default()
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.lora = lora
        abstract = abstract_model(config, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                                  rules=self.rules, remat=remat, scan_layers=scan_layers,
                                  attention=attention, lora=lora)
        self.graphdef, self._template = nnx.split(abstract)
        everything = nnx.to_pure_dict(self._template)
        shardings = nnx.to_pure_dict(param_shardings(self._template, mesh, self.rules))
        self.param_logical_axes: dict[str, tuple[str, ...]] = {
            name: var.get_metadata().get("logical_axes") for name, var in iter_params(self._template)}
        if lora is None:
            self.abstract_params: Params = everything
            self.param_shardings: Params = shardings
            self.frozen_abstract: Params = {}
            self.frozen_shardings: Params = {}
        else:
            self.abstract_params, frozen = split_adapters(everything)
            self.param_shardings, self.frozen_shardings = split_adapters(shardings)
            self.frozen_abstract = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, dtype), frozen)

    def merge(self, params: Params, frozen: Params | None = None,
              dropout_key: jax.Array | None = None) -> Transformer:
        """An NNX model over ``params`` and the ``frozen`` ones (works on traced arrays inside
        jit); ``dropout_key``: a training forward's adapter-dropout key (used when
        ``lora.dropout > 0``)."""
        flat = dict(_flatten(params))
        flat.update(_flatten(frozen or {}))
        state = nnx.map_state(lambda path, v: v.replace(flat[".".join(map(str, path))]),
                              self._template)
        model = nnx.merge(self.graphdef, state)
        if dropout_key is not None:
            model.lora_dropout_key = nnx.data(dropout_key)
        return model

    @property
    def has_dropout(self) -> bool:
        return self.lora is not None and self.lora.dropout > 0

    def dropout_key(self, step: jax.Array, micro: jax.Array) -> jax.Array | None:
        """The adapter-dropout key of optimizer step ``step``'s micro-batch ``micro`` (a
        function of the two only, so a resumed run draws the masks it would have), or None
        without dropout."""
        if not self.has_dropout:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step), micro)

    def split(self, model: Transformer) -> Params:
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def init_params(self, seed: int) -> Params:
        """Random parameters, materialised directly in their sharded layout: all of them (a
        LoRA spec's base and adapters in one dict: :meth:`split_frozen` parts them)."""
        def init():
            model = Transformer(self.config, rngs=nnx.Rngs(seed), dtype=self.dtype,
                                param_dtype=self.param_dtype, mesh=self.mesh, rules=self.rules,
                                lora=self.lora)
            return nnx.to_pure_dict(nnx.state(model, nnx.Param))

        out = _merge_trees(self.param_shardings, self.frozen_shardings)
        return jax.jit(init, out_shardings=out)()

    def init_adapters(self, seed: int) -> Params:
        """Fresh adapters (PEFT's initialisation: the adapted model equals its base), sharded;
        the same as :meth:`init_params`'s for ``seed``."""
        if self.lora is None:
            raise ValueError("init_adapters needs a ModelSpec with lora")

        def init():
            model = Transformer(self.config, rngs=nnx.Rngs(seed), dtype=self.dtype,
                                param_dtype=self.param_dtype, mesh=self.mesh, rules=self.rules,
                                lora=self.lora)
            return split_adapters(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]

        return jax.jit(init, out_shardings=self.param_shardings)()

    def split_frozen(self, params: Params, seed: int = 0) -> tuple[Params, Params]:
        """All parameters (or a base without adapters, which then get :meth:`init_adapters`'s
        of ``seed``) → ``(trainable, frozen)``, each in its sharded layout, the frozen base
        cast to the compute dtype. Without lora: ``(params, {})``."""
        if self.lora is None:
            return params, {}
        trainable, frozen = split_adapters(params)
        if not trainable:
            trainable = self.init_adapters(seed)
        frozen = jax.jit(lambda f: jax.tree.map(lambda x: x.astype(self.dtype), f),
                         out_shardings=self.frozen_shardings)(frozen)
        return trainable, frozen

    def replicated(self) -> Any:
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, PartitionSpec())


def split_adapters(tree: Params) -> tuple[Params, Params]:
    """A nested parameter dict → ``(adapters, the rest)``, both nested like it (a part with no
    leaves is left out)."""
    adapters, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            a, r = split_adapters(value)
            if a:
                adapters[key] = a
            if r:
                rest[key] = r
        elif is_adapter(str(key)):
            adapters[key] = value
        else:
            rest[key] = value
    return adapters, rest


def _merge_trees(a: Params, b: Params) -> Params:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge_trees(out[key], value) if isinstance(value, dict) and key in out \
            else value
    return out


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
                      opt_state=opt_state_shardings(tx, spec), skipped=rep,
                      frozen=spec.frozen_shardings)


def abstract_state(tx: optax.GradientTransformation, spec: ModelSpec) -> TrainState:
    """``ShapeDtypeStruct``s with shardings for the whole train state (restore targets; a LoRA
    restore target needs its ``frozen`` replaced by the base's arrays)."""
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=spec.abstract_params,
                        opt_state=jax.eval_shape(tx.init, spec.abstract_params),
                        skipped=jax.ShapeDtypeStruct((), jnp.int32),
                        frozen=spec.frozen_abstract)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, state_shardings(tx, spec))


def init_state(tx: optax.GradientTransformation, spec: ModelSpec, params: Params,
               frozen: Params | None = None) -> TrainState:
    """A fresh train state around ``params`` (already sharded; with lora the adapters, and
    ``frozen`` the base from :meth:`ModelSpec.split_frozen`), created in its sharded layout;
    the optimizer state covers ``params`` only."""
    shardings = state_shardings(tx, spec)
    frozen = {} if frozen is None else frozen
    if jax.tree.structure(frozen) != jax.tree.structure(spec.frozen_abstract):
        raise ValueError("init_state: frozen weights do not match the spec's "
                         f"({len(jax.tree.leaves(frozen))} arrays for "
                         f"{len(jax.tree.leaves(spec.frozen_abstract))})")

    def build(p):
        return TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                          skipped=jnp.zeros((), jnp.int32))

    # The base is not an input of the program: it would come out as a copy.
    return jax.jit(build, out_shardings=shardings.replace(frozen={}))(params).replace(
        frozen=frozen)


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
