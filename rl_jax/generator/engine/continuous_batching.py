"""The engine's data path: admitting waiting sequences, queuing decode steps, reading them back.

Each scheduler pass of :class:`rl_jax.generator.engine.core.Engine` calls, in order,
:meth:`ContinuousBatcher.admit` (prefill waiting sequences into free slots and free KV-cache
pages, as :func:`~rl_jax.generator.engine.scheduling.plan_admission` and the
:class:`~rl_jax.generator.engine.scheduling.PageBudget` allow),
:meth:`~ContinuousBatcher.decode_step`
(give every running sequence the pages its next tokens write, retracting sequences when the pool
runs dry, then queue one decode step on every replica) and :meth:`~ContinuousBatcher.read_back`
(append the tokens of finished steps, keeping one step in flight while decoding goes on).

The device stays busy: a decode step feeds each slot the token the previous step sampled without
the host in between, so step ``t+1`` is queued before the tokens of step ``t`` are read back and
bookkept. A sequence that stops on a stop token is seen one step late and that step's extra token
for it is dropped; a sequence that reaches ``max_new_tokens`` gives up its slot as soon as its
last token is queued. A failure while admitting is kept to the request that causes it.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading

import numpy as np

from rl_jax.generator.engine.bookkeeping import Bookkeeper
from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.kv_cache import SLOT_FIELDS, batch_bucket
from rl_jax.generator.engine.scheduling import (InFlight, PageBudget, Replica, Sequence,
                                                plan_admission, pow2_bucket, prefill_batch)
from rl_jax.generator.types import RequestFailed

log = logging.getLogger(__name__)


class ContinuousBatcher:
    """Admission, decode dispatch and read-back over an engine's replicas.

    Args:
      engine_config: the engine's settings.
      replicas: the engine's data-parallel replicas.
      book: the engine's :class:`Bookkeeper` (queue, requests, slots).
      budget: the KV-cache pages' admission and retraction policy.
      lock: the engine's lock, taken here around every change to ``book``.
      stats: the engine's counters, updated here.

    Called from the engine's scheduler thread only.
    """

    def __init__(self, engine_config: EngineConfig, replicas: list[Replica], book: Bookkeeper,
                 budget: PageBudget, lock: threading.Condition, stats: collections.Counter):
        self.engine_config = engine_config
        self.replicas = replicas
        self.book = book
        self.budget = budget
        self.lock = lock
        self.stats = stats
        self.inflight: collections.deque[InFlight] = collections.deque()

    # ---- admission ----------------------------------------------------------------------------

    def admit(self, version: int):
        """Prefills waiting sequences into free slots (fresh samples of one prompt waiting
        together share a prefill on one replica; a new prefill goes to the replica with the most
        free slots) and queues the sampling of their first tokens, by weights of ``version``."""
        budget = self.engine_config.max_prefill_tokens
        free = [len(r.free_slots) for r in self.replicas]
        with self.lock:
            pages = [self.budget.admissible_pages(r) for r in self.replicas]
            groups = plan_admission(self.book.waiting, free, budget, pages,
                                    self.budget.admission_pages)
        if not groups:
            return
        parts = []
        for replica in self.replicas:
            mine = [g for r, g in groups if r == replica.index]
            if mine:
                parts.extend(self._admit_isolated(replica, mine))
        if parts:
            self.inflight.append(InFlight(parts, version))
        self._release_fully_dispatched([seq for _, group in groups for seq in group
                                        if seq.finish_reason is None])

    def _admit_isolated(self, replica: Replica, groups: list[list[Sequence]]) -> list:
        """:meth:`_admit_to`, with a failure kept to the request that causes it: the admission
        is undone and retried one prefill group at a time, then one request at a time; a
        request that still fails alone gets the error, the others are admitted as usual (with
        the same tokens: sampling depends on seeds, not on batch composition)."""
        try:
            return [self._admit_to(replica, groups)]
        except Exception as e:
            with self.lock:
                self.book.undo_admission([seq for group in groups for seq in group])
            if len(groups) > 1:
                return [part for group in groups
                        for part in self._admit_isolated(replica, [group])]
            by_request: dict[int, list[Sequence]] = {}
            for seq in groups[0]:
                by_request.setdefault(id(seq.request), []).append(seq)
            if len(by_request) > 1:
                return [part for seqs in by_request.values()
                        for part in self._admit_isolated(replica, [seqs])]
            request = groups[0][0].request
            log.exception("request %s failed in the engine; the other requests go on",
                          request.rid)
            self.stats["failed_requests"] += 1
            with self.lock:
                self.book.fail_request(request, RequestFailed(
                    f"request {request.rid} failed in the engine: {type(e).__name__}: {e}"))
            return []

    def _admit_to(self, replica: Replica, groups: list[list[Sequence]]):
        """Prefills ``groups`` on ``replica`` and installs them in its lowest free slots; returns
        the in-flight part of their first tokens."""
        prompts = [g[0].tokens[:len(g[0].tokens) - (1 if g[0].output_ids else 0)] for g in groups]
        cfg, runner = self.engine_config, replica.runner
        tokens, lengths = prefill_batch(prompts, cfg.min_prefill_bucket, cfg.max_seq_len,
                                        runner.max_slots)
        k, v, logits = runner.prefill(replica.params, tokens, lengths)

        seqs = [seq for group in groups for seq in group]
        m = pow2_bucket(len(seqs), 1, max(runner.max_slots, 1))
        values = {name: np.zeros((m,), dtype) for name, dtype in SLOT_FIELDS.items()}
        rows = np.zeros((m,), np.int32)
        slots = np.full((m,), runner.max_slots, np.int32)  # padding: an out-of-range slot, dropped
        fresh = np.zeros((m,), bool)
        filtered = False
        with self.lock:
            i = 0
            for row, group in enumerate(groups):
                for j, seq in enumerate(group):
                    seq.slot = heapq.heappop(replica.free_slots)
                    seq.replica = replica.index
                    seq.cached_tokens = len(prompts[row]) if j else 0
                    replica.running[seq.slot] = seq
                    sp = seq.request.sampling
                    rows[i], slots[i], fresh[i] = row, seq.slot, not seq.output_ids
                    values["position"][i] = len(prompts[row])
                    values["token"][i] = seq.output_ids[-1] if seq.output_ids else 0
                    values["token_index"][i] = len(seq.output_ids)
                    values["seed"][i] = seq.seed
                    values["sample_index"][i] = seq.index
                    values["temperature"][i] = sp.temperature
                    values["top_k"][i] = sp.top_k
                    values["top_p"][i] = sp.top_p
                    values["min_p"][i] = sp.min_p
                    filtered |= fresh[i] and sp.needs_filter
                    seq.dispatched = max(len(seq.output_ids), 1)
                    i += 1
        out = runner.admit(k, v, logits, rows, slots, values, fresh, filtered)
        columns = [i for i in range(len(seqs)) if fresh[i]]
        self.stats["prefill_tokens"] += int(sum(map(len, prompts)))
        self.stats["prefills"] += 1
        self.stats[f"replica{replica.index}_admitted"] += len(seqs)
        return out, [seqs[i] for i in columns], columns

    # ---- decoding -----------------------------------------------------------------------------

    def decode_step(self, version: int):
        """Queues one decode step of every running sequence (slots ``0..batch-1`` of each
        replica), every replica's step before any is awaited; ``decode_steps`` of them in one
        program, sampled by weights of ``version``."""
        steps = self.engine_config.decode_steps
        self.budget.decay(steps)
        parts = []
        for replica in self.replicas:
            if not replica.running:
                continue
            self._give_pages(replica)
            if not replica.running:
                continue
            self._compact(replica)
            seqs = list(replica.running.values())
            batch = batch_bucket(max(replica.running) + 1, replica.runner.max_slots)
            # The next positions written are prompt + dispatched tokens (cache positions used).
            kv_needed = max(seq.prompt_len + seq.dispatched for seq in seqs)
            horizon = max(seq.horizon for seq in seqs)
            filtered = any(seq.filtered for seq in seqs)
            out = replica.runner.decode(replica.decode_weights, batch, kv_needed, filtered,
                                        horizon, steps=steps)
            for seq in seqs:
                seq.dispatched += steps
            self.stats[f"decode_batch_{batch}"] += steps  # how full the decode batches run
            parts.append((out, seqs, list(replica.running)))
        self.inflight.append(InFlight(parts, version))
        self.stats["decode_steps"] += steps
        self.stats["decode_dispatches"] += 1
        self._release_fully_dispatched([seq for _, seqs, _ in parts for seq in seqs])

    def _give_pages(self, replica: Replica):
        """Before a decode step: every running sequence of ``replica`` gets its next pages.
        When the pool runs dry, the steps in flight are read back (finished sequences give
        their pages back), then running sequences are retracted to the front of the queue
        (:meth:`PageBudget.retraction_victim` first) and the new-token ratio returns to its
        initial value. A sequence that cannot grow alone fails its request."""
        steps = self.engine_config.decode_steps
        with self.lock:
            if self.budget.grow(replica, steps) is None:
                return
        self.drain()
        retracted = 0
        while True:
            with self.lock:
                stuck = self.budget.grow(replica, steps)
                if stuck is None:
                    break
                if len(replica.running) == 1:
                    request = stuck.request
                else:
                    self.book.retract(self.budget.retraction_victim(replica.running))
                    retracted += 1
                    continue
            with self.lock:
                self.book.fail_request(request, RequestFailed(
                    f"request {request.rid} does not fit the KV cache alone "
                    f"({replica.runner.num_pages} pages of {replica.runner.page_size} tokens)"))
            break
        if retracted:
            self.budget.reset()
            self.stats["retracted_sequences"] += retracted
            self.stats["kv_cache_full"] += 1
            log.warning("KV cache full (%d pages of %d tokens): retracted %d sequences",
                        replica.runner.num_pages, replica.runner.page_size, retracted)

    def _compact(self, replica: Replica):
        """Moves the sequences of a replica's highest slots into free lower ones when the running
        sequences would then fit a smaller decode batch (a long sample left alone in slot 40
        would otherwise be decoded in a batch of 64)."""
        slots, running = replica.runner.max_slots, replica.running
        target = batch_bucket(len(running), slots)
        if batch_bucket(max(running) + 1, slots) <= target:
            return
        with self.lock:
            movers = sorted((s for s in running if s >= target), reverse=True)
            free = sorted(s for s in replica.free_slots if s < target)[:len(movers)]
            for src, dst in zip(movers, free):
                seq = running.pop(src)
                seq.slot = dst
                running[dst] = seq
            taken = set(free)
            replica.free_slots = [s for s in replica.free_slots if s not in taken] + movers
            heapq.heapify(replica.free_slots)
        replica.runner.move(np.asarray(movers, np.int32), np.asarray(free, np.int32))
        self.stats["compactions"] += 1

    def _release_fully_dispatched(self, seqs: list[Sequence]):
        """Frees the slots of sequences whose last token is queued: a later step would only
        compute tokens past ``max_new_tokens`` (the queued work still completes first)."""
        done = [s for s in seqs if s.dispatched >= s.max_new_tokens]
        if done:
            with self.lock:
                for seq in done:
                    self.book.release(seq)

    # ---- read-back ----------------------------------------------------------------------------

    def read_back(self, keep: int):
        """Reads back and bookkeeps the oldest steps in flight until ``keep`` are left."""
        while len(self.inflight) > keep:
            self._process(self.inflight.popleft())

    def drain(self):
        """Reads back and bookkeeps every step in flight."""
        self.read_back(0)

    def _process(self, work: InFlight):
        """Appends the tokens of one finished step to their sequences, finishing those that
        stop."""
        finished = self.book.record(work)
        if finished:
            with self.lock:
                self.book.finish(finished)
