"""What the runner watches and kills: the program's processes, memory and files (stdlib only).

The runner samples these every poll (:func:`_program_pids`, :func:`_resident_bytes`,
:func:`_fs_usage`), reaps its children (:func:`_reap_all`) and at the end SIGKILLs every process
of the program and of its harness however they detached themselves (:func:`_kill_all`).
"""

import os
import signal

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _fs_usage(work_dir, namespaces, base_inodes, max_files):
    """(files created, bytes used) on the sandbox's filesystem; stops counting past the limit."""
    if namespaces:
        st = os.statvfs("/tmp")
        return (st.f_files - st.f_ffree - base_inodes,
                (st.f_blocks - st.f_bfree) * st.f_frsize)
    count, size, stack = 0, 0, [work_dir]
    while stack and count <= max_files:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    count += 1
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            size += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:
            pass
    return count - 1, size  # minus the program file


def _program_pids(namespaces, uids, runner_pid):
    """The program's live processes: all but init in the namespace, else those of its uids, else
    the runner's descendants."""
    if namespaces:
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and n != "1"]
    if not uids:
        return sorted(_descendants(runner_pid))
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid in uids:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _resident_bytes(pids):
    """Total resident memory of ``pids`` (shared pages counted once per process)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE_BYTES
        except (OSError, IndexError, ValueError):
            pass
    return total


def _tasks_of_uid(uid):
    """Tasks (threads included, as RLIMIT_NPROC counts them) owned by ``uid`` right now."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count


def _descendants(root_pid):
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                parents[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError):
                pass
    found, frontier = set(), {root_pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def _kill_all(namespaces, uids, statuses):
    """SIGKILL every process of the program (and of its harness), however it detached itself."""
    if namespaces:
        for _ in range(100):
            try:
                os.kill(-1, signal.SIGKILL)  # every process in the namespace except init (us)
            except ProcessLookupError:
                return
            _reap_all(False, statuses)
        return
    for uid in uids:
        killer = os.fork()
        if killer == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                for _ in range(1000):
                    os.kill(-1, signal.SIGKILL)  # every process of this uid except us
            except OSError:
                pass
            os._exit(0)
        os.waitpid(killer, 0)
    for _ in range(100):
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap_all(False, statuses)


def _reap_all(block, statuses=None):
    """Reaps exited children; records the status of those that are keys of ``statuses``."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if statuses is not None and pid in statuses and statuses[pid] is None:
            statuses[pid] = status
