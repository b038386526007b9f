"""The trusted half of the code sandbox: runs one untrusted program and reports on it.

This file is executed as a script (``python -I -S sandbox_runner.py``), never imported by the
library, and uses only the standard library. :mod:`rl_jax.envs.sandbox` starts it, writes one JSON
job to its stdin and reads one JSON report from its stdout.

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
   bounding set, ``no_new_privs``), a seccomp filter (:func:`_load_seccomp`), cwd and HOME a
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
import builtins
import ctypes
import fcntl
import json
import os
import resource
import selectors
import signal
import sys
import time

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAPBSET_DROP = 24
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


# Seccomp (through the system's libseccomp): what a program may not ask of the kernel. Namespaces
# would let it become root of a user namespace and mount filesystems outside the disk limit;
# mounts, keyrings, BPF, perf, userfaultfd and ptrace are kernel surface it has no use for;
# io_uring would bypass the socket rule. Sockets other than AF_UNIX (needed by asyncio and
# multiprocessing) are refused; unix sockets reach nothing of the host (no host path is visible in
# the bwrap root, abstract ones live in the network namespace).
_SECCOMP_LIBRARY = "libseccomp.so.2"
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE, _SCMP_CMP_MASKED_EQ = 1, 7
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_AF_UNIX = 1
_DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key",
    "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev", "name_to_handle_at",
    "open_by_handle_at", "kexec_load", "init_module", "finit_module", "delete_module", "swapon",
    "swapoff", "reboot", "syslog", "acct", "quotactl", "lookup_dcookie", "vhangup")
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACE_FLAGS = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000,
                          0x20000000, 0x40000000)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno_action(errno):
    return 0x00050000 | errno


def _load_seccomp():
    """Installs the filter on this process and its future children (after ``no_new_privs``).

    Raises:
      OSError: if libseccomp is missing or refuses the filter.
    """
    lib = ctypes.CDLL(_SECCOMP_LIBRARY, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(name, errno, *conditions):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a system call of this architecture
        args = (_ArgCmp * max(1, len(conditions)))(*conditions)
        result = lib.seccomp_rule_add_array(ctx, _errno_action(errno), number, len(conditions),
                                            args)
        if result != 0:
            raise OSError(-result, f"seccomp rule for {name}: {os.strerror(-result)}")

    for name in _DENIED_SYSCALLS:
        rule(name, _EPERM)
    for flag in _CLONE_NAMESPACE_FLAGS:
        rule("clone", _EPERM, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
    # clone3's flags sit in memory a filter cannot read; libc falls back to clone on ENOSYS.
    rule("clone3", _ENOSYS)
    for name in ("socket", "socketpair"):
        rule(name, _EAFNOSUPPORT, _ArgCmp(0, _SCMP_CMP_NE, _AF_UNIX, 0))
    result = lib.seccomp_load(ctypes.c_void_p(ctx))
    if result != 0:
        raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


def _drop_bounding_capabilities():
    """Empties the capability bounding set (as root, before giving up the uid)."""
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability of this kernel
                return
            _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")


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


def _confine(job, uid, nproc_limit, file_bytes):
    """In a forked child: rlimits, then the uid, ``no_new_privs`` and the seccomp filter."""
    limits = job["limits"]
    cpu = max(1, int(-(-float(limits["cpu_time"]) // 1)))
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_AS, int(limits["memory_bytes"])),
                       (resource.RLIMIT_FSIZE, file_bytes),
                       (resource.RLIMIT_NOFILE, int(limits["max_open_files"])),
                       (resource.RLIMIT_NPROC, nproc_limit),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
    if os.geteuid() == 0:
        _drop_bounding_capabilities()
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    if job.get("seccomp"):
        _load_seccomp()


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


def _harness_child(job, requests_fd, answers_fd, report_w):
    """In the forked harness: confine (its own uid, no files), run the tests, report. Never
    returns."""
    try:
        keep = {requests_fd, answers_fd, report_w}
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for name in os.listdir("/proc/self/fd"):
            if int(name) > 2 and int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
        os.chdir("/")
        _confine(job, job.get("harness_uid"), 1, 1)
        report = {"results": _run_tests(job["tests"], requests_fd, answers_fd)}
    except BaseException as e:  # noqa: BLE001 - the runner reports a set-up failure
        report = {"setup_error": f"{type(e).__name__}: {e}"[:1000]}
    try:
        data = memoryview(json.dumps(report).encode())
        while data:
            data = data[os.write(report_w, data):]
    finally:
        os._exit(0)


# ---------------------------------------------------------------------------------------------
# Tests in a separate process. The program's side (the codec both sides share and the program's
# answering loop, between the two marker lines) is also the whole ``-c`` source of the program's
# process, so that it starts without the runner's heavier imports.

# >>> program side
# The program's process starts here. Requests come from the trusted harness as length-prefixed
# marshal data; answers go back as JSON lines (written without the json module, whose import of
# re would add to every run's start-up), which the harness parses without evaluating anything.
import marshal  # noqa: E402
import os  # noqa: E402,F811
import sys  # noqa: E402,F811

try:
    from _json import encode_basestring_ascii as _json_string
except ImportError:  # an interpreter without the C accelerator
    from json import dumps as _json_string

_MAX_DEPTH = 100
_ERROR_CHARS = 1000
_PROGRAM_FDS = (3, 4)  # the program's ends: requests in, answers out
_SMALL_INT = 2**53


def _encode(value, ref_of, depth=0):
    """JSON-ready form of ``value``: plain data by value, anything else through
    ``ref_of(value)`` as ``["r", handle, type name]``.

    Plain data is what the builtin types hold: an instance of a subclass (``Counter``, a
    namedtuple, ``numpy.float64``, an ``int`` with its own ``__eq__``) crosses as the builtin
    value it holds, and so does ``range``; an object with ``__index__`` (``numpy.int64``) as its
    integer. Whatever these conversions run, they run here: the other side receives only data.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        value = int.__index__(value)
        return value if -_SMALL_INT < value < _SMALL_INT else ["i", hex(value)]
    if isinstance(value, float):
        return ["f", float.hex(value)]
    if isinstance(value, complex):
        return ["c", float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]
    if isinstance(value, (bytes, bytearray)):
        return ["b", bytes(value).hex()]
    if isinstance(value, dict):
        return ["d", [[_encode(k, ref_of, depth + 1), _encode(v, ref_of, depth + 1)]
                      for k, v in dict.items(value)]]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z")):
        if isinstance(value, base):
            return [tag, [_encode(item, ref_of, depth + 1) for item in base.__iter__(value)]]
    if isinstance(value, range):
        return ["g", [_encode(x, ref_of, depth + 1) for x in (value.start, value.stop,
                                                              value.step)]]
    if hasattr(type(value), "__index__"):
        return _encode(type(value).__index__(value), ref_of, depth + 1)
    return ["r", ref_of(value), type(value).__name__[:100]]


