"""The staleness gate: property test over random interleavings of generation finish times,
generator weight updates and trainer steps."""

import collections

import numpy as np
import pytest

from rl_jax.rollout.staleness import GateConfig, StalenessConfigError, StalenessGate


def simulate(seed: int, policy: str, steps: int = 12, prefetch: int = 0):
    """A random run; the trainer holds up to ``1 + prefetch`` batches handed out (one training,
    the others taken ahead) and checks each sample's staleness when its batch trains."""
    rng = np.random.default_rng(seed)
    groups_per_batch = int(rng.integers(1, 5))
    max_lag = int(rng.integers(0, 4))
    cap = None if policy == "prevent" else groups_per_batch * int(rng.integers(1, 6))
    gate = StalenessGate(GateConfig(max_lag=max_lag, groups_per_batch=groups_per_batch,
                                    policy=policy, max_in_flight_groups=cap))
    generator_version = 0  # what the generators actually run (>= what they reported)
    in_flight: dict[int, int] = {}  # key -> min token version it will have
    min_version_of: dict[int, int] = {}
    next_key = 0
    consumed: set[int] = set()
    handed: collections.deque[list[int]] = collections.deque()
    discarded: set[int] = set()  # what the gate handed back as too stale to train
    for _ in range(5000):
        if gate.trainer_version >= steps:
            break
        event = rng.random()
        if event < 0.35:  # the rollout tries to admit a prompt
            if gate.admit(next_key):
                # Its first token comes from the weights running now (or newer, if an update
                # lands before its prefill).
                in_flight[next_key] = generator_version + int(rng.integers(0, 2) * (
                    generator_version < gate.trainer_version))
                next_key += 1
        elif event < 0.65 and in_flight:  # some generation finishes (out of order)
            key = int(rng.choice(list(in_flight)))
            min_version_of[key] = in_flight.pop(key)
            gate.complete(key, min_version_of[key])
        elif event < 0.8:  # a weight update reaches the generators
            if generator_version < gate.trainer_version:
                generator_version += int(rng.integers(1, gate.trainer_version - generator_version
                                                      + 1))
                gate.set_generator_version(generator_version)
        else:  # the trainer
            if handed and (len(handed) > prefetch or rng.random() < 0.5):
                # It finishes the step of its oldest batch: the version training it is the
                # current one. Some steps are skipped (a non-finite update: same version).
                for key in handed.popleft():
                    staleness = gate.trainer_version - min_version_of[key]
                    assert 0 <= staleness <= max_lag, (seed, staleness, max_lag)
                gate.advance(gate.trainer_version if rng.random() < 0.1 else None)
                continue
            batch = gate.next_batch()  # the next batch, or (prefetch) the one after it
            discarded.update(gate.take_discarded())
            if batch is not None:
                assert len(batch) == groups_per_batch
                for key in batch:
                    assert key not in consumed
                    consumed.add(key)
                handed.append(batch)
                # The rollout keeps admitting while this batch trains.
                for _ in range(int(rng.integers(0, 3))):
                    if gate.admit(next_key):
                        in_flight[next_key] = generator_version
                        next_key += 1
    c = gate.counts
    # Nothing admitted disappears: consumed, still pending, or counted as dropped.
    assert c["admitted"] == len(consumed) + gate.unconsumed + c["dropped"] + c["late"]
    # Every discarded group is handed back to its owner exactly once, never also trained.
    assert len(discarded) == c["dropped"] + c["late"] and not discarded & consumed
    assert gate.take_discarded() == []
    assert c["late"] == 0
    if policy == "prevent":
        assert c["dropped"] == 0
    return gate, consumed


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("policy", ["prevent", "drop"])
def test_no_sample_over_max_lag_reaches_a_batch(policy, prefetch):
    progressed = 0
    for seed in range(1500):
        gate, consumed = simulate(seed, policy, prefetch=prefetch)
        progressed += gate.trainer_version >= 12
        assert gate.staleness_histogram and max(gate.staleness_histogram) <= gate.config.max_lag
    assert progressed >= 1400  # the gate does not deadlock the run


def test_prevent_admits_exactly_up_to_the_bound():
    gate = StalenessGate(GateConfig(max_lag=2, groups_per_batch=4))
    admitted = sum(gate.admit(i) for i in range(20))
    assert admitted == (2 + 1) * 4 and gate.counts["prevented"] == 8
    for i in range(12):
        gate.complete(i, 0)
    assert gate.next_batch() == [0, 1, 2, 3]
    gate.advance()
    # Generators still on version 0: no new room (their groups would expire at version 2).
    assert not gate.admit(100)
    gate.set_generator_version(1)
    assert gate.capacity() == 4


def test_a_training_batch_holds_its_version():
    """While the batch of version v trains, new groups can only be consumed from v + 1 on."""
    gate = StalenessGate(GateConfig(max_lag=0, groups_per_batch=1))
    assert gate.admit("a")
    gate.complete("a", 0)
    assert gate.next_batch() == ["a"]
    assert gate.capacity() == 0 and not gate.admit("b")  # it would be stale at version 1
    gate.advance()
    gate.set_generator_version(1)
    assert gate.admit("b")
    gate.complete("b", 1)
    assert gate.next_batch() == ["b"] and gate.counts["late"] == 0


