"""Group-relative advantage estimators (no value network).

Each estimator takes one scalar reward per sampled sequence and the group it belongs to (the
samples drawn for one prompt), and returns one advantage per sequence:

  ``rewards [N]`` with ``group_ids [N]`` (ints in ``[0, num_groups)``; a negative id marks a
  padding sample, which gets advantage 0 and is left out of every group), or
  ``rewards [G, n]`` with ``group_ids=None`` (row ``g`` is group ``g``).

Group statistics use ``jax.ops.segment_sum`` with a static ``num_groups``, so the estimators
are jit-able. Group ids with no members ("empty groups") are allowed and produce no NaN.

Groups of size 1. A lone sample has no baseline other than itself; this is almost always a
grouping bug, so it is an error wherever it can be detected: for ``[G, 1]`` rewards, and for
concrete (non-traced) ``group_ids``, the estimators raise :class:`GroupSizeError`. Inside
``jit`` (traced ``group_ids``) the sizes are unknown at trace time; the members of a singleton
group then get advantage 0. Call :func:`check_groups` on the host to check traced inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from rl_jax.errors import UserError
from rl_jax.losses.configs import LossConfigError
from rl_jax.losses.core import safe_divide


class GroupSizeError(UserError, ValueError):
    """A group with a single member, or a group id outside ``[0, num_groups)``."""


def check_groups(group_ids: ArrayLike, num_groups: int | None = None) -> np.ndarray:
    """Host-side check of concrete group ids; returns the ``[num_groups]`` group sizes.

    Raises:
      GroupSizeError: if an id is ``≥ num_groups`` or a group has exactly one member (negative
        ids are padding and ignored; empty groups are allowed).
    """
    ids = np.asarray(group_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise GroupSizeError(f"group_ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    members = ids[ids >= 0]
    if num_groups is None:
        num_groups = int(members.max()) + 1 if members.size else 0
    if members.size and members.max() >= num_groups:
        raise GroupSizeError(f"group id {int(members.max())} is out of range for num_groups="
                             f"{num_groups}")
    sizes = np.bincount(members, minlength=num_groups)
    singletons = np.flatnonzero(sizes == 1)
    if singletons.size:
        raise GroupSizeError(
            f"{singletons.size} group(s) have a single sample (e.g. group {int(singletons[0])}); "
            "group-relative advantages need at least 2 samples per group")
    return sizes


def _concrete(x) -> np.ndarray | None:
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _grouped(rewards, group_ids, num_groups):
    """Flat float32 rewards, int32 ids, static group count and the output shape."""
    rewards = jnp.asarray(rewards)
    rewards = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
    if group_ids is None:
        if rewards.ndim != 2:
            raise GroupSizeError("rewards must be [num_groups, group_size] when group_ids is None, "
                                 f"got shape {rewards.shape}")
        groups, size = rewards.shape
        if size == 1:
            raise GroupSizeError("group size 1: group-relative advantages need at least 2 samples "
                                 "per group")
        ids = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), size)
        return rewards.reshape(-1), ids, groups, rewards.shape
    if rewards.ndim != 1 or jnp.shape(group_ids) != rewards.shape:
        raise GroupSizeError(f"rewards {rewards.shape} and group_ids {jnp.shape(group_ids)} must "
                             "both be [N]")
    concrete = _concrete(group_ids)
    if concrete is not None:
        sizes = check_groups(concrete, num_groups)
        num_groups = len(sizes) if num_groups is None else num_groups
    elif num_groups is None:
        raise LossConfigError("num_groups must be given (as a static int) when group_ids is traced")
    return rewards, jnp.asarray(group_ids).astype(jnp.int32), int(num_groups), rewards.shape


def _group_moments(rewards, ids, num_groups):
    """Per sample: its group's size, sum of rewards and mean (0 for non-members)."""
    member = (ids >= 0) & (ids < num_groups)
    weight = member.astype(rewards.dtype)
    safe_ids = jnp.where(member, ids, 0)
    count = jax.ops.segment_sum(weight, safe_ids, num_segments=num_groups)[safe_ids] * weight
    total = jax.ops.segment_sum(jnp.where(member, rewards, 0.0), safe_ids,
                                num_segments=num_groups)[safe_ids] * weight
    return member, safe_ids, count, total, safe_divide(total, count)


