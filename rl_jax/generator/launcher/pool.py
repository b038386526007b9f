"""Starts a pool of generator servers from one config block and stops it cleanly.

``kind = "rl_jax"`` runs this project's JAX server (``python -m rl_jax.generator.server.serve``);
``kind = "sglang"`` runs real SGLang servers (``python -m sglang.launch_server``; server ``i``
gets GPUs ``i*tp .. i*tp+tp-1`` via ``--base-gpu-id``) with the Python of SGLang's own
environment (``PoolConfig.python``: a venv or a container's interpreter; SGLang pins packages
this project's environment cannot share, so the trainer never imports it), plus the recipe's
environment variables and flags (on CPU: ``tools/sglang_cpu/``). Both speak the same API, so
:class:`~rl_jax.generator.client.core.GeneratorClient` drives either::

    with ServerPool(PoolConfig(model="ckpt", ports=(30001, 30002))) as pool:
        async with GeneratorClient(pool.urls) as client: ...

API keys (``PoolConfig.keys``, :class:`~rl_jax.generator.auth.Keys`) never go on a command line:
this project's servers get them in their environment (``RL_JAX_API_KEY``,
``RL_JAX_ADMIN_API_KEY``), SGLang servers in a YAML file readable by this user only, named by
SGLang's ``--config`` and holding its ``api-key`` / ``admin-api-key`` settings. Clients send them
with ``GeneratorClient(urls, keys=pool.config.keys)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_jax.cpus import lower_priority
from rl_jax.generator.auth import (ADMIN_API_KEY_ENV, API_KEY_ENV, NO_KEYS, Keys, child_environ,
                                   exposure_warning)

log = logging.getLogger(__name__)

KINDS = ("rl_jax", "sglang")
# What rl_jax.generator.server.app prints once it serves.
READY_LINE = re.compile(r"rl_jax generator server ready at http://\S+:(\d+)\s")


class LaunchError(RuntimeError):
    """A server did not start (bad config, missing package, crash or timeout)."""


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The ``generator`` block of a recipe config."""

    model: str  # HF checkpoint directory (or hub id, for SGLang)
    kind: str = "rl_jax"  # "rl_jax" | "sglang"
    host: str = "127.0.0.1"
    ports: tuple[int, ...] = (30000,)  # one server per port; 0: any free port
    max_slots: int = 32  # rl_jax --max_slots / sglang --max-running-requests
    max_seq_len: int = 512  # rl_jax --max_seq_len / sglang --context-length
    max_waiting: int = 4096  # rl_jax only
    dtype: str = "float32"  # sglang also accepts "auto"
    tensor_parallel: int = 1
    data_parallel: int = 1  # replicas per server (rl_jax --data_parallel / sglang --dp-size)
    # decode steps per program, admissions between programs (both kinds:
    # --num_continuous_decode_steps / --num-continuous-decode-steps)
    decode_steps: int = 1
    weight_version: int = 0
    extra_args: tuple[str, ...] = ()  # appended to every server's command line
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables
    startup_timeout: float = 900.0  # s until /health answers 200
    log_dir: str | None = None  # server logs (default: a temporary directory)
    # CPU cores each server may run on ("" = any), e.g. "1" or "2-3" (``taskset`` syntax);
    # this project's servers pin themselves, SGLang servers are started under ``taskset``.
    cpu_cores: str = ""
    # CPU priority of the servers: their ``nice`` value, 0 (the default priority) to 19 (the
    # lowest). Above 0, processes at the default priority on the same cores (the trainer's
    # rollout client and batch packing) run first whenever they have work, and the servers
    # decode in the time left; raising priority (a negative value) needs privileges. Where
    # the kernel schedules by session (autogroup), the value is given to each server's
    # session as well (``ServerPool.priority`` says which applies).
    nice: int = 0
    # The trainer's weight publisher (rl_jax.transfer): servers pull the newest published
    # version before they report ready (so a restarted server never serves old weights) and on
    # /update_weights_from_transfer.
    publisher_url: str = ""
    # The servers' API key and admin API key (SGLang's --api-key / --admin-api-key), handed to
    # them through their environment or a private file; never shown in a repr.
    keys: Keys = NO_KEYS
    # The Python interpreter that runs the servers ("" = this process's). For SGLang, the one
    # of its own environment (e.g. ".venv-sglang/bin/python"); "" needs sglang importable here.
    python: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LaunchError(f"generator kind must be one of {KINDS}, got {self.kind!r}")
        if not self.ports:
            raise LaunchError("the generator pool needs at least one port")
        check_nice(self.nice)
        if not isinstance(self.keys, Keys):
            raise LaunchError(f"generator keys must be rl_jax.generator.auth.Keys, got "
                              f"{type(self.keys).__name__}")
        named = sorted({k for k, _ in self.env} & {API_KEY_ENV, ADMIN_API_KEY_ENV})
        if named:
            raise LaunchError(f"generator env sets {named}: give the servers' keys as "
                              "PoolConfig.keys (the pool hands them over)")
        for arg in self.extra_args:
            if re.match(r"--(admin[-_])?api[-_]key(_file)?(=|$)", arg):
                raise LaunchError(f"generator extra_args name {arg.split('=')[0]}: give the "
                                  "servers' keys as PoolConfig.keys (a command line is visible "
                                  "to every local user and in logs)")

    @classmethod
    def from_config(cls, block: Any) -> "PoolConfig":
        """From an ``ml_collections.ConfigDict``, a mapping or a PoolConfig."""
        if isinstance(block, cls):
            return block
        values = dict(block.to_dict() if hasattr(block, "to_dict") else block)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LaunchError(f"unknown generator pool settings {unknown}; known: {sorted(known)}")
        for name in ("ports", "extra_args"):
            if name in values:
                values[name] = tuple(values[name])
        if "env" in values:
            env = values["env"]
            values["env"] = tuple((env.items() if isinstance(env, Mapping) else env))
        return cls(**values)


