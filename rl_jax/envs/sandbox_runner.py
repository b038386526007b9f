"""The trusted half of the code sandbox: runs one untrusted program and reports on it.

This file is executed as a script (``python -I -S sandbox_runner.py``), never imported by the
library, and uses only the standard library. :mod:`rl_jax.envs.sandbox` starts it, writes one JSON
job to its stdin and reads one JSON report from its stdout.

In ``namespaces`` mode it runs as root inside fresh network, PID, mount, IPC and UTS namespaces
(made by ``unshare --fork --kill-child --mount-proc``), where it is PID 1. It then

1. mounts one tmpfs, limited in bytes (``size``) and inodes (``nr_inodes``), on ``/tmp`` and binds
   it over the other world-writable directories (``/var/tmp``, ``/dev/shm``, ``/run/lock``), so
   that every file the program can create counts against the same two limits;
2. forks the program: a new session, rlimits (CPU, address space, file size, open files,
   processes, no core dumps), a uid/gid of its own (no supplementary groups, ``no_new_privs``),
   cwd and HOME a fresh directory on the tmpfs, a scrubbed environment, stdin from a memfd;
3. reads its stdout/stderr up to a byte cap, reaps every process (it is the namespace's init),
   samples the process count and their total resident memory every 20 ms, and stops at the wall
   deadline, at a cap, or when the program's main process exits; then SIGKILLs every process in
   the namespace.

When the runner exits, the kernel kills whatever is left in the PID namespace and frees the tmpfs.

In ``rlimits`` mode (no namespaces) it uses a fresh temporary directory, counts the files in it
while the program runs, makes itself a child subreaper so that escaped descendants stay its
children, and kills by uid (when root) or by walking its descendants. There is no network
isolation and writable directories outside the work directory are not limited.

Report reasons: ``ok``, ``runtime_error``, ``timeout``, ``memory``, ``output_limit``,
``file_limit``, ``process_limit``, ``sandbox_error``.
"""

import base64
import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_WRITABLE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock")
_POLL_SECONDS = 0.02
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_DRAIN_SECONDS = 0.05

_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"[Errno 12]", b"std::bad_alloc",
                   b"out of memory")
_PROCESS_MARKERS = (b"[Errno 11] Resource temporarily unavailable", b"can't start new thread",
                    b"fork: retry", b"Resource temporarily unavailable")
_FILE_MARKERS = (b"[Errno 28]", b"No space left on device", b"[Errno 27]", b"File too large",
                 b"[Errno 24]", b"Too many open files", b"[Errno 122]", b"Disk quota exceeded")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data):
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def _setup_namespace_fs(limits, num_files):
    """The limited tmpfs on /tmp (bound over the other writable dirs); returns the work dir."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
    inodes = int(limits["max_files"]) + 2 + num_files  # + the root and work dirs, our files
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={int(limits['max_disk_bytes'])},nr_inodes={inodes},mode=1777")
    for path in _WRITABLE_DIRS:
        if os.path.isdir(path):
            _mount("/tmp", path, None, _MS_BIND, None)
    return "/tmp/work"


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


def _program_pids(namespaces, uid, runner_pid):
    """The program's live processes: all but init in the namespace, else those of its uid, else
    the runner's descendants."""
    if namespaces:
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and n != "1"]
    if uid is None:
        return sorted(_descendants(runner_pid))
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
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


def _kill_all(namespaces, uid, main_pid, statuses):
    """SIGKILL every process of the program, however it detached itself."""
    if namespaces:
        for _ in range(100):
            try:
                os.kill(-1, signal.SIGKILL)  # every process in the namespace except init (us)
            except ProcessLookupError:
                return
            _reap_all(False, main_pid, statuses)
        return
    if uid is not None:
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
        _reap_all(False, main_pid, statuses)


def _reap_all(block, main_pid=None, statuses=None):
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if statuses is not None and pid == main_pid:
            statuses.append(status)


