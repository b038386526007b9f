"""The Ray launcher (``launch/ray_launch.py``, ``rl_jax.cluster``).

On a local two-node Ray cluster (two raylets on this host, each with resources of its own:
``ray.cluster_utils.Cluster``, what ``ray start --head`` plus ``ray start --address=...`` set up),
the launcher places two trainer processes on two nodes (``jax.distributed`` over loopback, CPU
backend), two generator servers on the node holding the ``gen`` resource and SGLang's router on
the head node; a short RL run goes to its end while a generator server is killed and restarted;
every process's output is in the run directory and nothing is left running afterwards. SIGTERM
(or Ctrl-C) stops a run the same way. Without Ray those tests are skipped; the launch spec and
the process supervisor are tested here without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rl_jax.cluster.spec import (ClusterError, LaunchSpec, Resources, RoleSpec, generator_command,
                                 parse_env, trainer_command)
from rl_jax.cluster.supervisor import ProcessSupervisor

ROOT = Path(__file__).resolve().parents[1]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install -e '.[ray]'; it is "
                                      "in the [test] extra)")
TRAINER = ["--config=configs/tiny_rl.py"]


def spec(**changes) -> LaunchSpec:
    values = dict(workdir="/runs/x", trainers=RoleSpec(2, args=tuple(TRAINER)),
                  generators=RoleSpec(1), generator_model="/ckpt")
    values.update(changes)
    return LaunchSpec(**values)


# ---- the launch spec (no Ray) ----

def test_resources_parse_names_the_flag_and_the_bad_value():
    r = Resources.parse('{"CPU": 4, "GPU": 8, "TPU": 4, "node1": 1, "memory": 1e9}', "--x")
    assert (r.num_cpus, r.num_gpus, r.memory) == (4, 8, 1e9)
    assert r.bundle() == {"CPU": 4, "GPU": 8, "memory": 1e9, "TPU": 4, "node1": 1}
    assert r.actor_options() == {"num_cpus": 4, "num_gpus": 8, "memory": 1e9,
                                 "resources": {"TPU": 4, "node1": 1}}
    assert Resources.parse("{}", "--x").bundle() == {"CPU": 1}
    for text, message in (('{"GPU": -1}', "--trainer_resources: 'GPU' must be a number >= 0"),
                          ('{"GPU": "8"}', "'GPU' must be a number >= 0, got '8'"),
                          ('{"CPU": true}', "'CPU' must be a number >= 0, got True"),
                          ("[1]", "expected a JSON object"),
                          ("{GPU: 1}", "--trainer_resources: not a JSON object")):
        with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace("[", r"\[")):
            Resources.parse(text, "--trainer_resources")


def test_launch_spec_refuses_what_would_contradict_the_placement():
    cases = [
        (dict(trainers=RoleSpec(2, args=(*TRAINER, "--coordinator=h:1"))),
         "trainer flag --coordinator is set by the launcher"),
        (dict(trainers=RoleSpec(2, args=(*TRAINER, "-process_id", "1"))),
         "trainer flag --process_id is set by the launcher"),
        (dict(trainers=RoleSpec(2, args=(*TRAINER, "--config.transfer.port=5"))),
         "trainer flag --config.transfer.port is set by the launcher"),
        (dict(trainers=RoleSpec(2, args=("--config.trainer.steps=3",))),
         "need --config=RECIPE"),
        (dict(trainers=RoleSpec(0, args=tuple(TRAINER))), "num_trainers must be >= 1, got 0"),
        (dict(generators=RoleSpec(1, args=("--api_key=abc",))),
         "generator args name --api_key: keys go through --api_key_file"),
        (dict(router=RoleSpec(1, args=("--api-key", "abc"))), "router args name --api-key"),
        (dict(generator_kind="vllm"), "generator_kind must be one of"),
        (dict(generator_model=""), "generator_model"),
        (dict(trainer_strategy="RANDOM"), "trainer_strategy must be one of"),
        (dict(generator_port=70000), r"generator_port must be in \[0, 65535\], got 70000"),
        (dict(max_restarts=-1), "max_restarts must be >= 0"),
    ]
    for changes, message in cases:
        with pytest.raises(ClusterError, match=message):
            spec(**changes)
    with pytest.raises(ClusterError, match="--trainer_env: expected KEY=VALUE, got 'XLA_FLAGS'"):
        parse_env(["XLA_FLAGS"], "--trainer_env")
    with pytest.raises(ClusterError, match="RL_JAX_API_KEY is set by the launcher"):
        parse_env(["RL_JAX_API_KEY=x"], "--generator_env")
    assert parse_env(["A=b=c", "XLA_FLAGS="], "--e") == (("A", "b=c"), ("XLA_FLAGS", ""))


def test_commands_carry_the_placement_and_no_keys():
    s = spec(trainers=RoleSpec(2, args=(*TRAINER, "--config.trainer.steps=3")))
    cmd = trainer_command(s, 1, coordinator="10.0.0.1:1234", generator_urls=["http://a:1",
                          "http://b:2"], publisher_host="10.0.0.1", publisher_port=4321,
                          python="py")
    assert cmd[:4] == ["py", "-m", "launch.trainer", "--workdir=/runs/x"]
    assert {"--coordinator=10.0.0.1:1234", "--num_processes=2", "--process_id=1",
            "--generator_urls=http://a:1,http://b:2", "--publisher_host=10.0.0.1"} <= set(cmd)
    # Overrides of the recipe go after it, the launcher's last.
    assert cmd.index("--config=configs/tiny_rl.py") < cmd.index("--config.trainer.steps=3")
    assert cmd[-1] == "--config.transfer.port=4321"
    single = trainer_command(spec(trainers=RoleSpec(1, args=tuple(TRAINER))), 0,
                             coordinator="x:1", generator_urls=["http://a:1"],
                             publisher_host="h", publisher_port=1)
    assert not any(a.startswith(("--coordinator", "--num_processes")) for a in single)
    ours = generator_command(spec(generators=RoleSpec(1, args=("--max_slots=8",))), host="h",
                             port=5, parent_pid=77, publisher_url="http://p:9", python="py")
    assert ours == ["py", "-m", "launch.generator_server", "--model=/ckpt", "--host=h",
                    "--port=5", "--parent_pid=77", "--publisher_url=http://p:9",
                    "--max_slots=8"]
    # A first start names the publisher too (the one address its transfer token may go to),
    # without pulling from it before the trainer publishes.
    first = generator_command(spec(), host="h", port=5, parent_pid=77,
                              publisher_url="http://p:9", pull_on_start=False, python="py")
    assert first[-2:] == ["--publisher_url=http://p:9", "--nopull_on_start"]
    sglang = generator_command(spec(generator_kind="sglang",
                                    generators=RoleSpec(1, args=("--tp-size", "2"))),
                               host="h", port=5, parent_pid=1, sglang_config="/private/k.yaml",
                               python="py")
    assert sglang == ["py", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "h",
                      "--port", "5", "--config", "/private/k.yaml", "--tp-size", "2"]


def test_launcher_reports_a_bad_flag_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.ray_launch", "--workdir=/tmp/x", "--generator_model=/m",
         "--generator_resources={\"GPU\": -2}", "--", *TRAINER], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: ClusterError: --generator_resources: 'GPU' must be a number >= 0, got -2")


# ---- the process supervisor (no Ray) ----

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_supervisor_collects_output_restarts_and_stops_the_whole_group(tmp_path):
    sup = ProcessSupervisor("generator", 3, str(tmp_path))
    pid = sup.start([sys.executable, "-c", "import os, sys; print('out', os.environ['X']); "
                     "print('err', file=sys.stderr)"], {"X": "1"})
    assert pid > 0
    chunks, last = [], []

    def exited():
        asked = sum(map(len, chunks))
        code, offset, data = sup.poll(asked)
        chunks.append(data[asked - offset:])
        last[:] = [asked, (code, offset, data)]
        return code is not None

    _wait(exited, what="the first process to exit")
    text = b"".join(chunks).decode()
    assert "==> generator-3 start 1" in text and "out 1" in text and "err" in text
    received = len(text.encode())
    # Output is kept until the caller says it has it (asks from past it): a lost reply is sent
    # again, whole, to the same question.
    asked, reply = last
    assert sup.poll(asked) == reply and reply[1] + len(reply[2]) == received
    assert sup.poll(received) == (0, received, b"")
    # A restart; the process starts a child of its own: a stop ends both.
    child_file = tmp_path / "child"
    sup.start(["bash", "-c", f"sleep 300 & echo $! > {child_file}; echo started; wait"], {})
    _wait(lambda: child_file.exists() and child_file.read_text().strip(), what="the child")
    child = int(child_file.read_text())
    with pytest.raises(RuntimeError, match="generator-3 is still running"):
        sup.start(["true"], {})
    assert sup.poll(received)[0] is None
    assert sup.stop(timeout=5) == -signal.SIGTERM
    assert not _alive(child)
    code, offset, data = sup.poll(received)
    assert (code, offset) == (-signal.SIGTERM, received)
    assert "==> generator-3 start 2" in data.decode() and "started" in data.decode()


SUPERVISOR_SCRIPT = """
import signal, sys, time
from rl_jax.cluster.supervisor import ProcessSupervisor
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a Ray worker
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
sups = [ProcessSupervisor("trainer", i, sys.argv[1]) for i in range(2)]
print(*(sup.start(["sleep", "300"], {}) for sup in sups), flush=True)
time.sleep(300)
"""


def test_a_supervised_process_takes_sigint_and_dies_with_its_supervisor(tmp_path):
    """A supervisor that ignores and blocks SIGINT (a Ray worker does) starts processes that
    take it; one killed outright (what Ray does to an actor whose driver is gone) takes them
    with it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        first, second = map(int, holder.stdout.readline().split())
        assert _alive(first) and _alive(second)
        os.kill(first, signal.SIGINT)
        _wait(lambda: not _alive(first), timeout=10, what="SIGINT to end the first")
        assert _alive(second)
        holder.kill()
        holder.wait()
        _wait(lambda: not _alive(second), timeout=10, what="the orphan to die")
    finally:
        if holder.poll() is None:
            holder.kill()


