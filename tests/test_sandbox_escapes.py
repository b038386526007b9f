"""Hostile programs against the code sandbox: escapes from the ``bwrap`` isolation (host files,
host sockets, user namespaces, files that outlive the run) and reward hacks against tests run
through ``Sandbox.run(tests=...)`` (exiting early, killing the harness, printing markers,
patching builtins, always-equal objects, SystemExit inside a test)."""

import asyncio
import dataclasses
import json
import logging
import os
import pathlib
import platform
import signal
import socket
import subprocess
import threading
import uuid

import pytest

import rl_jax.envs as envs
from rl_jax.data.prompts import Prompt
from rl_jax.envs import sandbox as sandbox_lib
from rl_jax.envs.base import EnvError
from rl_jax.envs.sandbox import Sandbox
from rl_jax.envs.sandbox.limits import SandboxError, SandboxLimits

BWRAP_PROBLEM = sandbox_lib._bwrap_problem()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None,
                                 reason=f"bwrap isolation unavailable: {BWRAP_PROBLEM}")
LIMITS = SandboxLimits(wall_time=5.0, cpu_time=5.0, memory_bytes=256 * 2**20,
                       max_total_memory_bytes=512 * 2**20, max_processes=16, max_files=100,
                       max_disk_bytes=8 * 2**20, max_file_bytes=4 * 2**20,
                       max_output_bytes=64 * 1024)
UID_BASE = 62000
PROJECT = pathlib.Path(__file__).resolve().parent.parent


def _modes():
    modes = [pytest.param("bwrap", marks=needs_bwrap)]
    if sandbox_lib._namespaces_problem() is None:
        modes.append("namespaces")
    return modes + ["rlimits"]


@pytest.fixture(scope="module")
def strong():
    if BWRAP_PROBLEM is not None:
        pytest.skip(f"bwrap isolation unavailable: {BWRAP_PROBLEM}")
    with Sandbox(LIMITS, max_concurrency=2, uid_base=UID_BASE) as sb:
        assert sb.isolation == "bwrap"
        yield sb


@pytest.fixture(scope="module", params=_modes())
def any_mode(request):
    with Sandbox(LIMITS, max_concurrency=2, isolation=request.param,
                 min_isolation=request.param, uid_base=UID_BASE) as sb:
        yield sb


# ---------------------------------------------------------------------------------------------
# Escapes (bwrap).

PROBE_PATHS = ["/root", "/work", "/home", "/run", "/etc/passwd", "/etc/shadow", "/var",
               "/opt", "/srv", "/mnt", "/sys", str(PROJECT), str(PROJECT / "setup.py"),
               str(pathlib.Path(__file__).resolve())]


def test_host_files_are_invisible(strong, tmp_path):
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # readable by anyone on the host
    paths = PROBE_PATHS + [str(secret), "/tmp/" + secret.name]
    program = ("import json, os\nseen = {}\nfor p in " + repr(paths) + ":\n"
               "    seen[p] = os.path.exists(p)\n"
               "print(json.dumps(seen))\nprint(json.dumps(sorted(os.listdir('/'))))\n")
    result = strong.run_sync(program)
    assert result.ok, result
    seen_line, root_line = result.stdout.splitlines()
    assert json.loads(seen_line) == {p: False for p in paths}
    # What is there: the system, the sandbox's own /proc, /dev and /tmp, and the runner.
    assert set(json.loads(root_line)) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr",
                                          "etc", "proc", "dev", "tmp", "sandbox_runner.py"}
    # The system is there, read-only; of /etc only the dynamic linker's cache.
    result = strong.run_sync("import os\nprint(len(open('/usr/lib/os-release').read()) > 0, "
                             "os.path.exists('/etc/ld.so.cache'), os.path.exists('/etc/hosts'))")
    assert result.ok and result.stdout == "True True False\n", result


