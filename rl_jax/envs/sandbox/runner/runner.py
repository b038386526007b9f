"""The trusted half of the code sandbox: runs one untrusted program and reports on it.

The runner's modules (this directory) use only the standard library and are never imported by
the library: :mod:`rl_jax.envs.sandbox.launch` starts ``python -I -S -c BOOTSTRAP`` and writes
one JSON message to its stdin, the sources of these modules and the job; the bootstrap runs the
modules under their bare names (``runner``, ``protocol``, ...) and calls :func:`main`, which
writes one JSON report to stdout. Nothing of the project is bound into the sandbox.

In ``bwrap`` mode it runs as root (with its capabilities, which the program loses) inside a
minimal read-only root made by bubblewrap (``/usr``, the interpreter's prefixes, a fresh
``/proc`` and ``/dev``; nothing else of the host) and fresh network, PID, IPC, UTS and cgroup
namespaces, where it is PID 1. In ``namespaces`` mode it runs in the same namespaces made by
``unshare --fork --kill-child --mount-proc``, but over the host's filesystem. In both it then

1. mounts one tmpfs, limited in bytes (``size``) and inodes (``nr_inodes``), on ``/tmp`` and binds
   it over the other world-writable directories (``/var/tmp``, ``/dev/shm``, ``/run/lock``), so
   that every file the program can create counts against the same two limits;
2. forks the program: a new session, rlimits (CPU, address space, file size, open files,
   processes, no core dumps), a uid/gid of its own (no supplementary groups, an empty capability
   bounding set, ``no_new_privs``), a seccomp filter (:mod:`seccomp_filter`), cwd and HOME a
   fresh directory on the tmpfs, a scrubbed environment, stdin from a memfd;
3. reads its stdout/stderr up to a byte cap, reaps every process (it is the namespace's init),
   samples the process count and their total resident memory every 20 ms, and stops at the wall
   deadline, at a cap, or when the program's main process exits; then SIGKILLs every process in
   the namespace.

When the runner exits, the kernel kills whatever is left in the PID namespace and frees the tmpfs.

In ``rlimits`` mode (no namespaces) it uses a fresh temporary directory, counts the files in it
while the program runs, makes itself a child subreaper so that escaped descendants stay its
children, and kills by uid (when root) or by walking its descendants. There is no network
isolation and writable directories outside the work directory are not limited.

Tests that call into the program (``job["tests"]``, Python sources such as
``assert solve(3, 4) == 7``) run in a separate *harness* process forked from the runner, under a
uid of its own, never in the program's process. The program runs as usual, then serves the
harness's requests (look up a global, call it, get an attribute or item) over two pipes; plain
data (numbers, strings, bytes, ranges and containers of them; instances of subclasses as the
builtin values they hold) crosses by value, in a JSON encoding decoded without evaluating
anything, and every other object (generators included) stays in the program as an opaque handle
that the tests may call but not compare, iterate, hash or convert. Names the tests use resolve to
builtins first, then to the program's globals. The harness alone holds the pipe on which it
reports which tests ran and passed, so a program that exits early, kills processes, prints
markers, patches builtins or its own copy of this code, or raises ``SystemExit`` fails the
tests it did not let run.

Report reasons: ``ok``, ``runtime_error``, ``test_failed``, ``timeout``, ``memory``,
``output_limit``, ``file_limit``, ``process_limit``, ``sandbox_error``.
"""

import binascii
import fcntl
import json
import os
import resource
import selectors
import sys
import time

from confinement import _PR_SET_CHILD_SUBREAPER, _check, _confine, _libc, _setup_namespace_fs
from harness import _harness_child
from outcome import _classify, _classify_tests
from processes import _fs_usage, _kill_all, _program_pids, _reap_all, _resident_bytes, _tasks_of_uid
from protocol import _ERROR_CHARS, _PROGRAM_FDS

_POLL_SECONDS = 0.02
_DRAIN_SECONDS = 0.05


def _child(job, work_dir, stdin_fd, out_w, err_w, status_w, program_fds):
    """In the forked child: confine, then exec the program. Never returns."""
    try:
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if program_fds is not None:
            high = [_dup_high(fd) for fd in program_fds]
            for fd, target in zip(high, _PROGRAM_FDS):
                os.dup2(fd, target)  # inheritable
        _confine(job, job.get("uid"), int(job["nproc_limit"]),
                 int(job["limits"]["max_file_bytes"]))
        os.chdir(work_dir)
        os.umask(0o077)
        env = dict(job["env"], HOME=work_dir, TMPDIR=work_dir)
        os.execve(job["argv"][0], job["argv"], env)
    except BaseException as e:  # noqa: BLE001 - report any set-up failure to the runner
        try:
            os.write(status_w, f"{type(e).__name__}: {e}".encode()[:1000])
        finally:
            os._exit(127)


