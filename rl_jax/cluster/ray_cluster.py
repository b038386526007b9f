"""A run's roles on a Ray cluster (``launch/ray_launch.py``): one command places the trainer
processes (one per node: a placement group, ``STRICT_SPREAD`` by default), the generator servers
and, if asked, SGLang's router, each by the resources it asks for (CPUs, GPUs, TPUs, custom
resources); then it supervises them until the trainers finish.

Every process runs under a :class:`~rl_jax.cluster.supervisor.ProcessSupervisor` actor on its
node. The trainers get the coordinator of ``jax.distributed`` (process 0's node address and a
port free there), the servers' URLs and the weight publisher's address (process 0's node), as
the multi-host commands pass them by hand (``launch.trainer``'s flags). A generator server
(or the router) that dies is restarted on the same node and port, up to ``max_restarts`` times;
a restarted server of this project pulls the newest published weights before it answers
``/health``. Every process's output is collected into ``<workdir>/logs/<role>-<i>.log`` (on the
machine running the launcher), and ``<workdir>/cluster.json`` says where each process runs.

The servers' API keys and the weight publisher's token reach the processes in their environment,
carried to the nodes as arguments of Ray calls (Ray's own channels: enable Ray's TLS where the
cluster's network is not trusted); they are on no command line, in no log and not in
``cluster.json``.

The run ends when every trainer has exited (the launcher's exit code is the first non-zero one,
else 0), or at once when one fails, on Ctrl-C or SIGTERM (exit code 130): every process is then
stopped (SIGINT to a trainer's process group, SIGTERM to a server's, SIGKILL after
``stop_timeout_s``), the actors and the placement group released. Processes also die with their
supervisor, so a launcher killed outright leaves nothing running once Ray reaps its actors.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_jax.cluster.spec import (ClusterError, LaunchSpec, generator_command, router_command,
                                 trainer_command, url)
from rl_jax.cluster.supervisor import ProcessSupervisor

ROOT = Path(__file__).resolve().parents[2]  # the project root: processes run from here
TICK_S = 0.5  # how often processes are polled and their output collected


def _ray():
    try:
        import ray
    except ImportError:
        raise ClusterError("the Ray launcher needs ray: pip install 'rl_jax[ray]'") from None
    return ray


class Proc:
    """One supervised process as the launcher sees it."""

    def __init__(self, role: str, index: int, actor: Any, log_path: Path):
        self.role, self.index, self.actor, self.log_path = role, index, actor, log_path
        self.name = f"{role}-{index}"
        self.node: dict = {}
        self.url = ""
        self.command: list[str] = []
        self.env: dict[str, str] = {}
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.received = 0  # bytes of its output stored in its log
        self.restarts = 0
        self.gone = False  # exited for good (or its actor was lost)

    def describe(self) -> dict:
        return {"name": self.name, "ip": self.node.get("ip"), "node_id": self.node.get("node_id"),
                "hostname": self.node.get("hostname"), "pid": self.pid,
                "supervisor_pid": self.node.get("pid"), "url": self.url or None,
                "restarts": self.restarts, "exit_code": self.exit_code}


class RayLaunch:
    """One run on a Ray cluster.

    Args:
      spec: what to start (:class:`~rl_jax.cluster.spec.LaunchSpec`).
      ray_address: the cluster (``ray.init``'s ``address``: "auto", ``host:port``,
        ``ray://...``).
      keys: the servers' ``(api_key, admin_api_key)``; the trainers get them too.
      transfer_token: the weight publisher's token, shared by trainers and servers.
      placement_timeout_s: how long a role may wait for its resources before the launch fails.
      say: where the launcher's own messages go (also to ``logs/launcher.log``).
    """

    def __init__(self, spec: LaunchSpec, *, ray_address: str = "auto",
                 keys: tuple[str | None, str | None] = (None, None),
                 transfer_token: str | None = None, placement_timeout_s: float = 300.0,
                 say: Callable[[str], None] | None = None):
        self.spec = spec
        self.ray_address = ray_address
        self.api_key, self.admin_api_key = keys
        self.transfer_token = transfer_token or secrets.token_urlsafe(32)
        self.placement_timeout_s = placement_timeout_s
        self.workdir = Path(spec.workdir).resolve()
        self.log_dir = self.workdir / "logs"
        self._say = say or (lambda message: print(message, flush=True))
        self.trainers: list[Proc] = []
        self.generators: list[Proc] = []
        self.router: Proc | None = None
        self.coordinator = ""
        self.publisher_url = ""
        self._placement_group = None

    # ---- entry point ----

    def run(self) -> int:
        """Places, starts and supervises every process; returns the exit code (see the module
        docstring)."""
        ray = _ray()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            ray.init(address=self.ray_address, log_to_driver=False,
                     logging_level="WARNING")
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ClusterError(f"no Ray cluster at --ray_address={self.ray_address}: "
                               f"{' '.join(str(e).split())[:300]}") from None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM stops the run as Ctrl-C does (after ray.init, whose handler would end
            # this process at once, leaving the processes to die with their supervisors).
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            self._place()
            self._start_generators()
            self._start_router()
            self._start_trainers()
            return self._supervise()
        except KeyboardInterrupt:
            self.say("interrupted: stopping every process")
            return 130
        finally:
            self._shutdown()
            ray.shutdown()

    def say(self, message: str) -> None:
        line = f"[ray_launch {time.strftime('%H:%M:%S')}] {message}"
        self._say(line)
        with open(self.log_dir / "launcher.log", "a") as f:
            f.write(line + "\n")

    # ---- placement ----

    def _actor(self, role: str, index: int, options: dict) -> Proc:
        ray = _ray()
        cls = ray.remote(ProcessSupervisor).options(max_restarts=0, **options)
        actor = cls.remote(role, index, str(ROOT))
        return Proc(role, index, actor, self.log_dir / f"{role}-{index}.log")

    def _await_nodes(self, procs: list[Proc], what: str) -> None:
        ray = _ray()
        refs = [p.actor.node.remote() for p in procs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.placement_timeout_s)
        if len(ready) < len(refs):
            raise ClusterError(f"cannot place {what} within {self.placement_timeout_s:.0f} s: "
                               f"the cluster's nodes: {self._free_resources()}")
        for proc, node in zip(procs, ray.get(refs)):
            proc.node = node

    def _free_resources(self) -> str:
        """Each live node's resources and what is free now (Ray's own bookkeeping resources
        and byte counts left out)."""
        ray = _ray()

        def shown(resources: dict) -> dict:
            return {k: v for k, v in sorted(resources.items()) if not k.startswith(
                ("node:", "bundle_group_")) and k not in ("memory", "object_store_memory")}

        nodes = [f"{node['NodeManagerAddress']} {shown(node['Resources'])}"
                 for node in ray.nodes() if node.get("Alive")]
        return "; ".join(nodes) + f" (free now: {shown(ray.available_resources())})"

    def _place(self) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        s = self.spec
        bundle = s.trainers.resources.bundle()
        if not bundle:
            raise ClusterError("trainer_resources asks for nothing; a trainer's placement "
                               "bundle needs at least one resource (e.g. {\"CPU\": 1})")
        self._placement_group = placement_group([bundle] * s.trainers.count,
                                                strategy=s.trainer_strategy)
        ready, _ = ray.wait([self._placement_group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise ClusterError(
                f"cannot place {s.trainers.count} trainer processes ({s.trainer_strategy}, "
                f"{bundle} each) within {self.placement_timeout_s:.0f} s: the cluster's "
                f"nodes: {self._free_resources()}")
        self.trainers = [self._actor("trainer", i, dict(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._placement_group, placement_group_bundle_index=i),
            **s.trainers.resources.actor_options())) for i in range(s.trainers.count)]
        self.generators = [self._actor("generator", i, dict(
            scheduling_strategy="SPREAD", **s.generators.resources.actor_options()))
            for i in range(s.generators.count)]
        if s.router.count:
            self.router = self._actor("router", 0, s.router.resources.actor_options())
        self._await_nodes(self.trainers, f"{s.trainers.count} trainer process(es)")
        self._await_nodes(self.generators, f"{s.generators.count} generator server(s) "
                          f"({s.generators.resources.bundle()} each)")
        for proc in self.generators:
            ip = proc.node["ip"]
            port = s.generator_port or ray.get(proc.actor.free_port.remote(ip))
            proc.url = url(ip, port)
        first = self.trainers[0]
        ip = first.node["ip"]
        coordinator_port = s.coordinator_port or ray.get(first.actor.free_port.remote(ip))
        publisher_port = s.publisher_port
        while not publisher_port or publisher_port == coordinator_port:
            publisher_port = ray.get(first.actor.free_port.remote(ip))
        self.coordinator = f"{ip}:{coordinator_port}"
        self.publisher_url = url(ip, publisher_port)
        for proc in self.trainers + self.generators:
            self.say(f"{proc.name} on {proc.node['hostname']} ({proc.node['ip']}, node "
                     f"{proc.node['node_id'][:12]}){' at ' + proc.url if proc.url else ''}")

    # ---- starting ----

    def _env(self, extra: tuple[tuple[str, str], ...], *, admin: bool = True) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1", **dict(extra)}  # output reaches the logs as written
        if self.api_key:
            env["RL_JAX_API_KEY"] = self.api_key
        if self.admin_api_key and admin:
            env["RL_JAX_ADMIN_API_KEY"] = self.admin_api_key
        env["RL_JAX_TRANSFER_TOKEN"] = self.transfer_token
        return env

    def _start(self, proc: Proc) -> None:
        ray = _ray()
        proc.pid = ray.get(proc.actor.start.remote(proc.command, proc.env))
        proc.exit_code = None
        self._write_cluster_file()

    def _generator_command(self, proc: Proc, *, restart: bool) -> list[str]:
        ray = _ray()
        host, port = proc.node["ip"], int(proc.url.rsplit(":", 1)[1])
        sglang_config = None
        if self.spec.generator_kind == "sglang" and (self.api_key or self.admin_api_key):
            sglang_config = ray.get(proc.actor.sglang_key_file.remote(self.api_key,
                                                                      self.admin_api_key))
        return generator_command(self.spec, host=host, port=port,
                                 parent_pid=proc.node["pid"],
                                 publisher_url=self.publisher_url, pull_on_start=restart,
                                 sglang_config=sglang_config, python=proc.node["python"])

    def _start_generators(self) -> None:
        for proc in self.generators:
            proc.command = self._generator_command(proc, restart=False)
            proc.env = self._env(self.spec.generators.env)
            self._start(proc)
        self._await_healthy(self.generators, "generator server")

    def _await_healthy(self, procs: list[Proc], what: str) -> None:
        ray = _ray()
        deadline = time.monotonic() + self.spec.startup_timeout_s
        pending = list(procs)
        while pending:
            self._collect(pending)
            for proc in pending:
                if proc.exit_code is not None:
                    raise ClusterError(
                        f"{proc.name} ({what} on {proc.node['ip']}) exited with code "
                        f"{proc.exit_code} while starting; its log {proc.log_path}:\n"
                        f"{self._log_tail(proc)}")
            healthy = ray.get([p.actor.healthy.remote(p.url) for p in pending])
            for proc, ok in zip(list(pending), healthy):
                if ok:
                    pending.remove(proc)
                    self.say(f"{proc.name} ready at {proc.url}")
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"{what}s {[p.name for p in pending]} not healthy after "
                                   f"{self.spec.startup_timeout_s:.0f} s (their logs are in "
                                   f"{self.log_dir})")
            if pending:
                time.sleep(TICK_S)

    def _start_router(self) -> None:
        if self.router is None:
            return
        ray = _ray()
        proc = self.router
        self._await_nodes([proc], f"the router ({self.spec.router.resources.bundle()})")
        ip = proc.node["ip"]
        port = self.spec.router_port or ray.get(proc.actor.free_port.remote(ip))
        proc.url = url(ip, port)
        proc.command = router_command(self.spec, host=ip, port=port,
                                      worker_urls=[g.url for g in self.generators],
                                      python=proc.node["python"])
        proc.env = self._env(self.spec.router.env, admin=False)
        self._start(proc)
        self._await_healthy([proc], "router")

    def _start_trainers(self) -> None:
        urls = [g.url for g in self.generators]
        first = self.trainers[0].node["ip"]
        port = int(self.publisher_url.rsplit(":", 1)[1])
        for proc in self.trainers:
            proc.command = trainer_command(self.spec, proc.index, coordinator=self.coordinator,
                                           generator_urls=urls, publisher_host=first,
                                           publisher_port=port, python=proc.node["python"])
            proc.env = self._env(self.spec.trainers.env)
            self._start(proc)
        self.say(f"{len(self.trainers)} trainer process(es) started (coordinator "
                 f"{self.coordinator}, weight publisher {self.publisher_url})")

    # ---- supervision ----

    def _all(self) -> list[Proc]:
        return self.trainers + self.generators + ([self.router] if self.router else [])

    def _collect(self, procs: list[Proc]) -> None:
        """Each process's exit code and new output (appended to its log file); a supervisor
        that cannot be reached (its node lost) marks its process gone."""
        ray = _ray()
        from ray.exceptions import RayActorError
        live = [p for p in procs if not p.gone and p.pid is not None]
        refs = [p.actor.poll.remote(p.received) for p in live]
        for proc, ref in zip(live, refs):
            try:
                code, offset, data = ray.get(ref, timeout=60)
            except (RayActorError, ray.exceptions.GetTimeoutError) as e:
                proc.gone, proc.exit_code = True, -1
                self.say(f"{proc.name}: its supervisor on {proc.node.get('ip')} is lost "
                         f"({type(e).__name__})")
                continue
            new = data[max(proc.received - offset, 0):]
            if offset > proc.received:
                new = f"[{offset - proc.received} bytes of output dropped]\n".encode() + new
            if new:
                with open(proc.log_path, "ab") as f:
                    f.write(new)
            proc.received = offset + len(data)  # the end of the output so far
            proc.exit_code = code

    def _log_tail(self, proc: Proc, lines: int = 20) -> str:
        try:
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _restart_or_drop(self, proc: Proc) -> None:
        """A dead server (or router): restarted on its node and port while restarts are left,
        else dropped from the run."""
        if proc.gone:
            return
        if proc.restarts >= self.spec.max_restarts:
            proc.gone = True
            self.say(f"{proc.name} exited with code {proc.exit_code} and has used its "
                     f"{self.spec.max_restarts} restart(s); the run goes on without it")
            return
        proc.restarts += 1
        self.say(f"{proc.name} exited with code {proc.exit_code}; restarting it "
                 f"({proc.restarts}/{self.spec.max_restarts}) at {proc.url}")
        if proc.role == "generator":
            proc.command = self._generator_command(proc, restart=True)
        try:
            self._start(proc)
        except Exception as e:  # noqa: BLE001 - a restart that fails counts as one death
            self.say(f"{proc.name}: restart failed: {type(e).__name__}: {e}")
            proc.exit_code = -1

    def _supervise(self) -> int:
        trainer_done_at = None
        while True:
            self._collect(self._all())
            for proc in self.generators + ([self.router] if self.router else []):
                if proc.exit_code is not None:
                    self._restart_or_drop(proc)
            if all(g.gone for g in self.generators):
                self.say("every generator server is gone; stopping the run")
                return 1
            codes = [t.exit_code for t in self.trainers]
            failed = [(t, c) for t, c in zip(self.trainers, codes) if c not in (None, 0)]
            if failed:
                proc, code = failed[0]
                self.say(f"{proc.name} exited with code {code}; stopping the run (its log: "
                         f"{proc.log_path}):\n{self._log_tail(proc, 10)}")
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                self.say("every trainer process finished")
                return 0
            if codes[0] == 0:
                trainer_done_at = trainer_done_at or time.monotonic()
                if time.monotonic() - trainer_done_at > self.spec.trainer_grace_s:
                    self.say(f"trainer-0 finished {self.spec.trainer_grace_s:.0f} s ago and "
                             f"others still run; stopping them")
                    return 0
            time.sleep(TICK_S)

    # ---- shutdown ----

    def _shutdown(self) -> None:
        """Stops the trainers, then the router and the servers; collects their last output;
        releases the actors and the placement group."""
        ray = _ray()
        timeout = self.spec.stop_timeout_s
        # Trainers get SIGINT, as on a terminal: jax.distributed catches SIGTERM (a preemption
        # notice) and goes on.
        for group, sig in ((self.trainers, signal.SIGINT),
                           (self.generators + ([self.router] if self.router else []),
                            signal.SIGTERM)):
            refs = [(p, p.actor.stop.remote(timeout, sig)) for p in group if p.pid is not None
                    and not (p.gone and p.exit_code == -1)]
            for proc, ref in refs:
                try:
                    code = ray.get(ref, timeout=timeout + 30)
                    proc.exit_code = proc.exit_code if code is None else code
                except Exception:  # noqa: BLE001 - a lost node: nothing left to stop
                    pass
            self._collect([p for p in group if not p.gone])
        for proc in self._all():
            try:
                ray.get(proc.actor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(proc.actor)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self._placement_group)
        if self.trainers:
            self._write_cluster_file()
        self.say("stopped")

    def _write_cluster_file(self) -> None:
        """``<workdir>/cluster.json``: where each process runs (no keys)."""
        info = {"ray_address": self.ray_address, "coordinator": self.coordinator,
                "publisher_url": self.publisher_url,
                "generator_urls": [g.url for g in self.generators],
                "router_url": self.router.url if self.router else None,
                "trainers": [p.describe() for p in self.trainers],
                "generators": [p.describe() for p in self.generators],
                "router": self.router.describe() if self.router else None}
        path = self.workdir / "cluster.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, path)


def run(spec: LaunchSpec, **kwargs) -> int:
    """Launches ``spec`` on a Ray cluster (:class:`RayLaunch`'s arguments); returns the exit
    code."""
    return RayLaunch(spec, **kwargs).run()
