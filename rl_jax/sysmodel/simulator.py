"""Discrete-event simulation of a trainer pool and a generator pool in the three modes.

What is simulated (times in seconds, lengths in tokens):

- *Generators*: ``num_servers`` servers with ``slots_per_server`` slots each, continuous
  batching. Every decode step advances each active sequence by one token and takes
  ``latency.step_seconds(active, mean_context)``. A sample waiting for a slot starts at the next
  step boundary; the step that starts samples also pays their prefill
  (``prompt_len · prefill_s_per_token`` each). A sample's first token is sampled by the weights
  the server holds when it starts, so that version is the oldest in the sample.
- *Trainer*: consumes one batch of ``groups_per_batch`` groups (``group_size`` samples of one
  prompt) per optimizer step, taking ``trainer.step_seconds(tokens)``; the version counts steps.
  A group's tokens are its completions and its prompt once per sample, or once per group with
  ``shared_prompts`` (``rollout.share_prompts``: the prompt packed once, its completions
  attending to it).
  New weights reach every server ``weight_transfer_s`` after a step ends. A group is ready to
  train ``group_overhead_s`` after its last sample ends (the client's HTTP, decoding, scoring).
- *Modes*:
  ``sync``: admit a batch, generate all of it, train, transfer, repeat (staleness 0).
  ``colocated``: as ``sync``, on one pool of chips that generates, then trains
  (:mod:`rl_jax.sysmodel.cluster`): ``weight_transfer_s`` is then the phase switch (the
  engine's and the trainer's memory swapped, the new weights copied into the engine).
  ``one_step_off``: batch ``k+1`` is generated while batch ``k`` trains; servers take new weights
  only between batches; batch ``k+1`` starts once batch ``k`` is generated and the weights of
  version ``k`` reached the servers (staleness <= 1).
  ``async``: groups are admitted whenever the pool has a free slot and the ``max_lag`` rule
  allows: a group admitted while every server holds version ``>= g`` must be consumed by trainer
  version ``g + max_lag`` (its deadline), so admission stops while the groups not yet consumed
  with deadline ``<= d`` would exceed ``(d − v + 1) · groups_per_batch``; the trainer takes the
  batch the staleness gate would (:func:`rl_jax.rollout.staleness.deadline_batch`: the
  earliest-deadline completed groups, waiting for one still generating only when its deadline
  leaves no later batch to take it). New weights are swapped
  in flight at the next decode step boundary, pausing that server ``swap_pause_s``.

Staleness is recorded per group at consumption: trainer version minus the oldest token version of
its samples. The run stops when the trainer has taken ``num_steps`` steps.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from typing import Any

import numpy as np

from rl_jax.rollout.staleness import deadline_batch
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.latency import DecodeLatency, TrainerModel
from rl_jax.sysmodel.lengths import LengthDistribution, SequenceLengths

MODES = ("sync", "one_step_off", "async", "colocated")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A run to simulate (see the module docstring for the meaning of each field)."""

    mode: str
    prompt_len: int
    group_size: int
    groups_per_batch: int
    max_lag: int
    num_servers: int
    slots_per_server: int
    num_steps: int = 16
    weight_transfer_s: float = 0.0
    swap_pause_s: float = 0.0
    prefill_s_per_token: float = 0.0
    group_overhead_s: float = 0.0
    shared_group_length: bool = False  # every sample of a group has one length (per prompt)
    shared_prompts: bool = False  # a group's prompt is trained once, not once per sample
    warmup_steps: int | None = None  # steps left out of the steady-state rate; None: auto
    seed: int = 0
    timeline_bins: int = 200

    def __post_init__(self):
        if self.mode not in MODES:
            raise SysModelError(f"unknown mode {self.mode!r}; choose one of {MODES}")
        for name in ("group_size", "groups_per_batch", "num_servers", "slots_per_server",
                     "num_steps", "timeline_bins"):
            if getattr(self, name) < 1:
                raise SysModelError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_len < 0:
            raise SysModelError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.max_lag < 0:
            raise SysModelError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.mode == "one_step_off" and self.max_lag < 1:
            raise SysModelError("one_step_off trains on samples one step old: it needs "
                                f"max_lag >= 1, got {self.max_lag}")
        for name in ("weight_transfer_s", "swap_pause_s", "prefill_s_per_token",
                     "group_overhead_s"):
            if getattr(self, name) < 0:
                raise SysModelError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return min(self.warmup_steps, self.num_steps - 1)
        return min(2, self.num_steps // 4)


@dataclasses.dataclass
class SimResult:
    """Predictions of one simulated run. Rates are over the whole run (from time 0 to the end of
    the last step) unless named ``steady_``; idle fractions are shares of that time."""

    mode: str
    steps: int
    wall_s: float
    tokens_per_s: float  # trained tokens (prompt + completion) per second
    completion_tokens_per_s: float
    samples_per_s: float
    steady_tokens_per_s: float  # after the warm-up steps
    step_s: float  # mean optimizer-step interval after warm-up
    trainer_idle_fraction: float
    generator_idle_fraction: float  # share of server-time with no sequence decoding
    generator_slot_utilisation: float  # mean share of slots decoding
    staleness_mean: float
    staleness_max: int
    staleness_histogram: dict[int, int]
    step_end_s: list[float]
    timeline: dict[str, list[float]]  # t (bin centres), trainer_busy, generator_slots

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["staleness_histogram"] = {str(k): v for k, v in self.staleness_histogram.items()}
        if not timeline:
            out.pop("timeline")
            out.pop("step_end_s")
        return out


class _Sample:
    __slots__ = ("group", "length", "end", "start", "version")

    def __init__(self, group: "_Group", length: int):
        self.group, self.length = group, length
        self.end = self.start = self.version = -1


class _Group:
    __slots__ = ("order", "batch", "deadline", "remaining", "min_version", "tokens",
                 "completion_tokens", "completed_order", "ready")

    def __init__(self, order: int, batch: int, deadline: int, lengths: np.ndarray,
                 prompt_len: int, shared_prompt: bool = False):
        self.order, self.batch, self.deadline = order, batch, deadline
        self.remaining = len(lengths)
        self.min_version = math.inf
        self.completion_tokens = int(lengths.sum())
        self.tokens = self.completion_tokens + prompt_len * (1 if shared_prompt
                                                             else len(lengths))
        self.completed_order = -1
        self.ready = False

    @property
    def complete(self) -> bool:
        """Every sample generated and the group handed over to the trainer's side."""
        return self.ready


class _Server:
    def __init__(self, index: int):
        self.index = index
        self.version = 0
        self.pending: int | None = None  # newest version delivered, not yet applied
        self.active: list[tuple[int, int, _Sample]] = []  # heap by end counter
        self.queue: collections.deque[_Sample] = collections.deque()
        self.counter = 0  # decode steps taken
        self.start_sum = 0  # Σ start counters of active samples (for the mean context)
        self.busy = False
        self.token = 0  # invalidates superseded segment-end events
        self.seg_start = self.seg_extra = self.seg_step = 0.0
        self.seg_steps = 0
        self.intervals: list[tuple[float, float, int]] = []  # (start, end, active sequences)

    @property
    def load(self) -> int:
        return len(self.active) + len(self.queue)


class _Simulation:
    def __init__(self, cfg: SimConfig, latency: DecodeLatency, trainer: TrainerModel,
                 lengths: LengthDistribution):
        cap = latency.max_batch
        if cap is not None and cfg.slots_per_server > cap:
            raise SysModelError(f"slots_per_server={cfg.slots_per_server} exceeds what the KV "
                                f"cache holds ({cap} sequences)")
        if isinstance(lengths, SequenceLengths):
            lengths = lengths.restart()  # every simulation replays from the first
        self.cfg, self.latency, self.trainer, self.lengths = cfg, latency, trainer, lengths
        self.rng = np.random.default_rng(cfg.seed)
        self.servers = [_Server(i) for i in range(cfg.num_servers)]
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.version = 0  # trainer version: optimizer steps applied
        self.training = False
        self.unconsumed: collections.OrderedDict[int, _Group] = collections.OrderedDict()
        self.group_order = itertools.count()
        self.completed_order = itertools.count()
        self.batches_admitted = 0
        self.outstanding = 0  # admitted samples not finished
        self.train_intervals: list[tuple[float, float]] = []
        self.step_end: list[float] = []
        self.step_tokens: list[tuple[int, int, int]] = []  # (tokens, completion tokens, samples)
        self.staleness: collections.Counter = collections.Counter()

    # ---- event queue --------------------------------------------------------------------------

    def push(self, time: float, kind: str, *payload):
        heapq.heappush(self.events, (time, next(self.seq), kind, payload))

    def run(self) -> SimResult:
        self.admit()
        while self.events and len(self.step_end) < self.cfg.num_steps:
            self.now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"on_{kind}")(*payload)
            self.admit()
        if len(self.step_end) < self.cfg.num_steps:
            raise SysModelError(f"simulation stalled after {len(self.step_end)} of "
                                f"{self.cfg.num_steps} steps ({self.cfg.mode})")
        return self.result()

    # ---- generator servers --------------------------------------------------------------------

    def kick(self, s: _Server):
        """Let ``s`` act on new work or weights: start a segment if idle, else end the current
        one at the next step boundary."""
        if not s.busy:
            self.start_segment(s)
            return
        elapsed = self.now - s.seg_start - s.seg_extra
        steps = 0 if elapsed <= 0 else min(int(elapsed / s.seg_step + 1e-9) + 1, s.seg_steps)
        if steps < s.seg_steps:
            s.token += 1
            s.seg_steps = steps
            self.push(s.seg_start + s.seg_extra + steps * s.seg_step, "segment_end", s, s.token,
                      steps)

    def wants_kick(self, s: _Server) -> bool:
        free = len(s.active) < self.cfg.slots_per_server and s.queue
        return bool(free) or (s.pending is not None and self.cfg.mode == "async")

    def start_segment(self, s: _Server):
        cfg = self.cfg
        extra = 0.0
        # Async swaps weights in flight; the other modes only between batches (server empty).
        if s.pending is not None and (cfg.mode == "async" or not (s.active or s.queue)):
            if s.active:
                extra += cfg.swap_pause_s  # in-flight swap between two decode steps
            s.version, s.pending = s.pending, None
        started = 0
        while s.queue and len(s.active) < cfg.slots_per_server:
            sample = s.queue.popleft()
            sample.start, sample.version = s.counter, s.version
            sample.end = s.counter + sample.length
            sample.group.min_version = min(sample.group.min_version, s.version)
            heapq.heappush(s.active, (sample.end, next(self.seq), sample))
            s.start_sum += s.counter
            started += 1
        extra += started * cfg.prompt_len * cfg.prefill_s_per_token
        if not s.active:
            s.busy = False
            return
        batch = len(s.active)
        steps = s.active[0][0] - s.counter
        context = cfg.prompt_len + s.counter - s.start_sum / batch + steps / 2
        step_s = self.latency.step_seconds(batch, context)
        s.busy, s.token = True, s.token + 1
        s.seg_start, s.seg_extra, s.seg_step, s.seg_steps = self.now, extra, step_s, steps
        self.push(self.now + extra + steps * step_s, "segment_end", s, s.token, steps)

    def on_segment_end(self, s: _Server, token: int, steps: int):
        if token != s.token:
            return
        s.intervals.append((s.seg_start, self.now, len(s.active)))
        s.counter += steps
        s.busy = False
        while s.active and s.active[0][0] <= s.counter:
            _, _, sample = heapq.heappop(s.active)
            s.start_sum -= sample.start
            self.finish(sample)
        if not s.busy:
            self.start_segment(s)

    def finish(self, sample: _Sample):
        self.outstanding -= 1
        group = sample.group
        group.remaining -= 1
        if group.remaining == 0:
            if self.cfg.group_overhead_s > 0:
                self.push(self.now + self.cfg.group_overhead_s, "group_ready", group)
            else:
                self.on_group_ready(group)

    def on_group_ready(self, group: "_Group"):
        group.ready = True
        group.completed_order = next(self.completed_order)
        self.try_train()

    def on_weights(self, version: int):
        for s in self.servers:
            s.pending = version if s.pending is None else max(s.pending, version)
            if self.cfg.mode == "async" or not (s.active or s.queue):
                self.kick(s)

    # ---- admission ----------------------------------------------------------------------------

    def generator_version(self) -> int:
        return min(s.version for s in self.servers)

    def admit(self):
        cfg = self.cfg
        if cfg.mode in ("sync", "colocated"):
            if (not self.training and not self.unconsumed
                    and self.batches_admitted == self.version
                    and all(s.version == self.version for s in self.servers)):
                self.admit_groups(cfg.groups_per_batch, deadline=self.version)
        elif cfg.mode == "one_step_off":
            j = self.batches_admitted
            previous_done = all(g.complete for g in self.unconsumed.values() if g.batch == j - 1)
            if (j == 0 or previous_done) and self.generator_version() >= j - 1 \
                    and j <= self.version + 1 and all(not s.queue for s in self.servers):
                self.admit_groups(cfg.groups_per_batch, deadline=j)
        else:
            total_slots = cfg.num_servers * cfg.slots_per_server
            # Trainer versions c .. g + max_lag are left for groups of deadline g + max_lag,
            # where c counts the batches already taken (one more than the version while a
            # step trains: that step's batch has used version `self.version`).
            g = self.generator_version()
            taken = self.version + int(self.training)
            room = (g + cfg.max_lag - taken + 1) * cfg.groups_per_batch - len(self.unconsumed)
            if room > 0 and self.outstanding < total_slots:
                count = min(room, -(-(total_slots - self.outstanding) // cfg.group_size))
                self.admit_groups(count, deadline=g + cfg.max_lag)

    def admit_groups(self, count: int, deadline: int):
        cfg = self.cfg
        kicked = set()
        for _ in range(count):
            lengths = (np.repeat(self.lengths.sample(self.rng, 1), cfg.group_size)
                       if cfg.shared_group_length else self.lengths.sample(self.rng, cfg.group_size))
            group = _Group(next(self.group_order), self.batches_admitted, deadline, lengths,
                           cfg.prompt_len, cfg.shared_prompts)
            self.unconsumed[group.order] = group
            for length in lengths:
                server = min(self.servers, key=lambda s: s.load)
                server.queue.append(_Sample(group, int(length)))
                kicked.add(server.index)
            self.outstanding += cfg.group_size
        if cfg.mode != "async":
            self.batches_admitted += 1
        for i in sorted(kicked):
            if self.wants_kick(self.servers[i]):
                self.kick(self.servers[i])

    # ---- trainer ------------------------------------------------------------------------------

    def choose_batch(self) -> list[_Group] | None:
        need = self.cfg.groups_per_batch
        if len(self.unconsumed) < need:
            return None
        ordered = list(self.unconsumed.values())
        if self.cfg.mode == "async":  # the staleness gate's own choice
            return deadline_batch(ordered, need, self.version, complete=lambda g: g.complete)
        chosen = ordered[:need]
        return chosen if all(g.complete for g in chosen) else None

    def try_train(self):
        if self.training or len(self.train_intervals) >= self.cfg.num_steps:
            return
        batch = self.choose_batch()
        if batch is None:
            return
        for g in batch:
            del self.unconsumed[g.order]
            self.staleness[int(self.version - g.min_version)] += 1
        tokens = sum(g.tokens for g in batch)
        self.step_tokens.append((tokens, sum(g.completion_tokens for g in batch),
                                 len(batch) * self.cfg.group_size))
        seconds = self.trainer.step_seconds(tokens)
        self.training = True
        self.train_intervals.append((self.now, self.now + seconds))
        self.push(self.now + seconds, "train_end")

    def on_train_end(self):
        self.training = False
        self.version += 1
        self.step_end.append(self.now)
        self.push(self.now + self.cfg.weight_transfer_s, "weights", self.version)
        self.try_train()

    # ---- results ------------------------------------------------------------------------------

    def result(self) -> SimResult:
        cfg = self.cfg
        end = self.step_end[-1]
        tokens = np.asarray(self.step_tokens, float)
        w = cfg.warmup
        t0 = self.step_end[w - 1] if w > 0 else 0.0
        steady = tokens[w:, 0].sum() / (end - t0) if end > t0 else math.inf
        step_s = (end - t0) / (cfg.num_steps - w)
        train_busy = sum(min(b, end) - a for a, b in self.train_intervals if a < end)
        slot_time, busy_time = 0.0, 0.0
        for s in self.servers:
            for a, b, n in s.intervals:
                if a < end:
                    slot_time += (min(b, end) - a) * n
                    busy_time += min(b, end) - a
            if s.busy and s.seg_start < end:  # the segment running at the end
                slot_time += (end - s.seg_start) * len(s.active)
                busy_time += end - s.seg_start
        hist = dict(sorted(self.staleness.items()))
        count = sum(hist.values())
        return SimResult(
            mode=cfg.mode, steps=cfg.num_steps, wall_s=end,
            tokens_per_s=tokens[:, 0].sum() / end,
            completion_tokens_per_s=tokens[:, 1].sum() / end,
            samples_per_s=tokens[:, 2].sum() / end,
            steady_tokens_per_s=float(steady), step_s=float(step_s),
            trainer_idle_fraction=max(0.0, 1 - train_busy / end),
            generator_idle_fraction=max(0.0, 1 - busy_time / (cfg.num_servers * end)),
            generator_slot_utilisation=slot_time / (cfg.num_servers * cfg.slots_per_server * end),
            staleness_mean=sum(k * n for k, n in hist.items()) / count,
            staleness_max=max(hist), staleness_histogram=hist,
            step_end_s=list(self.step_end), timeline=self.timeline(end))

    def timeline(self, end: float) -> dict[str, list[float]]:
        """Per time bin: share of the bin the trainer computes, and share of all slots decoding."""
        bins = self.cfg.timeline_bins
        edges = np.linspace(0.0, end, bins + 1)
        trainer = np.diff(_integral(self.train_intervals, edges)) / np.diff(edges)
        decoding = [(a, b, n) for s in self.servers for a, b, n in s.intervals]
        slots = np.diff(_integral(decoding, edges)) / np.diff(edges)
        slots /= self.cfg.num_servers * self.cfg.slots_per_server
        return {"t": list((edges[:-1] + edges[1:]) / 2), "trainer_busy": list(trainer),
                "generator_slots": list(slots)}


def _integral(intervals: list[tuple], times: np.ndarray) -> np.ndarray:
    """``F(t) = Σ_i w_i · |[a_i, b_i) ∩ [0, t)|`` at each of ``times`` for intervals ``(a, b)``
    (weight 1) or ``(a, b, w)``: ``Σ_{a_i<t} w_i (t − a_i) − Σ_{b_i<t} w_i (t − b_i)``."""
    if not intervals:
        return np.zeros(len(times))
    arr = np.asarray(intervals, float)
    a, b = arr[:, 0], arr[:, 1]
    w = arr[:, 2] if arr.shape[1] > 2 else np.ones(len(arr))

    def ramp(starts):
        order = np.argsort(starts)
        s, ws = starts[order], w[order]
        cw = np.concatenate([[0.0], np.cumsum(ws)])
        cws = np.concatenate([[0.0], np.cumsum(ws * s)])
        k = np.searchsorted(s, times, side="left")
        return times * cw[k] - cws[k]

    return ramp(a) - ramp(b)


def simulate(cfg: SimConfig, latency: DecodeLatency, trainer: TrainerModel,
             lengths: LengthDistribution) -> SimResult:
    """Runs one simulation; see the module docstring."""
    return _Simulation(cfg, latency, trainer, lengths).run()
