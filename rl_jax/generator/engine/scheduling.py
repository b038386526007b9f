"""The engine's records and the host side of its admissions.

A :class:`Request` is one ``GenerateRequest`` with its ``n`` :class:`Sequence` samples; a
:class:`Replica` is one data-parallel copy of the model with its slots and running sequences; an
:class:`InFlight` is device work whose tokens are not read yet. :func:`plan_admission` decides
which waiting sequences a scheduler pass admits (as slots, prefill tokens and KV-cache pages
allow), where, and which share a prefill; :class:`PageBudget` is the paged KV cache's side of
admission and retraction (the pages an admission takes and reserves, the pages a decode step
needs, which sequence gives its pages back when the pool runs dry);
:func:`prefill_batch` lays their prompts out for one prefill. All of it is host bookkeeping: the
engine (:mod:`rl_jax.generator.engine.core`) owns the records and calls these under its lock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rl_jax.generator.engine.kv_cache import pages_for
from rl_jax.generator.engine.runner import ModelRunner
from rl_jax.generator.types import GeneratorError, SamplingParams


@dataclasses.dataclass(slots=True)
class Sequence:
    """One sample of a request: its tokens so far and where it lives."""

    request: "Request"
    index: int  # sample index within the request (0..n-1)
    seed: int
    # Constant per request, kept here for the per-step loops over running sequences.
    prompt_len: int = dataclasses.field(init=False)
    max_new_tokens: int = dataclasses.field(init=False)
    horizon: int = dataclasses.field(init=False)  # cache positions it may reach
    filtered: bool = dataclasses.field(init=False)  # sampled with top-k/top-p/min-p
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # Under the distribution before top-k/top-p/min-p (kept only when a filter is on).
    unfiltered_logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1  # slot within its replica's cache (-1: none)
    replica: int = -1
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    # Tokens queued for sampling on the device (sampled or in flight): >= len(output_ids).
    dispatched: int = 0

    def __post_init__(self):
        sampling = self.request.sampling
        self.prompt_len = len(self.request.input_ids)
        self.max_new_tokens = sampling.max_new_tokens
        self.horizon = self.prompt_len + sampling.max_new_tokens
        self.filtered = sampling.needs_filter

    @property
    def tokens(self) -> list[int]:
        return self.request.input_ids + self.output_ids


@dataclasses.dataclass
class InFlight:
    """Device work whose tokens are not yet read, one part per replica: ``(out, seqs, columns)``
    with ``out [3, n]`` (tokens, log-prob bits) holding sequence ``seqs[i]``'s token at column
    ``columns[i]``; sampled by weights of ``version``."""

    parts: list[tuple[Any, list[Sequence], list[int]]]
    version: int


class Replica:
    """One data-parallel replica: a runner (KV cache and compiled steps on its own mesh), its
    copy of the parameters and decode weights, and its slots."""

    def __init__(self, index: int, runner: ModelRunner, params: dict[str, Any]):
        self.index = index
        self.runner = runner
        self.params = self.place(params)
        self.decode_weights = runner.prepare(self.params)
        self.running: dict[int, Sequence] = {}
        self.free_slots = list(range(runner.max_slots))  # a heap: lowest slot first

    def place(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` (placed for the first replica's mesh) as this replica uses them: the
        first replica's own, a copy with the same partition specs on another's mesh."""
        if self.index == 0:
            return params
        from jax.sharding import NamedSharding, PartitionSpec

        def one(a):
            spec = a.sharding.spec if isinstance(a.sharding, NamedSharding) else PartitionSpec()
            return jax.device_put(a, NamedSharding(self.runner.mesh, spec))
        return jax.tree.map(one, params)


@dataclasses.dataclass
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    future: concurrent.futures.Future
    start: float
    sequences: list[Sequence] = dataclasses.field(default_factory=list)


