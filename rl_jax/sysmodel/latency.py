"""Decode step latency of one generator server against its batch size.

Two models with one interface, ``step_seconds(batch, context) -> seconds`` and ``max_batch``:

- :class:`RooflineLatency`: first principles. One decode step of ``B`` sequences with mean
  context ``c`` on a server of ``tp`` chips (tensor parallel) takes

      max(bytes / (tp · bandwidth), FLOPs / (tp · peak)) / efficiency  +  TP all-reduces
          +  a fixed cost per step (``step_overhead_s``)

  where bytes are the weights a step reads plus the KV cache of the context, and FLOPs are
  ``B · (2·N_mm + 4·L·H·D·c)``. Small batches are memory-bound (weights dominate: latency nearly
  flat in ``B``), large ones compute-bound (latency grows linearly). The batch is capped by KV
  capacity: weights plus ``B`` sequences of ``max_context`` tokens must fit in HBM.
- :class:`MeasuredLatency`: points ``batch → seconds`` measured by a benchmark (e.g. the
  ``engine_step_s`` rows of ``benchmarks/results/generator_throughput.json``), interpolated
  linearly in the batch and extrapolated with the slope of the last two points (a single point
  is taken as constant). Below the first point the first value holds. Measured curves carry
  whatever context the benchmark used; ``context`` is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from rl_jax.sysmodel.accelerators import Accelerator, dtype_bytes
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.shape import ModelShape


class DecodeLatency(Protocol):
    """What the simulator needs from a latency model."""

    @property
    def max_batch(self) -> int | None: ...

    def step_seconds(self, batch: int, context: float) -> float: ...


@dataclasses.dataclass(frozen=True)
class RooflineLatency:
    """Roofline decode latency of one server of ``tensor_parallel`` chips.

    Attributes:
      efficiency: fraction of the roofline the engine reaches (1.0: the roofline itself;
        engines typically reach 0.5-0.8 of memory bandwidth at small batch).
      memory_fraction: share of each chip's memory usable for weights and KV cache.
      max_context: tokens per sequence the KV cache must hold (prompt + longest response).
      step_overhead_s: fixed seconds per decode step beyond the roofs (kernel launches,
        sampling, scheduling; :data:`rl_jax.sysmodel.cluster.DECODE_STEP_OVERHEAD_S`).
    """

    shape: ModelShape
    accelerator: Accelerator
    tensor_parallel: int = 1
    dtype: str = "bfloat16"
    efficiency: float = 1.0
    memory_fraction: float = 0.9
    max_context: int = 4096
    step_overhead_s: float = 0.0

    def __post_init__(self):
        if not self.step_overhead_s >= 0:
            raise SysModelError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")
        if self.tensor_parallel < 1:
            raise SysModelError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if not 0 < self.efficiency <= 1:
            raise SysModelError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if not 0 < self.memory_fraction <= 1:
            raise SysModelError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.max_context < 1:
            raise SysModelError(f"max_context must be >= 1, got {self.max_context}")
        self.accelerator.flops(self.dtype)  # an unknown dtype fails here, with the chip's list

    # ---- the two roofs ------------------------------------------------------------------------

    def step_bytes(self, batch: int, context: float) -> float:
        """Bytes one step reads and writes, summed over the server's chips: weights, the
        embedding rows of the batch, the KV cache of the context and the new keys/values."""
        itemsize = dtype_bytes(self.dtype)
        kv = self.shape.kv_bytes_per_token(self.dtype)
        return (self.shape.decode_weight_bytes(self.dtype)
                + batch * self.shape.hidden_size * itemsize + batch * (context + 1) * kv)

    def step_flops(self, batch: int, context: float) -> float:
        return batch * self.shape.decode_flops_per_token(context)

    def memory_seconds(self, batch: int, context: float) -> float:
        bandwidth = self.tensor_parallel * self.accelerator.memory_bandwidth * self.efficiency
        return self.step_bytes(batch, context) / bandwidth

    def compute_seconds(self, batch: int, context: float) -> float:
        peak = self.tensor_parallel * self.accelerator.flops(self.dtype) * self.efficiency
        return self.step_flops(batch, context) / peak

    def comm_seconds(self, batch: int) -> float:
        """Two all-reduces of ``[B, hidden]`` activations per layer (ring: each chip sends
        ``2·(tp−1)/tp`` of the buffer), each with a fixed latency."""
        tp = self.tensor_parallel
        if tp == 1:
            return 0.0
        buffer = batch * self.shape.hidden_size * dtype_bytes(self.dtype)
        one = (self.accelerator.collective_latency_s
               + 2 * (tp - 1) / tp * buffer / self.accelerator.link_bandwidth)
        return 2 * self.shape.num_layers * one

    def step_seconds(self, batch: int, context: float) -> float:
        """Seconds of one decode step of ``batch`` sequences with mean ``context`` tokens."""
        if batch <= 0:
            return 0.0
        return (max(self.memory_seconds(batch, context), self.compute_seconds(batch, context))
                + self.comm_seconds(batch) + self.step_overhead_s)

    def bound(self, batch: int, context: float) -> str:
        """``"memory"`` or ``"compute"``: which roof sets the step time."""
        return ("memory" if self.memory_seconds(batch, context)
                >= self.compute_seconds(batch, context) else "compute")

    def ridge_batch(self, context: float) -> float:
        """The batch at which the memory and compute roofs meet (both are affine in ``B``)."""
        m0, m1 = self.memory_seconds(0, context), self.memory_seconds(1, context)
        c1 = self.compute_seconds(1, context)
        slope = c1 - (m1 - m0)
        return math.inf if slope <= 0 else m0 / slope

    # ---- memory -------------------------------------------------------------------------------

    def kv_bytes_per_token_per_chip(self) -> float:
        """KV heads are split over the TP chips; with more chips than KV heads each chip keeps
        a replica of one head."""
        k, tp = self.shape.num_kv_heads, self.tensor_parallel
        return self.shape.kv_bytes_per_token(self.dtype) * math.ceil(k / tp) / k

    def weight_bytes_per_chip(self) -> float:
        return self.shape.weight_bytes(self.dtype) / self.tensor_parallel

    @property
    def max_batch(self) -> int:
        """Most sequences of ``max_context`` tokens whose KV cache fits next to the weights
        (0: the weights alone do not fit)."""
        room = (self.accelerator.memory_capacity * self.memory_fraction
                - self.weight_bytes_per_chip())
        if room <= 0:
            return 0
        return int(room // (self.max_context * self.kv_bytes_per_token_per_chip()))

    def prefill_seconds_per_token(self, prompt_len: float) -> float:
        """A prompt token's prefill cost at the compute roof (prefill runs many tokens at once)."""
        peak = self.tensor_parallel * self.accelerator.flops(self.dtype) * self.efficiency
        return self.shape.prefill_flops_per_token(prompt_len) / peak


