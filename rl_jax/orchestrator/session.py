"""One RL run from start (or resume) to export: see :mod:`rl_jax.orchestrator.rl`.

:class:`Session` drives the train loop; its setup steps are in
:mod:`rl_jax.orchestrator.setup` and its records, summary and plot in
:mod:`rl_jax.orchestrator.accounting`."""

from __future__ import annotations

import collections
import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from rl_jax import compile_cache, cpus, heap
from rl_jax.generator.client import GeneratorUnavailable
from rl_jax.models.config import eos_ids
from rl_jax.losses import finalize_metrics
from rl_jax.metrics import MetricsWriter
from rl_jax.models.config import DTYPES
from rl_jax.orchestrator.accounting import (LOSS_METRICS, Clock, RunAccounting, Window,
                                            tb_scalars, tensorboard)
from rl_jax.orchestrator.config import ModeSettings
from rl_jax.orchestrator.evaluation import EvalResult, evaluate
from rl_jax.orchestrator.policy import INT_FIELDS, POLICY_FIELDS, PolicyBatch
from rl_jax.orchestrator.setup import Codec, SessionSetup, prompt_source
from rl_jax.orchestrator.snapshots import SnapshotWriter
from rl_jax.recipe import RLRecipe
from rl_jax.trainer.state import ema_decay_at, ema_update, learning_rate_at, set_learning_rate
from rl_jax.trainer.step import StreamingTrainStep, global_batch

__all__ = ["Codec", "Session", "prompt_source"]

log = logging.getLogger(__name__)


