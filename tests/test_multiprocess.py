"""Two CPU processes on loopback (4 host devices each) form one 8-device mesh and take sharded
train steps whose losses equal the single-process ones."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(num_processes: int, local_devices: int) -> dict:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), str(port), str(i), str(num_processes), str(local_devices)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(num_processes)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-3000:]}"
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [line for line in outputs[0].splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def test_two_process_mesh_matches_single_process():
    multi = _run(num_processes=2, local_devices=4)
    single = _run(num_processes=1, local_devices=8)
    assert multi["devices"] == 8 and multi["processes"] == 2
    assert single["devices"] == 8 and single["processes"] == 1
    for a, b in zip(multi["losses"], single["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (multi, single)
    assert multi["losses"][1] < multi["losses"][0]  # the update was applied on both processes


AUTO_WORKER = """
import json, sys
from rl_jax import distributed
distributed.initialize("auto")
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
ranks = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
print(json.dumps({"processes": jax.process_count(), "index": jax.process_index(),
                  "devices": jax.device_count(), "ranks": sorted(int(r) for r in ranks.ravel()),
                  "cluster": distributed.detected_cluster()}))
"""


def _slurm_job_id() -> int:
    """A Slurm job id whose coordinator port (JAX derives it from the id, in
    ``[61440, 65535]``) is free on this host."""
    for port in range(61440 + os.getpid() % 4096, 61440 + 4096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 61440 + 4096 * 1000
    raise RuntimeError("no free port in Slurm's coordinator range")


def test_auto_coordinator_joins_through_jax_cluster_detection():
    """``coordinator="auto"``: two processes started as ``srun`` starts them (Slurm's variables
    on this host) find their coordinator, count and index through JAX's own detection."""
    job = _slurm_job_id()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_STEP_NUM_NODES="1")
    procs = [subprocess.Popen([sys.executable, "-c", AUTO_WORKER], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)})
             for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-3000:]}"
            # Gloo writes its own lines to stdout (from C++, unordered with Python's): the
            # worker's result is its last JSON line.
            results.append(json.loads([line for line in out.splitlines()
                                       if line.startswith("{")][-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["index"] for r in results] == [0, 1]
    for r in results:
        assert r["processes"] == 2 and r["devices"] == 4 and r["ranks"] == [0, 1]
        assert r["cluster"] == "slurm"


def test_auto_coordinator_outside_a_cluster_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    out = subprocess.run(
        [sys.executable, "-c", "from rl_jax import distributed; distributed.initialize('auto')"],
        capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "coordinator='auto': JAX detects no cluster here" in out.stderr
