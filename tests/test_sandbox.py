"""The code sandbox and the code environment: every abuse case ends with the right reason within
its limit, without hurting the test process or concurrent programs."""

import asyncio
import os
import pathlib
import resource
import signal
import socket
import time

import pytest

import rl_jax.envs as envs
from rl_jax.data.prompts import Prompt
from rl_jax.envs import sandbox as sandbox_lib
from rl_jax.envs.base import EnvError, run_episode, score_many
from rl_jax.envs.code import CodeTask, extract_program, outputs_match
from rl_jax.envs.sandbox import Sandbox
from rl_jax.envs.sandbox.limits import SandboxError, SandboxLimits

run = asyncio.run

NAMESPACES = sandbox_lib._namespaces_problem() is None
needs_namespaces = pytest.mark.skipif(
    not NAMESPACES, reason=f"namespaces isolation unavailable: {sandbox_lib._namespaces_problem()}")
BWRAP = sandbox_lib._bwrap_problem() is None
# What tests that do not name a mode use: the default where it works, else the weakest mode,
# asked for by name (``auto`` refuses to fall back).
DEFAULT_ISOLATION = "auto" if BWRAP else "rlimits"
MIN_ISOLATION = "bwrap" if BWRAP else "rlimits"  # the weaker mode must be allowed too

WALL = 2.0
LIMITS = SandboxLimits(wall_time=WALL, cpu_time=WALL, memory_bytes=256 * 2**20,
                       max_total_memory_bytes=512 * 2**20, max_processes=16,
                       max_files=100, max_disk_bytes=8 * 2**20, max_file_bytes=2**20,
                       max_output_bytes=64 * 1024)
# Slack for interpreter start-up and the runner's 20 ms polling, on a loaded 2-core machine.
SLACK = 1.5
UID_BASE = 61000

FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"
STUBBORN_FORK_BOMB = ("import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass\n")
THREAD_BOMB = ("import threading, time\nwhile True:\n"
               "    threading.Thread(target=time.sleep, args=(100,)).start()\n")
BUSY_LOOP = "while True:\n    pass\n"
SLEEPER = "import time\ntime.sleep(1000)\n"
MEMORY_HOG = "x = bytearray(2**31)\n"
SLOW_MEMORY_HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n"
# Each child stays under the per-process limit; together they exceed the total.
SPLIT_MEMORY_HOG = ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
                    "        x = bytearray(200 * 2**20)\n        time.sleep(100)\n"
                    "time.sleep(100)\n")
MILLION_FILES = "for i in range(10**6):\n    open(f'f{i}', 'w').close()\n"
FILES_ELSEWHERE = ("import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
                   "    for i in range(10**5):\n"
                   "        open(os.path.join(d, f'f{i}'), 'w').close()\n")
BIG_FILE = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**16)\n"
HUGE_PRINT = "print('x' * 10**7)\n"
ENDLESS_PRINT = "while True:\n    print('spam' * 1000)\n"
ENDLESS_STDERR = "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n"
DETACHED_CHILD = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                  "        time.sleep(1000)\n    os._exit(0)\nprint('parent done')\n")


