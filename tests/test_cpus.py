"""CPU pinning of processes and of single threads (Linux affinity is per thread)."""

import os
import subprocess
import sys
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


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy_pair_share(lower: bool, seconds: float = 2.0) -> tuple[float, str]:
    """Two busy processes on one core, each in a session of its own (as generator servers are
    started); the second at nice 10, through ``lower_priority`` when ``lower``. Returns the
    second's share of the CPU time the two got, and how the priority applied."""
    core = str(max(os.sched_getaffinity(0)))
    busy = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(["taskset", "-c", core, *prefix, *busy], start_new_session=True)
             for prefix in ([], ["nice", "-n", "10"])]
    try:
        how = cpus.lower_priority(procs[1].pid, 10) if lower else "nice 10"
        time.sleep(0.5)
        start = [_cpu_seconds(p.pid) for p in procs]
        time.sleep(seconds)
        spent = [_cpu_seconds(p.pid) - s for p, s in zip(procs, start)]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return spent[1] / max(sum(spent), 1e-9), how


def test_lower_priority_applies_across_sessions():
    share, how = _busy_pair_share(lower=True)
    if cpus.autogroup_enabled():
        assert how == "autogroup nice 10"
    else:
        assert how == "nice 10"
    # nice 10 against nice 0: a CFS weight of 110 against 1024, ~10% of the core.
    assert share < 0.3, (share, how)


@pytest.mark.skipif(not cpus.autogroup_enabled(), reason="the kernel does not group by session")
def test_nice_alone_does_not_apply_across_sessions_under_autogroup():
    """Why lower_priority exists: under autogroup a session's nice value orders it only
    within that session, so the two sessions share the core about equally."""
    share, _ = _busy_pair_share(lower=False)
    assert share > 0.35, share


def test_lower_priority_refuses_values_outside_0_to_19():
    for bad in (-1, 20, 1.5, True):
        with pytest.raises(ValueError, match="nice"):
            cpus.lower_priority(os.getpid(), bad)
    assert cpus.lower_priority(os.getpid(), 0) == "default"


def test_cpu_placement_is_switched_off_on_accelerator_backends(caplog):
    from configs.tiny_rl import get_config
    from rl_jax.orchestrator.rl import cpu_placement_off_cpu

    from rl_jax.recipe.checks import parse

    c = parse(get_config())
    assert c.cpus.trainer and c.cpus.generators and c.cpus.generators_nice
    assert cpu_placement_off_cpu(c, backend="cpu") is c  # CPU pools keep cores and priority
    with caplog.at_level("WARNING"):
        off = cpu_placement_off_cpu(c, backend="gpu")
    assert (off.cpus.trainer, off.cpus.generators, off.cpus.rollout,
            off.cpus.generators_nice) == ("", "", "", 0)
    assert off.rollout == c.rollout  # nothing else changes
    assert "cpus.trainer='0'" in caplog.text and "runs on gpu" in caplog.text
    assert cpu_placement_off_cpu(off, backend="tpu") is off  # nothing left to switch off
