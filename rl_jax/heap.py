"""Python's cyclic garbage collector in the long-running processes (trainer, generator servers).

A process that has imported JAX and compiled its programs tracks a few hundred thousand
container objects. A full (generation 2) collection traverses all of them, a large fraction of
a second on one CPU core (``docs/performance.md``), with the GIL held, so a server's scheduler
stops decoding and the trainer's loop stops feeding steps. Such a collection comes every few
seconds of allocation-heavy serving. :func:`freeze_long_lived` (once setup and warm-up are
done) moves everything alive then into the collector's permanent generation, so later
collections only look at what was made since.
Reference counting still frees frozen objects that are dropped; only reference cycles among
them are never collected.

:class:`GcMonitor` records how often each generation was collected and how long the pauses were.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def freeze_long_lived() -> int:
    """Collects once, then freezes every object alive (see the module doc); returns how many
    objects are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d long-lived objects out of the cyclic collector (%.2f s)", frozen,
             time.perf_counter() - start)
    return frozen


class GcMonitor:
    """Counts collections and their pauses per generation (via ``gc.callbacks``) from
    :meth:`install` until :meth:`uninstall`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # thread id -> start of its running collection
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = [0.0, 0.0, 0.0]

    def install(self) -> "GcMonitor":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self):
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]):
        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
            return
        start = self._started.pop(thread, None)
        if start is None:
            return
        generation, pause = info["generation"], now - start
        with self._lock:
            self.collections[generation] += 1
            self.pause_s[generation] += pause
            self.max_pause_s[generation] = max(self.max_pause_s[generation], pause)

    def stats(self) -> dict[str, Any]:
        """``{"frozen_objects", "collections", "pause_s", "max_pause_s"}`` (lists by generation
        0, 1, 2)."""
        with self._lock:
            return {"frozen_objects": gc.get_freeze_count(),
                    "collections": list(self.collections), "pause_s": list(self.pause_s),
                    "max_pause_s": list(self.max_pause_s)}