def check_nice(value: Any, name: str = "generator nice") -> None:
    """A ``LaunchError`` unless ``value`` is a ``nice`` value servers can be started with."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise LaunchError(f"{name} must be an integer from 0 (default priority) to 19 "
                          f"(lowest), got {value!r}")


def server_command(config: PoolConfig, port: int, index: int = 0,
                   sglang_config: str | None = None) -> list[str]:
    """The command line of server ``index`` listening on ``port``; ``sglang_config``: a YAML
    file of further SGLang settings (its ``--config``; see :func:`write_sglang_keys`)."""
    c = config
    python = c.python or sys.executable
    if c.kind == "rl_jax":
        cmd = [python, "-m", "rl_jax.generator.server.serve", f"--model={c.model}",
               f"--host={c.host}", f"--port={port}", f"--max_slots={c.max_slots}",
               f"--max_seq_len={c.max_seq_len}", f"--max_waiting={c.max_waiting}",
               f"--dtype={c.dtype}", f"--tensor_parallel={c.tensor_parallel}",
               f"--data_parallel={c.data_parallel}",
               f"--weight_version={c.weight_version}", f"--parent_pid={os.getpid()}",
               # always given: the server's own default follows its backend
               f"--num_continuous_decode_steps={c.decode_steps}"]
        if c.cpu_cores:
            cmd.append(f"--cpu_cores={c.cpu_cores}")
        if c.publisher_url:
            cmd.append(f"--publisher_url={c.publisher_url}")
        cmd += list(c.extra_args)
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", c.model,
               "--host", c.host, "--port", str(port), "--tp-size", str(c.tensor_parallel),
               "--dp-size", str(c.data_parallel),
               "--base-gpu-id", str(index * c.tensor_parallel * c.data_parallel),
               "--dtype", c.dtype,
               "--max-running-requests", str(c.max_slots),
               "--context-length", str(c.max_seq_len),
               "--weight-version", str(c.weight_version)]
        if c.decode_steps != 1:
            cmd += ["--num-continuous-decode-steps", str(c.decode_steps)]
        if sglang_config:
            cmd += ["--config", sglang_config]
        cmd += list(c.extra_args)
        # SGLang cannot watch its parent (this project's servers do: --parent_pid): a guard in
        # this environment ends it with this process, however this process ends.
        cmd = [sys.executable, "-m", "rl_jax.generator.launcher.orphan_guard",
               f"--parent_pid={os.getpid()}", "--"] + cmd
        if c.cpu_cores:
            cmd = ["taskset", "-c", c.cpu_cores] + cmd
    if c.nice:
        cmd = ["nice", "-n", str(c.nice)] + cmd
    return cmd


def sglang_cpu_settings() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """``(env, extra_args)`` that run real SGLang's CPU engine (an environment made by
    ``tools/sglang_cpu/install.sh``): its torch-native attention, no warm-up, no radix cache
    (its CPU path has none), a small static memory share (the KV pool on a shared host)."""
    env = (("SGLANG_USE_CPU_ENGINE", "1"),)
    args = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup",
            "--disable-radix-cache", "--mem-fraction-static", "0.1")
    return env, args


def check_python(config: PoolConfig) -> None:
    """A ``LaunchError`` naming the problem unless ``config.python`` can run the servers."""
    if config.python:
        python = shutil.which(config.python)
        if python is None or not os.access(python, os.X_OK):
            raise LaunchError(f"generator python {config.python!r} is not an executable "
                              "(for SGLang: the python of its own environment, e.g. "
                              "tools/sglang_cpu/install.sh .venv-sglang)")
    elif config.kind == "sglang" and importlib.util.find_spec("sglang") is None:
        raise LaunchError("generator kind 'sglang' needs SGLang: give generator.python, the "
                          "python of an environment where it is installed (on CPU: "
                          "tools/sglang_cpu/install.sh .venv-sglang; on GPUs: pip install "
                          "'sglang[srt]==0.5.23' in a venv or container of its own)")


def write_sglang_keys(keys: Keys, directory: str | Path) -> Path:
    """A YAML file of SGLang's ``api-key`` / ``admin-api-key`` settings for its ``--config``,
    created readable and writable by this user only (0600) in ``directory``."""
    path = Path(directory) / "sglang-keys.yaml"
    if any(k and k.startswith("-") for k in (keys.api_key, keys.admin_api_key)):
        raise LaunchError("an API key for SGLang must not start with '-' (SGLang reads it as a "
                          "command-line value, where it would be taken for an option)")
    lines = [f"{name}: {json.dumps(value)}\n" for name, value in
             (("api-key", keys.api_key), ("admin-api-key", keys.admin_api_key)) if value]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerPool:
    """Server processes started from a :class:`PoolConfig` (a context manager)."""

    def __init__(self, config: PoolConfig | Mapping[str, Any] | Any):
        self.config = PoolConfig.from_config(config)
        # Port 0: this project's servers bind a free port themselves and print it (no race with
        # other processes); SGLang cannot, so a free port is picked for it here.
        own = self.config.kind == "rl_jax"
        self.ports = [p or (0 if own else free_port(self.config.host)) for p in self.config.ports]
        self.processes: list[subprocess.Popen | None] = [None] * len(self.ports)
        self._log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        self._log_offsets = [0] * len(self.ports)
        # The servers get the pool's keys and no others (not ones this process inherited).
        self.env = child_environ({**os.environ, **dict(self.config.env)}, self.config.keys)
        self._secrets: Path | None = None  # private directory of SGLang's key file
        # How the servers' CPU priority applies (rl_jax.cpus.lower_priority), once started.
        self.priority = "default"
        if self.config.kind == "rl_jax":  # `launch` must be importable from the subprocess
            root = str(Path(__file__).resolve().parents[3])
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (root, self.env.get("PYTHONPATH")) if p)

    @property
    def log_dir(self) -> Path:
        """The servers' log directory: the configured one, else a temporary directory made when
        first needed (a pool never started leaves none behind) and kept after ``stop`` so that
        the logs can be read."""
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="rl_jax-generators-"))
        return self._log_dir

    @property
    def log_files(self) -> list[Path]:
        return [self.log_dir / f"{self.config.kind}-server-{i}.log" for i in range(len(self.ports))]

    @property
    def urls(self) -> list[str]:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host  # IPv6
        return [f"http://{host}:{p}" for p in self.ports]

    def commands(self) -> list[list[str]]:
        return [self._command(i) for i in range(len(self.ports))]

    def _command(self, index: int) -> list[str]:
        sglang_config = None
        if self.config.kind == "sglang" and self.config.keys:
            if self._secrets is None or not self._secrets.is_dir():
                self._secrets = Path(tempfile.mkdtemp(prefix="rl_jax-keys-"))  # mode 0700
            sglang_config = str(write_sglang_keys(self.config.keys, self._secrets))
        return server_command(self.config, self.ports[index], index, sglang_config)

    def start(self, wait: bool = True) -> "ServerPool":
        check_python(self.config)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        warning = exposure_warning(self.config.host, self.config.keys)
        if warning and self.config.kind == "sglang":  # this project's servers print it
            log.warning("%s", warning)
        for i in range(len(self.ports)):
            self.start_server(i, wait=False)
        if wait:
            self.wait_healthy()
        return self

    def start_server(self, index: int, *, wait: bool = True):
        """(Re)starts server ``index`` (e.g. after it died)."""
        cmd = self._command(index)
        # Readable by this user only: SGLang logs its settings, API keys included, at start.
        fd = os.open(self.log_files[index], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            self._log_offsets[index] = out.tell()
            self.processes[index] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True)
        # A new session is a scheduling group of its own where the kernel groups by session:
        # the `nice` prefix of the command line alone would not order the server against
        # the trainer's processes there.
        try:
            self.priority = lower_priority(self.processes[index].pid, self.config.nice)
        except OSError as e:
            self.priority = f"nice {self.config.nice} (autogroup not set: {e})"
            log.warning("generator server %d: could not lower its session's CPU priority (%s); "
                        "its nice value only orders it within its own session", index, e)
        if index == 0 and self.config.nice:
            log.info("generator servers' CPU priority: %s", self.priority)
        if wait:
            self.wait_healthy([index])

    def wait_healthy(self, indices: list[int] | None = None, *, restarts: int = 0):
        """Waits until the servers ``indices`` answer /health; one that exits while it starts
        is started again up to ``restarts`` times in all (a server killed during the run's
        start-up), then ``LaunchError`` names it with its log's tail."""
        indices = list(range(len(self.ports))) if indices is None else indices
        deadline = time.monotonic() + self.config.startup_timeout
        pending = set(indices)
        while pending:
            for i in sorted(pending):
                process = self.processes[i]
                if process.poll() is not None and restarts > 0:
                    restarts -= 1
                    log.warning("generator server %d exited with code %s while starting; "
                                "starting it again", i, process.returncode)
                    self.start_server(i, wait=False)
                    continue
                if process.poll() is not None:
                    self.stop()
                    raise LaunchError(f"generator server on port {self.ports[i]} exited with "
                                      f"code {process.returncode}:\n{self.log_tail(i)}")
                if not self.ports[i]:
                    self.ports[i] = self._announced_port(i)
                if self.ports[i] and _healthy(self.urls[i]):
                    pending.discard(i)
            if pending and time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"generator servers {sorted(self.urls[i] for i in pending)} "
                                  f"not healthy after {self.config.startup_timeout:.0f} s")
            if pending:
                time.sleep(0.2)

    def _announced_port(self, index: int) -> int:
        """The port in the server's ready line (0 while it has not printed it)."""
        try:
            with open(self.log_files[index], "rb") as log:
                log.seek(self._log_offsets[index])
                match = READY_LINE.search(log.read().decode(errors="replace"))
        except OSError:
            return 0
        return int(match.group(1)) if match else 0

    def log_tail(self, index: int, lines: int = 30) -> str:
        try:
            text = self.log_files[index].read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self, index: int, sig: int = signal.SIGKILL):
        """Sends ``sig`` to server ``index``'s process group (tests: simulate a crash)."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            os.killpg(process.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                process.wait()

    def stop(self, timeout: float = 30.0):
        """SIGTERM to every server's process group, SIGKILL to what is left after ``timeout``."""
        stop_process_groups(self.processes, timeout)
        if self._secrets is not None:
            shutil.rmtree(self._secrets, ignore_errors=True)
            self._secrets = None

    def __enter__(self) -> "ServerPool":
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def stop_process_groups(processes: list[subprocess.Popen | None], timeout: float) -> None:
    """SIGTERM to the process group of each process still running, SIGKILL to what is left
    after ``timeout`` seconds; returns once every one has exited."""
    alive = [p for p in processes if p is not None and p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in alive:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(process: subprocess.Popen, sig: int):
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