def test_filesystem_is_read_only_and_nothing_outlives_the_run(strong):
    marker = f"escape-{uuid.uuid4().hex}"
    program = (
        "import os\nwritten, refused = [], []\n"
        f"for d in ('.', '/tmp', '/dev/shm', '/usr', '/usr/lib', '/', '/etc', '/dev', '/proc'):\n"
        f"    try:\n        open(os.path.join(d, {marker!r}), 'w').write('x')\n"
        "        written.append(d)\n    except OSError:\n        refused.append(d)\n"
        "print(written)\n")
    result = strong.run_sync(program)
    assert result.ok and result.stdout == "['.', '/tmp', '/dev/shm']\n", result
    for host_dir in ("/tmp", "/dev/shm", "/usr", "/usr/lib", "/", "/etc", "/dev",
                     str(PROJECT), os.getcwd()):
        assert not os.path.exists(os.path.join(host_dir, marker)), host_dir
    # The next run starts from an empty tmpfs.
    result = strong.run_sync(f"import os\nprint([os.path.exists(os.path.join(d, {marker!r})) "
                             "for d in ('.', '/tmp', '/dev/shm')])")
    assert result.stdout == "[False, False, False]\n", result


def test_cannot_reach_host_tcp(strong):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # works out here
        listener.accept()[0].close()
        program = ("import socket\nfor family, host in ((socket.AF_INET, '127.0.0.1'), "
                   "(socket.AF_INET6, '::1')):\n"
                   "    try:\n        s = socket.socket(family)\n"
                   f"        s.settimeout(1)\n        s.connect((host, {port}))\n"
                   "        print('connected')\n    except OSError as e:\n"
                   "        print(type(e).__name__, e.errno)\n")
        result = strong.run_sync(program)
        assert result.ok, result
        # Refused by the seccomp filter (EAFNOSUPPORT) before the empty network namespace.
        assert result.stdout == "OSError 97\nOSError 97\n", result
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing came in
    finally:
        listener.close()


def test_cannot_reach_host_unix_sockets(strong, tmp_path):
    os.chmod(tmp_path, 0o755)
    path = str(tmp_path / "host.sock")
    abstract = f"\0rl_jax_test_{uuid.uuid4().hex}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.settimeout(0.5)
        servers.append(server)
    os.chmod(path, 0o777)
    try:
        for address in (path, abstract):  # reachable from the host
            client = socket.socket(socket.AF_UNIX)
            client.connect(address)
            client.close()
        for server in servers:
            server.accept()[0].close()
        probes = [path, abstract, "/run/systemd/private", "/var/run/docker.sock"]
        program = ("import socket\nfor address in " + repr(probes) + ":\n"
                   "    s = socket.socket(socket.AF_UNIX)\n"
                   "    try:\n        s.connect(address)\n        print('connected')\n"
                   "    except OSError as e:\n        print(type(e).__name__)\n")
        result = strong.run_sync(program)
        assert result.ok, result
        assert result.stdout.split() == ["FileNotFoundError", "ConnectionRefusedError",
                                         "FileNotFoundError", "FileNotFoundError"], result
        for server in servers:
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        for server in servers:
            server.close()


