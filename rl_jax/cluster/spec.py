"""What a cluster launch starts: the roles, the resources each process asks for and the command
line each one runs (no cluster engine needed here; :mod:`rl_jax.cluster.ray_cluster` places
and runs them).

Roles:
- ``trainer``: ``launch.trainer``, one process per node, joined by ``jax.distributed`` with the
  coordinator on process 0's node; told the generator servers' URLs and where its weight
  publisher listens (process 0's node).
- ``generator``: this project's server (``launch.generator_server``) or SGLang's
  (``python -m sglang.launch_server``), each on a port of its node.
- ``router``: SGLang's router (``sglang_router``) in front of the generator servers.

API keys never appear on a command line: the servers and the trainers get them in their
environment (``RL_JAX_API_KEY``, ``RL_JAX_ADMIN_API_KEY``), SGLang servers in a private YAML file
(:func:`rl_jax.generator.launcher.pool.write_sglang_keys`), the router through
:mod:`rl_jax.cluster.router`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from typing import Any

from rl_jax.errors import UserError

ROLES = ("trainer", "generator", "router")
GENERATOR_KINDS = ("rl_jax", "sglang")
# Ray placement-group strategies; STRICT_SPREAD puts every trainer on a node of its own.
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")
# launch.trainer flags the launcher sets itself: given among the trainer's flags they would
# contradict the placement.
OWNED_TRAINER_FLAGS = ("workdir", "coordinator", "num_processes", "process_id",
                       "generator_urls", "publisher_host", "config.transfer.host",
                       "config.transfer.port", "config.distributed.coordinator",
                       "config.distributed.num_processes", "config.distributed.process_id",
                       "config.generator.urls")
_KEY_ARG = re.compile(r"--(admin[-_])?api[-_]key(=|$)")


class ClusterError(UserError):
    """A cluster launch that cannot run as asked (bad resources, flags, placement); the message
    names the setting."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one process of a role asks its node for: CPUs and GPUs (Ray's ``num_cpus`` /
    ``num_gpus``), bytes of ``memory``, and custom resources (``TPU``, a node's own label)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, text: str, name: str) -> "Resources":
        """From a JSON object such as ``{"CPU": 4, "GPU": 8}`` or ``{"TPU": 4, "tpu-v5": 1}``;
        ``name`` (the flag) is named in errors. CPU defaults to 1 when absent."""
        try:
            values = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ClusterError(f"{name}: not a JSON object ({e.msg}): {text!r}") from None
        if not isinstance(values, dict):
            raise ClusterError(f"{name}: expected a JSON object such as {{\"CPU\": 1, "
                               f"\"GPU\": 1}}, got {text!r}")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value < 0:
                raise ClusterError(f"{name}: {key!r} must be a number >= 0, got {value!r}")
        values = {k: float(v) for k, v in values.items()}
        return cls(num_cpus=values.pop("CPU", 1.0), num_gpus=values.pop("GPU", 0.0),
                   memory=values.pop("memory", 0.0),
                   custom=tuple(sorted((k, v) for k, v in values.items() if v)))

    def bundle(self) -> dict[str, float]:
        """A placement-group bundle (Ray's resource names)."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": self.memory,
                  **dict(self.custom)}
        return {k: v for k, v in bundle.items() if v}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments of Ray's ``.options(...)`` for an actor holding these."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            options["memory"] = self.memory
        if self.custom:
            options["resources"] = dict(self.custom)
        return options


def parse_env(items: list[str] | tuple[str, ...], name: str) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` strings to pairs; refuses API key variables (the launcher hands those
    over itself)."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ClusterError(f"{name}: expected KEY=VALUE, got {item!r}")
        if key in ("RL_JAX_API_KEY", "RL_JAX_ADMIN_API_KEY", "RL_JAX_TRANSFER_TOKEN"):
            raise ClusterError(f"{name}: {key} is set by the launcher (give key files with "
                               "--api_key_file / --admin_api_key_file, or the variables in "
                               "the launcher's own environment)")
        pairs.append((key, value))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """``count`` processes of one role, each holding ``resources``, with extra command-line
    arguments and environment variables."""

    count: int
    resources: Resources = Resources()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One run on a cluster.

    Args:
      workdir: the run directory (shared by the trainer nodes); logs go to ``workdir/logs``.
      trainers: the trainer processes (``args``: ``launch.trainer`` flags, the recipe first).
      generators: the generator servers (``args``: extra server flags).
      generator_kind: ``rl_jax`` (this project's server) or ``sglang``.
      generator_model: the checkpoint the servers load (a path every generator node sees).
      generator_python: the Python that runs the generator servers on their nodes ("" = the
        node's own, the one running Ray). SGLang runs in an environment of its own: the python
        of that venv or container, at the same path on every generator node.
      router: SGLang's router in front of the servers (``count`` 0 or 1; ``args``: its flags).
      trainer_strategy: the trainers' placement-group strategy.
      coordinator_port / publisher_port / generator_port / router_port: 0 for a free port of
        the node (the generator port: the same for every server when not 0).
      max_restarts: restarts of each generator server (and the router) after it dies.
      startup_timeout_s: how long servers may take to answer ``/health``.
      stop_timeout_s: how long processes get between SIGTERM and SIGKILL.
      trainer_grace_s: how long the other trainers may run after process 0 finished.
    """

    workdir: str
    trainers: RoleSpec
    generators: RoleSpec
    generator_model: str
    generator_kind: str = "rl_jax"
    generator_python: str = ""
    router: RoleSpec = RoleSpec(0, Resources(num_cpus=0.0))
    trainer_strategy: str = "STRICT_SPREAD"
    coordinator_port: int = 0
    publisher_port: int = 0
    generator_port: int = 0
    router_port: int = 0
    max_restarts: int = 3
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0
    trainer_grace_s: float = 120.0

    def __post_init__(self):
        if not self.workdir:
            raise ClusterError("workdir is required")
        if self.trainers.count < 1:
            raise ClusterError(f"num_trainers must be >= 1, got {self.trainers.count}")
        if self.generators.count < 1:
            raise ClusterError(f"num_generators must be >= 1, got {self.generators.count}")
        if self.router.count not in (0, 1):
            raise ClusterError(f"at most one router, got {self.router.count}")
        if self.generator_kind not in GENERATOR_KINDS:
            raise ClusterError(f"generator_kind must be one of {GENERATOR_KINDS}, got "
                               f"{self.generator_kind!r}")
        if not self.generator_model:
            raise ClusterError("generator_model (the checkpoint the servers load) is required")
        if self.trainer_strategy not in STRATEGIES:
            raise ClusterError(f"trainer_strategy must be one of {STRATEGIES}, got "
                               f"{self.trainer_strategy!r}")
        for name in ("coordinator_port", "publisher_port", "generator_port", "router_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ClusterError(f"{name} must be in [0, 65535], got {port}")
        if self.max_restarts < 0:
            raise ClusterError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("startup_timeout_s", "stop_timeout_s", "trainer_grace_s"):
            if not getattr(self, name) > 0:
                raise ClusterError(f"{name} must be > 0, got {getattr(self, name)}")
        if not any(a == "--config" or a.startswith("--config=") for a in self.trainers.args):
            raise ClusterError("the trainer flags (after --) need --config=RECIPE, as "
                               "launch.trainer does")
        for arg in self.trainers.args:
            name = arg.lstrip("-").split("=", 1)[0]
            if arg.startswith("-") and name in OWNED_TRAINER_FLAGS:
                raise ClusterError(f"trainer flag --{name} is set by the launcher (from the "
                                   "placement); leave it out")
        for role, args in (("generator", self.generators.args), ("router", self.router.args)):
            for arg in args:
                if _KEY_ARG.match(arg):
                    raise ClusterError(f"{role} args name {arg.split('=')[0]}: keys go through "
                                       "--api_key_file / --admin_api_key_file (a command line "
                                       "is visible to every local user and in logs)")


def url(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host else host  # IPv6
    return f"http://{host}:{port}"


def trainer_command(spec: LaunchSpec, process_id: int, *, coordinator: str,
                    generator_urls: list[str], publisher_host: str, publisher_port: int,
                    python: str = sys.executable) -> list[str]:
    """``launch.trainer`` for process ``process_id`` of ``spec.trainers.count``."""
    cmd = [python, "-m", "launch.trainer", f"--workdir={spec.workdir}"]
    if spec.trainers.count > 1:
        cmd += [f"--coordinator={coordinator}", f"--num_processes={spec.trainers.count}",
                f"--process_id={process_id}"]
    cmd += [f"--generator_urls={','.join(generator_urls)}", f"--publisher_host={publisher_host}"]
    # A config override goes after the recipe's --config.
    return cmd + list(spec.trainers.args) + [f"--config.transfer.port={publisher_port}"]


def generator_command(spec: LaunchSpec, *, host: str, port: int, parent_pid: int,
                      publisher_url: str = "", pull_on_start: bool = True,
                      sglang_config: str | None = None,
                      python: str = sys.executable) -> list[str]:
    """One generator server bound to ``host:port``. This project's server exits with its
    supervisor (``parent_pid``), pulls only from ``publisher_url`` (the one address its
    transfer token goes to) and, with ``pull_on_start`` (a restart), pulls the newest
    published weights before it answers ``/health``."""
    if spec.generator_kind == "rl_jax":
        cmd = [spec.generator_python or python, "-m", "launch.generator_server",
               f"--model={spec.generator_model}",
               f"--host={host}", f"--port={port}", f"--parent_pid={parent_pid}"]
        if publisher_url:
            cmd.append(f"--publisher_url={publisher_url}")
            if not pull_on_start:
                cmd.append("--nopull_on_start")
    else:
        cmd = [spec.generator_python or python, "-m", "sglang.launch_server", "--model-path",
               spec.generator_model, "--host", host, "--port", str(port)]
        if sglang_config:
            cmd += ["--config", sglang_config]
    return cmd + list(spec.generators.args)


def router_command(spec: LaunchSpec, *, host: str, port: int, worker_urls: list[str],
                   python: str = sys.executable) -> list[str]:
    """SGLang's router in front of ``worker_urls`` (through :mod:`rl_jax.cluster.router`,
    which hands it the workers' API key from the environment)."""
    return [python, "-m", "rl_jax.cluster.router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, *spec.router.args]