# ---- on a local two-node Ray cluster ----

@pytest.fixture(scope="module")
def ray_cluster():
    """Two nodes on this host: the head (2 CPUs, ``node0``) and a node with 2 CPUs, ``node1``
    and two ``gen`` slots; small object stores. Shut down when the module's tests are done."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, resources={"node0": 1}, object_store_memory=200_000_000))
    try:
        node1 = cluster.add_node(num_cpus=2, resources={"node1": 1, "gen": 2},
                                 object_store_memory=200_000_000)
        cluster.wait_for_nodes()
        yield cluster, cluster.head_node.node_id, node1.node_id
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from rl_jax.models.shapes import shape, write_random_checkpoint
    return write_random_checkpoint(shape("tiny"), tmp_path_factory.mktemp("ckpt") / "tiny")


# A short async RL run of the tiny recipe on random weights of the tiny shape: one CPU device per
# trainer process (a 2-device mesh over the two), 16 prompts x 4 samples per step.
RUN = ["--config.mesh.fsdp=-1", "--config.rollout.groups_per_batch=16",
       "--config.rollout.group_size=4", "--config.eval.examples=16", "--config.eval.every=0",
       "--config.cpus.trainer=", "--config.cpus.generators=", "--config.cpus.rollout=",
       "--config.trainer.ema_decay=0", "--config.trainer.time_limit_s=0",
       "--config.rollout.filter_zero_signal=False", "--config.generator.max_seq_len=96",
       "--config.rollout.seq_len=96", "--config.checkpoint.every=100"]


def ray_launch(cluster, workdir: Path, checkpoint: Path, *trainer_flags: str, router: bool,
               generators: int = 2, key_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "launch.ray_launch", f"--ray_address={cluster.address}",
           *key_flags,
           f"--workdir={workdir}", "--num_trainers=2", f"--num_generators={generators}",
           f"--generator_model={checkpoint}", "--generator_resources={\"CPU\": 0.5, \"gen\": 1}",
           "--generator_args=--max_seq_len=96 --max_slots=32", "--generator_env=XLA_FLAGS=",
           "--trainer_env=XLA_FLAGS=", "--max_restarts=2", "--stop_timeout_s=10"]
    if router:
        cmd += ["--router", "--router_resources={\"CPU\": 0, \"node0\": 0.5}",
                "--router_args=--policy round_robin --log-level warn"]
    cmd += ["--", *TRAINER, f"--config.base.checkpoint={checkpoint}", *RUN, *trainer_flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def cluster_info(workdir: Path) -> dict:
    try:
        return json.loads((workdir / "cluster.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def trained_steps(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines())
            if "loss/loss" in r]


def pids(info: dict) -> list[int]:
    procs = info["trainers"] + info["generators"] + ([info["router"]] if info["router"] else [])
    return [p[key] for p in procs for key in ("pid", "supervisor_pid") if p[key]]


@needs_ray
@pytest.mark.slow
def test_a_run_on_two_ray_nodes_restarts_a_killed_server_and_logs_every_process(
        ray_cluster, checkpoint, tmp_path):
    cluster, head, node1 = ray_cluster
    workdir = tmp_path / "run"
    keys = {"api": "api-" + os.urandom(16).hex(), "admin": "admin-" + os.urandom(16).hex()}
    for name, key in keys.items():
        (tmp_path / name).write_text(key)
    launcher = ray_launch(cluster, workdir, checkpoint, "--config.trainer.steps=10",
                          "--config.trainer.step_delay_s=1.0", router=True,
                          key_flags=(f"--api_key_file={tmp_path / 'api'}",
                                     f"--admin_api_key_file={tmp_path / 'admin'}"))
    try:
        # Once the first step has trained, generator-0 dies (SIGKILL, as a crash).
        _wait(lambda: trained_steps(workdir) or launcher.poll() is not None, timeout=300,
              what="the first step")
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        info = cluster_info(workdir)
        request = urllib.request.Request(info["router_url"] + "/workers",
                                         headers={"Authorization": f"Bearer {keys['api']}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            workers = json.loads(response.read())["workers"]
        assert sorted(w["url"] for w in workers) == sorted(info["generator_urls"])
        assert all(w["is_healthy"] for w in workers), workers
        killed = info["generators"][0]["pid"]
        os.kill(killed, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, output[-4000:]
    assert "every trainer process finished" in output
    assert "generator-0 exited with code -9; restarting it (1/2)" in output

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["final_version"] == 10
    assert sorted(set(trained_steps(workdir))) == list(range(1, 11))

    info = cluster_info(workdir)
    # Placement: one trainer per node; both servers on the node with the `gen` resource; the
    # router on the head node (its custom resource); the coordinator on trainer 0's node.
    assert {t["node_id"] for t in info["trainers"]} == {head, node1}
    assert [g["node_id"] for g in info["generators"]] == [node1, node1]
    assert info["router"]["node_id"] == head
    assert info["coordinator"].startswith(info["trainers"][0]["ip"] + ":")
    assert [g["restarts"] for g in info["generators"]] == [1, 0]
    assert info["generators"][0]["pid"] != killed
    assert [t["exit_code"] for t in info["trainers"]] == [0, 0]

    logs = workdir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        "generator-0.log", "generator-1.log", "launcher.log", "router-0.log", "trainer-0.log",
        "trainer-1.log"]
    trainer0 = (logs / "trainer-0.log").read_text()
    assert "process 0/2 joined" in trainer0 and "held-out accuracy: " in trainer0
    assert "process 1/2 joined" in (logs / "trainer-1.log").read_text()
    # The restarted server came back on its port with the newest weights before serving.
    first, restarted = (logs / "generator-0.log").read_text().split("==> generator-0 start 2")
    assert "ready at " + info["generator_urls"][0] in first
    assert f"--publisher_url={info['publisher_url']}" in restarted.splitlines()[0]
    assert "pulled initial weight version" in restarted
    assert "ready at " + info["generator_urls"][0] in restarted
    assert "ready at " in (logs / "generator-1.log").read_text()
    assert "generator-0 exited with code -9" in (logs / "launcher.log").read_text()
    # The servers' keys are in no log, no command line and not in cluster.json.
    for path in [*logs.iterdir(), workdir / "cluster.json"]:
        text = path.read_text(errors="replace")
        assert not any(key in text for key in keys.values()), path
    assert not any(key in output for key in keys.values())
    # Nothing left running: the processes and their supervisors.
    _wait(lambda: not any(_alive(pid) for pid in pids(info)), timeout=30,
          what="every process to be gone")


@needs_ray
@pytest.mark.slow
def test_sigterm_stops_every_process(ray_cluster, checkpoint, tmp_path):
    """SIGTERM (what `timeout`, Slurm or Kubernetes send) stops a run as Ctrl-C does."""
    cluster, _, _ = ray_cluster
    workdir = tmp_path / "run"
    launcher = ray_launch(cluster, workdir, checkpoint, "--config.trainer.steps=1000",
                          router=False, generators=1)
    try:
        _wait(lambda: all(t.get("pid") for t in cluster_info(workdir).get("trainers", [{}]))
              or launcher.poll() is not None, timeout=300, what="the trainers to start")
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        info = cluster_info(workdir)
        assert all(_alive(pid) for pid in pids(info))
        os.kill(launcher.pid, signal.SIGTERM)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, output[-3000:]
    assert "interrupted: stopping every process" in output and "stopped" in output
    _wait(lambda: not any(_alive(pid) for pid in pids(info)), timeout=30,
          what="every process to be gone")
    assert (workdir / "logs" / "trainer-1.log").read_text().startswith("\n==> trainer-1 start 1")


@needs_ray
def test_a_placement_the_cluster_cannot_give_fails_in_one_line(ray_cluster, tmp_path):
    """Three trainers, one per node, on two nodes: the launch fails naming what it asked for
    and what the nodes have, and leaves nothing behind."""
    cluster, _, _ = ray_cluster
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.ray_launch", f"--ray_address={cluster.address}",
         f"--workdir={tmp_path / 'run'}", "--num_trainers=3", "--generator_model=/m",
         "--placement_timeout_s=5", "--", *TRAINER], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ClusterError: cannot place 3 trainer processes "
                           "(STRICT_SPREAD, {'CPU': 1.0} each) within 5 s"), last
    ip = cluster.head_node.node_ip_address
    assert f"{ip} {{'CPU': 2.0, 'node0': 1.0}}" in last
    assert f"{ip} {{'CPU': 2.0, 'gen': 2.0, 'node1': 1.0}}" in last
    assert last.endswith("(free now: {'CPU': 4.0, 'gen': 2.0, 'node0': 1.0, 'node1': 1.0})"), \
        last
    assert not (tmp_path / "run" / "cluster.json").exists()
