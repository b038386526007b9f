"""Policy losses and advantage estimators as pure, jit-able functions over arrays.

    from rl_jax.losses import get, make_config
    from rl_jax.losses.core import finalize_metrics
    out = get("grpo")(logprobs, behaviour_logprobs, advantages, loss_mask,
                      config=make_config("grpo"))
    loss = out.mean()  # loss_sum / denominator, 0 for a batch with no unmasked token

Every policy loss returns ``(loss_sum, denominator, metrics)`` so that micro-batches, hosts and
shards reduce exactly (``Σ loss_sum / Σ denominator``); see :mod:`rl_jax.losses.core` for the
normalisations and :mod:`rl_jax.losses.policy` for the common signature, and ``docs/losses.md``
for each loss's and normalisation's name in verl, tunix, TRL and AReaL.

Registered policy losses: ``reinforce_tis``, ``ppo_clip``, ``grpo``, ``dapo``, ``dr_grpo``,
``gspo``, ``gmpo``, ``cispo``, ``decoupled_ppo``, ``m2po``. Advantage estimators
(:func:`get_advantage_estimator`): ``grpo``, ``rloo``, ``dr_grpo``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rl_jax.losses.configs import (CISPOConfig, DAPOConfig, DecoupledPPOConfig, DrGRPOConfig,
                                   GMPOConfig, GRPOConfig, GSPOConfig, LossConfigError, M2POConfig,
                                   PolicyLossConfig, PPOClipConfig, ReinforceTISConfig)
from rl_jax.losses.core import LossOutput
from rl_jax.losses.policy import (cispo, dapo, decoupled_ppo, dr_grpo, gmpo, grpo, gspo, m2po,
                                  ppo_clip, reinforce_tis)

PolicyLoss = Callable[..., LossOutput]


@dataclasses.dataclass(frozen=True)
class RegisteredLoss:
    """A policy loss and the configuration class whose defaults are its published settings."""

    fn: PolicyLoss
    config_class: type[PolicyLossConfig]


_REGISTRY: dict[str, RegisteredLoss] = {
    "reinforce_tis": RegisteredLoss(reinforce_tis, ReinforceTISConfig),
    "ppo_clip": RegisteredLoss(ppo_clip, PPOClipConfig),
    "grpo": RegisteredLoss(grpo, GRPOConfig),
    "dapo": RegisteredLoss(dapo, DAPOConfig),
    "dr_grpo": RegisteredLoss(dr_grpo, DrGRPOConfig),
    "gspo": RegisteredLoss(gspo, GSPOConfig),
    "gmpo": RegisteredLoss(gmpo, GMPOConfig),
    "cispo": RegisteredLoss(cispo, CISPOConfig),
    "decoupled_ppo": RegisteredLoss(decoupled_ppo, DecoupledPPOConfig),
    "m2po": RegisteredLoss(m2po, M2POConfig),
}


def _entry(name: str) -> RegisteredLoss:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LossConfigError(f"unknown policy loss {name!r}; known: {names()}") from None


def get(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``."""
    return _entry(name).fn


def names() -> tuple[str, ...]:
    """Names of the registered policy losses."""
    return tuple(_REGISTRY)


def config_class(name: str) -> type[PolicyLossConfig]:
    """The configuration dataclass of the loss ``name``."""
    return _entry(name).config_class


def make_config(name: str, **overrides: Any) -> PolicyLossConfig:
    """The default configuration of the loss ``name`` with ``overrides`` applied (validated)."""
    cls = config_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise LossConfigError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(fields)}")
    return cls(**overrides)


def register(name: str, fn: PolicyLoss, config_cls: type[PolicyLossConfig]) -> None:
    """Adds a policy loss with the common signature under ``name`` (refuses to overwrite)."""
    if name in _REGISTRY:
        raise LossConfigError(f"a policy loss named {name!r} is already registered")
    _REGISTRY[name] = RegisteredLoss(fn, config_cls)


