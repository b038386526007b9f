"""The guard that ends a server (and what the server started) with the process that started it:
rl_jax.generator.launcher.orphan_guard, as the launcher runs SGLang under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A "server" that starts a child of its own and prints both pids, then sleeps.
SERVER = ("import os, subprocess, sys, time; "
          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "print(os.getpid(), c.pid, flush=True); time.sleep(600)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pids, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _guarded(parent_pid: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rl_jax.generator.launcher.orphan_guard",
         f"--parent_pid={parent_pid}",
         "--", sys.executable, "-c", SERVER],
        stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_the_server_and_its_children_end_with_the_parent():
    # A parent that starts the guarded server, prints the pids, then is killed (-9).
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-m', "
         "'rl_jax.generator.launcher.orphan_guard', f'--parent_pid={os.getpid()}', '--', "
         "sys.executable, "
         f"'-c', {SERVER!r}], stdout=subprocess.PIPE, text=True, start_new_session=True); "
         "print(p.pid, p.stdout.readline().strip(), flush=True); import time; time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    guard, server, child = (int(x) for x in parent.stdout.readline().split())
    assert all(_alive(p) for p in (guard, server, child))
    parent.kill()
    parent.wait()
    assert _wait_gone([guard, server, child]), "the server outlived the process that started it"


def test_a_signal_to_the_group_stops_the_server_and_the_guard_reports_its_status():
    proc = _guarded(os.getpid())
    server, child = (int(x) for x in proc.stdout.readline().split())
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM  # the server's own status, as a shell says
    assert _wait_gone([server, child])


def test_the_guard_leaves_with_the_commands_exit_status():
    done = subprocess.run([sys.executable, "-m", "rl_jax.generator.launcher.orphan_guard",
                           f"--parent_pid={os.getpid()}", "--", sys.executable, "-c",
                           "raise SystemExit(7)"], timeout=60)
    assert done.returncode == 7
