"""Continuous-batching inference engine with in-flight weight updates.

A scheduler thread repeats: apply control operations (weight swaps, aborts, pause/resume), admit
waiting requests into free slots and free pages of the paged KV cache (one prefill per prompt,
shared by its ``n`` samples, whose prompt pages are shared too), run one decode step for every
running sequence, and finish the sequences that stopped.

The KV cache is a pool of pages sized from a memory budget (``EngineConfig.kv_cache_bytes``,
like SGLang's ``--mem-fraction-static``; by default enough for every slot to reach
``max_seq_len``): a sequence holds pages for its live tokens only, taking one as it grows and
giving all back when it finishes. Admission follows SGLang's scheduler: a sequence is admitted
when the free pages cover its prompt plus a share (the *new-token ratio*) of the pages the
running and admitted sequences may still take for their completions; the ratio starts at
``init_new_token_ratio`` and decays towards ``min_new_token_ratio`` as decode steps run, so the
pool fills up. Before each decode step every running sequence gets the page its next tokens
need; when the pool runs dry, running sequences are retracted as SGLang's ``retract_decode``
does -- the one with the fewest generated tokens first (ties: the longest prompt) -- back to the
front of the queue, keeping their tokens (their KV is recomputed on re-admission), and the ratio
goes back to its initial value. A request that could never fit (its prompt and
``max_new_tokens`` beyond ``max_seq_len`` or the whole pool) is refused when submitted.

Weight updates (``update_weights``) take effect between two decode steps: running sequences keep
their KV cache and continue under the new weights (PipelineRL); every token records the version
of the weights that sampled it. ``pause(mode)`` follows SGLang's ``/pause_generation``:
``abort`` finishes everything with ``finish_reason.type == "abort"``; ``retract`` returns running
sequences to the queue (their KV is recomputed, under the then-current weights, when they are
re-admitted); ``in_place`` just stops stepping, keeping everything.

With several data-parallel replicas (``meshes``: one mesh per replica, e.g. one host device
each), every replica holds its own copy of the weights, its own KV cache and an equal share of
the slots; a sequence lives on one replica for its whole life, admissions go to the replica with
the most free slots, and each decode step is dispatched to every replica before any is awaited,
so one replica's matmuls run while another reads its cache (SGLang's ``--dp-size``).

The scheduler keeps the device busy: a decode step feeds each slot the token the previous step
sampled without the host in between, so step ``t+1`` is queued before the tokens of step ``t``
are read back and bookkept (one step in flight). A sequence that stops on a stop token is seen one
step late and that step's extra token for it is dropped; a sequence that reaches
``max_new_tokens`` gives up its slot as soon as its last token is queued. Control operations
first finish the step in flight, so their effect is observed at a step boundary. New weights are
laid out for decode (:meth:`ModelRunner.prepare`) in a helper thread, off the decode path, and
the ready layout is swapped in between two steps.

The records and the admission plan are :mod:`rl_jax.generator.scheduling`'s, the weight checks
:mod:`rl_jax.generator.weights`', the device work :class:`ModelRunner`'s. :class:`Engine` stays
one class: its thread-safe front (submit, update, pause, abort) and its scheduler loop (admit,
decode, read back, finish) share one lock-guarded state -- the queue, every replica's slots, the
steps in flight, the counters -- whose invariants (a sequence is waiting, in a slot or finished;
a slot is free or holds one sequence) each method keeps; split over classes, each half would
reach into the other's state.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import math
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from rl_jax.generator import kernels
from rl_jax.generator.kv_cache import (DEFAULT_PAGE_SIZE, SLOT_FIELDS, batch_bucket,
                                       pages_for)
from rl_jax.generator.runner import ModelRunner
from rl_jax.generator.sampling import unpack
from rl_jax.generator.scheduling import (InFlight, Replica, Request, Sequence, plan_admission,
                                         pow2_bucket, prefill_batch)
from rl_jax.generator.types import (GenerateOutput, GenerateRequest, GeneratorError, Overloaded,
                                    SamplingParams)
from rl_jax.generator.weights import WeightsRefused, check_weights
from rl_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
_INT32 = np.iinfo(np.int32)


class RequestFailed(RuntimeError):
    """The engine raised while serving one request: that request fails, the others go on."""


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
    # Decode steps run as one program, their tokens read back together (SGLang's
    # --num-continuous-decode-steps): the per-step host work and program launch are shared by
    # that many tokens, which is most of a step at small batches. A sequence that stops inside
    # such a run has its later tokens dropped (computed in vain), and admissions and weight
    # swaps wait for the run's end.
    decode_steps: int = 1
    # Decode attention: "auto" (on CPU the native kernel where it runs, on GPU the Pallas one
    # where it compiles, else XLA's), "native", "pallas" or "xla" (see rl_jax.generator.kernels
    # and ModelRunner).
    attention: str = "auto"
    # Positions per page of the paged KV cache (SGLang's --page-size).
    page_size: int = DEFAULT_PAGE_SIZE
    # Bytes of KV cache per data-parallel replica (the page pool: keys and values of every
    # layer); 0: enough for every slot to hold max_seq_len positions (max_slots × max_seq_len).
    kv_cache_bytes: int = 0
    # Admission reserves this share of the pages running sequences may still take (SGLang's
    # new-token ratio): it starts at init_new_token_ratio, decays to min_new_token_ratio over
    # new_token_ratio_decay_steps decode steps, and returns to the start when sequences had to
    # be retracted for want of pages.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600

    def __post_init__(self):
        if self.decode_steps < 1:
            raise GeneratorError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.page_size < 1:
            raise GeneratorError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_bytes < 0:
            raise GeneratorError(f"kv_cache_bytes must be >= 0 (0: max_slots x max_seq_len), "
                                 f"got {self.kv_cache_bytes}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise GeneratorError(
                f"need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        if self.new_token_ratio_decay_steps < 1:
            raise GeneratorError(f"new_token_ratio_decay_steps must be >= 1, got "
                                 f"{self.new_token_ratio_decay_steps}")
        if self.attention not in kernels.BACKENDS:
            raise GeneratorError(f"attention must be one of {kernels.BACKENDS}, got "
                                 f"{self.attention!r}")


class Engine:
    """Serves :class:`GenerateRequest`s from a background thread.

    Args:
      config: model shape.
      params: parameters (nested dict as the trainer holds them), already placed for ``mesh``.
      version: integer version of ``params`` (optimizer steps).
      eos_token_ids: tokens that end a sequence unless ``ignore_eos``.
      mesh: the mesh ``params`` are placed for (None: one device).
      meshes: instead of ``mesh``, one mesh per data-parallel replica, over disjoint devices;
        ``params`` are placed for ``meshes[0]`` and copied to the others, and each replica gets
        ``max_slots / len(meshes)`` slots.
    """

    def __init__(self, config: ModelConfig, params: dict[str, Any], *, version: int = 0,
                 engine_config: EngineConfig = EngineConfig(), mesh=None, meshes=None,
                 rules=None, dtype=None, eos_token_ids: tuple[int, ...] = ()):
        import jax.numpy as jnp
        if meshes is not None and mesh is not None:
            raise GeneratorError("give the engine either mesh or meshes (one per replica), "
                                 "not both")
        meshes = list(meshes) if meshes is not None else [mesh]
        if not meshes or (len(meshes) > 1 and any(m is None for m in meshes)):
            raise GeneratorError("data-parallel replicas need one mesh each")
        if engine_config.max_slots % len(meshes):
            raise GeneratorError(f"max_slots={engine_config.max_slots} does not split evenly "
                                 f"over {len(meshes)} data-parallel replicas")
        if len(meshes) > 1:
            used = [d for m in meshes for d in m.devices.flat]
            if len(set(used)) != len(used):
                raise GeneratorError("the data-parallel replicas' meshes share devices")
        self.config = config
        self.engine_config = engine_config
        self._replicas: list[Replica] = []
        num_pages = None
        if engine_config.kv_cache_bytes:
            page = ModelRunner.page_bytes(config, engine_config.page_size, dtype or jnp.float32)
            num_pages = engine_config.kv_cache_bytes // page
            if num_pages < 1:
                raise GeneratorError(
                    f"kv_cache_bytes={engine_config.kv_cache_bytes} holds no KV-cache page "
                    f"(one page of {engine_config.page_size} positions takes {page} bytes)")
        for i, m in enumerate(meshes):
            runner = ModelRunner(config, max_slots=engine_config.max_slots // len(meshes),
                                 max_seq_len=engine_config.max_seq_len, mesh=m, rules=rules,
                                 dtype=dtype or jnp.float32, attention=engine_config.attention,
                                 page_size=engine_config.page_size, num_pages=num_pages)
            self._replicas.append(Replica(i, runner, params))
        self._new_token_ratio = engine_config.init_new_token_ratio
        self.version = version
        self._accepted_version = version  # the newest version handed to update_weights
        # the decode attention the replicas run: "native" (the CPU kernel), "pallas" or "xla"
        backends = {r.runner.attention_backend for r in self._replicas}
        self.attention_backend = backends.pop() if len(backends) == 1 else "xla"
        self.eos_token_ids = tuple(eos_token_ids)
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)  # the scheduler and callers wait on this
        self._helper_wake = threading.Condition(mutex)  # the weight helper waits on this
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._requests: dict[str, Request] = {}
        self._inflight: collections.deque[InFlight] = collections.deque()
        self._to_prepare: list[tuple[dict[str, Any], int]] = []
        self._retired: list[Any] = []  # replaced weights, released by the helper thread
        # (params, version, [(replica params, decode weights)] per replica), ready to swap in.
        self._pending_weights: tuple[dict[str, Any], int, list] | None = None
        self._control: collections.deque = collections.deque()
        self._paused = False
        self._stop = False
        self._seed_counter = itertools.count(np.random.SeedSequence().entropy % (2 ** 31))
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        self._preparer = threading.Thread(target=self._prepare_loop, name="engine-weights",
                                          daemon=True)
        self._preparer.start()

    @property
    def runner(self) -> ModelRunner:
        """The first replica's runner (the only one without data parallelism)."""
        return self._replicas[0].runner

    @property
    def params(self) -> dict[str, Any]:
        """The parameters in use, placed as given (for the first replica's mesh)."""
        return self._replicas[0].params

    @property
    def runners(self) -> list[ModelRunner]:
        """One runner per data-parallel replica."""
        return [r.runner for r in self._replicas]

    def decode_weights(self) -> list[dict[str, Any]]:
        """Each replica's decode weights (what its runner's decode programs take)."""
        return [r.decode_weights for r in self._replicas]

    @property
    def data_parallel(self) -> int:
        return len(self._replicas)

    @property
    def _running_count(self) -> int:
        return sum(len(r.running) for r in self._replicas)

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
        runner = self.runner
        need = pages_for(len(ids) + sampling.max_new_tokens - 1, runner.page_size)
        if need > runner.num_pages:
            raise GeneratorError(
                f"prompt of {len(ids)} tokens + max_new_tokens={sampling.max_new_tokens} needs "
                f"{need} KV-cache pages of {runner.page_size} tokens, more than the whole cache "
                f"holds ({runner.num_pages} pages, kv_cache_bytes={runner.cache_bytes}; "
                f"{runner.num_pages * runner.page_size} tokens)")
        if sampling.n > self.engine_config.max_waiting:
            raise GeneratorError(f"n={sampling.n} samples can never be queued (the engine "
                                 f"holds at most {self.engine_config.max_waiting} waiting)")
        self._check_sampling(sampling)
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
            if len(self._waiting) + sampling.n > self.engine_config.max_waiting:
                self.stats["refused_overloaded"] += 1
                raise Overloaded(f"{len(self._waiting)} sequences are waiting (limit "
                                 f"{self.engine_config.max_waiting}); retry later")
            base_seed = sampling.seed if sampling.seed is not None else next(self._seed_counter)
            req = Request(rid=rid, input_ids=[int(t) for t in ids], sampling=sampling,
                           future=future, start=time.perf_counter())
            req.sequences = [Sequence(req, i, int(base_seed) % (2 ** 31))
                             for i in range(sampling.n)]
            self._requests[rid] = req
            self._waiting.extend(req.sequences)
            self._lock.notify_all()
        return future

    def _check_sampling(self, sampling: SamplingParams):
        """Refuses sampling values the per-slot state cannot hold (``runner.SLOT_FIELDS``)."""
        if not _INT32.min <= sampling.top_k <= _INT32.max:
            raise GeneratorError(f"top_k must fit in int32, got {sampling.top_k}")

    def generate(self, request: GenerateRequest, timeout: float | None = None
                 ) -> list[GenerateOutput]:
        return self.submit(request).result(timeout)

    def update_weights(self, params: dict[str, Any], version: int, *,
                       allow_older: bool = False, finite_checked: bool = False):
        """Swaps in ``params`` between two decode steps (running sequences continue).

        Checks them first, here, for every path new weights take (disk, transfer, SGLang's
        distributed protocol): :func:`check_weights` (tree, shapes, floating dtypes, finite
        values) and the version, which may not go below the newest one accepted unless
        ``allow_older``. Refused weights raise :class:`WeightsRefused` and change nothing.
        ``finite_checked``: the caller already found every value finite on the very bytes of
        ``params`` (the weight puller does, while it verifies their digests:
        ``WeightUpdate.finite_checked``), so the device-side pass over them is skipped.

        Returns once checked: a helper thread lays the weights out for decode (the running
        batch keeps decoding meanwhile), then the scheduler swaps them in before its next step;
        :attr:`version` (and :attr:`params`) change then. A newer update given before an older
        one was swapped in supersedes it.
        """
        version = int(version)
        with self._lock:
            newest = self._accepted_version
        if version < newest and not allow_older:
            raise WeightsRefused(f"weight version {version} is older than version {newest} "
                                 f"(already accepted); set allow_older to go back on purpose")
        start = time.perf_counter()
        check_weights(params, self.params, finite=not finite_checked)
        self.stats["weight_check_ms"] += int((time.perf_counter() - start) * 1000)
        with self._lock:
            if not self.alive:
                raise RuntimeError("the engine's scheduler is not running (shut down or "
                                   "crashed); the weights were not applied")
            if version < self._accepted_version and not allow_older:
                raise WeightsRefused(f"weight version {version} is older than version "
                                     f"{self._accepted_version} (accepted meanwhile)")
            self._accepted_version = version
            self._to_prepare.append((params, version))
            self._helper_wake.notify_all()

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
            return {"running": self._running_count, "waiting": len(self._waiting),
                    "free_slots": sum(len(r.free_slots) for r in self._replicas)}

    def cache_usage(self) -> dict[str, int]:
        """The KV cache over all replicas: its pages, the free ones, positions per page and
        bytes."""
        with self._lock:
            runners = self.runners
            return {"pages": sum(r.num_pages for r in runners),
                    "free_pages": sum(r.pages.free_pages for r in runners),
                    "page_size": runners[0].page_size,
                    "bytes": sum(r.cache_bytes for r in runners)}

    def shutdown(self):
        with self._lock:
            self._stop = True
            self._lock.notify_all()
            self._helper_wake.notify_all()
        self._thread.join(timeout=30)
        self._preparer.join(timeout=30)

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

    # ---- weight preparation (helper thread) ---------------------------------------------------

    def _prepare_loop(self):
        while True:
            with self._lock:
                while not self._stop and not self._to_prepare and not self._retired:
                    self._helper_wake.wait()
                if self._stop:
                    return
                retired, self._retired = self._retired, []
                job = self._to_prepare[-1] if self._to_prepare else None  # newest supersedes
                self._to_prepare.clear()
            del retired  # frees replaced weights here, outside the lock and the scheduler
            if job is None:
                continue
            params, version = job
            start = time.perf_counter()
            try:
                prepared = []
                for replica in self._replicas:
                    placed = replica.place(params)
                    prepared.append((placed, replica.runner.prepare(placed)))
                jax.block_until_ready(prepared)
            except Exception:  # keep serving with the current weights
                log.exception("laying out weights version %d for decode failed", version)
                self.stats["weight_update_errors"] += 1
                continue
            self.stats["weight_prepare_ms"] += int((time.perf_counter() - start) * 1000)
            with self._lock:
                self._pending_weights = (params, version, prepared)
                self._lock.notify_all()

    # ---- scheduler ----------------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._lock:
                while (not self._stop and not self._control and self._pending_weights is None
                       and not self._inflight
                       and (self._paused or (not self._running_count and not self._waiting))):
                    self._lock.wait()
                if self._stop:
                    break
                controls = list(self._control)
                self._control.clear()
                weights, self._pending_weights = self._pending_weights, None
            try:
                if controls:
                    self._drain()
                    for op in controls:
                        self._apply_control(op)
                if weights is not None:
                    self._swap_weights(*weights)
                if not self._paused:
                    self._admit()
                    if self._running_count:
                        self._decode_step()
                # One step stays in flight while decoding goes on: its tokens are read after
                # the next step is queued.
                keep = 1 if self._running_count and not self._paused else 0
                while len(self._inflight) > keep:
                    self._process(self._inflight.popleft())
            except Exception as e:  # never leave callers hanging on a scheduler error
                log.exception("engine step failed")
                self._inflight.clear()
                self._fail_all(e)
        self._inflight.clear()
        self._fail_all(RuntimeError("engine shut down"))

    def _drain(self):
        """Reads back and bookkeeps every step in flight."""
        while self._inflight:
            self._process(self._inflight.popleft())

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
            result["ok"] = not self._running_count
            if result["ok"]:
                for replica in self._replicas:
                    replica.runner.reset_cache()
            done.set()

    def _swap_weights(self, params, version, prepared):
        """Swaps in ``prepared`` (per replica: its copy of ``params`` and their decode layout)."""
        start = time.perf_counter()
        if self.engine_config.recompute_kv_on_update:
            self._drain()
            self._retract_all()
        old = [(r.params, r.decode_weights) for r in self._replicas]
        for replica, (placed, weights) in zip(self._replicas, prepared):
            replica.params, replica.decode_weights = placed, weights
        with self._lock:
            self.version = version
            self._retired.append(old)  # deallocation is the helper thread's work
            self._lock.notify_all()
            self._helper_wake.notify_all()
        del old, prepared
        self.stats["weight_updates"] += 1
        self.stats["weight_swap_ms"] += int((time.perf_counter() - start) * 1000)

    def _admit(self):
        """Prefills waiting sequences into free slots (fresh samples of one prompt waiting
        together share a prefill on one replica; a new prefill goes to the replica with the most
        free slots) and queues the sampling of their first tokens."""
        budget = self.engine_config.max_prefill_tokens
        free = [len(r.free_slots) for r in self._replicas]
        with self._lock:
            pages = [r.runner.pages.free_pages - self._reserved_pages(r)
                     for r in self._replicas]
            groups = plan_admission(self._waiting, free, budget, pages, self._admission_pages)
        if not groups:
            return
        parts = []
        for replica in self._replicas:
            mine = [g for r, g in groups if r == replica.index]
            if mine:
                parts.extend(self._admit_isolated(replica, mine))
        if parts:
            self._inflight.append(InFlight(parts, self.version))
        self._release_fully_dispatched([seq for _, group in groups for seq in group
                                        if seq.finish_reason is None])

    def _future_pages(self, seq: Sequence, held: int) -> int:
        """Pages ``seq`` may still take beyond the ``held`` ones, reserved at the current
        new-token ratio."""
        size = self._replicas[0].runner.page_size
        future = pages_for(seq.horizon - 1, size) - held
        return math.ceil(future * self._new_token_ratio) if future > 0 else 0

    def _reserved_pages(self, replica: Replica) -> int:
        """Pages a replica's running sequences may still take, at the new-token ratio."""
        held = replica.runner.pages.held
        return sum(self._future_pages(seq, int(held[slot]))
                   for slot, seq in replica.running.items())

    def _admission_pages(self, seq: Sequence, joins: bool) -> int:
        """Free pages admitting ``seq`` takes (``plan_admission``'s ``page_cost``): its prompt's
        pages (when it joins the prefill before it, only its own copy of the prompt's last,
        partly filled page), plus its reserve for its completion."""
        size = self._replicas[0].runner.page_size
        prefill = seq.prompt_len + max(len(seq.output_ids) - 1, 0)
        own = int(prefill % size != 0) if joins else pages_for(prefill, size)
        return own + self._future_pages(seq, pages_for(prefill, size))

    def _admit_isolated(self, replica: Replica, groups: list[list[Sequence]]) -> list:
        """:meth:`_admit_to`, with a failure kept to the request that causes it: the admission
        is undone and retried one prefill group at a time, then one request at a time; a
        request that still fails alone gets the error, the others are admitted as usual (with
        the same tokens: sampling depends on seeds, not on batch composition)."""
        try:
            return [self._admit_to(replica, groups)]
        except Exception as e:
            self._undo_admission([seq for group in groups for seq in group])
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
            self._fail_request(request, RequestFailed(
                f"request {request.rid} failed in the engine: {type(e).__name__}: {e}"))
            return []

    def _undo_admission(self, seqs: list[Sequence]):
        """Returns sequences whose admission raised to their state before it (no slot)."""
        with self._lock:
            for seq in seqs:
                self._release(seq)
                seq.dispatched = len(seq.output_ids)
                seq.cached_tokens = 0

    def _fail_request(self, req: Request, error: Exception):
        """Finishes every sequence of ``req`` and resolves its future with ``error``."""
        with self._lock:
            for seq in req.sequences:
                if seq.finish_reason is None:
                    seq.finish_reason = {"type": "abort", "message": str(error)}
                self._release(seq)
                if seq in self._waiting:
                    self._waiting.remove(seq)
            self._requests.pop(req.rid, None)
            if not req.future.done():
                req.future.set_exception(error)

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
        with self._lock:
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

    def _compact(self, replica: Replica):
        """Moves the sequences of a replica's highest slots into free lower ones when the running
        sequences would then fit a smaller decode batch (a long sample left alone in slot 40
        would otherwise be decoded in a batch of 64)."""
        slots, running = replica.runner.max_slots, replica.running
        target = batch_bucket(len(running), slots)
        if batch_bucket(max(running) + 1, slots) <= target:
            return
        with self._lock:
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

    def _decode_step(self):
        """Queues one decode step of every running sequence (slots ``0..batch-1`` of each
        replica), every replica's step before any is awaited; ``decode_steps`` of them in one
        program."""
        steps = self.engine_config.decode_steps
        cfg = self.engine_config
        self._new_token_ratio = max(cfg.min_new_token_ratio, self._new_token_ratio - steps * (
            cfg.init_new_token_ratio - cfg.min_new_token_ratio) / cfg.new_token_ratio_decay_steps)
        parts = []
        for replica in self._replicas:
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
        self._inflight.append(InFlight(parts, self.version))
        self.stats["decode_steps"] += steps
        self.stats["decode_dispatches"] += 1
        self._release_fully_dispatched([seq for _, seqs, _ in parts for seq in seqs])

    def _grow_all(self, replica: Replica) -> Sequence | None:
        """Gives every running sequence of ``replica`` the pages of the positions its next
        ``decode_steps`` steps write; the first sequence that cannot get them, or None."""
        steps = self.engine_config.decode_steps
        table = replica.runner.pages
        for slot, seq in sorted(replica.running.items()):
            # Positions up to prompt + dispatched + steps - 2 are written; none past the last
            # one its completion can have (later steps of a multi-step run are dropped).
            if not table.grow(slot, min(seq.prompt_len + seq.dispatched + steps - 1,
                                        seq.horizon - 1)):
                return seq
        return None

    def _give_pages(self, replica: Replica):
        """Before a decode step: every running sequence of ``replica`` gets its next pages.
        When the pool runs dry, the steps in flight are read back (finished sequences give
        their pages back), then running sequences are retracted to the front of the queue as
        SGLang's ``retract_decode`` does: fewest generated tokens first, ties the longest
        prompt (their tokens kept, their KV recomputed on re-admission); the new-token ratio
        returns to its initial value. A sequence that cannot grow alone fails its request."""
        with self._lock:
            if self._grow_all(replica) is None:
                return
        self._drain()
        retracted = 0
        while True:
            with self._lock:
                stuck = self._grow_all(replica)
                if stuck is None:
                    break
                if len(replica.running) == 1:
                    request = stuck.request
                else:
                    victim = min(replica.running.values(),
                                 key=lambda s: (len(s.output_ids), -s.prompt_len, -s.slot))
                    self._release(victim)
                    victim.dispatched = len(victim.output_ids)
                    self._waiting.appendleft(victim)
                    retracted += 1
                    continue
            self._fail_request(request, RequestFailed(
                f"request {request.rid} does not fit the KV cache alone "
                f"({replica.runner.num_pages} pages of {replica.runner.page_size} tokens)"))
            break
        if retracted:
            self._new_token_ratio = self.engine_config.init_new_token_ratio
            self.stats["retracted_sequences"] += retracted
            self.stats["kv_cache_full"] += 1
            log.warning("KV cache full (%d pages of %d tokens): retracted %d sequences",
                        replica.runner.num_pages, replica.runner.page_size, retracted)

    def _release_fully_dispatched(self, seqs: list[Sequence]):
        """Frees the slots of sequences whose last token is queued: a later step would only
        compute tokens past ``max_new_tokens`` (the queued work still completes first)."""
        done = [s for s in seqs if s.dispatched >= s.max_new_tokens]
        if done:
            with self._lock:
                for seq in done:
                    self._release(seq)

    def _process(self, work: InFlight):
        """Appends the tokens of one finished step to their sequences, finishing those that
        stop."""
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
        if finished:
            with self._lock:
                for seq in finished:
                    self._release(seq)
                for seq in finished:
                    self._maybe_complete(seq.request)

    def _release(self, seq: Sequence):
        if seq.slot >= 0:
            replica = self._replicas[seq.replica]
            replica.running.pop(seq.slot, None)
            replica.runner.pages.release(seq.slot)
            heapq.heappush(replica.free_slots, seq.slot)
            seq.slot = seq.replica = -1

    def _maybe_complete(self, req: Request):
        if any(s.finish_reason is None for s in req.sequences):
            return
        self._requests.pop(req.rid, None)
        latency = time.perf_counter() - req.start
        outputs = [GenerateOutput(
            rid=req.rid if req.sampling.n == 1 else f"{req.rid}-{s.index}",
            input_ids=list(req.input_ids), output_ids=s.output_ids, output_logprobs=s.logprobs,
            output_unfiltered_logprobs=s.unfiltered_logprobs if s.filtered else None,
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
        recomputed when they are admitted again. Nothing may be in flight."""
        with self._lock:
            running = sorted((s for r in self._replicas for s in r.running.values()),
                             key=lambda s: (s.slot, s.replica))
            for seq in running:
                self._release(seq)
                seq.dispatched = len(seq.output_ids)
            self._waiting.extendleft(reversed(running))
            self.stats["retracted_sequences"] += len(running)

    def _fail_all(self, error: Exception):
        with self._lock:
            for req in list(self._requests.values()):
                if not req.future.done():
                    req.future.set_exception(error)
            self._requests.clear()
            self._waiting.clear()
            for replica in self._replicas:
                for seq in list(replica.running.values()):
                    self._release(seq)