def _decode(data, from_ref, depth=0):
    """The value :func:`_encode` made; ``from_ref(handle, type name)`` stands for a reference.

    Raises:
      ValueError: for anything :func:`_encode` cannot have produced.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, str, int):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"malformed value {str(data)[:100]!r}")
    tag, rest = data[0], data[1:]
    if tag in ("i", "f", "b") and len(rest) == 1 and type(rest[0]) is str:
        return {"i": lambda h: int(h, 16), "f": float.fromhex, "b": bytes.fromhex}[tag](rest[0])
    if tag == "c" and len(rest) == 2 and all(type(x) is str for x in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "r" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
        return from_ref(rest[0], rest[1])
    if len(rest) == 1 and type(rest[0]) is list:
        items = rest[0]
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
            return {_decode(k, from_ref, depth + 1): _decode(v, from_ref, depth + 1)
                    for k, v in items}
        if tag == "g" and len(items) == 3:
            return range(*(_decode(x, from_ref, depth + 1) for x in items))
        make = {"l": list, "t": tuple, "s": set, "z": frozenset}.get(tag)
        if make is not None:
            return make(_decode(item, from_ref, depth + 1) for item in items)
    raise ValueError(f"malformed value {str(data)[:100]!r}")


def _json_text(value):
    """JSON text of an answer: dicts, lists, strings, small ints, booleans and None."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return _json_string(value)
    if type(value) is dict:
        return "{" + ",".join(f"{_json_string(k)}:{_json_text(v)}"
                              for k, v in value.items()) + "}"
    return "[" + ",".join(map(_json_text, value)) + "]"


def _read_request(requests):
    """The next request from the harness, or None at its end."""
    size = requests.read(4)
    if len(size) < 4:
        return None
    return marshal.loads(requests.read(int.from_bytes(size, "little")))


