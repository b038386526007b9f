"""Response-length distributions (tokens per completion).

RL responses have long tails: most finish early, a few run to ``max_new_tokens``. The tail sets
how long a synchronous step waits and how stale an asynchronous sample can get, so the model
carries the whole distribution, not a mean:

- :class:`EmpiricalLengths`: measured lengths (a histogram), resampled with replacement;
- :class:`LogNormalLengths`: ``median · exp(sigma · z)`` clipped to ``[1, max_length]`` (the
  clipped mass is the share of responses stopped by the length limit);
- :class:`ConstantLengths`: every response has the same length (closed-form checks);
- :class:`SequenceLengths`: given lengths drawn in their order (replaying a run's prompts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from statistics import NormalDist

import numpy as np

from rl_jax.sysmodel.errors import SysModelError

_NORMAL = NormalDist()


class LengthDistribution:
    """Interface: ``sample``, ``quantile``, ``mean``, ``max_length``."""

    max_length: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths, int64, each in ``[1, max_length]``."""
        raise NotImplementedError

    def quantile(self, q: float) -> float:
        raise NotImplementedError

    @property
    def mean(self) -> float:
        raise NotImplementedError

    @property
    def p50(self) -> float:
        return self.quantile(0.5)

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    def second_moment(self) -> float:
        """``E[L²]``, by the midpoint rule over 2000 quantiles (exact for sampled data)."""
        grid = (np.arange(2000) + 0.5) / 2000
        values = np.asarray([self.quantile(q) for q in grid])
        return float(np.mean(values ** 2))

    @functools.cached_property
    def active_context(self) -> float:
        """Mean generated length of the responses decoding at a random instant in a busy
        server: long responses stay longer, so it is ``E[L²] / (2·E[L])``, not ``E[L] / 2``."""
        return self.second_moment() / (2 * self.mean)

    def expected_max(self, n: int) -> float:
        """Approximate expected maximum of ``n`` draws: the ``n/(n+1)`` quantile."""
        return self.quantile(n / (n + 1)) if n > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p99": self.p99,
                "p99_over_p50": self.p99 / self.p50, "max": float(self.max_length)}

    def describe(self) -> str:
        s = self.summary()
        return (f"{type(self).__name__}: mean {s['mean']:.0f}, p50 {s['p50']:.0f}, p99 "
                f"{s['p99']:.0f} (p99/p50 {s['p99_over_p50']:.1f}), max {s['max']:.0f} tokens")


@dataclasses.dataclass(frozen=True)
class ConstantLengths(LengthDistribution):
    length: int

    def __post_init__(self):
        if self.length < 1:
            raise SysModelError(f"response length must be >= 1, got {self.length}")

    @property
    def max_length(self) -> int:  # type: ignore[override]
        return self.length

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.length, np.int64)

    def quantile(self, q: float) -> float:
        return float(self.length)

    @property
    def mean(self) -> float:
        return float(self.length)

    def second_moment(self) -> float:
        return float(self.length) ** 2


