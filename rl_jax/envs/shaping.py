"""Reward shaping and group statistics for group-relative RL.

Per sample (:class:`RewardShaping`): a length penalty, either linear in the completion length or
DAPO's soft overlong penalty, and an optional fixed reward for truncated completions. Lengths
are in tokens (the rollout knows them; environments see text). Format rewards live in the
environments, which know what a well-formed answer is (``format_reward=`` on each).

Per group of samples of one prompt (:func:`group_statistics`): a group whose rewards are all
equal has zero advantage under any group-relative estimator (GRPO, RLOO, Dr. GRPO) and gives no
learning signal; such groups are counted, as is the solve-rate band (the fraction of groups whose
solve rate is strictly between 0 and 1), the curriculum metric.

DAPO-style dynamic filtering: :func:`drop_zero_signal_groups` removes zero-signal groups so the
rollout can sample replacements, and :class:`SolveRateTracker` remembers recent per-prompt solve
rates and tells the rollout to skip prompts that are always or never solved.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

import numpy as np

from rl_jax.envs.base import EnvError

T = TypeVar("T")


def linear_length_penalty(num_tokens: int, max_tokens: int, coef: float = 1.0) -> float:
    """``-coef * min(num_tokens, max_tokens) / max_tokens``: from 0 (empty) to ``-coef``."""
    if max_tokens <= 0:
        raise EnvError(f"max_tokens must be positive, got {max_tokens}")
    return -coef * min(num_tokens, max_tokens) / max_tokens


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment (tokens): 0 up to ``max_tokens - cache_tokens``, then
    linear down to -1 at ``max_tokens``, and -1 beyond."""
    if not 0 < cache_tokens <= max_tokens:
        raise EnvError(f"need 0 < cache_tokens <= max_tokens, got cache_tokens={cache_tokens}, "
                       f"max_tokens={max_tokens}")
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_tokens:
        return (free - num_tokens) / cache_tokens
    return -1.0


@dataclasses.dataclass(frozen=True)
class RewardShaping:
    """Length-dependent adjustments of an environment's reward.

    Attributes:
      length_penalty: ``"none"``, ``"linear"`` (:func:`linear_length_penalty`) or
        ``"overlong"`` (:func:`overlong_penalty`).
      max_tokens: the length scale of the penalty (usually the generation limit).
      length_coef: weight of the penalty.
      cache_tokens: DAPO's soft buffer for ``"overlong"``.
      truncated_reward: if set, the reward of any completion cut off by the length limit
        (replacing the environment's; e.g. 0 to stop rewarding unfinished answers).
      penalize_correct_only: apply the length penalty only to rewards ``>= success_threshold``
        (so that a wrong short answer does not beat a wrong long one).
      success_threshold: what counts as a solved sample.
    """

    length_penalty: str = "none"
    max_tokens: int = 1024
    length_coef: float = 1.0
    cache_tokens: int = 256
    truncated_reward: float | None = None
    penalize_correct_only: bool = False
    success_threshold: float = 1.0

    def __post_init__(self):
        if self.length_penalty not in ("none", "linear", "overlong"):
            raise EnvError("length_penalty must be 'none', 'linear' or 'overlong', got "
                           f"{self.length_penalty!r}")
        if self.max_tokens <= 0:
            raise EnvError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.length_penalty == "overlong" and not 0 < self.cache_tokens <= self.max_tokens:
            raise EnvError(f"cache_tokens must be in (0, max_tokens={self.max_tokens}], got "
                           f"{self.cache_tokens}")

    def penalty(self, num_tokens: int) -> float:
        """The (non-positive) length term for a completion of ``num_tokens`` tokens."""
        if self.length_penalty == "linear":
            return linear_length_penalty(num_tokens, self.max_tokens, self.length_coef)
        if self.length_penalty == "overlong":
            return self.length_coef * overlong_penalty(num_tokens, self.max_tokens,
                                                       self.cache_tokens)
        return 0.0

    def apply(self, reward: float, num_tokens: int, *, truncated: bool = False) -> float:
        """The shaped reward of one completion."""
        if truncated and self.truncated_reward is not None:
            return float(self.truncated_reward)
        if self.penalize_correct_only and reward < self.success_threshold:
            return float(reward)
        return float(reward) + self.penalty(num_tokens)


# ---------------------------------------------------------------------------------------------
# Group statistics.

def _rows(rewards: Any) -> list[np.ndarray]:
    rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in rewards]
    for g, row in enumerate(rows):
        if row.size == 0:
            raise EnvError(f"group {g} has no rewards")
    return rows


def zero_signal(rewards: Any, atol: float = 1e-9) -> np.ndarray:
    """``[G]`` bool: groups whose rewards are all equal (within ``atol``).

    ``rewards`` is ``[G, n]`` or a list of per-group reward lists (groups may differ in size).
    """
    return np.asarray([row.max() - row.min() <= atol for row in _rows(rewards)], dtype=bool)


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """Statistics of a batch of groups.

    Attributes:
      solve_rate: ``[G]`` fraction of solved samples per group.
      zero_signal: ``[G]`` whether a group's rewards are all equal.
      mean_reward: mean over all samples.
    """

    solve_rate: np.ndarray
    zero_signal: np.ndarray
    mean_reward: float

    @property
    def num_groups(self) -> int:
        return int(self.solve_rate.size)

    @property
    def solve_rate_band(self) -> float:
        """Fraction of groups with solve rate strictly between 0 and 1 (0 for no groups)."""
        if not self.num_groups:
            return 0.0
        return float(np.mean((self.solve_rate > 0) & (self.solve_rate < 1)))

    def metrics(self, prefix: str = "groups/") -> dict[str, float]:
        """Counts and fractions for logging."""
        n = max(self.num_groups, 1)
        return {
            f"{prefix}count": float(self.num_groups),
            f"{prefix}zero_signal": float(self.zero_signal.sum()),
            f"{prefix}zero_signal_fraction": float(self.zero_signal.sum()) / n,
            f"{prefix}all_solved": float(np.sum(self.solve_rate == 1.0)),
            f"{prefix}none_solved": float(np.sum(self.solve_rate == 0.0)),
            f"{prefix}solve_rate_band": self.solve_rate_band,
            f"{prefix}solve_rate_mean": float(self.solve_rate.mean()) if self.num_groups else 0.0,
            f"{prefix}reward_mean": self.mean_reward,
        }


