"""Starting the sandbox's runner on one job and reading its report.

The runner (:mod:`rl_jax.envs.sandbox.runner`, stdlib only) is started as
``python -I -S -c BOOTSTRAP`` under the program's interpreter: directly (``rlimits``), under
``unshare`` (``namespaces``) or under ``bwrap`` in a minimal read-only root (``bwrap``). One JSON
message on its stdin carries the sources of the runner's modules and the job; the bootstrap runs
the modules under their bare names and calls ``runner.main``, which writes one JSON report to
stdout. The parent reads at most a bounded report. Nothing of the project is bound into the
``bwrap`` root: only the system, the interpreter's prefixes, ``/proc``, ``/dev`` and ``/tmp``.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from rl_jax.envs.sandbox.limits import REASONS, SandboxError, SandboxLimits, SandboxResult
from rl_jax.envs.sandbox.runner import MODULES as _RUNNER_MODULE_NAMES

_HIDDEN_IN_SANDBOX = ("/tmp/", "/var/tmp/", "/dev/shm/", "/run/lock/")
_UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
                  "--mount-proc")
# Added to the wall-time limit before the parent kills a runner that has not reported (the runner
# enforces the limit itself; this only covers a runner that is stuck or starved of CPU).
_PARENT_GRACE_SECONDS = 5.0
# The runner's report: two base64 streams of at most max_output_bytes each, plus small fields.
_REPORT_OVERHEAD_BYTES = 64 * 1024
_BWRAP_FLAGS = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--as-pid-1", "--new-session",
                # The runner (root) keeps its capabilities to mount the limited tmpfs and change
                # uid; the program loses them all (setuid, empty bounding set, no_new_privs).
                "--cap-add", "ALL")
# Top-level directories or links a dynamic linker may look in.
_BWRAP_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_RUNNER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner")
# The runner's first code: loads the runner's modules from the message on stdin, in order, under
# their bare names, then hands the message to ``runner.main``.
_RUNNER_BOOTSTRAP = (
    "import json, sys, types\n"
    "message = json.loads(sys.stdin.buffer.read())\n"
    "for name, source in message['modules']:\n"
    "    module = sys.modules[name] = types.ModuleType(name)\n"
    "    exec(compile(source, f'<sandbox runner: {name}>', 'exec'), module.__dict__)\n"
    "sys.modules['runner'].main(message)\n")


@functools.cache
def _runner_modules() -> tuple[tuple[str, str], ...]:
    """``(name, source)`` of the runner's modules in load order, read once per process."""
    sources = []
    for name in _RUNNER_MODULE_NAMES:
        with open(os.path.join(_RUNNER_DIR, f"{name}.py"), encoding="utf-8") as f:
            sources.append((name, f.read()))
    return tuple(sources)


@functools.cache
def _bwrap_binds(interpreter: str) -> tuple[str, ...]:
    """bwrap arguments that show ``interpreter`` its system and prefixes, read-only, at their own
    paths (a virtual environment and the Python it is based on), and nothing else of the host.

    Raises:
      SandboxError: if the interpreter cannot report its prefixes, or one is ``/``.
    """
    try:
        out = subprocess.run(
            [interpreter, "-I", "-S", "-c", "import sys; print('\\0'.join((sys.prefix, "
             "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)))"],
            capture_output=True, timeout=30, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"interpreter {interpreter!r} cannot report its prefixes: {e}") from e
    real = os.path.realpath(interpreter)
    prefixes = {os.path.realpath(p) for p in out.decode().strip().split("\0") if p}
    prefixes.add(os.path.dirname(os.path.dirname(real)))
    prefixes |= {os.path.abspath(p) for p in list(prefixes)}
    if "/" in prefixes:
        raise SandboxError(f"interpreter {interpreter!r} lives directly under / (prefix /); "
                           "showing it to the program would show the whole host")
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _BWRAP_SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for prefix in sorted(prefixes):
        if prefix != "/usr" and not prefix.startswith("/usr/") and os.path.isdir(prefix):
            args += ["--ro-bind", prefix, prefix]
    args += ["--perms", "0755", "--dir", "/etc",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
             "--proc", "/proc", "--dev", "/dev", "--dir", "/tmp",
             "--remount-ro", "/", "--chdir", "/"]
    return tuple(args)


