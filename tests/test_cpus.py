"""CPU pinning of processes and of single threads (Linux affinity is per thread)."""

import os
import threading
import time

import pytest

from rl_jax import cpus


def test_parse_cores():
    assert cpus.parse_cores("0,2-3") == {0, 2, 3}
    for bad in ("", "a", "3-1"):
        with pytest.raises(ValueError):
            cpus.parse_cores(bad)


def test_pin_threads_moves_only_the_given_threads_and_their_children():
    before = os.sched_getaffinity(0)
    core = max(before)
    seen, ready, go = {}, threading.Event(), threading.Event()

    def child():
        seen["child"] = os.sched_getaffinity(0)

    def worker():
        seen["id"] = threading.get_native_id()
        ready.set()
        go.wait(10)
        seen["worker"] = os.sched_getaffinity(0)
        t = threading.Thread(target=child)  # started after the pin: inherits it
        t.start()
        t.join()

    thread = threading.Thread(target=worker)
    thread.start()
    assert ready.wait(10)
    assert cpus.pin_threads(str(core), [seen["id"]]) == {core}
    go.set()
    thread.join(10)
    assert seen["worker"] == {core} and seen["child"] == {core}
    assert os.sched_getaffinity(0) == before  # the calling thread is untouched


def test_pin_threads_rejects_cores_the_machine_lacks():
    missing = (os.cpu_count() or 1) + 5
    with pytest.raises(ValueError, match=rf"CPU cores \[{missing}\] do not exist here"):
        cpus.pin_threads(str(missing), [threading.get_native_id()])


def test_pin_restricts_every_thread_of_the_process():
    # In a child process: pinning this one would bind the rest of the test session.
    import subprocess
    import sys
    code = ("import os, threading; from rl_jax import cpus\n"
            "ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()\n"
            "core = max(os.sched_getaffinity(0)); assert cpus.pin(str(core)) == {core}\n"
            "assert os.sched_getaffinity(t.native_id) == {core}, 'existing thread'\n"
            "ev.set(); t.join(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_thread_cpu_seconds_names_python_threads_and_counts_their_time():
    before = cpus.thread_cpu_seconds()
    burned, stop = threading.Event(), threading.Event()

    def burn():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            sum(range(1000))
        burned.set()
        stop.wait(10)  # alive when read: ended threads are not counted

    thread = threading.Thread(target=burn, name="cpu-burner")
    thread.start()
    assert burned.wait(10)
    after = cpus.thread_cpu_seconds()
    stop.set()
    thread.join(10)
    assert "main" in after and "cpu-burner" not in before
    spent = cpus.cpu_seconds_between(before, after)
    assert 0.25 <= spent["cpu-burner"] <= 1.0
    assert list(spent) == sorted(spent, key=lambda k: -spent[k])  # largest first
    assert all(v >= 0.005 for v in spent.values())
