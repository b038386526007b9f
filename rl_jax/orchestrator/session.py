"""One RL run from start (or resume) to export: see :mod:`rl_jax.orchestrator.rl`."""

from __future__ import annotations

import collections
import dataclasses
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
import ml_collections
import numpy as np
from tqdm import tqdm

from rl_jax import compile_cache, cpus, distributed, envs, heap
from rl_jax.data import sources
from rl_jax.data.sources import env_source, prompt_dataset
from rl_jax.generator.client import ClientConfig, GeneratorClient, GeneratorUnavailable
from rl_jax.models.config import eos_ids
from rl_jax.generator.types import SamplingParams
from rl_jax.losses import finalize_metrics
from rl_jax.metrics import MetricsWriter, plot_curves, write_json
from rl_jax.models.config import DTYPES
from rl_jax.models.hf import load_pretrained, load_tokenizer, read_config, save_pretrained
from rl_jax.orchestrator.config import (ModeSettings, RLConfigError, max_new_tokens,
                                        max_sample_tokens, rows_per_batch)
from rl_jax.orchestrator.evaluation import EvalResult, evaluate, held_out_prompts
from rl_jax.orchestrator.policy import (INT_FIELDS, POLICY_FIELDS, PolicyBatch,
                                        make_policy_loss)
from rl_jax.generator.launcher import PoolConfig
from rl_jax.orchestrator.pool import BackgroundLoop, GeneratorPool, check_keys
from rl_jax.orchestrator.snapshots import SnapshotWriter
from rl_jax.orchestrator.weights import WeightSync
from rl_jax.rollout.pipeline import (GroupsToBatch, LognormalLengths, RolloutConfig,
                                     RolloutDataset)
from rl_jax.sharding import make_mesh
from rl_jax.trainer.checkpoint import Checkpointer
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state, ema_decay_at,
                                  ema_update, init_state, learning_rate_at,
                                  learning_rate_schedule, make_optimizer, set_learning_rate)
from rl_jax.trainer.step import (StreamingTrainStep, default_batch_sharding, ess_update_scale,
                                 global_batch, make_train_step)
from rl_jax.transfer import Publisher, PublisherConfig

log = logging.getLogger(__name__)

# Loss metrics worth a line in the log (after finalize_metrics), when the loss reports them.
LOSS_METRICS = ("loss", "grad_norm", "clipped_fraction", "ratio_mean", "ratio_max", "ratio_ess",
                "entropy_mean", "policy_kl_mean", "kl_mean", "tokens", "sequences", "skipped",
                "behaviour_ratio_ess", "behaviour_kl_mean", "m2_mean", "update_scale")


@dataclasses.dataclass
class _Clock:
    """Wall-time accounting of the trainer: where its seconds went."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    waiting_s: float = 0.0  # for a batch from the rollout
    training_s: float = 0.0
    publishing_s: float = 0.0
    syncing_s: float = 0.0  # waiting for generators to take new weights (sync mode)
    # CPU seconds this process spent while the trainer waited (waiting + syncing): the rollout
    # client, scoring, packing and weight sync, i.e. the work that shares the trainer's cores.
    idle_cpu_s: float = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Codec:
    """Text ↔ token ids for prompts and completions: the prompt is put into ``template``
    (``"{prompt}"`` marks it), and ``<bos>`` goes first when the model has one."""

    def __init__(self, tokenizer, bos_id: int | None, template: str = "{prompt}"):
        if "{prompt}" not in template:
            raise RLConfigError(f"data.template must contain '{{prompt}}', got {template!r}")
        self.tokenizer, self.bos_id, self.template = tokenizer, bos_id, template

    def encode(self, text: str) -> list[int]:
        text = self.template.replace("{prompt}", text)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def prompt_source(c: ml_collections.ConfigDict, env, path: str | None = None) -> Any:
    """Prompts of ``path`` (default ``data.path``; JSONL, Parquet or ArrayRecord), or the
    environment's train split when there is no path."""
    d = c.data
    name = d.path if path is None else path
    if not name:
        return env_source(env, "train")
    path = Path(name)
    if not path.exists():
        raise RLConfigError(f"{name} does not exist (data.path / eval.path)")
    kwargs = dict(text_key=d.text_key, answer_key=d.answer_key or None)
    try:
        if path.suffix == ".jsonl":
            return sources.jsonl_source(path, **kwargs)
        if path.suffix == ".parquet":
            return sources.parquet_source(path, **kwargs)
        if path.suffix in (".array_record", ".arrayrecord"):
            return sources.array_record_source(path, **kwargs)
    except sources.SourceError as e:
        raise RLConfigError(f"{name}: {e}") from None
    raise RLConfigError(f"{name}: use a .jsonl, .parquet or .array_record file")