def pow2_bucket(n: int, minimum: int, maximum: int) -> int:
    """The smallest power-of-two multiple of ``minimum`` that holds ``n``, at most
    ``maximum``."""
    size = minimum
    while size < n:
        size *= 2
    return min(size, maximum)


def plan_admission(waiting: collections.deque[Sequence], free: list[int], budget: int,
                   pages: list[int] | None = None,
                   page_cost: Callable[[Sequence, bool], int] | None = None
                   ) -> list[tuple[int, list[Sequence]]]:
    """Takes from the front of ``waiting`` the sequences one scheduler pass admits: a list of
    ``(replica, sequences sharing a prefill)``. A new prefill goes to the replica with the most
    free slots (``free``: per replica, decremented here) among those with the KV-cache pages it
    takes (``pages``: per replica, the free pages it may take, decremented here by
    ``page_cost(seq, joins)``, its pages when it starts a prefill or joins the one before) while
    its prompt fits the remaining prefill ``budget`` (tokens; the first prefill always goes); it
    stops at the first sequence that cannot be placed, so the queue keeps its order."""
    pages = list(pages) if pages is not None else [0] * len(free)
    cost = page_cost or (lambda seq, joins: 0)
    groups: list[tuple[int, list[Sequence]]] = []
    while waiting:
        seq = waiting[0]
        # Fresh samples waiting together share one prefill when they have the same prompt: the
        # samples of one request, or requests for the same prompt sent together (e.g. a GRPO
        # group sent as one request per sample, each with its own length or seed).
        last = groups[-1] if groups else None
        head = last[1][0] if last is not None else None
        joins = (head is not None and free[last[0]] > 0 and not seq.output_ids
                 and not head.output_ids
                 and (head.request is seq.request
                      or head.request.input_ids == seq.request.input_ids)
                 and cost(seq, True) <= pages[last[0]])
        if joins:
            taken = cost(seq, True)
        else:
            taken = cost(seq, False)
            fits = [r for r in range(len(free)) if free[r] and taken <= pages[r]]
            if not fits:
                break
            target = max(fits, key=free.__getitem__)
            prefill_len = len(seq.request.input_ids) + max(len(seq.output_ids) - 1, 0)
            if groups and prefill_len > budget:
                break
            budget -= prefill_len
            groups.append((target, []))
        waiting.popleft()
        groups[-1][1].append(seq)
        free[groups[-1][0]] -= 1
        pages[groups[-1][0]] -= taken
    return groups



