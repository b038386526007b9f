"""One RL run from start (or resume) to export: see :mod:`rl_jax.orchestrator.rl`.

:class:`Session` owns the run's parts (:mod:`rl_jax.orchestrator.setup`: ``model``, ``trainer``,
``generators``, and the rollout), each built with the state it needs, and calls them: it drives
the train loop, exports, evaluates and shuts everything down. The records, CPU readings and plot
are :mod:`rl_jax.orchestrator.accounting`'s functions."""

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
from jax.experimental import multihost_utils
from tqdm import tqdm

from rl_jax import compile_cache, cpus, heap
from rl_jax.generator.client.control import GeneratorUnavailable
from rl_jax.losses.core import finalize_metrics
from rl_jax.metrics import MetricsWriter, write_json
from rl_jax.models.config import DTYPES, eos_ids
from rl_jax.orchestrator.accounting import (LOSS_METRICS, Clock, Window, cpu_spent,
                                            generator_readings, plot_progress, tb_scalars,
                                            tensorboard, write_step_record)
from rl_jax.orchestrator.config import ModeSettings
from rl_jax.orchestrator.evaluation import EvalResult, evaluate
from rl_jax.orchestrator.policy import INT_FIELDS, POLICY_FIELDS, PolicyBatch
from rl_jax.orchestrator.setup import GeneratorParts, ModelParts, TrainerParts, start_rollout
from rl_jax.orchestrator.snapshots import SnapshotWriter
from rl_jax.orchestrator.weights import stop_naming_checkpoints
from rl_jax.recipe.schema import RLRecipe
from rl_jax.trainer.state import ema_decay_at, ema_update, learning_rate_at, set_learning_rate
from rl_jax.trainer.step import StreamingTrainStep, global_batch

log = logging.getLogger(__name__)


