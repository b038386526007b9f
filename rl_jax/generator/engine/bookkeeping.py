"""Where the engine's requests and sequences are, and the moves between those places.

A sequence is waiting (in :attr:`Bookkeeper.waiting`), in one slot of one replica
(``Replica.running``), or finished (its ``finish_reason`` set); a slot is free (in
``Replica.free_slots``, with no KV-cache pages) or holds one sequence; a request stays in
:attr:`Bookkeeper.requests` until its future is resolved, with its outputs once all its
sequences finished or with an error. :class:`Bookkeeper`'s methods are the moves -- queue,
release, retract, record a step's tokens, finish, abort, fail -- each keeping those invariants.
Host bookkeeping only: the engine (:mod:`rl_jax.generator.engine.core`) and its continuous batcher
(:mod:`rl_jax.generator.engine.continuous_batching`) call them holding the engine's lock, except
:meth:`Bookkeeper.record` (only the scheduler thread appends tokens).
"""

from __future__ import annotations

import collections
import heapq
import time

from rl_jax.generator.engine.sampling import unpack
from rl_jax.generator.engine.scheduling import InFlight, Replica, Request, Sequence
from rl_jax.generator.types import GenerateOutput


class Bookkeeper:
    """The waiting queue, the live requests and every replica's slots of one engine.

    Args:
      replicas: the engine's data-parallel replicas (their ``running`` and ``free_slots``).
      eos_token_ids: tokens that end a sequence unless its request sets ``ignore_eos``.
      stats: the engine's counters, updated here.
    """

    def __init__(self, replicas: list[Replica], eos_token_ids: tuple[int, ...],
                 stats: collections.Counter):
        self.replicas = replicas
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.requests: dict[str, Request] = {}

    @property
    def running_count(self) -> int:
        return sum(len(r.running) for r in self.replicas)

    def queue(self, req: Request):
        """Adds ``req`` and queues its sequences behind the waiting ones."""
        self.requests[req.rid] = req
        self.waiting.extend(req.sequences)

    def release(self, seq: Sequence):
        """Frees ``seq``'s slot and KV-cache pages, if it holds one."""
        if seq.slot >= 0:
            replica = self.replicas[seq.replica]
            replica.running.pop(seq.slot, None)
            replica.runner.pages.release(seq.slot)
            heapq.heappush(replica.free_slots, seq.slot)
            seq.slot = seq.replica = -1

    def retract(self, seq: Sequence):
        """Moves a running ``seq`` back to the front of the queue, keeping its tokens (its KV is
        recomputed when it is admitted again)."""
        self.release(seq)
        seq.dispatched = len(seq.output_ids)
        self.waiting.appendleft(seq)

    def retract_all(self):
        """Moves every running sequence back to the front of the queue, in slot order; their KV
        cache is dropped and recomputed when they are admitted again. Nothing may be in
        flight."""
        running = sorted((s for r in self.replicas for s in r.running.values()),
                         key=lambda s: (s.slot, s.replica))
        for seq in running:
            self.release(seq)
            seq.dispatched = len(seq.output_ids)
        self.waiting.extendleft(reversed(running))
        self.stats["retracted_sequences"] += len(running)

    def undo_admission(self, seqs: list[Sequence]):
        """Returns sequences whose admission raised to their state before it (no slot)."""
        for seq in seqs:
            self.release(seq)
            seq.dispatched = len(seq.output_ids)
            seq.cached_tokens = 0

    def record(self, work: InFlight) -> list[Sequence]:
        """Appends the tokens of one finished step to their sequences (a sequence finished
        meanwhile takes none) and returns those that stop: on a stop token, on EOS unless
        ``ignore_eos``, or at ``max_new_tokens``. Called without the lock, from the scheduler
        thread."""
        finished = []
        appended = 0
        for out, seqs, columns in work.parts:
            tokens, logprobs, unfiltered = unpack(out)
            if tokens.ndim == 1:  # one step (a multi-step run is [steps, n])
                tokens, logprobs, unfiltered = tokens[None], logprobs[None], unfiltered[None]
            for step_tokens, step_logprobs, step_unfiltered in zip(
                    tokens.tolist(), logprobs.tolist(), unfiltered.tolist()):
                for seq, column in zip(seqs, columns):
                    if seq.finish_reason is not None:  # stopped in an earlier step, or aborted
                        continue
                    tok = step_tokens[column]
                    seq.output_ids.append(tok)
                    seq.logprobs.append(step_logprobs[column])
                    if seq.filtered:
                        seq.unfiltered_logprobs.append(step_unfiltered[column])
                    seq.versions.append(work.version)
                    appended += 1
                    sp = seq.request.sampling
                    if tok in sp.stop_token_ids or (not sp.ignore_eos
                                                    and tok in self.eos_token_ids):
                        seq.finish_reason = {"type": "stop", "matched": tok}
                    elif len(seq.output_ids) >= seq.max_new_tokens:
                        seq.finish_reason = {"type": "length", "length": seq.max_new_tokens}
                    if seq.finish_reason is not None:
                        finished.append(seq)
        self.stats["generated_tokens"] += appended
        return finished

    def finish(self, seqs: list[Sequence]):
        """Releases finished sequences, then completes the requests they end."""
        for seq in seqs:
            self.release(seq)
        for seq in seqs:
            self.complete_if_done(seq.request)

    def complete_if_done(self, req: Request):
        """Resolves ``req``'s future with its outputs once every sequence of it finished."""
        if any(s.finish_reason is None for s in req.sequences):
            return
        self.requests.pop(req.rid, None)
        latency = time.perf_counter() - req.start
        outputs = [GenerateOutput(
            rid=req.rid if req.sampling.n == 1 else f"{req.rid}-{s.index}",
            input_ids=list(req.input_ids), output_ids=s.output_ids, output_logprobs=s.logprobs,
            output_unfiltered_logprobs=s.unfiltered_logprobs if s.filtered else None,
            output_versions=s.versions, finish_reason=s.finish_reason,
            cached_tokens=s.cached_tokens, e2e_latency=latency) for s in req.sequences]
        if not req.future.done():
            req.future.set_result(outputs)

    def abort(self, rid: str | None):
        """Finishes request ``rid`` (every request when None) with reason ``abort``; its outputs
        keep the tokens generated so far."""
        targets = list(self.requests.values()) if rid is None else (
            [self.requests[rid]] if rid in self.requests else [])
        for req in targets:
            for seq in req.sequences:
                if seq.finish_reason is None:
                    seq.finish_reason = {"type": "abort", "message": "aborted"}
                self.release(seq)
                if seq in self.waiting:
                    self.waiting.remove(seq)
            self.complete_if_done(req)
            self.stats["aborted_requests"] += 1

    def fail_request(self, req: Request, error: Exception):
        """Finishes every sequence of ``req`` and resolves its future with ``error``."""
        for seq in req.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = {"type": "abort", "message": str(error)}
            self.release(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
        self.requests.pop(req.rid, None)
        if not req.future.done():
            req.future.set_exception(error)

    def fail_all(self, error: Exception):
        """Resolves every live request's future with ``error`` and empties the queue and the
        slots."""
        for req in list(self.requests.values()):
            if not req.future.done():
                req.future.set_exception(error)
        self.requests.clear()
        self.waiting.clear()
        for replica in self.replicas:
            for seq in list(replica.running.values()):
                self.release(seq)
