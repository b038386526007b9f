"""Running untrusted Python programs: isolated processes, hard limits, a bounded worker pool.

Every program runs in its own process tree, started by :class:`Sandbox` through the trusted runner
(:mod:`rl_jax.envs.sandbox.runner`, stdlib only; :mod:`rl_jax.envs.sandbox.launch` starts it).
Isolation modes:

``bwrap`` (root and bubblewrap, e.g. Debian's ``bubblewrap`` package, plus the system's
libseccomp; what ``auto`` picks, and the only mode it picks)
  * a minimal read-only root made by bubblewrap: ``/usr`` (with the usual ``/bin``, ``/lib``
    links), the interpreter's own prefixes (a virtual environment and its base Python), a fresh
    ``/proc`` and ``/dev``, ``/etc/ld.so.cache``; nothing else of the host (no work or data
    directories, home directories, ``/run`` sockets, ``/etc``), and nothing writable but the
    sandbox's own tmpfs below;
  * no network: fresh network namespace (only its own loopback), and a seccomp filter that
    refuses sockets other than AF_UNIX; unix sockets reach nothing of the host, as no host path is
    visible and abstract ones belong to the network namespace;
  * everything the ``namespaces`` mode does below, in fresh PID, IPC, UTS and cgroup namespaces.
``namespaces`` (root and ``unshare`` from util-linux; only when asked for)
  * no network: a fresh network namespace, whose loopback is down;
  * a fresh PID namespace whose init is the runner: the program sees only its own processes, and
    when the runner exits (or is killed: ``--kill-child``) the kernel kills every process left;
  * a fresh mount namespace with one tmpfs limited to ``max_disk_bytes`` and ``max_files``
    inodes on ``/tmp``, also bound over ``/var/tmp``, ``/dev/shm`` and ``/run/lock``: the
    program's cwd and HOME are a fresh directory on it, and every file it can create counts
    against those two limits (other directories are not writable by its uid). The tmpfs
    disappears with the namespace;
  * fresh IPC and UTS namespaces (SysV shared memory dies with the sandbox);
  * but the host's filesystem stays readable, with whatever unix sockets it holds.
``rlimits`` (no namespaces; only when asked for)
  a fresh temporary directory whose file count and size the runner polls (and kills past the
  limit), a child subreaper so that detached descendants can still be killed, and the rlimits
  below. No network isolation, the host's filesystem is readable, and directories such as
  ``/tmp`` are writable outside the limit (what a program leaves there fails its run: below).

A mode weaker than ``bwrap`` is never chosen silently: ``auto`` raises :class:`SandboxError` when
``bwrap`` cannot work, and a weaker mode must be asked for by name *and* allowed by the minimum
isolation, which is ``bwrap`` unless lowered: by ``min_isolation=`` (a recipe's ``env.kwargs``) or
by the deployment's environment variable ``RL_JAX_SANDBOX_MIN_ISOLATION``. When that variable is
set, it is a floor that ``min_isolation`` may raise but not lower (:func:`minimum_isolation`).
An allowed weaker mode logs a warning that lists what is not protected. In those modes a program
that leaves files in the host's shared temporary directories (or System V IPC objects) fails
with reason ``host_files`` whatever it printed, and as root what it left is removed
(:mod:`rl_jax.envs.sandbox.leftovers`); with ``rlimits`` it runs in a scratch directory of its
own (cwd, HOME and TMPDIR), removed after each run.

In every mode the program gets a seccomp filter where libseccomp is present (required in
``bwrap``): no new namespaces (``unshare``, ``setns``, namespace flags of ``clone``; so no user
namespace in which to mount past the disk limit), no mounts, keyrings, BPF, perf events,
userfaultfd, io_uring or ptrace, no sockets but AF_UNIX. As root it gets a uid of its own per
concurrent slot (``uid_base + slot``: ``RLIMIT_NPROC`` is per uid and is not enforced for root, so
one fork bomb cannot exhaust another sample's process quota), no supplementary groups, an empty
capability bounding set, ``no_new_privs``, a new session, a scrubbed environment, and these
limits (:class:`SandboxLimits`): wall time (the runner kills the whole tree at the deadline), CPU
time (``RLIMIT_CPU``), address space per process (``RLIMIT_AS``), resident memory of all its
processes together (the runner samples it every 20 ms and kills the tree past the limit; no
cgroup is needed), processes and threads (``RLIMIT_NPROC``), file size (``RLIMIT_FSIZE``), open
files (``RLIMIT_NOFILE``), no core dumps. Memory used by one sandbox is therefore bounded by
``max_total_memory_bytes`` (plus what can be faulted in within one 20 ms sample) plus the tmpfs's
``max_disk_bytes``. Stdout and stderr are read by the runner up to ``max_output_bytes`` each; past
that the program is killed. The parent reads one bounded JSON report; its memory does not grow
with what the program prints. If the caller dies, every runner still kills its program at the
wall deadline and cleans up (``bwrap``: at once).

Tests: ``run(program, tests=[...])`` runs test sources (``assert solve(3, 4) == 7``) in a harness
process of their own (uid ``uid_base + max_concurrency + slot`` as root), which calls into the
program's process over pipes and alone reports the outcome; the result is ``ok`` only when every
test ran and passed (see :mod:`rl_jax.envs.sandbox.runner.harness`). A program cannot pass them
by exiting early, killing processes, printing anything, patching builtins or returning objects
that compare equal to everything.

Concurrency: a :class:`Sandbox` owns a thread pool of ``max_concurrency`` workers, each driving
one sandboxed process at a time; :meth:`Sandbox.run` is awaitable from any event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import os
import queue
import shutil
import tempfile
from collections.abc import Sequence

from rl_jax.envs.sandbox.launch import _bwrap_binds, _Job, _run_job, default_interpreter
from rl_jax.envs.sandbox.leftovers import LeftoverWatch
from rl_jax.envs.sandbox.limits import SandboxError, SandboxLimits, SandboxResult

_SECCOMP_LIBRARY = "libseccomp.so.2"

ISOLATION_MODES = ("auto", "bwrap", "namespaces", "rlimits")
# Strongest first: the modes a minimum isolation accepts are it and those before it.
ISOLATION_STRENGTH = ("bwrap", "namespaces", "rlimits")
MIN_ISOLATION_ENV = "RL_JAX_SANDBOX_MIN_ISOLATION"
DEFAULT_MIN_ISOLATION = "bwrap"
# What the weaker modes leave open (logged when one is asked for).
_UNPROTECTED = {
    "namespaces": ("the host's whole filesystem is readable (project, data and home directories, "
                   "/etc) and unix sockets on it (e.g. under /run) can be connected to"),
    "rlimits": ("no network isolation (host TCP and unix sockets are reachable); the host's "
                "filesystem is readable; /tmp, /var/tmp and /dev/shm are writable outside the "
                "disk limit (a program that leaves anything there fails, and as root what it "
                "left is removed, but while it runs it can fill them); host processes are "
                "visible; without root the program shares its uid with the runner and the test "
                "harness, so it can signal or trace them"),
}

logger = logging.getLogger(__name__)


@functools.cache
def _namespaces_problem() -> str | None:
    """Why the ``namespaces`` mode cannot work here, or None if it does (probed once)."""
    if os.geteuid() != 0:
        return "it needs root (mount and network namespaces, per-sample uids)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "the `unshare` program (util-linux) is not on PATH"
    # The runner itself, as root inside the namespaces: checks the namespaces and the tmpfs mount.
    try:
        interpreter = default_interpreter()
    except SandboxError as e:
        return str(e)
    probe = _run_job(_Job("namespaces", [interpreter, "-I", "-S", "-c", "pass"],
                          seccomp=_seccomp_problem() is None),
                     "", "", SandboxLimits(wall_time=10.0))
    if not probe.ok:
        return f"a trial run failed ({probe.reason}): {probe.detail[-300:]}"
    return None


@functools.cache
def _seccomp_problem() -> str | None:
    """Why the seccomp filter cannot be installed here, or None."""
    try:
        ctypes.CDLL(_SECCOMP_LIBRARY)
    except OSError as e:
        return f"libseccomp is not installed ({_SECCOMP_LIBRARY}: {e})"
    return None


@functools.cache
def _bwrap_problem() -> str | None:
    """Why the ``bwrap`` mode cannot work here, or None if it does (probed once)."""
    if os.geteuid() != 0:
        return "it needs root (per-sample uids, the limited tmpfs)"
    if shutil.which("bwrap") is None:
        return "the `bwrap` program (bubblewrap) is not on PATH"
    problem = _seccomp_problem()
    if problem is not None:
        return problem
    try:
        interpreter = default_interpreter()
        binds = _bwrap_binds(interpreter)
    except SandboxError as e:
        return str(e)
    probe = _run_job(_Job("bwrap", [interpreter, "-I", "-S", "-c", "pass"], seccomp=True,
                          binds=binds), "", "", SandboxLimits(wall_time=10.0))
    if not probe.ok:
        return f"a trial run failed ({probe.reason}): {probe.detail[-300:]}"
    return None


def minimum_isolation(min_isolation: str | None = None) -> tuple[str, str]:
    """``(mode, where it was set)``: the weakest isolation mode a sandbox may use.

    The environment variable :data:`MIN_ISOLATION_ENV`, when set, is the deployment's floor:
    ``min_isolation`` (from a caller or a recipe) may ask for stronger isolation but never
    weaker. Unset, ``min_isolation`` decides, and by default (None) it is ``"bwrap"``.

    Raises:
      SandboxError: for a value that is not one of :data:`ISOLATION_STRENGTH`.
    """
    if min_isolation is not None and min_isolation not in ISOLATION_STRENGTH:
        raise SandboxError(f"min_isolation must be one of {ISOLATION_STRENGTH}, got "
                           f"{min_isolation!r}"[:300])
    floor = os.environ.get(MIN_ISOLATION_ENV)
    if floor is None or floor == "":
        if min_isolation is None:
            return DEFAULT_MIN_ISOLATION, "the default"
        return min_isolation, f"min_isolation={min_isolation!r}"
    if floor not in ISOLATION_STRENGTH:
        raise SandboxError(f"{MIN_ISOLATION_ENV} must be one of {ISOLATION_STRENGTH}, got "
                           f"{floor!r}"[:300])
    where = f"{MIN_ISOLATION_ENV}={floor}"
    if min_isolation is not None and (ISOLATION_STRENGTH.index(min_isolation)
                                      < ISOLATION_STRENGTH.index(floor)):
        return min_isolation, f"min_isolation={min_isolation!r} (above {where})"
    return floor, where


def resolve_isolation(isolation: str = "auto", min_isolation: str | None = None) -> str:
    """The isolation mode ``"auto"`` picks here, or ``isolation`` itself after checking it works
    and is allowed.

    ``"auto"`` means ``"bwrap"`` and nothing weaker; a weaker mode must be asked for by name and
    be allowed by :func:`minimum_isolation` (``"bwrap"`` unless lowered), and then a warning lists
    what it leaves unprotected.

    Raises:
      SandboxError: for an unknown mode, a mode below the minimum, or a mode (``"auto"``
        included) that cannot work here.
    """
    if isolation not in ISOLATION_MODES:
        raise SandboxError(f"isolation must be one of {ISOLATION_MODES}, got {isolation!r}"[:300])
    floor, where = minimum_isolation(min_isolation)
    if isolation != "auto" and (ISOLATION_STRENGTH.index(isolation)
                                > ISOLATION_STRENGTH.index(floor)):
        raise SandboxError(
            f"sandbox isolation {isolation!r} is weaker than the minimum {floor!r} ({where}); "
            f"run with bubblewrap (isolation='bwrap'), or, to accept what {isolation!r} leaves "
            f"open, allow it with min_isolation={isolation!r} (a recipe's env.kwargs) or "
            f"{MIN_ISOLATION_ENV}={isolation} unless the deployment's {MIN_ISOLATION_ENV} forbids "
            "it")
    if isolation in ("auto", "bwrap"):
        problem = _bwrap_problem()
        if problem is None:
            return "bwrap"
        raise SandboxError(
            f"sandbox isolation 'bwrap' is unavailable: {problem}. Install bubblewrap (Debian: "
            "apt-get install bubblewrap) and run as root, or pass isolation='namespaces' or "
            "'rlimits' to run untrusted code with weaker isolation")
    if isolation == "namespaces":
        problem = _namespaces_problem()
        if problem is not None:
            raise SandboxError(f"sandbox isolation 'namespaces' is unavailable: {problem}")
    unprotected = _UNPROTECTED[isolation]
    seccomp = _seccomp_problem()
    if seccomp is not None:
        unprotected += (f"; no seccomp filter ({seccomp}): the program may create user "
                        "namespaces, mount filesystems outside the disk limit and open any socket")
    logger.warning("sandbox: isolation %r was asked for instead of 'bwrap'; not protected: %s",
                   isolation, unprotected)
    return isolation


class Sandbox:
    """A pool that runs Python programs in isolated, limited processes.

    Args:
      limits: default limits of each run.
      max_concurrency: programs running at once (default: the number of CPUs).
      isolation: ``"auto"`` (= ``"bwrap"``), ``"bwrap"``, ``"namespaces"`` or ``"rlimits"``
        (see the module docstring; the last two are weaker and log what they leave open).
      min_isolation: the weakest mode allowed (default ``"bwrap"``); the environment variable
        ``RL_JAX_SANDBOX_MIN_ISOLATION``, when set, is a floor this cannot lower
        (:func:`minimum_isolation`).
      interpreter: absolute path of the Python that runs programs (default:
        :func:`default_interpreter`); as root it must be executable by an unprivileged uid. In
        ``bwrap`` mode its prefixes (not ``/``) are shown to programs read-only.
      uid_base: as root, slot ``k`` runs its program as uid and gid ``uid_base + k`` and its
        test harness as ``uid_base + max_concurrency + k``; pick an unused range.

    Raises:
      SandboxError: for bad arguments, or an isolation mode that cannot work here.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, max_concurrency: int | None = None,
                 isolation: str = "auto", min_isolation: str | None = None,
                 interpreter: str | None = None, uid_base: int = 61000):
        self.limits = limits or SandboxLimits()
        self.max_concurrency = int(max_concurrency or os.cpu_count() or 1)
        if self.max_concurrency < 1:
            raise SandboxError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.isolation = resolve_isolation(isolation, min_isolation)
        self._as_root = os.geteuid() == 0
        self.interpreter = interpreter or default_interpreter(unprivileged=self._as_root)
        if not os.path.isabs(self.interpreter) or not os.access(self.interpreter, os.X_OK):
            raise SandboxError(f"interpreter {self.interpreter!r} is not an executable absolute "
                               "path")
        if self._as_root and not 1000 <= uid_base <= 2**31 - 1 - 2 * self.max_concurrency:
            raise SandboxError(f"uid_base={uid_base} must leave room for "
                               f"{2 * self.max_concurrency} unprivileged uids (>= 1000)")
        self.uid_base = uid_base
        self._seccomp = self.isolation == "bwrap" or _seccomp_problem() is None
        self._binds = _bwrap_binds(self.interpreter) if self.isolation == "bwrap" else ()
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.max_concurrency):
            self._slots.put(slot)
        # rlimits: each run's scratch directory (the program's cwd, HOME and TMPDIR) lives in a
        # directory of this sandbox, not directly in the watched /tmp, and is removed after it.
        self._scratch = None
        if self.isolation == "rlimits":
            self._scratch = tempfile.mkdtemp(prefix="rl_jax_sandbox_")
            os.chmod(self._scratch, 0o711)  # the program's uid must reach its own directory
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.max_concurrency, thread_name_prefix="sandbox")

    def close(self) -> None:
        """Waits for running programs, stops the worker threads, removes the scratch space."""
        self._pool.shutdown(wait=True)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def run(self, program: str, stdin: str = "", *, limits: SandboxLimits | None = None,
                  tests: Sequence[str] | None = None) -> SandboxResult:
        """Runs ``program`` (Python source) with ``stdin``; waits for a free worker first.

        Args:
          tests: Python sources run one after the other by a separate harness process against
            the program's globals once the program has run (see the module docstring); the
            result is ``ok`` only if every test ran and passed, ``test_failed`` at the first
            failed assertion, ``runtime_error`` when a test raised or the program stopped first.

        Raises:
          SandboxError: if ``tests`` is not a non-empty list of strings.
        """
        tests = _check_tests(tests)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, functools.partial(self._run_in_slot, program, stdin, limits, tests))

    def run_sync(self, program: str, stdin: str = "", *, limits: SandboxLimits | None = None,
                 tests: Sequence[str] | None = None) -> SandboxResult:
        """Blocking :meth:`run`, through the same worker pool."""
        tests = _check_tests(tests)
        return self._pool.submit(self._run_in_slot, program, stdin, limits, tests).result()

    def _run_in_slot(self, program: str, stdin: str, limits: SandboxLimits | None,
                     tests: list[str] | None) -> SandboxResult:
        slot = self._slots.get()  # never blocks: one slot per worker thread
        try:
            return self._run(program, stdin, limits or self.limits, slot, tests)
        finally:
            self._slots.put(slot)

    def _run(self, program: str, stdin: str, limits: SandboxLimits, slot: int,
             tests: list[str] | None) -> SandboxResult:
        argv = [self.interpreter, "-I", "-B", "-X", "utf8", "program.py"]
        uid = self.uid_base + slot if self._as_root else None
        harness_uid = self.uid_base + self.max_concurrency + slot if self._as_root else None
        if self.isolation == "bwrap":
            job = _Job(self.isolation, argv, seccomp=self._seccomp, binds=self._binds,
                       tests=tests, uid=uid, harness_uid=harness_uid)
            return _run_job(job, program, stdin, limits)
        watch = LeftoverWatch(frozenset(u for u in (uid, harness_uid) if u is not None)).start()
        work_parent = None
        if self._scratch is not None:
            work_parent = tempfile.mkdtemp(dir=self._scratch)
            os.chmod(work_parent, 0o711)
        job = _Job(self.isolation, argv, seccomp=self._seccomp, tests=tests, uid=uid,
                   harness_uid=harness_uid, work_parent=work_parent)
        try:
            result = _run_job(job, program, stdin, limits)
        finally:
            if work_parent is not None:  # also when the runner was killed before its clean-up
                shutil.rmtree(work_parent, ignore_errors=True)
        return watch.check(result)


def _check_tests(tests: Sequence[str] | None) -> list[str] | None:
    if tests is None:
        return None
    if isinstance(tests, str) or not tests or not all(isinstance(t, str) for t in tests):
        raise SandboxError(f"tests must be a non-empty list of Python sources, got {tests!r}"[:300])
    return list(tests)