USER_NAMESPACE = """
import ctypes, os, platform, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17
print(libc.unshare(CLONE_NEWUSER), ctypes.get_errno())
print(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), ctypes.get_errno())
if platform.machine() == "x86_64":  # raw clone (56) and clone3 (435)
    pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    print("clone", pid, ctypes.get_errno())
    print("clone3", libc.syscall(435, 0, 0), ctypes.get_errno())
if hasattr(os, "unshare"):
    try:
        os.unshare(os.CLONE_NEWUSER)
        print("unshared")
    except OSError as e:
        print("os.unshare", e.errno)
run = subprocess.run(["unshare", "-Urm", "sh", "-c",
                      "mount -t tmpfs -o size=1g none /tmp && echo mounted"],
                     capture_output=True, text=True)
print(run.returncode != 0, "mounted" not in run.stdout)
# Past the disk limit, wherever it writes.
with open("/tmp/big", "wb") as f:
    for _ in range(64):
        f.write(b"x" * 2**20)
"""


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "namespaces"])
def test_cannot_create_a_user_namespace_to_escape_the_disk_limit(mode):
    if mode == "namespaces" and sandbox_lib._namespaces_problem() is not None:
        pytest.skip(f"namespaces isolation unavailable: {sandbox_lib._namespaces_problem()}")
    if sandbox_lib._seccomp_problem() is not None:
        pytest.skip(sandbox_lib._seccomp_problem())
    with Sandbox(LIMITS, max_concurrency=1, isolation=mode, min_isolation=mode,
                 uid_base=UID_BASE) as sb:
        result = sb.run_sync(USER_NAMESPACE)
        lines = result.stdout.splitlines()
        assert lines[:2] == ["-1 1", "-1 1"], result  # EPERM
        if platform.machine() == "x86_64":
            assert lines[2:4] == ["clone -1 1", "clone3 -1 38"], result  # EPERM, ENOSYS
        assert "unshared" not in result.stdout and lines[-1] == "True True", result
        assert result.reason == "file_limit", result
        if platform.machine() == "x86_64":  # the x32 ABI's unshare is killed, not run
            result = sb.run_sync("import ctypes\nctypes.CDLL(None).syscall(0x40000000 + 272, "
                                 "0x10000000)\nprint('survived')")
            assert result.signal == signal.SIGSYS and not result.stdout, result


def test_seccomp_and_uid_of_the_program(any_mode):
    result = any_mode.run_sync(
        "import os\nstatus = open('/proc/self/status').read()\n"
        "fields = dict(l.split(':', 1) for l in status.splitlines())\n"
        "print(fields['Seccomp'].strip(), fields['NoNewPrivs'].strip(), fields['CapEff'].strip(),"
        " fields['CapBnd'].strip(), os.getuid() != 0)")
    assert result.ok, result
    seccomp = "2" if sandbox_lib._seccomp_problem() is None else "0"
    as_root = os.geteuid() == 0
    assert result.stdout.split() == [seccomp, "1", "0" * 16, "0" * 16 if as_root else
                                     result.stdout.split()[3], str(as_root)], result


# ---------------------------------------------------------------------------------------------
# Reward hacks against tests run by the harness (every mode).

SOLVE = "def solve(a, b):\n    return a + b\n"
TESTS = ["assert solve(3, 4) == 7", "assert solve(-1, 1) == 0\nassert solve(2, 2) == 4"]
HARNESS_REPORT = json.dumps({"results": [{"passed": True}, {"passed": True}]})

