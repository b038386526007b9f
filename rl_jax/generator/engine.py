"""Continuous-batching inference engine with in-flight weight updates.

A scheduler thread repeats: apply control operations (weight swaps, aborts, pause/resume), admit
waiting requests into free KV-cache slots (one prefill per prompt, shared by its ``n`` samples),
run one decode step for every running sequence, and finish the sequences that stopped.

Weight updates (``update_weights``) take effect between two decode steps: running sequences keep
their KV cache and continue under the new weights (PipelineRL); every token records the version
of the weights that sampled it. ``pause(mode)`` follows SGLang's ``/pause_generation``:
``abort`` finishes everything with ``finish_reason.type == "abort"``; ``retract`` returns running
sequences to the queue (their KV is recomputed, under the then-current weights, when they are
re-admitted); ``in_place`` just stops stepping, keeping everything.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from rl_jax.generator.runner import ModelRunner
from rl_jax.generator.types import (GenerateOutput, GenerateRequest, GeneratorError, Overloaded,
                                    SamplingParams)
from rl_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 32  # sequences decoded together (KV-cache slots)
    max_seq_len: int = 512  # prompt + completion tokens per slot
    max_waiting: int = 4096  # queued sequences before requests are refused (Overloaded)
    max_prefill_tokens: int = 2048  # prompt tokens prefilled per scheduler iteration
    min_prefill_bucket: int = 16
    # On a weight update, keep running sequences' KV cache (PipelineRL: cheap, the prefix's keys
    # and values stay those of the old weights) or recompute it under the new weights (exact
    # new-policy probabilities from the update on, at the cost of one prefill per sequence).
    recompute_kv_on_update: bool = False


@dataclasses.dataclass
class _Sequence:
    """One sample of a request: its tokens so far and where it lives."""

    request: "_Request"
    index: int  # sample index within the request (0..n-1)
    seed: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.request.input_ids + self.output_ids


@dataclasses.dataclass
class _Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    future: concurrent.futures.Future
    start: float
    sequences: list[_Sequence] = dataclasses.field(default_factory=list)


def _bucket(n: int, minimum: int, maximum: int) -> int:
    size = minimum
    while size < n:
        size *= 2
    return min(size, maximum)


class Engine:
    """Serves :class:`GenerateRequest`s from a background thread.

    Args:
      config: model shape.
      params: parameters (nested dict as the trainer holds them), already placed for ``mesh``.
      version: integer version of ``params`` (optimizer steps).
      eos_token_ids: tokens that end a sequence unless ``ignore_eos``.
    """

    def __init__(self, config: ModelConfig, params: dict[str, Any], *, version: int = 0,
                 engine_config: EngineConfig = EngineConfig(), mesh=None, rules=None,
                 dtype=None, eos_token_ids: tuple[int, ...] = ()):
        import jax.numpy as jnp
        self.config = config
        self.engine_config = engine_config
        self.runner = ModelRunner(config, max_slots=engine_config.max_slots,
                                  max_seq_len=engine_config.max_seq_len, mesh=mesh, rules=rules,
                                  dtype=dtype or jnp.float32)
        self.params = params
        self.version = version
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: dict[int, _Sequence] = {}
        self._free_slots = list(range(engine_config.max_slots))[::-1]
        self._requests: dict[str, _Request] = {}
        self._pending_weights: tuple[dict[str, Any], int] | None = None
        self._control: collections.deque = collections.deque()
        self._paused = False
        self._stop = False
        self._seed_counter = itertools.count(np.random.SeedSequence().entropy % (2 ** 31))
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- public API (thread-safe) -------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Queues a request; the future resolves to a list of ``n`` :class:`GenerateOutput`."""
        ids = list(request.input_ids)
        sampling = request.sampling
        if not ids:
            raise GeneratorError("input_ids is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise GeneratorError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.engine_config.max_seq_len
        if len(ids) + sampling.max_new_tokens > limit:
            raise GeneratorError(
                f"prompt of {len(ids)} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
                f"the engine's max_seq_len={limit}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        rid = request.rid or uuid.uuid4().hex
        if sampling.max_new_tokens == 0:
            future.set_result([GenerateOutput(
                rid=rid if sampling.n == 1 else f"{rid}-{i}", input_ids=[int(t) for t in ids],
                output_ids=[], output_logprobs=[], output_versions=[],
                finish_reason={"type": "length", "length": 0}) for i in range(sampling.n)])
            return future
        with self._lock:
            if rid in self._requests:
                raise GeneratorError(f"request id {rid!r} is already running")
            if sampling.n > self.engine_config.max_waiting:
                raise GeneratorError(f"n={sampling.n} samples can never be queued (the engine "
                                     f"holds at most {self.engine_config.max_waiting} waiting)")
            if len(self._waiting) + sampling.n > self.engine_config.max_waiting:
                self.stats["refused_overloaded"] += 1
                raise Overloaded(f"{len(self._waiting)} sequences are waiting (limit "
                                 f"{self.engine_config.max_waiting}); retry later")
            base_seed = sampling.seed if sampling.seed is not None else next(self._seed_counter)
            req = _Request(rid=rid, input_ids=[int(t) for t in ids], sampling=sampling,
                           future=future, start=time.perf_counter())
            req.sequences = [_Sequence(req, i, int(base_seed) % (2 ** 31))
                             for i in range(sampling.n)]
            self._requests[rid] = req
            self._waiting.extend(req.sequences)
            self._lock.notify_all()
        return future

    def generate(self, request: GenerateRequest, timeout: float | None = None
                 ) -> list[GenerateOutput]:
        return self.submit(request).result(timeout)

    def update_weights(self, params: dict[str, Any], version: int):
        """Swaps in ``params`` before the next decode step (running sequences continue)."""
        with self._lock:
            self._pending_weights = (params, int(version))
            self._lock.notify_all()

    def wait_for_version(self, version: int, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.version < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def abort(self, rid: str | None = None):
        """Finishes request ``rid`` (or every request when None) with reason ``abort``."""
        self._submit_control(("abort", rid))

    def pause(self, mode: str = "abort"):
        if mode not in PAUSE_MODES:
            raise GeneratorError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._submit_control(("pause", mode))

    def resume(self):
        self._submit_control(("resume", None))

    def flush_cache(self) -> bool:
        """Clears the KV cache; refused (False) while sequences are running."""
        done = threading.Event()
        result = {}
        self._submit_control(("flush", (done, result)))
        done.wait()
        return result["ok"]

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "free_slots": len(self._free_slots)}

    def shutdown(self):
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    def _submit_control(self, op):
        with self._lock:
            self._control.append(op)
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            # Wait until the scheduler has applied it, so callers observe its effect.
            done = threading.Event()
            with self._lock:
                self._control.append(("signal", done))
                self._lock.notify_all()
            while not done.wait(timeout=0.5):
                if not self.alive:
                    raise RuntimeError("the engine's scheduler is not running (shut down or "
                                       "crashed); the operation was not applied")

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread is running (False after shutdown or a crash)."""
        return self._thread.is_alive()

    # ---- scheduler ----------------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._lock:
                while (not self._stop and not self._control and self._pending_weights is None
                       and (self._paused or (not self._running and not self._waiting))):
                    self._lock.wait()
                if self._stop:
                    break
                controls = list(self._control)
                self._control.clear()
                weights, self._pending_weights = self._pending_weights, None
            try:
                for op in controls:
                    self._apply_control(op)
                if weights is not None:
                    self._swap_weights(*weights)
                if not self._paused:
                    self._admit()
                    if self._running:
                        self._decode_step()
            except Exception as e:  # never leave callers hanging on a scheduler error
                log.exception("engine step failed")
                self._fail_all(e)
        self._fail_all(RuntimeError("engine shut down"))

    def _apply_control(self, op):
        kind, arg = op
        if kind == "signal":
            arg.set()
        elif kind == "abort":
            self._abort(arg)
        elif kind == "pause":
            if arg == "abort":
                self._abort(None)
            elif arg == "retract":
                self._retract_all()
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "flush":
            done, result = arg
            result["ok"] = not self._running
            if result["ok"]:
                self.runner.reset_cache()
            done.set()

    def _swap_weights(self, params, version):
        start = time.perf_counter()
        if self.engine_config.recompute_kv_on_update:
            self._retract_all()
        self.params = params
        with self._lock:
            self.version = version
            self._lock.notify_all()
        self.stats["weight_updates"] += 1
        self.stats["weight_swap_ms"] += int((time.perf_counter() - start) * 1000)

    def _admit(self):
        """Prefills waiting sequences into free slots (samples of one request share a prefill)."""
        budget = self.engine_config.max_prefill_tokens
        groups: list[list[_Sequence]] = []
        with self._lock:
            while self._waiting and len(self._free_slots) > sum(map(len, groups)):
                seq = self._waiting[0]
                prefill_len = len(seq.tokens) - (1 if seq.output_ids else 0)
                if groups and prefill_len > budget:
                    break
                self._waiting.popleft()
                # Fresh samples of the same request waiting together share one prefill.
                if (groups and not seq.output_ids and not groups[-1][0].output_ids
                        and groups[-1][0].request is seq.request):
                    groups[-1].append(seq)
                else:
                    groups.append([seq])
                    budget -= prefill_len
        if not groups:
            return
        prompts = [g[0].tokens[:len(g[0].tokens) - (1 if g[0].output_ids else 0)] for g in groups]
        cfg = self.engine_config
        p = _bucket(max(map(len, prompts)), cfg.min_prefill_bucket, cfg.max_seq_len)
        b = _bucket(len(prompts), 1, max(cfg.max_slots, 1))
        tokens = np.zeros((b, p), np.int32)
        lengths = np.ones((b,), np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)] = prompt
            lengths[i] = len(prompt)
        k, v, logits = self.runner.prefill(self.params, tokens, lengths)
        rows, slots, fresh_rows, fresh = [], [], [], []
        with self._lock:
            for i, group in enumerate(groups):
                for j, seq in enumerate(group):
                    seq.slot = self._free_slots.pop()
                    seq.cached_tokens = len(prompts[i]) if j else 0
                    self._running[seq.slot] = seq
                    rows.append(i)
                    slots.append(seq.slot)
                    if not seq.output_ids:
                        fresh_rows.append(i)
                        fresh.append(seq)
        self.runner.insert(k, v, np.asarray(rows, np.int32), np.asarray(slots, np.int32))
        self.stats["prefill_tokens"] += int(sum(map(len, prompts)))
        self.stats["prefills"] += 1
        if fresh:
            self._sample_and_append(logits, fresh, rows=fresh_rows)

    def _decode_step(self):
        seqs = list(self._running.values())
        s = self.engine_config.max_slots
        tokens = np.zeros((s,), np.int32)
        positions = np.zeros((s,), np.int32)
        for seq in seqs:
            tokens[seq.slot] = seq.output_ids[-1]
            positions[seq.slot] = len(seq.tokens) - 1
        logits = self.runner.decode(self.params, tokens, positions)
        slots = np.asarray([seq.slot for seq in seqs], np.int32)
        self._sample_and_append(logits, seqs, rows=slots)
        self.stats["decode_steps"] += 1

    def _sample_and_append(self, logits, seqs: list[_Sequence], rows=None):
        """Samples the next token of ``seqs`` from ``logits`` (row ``rows[i]`` for ``seqs[i]``;
        row ``i`` when ``rows`` is None) and appends it."""
        n = len(seqs)
        bucket = _bucket(n, 1, max(self.engine_config.max_slots, n))
        arrays = {"temperature": np.ones(bucket, np.float32),
                  "top_k": np.full(bucket, -1, np.int32), "top_p": np.ones(bucket, np.float32),
                  "min_p": np.zeros(bucket, np.float32), "seed": np.zeros(bucket, np.uint32),
                  "sample_index": np.zeros(bucket, np.int32),
                  "token_index": np.zeros(bucket, np.int32)}
        filtered = False
        for i, seq in enumerate(seqs):
            sp = seq.request.sampling
            arrays["temperature"][i] = sp.temperature
            arrays["top_k"][i] = sp.top_k
            arrays["top_p"][i] = sp.top_p
            arrays["min_p"][i] = sp.min_p
            arrays["seed"][i] = seq.seed
            arrays["sample_index"][i] = seq.index
            arrays["token_index"][i] = len(seq.output_ids)
            filtered |= sp.needs_filter
        if rows is not None:  # gathered inside the sampling jit: no eager gather or pad
            picked = np.zeros(bucket, np.int32)
            picked[:n] = rows
            tokens, logprobs = self.runner.sample(logits, arrays, filtered, rows=picked)
        else:
            if bucket != n:
                logits = jax.numpy.pad(logits, ((0, bucket - n), (0, 0)))
            tokens, logprobs = self.runner.sample(logits, arrays, filtered)
        tokens, logprobs = np.asarray(tokens)[:n], np.asarray(logprobs)[:n]
        version = self.version
        finished = []
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            sp = seq.request.sampling
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos_token_ids):
                seq.finish_reason = {"type": "stop", "matched": tok}
            elif len(seq.output_ids) >= sp.max_new_tokens:
                seq.finish_reason = {"type": "length", "length": sp.max_new_tokens}
            if seq.finish_reason is not None:
                finished.append(seq)
        self.stats["generated_tokens"] += n
        with self._lock:
            for seq in finished:
                self._release(seq)
            for seq in finished:
                self._maybe_complete(seq.request)

    def _release(self, seq: _Sequence):
        if seq.slot >= 0:
            self._running.pop(seq.slot, None)
            self._free_slots.append(seq.slot)
            seq.slot = -1

    def _maybe_complete(self, req: _Request):
        if any(s.finish_reason is None for s in req.sequences):
            return
        self._requests.pop(req.rid, None)
        latency = time.perf_counter() - req.start
        outputs = [GenerateOutput(
            rid=req.rid if req.sampling.n == 1 else f"{req.rid}-{s.index}",
            input_ids=list(req.input_ids), output_ids=s.output_ids, output_logprobs=s.logprobs,
            output_versions=s.versions, finish_reason=s.finish_reason,
            cached_tokens=s.cached_tokens, e2e_latency=latency) for s in req.sequences]
        if not req.future.done():
            req.future.set_result(outputs)

    def _abort(self, rid: str | None):
        with self._lock:
            targets = list(self._requests.values()) if rid is None else (
                [self._requests[rid]] if rid in self._requests else [])
            for req in targets:
                for seq in req.sequences:
                    if seq.finish_reason is None:
                        seq.finish_reason = {"type": "abort", "message": "aborted"}
                    self._release(seq)
                    if seq in self._waiting:
                        self._waiting.remove(seq)
                self._maybe_complete(req)
                self.stats["aborted_requests"] += 1

    def _retract_all(self):
        """Moves running sequences back to the front of the queue; their KV cache is dropped and
        recomputed when they are admitted again."""
        with self._lock:
            running = sorted(self._running.values(), key=lambda s: s.slot)
            for seq in running:
                self._release(seq)
            self._waiting.extendleft(reversed(running))
            self.stats["retracted_sequences"] += len(running)

    def _fail_all(self, error: Exception):
        with self._lock:
            for req in list(self._requests.values()):
                if not req.future.done():
                    req.future.set_exception(error)
            self._requests.clear()
            self._waiting.clear()
            for seq in list(self._running.values()):
                self._release(seq)
