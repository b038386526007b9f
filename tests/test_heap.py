"""The garbage-collector helpers of long-running processes (rl_jax.heap)."""

import gc

from rl_jax.heap import GcMonitor, freeze_long_lived


def test_freeze_takes_live_objects_out_of_collections_and_the_monitor_times_them():
    monitor = GcMonitor().install()
    try:
        keep = [[i] for i in range(50_000)]  # long-lived containers
        gc.collect()
        before = monitor.stats()
        assert before["collections"][2] >= 1 and before["max_pause_s"][2] > 0
        frozen = freeze_long_lived()
        assert frozen >= len(keep) and gc.get_freeze_count() == frozen
        # a full collection no longer visits them
        assert not any(obj is keep[0] for obj in gc.get_objects(generation=2))
        gc.collect()
        after = monitor.stats()
        assert after["collections"][2] == before["collections"][2] + 2  # freeze's own and ours
        assert after["frozen_objects"] == frozen
        # dropped frozen objects are still freed by reference counting
        del keep
    finally:
        monitor.uninstall()
        gc.unfreeze()
    assert monitor._callback not in gc.callbacks
