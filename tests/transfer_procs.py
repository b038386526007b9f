"""Driving ``transfer_worker.py`` processes from tests: start, send a command, read the reply."""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
from pathlib import Path

WORKER = Path(__file__).with_name("transfer_worker.py")
# The token the workers' publishers require and their pullers send (RL_JAX_TRANSFER_TOKEN).
TOKEN = secrets.token_urlsafe(24)


class Worker:
    """A worker process; :meth:`ask` sends one JSON command and returns its ``@@`` reply."""

    def __init__(self, *args: str, name: str = "worker", script: str = WORKER.name):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["RL_JAX_TRANSFER_TOKEN"] = TOKEN
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent),
                                                          env.get("PYTHONPATH")]))
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(WORKER.with_name(script)),
                                      *map(str, args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self._replies: queue.Queue = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
        self._replies.put(None)

    def _read_stderr(self):
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def reply(self, timeout: float = 120.0) -> dict:
        try:
            data = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no reply within {timeout} s\n"
                                 + "".join(self._stderr[-40:])) from None
        if data is None:
            raise AssertionError(f"{self.name} exited ({self.proc.poll()}):\n"
                                 + "".join(self._stderr[-40:]))
        return data

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, timeout: float = 120.0, **cmd) -> dict:
        self.send(**cmd)
        data = self.reply(timeout)
        assert "trace" not in data, f"{self.name}: {data['error']}\n{data['trace']}"
        return data

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
