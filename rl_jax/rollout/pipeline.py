"""The rollout stage: a grain ``IterDataset`` that keeps prompts in flight at the generator pool
and yields training batches whose staleness is bounded.

    prompts (MapDataset of (position, Prompt)) ─► RolloutDataset ─► .map(GroupsToBatch) ─► trainer
                                                     │  ▲
                                   GenerateRequest ──┘  └── completions, rewards (env)

A background thread runs an asyncio loop that admits prompts while the
:class:`~rl_jax.rollout.staleness.StalenessGate` allows, sends each as one request with ``n``
samples, scores the completions with the environment as they finish (out of order), and marks
the group complete. ``next()`` returns the groups the gate picks for the trainer's current
version. The orchestrator reports versions with :meth:`RolloutIterator.set_trainer_version`
(after each optimizer step) and :meth:`RolloutIterator.set_generator_version` (once every
generator runs a version).

Checkpointing: ``get_state()`` records the next prompt position and the positions admitted but
not yet trained (in flight, completed, or handed out in a batch whose optimizer step has not been
reported with ``set_trainer_version``); ``set_state()`` re-issues those first, so after a crash no
prompt is lost and none is trained twice except those in flight at the crash (generated again).

Beside it: :mod:`rl_jax.rollout.config` (:class:`RolloutConfig`, the settings),
:mod:`rl_jax.rollout.request_plan` (seeds and forced lengths of each request),
:mod:`rl_jax.rollout.episodes` (multi-turn episodes at the token level) and
:mod:`rl_jax.rollout.batching` (:class:`GroupsToBatch`, the map that packs groups into batches).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import Environment, score_many
from rl_jax.envs.shaping import SolveRateTracker
from rl_jax.generator.base import Generator
from rl_jax.generator.client.control import GeneratorUnavailable, ServerLeft
from rl_jax.generator.types import GenerateRequest
from rl_jax.rollout.attempts import Attempts
from rl_jax.rollout.config import RolloutConfig
from rl_jax.rollout.episodes import run_episode_tokens
from rl_jax.rollout.records import Group, Sample
from rl_jax.rollout.request_plan import mask_after_stop, prompt_seed, sample_seed, until_stop
from rl_jax.rollout.staleness import GateConfig, StalenessGate

log = logging.getLogger(__name__)


class RolloutIterator(grain.DatasetIterator):
    """Iterator of lists of :class:`Group` (one list per training batch)."""

    def __init__(self, prompts: grain.MapDataset, env: Environment, generator: Generator,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 config: RolloutConfig, state: dict[str, Any] | None = None,
                 encode_observation: Callable[[str], list[int]] | None = None,
                 close_generator: bool = False):
        super().__init__()
        self._close_generator = close_generator
        self._prompts = prompts
        self._encode_observation = encode_observation or encode
        self._env = env
        self._generator = generator
        self._encode = encode
        self._decode = decode
        self.config = config
        self._lock = threading.Condition()
        self._groups: dict[int, Group] = {}
        self._failures: collections.Counter = collections.Counter()
        self._attempts = Attempts()  # request ids stay unique; late completions are dropped
        self.solve_rates = None if config.solve_rate_window is None else SolveRateTracker(
            window=config.solve_rate_window)
        self._exhausted = False
        self._error: BaseException | None = None
        self._closed = False
        self.counts = collections.Counter()
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._drop_log = None if config.drop_log is None else open(
            config.drop_log, "a", buffering=1, encoding="utf-8")
        self._restore(state or {})

    def _record_drop(self, position: int, reason: str):
        """Notes a prompt dropped without training (call under the lock)."""
        if self._drop_log is not None:
            self._drop_log.write(json.dumps({"position": int(position), "reason": reason,
                                             "time": time.time()}) + "\n")

    def _restore(self, state: dict[str, Any]):
        cfg = self.config
        self.gate = StalenessGate(
            GateConfig(max_lag=cfg.max_lag, groups_per_batch=cfg.groups_per_batch,
                       policy=cfg.staleness_policy, max_in_flight_groups=cfg.max_in_flight_groups),
            trainer_version=int(state.get("trainer_version", 0)),
            generator_version=state.get("generator_version"))
        self._next_position = int(state.get("next_position", 0))
        self._reissue = collections.deque(int(p) for p in state.get("pending", []))
        if state.get("solve_rates") is not None and getattr(self, "solve_rates", None):
            self.solve_rates.load_state_dict(state["solve_rates"])

    def start(self):
        """Starts rolling out (the first ``next()`` does it too)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_loop, name="rollout",
                                                daemon=True)
                self._thread.start()

    # ---- control from the trainer side ------------------------------------------------------

    def set_trainer_version(self, version: int):
        """The trainer finished the optimizer step of the oldest batch ``next()`` handed out
        (call once per batch, also for a skipped step) and is now at ``version``."""
        with self._lock:
            self.gate.advance(version)
        self._poke()

    def set_generator_version(self, version: int):
        with self._lock:
            self.gate.set_generator_version(version)
        self._poke()

    def in_flight(self) -> int:
        """Admitted groups still generating."""
        with self._lock:
            return self.gate.in_flight

    def staleness(self, groups: list[Group]) -> list[int]:
        """Per-sample staleness of ``groups``: the version that consumes them (the one their
        batch was handed out for; the current one for groups not handed out) − the sample's
        oldest token version."""
        with self._lock:
            version = self.gate.trainer_version
        return [(version if g.consumed_by is None else g.consumed_by) - s.min_version
                for g in groups for s in g.samples]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {**self.gate.metrics(),
                    **{f"rollout/{k}": float(v) for k, v in self.counts.items()}}

    def close(self):
        if self._closed:
            return
        self._closed = True
        with self._lock:  # a next() waiting for a batch returns
            self._lock.notify_all()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._drop_log is not None:
            with self._lock:
                self._drop_log.close()
                self._drop_log = None

    # ---- grain iterator protocol ----------------------------------------------------------------

    def __next__(self) -> list[Group]:
        self.start()
        with self._lock:
            while True:
                if self._error is not None:
                    raise RuntimeError("rollout loop failed") from self._error
                if self._closed:
                    raise StopIteration
                version = self.gate.consumer_version
                keys = self.gate.next_batch()
                for key in self.gate.take_discarded():  # too stale to train: a recorded drop
                    self._groups.pop(key, None)
                    self._record_drop(key, "too_stale")
                if keys is not None:
                    groups = [self._groups.pop(k) for k in keys]
                    for g in groups:
                        g.consumed_by = version
                    break
                if self._exhausted and not self._reissue and self.gate.unconsumed < \
                        self.config.groups_per_batch and self.gate.in_flight == 0:
                    raise StopIteration
                self._lock.wait(timeout=1.0)
        self._poke()
        return groups

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            # Batches handed out but not trained yet (a prefetched one) are re-issued first.
            pending = [int(k) for k in self.gate.untrained_keys()] + list(self._reissue) + \
                [int(k) for k in self.gate.pending_keys()]
            return {"next_position": self._next_position, "pending": pending,
                    "trainer_version": self.gate.trainer_version,
                    "generator_version": self.gate.generator_version,
                    "solve_rates": None if self.solve_rates is None
                    else self.solve_rates.state_dict()}

    def set_state(self, state: dict[str, Any]):
        """Resumes from a ``get_state()``; only before the iterator has started (requests
        already sent to generators cannot be recalled)."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("set_state must be called before the first next(): this "
                                   "rollout has already sent requests")
            self._restore(state)

    # ---- background loop ------------------------------------------------------------------------

    def _poke(self):
        if self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def _run_loop(self):
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._admit_forever())
        except BaseException as e:  # surfaced to the trainer by __next__
            log.exception("rollout loop failed")
            with self._lock:
                self._error = e
                self._lock.notify_all()
        finally:
            self._loop.close()

    async def _admit_forever(self):
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        while not self._closed:
            while True:
                with self._lock:
                    position = self._take_position()
                    if position is None:
                        break
                task = asyncio.create_task(self._rollout(position))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            self._wake.clear()
            await self._wake.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Requests already sent keep running in the generators; stop them.
        for position in self.gate.pending_keys():
            try:
                for rid in self._rids(position):
                    await self._generator.abort(rid)
            except Exception as e:  # a dead server: nothing left to stop
                log.warning("could not abort prompt %s: %s", position, e)
        if self._close_generator:  # its connections belong to this loop
            await self._generator.close()

    def _take_position(self) -> int | None:
        """The next prompt position to admit, if the gate has room (call under the lock)."""
        if self.gate.capacity() < 1:
            if self._reissue or not self._exhausted:
                self.gate.counts["prevented"] += 1  # a prompt waits for the staleness bound
            return None
        if self._reissue:
            position = self._reissue.popleft()
        elif self._exhausted or self._next_position >= len(self._prompts):
            self._exhausted = True
            return None
        else:
            position = self._next_position
            self._next_position += 1
            if self.solve_rates is not None and self.solve_rates.should_skip(
                    self._prompt_key(position)):
                self.counts["skipped_solved_or_unsolved"] += 1
                self._record_drop(position, "solved_or_unsolved")
                return self._take_position()
        self.gate.admit(position)
        return position

    def _rid(self, position: int) -> str:
        return f"prompt-{position}-{self._attempts.current(position)}"

    def _rids(self, position: int) -> list[str]:
        """The request ids of the prompt's current attempt: one, or one per sample when each
        sample is its own request."""
        rid = self._rid(position)
        if self._request_per_sample:
            return [f"{rid}/{i}" for i in range(self.config.group_size)]
        return [rid]

    @property
    def _request_per_sample(self) -> bool:
        return self.config.length_of is not None and self.config.per_sample_lengths

    def _prompt_key(self, position: int) -> int:
        period = self.config.solve_rate_period
        return position % period if period else position

    async def _rollout(self, position: int):
        cfg = self.config
        attempt = self._attempts.current(position)
        try:
            element = self._prompts[position]
            prompt: Prompt = (element if isinstance(element, Prompt) else element[1]
                              if isinstance(element, tuple) else element.prompt)
            ids = self._encode(prompt.text)
            if getattr(self._env, "max_turns", 1) > 1:
                samples = list(await asyncio.gather(*(
                    self._episode(prompt, ids, position, i) for i in range(cfg.group_size))))
                scores = [(s.reward, s.info) for s in samples]
            else:
                samples, scores = await self._single_turn(prompt, ids, position)
            if any(not s.completion_ids for s in samples):
                raise RuntimeError(f"a completion of prompt {position} is empty "
                                   f"({[s.finish_reason for s in samples]})")
            group = Group(position=position, samples=samples, prompt=prompt)
            with self._lock:
                if not self._attempts.accept(position, attempt):
                    # The prompt was issued again meanwhile (its server left): the new
                    # attempt's completions are the ones trained on.
                    self.counts["late_completions_dropped"] += 1
                    return
                if self.solve_rates is not None:
                    self.solve_rates.update(self._prompt_key(position),
                                            [bool(info.get("correct")) for _, info in scores])
                if cfg.filter_zero_signal and np.ptp(group.rewards) == 0:
                    self.gate.cancel(position)
                    self.counts["filtered_zero_signal"] += 1
                    self._record_drop(position, "zero_signal")
                    self._lock.notify_all()
                    self._wake.set()
                    return
                self._groups[position] = group
                self.gate.complete(position, group.min_version)
                self.counts["groups"] += 1
                self.counts["samples"] += len(samples)
                self.counts["completion_tokens"] += sum(len(s.completion_ids) for s in samples)
                self._lock.notify_all()
        except asyncio.CancelledError:
            raise
        except ServerLeft as e:
            # The server left the pool (removed or down) with the request in flight: issued
            # again at once under a new attempt, not counted as the prompt's failure.
            log.info("prompt %d issued again: %s", position, e)
            self._attempts.supersede(position)
            with self._lock:
                self.gate.cancel(position)
                self.counts["reissued_server_left"] += 1
                self._reissue.appendleft(position)
                self._lock.notify_all()
        except GeneratorUnavailable as e:
            # No server could take the request (all down or restarting): not the prompt's
            # fault, so it does not use up its retries; it waits and goes first again.
            log.warning("generator pool unavailable for prompt %d, retrying in %.1f s: %s",
                        position, cfg.unavailable_backoff_s, e)
            with self._lock:
                self.counts["generator_unavailable"] += 1
            self._attempts.supersede(position)
            await asyncio.sleep(cfg.unavailable_backoff_s)
            with self._lock:
                self.gate.cancel(position)
                self.counts["cancelled_unavailable"] += 1
                self._reissue.appendleft(position)
                self._lock.notify_all()
        except Exception as e:
            self._failures[position] += 1
            self._attempts.supersede(position)
            log.warning("rollout of prompt %d failed (%d/%d): %s", position,
                        self._failures[position], cfg.max_retries, e)
            with self._lock:
                self.gate.cancel(position)
                self.counts["failures"] += 1
                if self._failures[position] < cfg.max_retries:
                    self._reissue.append(position)
                else:
                    self.counts["skipped_prompts"] += 1
                    self._record_drop(position, "failed")
                self._lock.notify_all()
        self._wake.set()


    async def _single_turn(self, prompt: Prompt, ids: list[int], position: int):
        cfg = self.config
        sampling = dataclasses.replace(cfg.sampling, n=cfg.group_size,
                                       seed=prompt_seed(cfg.sampling.seed, position))
        start = time.perf_counter()
        if self._request_per_sample:
            # One request per sample, each with its own length and seed, sent together.
            requests = [GenerateRequest(ids, dataclasses.replace(
                sampling, n=1, max_new_tokens=int(cfg.length_of(position, i)), ignore_eos=True,
                seed=sample_seed(sampling.seed, position, i)), rid=rid)
                for i, rid in enumerate(self._rids(position))]
            outputs = [o for outs in await self._generator.generate_batch(requests) for o in outs]
        else:
            if cfg.length_of is not None:
                sampling = dataclasses.replace(
                    sampling, max_new_tokens=int(cfg.length_of(position, 0)), ignore_eos=True)
            outputs = await self._generator.generate(
                GenerateRequest(ids, sampling, rid=self._rid(position)))
        texts = [self._decode(until_stop(o.output_ids, cfg.score_until)) for o in outputs]
        scoring = score_many(self._env, [prompt] * len(outputs), texts)
        try:  # a stalled reward environment fails the attempt (retried), not the rollout
            scores = await asyncio.wait_for(scoring, cfg.score_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"scoring took longer than {cfg.score_timeout_s:g} s "
                               "(rollout.score_timeout_s)") from None
        # Seconds a group spends outside the generator's engine (queueing in the client, HTTP,
        # decoding, scoring), when the generator reports its own latency.
        engine_s = max((o.e2e_latency for o in outputs), default=0.0)
        if engine_s > 0:
            with self._lock:
                self.counts["client_overhead_s"] += time.perf_counter() - start - engine_s
                self.counts["timed_groups"] += 1
        if cfg.shaping is not None:
            scores = [(cfg.shaping.apply(r, len(o.output_ids),
                                         truncated=o.finish_reason.get("type") == "length"),
                       info) for (r, info), o in zip(scores, outputs)]
        # Forced lengths: tokens past the first stop token only shape the length distribution;
        # they are trained on (compute) with loss mask 0, so the policy learns what it scored.
        masks = [None if cfg.length_of is None or not cfg.score_until else
                 mask_after_stop(o.output_ids, cfg.score_until) for o in outputs]
        if cfg.overlong_filter:
            masks = [[0.0] * len(o.output_ids) if o.finish_reason.get("type") == "length"
                     else mask for o, mask in zip(outputs, masks)]
        samples = [Sample(group_id=position, prompt_ids=list(ids),
                          completion_ids=list(o.output_ids),
                          behaviour_logprobs=list(o.output_logprobs),
                          versions=list(o.output_versions),
                          finish_reason=o.finish_reason.get("type", "unknown"),
                          reward=float(r), info=info, loss_mask=mask)
                   for o, (r, info), mask in zip(outputs, scores, masks)]
        return samples, scores

    async def _episode(self, prompt: Prompt, ids: list[int], position: int, index: int
                       ) -> Sample:
        return await run_episode_tokens(
            self._generator, self._env, prompt, ids, self.config, position=position,
            index=index, rid=self._rid(position), decode=self._decode,
            encode_observation=self._encode_observation)


class RolloutDataset(grain.IterDataset):
    """grain stage over a prompt ``MapDataset``; iterate it to start rolling out.

    Args:
      prompts: ``MapDataset`` of ``Prompt``, ``(position, Prompt)`` or
        ``rl_jax.data.sources.PositionedPrompt`` (``prompt_dataset``); element ``i`` is the prompt
        at stream position ``i`` (shuffled, repeated and sharded before).
      env: scores completions.
      generator: any :class:`~rl_jax.generator.base.Generator` (in-process engine or servers).
      encode / decode: prompt text → token ids; completion token ids → text.
      encode_observation: environment text → token ids in multi-turn episodes (default:
        ``encode``).
      state: a ``get_state()`` of an earlier iterator, to resume.
      close_generator: close ``generator`` when the iterator closes (from the rollout's own
        event loop, where a ``GeneratorClient`` made its connections).
    """

    def __init__(self, prompts: grain.MapDataset, env: Environment, generator: Generator, *,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 config: RolloutConfig, state: dict[str, Any] | None = None,
                 encode_observation: Callable[[str], list[int]] | None = None,
                 close_generator: bool = False):
        super().__init__()
        self._args = (prompts, env, generator, encode, decode, config)
        self._state = state
        self._encode_observation = encode_observation
        self._close_generator = close_generator

    def __iter__(self) -> RolloutIterator:
        return RolloutIterator(*self._args, state=self._state,
                               encode_observation=self._encode_observation,
                               close_generator=self._close_generator)