@dataclasses.dataclass(frozen=True)
class MeasuredLatency:
    """A measured decode-step curve: ``seconds[i]`` at ``batches[i]`` (increasing batches)."""

    batches: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str = ""
    max_batch: int | None = None

    def __post_init__(self):
        if len(self.batches) != len(self.seconds) or not self.batches:
            raise SysModelError("a measured latency curve needs as many batches as seconds, "
                                "at least one point")
        if any(b <= 0 for b in self.batches) or any(
                b2 <= b1 for b1, b2 in zip(self.batches, self.batches[1:])):
            raise SysModelError(f"measured batches must be positive and increasing, got "
                                f"{list(self.batches)}")
        if any(not s > 0 for s in self.seconds):
            raise SysModelError(f"measured step seconds must be > 0, got {list(self.seconds)}")

    @classmethod
    def from_points(cls, points: Mapping[int, float] | Iterable[tuple[int, float]],
                    source: str = "", max_batch: int | None = None) -> "MeasuredLatency":
        pairs = sorted((int(b), float(s)) for b, s in
                       (points.items() if isinstance(points, Mapping) else points))
        return cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), source, max_batch)

    @classmethod
    def from_benchmark(cls, path: str | Path, model: str | None = None,
                       key: str = "engine_step_s") -> "MeasuredLatency":
        """From ``generator_throughput.json``: the ``rows`` (``batch``, ``key``) of ``model``
        (default: the first model in the file)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SysModelError(f"cannot read latency benchmark {path}: {e}")
        models = data.get("models") or []
        chosen = [m for m in models if model is None or m.get("model") == model]
        if not chosen:
            raise SysModelError(f"{path} has no model {model!r}; it has "
                                f"{[m.get('model') for m in models]}")
        rows = chosen[0].get("rows") or []
        try:
            points = [(r["batch"], r[key]) for r in rows]
        except KeyError as e:
            raise SysModelError(f"{path}: rows of model {chosen[0].get('model')!r} lack {e}")
        return cls.from_points(points, source=f"{path}:{chosen[0].get('model')}:{key}")

    def step_seconds(self, batch: int, context: float = 0.0) -> float:
        if batch <= 0:
            return 0.0
        b = np.asarray(self.batches, float)
        s = np.asarray(self.seconds, float)
        if batch <= b[0]:
            return float(s[0])
        if batch <= b[-1]:
            return float(np.interp(batch, b, s))
        slope = max((s[-1] - s[-2]) / (b[-1] - b[-2]), 0.0) if len(b) > 1 else 0.0
        return float(s[-1] + slope * (batch - b[-1]))

    def affine_fit(self) -> tuple[float, float]:
        """Least-squares ``seconds ≈ a + b·batch``: (fixed seconds per step, seconds per
        sequence)."""
        if len(self.batches) == 1:
            return float(self.seconds[0]), 0.0
        slope, intercept = np.polyfit(np.asarray(self.batches, float),
                                      np.asarray(self.seconds, float), 1)
        return float(intercept), float(slope)


# ---- trainer -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainerModel:
    """Optimizer-step time of the trainer pool: ``tokens / tokens_per_s + step_overhead_s``.

    ``tokens_per_s`` counts every token of the batch (prompt and completion) across the pool.
    """

    tokens_per_s: float
    step_overhead_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        if not self.tokens_per_s > 0:
            raise SysModelError(f"trainer tokens/s must be > 0, got {self.tokens_per_s}")
        if self.step_overhead_s < 0:
            raise SysModelError(f"trainer step overhead must be >= 0, got "
                                f"{self.step_overhead_s}")

    def step_seconds(self, tokens: float) -> float:
        return tokens / self.tokens_per_s + self.step_overhead_s

    @classmethod
    def from_flops(cls, shape: ModelShape, accelerator: Accelerator, num_accelerators: int, *,
                   mfu: float, seq_len: float, dtype: str = "bfloat16",
                   param_dtype: str = "float32", forward_passes: float = 0.0
                   ) -> "TrainerModel":
        """``num_accelerators · peak · mfu / flops_per_token`` tokens/s, where a token costs
        ``train_flops_per_token(seq_len)`` (forward and backward) plus ``forward_passes`` more
        forward passes (a third of that each: a reference model's, the old policy's
        log-probs, the remat recompute); the overhead is the AdamW update, memory-bound: per
        parameter it reads parameter, gradient and two moments and writes parameter and
        moments, spread over the pool (FSDP)."""
        if not 0 < mfu <= 1:
            raise SysModelError(f"mfu must be in (0, 1], got {mfu}")
        if num_accelerators < 1:
            raise SysModelError(f"a trainer needs >= 1 accelerator, got {num_accelerators}")
        if forward_passes < 0:
            raise SysModelError(f"forward_passes must be >= 0, got {forward_passes}")
        peak = accelerator.flops(dtype) * num_accelerators * mfu
        train = shape.train_flops_per_token(seq_len)
        tokens_per_s = peak / (train * (1 + forward_passes / 3))
        p = dtype_bytes(param_dtype)
        update_bytes = shape.params * ((2 * p + 8) + (p + 8))
        overhead = update_bytes / (num_accelerators * accelerator.memory_bandwidth)
        return cls(tokens_per_s, overhead,
                   source=f"{num_accelerators}x {accelerator.name} at MFU {mfu:.2f}")

    @classmethod
    def from_measured(cls, tokens_per_s_per_accelerator: float, num_accelerators: int = 1,
                      step_overhead_s: float = 0.0) -> "TrainerModel":
        """Measured throughput of one accelerator, scaled linearly to the pool."""
        return cls(tokens_per_s_per_accelerator * num_accelerators, step_overhead_s,
                   source=f"measured {tokens_per_s_per_accelerator:,.0f} tok/s per accelerator")
