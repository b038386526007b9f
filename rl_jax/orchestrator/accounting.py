"""Accounting of an RL run: where the trainer's seconds went, the generators' idle time and
CPU seconds, the per-step records (JSONL, TensorBoard, progress bar), the summary and the
progress plot (see :mod:`rl_jax.orchestrator.session`)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax import cpus
from rl_jax.generator.client.core import GeneratorClient
from rl_jax.metrics import MetricsWriter, plot_curves
from rl_jax.orchestrator.evaluation import EvalResult

log = logging.getLogger(__name__)

# Loss metrics worth a line in the log (after finalize_metrics), when the loss reports them.
LOSS_METRICS = ("loss", "grad_norm", "clipped_fraction", "ratio_mean", "ratio_max", "ratio_ess",
                "entropy_mean", "policy_kl_mean", "kl_mean", "tokens", "sequences", "skipped",
                "behaviour_ratio_ess", "behaviour_kl_mean", "m2_mean", "update_scale")


@dataclasses.dataclass
class Clock:
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

class Window:
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

def tb_scalars(tb, values: dict[str, Any], step: int):
    """The finite numbers of ``values`` as one TensorBoard event (a summary with one value per
    tag): a step's forty-odd metrics cost one protobuf and one write, not one each."""
    from tensorboardX.proto.summary_pb2 import Summary
    entries = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if entries:
        tb._get_file_writer().add_summary(Summary(value=entries), step)


def tensorboard(path: Path):
    if jax.process_index() != 0:
        return None
    from tensorboardX import SummaryWriter
    return SummaryWriter(str(path), flush_secs=10)


def write_step_record(writer: MetricsWriter, tb, bar, done: int, record: dict[str, Any],
                      staleness: list[int], last_eval: EvalResult | None):
    """A step's record to the JSONL log, TensorBoard and the progress bar."""
    writer.write(done, **record)
    if tb is not None:
        tb_scalars(tb, record, done)
        tb.add_histogram("staleness", np.asarray(staleness), done)
    bar.set_postfix(reward=f"{record['reward/mean']:.2f}",
                    acc=f"{record['rollout/accuracy']:.2f}",
                    **({"eval": f"{last_eval.accuracy:.2f}"} if last_eval else {}),
                    stale=int(record["staleness/batch_max"]),
                    **({"gen_tok_s": f"{record['generator/tokens_per_s']:.0f}"}
                       if "generator/tokens_per_s" in record else {}),
                    refresh=False)
    bar.update(1)


def generator_readings(loop: Any, control: GeneratorClient) -> dict[str, dict[str, Any]]:
    """Each generator server's CPU seconds per thread so far and its engine counters (this
    project's servers report them in ``/get_server_info``; SGLang's do not, and give nothing
    here): ``{url: {"cpu": {thread: s}, "counters": {name: count}}}``."""
    try:
        answers = loop.run(control.broadcast("GET", "/get_server_info"),
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


def cpu_spent(before, after) -> dict[str, Any]:
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


def plot_progress(path: Path, writer: MetricsWriter, title: str):
    """``progress.png``: rewards, held-out accuracy and staleness against wall time."""
    def by_wall(key):
        rows = [(r["wall_s"], r[key]) for r in writer.records
                if isinstance(r.get(key), (int, float)) and "wall_s" in r]
        if not rows:
            return np.zeros(0), np.zeros(0)
        x, y = zip(*rows)
        return np.asarray(x), np.asarray(y, float)

    plot_curves(path, [
        ("reward", [("train reward (mean)", *by_wall("reward/mean")),
                    ("train accuracy", *by_wall("rollout/accuracy"))]),
        ("held-out accuracy (greedy)", [("", *by_wall("eval/accuracy"))]),
        ("staleness (steps)", [("batch max", *by_wall("staleness/batch_max")),
                               ("batch mean", *by_wall("staleness/batch_mean"))]),
    ], title=title, xlabel="wall time (s)")