def grpo_advantages(rewards: ArrayLike, group_ids: ArrayLike | None = None, *,
                    num_groups: int | None = None,
                    scale_by_std: bool = True, epsilon: float = 1e-6) -> jax.Array:
    """GRPO's group-normalised advantage ``A_i = (R_i − mean_g R) / (std_g R + ε)``.

    ``std_g`` is the unbiased (``n − 1``) standard deviation of the group; a group whose rewards
    are all equal gets ``A = 0``. ``scale_by_std=False`` gives ``R_i − mean_g R`` (Dr. GRPO).

    Z. Shao et al., "DeepSeekMath" (2024), arXiv:2402.03300, section 4.1.2 (outcome supervision).

    Args:
      rewards: ``[N]`` or ``[G, n]`` scalar rewards.
      group_ids: ``[N]`` ints, or ``None`` with ``[G, n]`` rewards.
      num_groups: static number of groups (required under ``jit`` with ``[N]`` rewards).
      scale_by_std: divide by the group's standard deviation.
      epsilon: added to the standard deviation.

    Returns:
      advantages with the shape of ``rewards`` (float32).
    """
    flat, ids, groups, shape = _grouped(rewards, group_ids, num_groups)
    member, safe_ids, count, _, mean = _group_moments(flat, ids, groups)
    centered = jnp.where(member & (count > 1), flat - mean, 0.0)
    if scale_by_std:
        sq = jax.ops.segment_sum(jnp.square(centered), safe_ids, num_segments=groups)[safe_ids]
        std = jnp.sqrt(safe_divide(sq, count - 1.0))
        centered = centered / (std + epsilon)
    return centered.reshape(shape)


def dr_grpo_advantages(rewards: ArrayLike, group_ids: ArrayLike | None = None, *,
                       num_groups: int | None = None) -> jax.Array:
    """Dr. GRPO's advantage ``A_i = R_i − mean_g R``: no division by the group's std, which
    would over-weight groups that are nearly all right or all wrong.

    Z. Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (2025),
    arXiv:2503.20783.

    Args and returns: as :func:`grpo_advantages`.
    """
    return grpo_advantages(rewards, group_ids, num_groups=num_groups, scale_by_std=False)


def rloo_advantages(rewards: ArrayLike, group_ids: ArrayLike | None = None, *,
                    num_groups: int | None = None) -> jax.Array:
    """REINFORCE leave-one-out: ``A_i = R_i − (1/(n−1)) Σ_{j≠i} R_j = n/(n−1) · (R_i − mean_g R)``.

    Each sample's baseline is the mean reward of the *other* samples of its group, so it is
    independent of the sample and the gradient estimate stays unbiased.

    W. Kool, H. van Hoof, M. Welling, "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (2019,
    ICLR DeepRLStructPred workshop); A. Ahmadian et al., "Back to Basics: Revisiting
    REINFORCE-Style Optimization for Learning from Human Feedback in LLMs" (2024),
    arXiv:2402.14740.

    Args and returns: as :func:`grpo_advantages`.
    """
    flat, ids, groups, shape = _grouped(rewards, group_ids, num_groups)
    member, _, count, total, _ = _group_moments(flat, ids, groups)
    ok = member & (count > 1)
    others = safe_divide(total - flat, count - 1.0)
    return jnp.where(ok, flat - others, 0.0).reshape(shape)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "dr_grpo": dr_grpo_advantages,
}


def get_advantage_estimator(name: str) -> Callable[..., jax.Array]:
    """The estimator registered as ``name`` (``"grpo"``, ``"rloo"``, ``"dr_grpo"``)."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise LossConfigError(f"unknown advantage estimator {name!r}; known: "
                              f"{sorted(ADVANTAGE_ESTIMATORS)}") from None
