"""The staleness gate: which prompt groups may be admitted and which completed groups form the
next training batch, so that no sample older than ``max_lag`` reaches the loss.

Definitions. The trainer at version ``v`` (``v`` optimizer updates applied) consumes exactly one
batch of ``groups_per_batch`` groups, then becomes ``v + 1``. A group's staleness at consumption
is ``v − min(token versions of its samples)``; it must be ``<= max_lag``.

The trainer may take the batch of version ``v + 1`` while the one of ``v`` still trains
(prefetching): every batch handed out and not yet trained counts, so the ``k``-th such batch is
the one version ``v + k`` consumes, and staleness and admission are reckoned against it.

``policy="prevent"`` (default) guarantees this without generating anything in vain. A group
admitted while every generator runs weights of version ``>= g`` (a lower bound the orchestrator
reports through :meth:`set_generator_version`) has all token versions ``>= g``, so it is safe if
consumed by version ``g + max_lag``: its *deadline*. The gate keeps, for every deadline ``d``,

    (unconsumed groups with deadline <= d)  <=  (d − v + 1) · groups_per_batch

by admitting a new group only when this still holds. A batch takes the completed groups with the
smallest deadlines when the groups it leaves behind still satisfy the inequality for ``v + 1``: a
group still generating (a long completion) holds up a batch only when its deadline leaves no
later batch to take it. Otherwise the batch is the ``groups_per_batch`` smallest-deadline groups
(completed ones first among equal deadlines), and it waits for those still generating. Either way
the inequality holds for ``v + 1``, so every group is consumed by its deadline. Admission that
would break it is refused and counted (``prevented``).

``policy="drop"`` admits up to ``max_in_flight_groups`` and, at batch time, discards completed
groups that are already too stale (counted in ``dropped``) — simpler, but work is wasted.

In both policies the batch check is enforced again on the actual token versions: a group whose
measured staleness exceeds ``max_lag`` is never returned (counted in ``late``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from rl_jax.recipe.schema import STALENESS_POLICIES

POLICIES = STALENESS_POLICIES


class StalenessConfigError(ValueError):
    """A staleness-gate configuration that cannot work."""


@dataclasses.dataclass(frozen=True)
class GateConfig:
    max_lag: int
    groups_per_batch: int
    policy: str = "prevent"
    max_in_flight_groups: int | None = None  # admitted and not yet consumed; None: no cap

    def __post_init__(self):
        if not isinstance(self.max_lag, int) or self.max_lag < 0:
            raise StalenessConfigError(f"max_lag must be an integer >= 0, got {self.max_lag!r}")
        if self.groups_per_batch < 1:
            raise StalenessConfigError(
                f"groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.policy not in POLICIES:
            raise StalenessConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_in_flight_groups is not None and \
                self.max_in_flight_groups < self.groups_per_batch:
            raise StalenessConfigError(
                f"max_in_flight_groups={self.max_in_flight_groups} is smaller than one batch "
                f"({self.groups_per_batch} groups): no batch could ever form")


@dataclasses.dataclass
class _Group:
    key: Any
    order: int  # admission order
    deadline: int  # last trainer version that may consume it (prevent policy)
    min_version: int | None = None  # set when complete
    completed_order: int = -1


def deadline_batch(ordered: Sequence[Any], need: int, version: int,
                   complete: Callable[[Any], bool]) -> list[Any] | None:
    """The batch version ``version`` consumes under ``policy="prevent"``, or None to wait.

    ``ordered``: the unconsumed groups by (deadline, admission order), each with ``deadline``,
    ``order`` and ``completed_order``. The completed groups with the smallest deadlines form the
    batch if every group left behind can still be consumed by its deadline in the batches of
    versions ``version + 1, version + 2, ...``; otherwise the batch is the ``need``
    smallest-deadline groups (completed ones first among equal deadlines), None while one of them
    is still generating."""
    if len(ordered) < need:
        return None
    done = [g for g in ordered if complete(g)]
    if len(done) >= need:
        chosen = done[:need]
        taken = {id(g) for g in chosen}
        left = 0  # groups left behind with deadline <= that of g
        for g in ordered:
            if id(g) not in taken:
                left += 1
                if left > (g.deadline - version) * need:
                    break
        else:
            return chosen
    cut = ordered[need - 1].deadline
    must = [g for g in ordered if g.deadline < cut]
    tied = sorted((g for g in ordered if g.deadline == cut),
                  key=lambda g: (not complete(g), g.completed_order, g.order))
    chosen = must + tied[:need - len(must)]
    return chosen if all(complete(g) for g in chosen) else None


class StalenessGate:
    """Admission and batch selection for one trainer. Not thread-safe: call from one thread (or
    under a lock)."""

    def __init__(self, config: GateConfig, *, trainer_version: int = 0,
                 generator_version: int | None = None):
        self.config = config
        self.trainer_version = trainer_version
        self.generator_version = trainer_version if generator_version is None \
            else generator_version
        self._groups: dict[Any, _Group] = {}
        # Keys of the batches handed out whose optimizer step has not finished (training, or
        # prefetched), oldest first: the next batch is consumed by trainer_version + their count.
        self._untrained: collections.deque[list] = collections.deque()
        self._order = itertools.count()
        self._completed_order = itertools.count()
        self.counts = collections.Counter()
        self.staleness_histogram: collections.Counter = collections.Counter()
        # Keys of completed groups discarded as too stale, until the owner takes them
        # (:meth:`take_discarded`) to free their completions and record the drop.
        self._discarded: list[Any] = []

    # ---- versions ---------------------------------------------------------------------------

    @property
    def consumer_version(self) -> int:
        """The trainer version that will consume the next batch handed out."""
        return self.trainer_version + len(self._untrained)

    def set_generator_version(self, version: int):
        """A version every generator has reached (it only moves forward)."""
        self.generator_version = max(self.generator_version, int(version))

    # ---- admission --------------------------------------------------------------------------

    @property
    def unconsumed(self) -> int:
        return len(self._groups)

    @property
    def in_flight(self) -> int:
        return sum(g.min_version is None for g in self._groups.values())

    def capacity(self) -> int:
        """How many more groups may be admitted now."""
        cfg = self.config
        room = None if cfg.max_in_flight_groups is None else \
            cfg.max_in_flight_groups - self.unconsumed
        if cfg.policy == "prevent":
            deadline = self.generator_version + cfg.max_lag
            # Versions still free to consume a new group: from the one that takes the next
            # batch (past those already handed out) up to the deadline.
            batches = deadline - self.consumer_version + 1
            prevent_room = batches * cfg.groups_per_batch - self.unconsumed
            room = prevent_room if room is None else min(room, prevent_room)
        return max(room, 0) if room is not None else 1 << 30

    def admit(self, key: Any) -> bool:
        """Admits group ``key`` if the bound allows; otherwise counts it as prevented."""
        if key in self._groups:
            raise KeyError(f"group {key!r} is already admitted")
        if self.capacity() < 1:
            self.counts["prevented"] += 1
            return False
        deadline = self.generator_version + self.config.max_lag
        self._groups[key] = _Group(key, next(self._order), deadline)
        self.counts["admitted"] += 1
        return True

    def complete(self, key: Any, min_token_version: int):
        """Group ``key`` finished generating; its oldest token has ``min_token_version``."""
        group = self._groups[key]
        group.min_version = int(min_token_version)
        group.completed_order = next(self._completed_order)
        self.counts["completed"] += 1

    def cancel(self, key: Any):
        """Forgets an admitted group (e.g. its generation failed); counted."""
        if self._groups.pop(key, None) is not None:
            self.counts["cancelled"] += 1

    # ---- batches ------------------------------------------------------------------------------

    def next_batch(self) -> list[Any] | None:
        """Keys of the groups forming the batch for :attr:`consumer_version` (the current trainer
        version, plus one for each batch already handed out and not yet trained), or None when
        one cannot be formed yet (wait for generation). The groups are marked consumed; call
        :meth:`advance` once the trainer has finished the step of each batch."""
        cfg = self.config
        v = self.consumer_version
        while True:
            # Groups already too stale are never returned (drop policy: expected; prevent policy:
            # only if a generator reported a version below the bound it promised).
            late = [g for g in self._groups.values()
                    if g.min_version is not None and v - g.min_version > cfg.max_lag]
            for g in late:
                del self._groups[g.key]
                self._discarded.append(g.key)
                self.counts["dropped" if cfg.policy == "drop" else "late"] += 1
            if cfg.policy == "drop":
                done = sorted((g for g in self._groups.values() if g.min_version is not None),
                              key=lambda g: g.completed_order)
                chosen = done[:cfg.groups_per_batch] \
                    if len(done) >= cfg.groups_per_batch else None
            else:
                chosen = self._prevent_choice()
            if chosen is None:
                return None
            if all(v - g.min_version <= cfg.max_lag for g in chosen):
                break
        for g in chosen:
            del self._groups[g.key]
            self.staleness_histogram[v - g.min_version] += 1
        self.counts["consumed"] += len(chosen)
        keys = [g.key for g in chosen]
        self._untrained.append(keys)
        return keys

    def take_discarded(self) -> list[Any]:
        """Keys of the completed groups :meth:`next_batch` discarded as too stale since the last
        call (never trained: their owner records them as dropped)."""
        keys, self._discarded = self._discarded, []
        return keys

    def _prevent_choice(self) -> list[_Group] | None:
        ordered = sorted(self._groups.values(), key=lambda g: (g.deadline, g.order))
        return deadline_batch(ordered, self.config.groups_per_batch, self.consumer_version,
                              complete=lambda g: g.min_version is not None)

    def advance(self, version: int | None = None):
        """The trainer finished the step of the oldest batch handed out: it is now at
        ``version`` (default: +1; the same version if the step was skipped)."""
        self.trainer_version = self.trainer_version + 1 if version is None else int(version)
        if self._untrained:
            self._untrained.popleft()

    # ---- checkpointing ------------------------------------------------------------------------

    def untrained_keys(self) -> list[Any]:
        """Handed out in a batch whose step has not finished, oldest batch first."""
        return [k for keys in self._untrained for k in keys]

    def pending_keys(self) -> list[Any]:
        """Admitted, not consumed (in flight or completed), in admission order."""
        return [g.key for g in sorted(self._groups.values(), key=lambda g: g.order)]

    def metrics(self) -> dict[str, float]:
        hist = self.staleness_histogram
        total = sum(hist.values())
        return {**{f"gate/{k}": float(v) for k, v in self.counts.items()},
                "gate/in_flight": float(self.in_flight), "gate/unconsumed": float(self.unconsumed),
                "staleness/max": float(max(hist) if hist else 0),
                "staleness/mean": float(sum(k * n for k, n in hist.items()) / total) if total
                else 0.0}
