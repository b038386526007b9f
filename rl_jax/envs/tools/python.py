"""A Python interpreter in the code environment's sandbox (:mod:`rl_jax.envs.sandbox`:
bubblewrap isolation, no network, no host files, limits on time, memory, processes and output).

With ``stateful=True`` the cells of one episode share their names: each call runs the episode's
earlier successful cells first (their output discarded), then the new one, in a fresh sandboxed
process, so no process outlives a call. Replayed cells run again: programs whose results depend
on time or randomness may see different values than the first time.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from rl_jax.envs.sandbox import Sandbox
from rl_jax.envs.sandbox.limits import SandboxLimits
from rl_jax.envs.tools.base import Tool, ToolError

MAX_CODE_CHARS = 8000

# Runs the earlier cells silently, then the new one; sources come as JSON on stdin so that no
# text of the policy's is ever spliced into the program.
_DRIVER = """
import contextlib, io, json, sys
_cells = json.loads(sys.stdin.read())
_names = {"__name__": "__main__"}
for _cell in _cells[:-1]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        exec(compile(_cell, "<earlier cell>", "exec"), _names)
exec(compile(_cells[-1], "<cell>", "exec"), _names)
"""


class PythonInterpreter(Tool):
    """Args (beside :class:`Tool`'s): ``stateful`` (earlier cells' names kept, default True),
    ``memory_mb`` and ``max_concurrency`` of the sandbox, ``isolation`` / ``min_isolation`` as
    :class:`~rl_jax.envs.sandbox.Sandbox` takes them."""

    name = "python"
    description = ("Runs a Python 3 program and returns what it prints (stdout; stderr when it "
                   "fails). No network or files outside its working directory.")
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "minLength": 1,
                                          "maxLength": MAX_CODE_CHARS}},
                  "required": ["code"], "additionalProperties": False}

    def __init__(self, *, stateful: bool = True, memory_mb: int = 256,
                 max_concurrency: int | None = None, isolation: str = "auto",
                 min_isolation: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.stateful = bool(stateful)
        # The sandbox's own wall limit ends the process tree; the call's limit is a little
        # longer so that the sandbox reports what happened.
        self.limits = SandboxLimits(wall_time=self.timeout_s * 0.9,
                                    cpu_time=self.timeout_s * 0.9,
                                    memory_bytes=max(memory_mb, 64) * 2**20,
                                    max_output_bytes=max(4 * self.max_output_chars, 4096))
        self._sandbox_args = dict(max_concurrency=max_concurrency, isolation=isolation,
                                  min_isolation=min_isolation)
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    def sandbox(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = Sandbox(self.limits, **self._sandbox_args)
            return self._sandbox

    async def run(self, arguments: dict[str, Any], session: dict[str, Any]) -> str:
        cells = [*session.get("cells", []), arguments["code"]] if self.stateful \
            else [arguments["code"]]
        result = await self.sandbox().run(_DRIVER, stdin=json.dumps(cells))
        if not result.ok:
            detail = result.stderr.strip().splitlines()[-3:] if result.stderr.strip() else []
            raise ToolError("; ".join([f"{result.reason}: {result.detail}".rstrip(": "),
                                       *detail]) or result.reason)
        if self.stateful:
            session["cells"] = cells
        return result.stdout if result.stdout else "(no output)"

    async def close(self) -> None:
        with self._lock:
            sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            sandbox.close()