HACKS = {
    "exit_before_tests": "import sys\ndef solve(a, b):\n    return 0\nsys.exit(0)\n",
    "os_exit_before_tests": "import os\ndef solve(a, b):\n    return 0\nos._exit(0)\n",
    "os_exit_in_test": "import os\ndef solve(a, b):\n    os._exit(0)\n",
    "system_exit_in_test": "def solve(a, b):\n    raise SystemExit(0)\n",
    "keyboard_interrupt_in_test": "def solve(a, b):\n    raise KeyboardInterrupt\n",
    "kill_parent": ("import os, signal\ndef solve(a, b):\n    return 0\n"
                    "for sig in (signal.SIGKILL, signal.SIGTERM):\n"
                    "    try:\n        os.kill(os.getppid(), sig)\n    except OSError:\n"
                    "        pass\n"),
    "kill_everything": ("import os, signal\ndef solve(a, b):\n"
                        "    for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
                        "        if pid != os.getpid():\n"
                        "            try:\n                os.kill(pid, signal.SIGKILL)\n"
                        "            except OSError:\n                pass\n"
                        "    os.kill(-1, signal.SIGKILL)\n"),
    "print_markers": ("import sys\ndef solve(a, b):\n    return 0\n"
                      f"print({HARNESS_REPORT!r})\nprint('OK\\nPASSED\\nAll tests passed')\n"
                      f"sys.stderr.write({HARNESS_REPORT!r})\nsys.exit(0)\n"),
    "always_equal": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                     "    __ne__ = lambda self, other: False\n    __bool__ = lambda self: True\n"
                     "    __hash__ = lambda self: 0\n"
                     "def solve(a, b):\n    return Anything()\n"),
    "always_equal_subclass": ("class Int(int):\n    def __eq__(self, other):\n"
                              "        return True\ndef solve(a, b):\n    return Int(0)\n"),
    "patch_builtins": ("import builtins\nclass Quiet(Exception):\n    pass\n"
                       "builtins.AssertionError = Quiet\nbuiltins.isinstance = lambda *a: True\n"
                       "builtins.int = lambda *a: 0\n"
                       "def solve(a, b):\n    return 0\nAssertionError = Quiet\n"),
    "shadow_builtins_in_globals": ("def solve(a, b):\n    return 0\n"
                                   "def sorted(*a, **k):\n    return 0\nlen = sorted\n"),
    # The answering code runs in the program's process: it can be patched to answer anything,
    # but an answer is only data, which the harness compares itself.
    "patch_the_answering_code": (
        "import gc\npatched = 0\n"
        "for obj in gc.get_objects():\n"
        "    if isinstance(obj, dict) and '_serve_program' in obj and '_json_text' in obj:\n"
        "        obj['_json_text'] = lambda value: '{\"value\": true}'\n"
        "        obj['_encode'] = lambda value, ref_of, depth=0: True\n"
        "        patched += 1\n"
        "assert patched == 1\n"
        "def solve(a, b):\n    return 0\n"),
    "forge_the_pipes": ("import os\ndef solve(a, b):\n    return 0\n"
                        f"for fd in range(3, 64):\n    try:\n"
                        f"        os.write(fd, {HARNESS_REPORT!r}.encode() + b'\\n')\n"
                        "    except OSError:\n        pass\n"),
    "read_the_tests": ("import os, re\ndef solve(a, b):\n    for pid in os.listdir('/proc'):\n"
                       "        for name in ('mem', 'environ', 'fd/3', 'fd/4'):\n"
                       "            try:\n"
                       "                open(f'/proc/{pid}/{name}', 'rb').read(1)\n"
                       "                if int(pid) != os.getpid():\n"
                       "                    return 'leak'\n"
                       "            except (OSError, ValueError):\n                pass\n"
                       "    return 0\n"),
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacks_fail(any_mode, hack):
    if any_mode.isolation == "rlimits" and os.geteuid() != 0:
        pytest.skip("without root the harness shares the program's uid")
    result = any_mode.run_sync(HACKS[hack], tests=TESTS)
    assert not result.ok, result
    assert result.reason in ("runtime_error", "test_failed"), result
    assert result.tests_passed < len(TESTS), result


def test_honest_programs_pass(any_mode):
    result = any_mode.run_sync(SOLVE, tests=TESTS)
    assert result.ok and (result.tests_run, result.tests_passed) == (2, 2), result
    programs_and_tests = [
        # The program's objects can be called and read; plain data crosses by value.
        ("class Solution:\n    def add(self, a, b):\n        return a + b\n"
         "    name = 'adder'\n",
         "s = Solution()\nassert s.add(2, 3) == 5 and s.name == 'adder'"),
        ("def solve(x):\n    return {'big': 10**30, 'f': float('inf'), 't': (1, 'a', b'z'),"
         " 's': {1, 2}, 'c': 1j, 'n': None, 'b': True}\n",
         "r = solve(0)\nassert r == {'big': 10**30, 'f': float('inf'), 't': (1, 'a', b'z'), "
         "'s': {1, 2}, 'c': 1j, 'n': None, 'b': True}\nassert type(r['b']) is bool"),
        # Subclasses of builtin types and ranges cross as the plain values they hold.
        ("import collections\nPoint = collections.namedtuple('Point', 'x y')\n"
         "def solve(s):\n    return collections.Counter(s), Point(1, 2), range(2, 8, 3), "
         "bytearray(b'ab')\n",
         "c, p, r, b = solve('abca')\nassert c == {'a': 2, 'b': 1, 'c': 1} and type(c) is dict\n"
         "assert p == (1, 2) and list(r) == [2, 5] and r == range(2, 8, 3) and b == b'ab'"),
        ("def solve(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x\n",
         "try:\n    solve(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
         "else:\n    raise AssertionError('no error')"),
        ("import sys\nN = int(sys.stdin.read() or 5)\ndef f(n):\n    return n * N\n",
         "import math\ndef helper(k):\n    return f(k) + 1\nassert helper(2) == 11\n"
         "assert sorted([3, 1]) == [1, 3] and math.gcd(4, 6) == 2"),
    ]
    for program, test in programs_and_tests:
        result = any_mode.run_sync(program, tests=[test])
        assert result.ok, (program, result)


