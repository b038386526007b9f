"""Configuration dataclasses of the policy losses, with their published defaults.

Every loss has a frozen, hashable (so usable as a static ``jit`` argument) dataclass derived from
:class:`PolicyLossConfig`; values are checked when the dataclass is built and a bad value raises
:class:`LossConfigError`. ``rl_jax.losses.make_config(name, **overrides)`` builds one by loss name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from rl_jax.errors import UserError

LOG_RATIO_CLAMP = 20.0
NORMALIZATIONS = ("token", "sequence", "sequence_sum", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTIONS = ("none", "tis", "mis")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


class LossConfigError(UserError, ValueError):
    """A loss configuration or a loss input that cannot be used."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Options shared by every policy loss.

    Attributes:
      normalization: how per-token losses are averaged: ``"token"``, ``"sequence"``,
        ``"sequence_sum"`` or ``"constant"`` (see :mod:`rl_jax.losses.core`).
      max_tokens: ``L`` of the ``"constant"`` normalisation, in tokens; ``None`` uses ``T``.
      kl_coef: β of the penalty ``β · KL(π_θ ‖ π_ref)`` added to every token's loss (needs
        ``ref_logprobs``). 0 disables it; the KL is still reported when ``ref_logprobs`` is given.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see
      :func:`rl_jax.losses.regularizers.kl_penalty`).
      kl_value_clamp: optional bound on each token's KL estimate (``None``: none; verl and AReaL
        use 10); tokens beyond it get no gradient from the penalty.
      entropy_coef: α of the bonus ``−α · H`` added to every token's loss (needs ``entropy``).
      correction: trainer–generator mismatch correction of the policy term, weight
        ``π_prox / μ`` per token (needs ``proximal_logprobs``): ``"none"``, ``"tis"`` (truncate at
        ``correction_cap``) or ``"mis"`` (zero the tokens above ``correction_cap``).
      correction_cap: ``C`` of the correction.
      correction_level: ``"token"`` (each token's ratio), ``"sequence"`` (product over the
        sequence) or ``"geometric"`` (geometric mean over the sequence); see
        :func:`rl_jax.losses.regularizers.importance_weights`.
      log_ratio_clamp: log-ratios are clamped to ``[−c, c]`` before ``exp`` so that no ratio,
        loss or gradient overflows; clamped tokens get no gradient through the ratio.
    """

    # The registered loss this configuration belongs to (None: a base, no loss's own); a loss
    # refuses the configuration of another, whose defaults (e.g. the normalisation) differ.
    loss: ClassVar[str | None] = None

    normalization: str = "token"
    max_tokens: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_value_clamp: float | None = None
    entropy_coef: float = 0.0
    correction: str = "none"
    correction_cap: float = 5.0
    correction_level: str = "token"
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    def __post_init__(self):
        self._check()

    def _check(self) -> None:
        _one_of("normalization", self.normalization, NORMALIZATIONS)
        _one_of("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("correction", self.correction, CORRECTIONS)
        _one_of("correction_level", self.correction_level, CORRECTION_LEVELS)
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise LossConfigError(f"max_tokens must be positive, got {self.max_tokens}")
        _positive("correction_cap", self.correction_cap)
        _positive("log_ratio_clamp", self.log_ratio_clamp)
        if self.kl_value_clamp is not None:
            _positive("kl_value_clamp", self.kl_value_clamp)
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise LossConfigError(
                f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}")

    def replace(self, **changes: Any) -> "PolicyLossConfig":
        return dataclasses.replace(self, **changes)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LossConfigError(f"{name} must be one of {allowed}, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise LossConfigError(f"{name} must be positive, got {value}")


def _nonnegative(name: str, value: float) -> None:
    if not value >= 0:
        raise LossConfigError(f"{name} must be >= 0, got {value}")


# ----------------------------------------------------------------------------------------------
# Per-loss configurations
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReinforceTISConfig(PolicyLossConfig):
    """``reinforce_tis``: ``truncation`` is the cap ``c`` of the importance weight."""

    loss: ClassVar[str | None] = "reinforce_tis"

    normalization: str = "sequence_sum"
    truncation: float = 5.0

    def _check(self) -> None:
        super()._check()
        _positive("truncation", self.truncation)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOClipConfig(PolicyLossConfig):
    """Clipped surrogate: ratio clipped to ``[1 − epsilon_low, 1 + epsilon_high]``.

    ``dual_clip`` bounds the loss of negative-advantage tokens by ``dual_clip_c · |A|``
    (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", arXiv:1912.09729); off by default.
    """

    loss: ClassVar[str | None] = "ppo_clip"

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: bool = False
    dual_clip_c: float = 3.0

    def _check(self) -> None:
        super()._check()
        _nonnegative("epsilon_low", self.epsilon_low)
        _nonnegative("epsilon_high", self.epsilon_high)
        if self.epsilon_low > 1:
            raise LossConfigError(f"epsilon_low must be <= 1, got {self.epsilon_low}")
        if not self.dual_clip_c > 1:
            raise LossConfigError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig(PPOClipConfig):
    """``grpo``: per-sequence token mean, then mean over sequences (DeepSeekMath, eq. 3).

    The paper also adds ``β · k3`` KL to a reference with ``β = 0.04``; here ``kl_coef``
    defaults to 0 (no reference model), set it together with ``ref_logprobs``.
    """

    loss: ClassVar[str | None] = "grpo"

    normalization: str = "sequence"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DAPOConfig(PPOClipConfig):
    """``dapo``: decoupled clip ``ε_low = 0.2``, ``ε_high = 0.28``, token-level mean."""

    loss: ClassVar[str | None] = "dapo"

    epsilon_high: float = 0.28


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrGRPOConfig(PPOClipConfig):
    """``dr_grpo``: token sum per sequence divided by a constant ``max_tokens`` (or ``T``)."""

    loss: ClassVar[str | None] = "dr_grpo"

    normalization: str = "constant"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GSPOConfig(PolicyLossConfig):
    """``gspo``: sequence ratio clipped to ``[1 − 3e-4, 1 + 4e-4]`` (the paper's ranges)."""

    loss: ClassVar[str | None] = "gspo"

    normalization: str = "sequence"
    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4

    def _check(self) -> None:
        super()._check()
        _nonnegative("epsilon_low", self.epsilon_low)
        _nonnegative("epsilon_high", self.epsilon_high)
        if self.epsilon_low > 1:
            raise LossConfigError(f"epsilon_low must be <= 1, got {self.epsilon_low}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GMPOConfig(PolicyLossConfig):
    """``gmpo``: token log-ratios clipped to ``[−ε_low, ε_high]`` on the side the advantage's sign
    makes pessimistic; ``ε = 0.4``, the ratio range ``(e^−0.4, e^0.4)`` of the paper."""

    loss: ClassVar[str | None] = "gmpo"

    normalization: str = "sequence"
    epsilon_low: float = 0.4
    epsilon_high: float = 0.4

    def _check(self) -> None:
        super()._check()
        _nonnegative("epsilon_low", self.epsilon_low)
        _nonnegative("epsilon_high", self.epsilon_high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOConfig(PolicyLossConfig):
    """``cispo``: weight ``clip(r, 1 − ε_low, 1 + ε_high)``; ``epsilon_low=None`` means no lower
    bound (as in the paper). ``ε_high = 4`` caps the weight at 5."""

    loss: ClassVar[str | None] = "cispo"

    epsilon_low: float | None = None
    epsilon_high: float = 4.0

    def _check(self) -> None:
        super()._check()
        if self.epsilon_low is not None:
            _nonnegative("epsilon_low", self.epsilon_low)
        _nonnegative("epsilon_high", self.epsilon_high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledPPOConfig(PPOClipConfig):
    """``decoupled_ppo``: clip against ``π_prox``; behaviour weight ``π_prox / μ`` capped at
    ``behaviour_weight_cap`` by ``behaviour_weight_mode`` (``"mis"``: AReaL's masking of tokens
    above the cap; ``"tis"``: truncation; ``cap=None``: uncapped). The generic ``correction``
    must stay ``"none"``: the behaviour weight is that correction."""

    loss: ClassVar[str | None] = "decoupled_ppo"

    behaviour_weight_cap: float | None = 5.0
    behaviour_weight_mode: str = "mis"

    def _check(self) -> None:
        super()._check()
        if self.correction != "none":
            raise LossConfigError("decoupled_ppo already weights by π_prox/μ; leave correction="
                                  f"'none' and set behaviour_weight_* instead (got "
                                  f"{self.correction!r})")
        if self.behaviour_weight_cap is not None:
            _positive("behaviour_weight_cap", self.behaviour_weight_cap)
        if self.behaviour_weight_mode not in ("tis", "mis"):
            raise LossConfigError("behaviour_weight_mode must be 'tis' or 'mis', got "
                                  f"{self.behaviour_weight_mode!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class M2POConfig(PolicyLossConfig):
    """``m2po``: the fewest tokens with the largest ``(log r)²`` are masked so that the mean
    ``(log r)²`` of the kept tokens is at most ``m2_threshold`` (the paper's ``τ_M2 = 0.04``);
    token-level mean."""

    loss: ClassVar[str | None] = "m2po"

    m2_threshold: float = 0.04

    def _check(self) -> None:
        super()._check()
        _positive("m2_threshold", self.m2_threshold)
