"""Requests, sampling parameters and outputs of the generator (SGLang's field names)."""

from __future__ import annotations

import dataclasses
from typing import Any


# The largest temperature sampled with: the device scales logits by its reciprocal, which must
# be a normal float32 (above 1 / 1.18e-38 = 8.5e37 it is subnormal, flushed to zero, and the
# log-probabilities become NaN). Any temperature above ~1e8 already samples uniformly.
MAX_TEMPERATURE = 1e37


class GeneratorError(ValueError):
    """A request the generator cannot serve (bad parameters, too long, unknown tokens)."""


class Overloaded(RuntimeError):
    """The generator's waiting queue is full; retry later (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine raised while serving one request: that request fails, the others go on."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls, named as in SGLang's ``sampling_params``.

    ``temperature == 0`` is greedy decoding. ``top_k <= 0`` (SGLang uses -1) and ``top_p == 1``
    disable those filters. ``seed`` makes sampling reproducible: the same seed, prompt and
    weights give the same tokens whatever else is in the batch.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
             f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.temperature <= MAX_TEMPERATURE,
             f"temperature must be at most {MAX_TEMPERATURE:g} (the sampler divides by it in "
             f"float32), got {self.temperature:.6g}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int), f"top_k must be an integer, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be a positive integer, got {self.n!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise GeneratorError(message)

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclasses.dataclass
class GenerateRequest:
    """One prompt to complete (``n`` samples share its prefill)."""

    input_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    rid: str | None = None
    return_logprob: bool = True


@dataclasses.dataclass
class GenerateOutput:
    """One completion: every generated token with its log-probability under the distribution
    it was sampled from and the version of the weights that produced it.

    ``output_logprobs`` are under ``softmax(logits / temperature)`` restricted to what
    top-k/top-p/min-p keep, renormalised (the behaviour policy; raw logits when greedy);
    ``output_unfiltered_logprobs`` under ``softmax(logits / temperature)`` before the filters,
    present when a filter was on (``None`` otherwise: the two are equal)."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, Any]
    cached_tokens: int = 0
    e2e_latency: float = 0.0
    output_unfiltered_logprobs: list[float] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