def _serve_program(path):
    """The program's process: runs the program as ``__main__``, then answers the harness.

    Runs under the program's own interpreter, uid and limits; nothing here is trusted.
    """
    import types
    requests = os.fdopen(_PROGRAM_FDS[0], "rb")
    answers = os.fdopen(_PROGRAM_FDS[1], "wb")
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)
    refs = []

    def ref_of(value):
        refs.append(value)
        return len(refs) - 1

    def from_ref(handle, _):
        return refs[handle]

    while (request := _read_request(requests)) is not None:
        try:
            op = request["op"]
            if op == "get":
                if request["name"] not in module.__dict__:
                    answers.write(b'{"missing": true}\n')
                    answers.flush()
                    continue
                value = module.__dict__[request["name"]]
            else:
                target = refs[request["ref"]]
                if op == "call":
                    value = target(*_decode(request["args"], from_ref),
                                   **_decode(request["kwargs"], from_ref))
                elif op == "getattr":
                    value = getattr(target, request["name"])
                else:
                    value = target[_decode(request["key"], from_ref)]
            answer = {"value": _encode(value, ref_of)}
        except BaseException as e:  # noqa: BLE001 - the harness decides what a failure means
            answer = {"error": [type(e).__name__, str(e)[:_ERROR_CHARS]]}
        answers.write(_json_text(answer).encode() + b"\n")
        answers.flush()
# <<< program side


_MESSAGE_BYTES = 16 * 2**20
# Exceptions of the program that tests may catch by their builtin type.
_PASSED_EXCEPTIONS = tuple(
    value for value in vars(builtins).values()
    if isinstance(value, type) and issubclass(value, Exception)
    and not issubclass(value, (StopIteration, StopAsyncIteration)))


def _program_side_source():
    """The ``-c`` source of the program's process when it serves tests."""
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        text = f.read()
    begin = text.index("\n# >>> program side\n")
    end = text.index("\n# <<< program side\n")
    return text[begin:end] + "\n_serve_program(sys.argv[1])\n"


class ProgramExited(Exception):
    """The program's process ended (or broke the protocol) before answering."""


class ProgramError(Exception):
    """The program raised an exception that is not a builtin ``Exception`` type."""


class _Remote:
    """An object that stays in the program: it can be called, and its attributes and items read;
    comparing, hashing or converting it is refused, since the program would decide the result."""

    __slots__ = ("_client", "_handle", "_type")

    def __init__(self, client, handle, type_name):
        self._client, self._handle, self._type = client, handle, type_name

    def __call__(self, *args, **kwargs):
        return self._client.request({"op": "call", "ref": self._handle,
                                     "args": self._client.encode(list(args)),
                                     "kwargs": self._client.encode(dict(kwargs))})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._client.request({"op": "getattr", "ref": self._handle, "name": name})

    def __getitem__(self, key):
        return self._client.request({"op": "getitem", "ref": self._handle,
                                     "key": self._client.encode(key)})

    def __repr__(self):
        return f"<{self._type} object of the program>"

    def _refuse(self, *args):
        raise TypeError(f"the test compared or converted a {self._type} object of the program; "
                        "tests see plain data (numbers, strings, bytes, lists, tuples, sets, "
                        "dicts) returned by the program, not its own objects")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = _refuse
    __contains__ = __hash__ = __int__ = __float__ = __index__ = _refuse


class _Client:
    """The harness's end of the two pipes to the program."""

    def __init__(self, requests_fd, answers_fd):
        self._out = os.fdopen(requests_fd, "wb")
        self._in = os.fdopen(answers_fd, "rb")

    def encode(self, value):
        def ref_of(obj):
            if isinstance(obj, _Remote):
                return obj._handle
            raise TypeError(f"a test passed a {type(obj).__name__} to the program; only plain "
                            "data and the program's own objects can be passed")
        return _encode(value, ref_of)

    def request(self, message):
        try:
            data = marshal.dumps(message)
            self._out.write(len(data).to_bytes(4, "little") + data)
            self._out.flush()
        except OSError as e:
            raise ProgramExited(f"the program exited before answering ({e.strerror})") from None
        line = self._in.readline(_MESSAGE_BYTES + 1)
        if not line.endswith(b"\n"):
            raise ProgramExited("the program exited before answering" if len(line) <= _MESSAGE_BYTES
                                else f"the program's answer exceeded {_MESSAGE_BYTES} bytes")
        try:
            answer = json.loads(line)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
            if answer.get("missing") is True and message["op"] == "get":
                error = KeyError(message["name"])
            elif "error" in answer:
                name, text = (str(x)[:_ERROR_CHARS] for x in answer["error"])
                error = self._exception(name, text)
            else:
                return _decode(answer["value"], lambda h, t: _Remote(self, h, t))
        except (ValueError, TypeError, RecursionError, IndexError, KeyError) as e:
            raise ProgramExited(f"the program broke the test protocol: {e!r}"[:_ERROR_CHARS]) \
                from None
        raise error

    @staticmethod
    def _exception(name, text):
        for kind in _PASSED_EXCEPTIONS:
            if kind.__name__ == name:
                try:
                    return kind(text)
                except Exception:  # noqa: BLE001 - a type that needs other arguments
                    break
        return ProgramError(f"{name}: {text}")


