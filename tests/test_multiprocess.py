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
