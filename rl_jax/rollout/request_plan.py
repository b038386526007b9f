"""What each generate request of a rollout asks for: sampling seeds and forced lengths.

Seeds are pure functions of ``(seed, position[, sample])``, so a resumed or repeated run samples
the same tokens. Forced completion lengths (benchmarks) come from a ``length_of(position,
sample)`` such as :class:`LognormalLengths`; with ``score_until`` the environment scores a
completion up to its first stop token and the tokens after it get loss mask 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def prompt_seed(seed: int | None, position: int) -> int | None:
    """The sampling seed of the prompt at ``position`` (None: unseeded): distinct per prompt,
    the same for the same prompt, so a resumed or repeated run samples the same tokens."""
    return None if seed is None else (int(seed) * 1_000_003 + 65_537 * int(position)) % 2**31


def mask_after_stop(ids: list[int], stops: tuple[int, ...]) -> list[float]:
    """1.0 up to and including the first stop token, 0.0 after it."""
    kept = len(until_stop(ids, stops))
    return [1.0] * kept + [0.0] * (len(ids) - kept)


def until_stop(ids: list[int], stops: tuple[int, ...]) -> list[int]:
    """``ids`` up to and including the first stop token (all of them if there is none)."""
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i + 1]
    return ids


def sample_seed(seed: int | None, position: int, index: int) -> int | None:
    """The sampling seed of sample ``index`` of the prompt at ``position`` when each sample is
    its own request (None: unseeded); distinct per sample, the same on a repeat."""
    if seed is None:
        return None
    state = np.random.SeedSequence([int(seed), int(position), int(index)]).generate_state(1)
    return int(state[0]) % 2**31


@dataclasses.dataclass(frozen=True)
class LognormalLengths:
    """Long-tailed completion lengths: ``min(max, max(1, round(median · exp(sigma · z))))``
    with ``z ~ N(0, 1)`` drawn from ``(seed, position, sample)`` (sample 0: ``(seed,
    position)``, the length a whole group shares without per-sample lengths), so a sample always
    gets the same length. ``p99 / p50 = exp(2.326 · sigma)`` before the cap (8.4 at sigma 0.915)."""

    median: float
    sigma: float
    max: int
    seed: int = 0

    def __call__(self, position: int, sample: int = 0) -> int:
        key = [self.seed, int(position)] + ([int(sample)] if sample else [])
        z = np.random.default_rng(key).standard_normal()
        return int(min(self.max, max(1, round(self.median * math.exp(self.sigma * z)))))
