"""Runs a server command and ends it with the process that started it.

Servers are started in sessions of their own (so that a signal to the trainer's terminal does not
reach them), which also means nothing stops them when the trainer dies without stopping them
(``kill -9``, an out-of-memory kill, a test runner's time limit). This project's servers watch
their parent themselves (``--parent_pid``); SGLang's cannot, so the launcher starts them through
this guard:

    python -m rl_jax.generator.launcher.orphan_guard --parent_pid=PID -- COMMAND...

The guard leads the process group the command runs in. Every ``POLL_S`` it checks that ``PID``
is alive; once it is not, it sends SIGTERM to the whole group (the server and every process the
server started), then SIGKILL after ``GRACE_S``. A SIGTERM or SIGINT sent to the group reaches
the server directly (the guard only waits for it and leaves with its exit status); a SIGKILL of
the group ends both. The guard exits with the command's exit status (128 + N when signal N ended
it, as a shell reports it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from rl_jax.procs import process_alive

POLL_S = 0.5
GRACE_S = 20.0


def _end_group(child: subprocess.Popen) -> int:
    """SIGTERM to this process group, SIGKILL to what is left after ``GRACE_S``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    try:
        return child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the guard too
        return -signal.SIGKILL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parent_pid", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    if os.getpgrp() != os.getpid():  # lead a group of our own (the launcher starts a session)
        os.setpgid(0, 0)
    # A signal to the group reaches the command by itself: the guard waits for it to end.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    child = subprocess.Popen(command)
    while True:
        try:
            return _status(child.wait(POLL_S))
        except subprocess.TimeoutExpired:
            pass
        if not process_alive(args.parent_pid) or os.getppid() == 1:
            print(f"orphan_guard: process {args.parent_pid} ended; stopping {command[0]}",
                  file=sys.stderr, flush=True)
            return _status(_end_group(child))


def _status(returncode: int) -> int:
    """An exit status as a shell gives it: 128 + N for a command ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