class Session(SessionSetup, RunAccounting):
    """Builds every role of a run, drives the loop, and shuts everything down."""

    def __init__(self, c: RLRecipe, settings: ModeSettings, workdir: Path,
                 base_dir: Path):
        self.c, self.settings, self.workdir, self.base_dir = c, settings, workdir, base_dir
        self._closers: list[Any] = []
        self.rollout = None
        self.summary: dict[str, Any] = {}
        self.first_step_s: float | None = None  # seconds from launch to the first step's end
        # JAX's persistent compilation cache, for this process and the servers it starts
        # (rl_jax.compile_cache): a later run of the recipe loads its programs.
        self.compilation_cache_dir = compile_cache.resolve(c.compilation_cache_dir)
        compile_cache.enable(self.compilation_cache_dir)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception as e:  # shutting down: report, keep closing the rest
                log.warning("shutdown step failed: %s", e)

    def score_until(self) -> tuple[int, ...]:
        """Token ids that end a completion for scoring (the model's end-of-sequence ids)."""
        return eos_ids(self.model_config)

    # ---- evaluation -----------------------------------------------------------------------------

    def _evaluate(self, tag: str, background: bool = False):
        """Held-out evaluation. A ``background`` one (periodic, while the rollout goes on)
        keeps at most ``eval.concurrency`` requests on the servers, so that it does not take the
        slots the rollout's next batches need; the others (before and after the run, when
        nothing else generates) use every slot."""
        slots = self.c.generator.max_slots * max(len(self.fleet.members), 1)
        concurrency = self.c.eval.concurrency if background else slots
        return evaluate(self.control, self.env, self.eval_prompts, encode=self.codec.encode,
                        decode=self.codec.decode, max_new_tokens=self.c.eval.max_new_tokens,
                        tag=tag, concurrency=concurrency)
    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.c
        self._setup_model()
        self.primary = jax.process_index() == 0
        if self.primary:  # the other trainer processes only train (batches are broadcast)
            self._start_generators()  # their start-up overlaps the trainer's
        self._setup_trainer()
        if self.primary:
            self._setup_generators()
            self._setup_rollout()
        writer = MetricsWriter(self.workdir)
        tb = tensorboard(self.workdir / "tb") if c.logging.tensorboard else None
        if tb is not None:
            self._closers.append(tb.close)

        before = math.nan
        if "eval_before" in self.meta:
            before = float(self.meta["eval_before"])
        elif self.primary and self.eval_prompts:
            result = self.control_loop.run(self._evaluate("eval-before"))
            before = result.accuracy
            writer.write(int(self.state.step), wall_s=0.0, **result.metrics())
        if self.primary:
            print(f"policy {self.n_params / 1e6:.2f}M parameters, mode {self.settings.mode}, "
                  f"max_lag {self.settings.max_lag}, {len(self.fleet.members)} generator "
                  f"server(s); held-out accuracy before RL: {before:.3f}", flush=True)

        # Setup's objects out of the garbage collector: a full collection over them pauses the
        # loop (rl_jax.heap); the monitor counts the loop's own collections. Done before the
        # clock starts and before the rollout sends its first request: the collection itself
        # holds the GIL.
        heap.freeze_long_lived()
        self.gc = heap.GcMonitor().install()
        self._closers.append(self.gc.uninstall)
        cpu_before = (cpus.thread_cpu_seconds(), self._generator_readings()) if self.primary \
            else None
        wall_offset = float(self.meta.get("wall_s", 0.0))
        totals = collections.Counter({k: float(v) for k, v in
                                      self.meta.get("totals", {}).items()})
        clock = Clock()
        pending_eval: tuple[int, Any] | None = None
        last_eval: EvalResult | None = None
        start_iter = int(self.state.step) + int(self.state.skipped)
        bar = tqdm(total=c.trainer.steps, initial=start_iter, desc=f"rl {self.settings.mode}",
                   unit="step", dynamic_ncols=True, disable=not self.primary)
        window = Window(self.rollout.metrics()) if self.primary else None
        # The next batch is taken from the rollout and packed in a background thread while the
        # current one trains (the gate reckons its staleness against the version that will
        # train it), so the train step does not wait for host work between two steps.
        prefetcher = None
        if self.primary:
            prefetcher = _Prefetcher(self._next_batch,
                                     inline=not c.trainer.prefetch)
            self._closers.append(prefetcher.close)
            if start_iter < c.trainer.steps:
                prefetcher.request()
        self.snapshots = None
        if self.primary and c.export.every:
            self.snapshots = SnapshotWriter(self.workdir, self.spec, tokenizer=self.tokenizer,
                                            dtype=DTYPES[c.export.dtype], every=c.export.every)
            self._closers.append(self.snapshots.close)
        if self.primary and c.cpus.rollout:
            self._pin_host_threads(c.cpus.rollout)
        log_step = None  # the previous step's logging, done while this step trains
        for i in range(start_iter, c.trainer.steps):
            t0, cpu0 = time.perf_counter(), time.process_time()
            groups, host, staleness, packing = None, None, [], 0.0
            stop = bool(c.trainer.time_limit_s and clock.elapsed > c.trainer.time_limit_s)
            if self.primary and not stop:
                groups, host, staleness, packing = prefetcher.get()
                if i + 1 < c.trainer.steps:
                    prefetcher.request()
            host, stop = self._share_batch(host, stop)
            if stop:
                log.warning("time limit of %.0f s reached after %d steps",
                            c.trainer.time_limit_s, i)
                break
            t1, cpu1 = time.perf_counter(), time.process_time()
            learning_rate = self._learning_rate(i, wall_offset + clock.elapsed)
            batch = PolicyBatch.from_numpy(host)
            if not isinstance(self.train_step, StreamingTrainStep):
                batch = global_batch(batch, self.batch_sharding)
            self.state, metrics = self.train_step(self.state, batch)  # dispatched: runs on
            if log_step is not None:  # XLA's threads while this one logs the previous step
                log_step()
                log_step = None
            metrics = finalize_metrics({k: float(v) for k, v in jax.device_get(metrics).items()})
            if i == start_iter:
                self.first_step_s = cpus.seconds_since_start()
                if self.primary:
                    bar.write(f"first step {self.first_step_s:.1f} s after launch")
            version = int(self.state.step)
            if self.ema is not None:
                self.ema = ema_update(self.ema, self.state.params, jnp.float32(
                    ema_decay_at(self.ema_decay, self.ema_updates)))
                self.ema_updates += 1
            t2 = time.perf_counter()
            published = self._publish(version)
            if published is not None and self.snapshots is not None \
                    and self.snapshots.due(version):
                self.snapshots.submit(published, version=version, step=i + 1,
                                      wall_s=wall_offset + clock.elapsed)
            delay = c.trainer.step_delay_s
            if delay:
                time.sleep(delay)
            t3, cpu3 = time.perf_counter(), time.process_time()
            if self.primary and self.settings.wait_for_update:
                self.weights.wait_applied(version)
            t4, cpu4 = time.perf_counter(), time.process_time()
            clock.waiting_s += t1 - t0
            clock.training_s += t2 - t1
            clock.publishing_s += t3 - t2
            clock.syncing_s += t4 - t3
            clock.idle_cpu_s += (cpu1 - cpu0) + (cpu4 - cpu3)
            trained = float(np.sum(host["segment_ids"] > 0))
            totals["trained_tokens"] += trained
            done = i + 1
            meta = {"eval_before": before, "wall_s": wall_offset + clock.elapsed,
                    "totals": dict(totals)}
            if self.primary:
                totals["completion_tokens"] += host["metrics"]["tokens/completion"]
                totals["samples"] += len(host["rewards"])
                meta["rollout"] = self.rollout.get_state()
                if pending_eval is not None and pending_eval[1].done():
                    try:
                        result = pending_eval[1].result()
                    except GeneratorUnavailable as e:  # a periodic eval is not worth the run
                        log.warning("held-out evaluation of step %d skipped: %s",
                                    pending_eval[0], e)
                        result = None
                    pending_eval = None
                    if result is not None:
                        last_eval = result
                        writer.write(done, wall_s=wall_offset + clock.elapsed,
                                     **last_eval.metrics())
                        if tb is not None:
                            tb_scalars(tb, last_eval.metrics(), done)
                if c.eval.every and done % c.eval.every == 0 and done < c.trainer.steps and \
                        pending_eval is None and self.eval_prompts:
                    pending_eval = (done,
                                    self.control_loop.submit(
                                        self._evaluate(f"eval-{done}", background=True)))
                correct = np.mean([bool(s.info.get("correct")) for g in groups
                                   for s in g.samples])
                record = {
                    "wall_s": wall_offset + clock.elapsed, "version": version,
                    "reward/mean": host["metrics"]["reward/mean"],
                    "reward/std": host["metrics"]["reward/std"],
                    "rollout/accuracy": float(correct),
                    "groups/zero_signal": host["metrics"]["groups/zero_signal"],
                    # Which prompts (stream positions) the step trained on.
                    "rollout/prompts": [int(x) for x in host["metrics"]["positions"]],
                    "staleness/batch_max": float(max(staleness)),
                    "staleness/batch_mean": float(np.mean(staleness)),
                    "learning_rate": learning_rate,
                    "trainer/step_s": t2 - t1, "trainer/wait_s": t1 - t0,
                    "trainer/pack_s": packing,
                    "trainer/tokens_per_s": trained / max(t2 - t1, 1e-9),
                    "weights/publish_s": t3 - t2,
                    **{f"loss/{k}": v for k, v in metrics.items() if k in LOSS_METRICS},
                }
                if done % c.logging.every == 0 or done == c.trainer.steps:
                    record.update(window.take(self.rollout.metrics(), self.sampler.take(), clock))
                    record.update(self.weights.metrics())
                    record["generator/restarts"] = float(sum(self.pool.restarts.values()))
                log_step = functools.partial(self._log_step, writer, tb, bar, done, record,
                                             staleness, last_eval)
            else:
                bar.update(1)
            final = done == c.trainer.steps
            if log_step is not None and (final or self.checkpointer.should_save(done)):
                log_step()  # a checkpointed step has its record: a resumed run starts after it
                log_step = None
            self.checkpointer.save(done, self.state, meta, force=final)
        if log_step is not None:
            log_step()
        bar.close()
        return self._finish(writer, tb, before, clock, wall_offset, totals, pending_eval,
                            cpu_before)

    def _learning_rate(self, step: int, wall_s: float) -> float:
        """The learning rate of update ``step`` (0-based), set into the optimizer state when the
        schedule runs on the run's progress: the larger of the steps done and the wall time
        used, each over its limit, so a run stopped by its time limit ends its decay then."""
        opt, c = self.optimizer_config, self.c
        if opt.schedule_on != "progress":
            return float(self.schedule(step))
        progress = step / c.trainer.steps
        if c.trainer.time_limit_s:
            progress = max(progress, wall_s / c.trainer.time_limit_s)
        if jax.process_count() > 1:  # every process steps with process 0's clock
            from jax.experimental import multihost_utils
            progress = float(multihost_utils.broadcast_one_to_all(np.float32(progress)))
        learning_rate = learning_rate_at(opt, step, progress)
        self.state = self.state.replace(
            opt_state=set_learning_rate(self.state.opt_state, learning_rate))
        return learning_rate

    def _next_batch(self) -> tuple[list, dict[str, Any], list[int], float]:
        """The rollout's next batch, packed: ``(groups, host batch, per-sample staleness,
        packing seconds)``."""
        groups = next(self.rollout)
        start = time.perf_counter()
        host = self.to_batch(groups)
        return groups, host, self.rollout.staleness(groups), time.perf_counter() - start

    def _pin_host_threads(self, cores: str):
        """Moves this process's Python threads other than the main one (the rollout client,
        generator control and evaluation, weight sync, the publisher's control server) to
        ``cores``: the trainer's cores are left to the train step and the loop itself. XLA's
        own threads are not Python threads and stay where they are."""
        self.rollout.start()
        threads = [t for t in threading.enumerate()
                   if t is not threading.main_thread() and t.native_id is not None]
        pinned = cpus.pin_threads(cores, [t.native_id for t in threads])
        log.info("host threads %s pinned to cores %s", sorted(t.name for t in threads),
                 sorted(pinned))

    def _share_batch(self, host: dict | None, stop: bool) -> tuple[dict | None, bool]:
        """Multi-process runs: process 0's batch (and its decision to stop) to every process."""
        if jax.process_count() == 1:
            return host, stop
        from jax.experimental import multihost_utils
        rows = 0 if host is None else host["tokens"].shape[0]
        header = multihost_utils.broadcast_one_to_all(np.asarray([int(stop), rows], np.int32))
        if int(header[0]):
            return None, True
        shape = (int(header[1]), int(self.c.rollout.seq_len))
        arrays = {k: np.asarray(host[k]) if self.primary else
                  np.zeros(shape, np.int32 if k in INT_FIELDS else np.float32)
                  for k in POLICY_FIELDS}
        shared = multihost_utils.broadcast_one_to_all(arrays)
        merged = dict(host) if self.primary else {}
        merged.update({k: np.asarray(v) for k, v in shared.items()})
        return merged, False

    def _publish(self, version: int, params: Any = None) -> Any:
        """The new version to the generators (process 0; in a multi-process run every process
        takes part in gathering the parameters); returns the parameters published (None if
        nothing was). ``params``: other parameters than the train state's (the final average),
        published after the rollout ended."""
        if self.primary:
            if params is None:
                self.rollout.set_trainer_version(version)
            if version == self.weights.published:
                return None
        params = self.state.params if params is None else params
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            params = multihost_utils.process_allgather(params, tiled=True)
            if not self.primary:
                return None
            params = jax.device_put(params, jax.local_devices()[0])
        self.weights.publish(params, version)
        return params

class _Prefetcher:
    """Runs ``fetch()`` in a background thread, one call per :meth:`request`; :meth:`get` returns
    the results in order (raising what a call raised). ``inline``: each :meth:`get` calls
    ``fetch`` itself instead (no overlap)."""

    def __init__(self, fetch: Callable[[], Any], inline: bool = False):
        self._fetch, self._inline = fetch, inline
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="batch-prefetch",
                                            daemon=True)
            self._thread.start()

    def request(self):
        if not self._inline:
            self._requests.put(True)

    def get(self) -> Any:
        if self._inline:
            return self._fetch()
        ok, value = self._results.get()
        if not ok:
            raise value
        return value

    def _run(self):
        while self._requests.get() is not None:
            try:
                self._results.put((True, self._fetch()))
            except BaseException as e:  # handed to the trainer's thread by get()
                self._results.put((False, e))

    def close(self):
        """Stops after the call in progress (the caller closes what it waits on)."""
        if self._thread is not None:
            self._requests.put(None)