class PoolSampler:
    """Samples, every ``interval`` seconds, whether each generator server has requests in flight
    (from the clients' outstanding counts): the pool's idle fraction over a window."""

    def __init__(self, clients: list[GeneratorClient], interval: float = 0.05):
        self.clients, self.interval = clients, interval
        self._busy: collections.Counter = collections.Counter()
        self._samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            outstanding = collections.Counter()
            for client in self.clients:
                for server in client.servers:
                    outstanding[server.url] += server.outstanding
            with self._lock:
                self._samples += 1
                for url, n in outstanding.items():
                    self._busy[url] += n > 0

    def take(self) -> float:
        """Mean idle fraction of the servers since the last call (NaN before any sample)."""
        with self._lock:
            samples, busy = self._samples, dict(self._busy)
            self._samples = 0
            self._busy.clear()
        urls = {s.url for c in self.clients for s in c.servers}
        if not samples or not urls:
            return math.nan
        return float(np.mean([1.0 - busy.get(u, 0) / samples for u in urls]))

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


class Session:
    """Builds every role of a run, drives the loop, and shuts everything down."""

    def __init__(self, c: ml_collections.ConfigDict, settings: ModeSettings, workdir: Path,
                 base_dir: Path):
        self.c, self.settings, self.workdir, self.base_dir = c, settings, workdir, base_dir
        self._closers: list[Any] = []
        self.rollout = None
        self.summary: dict[str, Any] = {}
        self.first_step_s: float | None = None  # seconds from launch to the first step's end
        # JAX's persistent compilation cache, for this process and the servers it starts
        # (rl_jax.compile_cache): a later run of the recipe loads its programs.
        self.compilation_cache_dir = compile_cache.resolve(c.get("compilation_cache_dir", ""))
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

    # ---- setup ----------------------------------------------------------------------------------

    def _setup_model(self):
        c = self.c
        distributed.initialize(c.distributed.coordinator, c.distributed.num_processes,
                               c.distributed.process_id)
        self.model_config = read_config(self.base_dir)
        self.tokenizer = load_tokenizer(self.base_dir)
        self.codec = Codec(self.tokenizer, self.model_config.bos_token_id, c.data.template)
        for name in (c.model.dtype, c.model.param_dtype):
            if name not in DTYPES:
                raise RLConfigError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
        self.mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
        self.spec = ModelSpec(self.model_config, mesh=self.mesh, dtype=DTYPES[c.model.dtype],
                              param_dtype=DTYPES[c.model.param_dtype], remat=c.model.remat,
                              scan_layers=bool(c.model.get("scan_layers", True)))
        self.env = envs.get(c.env.name, **c.env.kwargs.to_dict())
        self.prompt_source = prompt_source(c, self.env)
        if c.eval.path:
            held_out = prompt_source(c, self.env, path=c.eval.path)
            self.eval_prompts = [held_out[i] for i in range(min(c.eval.examples,
                                                                 len(held_out)))]
        else:
            self.eval_prompts = held_out_prompts(self.env, c.eval.examples)
        sample_prompts = [self.prompt_source[i] for i in
                          range(min(256, len(self.prompt_source)))] + self.eval_prompts
        self.max_prompt_tokens = max(len(self.codec.encode(p.text)) for p in sample_prompts)
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro_rows = int(c.trainer.micro_batch_rows)
        if micro_rows and micro_rows % shards:
            raise RLConfigError(f"trainer.micro_batch_rows={micro_rows} is not divisible by the "
                                f"mesh's {shards} batch shards (data × fsdp)")
        self.row_multiple = micro_rows or shards * c.trainer.num_microbatches
        self.rows = rows_per_batch(c, self.max_prompt_tokens, self.row_multiple)
        if max_sample_tokens(self.max_prompt_tokens, c) > c.generator.max_seq_len:
            raise RLConfigError(
                f"generator.max_seq_len={c.generator.max_seq_len} is shorter than a prompt "
                f"({self.max_prompt_tokens} tokens) plus the completion limit "
                f"({max_new_tokens(c)} tokens)")
        opt = OptimizerConfig(total_steps=c.trainer.steps, **c.optimizer.to_dict())
        self.optimizer_config = opt
        # Compiled once and called here: evaluated eagerly, the schedule's first call dispatches
        # (and compiles) a few dozen small operations on the trainer's thread.
        self.schedule = jax.jit(learning_rate_schedule(opt))
        jax.block_until_ready(self.schedule(0))
        self.tx = make_optimizer(opt)
        self.batch_sharding = default_batch_sharding(self.spec)
        loss_fn = make_policy_loss(c.loss.name, c.loss.options.to_dict(),
                                   block_size=c.trainer.logits_block_size,
                                   temperature=c.rollout.temperature)
        power = float(c.trainer.get("ess_lr_power", 0.0))
        update_scale = ess_update_scale(power) if power else None
        if micro_rows:
            # Batches of any size run as fixed-shape micro-batches: compiled once, here.
            self.train_step = StreamingTrainStep(self.spec, self.tx, loss_fn,
                                                 micro_rows=micro_rows,
                                                 batch_sharding=self.batch_sharding,
                                                 update_scale=update_scale)
            seconds = self.train_step.compile(PolicyBatch.abstract(micro_rows,
                                                                   c.rollout.seq_len))
            log.info("train step compiled for micro-batches of %d x %d in %.1f s", micro_rows,
                     c.rollout.seq_len, seconds)
        else:
            self.train_step = make_train_step(self.spec, self.tx, loss_fn,
                                              num_microbatches=c.trainer.num_microbatches,
                                              batch_sharding=self.batch_sharding,
                                              update_scale=update_scale)
        self.checkpointer = Checkpointer(self.workdir / "checkpoints", keep=c.checkpoint.keep,
                                         every=c.checkpoint.every,
                                         use_async=c.checkpoint.use_async)
        self._closers.append(self.checkpointer.close)
        self.meta: dict[str, Any] = {}
        if self.checkpointer.latest_step() is not None:
            self.state, self.meta, _ = self.checkpointer.restore(
                abstract_state(self.tx, self.spec))
            log.info("resumed from %s at policy version %d", self.checkpointer.directory,
                     int(self.state.step))
        else:
            params = self.spec.split(load_pretrained(
                self.base_dir, self.mesh, self.spec.dtype, param_dtype=self.spec.param_dtype,
                rules=self.spec.rules))
            self.state = init_state(self.tx, self.spec, params)
        self.n_params = sum(x.size for x in jax.tree.leaves(self.state.params))
        # An exponential moving average of the parameters, exported and evaluated at the end in
        # place of the last step's (the generators always sample from the trained policy).
        # It lives beside the train state, not in its checkpoints: a resumed run restarts it.
        self.ema_decay = float(c.trainer.get("ema_decay", 0.0))
        self.ema, self.ema_updates = None, 0
        if self.ema_decay:
            self.ema = jax.tree.map(jnp.copy, self.state.params)
            if self.meta:
                log.info("parameter average restarts from the resumed parameters")
        if micro_rows:
            seconds = self.train_step.warm(self.state.params,
                                           PolicyBatch.abstract(micro_rows, c.rollout.seq_len))
            log.info("train step warmed up in %.2f s", seconds)

    def _setup_generators(self):
        c = self.c
        method = "disk" if (c.generator.kind == "sglang" or tuple(c.transfer.transports) ==
                            ("disk",)) else "transfer"
        transports = ("disk",) if method == "disk" else tuple(c.transfer.transports)
        self.publisher = Publisher(PublisherConfig(
            host=c.transfer.host, port=c.transfer.port, transports=transports,
            disk_dir=str(self.workdir / "weights") if method == "disk" else None),
            spec=self.spec)
        self._closers.append(self.publisher.close)
        self.pool = GeneratorPool(c.generator, model_dir=self.base_dir,
                                  publisher_url=self.publisher.url, cpu_cores=c.cpus.generators,
                                  nice=int(c.cpus.get("generators_nice", 0)),
                                  log_dir=self.workdir / "generators",
                                  compilation_cache_dir=self.compilation_cache_dir)
        self._closers.append(self.pool.stop)
        started = time.perf_counter()
        self.pool.start()
        log.info("generator pool up in %.1f s: %s", time.perf_counter() - started, self.pool.urls)
        client_config = ClientConfig(request_timeout=c.generator.request_timeout_s,
                                     control_timeout=max(c.transfer.timeout_s, 60.0))
        self.control_loop = BackgroundLoop("generator-control")
        self._closers.append(self.control_loop.close)
        self.control = GeneratorClient(self.pool.urls, client_config, keys=self.pool.keys)
        self._closers.append(lambda: self.control_loop.run(self.control.close(), timeout=30))
        if c.generator.urls:
            health = self.control_loop.run(self.control.check_health(), timeout=60)
            down = sorted(url for url, ok in health.items() if not ok)
            if down:
                raise RLConfigError(f"generator server(s) {', '.join(down)} unreachable (no "
                                    "answer at /health)")
        self.control_loop.run(check_keys(self.control), timeout=60)
        self.rollout_client = GeneratorClient(self.pool.urls, client_config,
                                              keys=self.pool.keys)
        self.sampler = PoolSampler([self.rollout_client, self.control])
        self._closers.append(self.sampler.close)
        self.weights = WeightSync(
            self.publisher, self.control, self.control_loop, method=method,
            update_when_idle=self.settings.update_when_idle,
            generation_idle=lambda: self.rollout is None or self.rollout.in_flight() == 0,
            on_applied=self._on_applied, timeout_s=c.transfer.timeout_s)
        self._closers.append(self.weights.close)
        if method == "transfer" and not c.generator.urls:
            if not self.publisher.wait_for_layouts(1, timeout=60):
                raise RLConfigError("no generator server registered with the weight publisher")
        # Bring every server to the trainer's version before any rollout.
        version = int(self.state.step)
        versions = self.control_loop.run(self.control.weight_versions(), timeout=60)
        if version == 0 and versions and all(v == 0 for v in versions.values()):
            self.weights.published = self.weights.applied = 0
        else:
            self.weights.publish(self.state.params, version)
            self.weights.wait_applied(version)

    def _on_applied(self, version: int):
        if self.rollout is not None:
            self.rollout.set_generator_version(version)

    def _setup_rollout(self):
        c, r = self.c, self.c.rollout
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                  top_p=r.top_p, top_k=r.top_k, ignore_eos=r.ignore_eos,
                                  seed=c.seed)
        # This project's servers started here queue at most PoolConfig.max_waiting sequences
        # each: admitting more groups than fit gets requests refused as overloaded. A quarter
        # of the queue stays free for evaluations and retries.
        in_flight_cap = None
        if c.generator.kind == "rl_jax" and not c.generator.urls:
            in_flight_cap = (PoolConfig.max_waiting * 3 // 4) * int(c.generator.num_servers) \
                // r.group_size
            if in_flight_cap < r.groups_per_batch:
                raise RLConfigError(
                    f"rollout.groups_per_batch={r.groups_per_batch} groups of {r.group_size} "
                    f"exceed what {c.generator.num_servers} server(s) queue "
                    f"({PoolConfig.max_waiting} sequences each)")
        config = RolloutConfig(group_size=r.group_size, groups_per_batch=r.groups_per_batch,
                               max_in_flight_groups=in_flight_cap,
                               max_lag=self.settings.max_lag, staleness_policy=r.staleness_policy,
                               sampling=sampling, max_retries=r.max_retries,
                               filter_zero_signal=r.filter_zero_signal,
                               length_of=None if not r.lengths.sigma else LognormalLengths(
                                   r.lengths.median, r.lengths.sigma, r.lengths.max, c.seed),
                               per_sample_lengths=bool(r.lengths.per_sample),
                               score_until=eos_ids(self.model_config))
        version = int(self.state.step)
        state = dict(self.meta.get("rollout") or {})
        state.update(trainer_version=version, generator_version=self.weights.applied)
        prompts = prompt_dataset(self.prompt_source, seed=c.seed,
                                 shuffle=bool(c.data.path) and c.data.shuffle,
                                 num_epochs=None if not c.data.epochs or not c.data.path
                                 else int(c.data.epochs))
        dataset = RolloutDataset(prompts, self.env, self.rollout_client,
                                 encode=self.codec.encode, decode=self.codec.decode,
                                 config=config, state=state, close_generator=True)
        self.rollout = iter(dataset)
        self._closers.append(self.rollout.close)
        self.to_batch = GroupsToBatch(seq_len=r.seq_len, rows=self.rows, advantage=r.advantage,
                                      pad_id=self.model_config.pad_token_id or 0,
                                      row_multiple=self.row_multiple,
                                      power_of_two=not c.trainer.micro_batch_rows,
                                      share_prompts=bool(r.get("share_prompts", False)))
        self.to_batch.warm(r.groups_per_batch, r.group_size)


    # ---- evaluation -----------------------------------------------------------------------------

    def _evaluate(self, tag: str, background: bool = False):
        """Held-out evaluation. A ``background`` one (periodic, while the rollout goes on)
        keeps at most ``eval.concurrency`` requests on the servers, so that it does not take the
        slots the rollout's next batches need; the others (before and after the run, when
        nothing else generates) use every slot."""
        slots = self.c.generator.max_slots * max(len(self.pool.urls), 1)
        concurrency = int(self.c.eval.get("concurrency", slots)) if background else slots
        return evaluate(self.control, self.env, self.eval_prompts, encode=self.codec.encode,
                        decode=self.codec.decode, max_new_tokens=self.c.eval.max_new_tokens,
                        tag=tag, concurrency=concurrency)

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.c
        self._setup_model()
        self.primary = jax.process_index() == 0
        if self.primary:  # the other trainer processes only train (batches are broadcast)
            self._setup_generators()
            self._setup_rollout()
        writer = MetricsWriter(self.workdir)
        tb = _tensorboard(self.workdir / "tb") if c.logging.tensorboard else None
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
                  f"max_lag {self.settings.max_lag}, {len(self.pool.urls)} generator "
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
        clock = _Clock()
        pending_eval: tuple[int, Any] | None = None
        last_eval: EvalResult | None = None
        start_iter = int(self.state.step) + int(self.state.skipped)
        bar = tqdm(total=c.trainer.steps, initial=start_iter, desc=f"rl {self.settings.mode}",
                   unit="step", dynamic_ncols=True, disable=not self.primary)
        window = _Window(self.rollout.metrics()) if self.primary else None
        # The next batch is taken from the rollout and packed in a background thread while the
        # current one trains (the gate reckons its staleness against the version that will
        # train it), so the train step does not wait for host work between two steps.
        prefetcher = None
        if self.primary:
            prefetcher = _Prefetcher(self._next_batch,
                                     inline=not c.trainer.get("prefetch", True))
            self._closers.append(prefetcher.close)
            if start_iter < c.trainer.steps:
                prefetcher.request()
        self.snapshots = None
        if self.primary and c.export.get("every", 0):
            self.snapshots = SnapshotWriter(self.workdir, self.spec, tokenizer=self.tokenizer,
                                            dtype=DTYPES[c.export.dtype], every=c.export.every)
            self._closers.append(self.snapshots.close)
        if self.primary and c.cpus.get("rollout"):
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
            delay = float(c.trainer.get("step_delay_s", 0.0))
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
                            _tb_scalars(tb, last_eval.metrics(), done)
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

    @staticmethod
    def _log_step(writer: MetricsWriter, tb, bar, done: int, record: dict[str, Any],
                  staleness: list[int], last_eval: EvalResult | None):
        """A step's record to the JSONL log, TensorBoard and the progress bar."""
        writer.write(done, **record)
        if tb is not None:
            _tb_scalars(tb, record, done)
            tb.add_histogram("staleness", np.asarray(staleness), done)
        bar.set_postfix(reward=f"{record['reward/mean']:.2f}",
                        acc=f"{record['rollout/accuracy']:.2f}",
                        **({"eval": f"{last_eval.accuracy:.2f}"} if last_eval else {}),
                        stale=int(record["staleness/batch_max"]),
                        **({"gen_tok_s": f"{record['generator/tokens_per_s']:.0f}"}
                           if "generator/tokens_per_s" in record else {}),
                        refresh=False)
        bar.update(1)

    def _generator_readings(self) -> dict[str, dict[str, Any]]:
        """Each generator server's CPU seconds per thread so far and its engine counters (this
        project's servers report them in ``/get_server_info``; SGLang's do not, and give nothing
        here): ``{url: {"cpu": {thread: s}, "counters": {name: count}}}``."""
        try:
            answers = self.control_loop.run(self.control.broadcast("GET", "/get_server_info"),
                                            timeout=30)
        except Exception as e:  # diagnostics only: never stop a run for them
            log.warning("generator CPU times unavailable: %r", e)
            return {}
        out = {}
        for url, (status, body) in answers.items():
            if status != 200 or not isinstance(body, dict) \
                    or not isinstance(body.get("cpu_seconds_by_thread"), dict):
                continue
            states = body.get("internal_states") or [{}]
            counters = states[0] if isinstance(states[0], dict) else {}
            gc_pauses = (body.get("gc") or {}).get("pause_s") or [0.0]
            out[url] = {"cpu": body["cpu_seconds_by_thread"], "counters": {
                name: value for name, value in counters.items()
                if isinstance(value, int) and not isinstance(value, bool)},
                "gc_pause_s": float(sum(gc_pauses))}
        return out

    @staticmethod
    def _cpu_spent(before, after) -> dict[str, Any]:
        """CPU seconds per thread name spent in the loop (between the readings ``before`` and
        ``after``) by this process (``trainer_cpu_seconds``) and by the generator servers
        (``generator_cpu_seconds``, summed over the servers that answered both times), and the
        servers' engine counters (``generator_counters``: decode steps, prefills, compactions,
        ...; ``generator_decode_batches``: decode steps per decode batch size)."""
        if before is None or after is None:
            return {}
        (trainer_before, generators_before), (trainer_after, generators_after) = before, after
        out: dict[str, Any] = {"trainer_cpu_seconds": cpus.cpu_seconds_between(
            trainer_before, trainer_after)}
        total: collections.Counter = collections.Counter()
        counters: collections.Counter = collections.Counter()
        gc_pause = 0.0
        for url, reading in generators_after.items():
            if url in generators_before:
                earlier = generators_before[url]
                total.update(cpus.cpu_seconds_between(earlier["cpu"], reading["cpu"]))
                gc_pause += reading["gc_pause_s"] - earlier["gc_pause_s"]
                counters.update({name: n - earlier["counters"].get(name, 0)
                                 for name, n in reading["counters"].items()})
        if total:
            out["generator_cpu_seconds"] = {k: round(v, 3) for k, v in total.most_common()}
            # seconds the servers' garbage collections paused them (summed over servers)
            out["generator_gc_pause_s"] = round(gc_pause, 4)
        prefix = "decode_batch_"
        batches = {name[len(prefix):]: n for name, n in counters.items()
                   if name.startswith(prefix) and n}
        if batches:
            out["generator_decode_batches"] = dict(sorted(batches.items(),
                                                          key=lambda kv: int(kv[0])))
        others = {name: n for name, n in counters.items() if not name.startswith(prefix)}
        if others:
            out["generator_counters"] = dict(sorted(others.items()))
        return out

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

    def _finish(self, writer, tb, before, clock, wall_offset, totals, pending_eval,
                cpu_before):
        c = self.c
        version = int(self.state.step)
        train_wall = wall_offset + clock.elapsed
        gc_stats = self.gc.stats()  # the loop's collections and pauses
        cpu_after = (cpus.thread_cpu_seconds(), self._generator_readings()) if self.primary \
            else None
        self.checkpointer.wait()
        if self.snapshots is not None:
            self.snapshots.close()
        done = version + int(self.state.skipped)
        if self.checkpointer.latest_step() != done:  # stopped early by the time limit
            self.checkpointer.save(done, self.state,
                                   {"eval_before": before, "wall_s": train_wall,
                                    "totals": dict(totals),
                                    **({"rollout": self.rollout.get_state()} if self.primary
                                       else {})}, force=True)
            self.checkpointer.wait()
        final_params = self.state.params if self.ema is None else self.ema
        export = save_pretrained(self.spec.merge(final_params), self.workdir / "hf",
                                 tokenizer=self.tokenizer, dtype=DTYPES[c.export.dtype])
        final_version = version
        if self.ema is not None:  # the generators evaluate the average as the next version
            final_version = version + 1
            self._publish(final_version, params=self.ema)
        if not self.primary:
            return {}
        cpu_spent = self._cpu_spent(cpu_before, cpu_after)
        cpu_spent["trainer_gc"] = gc_stats
        rollout_metrics = self.rollout.metrics()
        self.rollout.close()
        if pending_eval is not None:
            pending_eval[1].result()
        self.weights.update_when_idle = False  # nothing is generating any more
        self.weights.poke()
        self.weights.wait_applied(final_version)
        final = self.control_loop.run(self._evaluate("eval-final"))
        writer.write(version, wall_s=wall_offset + clock.elapsed, **final.metrics())
        if tb is not None:
            _tb_scalars(tb, final.metrics(), version)
        elapsed = max(clock.elapsed, 1e-9)
        summary = {
            "mode": self.settings.mode, "max_lag": self.settings.max_lag,
            "steps": version, "skipped_steps": int(self.state.skipped),
            "final_weights": "policy" if self.ema is None else
            f"average (ema_decay={self.ema_decay}, {self.ema_updates} updates)",
            "parameters": int(self.n_params), "wall_s": train_wall,
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
            "weights": dict(self.weights.totals),
            "generator_restarts": dict(self.pool.restarts), "export": str(export),
            "generators_priority": self.pool.priority,
            "time_to_first_step_s": self.first_step_s,
            **cpu_spent,
        }
        idle = writer.series("generator/idle_fraction")[1]
        summary["generator_idle_fraction"] = float(np.mean(idle)) if len(idle) else None
        write_json(self.workdir / "summary.json", summary)
        self._plot(writer)
        self.summary = summary
        if jax.process_index() == 0:
            print(f"exported {export}; {version} steps in {train_wall:.0f} s, "
                  f"{summary['trained_tokens_per_s']:.0f} trained tokens/s", flush=True)
            print(f"held-out accuracy: {before:.2f} -> {final.accuracy:.2f}", flush=True)
        return summary

    def _plot(self, writer: MetricsWriter):
        def by_wall(key):
            rows = [(r["wall_s"], r[key]) for r in writer.records
                    if isinstance(r.get(key), (int, float)) and "wall_s" in r]
            if not rows:
                return np.zeros(0), np.zeros(0)
            x, y = zip(*rows)
            return np.asarray(x), np.asarray(y, float)

        plot_curves(self.workdir / "progress.png", [
            ("reward", [("train reward (mean)", *by_wall("reward/mean")),
                        ("train accuracy", *by_wall("rollout/accuracy"))]),
            ("held-out accuracy (greedy)", [("", *by_wall("eval/accuracy"))]),
            ("staleness (steps)", [("batch max", *by_wall("staleness/batch_max")),
                                   ("batch mean", *by_wall("staleness/batch_mean"))]),
        ], title=f"{self.c.env.name}, mode {self.settings.mode}", xlabel="wall time (s)")


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


class _Window:
    """Rates over the interval between two log lines."""

    def __init__(self, rollout_metrics: dict[str, float]):
        self.time = time.perf_counter()
        self.rollout = rollout_metrics
        self.clock: dict[str, float] = {}

    def take(self, rollout_metrics: dict[str, float], generator_idle: float, clock) -> dict:
        now = time.perf_counter()
        dt = max(now - self.time, 1e-9)
        tokens = rollout_metrics.get("rollout/completion_tokens", 0.0) - \
            self.rollout.get("rollout/completion_tokens", 0.0)
        spent = {"waiting": clock.waiting_s + clock.syncing_s, "training": clock.training_s}
        idle = (spent["waiting"] - self.clock.get("waiting", 0.0)) / dt
        out = {"generator/tokens_per_s": tokens / dt, "generator/idle_fraction": generator_idle,
               "trainer/idle_fraction": min(max(idle, 0.0), 1.0),
               **{k: v for k, v in rollout_metrics.items() if k.startswith(("gate/",
                                                                             "staleness/"))}}
        # With dynamic filtering: the share of the groups generated in the window that had no
        # reward signal (the batches themselves then have none).
        filtered = rollout_metrics.get("rollout/filtered_zero_signal", 0.0) - \
            self.rollout.get("rollout/filtered_zero_signal", 0.0)
        kept = rollout_metrics.get("rollout/groups", 0.0) - self.rollout.get("rollout/groups", 0.0)
        if "rollout/filtered_zero_signal" in rollout_metrics and filtered + kept > 0:
            out["groups/zero_signal_generated"] = filtered / (filtered + kept)
        self.time, self.rollout, self.clock = now, rollout_metrics, spent
        return out


def _tb_scalars(tb, values: dict[str, Any], step: int):
    """The finite numbers of ``values`` as one TensorBoard event (a summary with one value per
    tag): a step's forty-odd metrics cost one protobuf and one write, not one each."""
    from tensorboardX.proto.summary_pb2 import Summary
    entries = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if entries:
        tb._get_file_writer().add_summary(Summary(value=entries), step)


def _tensorboard(path: Path):
    if jax.process_index() != 0:
        return None
    from tensorboardX import SummaryWriter
    return SummaryWriter(str(path), flush_secs=10)
