"""Pinning a process to CPU cores, so that trainer and generator pools on one machine do not
compete for the same cores. No JAX import: call :func:`pin` before JAX starts its thread pools."""

from __future__ import annotations

import os
from collections.abc import Iterable


def parse_cores(text: str) -> set[int]:
    """``"0,2-3"`` → ``{0, 2, 3}`` (``taskset -c`` syntax)."""
    cores: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"not a CPU core list: {text!r} (use e.g. '1' or '0,2-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU core range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    if not cores:
        raise ValueError(f"no CPU cores in {text!r}")
    return cores


def existing_cores(text: str) -> set[int]:
    """:func:`parse_cores`, and a ``ValueError`` for cores this machine does not have."""
    cores = parse_cores(text)
    available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    missing = sorted(cores - available)
    if missing:
        raise ValueError(f"CPU cores {missing} do not exist here (this machine has "
                         f"{os.cpu_count()})")
    return cores


def pin_threads(text: str, native_ids: Iterable[int]) -> set[int]:
    """Restricts the threads ``native_ids`` of this process (``threading.Thread.native_id``) to
    the cores ``text`` names; threads they start later inherit it. Returns the cores. On Linux
    CPU affinity is per thread, so a process pinned to one core can still run its host-side
    threads (an HTTP client, a scorer) on another."""
    cores = existing_cores(text)
    for tid in native_ids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that just ended
            pass
    return cores


def pin(text: str) -> set[int]:
    """Restricts this process to the cores ``text`` names; returns them. Raises ``ValueError``
    for a bad list or cores this machine does not have."""
    # Every thread of the process (a thread pool may already exist), and threads started later
    # inherit it from the calling thread.
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = []
    cores = pin_threads(text, threads)
    os.sched_setaffinity(0, cores)
    return cores


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each live thread of this process, summed by
    thread name: Python threads by their ``threading`` name (the main thread as ``"main"``),
    native ones (XLA's thread pool, a web server's workers) by the kernel's name for them
    (``/proc/self/task/<tid>/comm``). Threads that have ended are not counted. Empty where
    ``/proc`` is not available (not Linux)."""
    import threading

    names = {t.native_id: ("main" if t is threading.main_thread() else t.name)
             for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread just ended
            continue
        # pid (comm) state ... : comm may hold spaces and parentheses, so split after the last
        # ')'; utime and stime are then fields 12 and 13 (1-based after the comm).
        comm, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:]
        fields = rest.split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + seconds
    return out


def cpu_seconds_between(before: dict[str, float], after: dict[str, float],
                        floor: float = 0.005) -> dict[str, float]:
    """Per-name CPU seconds spent between two :func:`thread_cpu_seconds` readings, largest
    first, without the names that spent less than ``floor``."""
    spent = {name: after[name] - before.get(name, 0.0) for name in after}
    return {name: round(s, 3) for name, s in sorted(spent.items(), key=lambda kv: -kv[1])
            if s >= floor}


AUTOGROUP_SWITCH = "/proc/sys/kernel/sched_autogroup_enabled"


def autogroup_enabled() -> bool:
    """Whether Linux groups processes by session for CPU scheduling (``CONFIG_SCHED_AUTOGROUP``
    with ``kernel.sched_autogroup_enabled=1``, the default on many distributions). There a
    process's ``nice`` value only orders it against the processes of its own session: two
    sessions share a core equally whatever their processes' nice values."""
    try:
        with open(AUTOGROUP_SWITCH) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def lower_priority(pid: int, nice: int) -> str:
    """Gives process ``pid``, started in a session of its own (``start_new_session=True``, e.g.
    a generator server), the CPU priority ``nice`` (0 to 19) against every other session, and
    returns how: ``"autogroup nice N"`` where scheduling is grouped by session (the session's
    group gets the nice value, writing ``/proc/<pid>/autogroup``), ``"nice N"`` otherwise (the
    process's own nice value, set by the caller, e.g. ``nice -n N`` in its command line, then
    applies), ``"default"`` for 0. Raises ``ValueError`` for a value outside 0..19 (raising
    priority needs privileges) and ``OSError`` if the group's value cannot be written."""
    if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
        raise ValueError(f"nice must be an integer from 0 to 19, got {nice!r}")
    if nice == 0:
        return "default"
    if not autogroup_enabled():
        return f"nice {nice}"
    with open(f"/proc/{pid}/autogroup", "w") as f:
        f.write(str(nice))
    return f"autogroup nice {nice}"


def seconds_since_start(pid: int | str = "self") -> float:
    """Wall seconds since process ``pid`` started (its launch, interpreter start-up included),
    from ``/proc``; NaN where that is not available."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError):
        return float("nan")
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, since boot
