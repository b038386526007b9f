"""Getting each new policy version from the trainer to the generator pool.

After every optimizer step the trainer calls :meth:`WeightSync.publish` (in its own thread: the
publisher reshards and stages the parameters before the next step donates them). A worker thread
then brings the servers to that version:

* in flight (``async``): at once; each server pulls the version and swaps it in between two decode
  steps, running sequences keep their KV cache and continue under the new weights;
* at batch boundaries (``one_step_off``, ``sync``): once the rollout has no admitted group still
  generating, so every sample of a batch comes from one version.

Two delivery methods: ``transfer`` (this project's servers pull from the
:class:`~rl_jax.transfer.publisher.core.Publisher` over shared memory, sockets or ``jax.experimental.transfer``)
and ``disk`` (the publisher writes an HF checkpoint and every server, SGLang's included, loads it
with ``/update_weights_from_disk``). When every server runs the version, the rollout's staleness
gate is told (``set_generator_version``), which lets it admit prompts against the new bound.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rl_jax.errors import UserError
from rl_jax.generator.client.control import GeneratorUnavailable
from rl_jax.transfer.publisher.core import Publisher

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """The generators could not be brought to a new version."""


class StagingSpaceStop(WeightSyncError, UserError):
    """A version found no room in the publisher's staging directory (a full ``/dev/shm``) and
    no transport to fall back to: the run stops with this one line (no traceback), its
    checkpoints as they were."""

    def with_checkpoints(self, checkpointer: Any) -> StagingSpaceStop:
        """This error with where the run's checkpoints stand, once the saves in flight have
        finished (the last one is kept as it is)."""
        checkpointer.wait()
        latest = checkpointer.latest_step()
        kept = (f"its last checkpoint (step {latest}, in {checkpointer.directory}) is kept and "
                "the run resumes from it" if latest is not None else "no checkpoint was written")
        return StagingSpaceStop(f"{self}; the run stopped: {kept}")


@contextlib.contextmanager
def stop_naming_checkpoints(checkpointer: Any):
    """Re-raises a :class:`StagingSpaceStop` with where ``checkpointer``'s checkpoints stand."""
    try:
        yield
    except StagingSpaceStop as e:
        raise e.with_checkpoints(checkpointer) from None


