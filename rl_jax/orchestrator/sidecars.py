"""Weight sidecars beside a run's SGLang servers (``generator.sglang_weights = "sidecar"``).

One :mod:`rl_jax.transfer.sglang.sidecar` process per SGLang server, on the server's host: it
pulls each version from the trainer's publisher over the transfer service's transports (digests,
finiteness and versions checked before anything reaches SGLang) and hands it to its server
locally (tmpfs + ``/update_weights_from_disk``, or shared-memory tensors +
``/update_weights_from_tensor``). The run's weight updates then go to the sidecars' fronts
(``/update_weights_from_transfer``, as to this project's servers), and the trainer never writes
a checkpoint per step nor needs a filesystem shared with the generators.

Each sidecar runs in the trainer's environment (it needs JAX and this package, not SGLang) on
JAX's CPU backend, under :mod:`rl_jax.generator.launcher.orphan_guard` (it ends with this process),
with
the servers' keys in private files. A sidecar that dies is restarted on the same port by
:meth:`SidecarPool.restart_dead` (the pool's watchdog calls it); a restarted SGLang server keeps
its sidecar, which brings it to the newest version at the next update.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_jax.generator.auth import Keys, child_environ
from rl_jax.generator.launcher.pool import LaunchError, stop_process_groups

log = logging.getLogger(__name__)

READY = re.compile(r"rl_jax sglang sidecar ready at (http://\S+)")
HANDOFFS = ("disk", "tensor")


class SidecarPool:
    """The sidecars of ``server_urls`` (same order).

    Args:
      server_urls: the SGLang servers, started on this host.
      publisher_url: the trainer's weight publisher.
      model_dir: the checkpoint the servers started from (config and tokenizer files).
      keys: the servers' keys (also guarding each sidecar's front).
      handoff: ``"disk"`` or ``"tensor"`` (:mod:`rl_jax.transfer.sglang.sidecar`).
      log_dir: where ``sidecar-<i>.log`` go.
      transport: the sidecars' pull transport (``"auto"`` or a registry name).
      startup_timeout_s: most seconds until a sidecar says it is ready.
    """

    def __init__(self, server_urls: list[str], *, publisher_url: str, model_dir: str | Path,
                 keys: Keys, handoff: str = "disk", log_dir: str | Path,
                 transport: str = "auto", startup_timeout_s: float = 180.0):
        if handoff not in HANDOFFS:
            raise LaunchError(f"sidecar hand-off must be one of {HANDOFFS}, got {handoff!r}")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.publisher_url, self.model_dir = publisher_url, str(model_dir)
        self.keys, self.handoff, self.transport = keys, handoff, transport
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[subprocess.Popen | None] = [None] * len(server_urls)
        self.ports = [0] * len(server_urls)  # kept across restarts: the run's URLs stay valid
        self.restarts = [0] * len(server_urls)
        self._offsets = [0] * len(server_urls)
        self._secrets: Path | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def log_file(self, index: int) -> Path:
        return self.log_dir / f"sidecar-{index}.log"

    def _key_args(self) -> list[str]:
        args = []
        for flag, key in (("--api_key_file", self.keys.api_key),
                          ("--admin_api_key_file", self.keys.admin_api_key)):
            if not key:
                continue
            if self._secrets is None:
                self._secrets = Path(tempfile.mkdtemp(prefix="rl_jax-sidecar-keys-"))  # 0700
            path = self._secrets / flag.strip("-")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key)
            args.append(f"{flag}={path}")
        return args

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "rl_jax.generator.launcher.orphan_guard",
                f"--parent_pid={os.getpid()}", "--",
                sys.executable, "-m", "rl_jax.transfer.sglang.sidecar",
                f"--publisher_url={self.publisher_url}",
                f"--server_url={self.server_urls[index]}", f"--port={self.ports[index]}",
                f"--handoff={self.handoff}", f"--transport={self.transport}",
                f"--model={self.model_dir}", *self._key_args()]

    def start(self) -> "SidecarPool":
        """Starts every sidecar and waits until each says it is ready (its first pull done)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.server_urls)):
            self._start(i)
        self.wait_ready()
        return self

    @staticmethod
    def environ() -> dict[str, str]:
        """A sidecar's environment: this process's when it starts one (the publisher's token
        included: ``RL_JAX_TRANSFER_TOKEN``), no server keys (files carry them), JAX on the
        CPU (a sidecar computes nothing on an accelerator and must not take one from SGLang)."""
        root = str(Path(__file__).resolve().parents[2])
        env = child_environ(dict(os.environ), Keys(None, None))
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        return env

    def _start(self, index: int) -> None:
        fd = os.open(self.log_file(index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            self._offsets[index] = out.tell()
            self.processes[index] = subprocess.Popen(
                self.command(index), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.environ(), start_new_session=True)

    def wait_ready(self, indices: list[int] | None = None) -> None:
        """Waits for the ready line of each sidecar in ``indices`` (default all); raises
        :class:`LaunchError` naming one that exited or did not get ready, with its log's tail."""
        pending = set(range(len(self.server_urls)) if indices is None else indices)
        deadline = time.monotonic() + self.startup_timeout_s
        while pending:
            for i in sorted(pending):
                url = self._announced(i)
                if url is not None:
                    self.ports[i] = int(url.rsplit(":", 1)[1].rstrip("/"))
                    pending.discard(i)
                elif self.processes[i].poll() is not None:
                    raise LaunchError(f"the weight sidecar of {self.server_urls[i]} exited with "
                                      f"code {self.processes[i].returncode}:\n{self.tail(i)}")
            if pending and time.monotonic() > deadline:
                raise LaunchError(f"weight sidecar(s) of {[self.server_urls[i] for i in pending]}"
                                  f" not ready after {self.startup_timeout_s:.0f} s:\n"
                                  f"{self.tail(min(pending))}")
            if pending:
                time.sleep(0.2)

    def _announced(self, index: int) -> str | None:
        try:
            with open(self.log_file(index), "rb") as f:
                f.seek(self._offsets[index])
                match = READY.search(f.read().decode(errors="replace"))
        except OSError:
            return None
        return match.group(1) if match else None

    def tail(self, index: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file(index).read_text(errors="replace")
                             .splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def restart_dead(self) -> list[int]:
        """Restarts (on its port) every sidecar that exited; the indices restarted."""
        restarted = []
        for i, process in enumerate(self.processes):
            if process is None or process.poll() is None:
                continue
            log.warning("weight sidecar of %s exited with code %s; restarting it:\n%s",
                        self.server_urls[i], process.returncode, self.tail(i, 5))
            self.restarts[i] += 1
            try:
                self._start(i)
            except OSError as e:
                log.error("cannot restart the weight sidecar of %s: %s", self.server_urls[i], e)
                continue
            restarted.append(i)
        return restarted

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to sidecar ``index``'s process group (tests: a crash)."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            os.killpg(process.pid, sig)
            process.wait()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to every sidecar (each removes its hand-off files), SIGKILL after
        ``timeout``; removes the key files."""
        stop_process_groups(self.processes, timeout)
        if self._secrets is not None:
            shutil.rmtree(self._secrets, ignore_errors=True)
            self._secrets = None