@dataclasses.dataclass(frozen=True)
class EmpiricalLengths(LengthDistribution):
    """Measured lengths, sorted; sampling draws from them with replacement."""

    lengths: tuple[int, ...]

    def __post_init__(self):
        if not self.lengths:
            raise SysModelError("measured response lengths are empty")
        if min(self.lengths) < 1:
            raise SysModelError(f"response lengths must be >= 1, got min {min(self.lengths)}")
        object.__setattr__(self, "lengths", tuple(sorted(int(n) for n in self.lengths)))

    @classmethod
    def from_values(cls, values: Iterable[int]) -> "EmpiricalLengths":
        return cls(tuple(int(v) for v in values))

    @classmethod
    def from_histogram(cls, counts: Mapping[int, int]) -> "EmpiricalLengths":
        """From ``{length: count}``."""
        return cls(tuple(int(n) for n, c in counts.items() for _ in range(int(c))))

    @classmethod
    def from_file(cls, path: str | Path) -> "EmpiricalLengths":
        """A JSON list of lengths, or an object with ``"lengths"`` (a list) or ``"histogram"``
        (``{length: count}``)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SysModelError(f"cannot read response lengths from {path}: {e}")
        if isinstance(data, dict) and "histogram" in data:
            return cls.from_histogram({int(k): v for k, v in data["histogram"].items()})
        if isinstance(data, dict):
            data = data.get("lengths")
        if not isinstance(data, list):
            raise SysModelError(f"{path} must hold a list of lengths, or an object with "
                                "'lengths' or 'histogram'")
        return cls.from_values(data)

    @property
    def max_length(self) -> int:  # type: ignore[override]
        return self.lengths[-1]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.asarray(self.lengths, np.int64)[rng.integers(0, len(self.lengths), n)]

    def quantile(self, q: float) -> float:
        return float(np.quantile(np.asarray(self.lengths, float), q))

    @property
    def mean(self) -> float:
        return float(np.mean(self.lengths))

    def second_moment(self) -> float:
        return float(np.mean(np.asarray(self.lengths, float) ** 2))


class SequenceLengths(EmpiricalLengths):
    """Lengths in the order a run meets them (e.g. the forced length of each prompt of a
    benchmark's stream): :meth:`sample` returns the next ones, starting over after the last;
    the statistics are those of all of them. :meth:`restart` gives a copy at the first."""

    def __init__(self, values: Iterable[int]):
        ordered = tuple(int(v) for v in values)
        super().__init__(ordered)  # sorted copy: quantiles, mean, max
        object.__setattr__(self, "order", np.asarray(ordered, np.int64))
        object.__setattr__(self, "_next", 0)

    def restart(self) -> "SequenceLengths":
        return SequenceLengths(self.order)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        index = (self._next + np.arange(n)) % len(self.order)
        object.__setattr__(self, "_next", int((self._next + n) % len(self.order)))
        return self.order[index]


@dataclasses.dataclass(frozen=True)
class LogNormalLengths(LengthDistribution):
    """``round(median · exp(sigma · z))``, ``z ~ N(0, 1)``, clipped to ``[1, max_length]``."""

    median: float
    sigma: float
    max_length: int  # type: ignore[misc]

    def __post_init__(self):
        if not self.median >= 1:
            raise SysModelError(f"median response length must be >= 1, got {self.median}")
        if not self.sigma >= 0:
            raise SysModelError(f"length sigma must be >= 0, got {self.sigma}")
        if self.max_length < 1:
            raise SysModelError(f"max response length must be >= 1, got {self.max_length}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(np.rint(raw), 1, self.max_length).astype(np.int64)

    def quantile(self, q: float) -> float:
        q = min(max(q, 1e-12), 1 - 1e-12)
        value = self.median * math.exp(self.sigma * _NORMAL.inv_cdf(q))
        return float(min(max(value, 1.0), self.max_length))

    @property
    def truncated_fraction(self) -> float:
        """Share of responses stopped by ``max_length``."""
        if self.sigma == 0:
            return float(self.median >= self.max_length)
        return 1 - _NORMAL.cdf(math.log(self.max_length / self.median) / self.sigma)

    @property
    def mean(self) -> float:
        """Mean of the clipped distribution (closed form; rounding ignored)."""
        mu, s, lo, hi = math.log(self.median), self.sigma, 1.0, float(self.max_length)
        if s == 0:
            return min(max(self.median, lo), hi)
        full = math.exp(mu + s * s / 2)
        # E[min(X, hi)] + E[(lo - X)+]
        upper = full * _NORMAL.cdf((math.log(hi) - mu - s * s) / s) + hi * (
            1 - _NORMAL.cdf((math.log(hi) - mu) / s))
        lower = lo * _NORMAL.cdf((math.log(lo) - mu) / s) - full * _NORMAL.cdf(
            (math.log(lo) - mu - s * s) / s)
        return upper + lower

    def summary(self) -> dict[str, float]:
        return {**super().summary(), "truncated_fraction": self.truncated_fraction}