class Session:
    """Builds the parts of a run (:mod:`rl_jax.orchestrator.setup`), drives the loop, exports,
    evaluates, and shuts everything down."""

    def __init__(self, c: RLRecipe, settings: ModeSettings, workdir: Path,
                 base_dir: Path):
        self.c, self.settings, self.workdir, self.base_dir = c, settings, workdir, base_dir
        self._closers: list[Any] = []
        # The parts (rl_jax.orchestrator.setup), built by run(); the generators and the rollout
        # on process 0 only.
        self.model: ModelParts | None = None
        self.trainer: TrainerParts | None = None
        self.generators: GeneratorParts | None = None
        self.rollout = None  # the rollout's iterator of batches of groups
        self.to_batch: Any = None  # its groups into train batches
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

    def _on_applied(self, version: int):
        """Every server runs ``version``: the rollout's staleness gate hears it."""
        if self.rollout is not None:
            self.rollout.set_generator_version(version)

    def score_until(self) -> tuple[int, ...]:
        """Token ids that end a completion for scoring (the model's end-of-sequence ids)."""
        return eos_ids(self.model.model_config)

    # ---- evaluation -----------------------------------------------------------------------------

    def _evaluate(self, tag: str, background: bool = False):
        """Held-out evaluation. A ``background`` one (periodic, while the rollout goes on)
        keeps at most ``eval.concurrency`` requests on the servers, so that it does not take the
        slots the rollout's next batches need; the others (before and after the run, when
        nothing else generates) use every slot."""
        slots = self.c.generator.max_slots * max(len(self.generators.fleet.members), 1)
        concurrency = self.c.eval.concurrency if background else slots
        m = self.model
        return evaluate(self.generators.control, m.env, m.eval_prompts, encode=m.codec.encode,
                        decode=m.codec.decode, tag=tag, max_new_tokens=self.c.eval.max_new_tokens,
                        concurrency=concurrency, encode_observation=m.codec.encode_observation,
                        turn_stop_token_ids=m.turn_stops)
    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.c
        self.model = ModelParts(c, self.base_dir)
        self.primary = jax.process_index() == 0
        if self.primary:  # the other trainer processes only train (batches are broadcast)
            # started now: their start-up overlaps the trainer's
            self.generators = GeneratorParts(c, self.model, self.workdir, self.base_dir,
                                             self.compilation_cache_dir, self._closers)
        self.trainer = TrainerParts(c, self.model, self.workdir, self.base_dir, self._closers)
        if self.primary:
            with stop_naming_checkpoints(self.trainer.checkpointer):
                self.generators.connect(
                    self.trainer, update_when_idle=self.settings.update_when_idle,
                    generation_idle=lambda: self.rollout is None or self.rollout.in_flight() == 0,
                    on_applied=self._on_applied)
            self.rollout, self.to_batch = start_rollout(
                c, self.settings, self.model, self.trainer.meta, int(self.trainer.state.step),
                self.generators, self._closers, self.score_until())
        writer = MetricsWriter(self.workdir)
        tb = tensorboard(self.workdir / "tb") if c.logging.tensorboard else None
        if tb is not None:
            self._closers.append(tb.close)

        before = math.nan
        if "eval_before" in self.trainer.meta:
            before = float(self.trainer.meta["eval_before"])
        elif self.primary and self.model.eval_prompts:
            result = self.generators.control_loop.run(self._evaluate("eval-before"))
            before = result.accuracy
            writer.write(int(self.trainer.state.step), wall_s=0.0, **result.metrics())
        if self.primary:
            print(f"policy {self.trainer.n_params / 1e6:.2f}M parameters, mode "
                  f"{self.settings.mode}, max_lag {self.settings.max_lag}, "
                  f"{len(self.generators.fleet.members)} generator "
                  f"server(s); held-out accuracy before RL: {before:.3f}", flush=True)

        # Setup's objects out of the garbage collector: a full collection over them pauses the
        # loop (rl_jax.heap); the monitor counts the loop's own collections. Done before the
        # clock starts and before the rollout sends its first request: the collection itself
        # holds the GIL.
        heap.freeze_long_lived()
        self.gc = heap.GcMonitor().install()
        self._closers.append(self.gc.uninstall)
        cpu_before = self._cpu_reading()
        wall_offset = float(self.trainer.meta.get("wall_s", 0.0))
        totals = collections.Counter({k: float(v) for k, v in
                                      self.trainer.meta.get("totals", {}).items()})
        clock = Clock()
        pending_eval: tuple[int, Any] | None = None
        last_eval: EvalResult | None = None
        start_iter = int(self.trainer.state.step) + int(self.trainer.state.skipped)
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
            self.snapshots = SnapshotWriter(self.workdir, self.model.plain_spec,
                                            tokenizer=self.model.tokenizer,
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
            if not isinstance(self.trainer.train_step, StreamingTrainStep):
                batch = global_batch(batch, self.model.batch_sharding)
            trainer = self.trainer
            trainer.state, metrics = trainer.train_step(trainer.state, batch)  # dispatched: runs
            if log_step is not None:  # on XLA's threads while this one logs the previous step
                log_step()
                log_step = None
            metrics = finalize_metrics({k: float(v) for k, v in jax.device_get(metrics).items()})
            if i == start_iter:
                self.first_step_s = cpus.seconds_since_start()
                if self.primary:
                    bar.write(f"first step {self.first_step_s:.1f} s after launch")
            version = int(self.trainer.state.step)
            if self.trainer.ema is not None:
                trainer.ema = ema_update(trainer.ema, trainer.state.params, jnp.float32(
                    ema_decay_at(trainer.ema_decay, trainer.ema_updates)))
                trainer.ema_updates += 1
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
                self.generators.weights.wait_applied(version)
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
                        pending_eval is None and self.model.eval_prompts:
                    pending_eval = (done,
                                    self.generators.control_loop.submit(
                                        self._evaluate(f"eval-{done}", background=True)))
                correct = np.mean([bool(s.info.get("correct")) for g in groups
                                   for s in g.samples])
                record = {
                    "wall_s": wall_offset + clock.elapsed, "version": version,
                    "reward/mean": host["metrics"]["reward/mean"],
                    "reward/std": host["metrics"]["reward/std"],
                    "rollout/accuracy": float(correct),
                    "groups/zero_signal": host["metrics"]["groups/zero_signal"],
                    **{k: v for k, v in host["metrics"].items()
                       if k.startswith(("completions/", "tools/", "episodes/"))},
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
                    record.update(window.take(self.rollout.metrics(),
                                              self.generators.sampler.take(), clock))
                    record.update(self.generators.weights.metrics())
                    record["generator/restarts"] = float(
                        sum(self.generators.pool.restarts.values()))
                log_step = functools.partial(write_step_record, writer, tb, bar, done, record,
                                             staleness, last_eval)
            else:
                bar.update(1)
            final = done == c.trainer.steps
            if log_step is not None and (final or self.trainer.checkpointer.should_save(done)):
                log_step()  # a checkpointed step has its record: a resumed run starts after it
                log_step = None
            self.trainer.checkpointer.save(done, self.trainer.state, meta, force=final)
        if log_step is not None:
            log_step()
        bar.close()
        return self._finish(writer, tb, before, clock, wall_offset, totals, pending_eval,
                            cpu_before)

    def _finish(self, writer, tb, before, clock, wall_offset, totals, pending_eval,
                cpu_before):
        c = self.c
        version = int(self.trainer.state.step)
        train_wall = wall_offset + clock.elapsed
        gc_stats = self.gc.stats()  # the loop's collections and pauses
        cpu_after = self._cpu_reading()
        self.trainer.checkpointer.wait()
        if self.snapshots is not None:
            self.snapshots.close()
        done = version + int(self.trainer.state.skipped)
        if self.trainer.checkpointer.latest_step() != done:  # stopped early by the time limit
            self.trainer.checkpointer.save(done, self.trainer.state,
                                   {"eval_before": before, "wall_s": train_wall,
                                    "totals": dict(totals),
                                    **({"rollout": self.rollout.get_state()} if self.primary
                                       else {})}, force=True)
            self.trainer.checkpointer.wait()
        final_params = self.trainer.state.params if self.trainer.ema is None else self.trainer.ema
        export = self.trainer.export(final_params, self.workdir / "hf",
                                     tokenizer=self.model.tokenizer, dtype=DTYPES[c.export.dtype])
        final_version = version
        if self.trainer.ema is not None:  # the generators evaluate the average as the next version
            final_version = version + 1
            self._publish(final_version, params=self.trainer.ema)
        if not self.primary:
            return {}
        spent = cpu_spent(cpu_before, cpu_after)
        spent["trainer_gc"] = gc_stats
        rollout_metrics = self.rollout.metrics()
        self.rollout.close()
        if pending_eval is not None:
            pending_eval[1].result()
        self.generators.weights.update_when_idle = False  # nothing is generating any more
        self.generators.weights.poke()
        self.generators.weights.wait_applied(final_version)
        final = self.generators.control_loop.run(self._evaluate("eval-final"))
        writer.write(version, wall_s=wall_offset + clock.elapsed, **final.metrics())
        if tb is not None:
            tb_scalars(tb, final.metrics(), version)
        elapsed = max(clock.elapsed, 1e-9)
        summary = {
            "mode": self.settings.mode, "max_lag": self.settings.max_lag,
            "steps": version, "skipped_steps": int(self.trainer.state.skipped),
            "final_weights": "policy" if self.trainer.ema is None else
            f"average (ema_decay={self.trainer.ema_decay}, {self.trainer.ema_updates} updates)",
            "parameters": int(self.trainer.n_params), "wall_s": train_wall,
            "held_out_accuracy_before": before, "held_out_accuracy_after": final.accuracy,
            "held_out_examples": final.examples, "final_version": final.min_version,
            "trained_tokens": totals["trained_tokens"],
            "trained_tokens_per_s": totals["trained_tokens"] / max(train_wall, 1e-9),
            "completion_tokens": totals["completion_tokens"],
            "trainer_idle_fraction": (clock.waiting_s + clock.syncing_s) / elapsed,
            "trainer_seconds": {"waiting": clock.waiting_s, "training": clock.training_s,
                                "publishing": clock.publishing_s, "syncing": clock.syncing_s,
                                "cpu_while_idle": clock.idle_cpu_s},
            "staleness_histogram": {str(k): v for k, v in sorted(
                self.rollout.gate.staleness_histogram.items())},
            **{k: v for k, v in rollout_metrics.items()},
            "weights": dict(self.generators.weights.totals),
            "generator_restarts": dict(self.generators.pool.restarts), "export": str(export),
            "fleet": self.generators.fleet.summary(),
            "generators_priority": self.generators.pool.priority,
            "time_to_first_step_s": self.first_step_s,
            **spent,
        }
        idle = writer.series("generator/idle_fraction")[1]
        summary["generator_idle_fraction"] = float(np.mean(idle)) if len(idle) else None
        write_json(self.workdir / "summary.json", summary)
        plot_progress(self.workdir / "progress.png", writer,
                      f"{c.env.name}, mode {self.settings.mode}")
        self.summary = summary
        if jax.process_index() == 0:
            print(f"exported {export}; {version} steps in {train_wall:.0f} s, "
                  f"{summary['trained_tokens_per_s']:.0f} trained tokens/s", flush=True)
            print(f"held-out accuracy: {before:.2f} -> {final.accuracy:.2f}", flush=True)
        return summary

    def _cpu_reading(self) -> tuple[dict, dict] | None:
        """CPU seconds per thread of this process and of the generator servers (process 0)."""
        if not self.primary:
            return None
        return cpus.thread_cpu_seconds(), generator_readings(self.generators.control_loop,
                                                             self.generators.control)

    def _learning_rate(self, step: int, wall_s: float) -> float:
        """The learning rate of update ``step`` (0-based), set into the optimizer state when the
        schedule runs on the run's progress: the larger of the steps done and the wall time
        used, each over its limit, so a run stopped by its time limit ends its decay then."""
        opt, c = self.model.optimizer_config, self.c
        if opt.schedule_on != "progress":
            return float(self.model.schedule(step))
        progress = step / c.trainer.steps
        if c.trainer.time_limit_s:
            progress = max(progress, wall_s / c.trainer.time_limit_s)
        if jax.process_count() > 1:  # every process steps with process 0's clock
            progress = float(multihost_utils.broadcast_one_to_all(np.float32(progress)))
        learning_rate = learning_rate_at(opt, step, progress)
        self.trainer.state = self.trainer.state.replace(
            opt_state=set_learning_rate(self.trainer.state.opt_state, learning_rate))
        return learning_rate

    def _next_batch(self) -> tuple[list, dict[str, Any], list[int], float]:
        """The next batch: ``(groups, packed host batch, staleness per sample, packing s)``."""
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
            if version == self.generators.weights.published:
                return None
        params = self.trainer.for_generators(self.trainer.state.params if params is None
                                             else params)
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(params, tiled=True)
            if not self.primary:
                return None
            params = jax.device_put(params, jax.local_devices()[0])
        with stop_naming_checkpoints(self.trainer.checkpointer):
            self.generators.weights.publish(params, version)
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