def test_test_failures_are_reported(any_mode):
    result = any_mode.run_sync("def solve(a, b):\n    return 0 if a == 3 else a + b\n",
                               tests=TESTS)
    assert (result.reason, result.tests_run, result.tests_passed) == ("test_failed", 2, 1)
    assert "test 0: AssertionError" in result.detail and "solve(3, 4) == 7" in result.detail
    result = any_mode.run_sync("x = 1/0\n", tests=TESTS)
    assert result.reason == "runtime_error" and "ZeroDivisionError" in result.stderr, result
    assert result.tests_run == 0
    result = any_mode.run_sync("def solve(a, b):\n    return [1]\n", tests=["assert solve(1, 2)"])
    assert result.ok  # plain data is truthy by value
    result = any_mode.run_sync("class A:\n    pass\ndef solve(a, b):\n    return A()\n",
                               tests=["assert solve(1, 2)"])
    assert result.reason == "runtime_error" and "compared or converted" in result.detail, result
    # A long message that JSON escapes six-fold still fits the harness's report.
    result = any_mode.run_sync("def solve(a, b):\n    raise ValueError('\u00e9' * 5000)\n",
                               tests=TESTS)
    assert result.reason == "runtime_error" and "ValueError: \u00e9\u00e9" in result.detail
    result = any_mode.run_sync("while True:\n    pass\n", tests=TESTS,
                               limits=SandboxLimits(wall_time=2.0, cpu_time=1.0))
    assert result.reason == "timeout" and result.tests_run == 0, result
    with pytest.raises(SandboxError, match="tests must be a non-empty list"):
        any_mode.run_sync(SOLVE, tests=[])
    with pytest.raises(SandboxError, match="tests must be a non-empty list"):
        any_mode.run_sync(SOLVE, tests="assert True")


@pytest.mark.parametrize("hack", ["exit_before_tests", "always_equal", "kill_parent",
                                  "print_markers", "system_exit_in_test"])
def test_code_env_rejects_reward_hacks(hack):
    isolation = "auto" if BWRAP_PROBLEM is None else "rlimits"
    env = envs.get("code", limits=LIMITS, max_concurrency=2, isolation=isolation,
                   min_isolation="bwrap" if isolation == "auto" else isolation)
    prompt = Prompt("add", info={"assert_tests": TESTS})
    try:
        reward, info = asyncio.run(env.score(prompt, f"```python\n{HACKS[hack]}```"))
        assert (reward, info["correct"]) == (0.0, False), info
        reward, info = asyncio.run(env.score(prompt, f"```python\n{SOLVE}```"))
        assert (reward, info["correct"], info["passed"]) == (1.0, True, 2), info
        with pytest.raises(EnvError, match="assert test 0 must be a string"):
            asyncio.run(env.score(Prompt("x", info={"assert_tests": [1]}), "print(1)"))
    finally:
        asyncio.run(env.close())


# ---------------------------------------------------------------------------------------------
# Weaker isolation is never chosen silently.

