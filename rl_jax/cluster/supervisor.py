"""One process of a run on one node, supervised: started, polled, restarted, its output kept
for the launcher to collect, stopped.

:class:`ProcessSupervisor` is a plain class; :mod:`rl_jax.cluster.ray_cluster` runs it as a Ray
actor on the node its role's resources are placed on, so its methods are the calls the launcher
makes across the cluster. Each call returns at once (nothing blocks the actor's one thread
beyond a stop's timeout).

The process runs in a session of its own (a stop signals its whole process group) and is
killed by the kernel if the supervisor dies first (``PR_SET_PDEATHSIG``), so that a supervisor
Ray kills (driver gone, node drained) leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

MAX_BUFFERED = 16 << 20  # bytes of output kept between two collections

_PR_SET_PDEATHSIG = 1
_SIG_SETMASK = 2
_NO_SIGNALS = ctypes.create_string_buffer(128)  # an empty sigset_t
try:  # resolved before any fork
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl, _signal, _sigprocmask = _libc.prctl, _libc.signal, _libc.sigprocmask
    _signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
except (OSError, AttributeError):  # not Linux
    _prctl = _signal = _sigprocmask = None


def _child_setup() -> None:
    """Runs in the child between fork and exec: SIGKILL when the supervisor dies, no blocked
    signals and the default SIGINT and SIGTERM actions. (A Ray worker ignores SIGINT and its
    threads block signals; ignored and blocked signals stay so across exec, and Python would
    then never raise KeyboardInterrupt.)"""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _sigprocmask(_SIG_SETMASK, _NO_SIGNALS, None)
        for sig in (signal.SIGINT, signal.SIGTERM):
            _signal(sig, None)  # SIG_DFL


def node_ip() -> str:
    """This node's address as its cluster sees it (Ray's own choice when Ray runs here)."""
    try:
        import ray
        return ray.util.get_node_ip_address()
    except ImportError:
        return "127.0.0.1"


class ProcessSupervisor:
    """Runs and restarts one command on this node.

    Args:
      role: ``trainer``, ``generator`` or ``router`` (named in the output's markers).
      index: the process's index within its role.
      cwd: the working directory of the process (the project root, so ``launch`` imports).
    """

    def __init__(self, role: str, index: int, cwd: str):
        self.role, self.index, self.cwd = role, index, cwd
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._buffer = bytearray()
        self._base = 0  # the offset in the whole output of the buffer's first byte
        self._lock = threading.Lock()
        self._private: str | None = None  # a 0700 directory of files holding secrets
        self.starts = 0

    # ---- where it runs ----

    def node(self) -> dict:
        """This supervisor's node: ``ip``, Ray ``node_id`` (when Ray runs it) and ``pid``."""
        node_id = ""
        try:
            import ray
            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"ip": node_ip(), "node_id": node_id, "pid": os.getpid(),
                "hostname": socket.gethostname(), "python": sys.executable}

    def free_port(self, host: str) -> int:
        """A port free on this node at ``host`` now (the caller binds it soon after)."""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def sglang_key_file(self, api_key: str | None, admin_api_key: str | None) -> str:
        """SGLang's ``--config`` YAML holding the keys, in a directory private to this user
        on this node (removed by :meth:`close`)."""
        from rl_jax.generator.auth import Keys
        from rl_jax.generator.launcher.pool import write_sglang_keys
        if self._private is None:
            self._private = tempfile.mkdtemp(prefix="rl_jax-keys-")  # mode 0700
        return str(write_sglang_keys(Keys(api_key, admin_api_key), self._private))

    # ---- the process ----

    def start(self, command: list[str], env: Mapping[str, str]) -> int:
        """Starts ``command`` (after a previous one has exited) with this node's environment
        plus ``env`` (what Ray set for the actor, e.g. ``CUDA_VISIBLE_DEVICES``, is kept);
        returns its pid."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError(f"{self.role}-{self.index} is still running "
                               f"(pid {self._process.pid})")
        if self._reader is not None:
            self._reader.join(timeout=5)  # the previous process's last output
        self.starts += 1
        self._append(f"\n==> {self.role}-{self.index} start {self.starts} at "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n".encode())
        environ = {**os.environ, **env}
        # The project root first, so that `launch` and this checkout's rl_jax import.
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (self.cwd, environ.get("PYTHONPATH")) if p)
        read_end, write_end = os.pipe()
        try:
            self._process = subprocess.Popen(
                command, cwd=self.cwd, env=environ, stdin=subprocess.DEVNULL,
                stdout=write_end, stderr=write_end, start_new_session=True,
                preexec_fn=_child_setup)
        except OSError:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._reader = threading.Thread(target=self._read, args=(read_end,),
                                        name=f"{self.role}-{self.index}-output", daemon=True)
        self._reader.start()
        return self._process.pid

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                self._append(chunk)

    def _append(self, data: bytes) -> None:
        with self._lock:
            self._buffer += data
            excess = len(self._buffer) - MAX_BUFFERED
            if excess > 0:  # nobody collected for a long time: keep the newest output
                del self._buffer[:excess]
                self._base += excess

    def poll(self, received: int = 0) -> tuple[int | None, int, bytes]:
        """``(exit code or None while running, offset, output)``: the output kept from
        ``offset`` on, after dropping the first ``received`` bytes of the whole output (what
        the caller has stored). A reply lost on its way is thus sent again by the next call;
        ``offset > received`` means output was dropped (more than ``MAX_BUFFERED`` bytes
        between two calls)."""
        code = None if self._process is None else self._process.poll()
        if code is not None and self._reader is not None:
            self._reader.join(timeout=1)  # everything it wrote before exiting
        with self._lock:
            if received > self._base:
                received = min(received, self._base + len(self._buffer))
                del self._buffer[:received - self._base]
                self._base = received
            return code, self._base, bytes(self._buffer)

    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def healthy(self, address: str, path: str = "/health", timeout: float = 2.0) -> bool:
        """Whether ``address + path`` answers 200 (probed from this node)."""
        try:
            with urllib.request.urlopen(address + path, timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def send_signal(self, sig: int) -> bool:
        """Sends ``sig`` to the process group; False when nothing runs."""
        if self._process is None or self._process.poll() is not None:
            return False
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int | None:
        """``sig`` to the process group, SIGKILL after ``timeout`` s; returns the exit code."""
        process = self._process
        if process is None:
            return None
        if self.send_signal(sig):
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                process.wait()
        try:  # members of the group still running after their leader exited
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._reader is not None:
            self._reader.join(timeout=5)
        return process.returncode

    def close(self) -> None:
        """Stops the process and removes this supervisor's private files."""
        self.stop(timeout=5)
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None
