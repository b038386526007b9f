"""Continuous-batching inference engine with in-flight weight updates.

A scheduler thread repeats: apply control operations (weight swaps, aborts, pause/resume), admit
waiting requests into free slots and free pages of the paged KV cache (one prefill per prompt,
shared by its ``n`` samples, whose prompt pages are shared too), run one decode step for every
running sequence, and finish the sequences that stopped.

The KV cache is a pool of pages sized from a memory budget (``EngineConfig.kv_cache_bytes``,
like SGLang's ``--mem-fraction-static``; by default enough for every slot to reach
``max_seq_len``): a sequence holds pages for its live tokens only. Admission reserves pages for
the running sequences' completions at a decaying new-token ratio, and when the pool runs dry the
sequences with the fewest generated tokens are retracted to the front of the queue, keeping
their tokens, as in SGLang's scheduler (:class:`~rl_jax.generator.engine.scheduling.PageBudget`). A
request that could never fit (its prompt and ``max_new_tokens`` beyond ``max_seq_len`` or the
whole pool) is refused when submitted.

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

The scheduler keeps one decode step in flight while the next is queued, so the device never
waits for the host; control operations first finish the step in flight, so their effect is
observed at a step boundary. New weights are laid out for decode in a helper thread
(:class:`~rl_jax.generator.engine.weights.WeightPreparer`), off the decode path, and the ready
layout
is swapped in between two steps.

:class:`Engine` is the thread-safe front (submit, update, pause, abort) and the scheduler loop;
the settings are :mod:`~rl_jax.generator.engine.config`'s, the data path (admission, decode
steps, read-back) :mod:`~rl_jax.generator.engine.continuous_batching`'s, the state of every request
and
sequence and its moves :mod:`~rl_jax.generator.engine.bookkeeping`'s, the records, admission plan
and
KV page budget :mod:`~rl_jax.generator.engine.scheduling`'s, the weight checks
:mod:`~rl_jax.generator.engine.weights`', the device work :class:`ModelRunner`'s. All of them share
the
engine's one lock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from typing import Any

import numpy as np

from rl_jax.generator.engine.bookkeeping import Bookkeeper
from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.continuous_batching import ContinuousBatcher
from rl_jax.generator.engine.runner import ModelRunner
from rl_jax.generator.engine.scheduling import PageBudget, Replica, Request, Sequence
from rl_jax.generator.engine.weights import WeightPreparer, WeightsRefused, check_weights
from rl_jax.generator.types import (GenerateOutput, GenerateRequest, GeneratorError, Overloaded,
                                    SamplingParams)
from rl_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
_INT32 = np.iinfo(np.int32)


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
                                 page_size=engine_config.page_size, num_pages=num_pages,
                                 prefill_attention=engine_config.prefill_attention)
            self._replicas.append(Replica(i, runner, params))
        self._budget = PageBudget(self._replicas[0].runner,
                                  init_ratio=engine_config.init_new_token_ratio,
                                  min_ratio=engine_config.min_new_token_ratio,
                                  decay_steps=engine_config.new_token_ratio_decay_steps)
        self.version = version
        self._accepted_version = version  # the newest version handed to update_weights
        # the decode attention the replicas run: "native" (the CPU kernel), "pallas" or "xla"
        backends = {r.runner.attention_backend for r in self._replicas}
        self.attention_backend = backends.pop() if len(backends) == 1 else "xla"
        # the prefill attention for prompts of a fused kernel's block length (same on each)
        self.prefill_attention_backend = self._replicas[0].runner.prefill_attention_backend
        self.eos_token_ids = tuple(eos_token_ids)
        mutex = threading.RLock()
        self._lock = threading.Condition(mutex)  # the scheduler and callers wait on this
        self.stats = collections.Counter()
        self._book = Bookkeeper(self._replicas, self.eos_token_ids, self.stats)
        self._batcher = ContinuousBatcher(engine_config, self._replicas, self._book,
                                          self._budget, self._lock, self.stats)
        self._control: collections.deque = collections.deque()
        self._paused = False
        self._stop = False
        self._seed_counter = itertools.count(np.random.SeedSequence().entropy % (2 ** 31))
        self._preparer = WeightPreparer(self._replicas, mutex, self._lock, self.stats)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

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
        return self._book.running_count

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
        self._budget.check_fits(len(ids), sampling.max_new_tokens)
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
            if rid in self._book.requests:
                raise GeneratorError(f"request id {rid!r} is already running")
            if len(self._book.waiting) + sampling.n > self.engine_config.max_waiting:
                self.stats["refused_overloaded"] += 1
                raise Overloaded(f"{len(self._book.waiting)} sequences are waiting (limit "
                                 f"{self.engine_config.max_waiting}); retry later")
            base_seed = sampling.seed if sampling.seed is not None else next(self._seed_counter)
            req = Request(rid=rid, input_ids=[int(t) for t in ids], sampling=sampling,
                           future=future, start=time.perf_counter())
            req.sequences = [Sequence(req, i, int(base_seed) % (2 ** 31))
                             for i in range(sampling.n)]
            self._book.queue(req)
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
            self._preparer.offer(params, version)

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
            return {"running": self._running_count, "waiting": len(self._book.waiting),
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
            self._preparer.stop()
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

    # ---- scheduler ----------------------------------------------------------------------------

    def _loop(self):
        while True:
            with self._lock:
                while (not self._stop and not self._control and self._preparer.pending is None
                       and not self._batcher.inflight
                       and (self._paused or (not self._running_count
                                             and not self._book.waiting))):
                    self._lock.wait()
                if self._stop:
                    break
                controls = list(self._control)
                self._control.clear()
                weights = self._preparer.take()
            try:
                if controls:
                    self._batcher.drain()
                    for op in controls:
                        self._apply_control(op)
                if weights is not None:
                    self._swap_weights(*weights)
                if not self._paused:
                    self._batcher.admit(self.version)
                    if self._running_count:
                        self._batcher.decode_step(self.version)
                # One step stays in flight while decoding goes on: its tokens are read after
                # the next step is queued.
                keep = 1 if self._running_count and not self._paused else 0
                self._batcher.read_back(keep)
            except Exception as e:  # never leave callers hanging on a scheduler error
                log.exception("engine step failed")
                self._batcher.inflight.clear()
                self._fail_all(e)
        self._batcher.inflight.clear()
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
            result["ok"] = not self._running_count
            if result["ok"]:
                for replica in self._replicas:
                    replica.runner.reset_cache()
            done.set()

    def _swap_weights(self, params, version, prepared):
        """Swaps in ``prepared`` (per replica: its copy of ``params`` and their decode layout)."""
        start = time.perf_counter()
        if self.engine_config.recompute_kv_on_update:
            self._batcher.drain()
            self._retract_all()
        old = [(r.params, r.decode_weights) for r in self._replicas]
        for replica, (placed, weights) in zip(self._replicas, prepared):
            replica.params, replica.decode_weights = placed, weights
        with self._lock:
            self.version = version
            self._preparer.retire(old)  # deallocation is the helper thread's work
            self._lock.notify_all()
        del old, prepared
        self.stats["weight_updates"] += 1
        self.stats["weight_swap_ms"] += int((time.perf_counter() - start) * 1000)

    def _abort(self, rid: str | None):
        with self._lock:
            self._book.abort(rid)

    def _retract_all(self):
        """Moves running sequences back to the front of the queue (nothing may be in flight)."""
        with self._lock:
            self._book.retract_all()

    def _fail_all(self, error: Exception):
        with self._lock:
            self._book.fail_all(error)
