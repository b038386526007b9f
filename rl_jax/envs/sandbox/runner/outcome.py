"""The reason a run ended (one of the sandbox's ``REASONS``) and its detail (stdlib only).

:func:`_classify` reads a run without tests: what the runner killed it for, the main process's
status, its stderr, the peaks sampled and the limits. :func:`_classify_tests` reads a run with
tests: ``ok`` only when the harness reported every test as run and passed.
"""

import json
import os
import signal

_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"[Errno 12]", b"std::bad_alloc",
                   b"out of memory")
_PROCESS_MARKERS = (b"[Errno 11] Resource temporarily unavailable", b"can't start new thread",
                    b"fork: retry", b"Resource temporarily unavailable")
_FILE_MARKERS = (b"[Errno 28]", b"No space left on device", b"[Errno 27]", b"File too large",
                 b"[Errno 24]", b"Too many open files", b"[Errno 122]", b"Disk quota exceeded")


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