def group_statistics(rewards: Any, solved: Any | None = None, *,
                     success_threshold: float = 1.0, atol: float = 1e-9) -> GroupStats:
    """Per-group solve rates and zero-signal flags.

    Args:
      rewards: ``[G, n]`` or a list of per-group reward lists.
      solved: the same shape of bools (e.g. ``info["correct"]``); default
        ``reward >= success_threshold``.
    """
    rows = _rows(rewards)
    if solved is None:
        solved_rows = [row >= success_threshold for row in rows]
    else:
        solved_rows = [np.asarray(s, dtype=bool).reshape(-1) for s in solved]
        if [s.size for s in solved_rows] != [r.size for r in rows]:
            raise EnvError("solved must have the same group sizes as rewards")
    return GroupStats(
        solve_rate=np.asarray([s.mean() for s in solved_rows], dtype=np.float64),
        zero_signal=np.asarray([r.max() - r.min() <= atol for r in rows], dtype=bool),
        mean_reward=float(np.concatenate(rows).mean()) if rows else 0.0,
    )


def drop_zero_signal_groups(groups: Sequence[T], rewards: Any,
                            atol: float = 1e-9) -> tuple[list[T], int]:
    """``(kept groups, number dropped)``: removes groups whose rewards are all equal.

    ``groups[g]`` is any object describing group ``g`` (its samples); ``rewards[g]`` its rewards.
    """
    flags = zero_signal(rewards, atol)
    if len(groups) != flags.size:
        raise EnvError(f"{len(groups)} groups but {flags.size} reward groups")
    kept = [g for g, flag in zip(groups, flags) if not flag]
    return kept, int(flags.sum())


class SolveRateTracker:
    """Recent per-prompt solve rates, for skipping prompts with no learning signal.

    A prompt (any hashable key, e.g. its index) is skipped when at least ``min_samples`` of its
    last ``window`` samples are recorded and they are all solved or all unsolved. Every
    ``revisit_every``-th time a prompt would be skipped it is admitted instead, so that a policy
    that changed can show a new solve rate (None: never revisit). At most ``max_prompts`` prompts
    are remembered (least recently updated forgotten first).
    """

    def __init__(self, window: int = 16, min_samples: int | None = None,
                 revisit_every: int | None = 8, max_prompts: int = 1_000_000):
        if window < 1:
            raise EnvError(f"window must be at least 1, got {window}")
        self.window = int(window)
        self.min_samples = int(window if min_samples is None else min_samples)
        if not 1 <= self.min_samples <= self.window:
            raise EnvError(f"min_samples must be in 1..window={window}, got {min_samples}")
        if revisit_every is not None and revisit_every < 1:
            raise EnvError(f"revisit_every must be at least 1 or None, got {revisit_every}")
        self.revisit_every = revisit_every
        self.max_prompts = int(max_prompts)
        self._history: collections.OrderedDict[Hashable, collections.deque] = (
            collections.OrderedDict())
        self._skips: collections.Counter = collections.Counter()
        self.total_skipped = 0

    def update(self, key: Hashable, solved: Sequence[bool]) -> None:
        """Records the outcomes of new samples of prompt ``key``."""
        history = self._history.pop(key, None) or collections.deque(maxlen=self.window)
        history.extend(bool(s) for s in solved)
        self._history[key] = history
        while len(self._history) > self.max_prompts:
            old, _ = self._history.popitem(last=False)
            self._skips.pop(old, None)

    def solve_rate(self, key: Hashable) -> float | None:
        """Solve rate over the recent window, or None with fewer than ``min_samples``."""
        history = self._history.get(key)
        if history is None or len(history) < self.min_samples:
            return None
        return sum(history) / len(history)

    def should_skip(self, key: Hashable) -> bool:
        """Whether the rollout should skip prompt ``key`` now (counts the skip)."""
        rate = self.solve_rate(key)
        if rate is None or 0.0 < rate < 1.0:
            return False
        self._skips[key] += 1
        if self.revisit_every is not None and self._skips[key] % self.revisit_every == 0:
            return False
        self.total_skipped += 1
        return True

    def metrics(self, prefix: str = "solve_rate_tracker/") -> dict[str, float]:
        rates = [r for r in map(self.solve_rate, self._history) if r is not None]
        return {f"{prefix}prompts": float(len(self._history)),
                f"{prefix}always_solved": float(sum(r == 1.0 for r in rates)),
                f"{prefix}never_solved": float(sum(r == 0.0 for r in rates)),
                f"{prefix}skipped": float(self.total_skipped)}

    def state_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot (keys must be JSON-friendly too) for checkpoints."""
        return {"history": [[k, list(v)] for k, v in self._history.items()],
                "skips": [[k, n] for k, n in self._skips.items()],
                "total_skipped": self.total_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (list keys come back as tuples)."""
        def key(k):
            return tuple(k) if isinstance(k, list) else k
        self._history = collections.OrderedDict(
            (key(k), collections.deque(v, maxlen=self.window)) for k, v in state["history"])
        self._skips = collections.Counter({key(k): n for k, n in state["skips"]})
        self.total_skipped = int(state["total_skipped"])
