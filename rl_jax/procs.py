"""Whether a process is alive, for the owners of shared resources (staging directories, shared
memory, servers watching their parent). A zombie is dead: ``kill(pid, 0)`` succeeds on a
process that exited but was not yet reaped (a killed wrapper's child waits for an init that may
never reap it), and its resources must not be kept for it."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (or is stopped); False once it exited, reaped or not. A process
    this user may not signal counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no procfs (macOS), or it was reaped between the two calls
        return os.path.isdir(f"/proc/{pid}") or not os.path.isdir("/proc/self")
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ")"
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")