class PageBudget:
    """The paged KV cache's admission and retraction, as SGLang's scheduler has them.

    A sequence holds pages for its live tokens only, taking one as it grows and giving all back
    when it finishes. It is admitted when its replica's free pages cover its prompt plus a share
    -- the *new-token ratio* -- of the pages the running and admitted sequences may still take
    for their completions (:meth:`admissible_pages`, :meth:`admission_pages`). The ratio starts
    at ``init_ratio`` and decays towards ``min_ratio`` over ``decay_steps`` decode steps
    (:meth:`decay`), so the pool fills up. Before each decode step every running sequence takes
    the pages its next tokens write (:meth:`grow`); when the pool runs dry, running sequences are
    retracted as SGLang's ``retract_decode`` does -- :meth:`retraction_victim`, the one with the
    fewest generated tokens first (ties: the longest prompt) -- and the ratio goes back to
    ``init_ratio`` (:meth:`reset`). A request that could never fit the whole pool is refused when
    submitted (:meth:`check_fits`).

    Every replica's pool is ``runner``'s size (the engine builds them alike). Host bookkeeping
    only: the engine calls it under its lock.
    """

    def __init__(self, runner: ModelRunner, *, init_ratio: float, min_ratio: float,
                 decay_steps: int):
        self.page_size = runner.page_size
        self.num_pages = runner.num_pages
        self.cache_bytes = runner.cache_bytes
        self.init_ratio = init_ratio
        self.min_ratio = min_ratio
        self.decay_steps = decay_steps
        self.new_token_ratio = init_ratio

    def check_fits(self, prompt_len: int, max_new_tokens: int):
        """Refuses a request whose one sequence needs more pages than the whole pool holds."""
        need = pages_for(prompt_len + max_new_tokens - 1, self.page_size)
        if need > self.num_pages:
            raise GeneratorError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} needs "
                f"{need} KV-cache pages of {self.page_size} tokens, more than the whole cache "
                f"holds ({self.num_pages} pages, kv_cache_bytes={self.cache_bytes}; "
                f"{self.num_pages * self.page_size} tokens)")

    def decay(self, steps: int):
        """Lowers the new-token ratio for ``steps`` decode steps, down to ``min_ratio``."""
        self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - steps * (
            self.init_ratio - self.min_ratio) / self.decay_steps)

    def reset(self):
        """Back to ``init_ratio`` (after a retraction: the reserve was too small)."""
        self.new_token_ratio = self.init_ratio

    def future_pages(self, seq: Sequence, held: int) -> int:
        """Pages ``seq`` may still take beyond the ``held`` ones, reserved at the current
        new-token ratio."""
        future = pages_for(seq.horizon - 1, self.page_size) - held
        return math.ceil(future * self.new_token_ratio) if future > 0 else 0

    def reserved_pages(self, replica: Replica) -> int:
        """Pages a replica's running sequences may still take, at the new-token ratio."""
        held = replica.runner.pages.held
        return sum(self.future_pages(seq, int(held[slot]))
                   for slot, seq in replica.running.items())

    def admissible_pages(self, replica: Replica) -> int:
        """Free pages of ``replica`` that admissions may take (``plan_admission``'s ``pages``):
        the free ones less the running sequences' reserve."""
        return replica.runner.pages.free_pages - self.reserved_pages(replica)

    def admission_pages(self, seq: Sequence, joins: bool) -> int:
        """Free pages admitting ``seq`` takes (``plan_admission``'s ``page_cost``): its prompt's
        pages (when it joins the prefill before it, only its own copy of the prompt's last,
        partly filled page), plus its reserve for its completion."""
        size = self.page_size
        prefill = seq.prompt_len + max(len(seq.output_ids) - 1, 0)
        own = int(prefill % size != 0) if joins else pages_for(prefill, size)
        return own + self.future_pages(seq, pages_for(prefill, size))

    @staticmethod
    def grow(replica: Replica, steps: int) -> Sequence | None:
        """Gives every running sequence of ``replica`` the pages of the positions its next
        ``steps`` decode steps write; the first sequence that cannot get them, or None."""
        table = replica.runner.pages
        for slot, seq in sorted(replica.running.items()):
            # Positions up to prompt + dispatched + steps - 2 are written; none past the last
            # one its completion can have (later steps of a multi-step run are dropped).
            if not table.grow(slot, min(seq.prompt_len + seq.dispatched + steps - 1,
                                        seq.horizon - 1)):
                return seq
        return None

    @staticmethod
    def retraction_victim(running: dict[int, Sequence]) -> Sequence:
        """The running sequence to retract first: fewest generated tokens, then the longest
        prompt, then the highest slot."""
        return min(running.values(), key=lambda s: (len(s.output_ids), -s.prompt_len, -s.slot))


def prefill_batch(prompts: list[list[int]], min_len: int, max_seq_len: int, max_slots: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``prompts`` as one prefill: ``tokens [B, P]`` int32, right-padded, and their ``lengths
    [B]`` (padding rows of length 1), with ``P`` and ``B`` powers of two (``P >= min_len``,
    at most ``max_seq_len``; ``B`` at most ``max_slots``) so that few shapes compile."""
    p = pow2_bucket(max(map(len, prompts)), min_len, max_seq_len)
    b = pow2_bucket(len(prompts), 1, max(max_slots, 1))
    tokens = np.zeros((b, p), np.int32)
    lengths = np.ones((b,), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
        lengths[i] = len(prompt)
    return tokens, lengths