class _TestGlobals(dict):
    """A test's globals: its own names, then builtins, then the program's globals."""

    def __init__(self, client):
        super().__init__(__name__="__test__", __builtins__=builtins)
        self._client = client
        self._builtins = builtins

    def __missing__(self, name):
        if hasattr(self._builtins, name):
            raise KeyError(name)
        value = self._client.request({"op": "get", "name": name})
        self[name] = value
        return value


def _describe_failure(error, source):
    """``"AssertionError at line 2: assert solve(3, 4) == 7"`` for an exception from a test."""
    line = None
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<test>":
            line = frame.tb_lineno
        frame = frame.tb_next
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if line is not None:
        lines = source.splitlines()
        code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        text += f" (test line {line}: {code})"
    return text[:_ERROR_CHARS]


def _run_tests(tests, requests_fd, answers_fd):
    """The harness: runs each test source against the program; returns one result per test."""
    client = _Client(requests_fd, answers_fd)
    results = []
    for source in tests:
        try:
            exec(compile(source, "<test>", "exec"), _TestGlobals(client))
        except ProgramExited as e:
            results.append({"passed": False, "kind": "program_exited",
                            "error": _describe_failure(e, source)})
        except AssertionError as e:
            results.append({"passed": False, "kind": "assertion",
                            "error": _describe_failure(e, source)})
        except BaseException as e:  # noqa: BLE001 - any other failure of a test
            results.append({"passed": False, "kind": "error",
                            "error": _describe_failure(e, source)})
        else:
            results.append({"passed": True})
    return results


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
    if main_status is None:
        return "runtime_error", "the program did not finish"
    return "runtime_error", f"exit code {os.WEXITSTATUS(main_status)}"


def _classify_tests(tests, report, killed_for, program_status, stderr, peak, files, disk, limits,
                    cpu_time):
    """(reason, detail, tests run, tests passed) of a run with tests: ``ok`` only when the
    harness reported every test as run and passed."""
    try:
        results = json.loads(report)["results"]
        if not isinstance(results, list) or len(results) > len(tests):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        results = None
        if report:
            try:
                setup_error = json.loads(report).get("setup_error")
            except (ValueError, AttributeError):
                setup_error = None
            if setup_error:
                return "sandbox_error", f"the test harness failed: {setup_error}", 0, 0
    results = results or []
    ran = [r for r in results if r.get("kind") != "program_exited"]
    passed = sum(r.get("passed") is True for r in results)
    if killed_for is None and len(results) == len(tests) and passed == len(tests):
        return "ok", "", len(ran), passed
    failure = next((r for r in results if r.get("passed") is not True), None)
    if killed_for is None and failure is not None and failure.get("kind") in ("assertion",
                                                                              "error"):
        reason = "test_failed" if failure["kind"] == "assertion" else "runtime_error"
        return reason, f"test {results.index(failure)}: {failure.get('error')}", len(ran), passed
    # The program's process died, or was stopped at a limit, before every test ran.
    reason, detail = _classify(killed_for, program_status, stderr, peak, files, disk, limits,
                               cpu_time)
    if reason == "ok":
        reason, detail = "runtime_error", "exit code 0"
    where = (f"before test {len(ran)} of {len(tests)} ran" if len(ran) < len(tests)
             else "during the tests")
    return reason, f"{detail}; the program stopped {where}", len(ran), passed


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


def run(job):
    """Runs one job and returns the report dict."""
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
        argv[-1:] = ["-c", _program_side_source(), argv[-1]]
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