def _dup_high(fd):
    """A close-on-exec copy of ``fd`` numbered above the ones :data:`_PROGRAM_FDS` takes."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)


def _read_what_is_left(sel, buffers, caps):
    """Reads the pipes to their end (up to their caps) once every writer has been killed."""
    for fd in list(sel.get_map()):
        while len(buffers[fd]) <= caps[fd]:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            buffers[fd] += data


def run(job, serve_source):
    """Runs one job and returns the report dict; ``serve_source`` is the ``-c`` source of the
    program's process when the job has tests."""
    limits, uid = job["limits"], job.get("uid")
    tests = job.get("tests")
    namespaces = job["mode"] in ("bwrap", "namespaces")
    start = time.monotonic()
    temp_dir = None
    if namespaces:
        work_dir = _setup_namespace_fs(limits, len(job["files"]))
    else:
        _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(child_subreaper)")
        import tempfile  # here only: imports cost start-up time of every run
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
    uids = [u for u in (uid, job.get("harness_uid")) if u is not None]

    # RLIMIT_NPROC counts every task of the real uid. A uid of the sandbox's own starts from zero;
    # without one (not root) the limit is on top of what this user already runs.
    job["nproc_limit"] = int(limits["max_processes"]) + (
        0 if uid is not None else _tasks_of_uid(os.getuid()))
    argv = list(job["argv"])
    if tests is not None:  # the program's process serves the harness (see _serve_program)
        argv[-1:] = ["-c", serve_source, argv[-1]]
        job["argv"] = argv
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, job["stdin"].encode("utf-8"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    harness_fds = ()
    if tests is not None:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        report_r, report_w = os.pipe()
        harness_fds = (requests_r, requests_w, answers_r, answers_w, report_w)
    main_pid = os.fork()
    if main_pid == 0:
        _child(job, work_dir, stdin_fd, out_w, err_w, status_w,
               (requests_r, answers_w) if tests is not None else None)
    watched_pid = main_pid
    if tests is not None:
        watched_pid = os.fork()
        if watched_pid == 0:
            _harness_child(job, requests_w, answers_r, report_w)
    for fd in (out_w, err_w, status_w, stdin_fd, *harness_fds):
        os.close(fd)
    setup_error = b""
    while chunk := os.read(status_r, 4096):
        setup_error += chunk
    os.close(status_r)

    cap = int(limits["max_output_bytes"])
    caps = {out_r: cap, err_r: cap}
    if tests is not None:
        # At most _ERROR_CHARS characters per test, each at most 6 bytes as JSON escapes.
        caps[report_r] = 4096 + len(tests) * (6 * _ERROR_CHARS + 64)
    buffers = {fd: bytearray() for fd in caps}
    sel = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = start + float(limits["wall_time"])
    statuses = {main_pid: None, watched_pid: None}
    killed_for, peak, files, disk, peak_memory = None, 1, 0, 0, 0
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
            if len(buffers[key.fd]) > caps[key.fd]:
                killed_for = "output_limit"
        _reap_all(False, statuses)
        now = time.monotonic()
        if now >= next_sample:
            next_sample = now + _POLL_SECONDS
            pids = _program_pids(namespaces, uids, runner_pid)
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
        if statuses[watched_pid] is not None and tests is not None:
            break  # the harness has reported; the program's output is read to its end below
        if statuses[watched_pid] is not None and drain_until is None:
            drain_until = min(deadline, now + _DRAIN_SECONDS)
        if drain_until is not None and (now >= drain_until or not sel.get_map()):
            break
        if now >= deadline:
            killed_for = "timeout"
            break
    wall_time = time.monotonic() - start
    files, disk = _fs_usage(work_dir, namespaces, base_inodes, int(limits["max_files"]))
    _kill_all(namespaces, uids, statuses)
    _reap_all(True, statuses)
    _read_what_is_left(sel, buffers, caps)
    cpu_time = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_time = cpu_time.ru_utime + cpu_time.ru_stime
    for fd in buffers:
        os.close(fd)
    if temp_dir is not None:
        import shutil
        shutil.rmtree(temp_dir, ignore_errors=True)

    main_status = statuses[main_pid]
    stdout, stderr = bytes(buffers[out_r][:cap]), bytes(buffers[err_r][:cap])
    tests_run = tests_passed = 0
    if setup_error:
        reason, detail = "sandbox_error", setup_error.decode("utf-8", "replace")
    elif tests is not None:
        reason, detail, tests_run, tests_passed = _classify_tests(
            tests, bytes(buffers[report_r]), killed_for, main_status, stderr, peak, files, disk,
            limits, cpu_time)
    else:
        reason, detail = _classify(killed_for, main_status, stderr, peak, files, disk, limits,
                                   cpu_time)
    exited = main_status is not None and os.WIFEXITED(main_status)
    signaled = main_status is not None and os.WIFSIGNALED(main_status)
    return {
        "reason": reason, "detail": detail,
        "exit_code": os.WEXITSTATUS(main_status) if exited else None,
        "signal": os.WTERMSIG(main_status) if signaled else None,
        "stdout_b64": binascii.b2a_base64(stdout, newline=False).decode(),
        "stderr_b64": binascii.b2a_base64(stderr, newline=False).decode(),
        "stdout_truncated": len(buffers[out_r]) > cap,
        "stderr_truncated": len(buffers[err_r]) > cap,
        "wall_time": wall_time, "cpu_time": cpu_time,
        "peak_processes": peak, "peak_memory_bytes": peak_memory,
        "files_created": max(files, 0), "disk_bytes": disk,
        "tests_run": tests_run, "tests_passed": tests_passed,
    }


def main(message):
    """Runs the job of the bootstrap's ``message`` (``{"modules": [[name, source], ...],
    "job": {...}}``) and writes its report to stdout."""
    serve_source = dict(message["modules"])["protocol"] + "\n_serve_program(sys.argv[1])\n"
    try:
        report = run(message["job"], serve_source)
    except Exception as e:  # noqa: BLE001 - the parent turns this into a sandbox_error
        report = {"reason": "sandbox_error", "detail": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
