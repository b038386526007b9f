"""Attempts of a prompt's generation, each with its own request id, so that a group is taken
into training once: from its current attempt, never from one it was issued again after.

A prompt is issued again when its attempt failed or the generator server it ran on left the
pool. An attempt that was superseded may still deliver completions (a removed server that
answers after all, a task that outlived its re-issue); :meth:`Attempts.accept` refuses them.
"""

from __future__ import annotations

import collections
import threading


class Attempts:
    """The current attempt of every prompt position (thread-safe).

    A rollout task takes ``current(position)`` and puts it into its request ids;
    ``supersede(position)`` retires that attempt (the prompt is issued again under the next);
    ``accept(position, attempt)`` is True once, for the current attempt's completions, and
    False for a superseded attempt or a second delivery (accepting retires the attempt too, so
    request ids are never reused)."""

    def __init__(self):
        self._current: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def current(self, position: int) -> int:
        with self._lock:
            return self._current[position]

    def supersede(self, position: int) -> int:
        """Retires the current attempt of ``position``; returns the next one."""
        with self._lock:
            self._current[position] += 1
            return self._current[position]

    def accept(self, position: int, attempt: int) -> bool:
        """Whether completions of ``attempt`` of ``position`` may be trained on: True the first
        time for the current attempt, False for a superseded attempt or a repeat."""
        with self._lock:
            if attempt != self._current[position]:
                return False
            self._current[position] += 1
            return True