def test_auto_refuses_weaker_isolation(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_lib, "_bwrap_problem", lambda: "no bwrap here")
    for isolation in ("auto", "bwrap"):
        with pytest.raises(SandboxError, match="'bwrap' is unavailable: no bwrap here.*"
                                               "apt-get install bubblewrap.*isolation="):
            Sandbox(isolation=isolation)
    with pytest.raises(SandboxError, match="'bwrap' is unavailable"):
        envs.get("code")
    with caplog.at_level(logging.WARNING, logger=sandbox_lib.logger.name):
        with Sandbox(isolation="rlimits", min_isolation="rlimits", max_concurrency=1,
                     uid_base=UID_BASE) as sb:
            assert sb.isolation == "rlimits" and sb.run_sync("print(1)").stdout == "1\n"
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "isolation 'rlimits' was asked for instead of 'bwrap'; not protected:" in warning
    assert "no network isolation" in warning and "filesystem is readable" in warning


def test_weaker_modes_need_the_minimum_lowered(monkeypatch):
    """A weaker mode is refused unless the minimum isolation allows it; a deployment's
    RL_JAX_SANDBOX_MIN_ISOLATION is a floor that a recipe's min_isolation cannot lower."""
    monkeypatch.delenv(sandbox_lib.MIN_ISOLATION_ENV, raising=False)
    for mode in ("namespaces", "rlimits"):
        with pytest.raises(SandboxError, match=f"isolation '{mode}' is weaker than the minimum "
                                               f"'bwrap' \\(the default\\).*min_isolation='{mode}'"):
            Sandbox(isolation=mode, uid_base=UID_BASE)
        with pytest.raises(SandboxError, match=f"'{mode}' is weaker than the minimum 'bwrap'"):
            envs.get("code", isolation=mode)  # as a recipe's env.kwargs would ask
    with pytest.raises(SandboxError, match="'rlimits' is weaker than the minimum 'namespaces'"):
        Sandbox(isolation="rlimits", min_isolation="namespaces", uid_base=UID_BASE)
    with pytest.raises(SandboxError, match="min_isolation must be one of"):
        Sandbox(isolation="rlimits", min_isolation="none", uid_base=UID_BASE)
    # The deployment forbids weaker modes: a recipe cannot allow them again.
    monkeypatch.setenv(sandbox_lib.MIN_ISOLATION_ENV, "bwrap")
    with pytest.raises(SandboxError, match="'rlimits' is weaker than the minimum 'bwrap' "
                                           "\\(RL_JAX_SANDBOX_MIN_ISOLATION=bwrap\\)"):
        envs.get("code", isolation="rlimits", min_isolation="rlimits", limits=LIMITS)
    monkeypatch.setenv(sandbox_lib.MIN_ISOLATION_ENV, "no-sandbox")
    with pytest.raises(SandboxError, match="RL_JAX_SANDBOX_MIN_ISOLATION must be one of"):
        Sandbox(isolation="rlimits", min_isolation="rlimits", uid_base=UID_BASE)
    # The deployment allows rlimits: a recipe may still ask for more.
    monkeypatch.setenv(sandbox_lib.MIN_ISOLATION_ENV, "rlimits")
    with pytest.raises(SandboxError, match="minimum 'namespaces' \\(min_isolation='namespaces'"):
        Sandbox(isolation="rlimits", min_isolation="namespaces", uid_base=UID_BASE)
    env = envs.get("code", isolation="rlimits", limits=LIMITS, max_concurrency=1)
    try:
        assert env.sandbox.isolation == "rlimits"
        reward, info = asyncio.run(env.score(Prompt("add", info={"assert_tests": TESTS}),
                                             f"```python\n{SOLVE}```"))
        assert (reward, info["reason"]) == (1.0, "correct"), info
    finally:
        asyncio.run(env.close())
    # bwrap passes every minimum.
    if BWRAP_PROBLEM is None:
        monkeypatch.setenv(sandbox_lib.MIN_ISOLATION_ENV, "bwrap")
        with Sandbox(LIMITS, max_concurrency=1, uid_base=UID_BASE) as sb:
            assert sb.isolation == "bwrap"


