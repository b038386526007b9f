"""A task whose scoring stalls on request: a reward environment that stops answering in time (a
busy verifier, a saturated sandbox), for fault drills (``tools/chaos.py``) and tests of
``rollout.score_timeout_s``.

While the JSON file ``control`` holds ``{"delay_s": X, "until": T}`` (``T`` in seconds since the
epoch, in the future), every score first waits ``X`` seconds; otherwise it is the task's own
score. The file is read at most twice a second; a missing or malformed file means no delay.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, ClassVar

from rl_jax.data.prompts import Prompt
from rl_jax.envs.base import EnvError, Environment, PromptLike

MAX_DELAY_S = 3600.0


class DelayedEnv(Environment):
    """Args: ``task``, the single-turn environment (``rl_jax.envs.get("delayed", task=NAME,
    task_kwargs={...}, control=...)`` builds it from its name); ``control``: the file that
    switches the delay on."""

    name: ClassVar[str] = "delayed"

    def __init__(self, task: Environment | None = None, *, control: str = ""):
        if not control:
            raise EnvError("delayed: give the control file's path (control=...)")
        self.task = task
        if not isinstance(task, Environment) or task.max_turns != 1:
            raise EnvError("delayed: the task must be a single-turn environment")
        self.control = str(control)
        self._read_at, self._delay, self._until = -1.0, 0.0, 0.0

    def prompt(self, index: int, split: str = "train") -> Prompt:
        return self.task.prompt(index, split)

    def __getattr__(self, name: str):  # the task's own attributes (ALPHABET, EOS_TEXT, ...)
        if name.startswith("_") or name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)

    def delay_s(self) -> float:
        """The delay now in force (seconds)."""
        now = time.monotonic()
        if now - self._read_at > 0.5:
            self._read_at = now
            try:
                with open(self.control, "rb") as f:
                    spec = json.loads(f.read(4096))
                delay, until = float(spec["delay_s"]), float(spec["until"])
                self._delay = delay if 0 <= delay <= MAX_DELAY_S else 0.0
                self._until = until
            except (OSError, ValueError, KeyError, TypeError):
                self._delay, self._until = 0.0, 0.0
        return self._delay if time.time() < self._until else 0.0

    async def score(self, prompt: PromptLike, completion: str) -> tuple[float, dict[str, Any]]:
        delay = self.delay_s()
        if delay:
            await asyncio.sleep(delay)
        return await self.task.score(prompt, completion)

    async def close(self) -> None:
        await self.task.close()