def _usable_by_others(path: str) -> bool:
    """Whether a uid that owns nothing can execute ``path`` (every directory on the way
    searchable, the file readable and executable, by "others")."""
    real = os.path.realpath(path)
    try:
        if os.stat(real).st_mode & 0o005 != 0o005:
            return False
        parent = os.path.dirname(real)
        while True:
            if os.stat(parent).st_mode & 0o001 == 0:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def default_interpreter(unprivileged: bool = True) -> str:
    """The Python that runs sandboxed programs by default.

    This process's interpreter when an unprivileged uid can run it (or ``unprivileged`` is
    False) and it does not live under a directory the sandbox replaces (``/tmp`` ...), else the
    first ``python3`` on PATH that qualifies. Programs see that interpreter's
    standard library and installed packages.

    Raises:
      SandboxError: if no such interpreter exists; pass ``interpreter=`` explicitly.
    """
    candidates = [sys.executable]
    if unprivileged:
        candidates += [shutil.which(name) for name in ("python3", "python")]
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3"]
    for path in candidates:
        # The namespaces mode mounts a fresh tmpfs over these: an interpreter there would vanish.
        hidden = path and any(p.startswith(_HIDDEN_IN_SANDBOX)
                              for p in (os.path.abspath(path), os.path.realpath(path)))
        if path and not hidden and (not unprivileged or _usable_by_others(path)):
            return path
    raise SandboxError(f"no Python interpreter is executable by an unprivileged uid (tried "
                       f"{sys.executable!r} and python3 on PATH); pass interpreter= to Sandbox")


_PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class _Job:
    """How to run programs: the mode, the program's argv (its file last), the confinement."""

    mode: str
    argv: list[str]
    seccomp: bool = False
    binds: tuple[str, ...] = ()  # bwrap's view of the host
    tests: list[str] | None = None
    uid: int | None = None
    harness_uid: int | None = None
    work_parent: str | None = None  # rlimits: where the runner makes the program's directory


def _run_job(spec: _Job, program: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    """Starts the runner (inside bwrap, or fresh namespaces for ``namespaces``) on one job."""
    job = {"mode": spec.mode, "uid": spec.uid, "harness_uid": spec.harness_uid,
           "argv": spec.argv, "files": {"program.py": program}, "stdin": stdin,
           "env": _PROGRAM_ENV, "limits": dataclasses.asdict(limits), "seccomp": spec.seccomp,
           "tests": spec.tests, "work_parent": spec.work_parent}
    # The runner (and the test harness it forks) runs under the program's interpreter: the only
    # one inside bwrap, and one that the harness's unprivileged uid can use in every mode.
    runner = [spec.argv[0], "-I", "-S", "-c", _RUNNER_BOOTSTRAP]
    if spec.mode == "bwrap":
        runner = [shutil.which("bwrap") or "bwrap", *_BWRAP_FLAGS, *spec.binds, "--", *runner]
    elif spec.mode == "namespaces":
        runner = [shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS, *runner]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(runner, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except OSError as e:
        return SandboxResult("sandbox_error", f"cannot start the sandbox runner: {e}")
    try:
        message = {"modules": _runner_modules(), "job": job}
        out, err = proc.communicate(json.dumps(message).encode(),
                                    timeout=limits.wall_time + _PARENT_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return SandboxResult("timeout", "the sandbox runner missed its deadline and was killed",
                             wall_time=time.monotonic() - start)
    report_limit = 3 * limits.max_output_bytes + _REPORT_OVERHEAD_BYTES
    return _parse_report(out[:report_limit], err, proc.returncode)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _parse_report(out: bytes, err: bytes, returncode: int) -> SandboxResult:
    try:
        report = json.loads(out)
    except ValueError:
        return SandboxResult("sandbox_error", f"the runner exited with {returncode} and no "
                             f"report; stderr: {err.decode('utf-8', 'replace')[-500:]}")
    if report.get("reason") not in REASONS:
        return SandboxResult("sandbox_error", f"the runner reported {report!r}"[:1000])
    decoded = {k[:-4]: base64.b64decode(report.pop(k)).decode("utf-8", "replace")
               for k in ("stdout_b64", "stderr_b64") if k in report}
    fields = {f.name for f in dataclasses.fields(SandboxResult)}
    return SandboxResult(**decoded, **{k: v for k, v in report.items() if k in fields})