class WeightSync:
    """Publishes versions and applies them to the generator pool (see the module docstring).

    Args:
      publisher: the trainer's weight publisher.
      client: a ``GeneratorClient`` living on ``loop``.
      loop: a :class:`~rl_jax.orchestrator.pool.BackgroundLoop` running the client.
      method: ``"transfer"`` or ``"disk"``.
      update_when_idle: wait until ``generation_idle()`` before applying a version.
      generation_idle: whether no admitted rollout work is still generating.
      on_applied: called with the version every server now runs.
      timeout_s: most seconds one update may take.
    """

    def __init__(self, publisher: Publisher, client: Any, loop: Any, *, method: str = "transfer",
                 update_when_idle: bool = False,
                 generation_idle: Callable[[], bool] = lambda: True,
                 on_applied: Callable[[int], None] = lambda v: None, timeout_s: float = 300.0,
                 transport: str = "auto"):
        if method not in ("transfer", "disk"):
            raise ValueError(f"method must be 'transfer' or 'disk', got {method!r}")
        self.publisher, self.client, self.loop = publisher, client, loop
        self.method = method
        self.update_when_idle = update_when_idle
        self.generation_idle = generation_idle
        self.on_applied = on_applied
        self.timeout_s = timeout_s
        self.transport = None if transport == "auto" else transport  # the servers' pulls
        self.applied: int | None = None
        self.published: int | None = None
        self.error: BaseException | None = None
        self.totals: collections.Counter = collections.Counter()
        self.last: dict[str, float] = {}
        self._cond = threading.Condition()
        # Held while a version is applied and while the pool's membership changes
        # (:mod:`rl_jax.orchestrator.fleet`): a server joins between two updates, at the
        # version every server runs, and takes every later update.
        self.membership = threading.RLock()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="weight-sync", daemon=True)
        self._thread.start()

    # ---- trainer side -------------------------------------------------------------------------

    def publish(self, params: Any, version: int) -> dict[str, float]:
        """Stages ``params`` as ``version`` (returns once the trainer may reuse their buffers)
        and hands the version to the worker."""
        self._raise_error()
        stats = self.publisher.publish(params, int(version))
        if stats.out_of_space:
            reason = " ".join(stats.errors[stats.out_of_space[0]].split())
            raise StagingSpaceStop(
                f"version {version} could not be staged for the generators: {reason}. Give "
                "the run a staging directory with room (transfer.staging_dir) or a transport "
                "that needs none as a fallback (add 'disk' to transfer.transports)")
        if stats.errors:
            raise WeightSyncError(f"version {version} could not be prepared for some "
                                  f"generators: {stats.errors}")
        with self._cond:
            self.published = int(version)
            self.totals["publishes"] += 1
            self.totals["publish_s"] += stats.seconds
            self.totals["bytes"] += sum(stats.bytes.values())
            self.last.update(publish_s=stats.seconds, bytes=float(sum(stats.bytes.values())))
            self._cond.notify_all()
        return {"publish_s": stats.seconds}

    def wait_applied(self, version: int, timeout: float | None = None) -> None:
        """Blocks until every server runs ``version`` or newer."""
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._cond:
            while self.applied is None or self.applied < version:
                self._raise_error()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WeightSyncError(f"the generators did not reach version {version} "
                                          f"within {self.timeout_s:.0f} s (at {self.applied})")
                self._cond.wait(min(remaining, 0.5))

    def poke(self):
        """Re-checks ``generation_idle`` now (the rollout calls it when work finishes)."""
        with self._cond:
            self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        with self._cond:
            return {"weights/publish_s": self.last.get("publish_s", 0.0),
                    "weights/update_s": self.last.get("update_s", 0.0),
                    "weights/total_s": self.last.get("publish_s", 0.0) +
                    self.last.get("update_s", 0.0),
                    "weights/versions_skipped": float(self.totals["skipped"]),
                    "weights/bytes": self.last.get("bytes", 0.0),
                    "weights/generator_version": float(-1 if self.applied is None
                                                       else self.applied)}

    def close(self):
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _raise_error(self):
        if self.error is not None:
            raise WeightSyncError(f"weight update failed: {self.error}") from self.error

    # ---- worker ---------------------------------------------------------------------------------

    def _due(self) -> int | None:
        """The version to apply now, if any (caller holds the lock)."""
        if self.published is None or (self.applied is not None and
                                      self.applied >= self.published):
            return None
        if self.update_when_idle and not self.generation_idle():
            return None
        return self.published

    def _work(self):
        while True:
            with self._cond:
                while not self._closed and self._due() is None:
                    self._cond.wait(0.01 if self.update_when_idle else 0.5)
                if self._closed:
                    return
                version = self._due()
            start = time.perf_counter()
            try:
                with self.membership:
                    reached = self._apply(version)
            except Exception as e:  # surfaced in the trainer thread
                log.exception("weight update to version %d failed", version)
                with self._cond:
                    self.error = e
                    self._cond.notify_all()
                return
            seconds = time.perf_counter() - start
            with self._cond:
                if self.applied is not None:
                    self.totals["skipped"] += max(reached - self.applied - 1, 0)
                self.applied = reached
                self.totals["updates"] += 1
                self.totals["update_s"] += seconds
                self.last["update_s"] = seconds
                self._cond.notify_all()
            self.on_applied(reached)

    def _apply(self, version: int) -> int:
        """Brings every server up to ``version`` (or newer); returns the lowest version now
        served."""
        if self.method == "disk":
            with self.publisher.holding_disk(version) as path:  # not dropped while loading
                self.loop.run(self.client.update_weights_from_disk(path, version),
                              timeout=self.timeout_s)
            return version
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                versions = self.loop.run(self.client.update_weights_from_transfer(
                    version, publisher_url=self.publisher.url,
                    wait_s=max(min(30.0, remaining), 0.0), transport=self.transport),
                    timeout=self.timeout_s)
            except GeneratorUnavailable as e:
                # Every server down (e.g. one restarting): a restarted server pulls the newest
                # version itself; keep asking until one answers.
                if time.monotonic() > deadline:
                    raise
                self.totals["unavailable_retries"] += 1
                log.warning("no generator server took version %d yet: %s", version, e)
                time.sleep(1.0)
                continue
            if not versions:
                raise WeightSyncError(f"no generator server confirmed version {version}")
            low = min(versions.values())
            if low >= version:
                return low
            # A server still pulling (a large version on a busy host) answers with the version it
            # runs; asking again is idempotent, so wait for it up to the update's time limit.
            if time.monotonic() > deadline:
                raise WeightSyncError(f"servers did not reach version {version} within "
                                      f"{self.timeout_s:.0f} s: {versions}")
            self.totals["slow_retries"] += 1
            log.warning("servers at %s, waiting for version %d", versions, version)
