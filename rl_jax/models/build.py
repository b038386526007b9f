"""Creating models directly sharded: abstract shapes first, then parameters materialised in their
final layout (no unsharded copy on any device)."""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from rl_jax.models.config import ModelConfig
from rl_jax.models.lora import LoraConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import ShardingRules


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def iter_params(state: nnx.State) -> Iterator[tuple[str, nnx.Variable]]:
    """``(dotted name, Variable)`` for every variable in ``state``, in a stable order."""
    for path, var in nnx.to_flat_state(state):
        yield path_name(path), var


def abstract_model(config: ModelConfig, *, dtype: Any = jnp.float32,
                   param_dtype: Any = jnp.float32, mesh: Mesh | None = None,
                   rules: ShardingRules | None = None, remat: str = "none",
                   scan_layers: bool = True, attention: str = "auto",
                   lora: LoraConfig | None = None) -> Transformer:
    """The model with ``ShapeDtypeStruct`` parameters: costs no memory."""
    return nnx.eval_shape(lambda: Transformer(
        config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules,
        remat=remat, scan_layers=scan_layers, attention=attention, lora=lora))


def param_shardings(state: nnx.State, mesh: Mesh | None,
                    rules: ShardingRules | None = None) -> nnx.State:
    """A state of the same structure holding each parameter's sharding.

    Raises ``ShardingError`` naming the parameter when the mesh does not divide a dimension.
    """
    rules = rules or ShardingRules.default()

    def one(path, var):
        if mesh is None:
            return var.replace(SingleDeviceSharding(jax.devices()[0]))
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            return var.replace(NamedSharding(mesh, jax.sharding.PartitionSpec()))
        return var.replace(rules.sharding(mesh, axes, var.shape, name=path_name(path)))

    return nnx.map_state(one, state)


def create_model(config: ModelConfig, *, seed: int = 0, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, mesh: Mesh | None = None,
                 rules: ShardingRules | None = None, remat: str = "none",
                 scan_layers: bool = True) -> Transformer:
    """A randomly initialised model whose parameters are created in their sharded layout."""
    rules = rules or ShardingRules.default()
    abstract = abstract_model(config, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                              rules=rules, remat=remat, scan_layers=scan_layers)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh, rules)

    def init():
        model = Transformer(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype,
                            mesh=mesh, rules=rules, remat=remat, scan_layers=scan_layers)
        return nnx.state(model)

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
