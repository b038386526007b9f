"""Low-rank adapters (LoRA, arXiv:2106.09685) on the attention and MLP projections.

A target projection ``W`` (stacked over layers, in this model's layout: ``wq [L, D, H, Dh]``,
``wo [L, H, Dh, D]``, ``w_down [L, F, D]``, ...) gets ``A [L, in..., r]`` and ``B [L, r, out...]``
and computes ``x·W + (alpha / r) · (x·A)·B``. ``A`` is drawn as PEFT draws it (Kaiming-uniform
with ``a = sqrt(5)``: uniform in ``±1/sqrt(fan_in)``) and ``B`` is zero, so an adapted model's
first forward equals its base's.

Why not Flax's ``nnx.LoRA`` / ``nnx.LoRALinear`` (or qwix, not a dependency here): this model
keeps every layer's weights as ``[L, ...]`` stacks that a ``lax.scan`` walks and pure layer
functions (shared with the decode path) read from a dict, with several input/output axes per
projection (heads × head dim) each carrying a logical sharding axis. ``nnx.LoRA`` is a 2-D
module applied per call. What is used of Flax is its variable type: adapters are
``nnx.LoRAParam`` (a ``Param`` subclass) so that ``nnx.state(model, nnx.LoRAParam)`` selects
exactly what trains.

Adapters carry logical axes derived from the weight they adapt (``A``: its input axes and
``lora_rank``; ``B``: ``lora_rank`` and its output axes), so that the same
:class:`rl_jax.sharding.ShardingRules` shards them (and their optimizer state) like that weight.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.errors import UserError
from rl_jax.models.config import ModelConfig

# Target name → (our stacked weight, number of its input axes, PEFT/HF module path).
TARGETS: dict[str, tuple[str, int, str]] = {
    "q": ("wq", 1, "self_attn.q_proj"),
    "k": ("wk", 1, "self_attn.k_proj"),
    "v": ("wv", 1, "self_attn.v_proj"),
    "o": ("wo", 2, "self_attn.o_proj"),
    "gate": ("w_gate", 1, "mlp.gate_proj"),
    "up": ("w_up", 1, "mlp.up_proj"),
    "down": ("w_down", 1, "mlp.down_proj"),
}
DEFAULT_TARGETS = tuple(TARGETS)
_WEIGHTS = [weight for weight, _, _ in TARGETS.values()]
RANK_AXIS = "lora_rank"
A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"


class LoraConfigError(UserError, ValueError):
    """An adapter configuration that cannot be built; the message names the field."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """``rank`` r, ``alpha`` (the low-rank term is scaled by ``alpha / r``), ``dropout`` (on
    the adapter's input, training only) and ``targets`` (names in :data:`TARGETS`)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise LoraConfigError(f"lora.rank must be an integer > 0, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise LoraConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = ((self.targets,) if isinstance(self.targets, str) else tuple(self.targets))
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise LoraConfigError(f"lora.targets: unknown {unknown}; known: {list(TARGETS)}")
        if not targets:
            raise LoraConfigError("lora.targets must name at least one projection")
        if len(set(targets)) != len(targets):
            raise LoraConfigError(f"lora.targets names a projection twice: {list(targets)}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


def adapter_specs(cfg: ModelConfig, base_specs: dict[str, tuple[tuple[int, ...], tuple[str, ...]]],
                  lora: LoraConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], int]]:
    """Adapter name → (stacked shape, logical axes, fan-in), from the base's
    ``layer_param_specs`` (shapes without, axes with the leading ``layers`` axis)."""
    out = {}
    r = lora.rank
    for target in lora.targets:
        weight, n_in, _ = TARGETS[target]
        shape, axes = base_specs[weight]
        layers_axis, axes = axes[:1], axes[1:]
        in_shape, out_shape = shape[:n_in], shape[n_in:]
        in_axes, out_axes = axes[:n_in], axes[n_in:]
        fan_in = math.prod(in_shape)
        out[weight + A_SUFFIX] = ((cfg.num_layers,) + in_shape + (r,),
                                  layers_axis + in_axes + (RANK_AXIS,), fan_in)
        out[weight + B_SUFFIX] = ((cfg.num_layers, r) + out_shape,
                                  layers_axis + (RANK_AXIS,) + out_axes, fan_in)
    return out


def init_adapter(key: jax.Array, name: str, shape: tuple[int, ...], fan_in: int,
                 dtype: Any) -> jax.Array:
    """PEFT's initialisation: ``A`` uniform in ``±1/sqrt(fan_in)``, ``B`` zero."""
    if name.endswith(B_SUFFIX):
        return jnp.zeros(shape, dtype)
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


Dropout = tuple[jax.Array, float]  # (this layer's key, rate)


def lora_delta(x: jax.Array, w: dict[str, jax.Array], weight: str, dtype, *,
               n_in: int = 1, dropout: Dropout | None = None) -> jax.Array | None:
    """The low-rank term ``(x·A)·B`` of projection ``weight`` for inputs ``x [B, T, in...]``
    (``[B, T, out...]``), or None when ``w`` holds no adapter for it. ``B`` in ``w`` is
    expected already scaled by ``alpha / r`` (:func:`scaled_layer_weights`). ``dropout``:
    inverted dropout on ``x`` in the adapter's path only (as PEFT's ``lora_dropout``), its
    mask drawn from the key folded with the projection."""
    a = w.get(weight + A_SUFFIX)
    if a is None:
        return None
    if dropout is not None:
        key, rate = dropout
        keep = jax.random.bernoulli(jax.random.fold_in(key, _WEIGHTS.index(weight)),
                                    1.0 - rate, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
    xa = jnp.tensordot(x, a.astype(dtype), axes=n_in)
    return jnp.tensordot(xa, w[weight + B_SUFFIX].astype(dtype), axes=1)


def scaled_layer_weights(weights: dict[str, jax.Array], lora: LoraConfig | None
                         ) -> dict[str, jax.Array]:
    """Per-layer weight stacks with every ``B`` multiplied by ``alpha / r`` (once, before the
    layer scan)."""
    if lora is None:
        return weights
    return {name: (value * jnp.asarray(lora.scale, value.dtype)
                   if name.endswith(B_SUFFIX) else value) for name, value in weights.items()}


def is_adapter(name: str) -> bool:
    """Whether a (dotted or bare) parameter name is an adapter's."""
    return name.endswith((A_SUFFIX, B_SUFFIX))


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``W + scale · A·B`` for stacks ``W [L, in..., out...]``, ``A [L, in..., r]``,
    ``B [L, r, out...]``, computed in float32 and stored in ``W``'s dtype."""
    n_layers, r = a.shape[0], a.shape[-1]
    a2 = a.astype(jnp.float32).reshape(n_layers, -1, r)
    b2 = b.astype(jnp.float32).reshape(n_layers, r, -1)
    delta = jnp.einsum("lir,lro->lio", a2, b2).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def merge_adapters(params: dict[str, Any], lora: LoraConfig) -> dict[str, Any]:
    """A full parameter dict (base + adapters, nested as the model's) → the base's parameter
    dict with every adapter merged into the weight it adapts (no adapter entries left)."""
    layers = dict(params["layers"])
    for target in lora.targets:
        weight = TARGETS[target][0]
        a, b = layers.pop(weight + A_SUFFIX), layers.pop(weight + B_SUFFIX)
        layers[weight] = merged_weight(layers[weight], a, b, lora.scale)
    return {**params, "layers": layers}