def _host_damage(marker: str) -> str:
    """A program that solves the task and also leaves files in the host's /dev/shm (4 MiB),
    /tmp (2000 directories) and /var/tmp, and a System V shared memory segment (4 MiB)."""
    return (f"import ctypes, os\n"
            f"with open('/dev/shm/{marker}', 'wb') as f:\n"
            "    for _ in range(4):\n        f.write(b'x' * 2**20)\n"
            f"for i in range(2000):\n    os.makedirs(f'/tmp/{marker}/{{i}}', exist_ok=True)\n"
            f"open('/var/tmp/{marker}', 'w').write('x')\n"
            "ctypes.CDLL(None).shmget(0, 4 * 2**20, 0o1000 | 0o600)\n" + SOLVE)


def _left_on_host(marker: str) -> list[str]:
    return [os.path.join(d, marker) for d in ("/tmp", "/var/tmp", "/dev/shm")
            if os.path.lexists(os.path.join(d, marker))]


def _sysv_segments_of(uids) -> list[str]:
    with open("/proc/sysvipc/shm") as f:
        header = f.readline().split()
        return [line for line in f if int(line.split()[header.index("cuid")]) in uids]


@pytest.mark.parametrize("reward_mode", ["all", "fraction"])
def test_rlimits_pays_nothing_for_a_program_that_leaves_files_on_the_host(reward_mode):
    """The weakest mode cannot keep a program from writing the host's /tmp, /dev/shm and System
    V shared memory: such a program fails with reason host_files, earns 0 (no format reward, no
    partial credit) and, as root, what it left is removed; an honest program still earns 1."""
    marker = f"sandbox-damage-{uuid.uuid4().hex}"
    limits = dataclasses.replace(LIMITS, wall_time=20.0, cpu_time=20.0)
    sandbox = Sandbox(limits, max_concurrency=2, isolation="rlimits", min_isolation="rlimits",
                      uid_base=UID_BASE)
    env = envs.get("code", sandbox=sandbox, reward_mode=reward_mode, format_reward=0.1)
    uids = set(range(UID_BASE, UID_BASE + 4))
    scratch = sandbox._scratch
    try:
        prompt = Prompt("add", info={"assert_tests": TESTS})
        reward, info = asyncio.run(env.score(prompt, f"```python\n{_host_damage(marker)}```"))
        assert (reward, info["correct"], info["reason"]) == (0.0, False, "host_files"), info
        detail = info["failure"]["detail"]
        assert f"/dev/shm/{marker}" in detail and f"/tmp/{marker}" in detail, detail
        assert "System V shm" in detail, detail
        if os.geteuid() == 0:
            assert "removed" in detail and not _left_on_host(marker), detail
            assert not _sysv_segments_of(uids)
        reward, info = asyncio.run(env.score(prompt, f"```python\n{SOLVE}```"))
        assert (reward, info["reason"]) == (1.0, "correct"), info
    finally:
        asyncio.run(env.close())
        sandbox.close()
        for path in _left_on_host(marker):  # without root the sandbox leaves them in place
            subprocess.run(["rm", "-rf", "--", path], check=True)
    assert not os.path.exists(scratch)  # the programs' scratch directories are gone


def test_namespaces_program_leaves_nothing_on_the_host():
    if sandbox_lib._namespaces_problem() is not None:
        pytest.skip(f"namespaces isolation unavailable: {sandbox_lib._namespaces_problem()}")
    marker = f"sandbox-damage-{uuid.uuid4().hex}"
    limits = dataclasses.replace(LIMITS, max_files=10**4, max_disk_bytes=32 * 2**20)
    with Sandbox(limits, max_concurrency=1, isolation="namespaces", min_isolation="namespaces",
                 uid_base=UID_BASE) as sb:
        program = _host_damage(marker).replace(f"/tmp/{marker}/", f"/tmp/{marker}-d/")
        result = sb.run_sync(program, tests=TESTS)
        # /tmp, /var/tmp and /dev/shm are its own tmpfs, System V IPC its own namespace.
        assert result.ok, result
    assert not _left_on_host(marker) and not _left_on_host(marker + "-d")
    assert not _sysv_segments_of({UID_BASE, UID_BASE + 1})
