"""Policy snapshots during a run: every ``export.every`` optimizer steps the trainer's parameters
go to ``<workdir>/hf_steps/step_NNNNNN`` as an HF checkpoint, with ``snapshot.json`` (``version``,
``step``, ``wall_s``: the run's wall seconds when that version existed), so that learning can be
measured against wall time afterwards without evaluating inside the run (an eval on the servers
takes generator time from the rollout).

The trainer's thread only copies the parameters to host memory (they are donated to the next
step); converting and writing happen on this writer's own thread.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import jax

from rl_jax.models.hf import save_pretrained

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "hf_steps"
SNAPSHOT_META = "snapshot.json"


def snapshot_path(workdir: str | Path, version: int) -> Path:
    return Path(workdir) / SNAPSHOT_DIR / f"step_{version:06d}"


def list_snapshots(workdir: str | Path) -> list[tuple[dict[str, Any], Path]]:
    """The complete snapshots of a run, by version: ``(snapshot.json contents, directory)``."""
    out = []
    for path in sorted((Path(workdir) / SNAPSHOT_DIR).glob("step_*")):
        meta = path / SNAPSHOT_META
        if meta.is_file():  # written last: a directory without it is incomplete
            out.append((json.loads(meta.read_text()), path))
    return sorted(out, key=lambda item: item[0]["version"])


class SnapshotWriter:
    """Writes snapshots on a thread of its own, one at a time, in order.

    Args:
      spec: the run's ``ModelSpec`` (rebuilds the model from host parameters).
      tokenizer, dtype: as for :func:`rl_jax.models.hf.save_pretrained`.
      every: snapshot every this many versions (> 0).
    """

    def __init__(self, workdir: str | Path, spec, *, tokenizer, dtype, every: int):
        if every <= 0:
            raise ValueError(f"snapshots every {every} steps: must be > 0")
        self.workdir, self.spec, self.tokenizer, self.dtype = Path(workdir), spec, tokenizer, dtype
        self.every = every
        self.written = 0
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="snapshots", daemon=True)
        self._thread.start()

    def due(self, version: int) -> bool:
        return version % self.every == 0

    def submit(self, params: Any, *, version: int, step: int, wall_s: float):
        """Copies ``params`` to host memory (blocking until they are computed) and queues them."""
        self._raise()
        host = jax.device_get(params)
        self._queue.put((host, {"version": int(version), "step": int(step),
                                "wall_s": float(wall_s)}))

    def close(self):
        """Writes what is queued; raises the first write error."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def _raise(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a policy snapshot failed: {error}") from error

    def _run(self):
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            host, meta = item
            try:
                path = save_pretrained(self.spec.merge(host), snapshot_path(
                    self.workdir, meta["version"]), tokenizer=self.tokenizer, dtype=self.dtype)
                (path / SNAPSHOT_META).write_text(json.dumps(meta))
                self.written += 1
            except Exception as e:  # surfaced on the trainer's thread
                log.exception("policy snapshot of version %d failed", meta["version"])
                self._error = e