def _sandbox_processes() -> list[int]:
    """Live processes owned by a sandbox slot uid."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if UID_BASE <= os.stat(f"/proc/{name}").st_uid < UID_BASE + 64:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


@pytest.fixture(scope="module", params=["bwrap", "namespaces", "rlimits"])
def sandbox(request):
    if request.param == "bwrap" and not BWRAP:
        pytest.skip(f"bwrap isolation unavailable: {sandbox_lib._bwrap_problem()}")
    if request.param == "namespaces" and not NAMESPACES:
        pytest.skip(f"namespaces isolation unavailable: {sandbox_lib._namespaces_problem()}")
    with Sandbox(LIMITS, max_concurrency=8, isolation=request.param,
                 min_isolation=request.param, uid_base=UID_BASE) as sb:
        yield sb


def _run_timed(sb: Sandbox, program: str, stdin: str = "", limits=None):
    start = time.monotonic()
    result = sb.run_sync(program, stdin, limits=limits)
    return result, time.monotonic() - start


def test_good_program_and_its_environment(sandbox, monkeypatch):
    monkeypatch.setenv("RL_JAX_TEST_SECRET", "hunter2")
    program = ("import os, sys\nname = input()\nprint('hello', name)\n"
               "print(os.getcwd() == os.environ['HOME'], sorted(os.listdir('.')))\n"
               "print('RL_JAX_TEST_SECRET' in os.environ, os.getuid() != 0)\n"
               "sys.stderr.write('warn')\n")
    result, elapsed = _run_timed(sandbox, program, "world\n")
    assert result.ok, result
    assert result.stdout == "hello world\nTrue ['program.py']\nFalse True\n"
    assert result.stderr == "warn" and result.exit_code == 0
    assert elapsed < SLACK


def test_runs_do_not_share_files(sandbox):
    assert sandbox.run_sync("open('mark', 'w').write('x')").ok
    assert sandbox.run_sync("import os\nassert not os.path.exists('mark')").ok


def test_cannot_write_outside_its_directory(sandbox):
    target = pathlib.Path(__file__).resolve().parent / "sandbox_escape_marker"
    result = sandbox.run_sync(f"open({str(target)!r}, 'w').write('x')")
    # Refused (PermissionError), or invisible: bwrap shows no host directory, and the
    # namespaces mode replaces /tmp with the sandbox's own tmpfs (FileNotFoundError).
    assert result.reason == "runtime_error"
    assert "PermissionError" in result.stderr or ("FileNotFoundError" in result.stderr and (
        sandbox.isolation == "bwrap" or str(target).startswith("/tmp/")))
    assert not target.exists()


@pytest.mark.parametrize("program, reason", [
    ("raise SystemExit(3)", "runtime_error"),
    ("1/0", "runtime_error"),
    ("def f(:\n", "runtime_error"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "runtime_error"),
])
def test_failures(sandbox, program, reason):
    result = sandbox.run_sync(program)
    assert result.reason == reason and not result.ok


@pytest.mark.parametrize("program, reason, bound", [
    (FORK_BOMB, "process_limit", SLACK),
    (STUBBORN_FORK_BOMB, "process_limit", WALL + SLACK),
    (THREAD_BOMB, "process_limit", WALL + SLACK),
    (SLEEPER, "timeout", WALL + SLACK),
    (MEMORY_HOG, "memory", SLACK),
    (SLOW_MEMORY_HOG, "memory", WALL + SLACK),
    (SPLIT_MEMORY_HOG, "memory", WALL + SLACK),  # children fault in ~1 GB first
    (MILLION_FILES, "file_limit", SLACK),
    (BIG_FILE, "file_limit", SLACK),
    (HUGE_PRINT, "output_limit", SLACK),
    (ENDLESS_PRINT, "output_limit", SLACK),
    (ENDLESS_STDERR, "output_limit", SLACK),
], ids=["fork_bomb", "stubborn_fork_bomb", "thread_bomb", "sleeper", "memory_hog",
        "slow_memory_hog", "split_memory_hog", "million_files", "big_file", "huge_print",
        "endless_print", "endless_stderr"])
def test_abuse_is_contained(sandbox, program, reason, bound):
    before_fds = len(os.listdir("/proc/self/fd"))
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    result, elapsed = _run_timed(sandbox, program)
    assert result.reason == reason, result
    assert elapsed < bound, f"{reason} took {elapsed:.2f} s"
    assert len(result.stdout.encode()) <= LIMITS.max_output_bytes
    assert len(result.stderr.encode()) <= LIMITS.max_output_bytes
    assert not _sandbox_processes(), "processes survived the sandbox"
    assert len(os.listdir("/proc/self/fd")) == before_fds
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_rss < 16 * 1024


def test_cpu_time_limit(sandbox):
    # Ends by RLIMIT_CPU after 1 CPU second, however long that takes on a loaded machine, and
    # before the wall limit.
    limits = SandboxLimits(wall_time=20.0, cpu_time=1.0)
    result, elapsed = _run_timed(sandbox, BUSY_LOOP, limits=limits)
    assert result.reason == "timeout" and "CPU" in result.detail, result
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL)  # soft limit, or the hard one
    # The signal is the proof; rusage is tick-sampled and may read a little under the limit.
    assert result.cpu_time > 0.5
    assert elapsed < limits.wall_time


def test_detached_descendants_are_killed(sandbox):
    result = sandbox.run_sync(DETACHED_CHILD)
    assert result.ok and result.stdout == "parent done\n"
    assert not _sandbox_processes()


@needs_namespaces
def test_namespace_isolation():
    with Sandbox(LIMITS, max_concurrency=1, isolation="namespaces", min_isolation="namespaces",
                 uid_base=UID_BASE) as sb:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()  # works out here
            result = sb.run_sync(
                f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        finally:
            listener.close()
        # Refused by the seccomp filter where libseccomp is present, else by the empty network
        # namespace.
        refusal = ("Address family not supported" if sandbox_lib._seccomp_problem() is None
                   else "Network is unreachable")
        assert result.reason == "runtime_error" and refusal in result.stderr
        # Its own PID namespace: it is process 2 (the runner is 1) and sees no host process.
        result = sb.run_sync("import os\nprint(os.getpid(), sorted(int(p) for p in "
                             "os.listdir('/proc') if p.isdigit()))")
        assert result.stdout == "2 [1, 2]\n", result
        # /tmp, /var/tmp and /dev/shm all count against the same file limit.
        result, elapsed = _run_timed(sb, FILES_ELSEWHERE)
        assert result.reason == "file_limit" and result.files_created == LIMITS.max_files
        assert elapsed < SLACK


def test_concurrent_mixed_programs():
    good = "import sys\nn = int(input())\nprint(n * n)\n"
    programs = [(good, "ok"), (FORK_BOMB, "process_limit"), (good, "ok"), (SLEEPER, "timeout"),
                (good, "ok"), (MEMORY_HOG, "memory"), (good, "ok"), (MILLION_FILES, "file_limit"),
                (good, "ok"), (ENDLESS_PRINT, "output_limit"), (good, "ok"),
                (STUBBORN_FORK_BOMB, "process_limit"), (good, "ok"), (BUSY_LOOP, "timeout"),
                (good, "ok"), ("1/0", "runtime_error")]
    assert len(programs) == 16
    with Sandbox(LIMITS, max_concurrency=8, isolation=DEFAULT_ISOLATION,
                 min_isolation=MIN_ISOLATION, uid_base=UID_BASE) as sb:
        async def go():
            return await asyncio.gather(*(sb.run(p, f"{i}\n") for i, (p, _) in enumerate(programs)))
        start = time.monotonic()
        results = run(go())
        elapsed = time.monotonic() - start
    for i, ((_, reason), result) in enumerate(zip(programs, results)):
        assert result.reason == reason, (i, result)
        if reason == "ok":
            assert result.stdout == f"{i * i}\n"
    # Three programs run to the 2 s deadline; 16 runs on 8 workers fit in a few deadlines.
    assert elapsed < 3 * WALL + 2 * SLACK, f"16 programs took {elapsed:.2f} s"
    assert not _sandbox_processes()


def test_sandbox_works_from_several_event_loops():
    with Sandbox(LIMITS, max_concurrency=2, isolation=DEFAULT_ISOLATION,
                 min_isolation=MIN_ISOLATION, uid_base=UID_BASE) as sb:
        for _ in range(2):
            assert run(sb.run("print(1)")).stdout == "1\n"


def test_configuration_errors(monkeypatch):
    with pytest.raises(SandboxError, match="wall_time must be positive"):
        SandboxLimits(wall_time=0)
    with pytest.raises(SandboxError, match="below 32 MiB"):
        SandboxLimits(memory_bytes=2**20)
    with pytest.raises(SandboxError, match="isolation must be one of"):
        Sandbox(isolation="docker")
    monkeypatch.setattr(sandbox_lib, "_namespaces_problem", lambda: "it needs root")
    with pytest.raises(SandboxError, match="'namespaces' is unavailable: it needs root"):
        Sandbox(isolation="namespaces", min_isolation="namespaces")
    monkeypatch.setattr(sandbox_lib, "_bwrap_problem", lambda: "it needs root")
    with pytest.raises(SandboxError, match="'bwrap' is unavailable: it needs root"):
        sandbox_lib.resolve_isolation("auto")  # never a silent fall-back
    assert sandbox_lib.resolve_isolation("rlimits", "rlimits") == "rlimits"
    with pytest.raises(SandboxError, match="not an executable"):
        Sandbox(isolation="rlimits", min_isolation="rlimits", interpreter="python3")


# ---------------------------------------------------------------------------------------------
# The code environment.

@pytest.mark.parametrize("completion, expected", [
    ("Here:\n```python\nprint(1)\n```\nand\n```python\nprint(2)\n```", ("print(2)\n", True)),
    ("```py\nx = 1\n```", ("x = 1\n", True)),
    ("```\nprint(3)\n```", ("print(3)\n", True)),
    ("```cpp\nint main() {}\n```", (None, True)),
    ("print(4)", ("print(4)", False)),
    ("I think the answer is 4.", (None, False)),
    ("", (None, False)),
])
def test_extract_program(completion, expected):
    assert extract_program(completion) == expected


def test_outputs_match():
    assert outputs_match("1 2\n3  \n\n", "1 2\n3")
    assert not outputs_match("1 2\n3", "1 2 3")
    assert not outputs_match(" 1", "1")


REFERENCE = {
    "add": "a, b = map(int, input().split())\nprint(a + b)",
    "max": "input()\nprint(max(map(int, input().split())))",
    "sort": "input()\nprint(*sorted(map(int, input().split())))",
    "reverse": "print(input()[::-1])",
    "vowels": "print(sum(c in 'aeiou' for c in input()))",
    "fib": "a, b = 0, 1\nfor _ in range(int(input())):\n    a, b = b, a + b\nprint(a)",
    "digits": "print(sum(map(int, input())))",
}
REFERENCE_FUNCTIONS = {
    "add": "def solve(a, b):\n    return a + b",
    "max": "solve = max",
    "sort": "solve = sorted",
    "reverse": "def solve(s):\n    return s[::-1]",
    "vowels": "def solve(s):\n    return sum(c in 'aeiou' for c in s)",
    "fib": "def solve(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
           "    return a",
    "digits": "def solve(n):\n    return sum(map(int, str(n)))",
}


@pytest.fixture(scope="module")
def code_env():
    env = envs.get("code", limits=LIMITS, max_concurrency=8, format_reward=0.1, num_tests=3,
                   seed=2, isolation=DEFAULT_ISOLATION, min_isolation=MIN_ISOLATION)
    yield env
    run(env.close())


def test_code_task_is_deterministic_and_solvable(code_env):
    prompts = [code_env.prompt(i) for i in range(12)]
    assert prompts == [code_env.prompt(i) for i in range(12)]
    assert code_env.prompt(0, "eval") != prompts[0]
    completions = [f"```python\n{REFERENCE[p.info['template']]}\n```" for p in prompts]
    results = run(score_many(code_env, prompts, completions))
    assert all(r == 1.0 for r, _ in results), results
    function_task = CodeTask(style="function", seed=2)
    fprompts = [function_task.prompt(i) for i in range(8)]
    fcompletions = [f"```python\n{REFERENCE_FUNCTIONS[p.info['template']]}\n```" for p in fprompts]
    assert all(r == 1.0 for r, _ in run(score_many(code_env, fprompts, fcompletions)))


@pytest.mark.parametrize("completion, reward, reason", [
    ("```python\nprint(int(input()) * 2)\n```", 1.0, "correct"),
    ("```python\nprint(int(input()) * 3)\n```", 0.1, "wrong_answer"),
    ("print(int(input()) * 3)", 0.0, "wrong_answer"),            # unfenced: no format reward
    ("```python\ndef f(:\n```", 0.1, "syntax_error"),
    ("The answer is 42.", 0.0, "no_code"),
    ("```python\nimport os\nwhile True:\n    os.fork()\n```", 0.1, "process_limit"),
    ("```python\nwhile True:\n    pass\n```", 0.1, "timeout"),
    ("```python\nx = bytearray(2**31)\n```", 0.1, "memory"),
    ("```python\nwhile True:\n    print('x' * 1000)\n```", 0.1, "output_limit"),
])
def test_code_env_rewards(code_env, completion, reward, reason):
    prompt = Prompt("double it", info={"tests": [{"stdin": "2\n", "stdout": "4\n"},
                                                 {"stdin": "5\n", "stdout": "10\n"}]})
    got_reward, info = run(code_env.score(prompt, completion))
    assert (got_reward, info["reason"]) == (reward, reason), info
    assert info["correct"] == (reason == "correct")


def test_code_env_fraction_and_asserts():
    env = envs.get("code", limits=LIMITS, max_concurrency=4, reward_mode="fraction",
                   isolation=DEFAULT_ISOLATION, min_isolation=MIN_ISOLATION)
    prompt = Prompt("solve", info={"assert_tests": ["assert solve(1) == 2", "assert solve(2) == 4",
                                                    "assert solve(0) == 1"]})
    reward, info = run(env.score(prompt, "```python\ndef solve(x):\n    return 2 * x\n```"))
    assert reward == pytest.approx(2 / 3) and (info["passed"], info["total"]) == (2, 3)
    assert info["reason"] == "wrong_answer"
    with pytest.raises(EnvError, match="needs Prompt.info"):
        run(env.score(Prompt("no tests"), "print(1)"))
    with pytest.raises(EnvError, match="test 0 must be a dict with a 'stdout' string"):
        run(env.score(Prompt("bad test", info={"tests": [{"stdin": "1"}]}), "print(1)"))
    run(env.close())


def test_code_env_multi_turn_feedback():
    env = envs.get("code", limits=LIMITS, max_concurrency=2, max_turns=3,
                   isolation=DEFAULT_ISOLATION, min_isolation=MIN_ISOLATION)
    prompt = Prompt("Print the input doubled.", info={"tests": [{"stdin": "21\n",
                                                                 "stdout": "42\n"}]})
    answers = iter(["```python\nprint(input() * 2)\n```",
                    "```python\nprint(2 * int(input()))\n```"])

    async def policy(state):
        return next(answers)

    async def go():
        state = await run_episode(env, prompt, policy)
        await env.close()
        return state
    state = run(go())
    assert state.done and state.turn == 2 and state.total_reward == 1.0
    sources = [source for source, _ in state.transcript]
    assert sources == ["policy", "environment", "policy"]
    feedback = state.transcript[1][1]
    assert "wrong answer" in feedback and "Expected output:\n42" in feedback
    assert "2121" in feedback  # what the program printed