def _child(job, work_dir, stdin_fd, out_w, err_w, status_w):
    """In the forked child: confine, then exec the program. Never returns."""
    try:
        limits, uid = job["limits"], job.get("uid")
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        cpu = max(1, int(-(-float(limits["cpu_time"]) // 1)))
        for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                           (resource.RLIMIT_AS, int(limits["memory_bytes"])),
                           (resource.RLIMIT_FSIZE, int(limits["max_file_bytes"])),
                           (resource.RLIMIT_NOFILE, int(limits["max_open_files"])),
                           (resource.RLIMIT_NPROC, int(job["nproc_limit"])),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        os.chdir(work_dir)
        os.umask(0o077)
        env = dict(job["env"], HOME=work_dir, TMPDIR=work_dir)
        os.execve(job["argv"][0], job["argv"], env)
    except BaseException as e:  # noqa: BLE001 - report any set-up failure to the runner
        try:
            os.write(status_w, f"{type(e).__name__}: {e}".encode()[:1000])
        finally:
            os._exit(127)


def _classify(killed_for, main_status, stderr, peak, files, disk, limits, cpu_time):
    if killed_for == "output_limit":
        return "output_limit", "stdout or stderr exceeded max_output_bytes"
    if killed_for == "memory":
        return "memory", f"total resident memory above {limits['max_total_memory_bytes']} bytes"
    exited_ok = (main_status is not None and os.WIFEXITED(main_status)
                 and os.WEXITSTATUS(main_status) == 0 and killed_for is None)
    if exited_ok:
        return "ok", ""
    signaled = main_status is not None and os.WIFSIGNALED(main_status)
    sig = os.WTERMSIG(main_status) if signaled else None
    if (killed_for == "file_limit" or sig == signal.SIGXFSZ or files >= int(limits["max_files"])
            or disk >= int(limits["max_disk_bytes"]) - 65536
            or any(m in stderr for m in _FILE_MARKERS)):
        return "file_limit", f"{files} files, {disk} bytes created"
    if peak >= int(limits["max_processes"]) or any(m in stderr for m in _PROCESS_MARKERS):
        return "process_limit", f"peak {peak} processes (limit {limits['max_processes']})"
    if any(m in stderr for m in _MEMORY_MARKERS):
        return "memory", f"address-space limit {limits['memory_bytes']} bytes per process"
    if killed_for == "timeout":
        return "timeout", f"wall time limit {limits['wall_time']} s"
    # SIGXCPU comes only from RLIMIT_CPU's soft limit; a program that ignores it is SIGKILLed at
    # the hard limit a second later (rusage can read slightly below either).
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL
                                 and cpu_time >= 0.9 * float(limits["cpu_time"])):
        return "timeout", f"CPU time limit {limits['cpu_time']} s"
    if sig is not None:
        return "runtime_error", f"killed by signal {signal.Signals(sig).name}"
    return "runtime_error", f"exit code {os.WEXITSTATUS(main_status)}"


def run(job):
    """Runs one job and returns the report dict."""
    limits, uid = job["limits"], job.get("uid")
    namespaces = job["mode"] == "namespaces"
    start = time.monotonic()
    temp_dir = None
    if namespaces:
        work_dir = _setup_namespace_fs(limits, len(job["files"]))
    else:
        _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(child_subreaper)")
        temp_dir = tempfile.mkdtemp(prefix="rl_jax_sandbox_", dir=job.get("work_parent"))
        os.chmod(temp_dir, 0o755)
        work_dir = os.path.join(temp_dir, "work")
    os.mkdir(work_dir, 0o700)
    for name, text in job["files"].items():
        with open(os.path.join(work_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(os.path.join(work_dir, name), 0o644)
    if uid is not None:
        os.chown(work_dir, uid, uid)
    base_inodes = 0
    if namespaces:
        st = os.statvfs("/tmp")
        base_inodes = st.f_files - st.f_ffree

    # RLIMIT_NPROC counts every task of the real uid. A uid of the sandbox's own starts from zero;
    # without one (not root) the limit is on top of what this user already runs.
    job["nproc_limit"] = int(limits["max_processes"]) + (
        0 if uid is not None else _tasks_of_uid(os.getuid()))
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job["stdin"].encode("utf-8"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    main_pid = os.fork()
    if main_pid == 0:
        os.close(out_r)
        os.close(err_r)
        os.close(status_r)
        _child(job, work_dir, stdin_fd, out_w, err_w, status_w)
    for fd in (out_w, err_w, status_w, stdin_fd):
        os.close(fd)
    setup_error = b""
    while chunk := os.read(status_r, 4096):
        setup_error += chunk
    os.close(status_r)

    cap = int(limits["max_output_bytes"])
    buffers = {out_r: bytearray(), err_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = start + float(limits["wall_time"])
    statuses, killed_for, peak, files, disk, peak_memory = [], None, 1, 0, 0, 0
    runner_pid = os.getpid()
    next_sample, drain_until = 0.0, None
    while True:
        now = time.monotonic()
        stop_at = drain_until if drain_until is not None else deadline
        for key, _ in sel.select(max(0.0, min(_POLL_SECONDS, stop_at - now))):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                continue
            buffers[key.fd] += data
            if len(buffers[key.fd]) > cap:
                killed_for = "output_limit"
        _reap_all(False, main_pid, statuses)
        now = time.monotonic()
        if now >= next_sample:
            next_sample = now + _POLL_SECONDS
            pids = _program_pids(namespaces, uid, runner_pid)
            peak = max(peak, len(pids))
            peak_memory = max(peak_memory, _resident_bytes(pids))
            if peak_memory > int(limits["max_total_memory_bytes"]):
                killed_for = killed_for or "memory"
            files, disk = _fs_usage(work_dir, namespaces, base_inodes, int(limits["max_files"]))
            if not namespaces and (files > int(limits["max_files"])
                                   or disk > int(limits["max_disk_bytes"])):
                killed_for = killed_for or "file_limit"
        if killed_for is not None or setup_error:
            break
        if statuses and drain_until is None:
            drain_until = min(deadline, now + _DRAIN_SECONDS)
        if drain_until is not None and (now >= drain_until or not sel.get_map()):
            break
        if now >= deadline:
            killed_for = "timeout"
            break
    wall_time = time.monotonic() - start
    files, disk = _fs_usage(work_dir, namespaces, base_inodes, int(limits["max_files"]))
    _kill_all(namespaces, uid, main_pid, statuses)
    _reap_all(True, main_pid, statuses)
    cpu_time = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_time = cpu_time.ru_utime + cpu_time.ru_stime
    for fd in buffers:
        os.close(fd)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)

    main_status = statuses[0] if statuses else None
    stdout, stderr = bytes(buffers[out_r][:cap]), bytes(buffers[err_r][:cap])
    if setup_error:
        reason, detail = "sandbox_error", setup_error.decode("utf-8", "replace")
    else:
        reason, detail = _classify(killed_for, main_status, stderr, peak, files, disk, limits,
                                   cpu_time)
    exited = main_status is not None and os.WIFEXITED(main_status)
    signaled = main_status is not None and os.WIFSIGNALED(main_status)
    return {
        "reason": reason, "detail": detail,
        "exit_code": os.WEXITSTATUS(main_status) if exited else None,
        "signal": os.WTERMSIG(main_status) if signaled else None,
        "stdout_b64": base64.b64encode(stdout).decode(),
        "stderr_b64": base64.b64encode(stderr).decode(),
        "stdout_truncated": len(buffers[out_r]) > cap,
        "stderr_truncated": len(buffers[err_r]) > cap,
        "wall_time": wall_time, "cpu_time": cpu_time,
        "peak_processes": peak, "peak_memory_bytes": peak_memory,
        "files_created": max(files, 0), "disk_bytes": disk,
    }


def main():
    job = json.loads(sys.stdin.buffer.read())
    try:
        report = run(job)
    except Exception as e:  # noqa: BLE001 - the parent turns this into a sandbox_error
        report = {"reason": "sandbox_error", "detail": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
