"""Train-state checkpoints with orbax ``CheckpointManager``: asynchronous, keep N, every K steps,
restorable onto another mesh (the restore target carries the new shardings).

A LoRA state's frozen base (``TrainState.frozen``) is not written: a checkpoint holds the
adapters, their optimizer state and the counters, and a restore takes the base from its target.

A save that finds no room (a full disk or quota: ``ENOSPC``, ``EDQUOT``, ``EFBIG``) is logged and
skipped, and the run goes on: the checkpoints already written stay as they are (a save never
removes the last complete one before its replacement is complete), its partial files are
removed, and the next save tries again. Any other error is raised.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from rl_jax.errors import UserError
from rl_jax.trainer.state import TrainState

log = logging.getLogger(__name__)


class CheckpointRestoreError(UserError, RuntimeError):
    """No checkpoint in a directory could be restored."""


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk or quota is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in SPACE_ERRNOS:
            return True
        if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _state_dict(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "skipped": state.skipped}


class Checkpointer:
    """Saves and restores :class:`TrainState` plus a JSON metadata dict (e.g. data position).

    Args:
      directory: where step directories are written.
      keep: how many most recent checkpoints to keep.
      every: save only steps divisible by this (``save(..., force=True)`` overrides).
      use_async: write in the background; the train loop continues immediately.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, every: int = 1,
                 use_async: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every,
            enable_async_checkpointing=use_async, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "metadata"))
        self.failed_saves = 0  # saves skipped for want of space

    def save(self, step: int, state: TrainState, metadata: dict[str, Any] | None = None, *,
             force: bool = False) -> bool:
        """Starts saving; returns whether a checkpoint is being written for ``step`` (False
        also when this save, or the background write of the one before, found no room)."""
        try:
            return self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(_state_dict(state)),
                metadata=ocp.args.JsonSave(metadata or {})), force=force)
        except Exception as e:
            if not out_of_space(e):
                raise
            self._skipped(step, e)
            return False

    def _skipped(self, step: int | None, error: BaseException):
        self.failed_saves += 1
        for partial in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        log.error("a checkpoint%s was not written, the disk has no room (%s); the run goes on "
                  "and the next save tries again; the newest complete checkpoint is step %s",
                  "" if step is None else f" of step {step}", str(error).splitlines()[0][:200],
                  self.latest_step())

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` (without ``force``) writes a checkpoint for ``step``."""
        return self._manager.should_save(step)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, target: TrainState, step: int | None = None
                ) -> tuple[TrainState, dict[str, Any], int]:
        """Restores onto ``target`` (a TrainState of ``ShapeDtypeStruct``s with shardings; see
        ``rl_jax.trainer.state.abstract_state``), which may describe a different mesh. A LoRA
        target's ``frozen`` must hold the base's arrays (they are not in checkpoints), e.g.
        ``abstract_state(tx, spec).replace(frozen=base)``.

        With ``step=None`` the newest checkpoint is used; if it is unreadable (a crash in the
        middle of a write, a corrupt file), older ones are tried, each failure logged.
        Returns ``(state, metadata, step)``.
        """
        self.wait()
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target.frozen)):
            raise CheckpointRestoreError(
                "checkpoints hold no frozen base weights: restore onto a target whose frozen "
                "weights are the base's arrays (abstract_state(...).replace(frozen=base))")
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            raise CheckpointRestoreError(f"no checkpoints in {self.directory}")
        errors = []
        for s in steps:
            try:
                restored = self._manager.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(_state_dict(target)),
                    metadata=ocp.args.JsonRestore()))
            except Exception as e:  # orbax raises many types for damaged files
                log.error("checkpoint %s/%s could not be restored: %s", self.directory, s, e)
                errors.append(f"step {s}: {type(e).__name__}: {e}")
                continue
            d = restored["state"]
            state = TrainState(step=d["step"], params=d["params"], opt_state=d["opt_state"],
                               skipped=d["skipped"], frozen=target.frozen)
            if errors:
                log.warning("restored older checkpoint step %d because newer ones failed", s)
            return state, dict(restored["metadata"] or {}), s
        raise CheckpointRestoreError(
            f"no checkpoint in {self.directory} could be restored:\n  " + "\n  ".join(errors))

    def wait(self):
        """Blocks until background saves have finished (one that found no room is skipped)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if not out_of_space(e):
                raise
            self._skipped(None, e)

    def close(self):
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