def test_a_prefetched_batch_is_reckoned_against_the_version_that_trains_it():
    """A batch taken while the previous one trains is consumed one version later: its staleness
    and the room for admission count from there."""
    gate = StalenessGate(GateConfig(max_lag=1, groups_per_batch=1))
    assert gate.admit("a") and gate.admit("b") and not gate.admit("c")
    gate.complete("a", 0)
    gate.complete("b", 0)
    assert gate.next_batch() == ["a"] and gate.consumer_version == 1
    assert gate.next_batch() == ["b"] and gate.consumer_version == 2  # prefetched
    assert dict(gate.staleness_histogram) == {0: 1, 1: 1}
    assert gate.untrained_keys() == ["a", "b"]
    gate.advance()  # "a" trained; "b" is training at version 1
    assert gate.untrained_keys() == ["b"]
    assert gate.capacity() == 0  # the generators' version-0 groups would expire at 1
    gate.set_generator_version(1)
    assert gate.capacity() == 1

    drop = StalenessGate(GateConfig(max_lag=0, groups_per_batch=1, policy="drop",
                                    max_in_flight_groups=2))
    drop.admit("a")
    drop.admit("b")
    drop.complete("a", 0)
    drop.complete("b", 0)
    assert drop.next_batch() == ["a"]
    # Taken ahead, "b" would train at version 1 with tokens of version 0: over max_lag.
    assert drop.next_batch() is None and drop.counts["dropped"] == 1


def test_prevent_waits_for_an_expiring_group_and_prefers_completed_ones():
    gate = StalenessGate(GateConfig(max_lag=1, groups_per_batch=2))
    for i in range(4):
        gate.admit(i)
    for i in (1, 3):
        gate.complete(i, 0)
    # Deadline of all four is version 1; at version 0 two completed ones are enough.
    assert gate.next_batch() == [1, 3]
    gate.advance()
    gate.complete(2, 0)
    assert gate.next_batch() is None  # group 0 must go into this batch: wait for it
    gate.complete(0, 0)
    assert sorted(gate.next_batch()) == [0, 2]
    assert gate.metrics()["staleness/max"] == 1


def test_a_group_still_generating_holds_up_a_batch_only_when_its_deadline_comes():
    """A long completion with time left does not stall the trainer: completed groups with later
    deadlines go first, as long as a later batch can still take it by its deadline."""
    gate = StalenessGate(GateConfig(max_lag=2, groups_per_batch=1))
    assert gate.admit(0) and gate.admit(1)  # deadline 2
    gate.complete(1, 0)
    assert gate.next_batch() == [1]
    gate.advance()
    gate.set_generator_version(1)
    assert gate.admit(2)  # deadline 3
    gate.complete(2, 1)
    # Group 0 (deadline 2) still generates; the batch of version 2 can take it: go on.
    assert gate.next_batch() == [2]
    gate.advance()
    assert gate.admit(3)  # deadline 3
    gate.complete(3, 1)
    # Version 2 is group 0's last chance: wait for it, though group 3 is ready.
    assert gate.next_batch() is None
    gate.complete(0, 0)
    assert gate.next_batch() == [0]
    assert max(gate.staleness_histogram) == 2 and gate.counts["late"] == 0


def test_drop_policy_discards_stale_groups_and_counts_them():
    gate = StalenessGate(GateConfig(max_lag=0, groups_per_batch=1, policy="drop",
                                    max_in_flight_groups=4))
    gate.admit("a")
    gate.admit("b")
    gate.complete("a", 0)
    assert gate.next_batch() == ["a"]
    gate.advance()
    gate.complete("b", 0)  # generated under version 0, trainer now at 1 > max_lag
    assert gate.next_batch() is None and gate.counts["dropped"] == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_lag=-1, groups_per_batch=1), "max_lag"),
    (dict(max_lag=1, groups_per_batch=0), "groups_per_batch"),
    (dict(max_lag=1, groups_per_batch=1, policy="maybe"), "policy"),
    (dict(max_lag=1, groups_per_batch=4, max_in_flight_groups=2), "no batch could ever form"),
])
def test_bad_gate_configs(kwargs, message):
    with pytest.raises(StalenessConfigError, match=message):
        GateConfig(**kwargs)


def test_a_group_older_than_its_generator_promised_is_handed_back_not_trained():
    """A server that reported version 1 but answered from version 0 (one restarted from an old
    image, say): the group is too stale once the trainer is at 1 + max_lag; the gate never
    returns it in a batch and hands its key back once, for the rollout's drop log."""
    gate = StalenessGate(GateConfig(max_lag=0, groups_per_batch=2), trainer_version=1,
                         generator_version=1)
    assert gate.admit("old") and gate.admit("new")
    gate.complete("old", 0)
    gate.complete("new", 1)
    assert gate.next_batch() is None  # one group left: no batch of two
    assert gate.counts["late"] == 1 and gate.take_discarded() == ["old"]
    assert gate.take_discarded() == [] and gate.pending_keys() == ["new"]
