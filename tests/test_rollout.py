"""The rollout stage against a real in-process engine: batches, staleness under in-flight weight
updates, packing alignment, and resume without losing or repeating prompts."""

import grain
import numpy as np
import pytest

from rl_jax.data.tokenizer import build_char_tokenizer, special_token_ids
from rl_jax.envs.arithmetic import ArithmeticEnv
from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.local import LocalGenerator
from rl_jax.generator.types import SamplingParams
from rl_jax.models.config import ModelConfig
from rl_jax.rollout.batching import GroupsToBatch
from rl_jax.rollout.config import RolloutConfig
from rl_jax.rollout.pipeline import RolloutDataset
from rl_jax.trainer.state import ModelSpec

TOKENIZER = build_char_tokenizer(ArithmeticEnv.ALPHABET)
SPECIAL = special_token_ids(TOKENIZER)
CFG = ModelConfig(vocab_size=TOKENIZER.get_vocab_size(), hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def encode(text):
    return [SPECIAL["bos"]] + TOKENIZER.encode(text).ids


def decode(ids):
    return TOKENIZER.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def setup():
    spec = ModelSpec(CFG, mesh=None)
    weights = [spec.init_params(seed) for seed in range(4)]
    engine = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=16, max_seq_len=32),
                    eos_token_ids=(SPECIAL["eos"],))
    yield spec, weights, engine
    engine.shutdown()


def make_rollout(engine, config, env, state=None, size=64):
    prompts = grain.MapDataset.range(size).map(lambda i: (i, env.prompt(i)))
    return RolloutDataset(prompts, env, LocalGenerator(engine), encode=encode, decode=decode,
                          config=config, state=state)


CONFIG = RolloutConfig(group_size=4, groups_per_batch=3, max_lag=1,
                       sampling=SamplingParams(max_new_tokens=6, temperature=1.0))


def test_batches_are_packed_and_aligned_with_the_generator_output(setup):
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    it = iter(make_rollout(engine, CONFIG, env))
    try:
        groups = next(it)
    finally:
        it.close()
    assert len(groups) == 3 and all(len(g.samples) == 4 for g in groups)
    batch = GroupsToBatch(seq_len=32, rows=6)(groups)
    assert batch["tokens"].shape == (6, 32)
    samples = [s for g in groups for s in g.samples]
    mask = batch["loss_mask"] > 0
    # Exactly the completion tokens are predicted with loss, each with its behaviour log-prob,
    # version and advantage.
    assert mask.sum() == sum(len(s.completion_ids) for s in samples)
    assert np.array_equal(mask, batch["versions"] >= 0)
    np.testing.assert_allclose(batch["behaviour_logprobs"][mask].sum(),
                               sum(sum(s.behaviour_logprobs) for s in samples), rtol=1e-5)
    assert sorted(batch["targets"][mask].tolist()) == sorted(
        t for s in samples for t in s.completion_ids)
    with pytest.raises(Exception,
                       match=r"12 samples need \d+ rows of 32 tokens but the batch has 4"):
        GroupsToBatch(seq_len=32, rows=4)(groups)
    for g in groups:
        assert {s.group_id for s in g.samples} == {g.position}
        for s in g.samples:
            assert s.prompt_ids == encode(env.prompt(g.position).text)
            assert s.reward in (0.0, 1.0)
    np.testing.assert_allclose(batch["sample_advantages"].reshape(3, 4).sum(1), 0, atol=1e-5)


@pytest.mark.parametrize("policy", ["prevent", "drop"])
def test_staleness_bound_holds_across_in_flight_updates(setup, policy):
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    config = RolloutConfig(group_size=2, groups_per_batch=2, max_lag=1, staleness_policy=policy,
                           max_in_flight_groups=6 if policy == "drop" else None,
                           sampling=SamplingParams(max_new_tokens=10, temperature=1.0))
    base = engine.version
    it = iter(make_rollout(engine, config, env, size=200))
    try:
        it.set_trainer_version(base)
        it.set_generator_version(base)
        for step in range(6):
            groups = next(it)
            version = base + step
            for g in groups:
                assert version - g.min_version <= 1
            # "Train", then publish the next version to the generator mid-generation.
            engine.update_weights(weights[(step + 1) % 4], version + 1)
            it.set_trainer_version(version + 1)
            assert engine.wait_for_version(version + 1)
            it.set_generator_version(version + 1)
        metrics = it.metrics()
    finally:
        it.close()
    assert metrics["staleness/max"] <= 1 and metrics.get("gate/late", 0) == 0
    if policy == "prevent":
        assert metrics.get("gate/dropped", 0) == 0


def test_resume_loses_nothing_and_repeats_nothing(setup):
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    config = RolloutConfig(group_size=2, groups_per_batch=2, max_lag=2,
                           sampling=SamplingParams(max_new_tokens=4))
    it = iter(make_rollout(engine, config, env, size=20))
    first = []
    for _ in range(3):
        first += [g.position for g in next(it)]
        it.set_trainer_version(0)  # trained (the weights here never change: version 0)
    # A batch handed out (prefetched) but not trained yet is not lost either.
    untrained = [g.position for g in next(it)]
    state = it.get_state()
    it.close()  # a crash: whatever was in flight is lost
    assert set(state["pending"]).isdisjoint(first)
    assert state["pending"][:len(untrained)] == untrained
    resumed = iter(make_rollout(engine, config, env, size=20))
    resumed.set_state(state)
    second = []
    try:
        while True:
            second += [g.position for g in next(resumed)]
            resumed.set_trainer_version(0)
    except StopIteration:
        pass
    finally:
        resumed.close()
    assert not set(first) & set(second)
    # Every prompt trained exactly once, except a final partial batch's worth.
    assert len(first) + len(second) == len(set(first) | set(second))
    assert len(set(range(20)) - set(first) - set(second)) < config.groups_per_batch
    with pytest.raises(RuntimeError, match="before the first next"):
        resumed.set_state(state)


class CoinEnv(ArithmeticEnv):
    """Reward 1 when the completion's first token is even: mixed groups without training."""

    async def score(self, prompt, completion):
        solved = bool(completion) and ord(completion[0]) % 2 == 0
        return float(solved), {"correct": solved, "reason": "coin"}


class AlwaysEnv(ArithmeticEnv):
    async def score(self, prompt, completion):
        return 1.0, {"correct": True, "reason": "always"}


def test_dynamic_filtering_replaces_zero_signal_groups(setup):
    _, _, engine = setup
    config = RolloutConfig(group_size=2, groups_per_batch=2, max_lag=4, filter_zero_signal=True,
                           sampling=SamplingParams(max_new_tokens=3))
    it = iter(make_rollout(engine, config, CoinEnv(num_digits=2), size=400))
    try:
        # Half of the groups of 2 have equal rewards; keep going until one was filtered
        # (missing one in 12 batches has probability 2**-24).
        for _ in range(12):
            for g in next(it):
                assert np.ptp(g.rewards) > 0
            it.set_trainer_version(0)  # trained (weights unchanged)
            metrics = it.metrics()
            if metrics.get("rollout/filtered_zero_signal", 0) > 0:
                break
    finally:
        it.close()
    assert metrics.get("rollout/filtered_zero_signal", 0) > 0
    assert metrics.get("rollout/failures", 0) == 0


def test_prompts_always_solved_are_skipped(setup):
    _, _, engine = setup
    config = RolloutConfig(group_size=2, groups_per_batch=2, max_lag=4, solve_rate_window=2,
                           solve_rate_period=4, sampling=SamplingParams(max_new_tokens=3))
    it = iter(make_rollout(engine, config, AlwaysEnv(num_digits=2), size=200))
    try:
        positions = []
        for _ in range(8):
            positions += [g.position for g in next(it)]
            it.set_trainer_version(0)  # trained (weights unchanged)
        state = it.get_state()
        metrics = it.metrics()
    finally:
        it.close()
    # After one round over the 4 distinct prompts each has solve rate 1 and is skipped (every
    # 8th time it is revisited).
    assert metrics.get("rollout/skipped_solved_or_unsolved", 0) > 0, (metrics, positions)
    assert state["solve_rates"]["total_skipped"] > 0


class TwoTurnEnv(ArithmeticEnv):
    """After the first answer the environment writes "+1=" and asks again; reward 1 at the end."""

    max_turns = 3

    async def step(self, state, completion):
        from rl_jax.envs.base import StepResult
        state.check_running()
        if state.turn == 0:  # record() below counts the turn
            result = StepResult(0.0, False, "+1=", {"correct": False, "reason": "again"})
        else:
            result = StepResult(1.0, True, None, {"correct": True, "reason": "done"})
        state.record(completion, result)
        return result


def test_multi_turn_episodes_mask_environment_tokens(setup):
    _, _, engine = setup
    config = RolloutConfig(group_size=2, groups_per_batch=1, max_lag=4, max_tokens_per_turn=3,
                           sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    env = TwoTurnEnv(num_digits=2)
    rollout = make_rollout(engine, config, env, size=8)
    rollout._encode_observation = lambda text: TOKENIZER.encode(text).ids
    it = iter(rollout)
    try:
        groups = next(it)
    finally:
        it.close()
    observation = TOKENIZER.encode("+1=").ids
    for s in groups[0].samples:
        mask = np.asarray(s.loss_mask)
        assert s.reward == 1.0 and s.info["turns"] == 2
        assert len(s.completion_ids) == 3 + len(observation) + 3
        # The observation sits after the first turn and is masked out, with log-prob 0 and the
        # version of the policy token before it.
        start = int(np.argmin(mask))
        assert s.completion_ids[start:start + len(observation)] == observation
        assert start == 3 and mask[start:start + len(observation)].sum() == 0
        assert mask.sum() == 6
        assert all(lp == 0 for lp in s.behaviour_logprobs[start:start + 3])
        assert s.versions[start] == s.versions[start - 1]
    batch = GroupsToBatch(seq_len=32, rows=2)(groups)
    assert batch["loss_mask"].sum() == sum(np.sum(s.loss_mask) for s in groups[0].samples)


@pytest.mark.parametrize("per_sample", [False, True])
def test_forced_lengths_per_sample_or_per_prompt(setup, per_sample):
    """Benchmark lengths: each completion gets the length drawn for its sample (or its
    prompt's, shared by the group), and a seeded repeat samples the same tokens."""
    import dataclasses

    from rl_jax.rollout.request_plan import LognormalLengths
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    length_of = LognormalLengths(median=6, sigma=1.0, max=20, seed=3)
    config = dataclasses.replace(
        CONFIG, length_of=length_of, per_sample_lengths=per_sample,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=11))

    def first_batch():
        it = iter(make_rollout(engine, config, env))
        try:
            return next(it)
        finally:
            it.close()

    groups = first_batch()
    for g in groups:
        want = [length_of(g.position, i if per_sample else 0) for i in range(4)]
        assert [len(s.completion_ids) for s in g.samples] == want
        assert all(s.finish_reason == "length" for s in g.samples)
        # Samples of one prompt are distinct draws, not copies of one sequence.
        prefixes = {tuple(s.completion_ids[:3]) for s in g.samples}
        assert len(prefixes) > 1
    if per_sample:
        assert len({len(s.completion_ids) for g in groups for s in g.samples}) > 3
    first = {g.position: [s.completion_ids for s in g.samples] for g in groups}
    again = {g.position: [s.completion_ids for s in g.samples] for g in first_batch()}
    common = first.keys() & again.keys()  # a batch takes the groups that finish first
    assert common and all(first[p] == again[p] for p in common)


def test_shared_prompt_packing_gives_the_same_loss_and_gradient(setup, loss="grpo"):
    """A group's prompt packed once, its completions attending to it: the same per-token
    log-probs, loss and gradient as one full sequence per sample, in fewer tokens; every
    completion token keeps its own behaviour log-prob, version and advantage."""
    import jax

    from rl_jax.orchestrator.policy import PolicyBatch, make_policy_loss
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    config = RolloutConfig(group_size=4, groups_per_batch=5, max_lag=1,
                           sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    it = iter(make_rollout(engine, config, env))
    try:
        groups = next(it)
    finally:
        it.close()
    plain = GroupsToBatch(seq_len=32, rows=0)(groups)
    # seq_len 24: some groups need two units (the prompt copied into each).
    shared = GroupsToBatch(seq_len=24, rows=0, share_prompts=True)(groups)
    samples = [s for g in sorted(groups, key=lambda g: g.position) for s in g.samples]
    assert (shared["segment_ids"] > 0).sum() < (plain["segment_ids"] > 0).sum()
    assert shared["prefix_ids"].any() and not plain["prefix_ids"].any()
    for key in ("behaviour_logprobs", "advantages", "versions"):
        a = np.sort(plain[key][plain["loss_mask"] > 0])
        b = np.sort(shared[key][shared["loss_mask"] > 0])
        np.testing.assert_array_equal(a, b, err_msg=key)
    assert shared["loss_mask"].sum() == sum(len(s.completion_ids) for s in samples)

    loss_fn = make_policy_loss(loss, temperature=0.8)
    model_params = weights[1]  # not the weights that sampled: ratios differ from 1

    @jax.jit
    def value_and_grad(params, batch: PolicyBatch):
        def value(params):
            out = loss_fn(spec.merge(params), batch)
            return out[0] / out[1], out
        return jax.value_and_grad(value, has_aux=True)(params)

    @jax.jit
    def logprobs(params, batch: PolicyBatch):
        return spec.merge(params).token_stats(batch.tokens, batch.targets, batch.positions,
                                              batch.segment_ids,
                                              prefix_ids=batch.prefix_ids)["logprobs"]

    results = []
    for batch in (plain, shared):
        policy_batch = PolicyBatch.from_numpy(batch)
        (v, out), grads = value_and_grad(model_params, policy_batch)
        lp = np.asarray(logprobs(model_params, policy_batch))[batch["loss_mask"] > 0]
        results.append((float(v), grads, np.sort(lp), out[2]))
    (v1, g1, lp1, m1), (v2, g2, lp2, m2) = results
    np.testing.assert_allclose(lp2, lp1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v2, v1, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert float(m1["sequences"]) == float(m2["sequences"]) == len(samples)


def test_a_completion_across_an_update_trains_each_token_against_its_own_version(setup):
    """Long completions cut by an in-flight update (KV recomputed): in the packed trainer batch
    every completion token keeps the behaviour log-prob and version it was sampled with, so the
    trainer's importance ratio exp(log π − log μ) is 1 on the tokens of the weights it holds
    and not on the others; the group's staleness counts from its oldest token."""
    import time

    import jax

    from rl_jax.generator.types import GenerateRequest
    from rl_jax.orchestrator.policy import PolicyBatch
    from rl_jax.rollout.records import Group, Sample
    spec, weights, _ = setup
    engine = Engine(CFG, weights[0], engine_config=EngineConfig(
        max_slots=4, max_seq_len=96, recompute_kv_on_update=True))
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    prompts = [encode(env.prompt(i).text) for i in range(2)]
    try:
        engine.pause("in_place")
        futures = [engine.submit(GenerateRequest(p, SamplingParams(
            max_new_tokens=80, temperature=1.0, n=2, seed=i))) for i, p in enumerate(prompts)]
        engine.resume()
        while engine.stats["generated_tokens"] < 4 * 10:
            time.sleep(0.005)
        engine.update_weights(weights[1], version=1)
        outputs = [f.result(timeout=120) for f in futures]
    finally:
        engine.shutdown()
    groups = [Group(position=i, samples=[Sample(
        group_id=i, prompt_ids=prompts[i], completion_ids=list(o.output_ids),
        behaviour_logprobs=list(o.output_logprobs), versions=list(o.output_versions),
        finish_reason=o.finish_reason.get("type", ""), reward=float(j))
        for j, o in enumerate(outs)]) for i, outs in enumerate(outputs)]
    crossing = [s for g in groups for s in g.samples if len(set(s.versions)) == 2]
    assert crossing, [sorted(set(s.versions)) for g in groups for s in g.samples]
    assert all(g.min_version == 0 for g in groups)  # staleness from the oldest token

    batch = GroupsToBatch(seq_len=96, rows=0, share_prompts=True)(groups)
    policy_batch = PolicyBatch.from_numpy(batch)

    @jax.jit
    def logprobs(params, batch):
        return spec.merge(params).token_stats(batch.tokens, batch.targets, batch.positions,
                                              batch.segment_ids,
                                              prefix_ids=batch.prefix_ids)["logprobs"]

    mask = batch["loss_mask"] > 0
    versions, behaviour = batch["versions"][mask], batch["behaviour_logprobs"][mask]
    assert set(versions.tolist()) == {0, 1}
    for held in (0, 1):
        log_ratio = np.asarray(logprobs(weights[held], policy_batch))[mask] - behaviour
        np.testing.assert_allclose(log_ratio[versions == held], 0.0, atol=2e-4)
        assert np.abs(log_ratio[versions != held]).max() > 1e-2


def test_overlong_completions_are_filtered_or_penalised(setup):
    """rollout.overlong: a completion cut off by the length limit keeps its place in its group
    (its reward counts in the baseline) with loss mask 0 ("filter"), or gets the fixed reward
    ("penalize"); finished completions are untouched."""
    from rl_jax.envs.shaping import RewardShaping
    spec, weights, engine = setup
    env = ArithmeticEnv(num_digits=2, reverse_answer=False)
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    results = {}
    for name, extra in (("keep", {}), ("filter", {"overlong_filter": True}),
                        ("penalize", {"shaping": RewardShaping(max_tokens=3,
                                                               truncated_reward=-1.0)})):
        config = RolloutConfig(group_size=4, groups_per_batch=4, max_lag=1, sampling=sampling,
                               **extra)
        it = iter(make_rollout(engine, config, env))
        try:
            results[name] = next(it)
        finally:
            it.close()
    for name, groups in results.items():
        samples = [s for g in groups for s in g.samples]
        cut = [s for s in samples if s.finish_reason == "length"]
        done = [s for s in samples if s.finish_reason != "length"]
        assert cut, name  # random weights: most samples run to the limit
        if name == "filter":
            assert all(s.loss_mask == [0.0] * len(s.completion_ids) for s in cut)
            assert all(s.loss_mask is None for s in done)
            batch = GroupsToBatch(seq_len=32, rows=0)(groups)
            assert batch["loss_mask"].sum() == sum(len(s.completion_ids) for s in done)
        elif name == "penalize":
            assert all(s.reward == -1.0 for s in cut) and all(s.reward >= 0 for s in done)
            assert all(s.loss_mask is None for s in samples)
        else:
            assert all(s.reward >= 0 and s.loss_mask is None for s in samples)


class UpdateBetweenTurnsEnv(ArithmeticEnv):
    """A slow first "tool call": while the environment answers it, the trainer's next version
    lands on the engine; the second turn is generated by the new weights."""

    max_turns = 2

    def __init__(self, engine, weights, version, **kw):
        super().__init__(**kw)
        self.engine, self.weights, self.version = engine, weights, version

    async def step(self, state, completion):
        import asyncio

        from rl_jax.envs.base import StepResult
        state.check_running()
        if state.turn == 0:
            if self.engine.version < self.version:  # the first episode here publishes it
                # from a thread, as the trainer does: not on the rollout's event loop, which
                # the engine's answers to the other episode need
                await asyncio.to_thread(self.engine.update_weights, self.weights, self.version)
            assert await asyncio.to_thread(self.engine.wait_for_version, self.version)
            return state.record(completion, StepResult(0.0, False, "+1=", {}))
        return state.record(completion, StepResult(1.0, True, None, {"correct": True,
                                                                    "reason": "done"}))


def test_an_episode_spans_a_weight_update_and_its_turns_end_at_the_stop_tokens(setup):
    """Per-token versions across turns: the first turn's tokens keep the version that wrote
    them, the observation takes the one before it, the second turn's the new one; each turn
    ends at one of the environment's stop tokens (or its token limit), kept in the turn."""
    spec, weights, engine = setup
    base = engine.version
    stops = tuple(TOKENIZER.token_to_id(d) for d in "0123456789")
    config = RolloutConfig(group_size=2, groups_per_batch=1, max_lag=4, max_tokens_per_turn=4,
                           turn_stop_token_ids=stops,
                           sampling=SamplingParams(max_new_tokens=12, temperature=1.0))
    env = UpdateBetweenTurnsEnv(engine, weights[1], base + 1, num_digits=2)
    rollout = make_rollout(engine, config, env, size=8)
    rollout._encode_observation = lambda text: TOKENIZER.encode(text).ids
    it = iter(rollout)
    try:
        it.set_trainer_version(base)
        it.set_generator_version(base)
        groups = next(it)
    finally:
        it.close()
        engine.update_weights(weights[0], base + 2)
        engine.wait_for_version(base + 2)
    observation = TOKENIZER.encode("+1=").ids
    for s in groups[0].samples:
        mask = np.asarray(s.loss_mask)
        start = int(np.argmin(mask))  # the observation
        first, second = s.completion_ids[:start], s.completion_ids[start + len(observation):]
        assert s.completion_ids[start:start + len(observation)] == observation
        assert mask.sum() == len(first) + len(second) and s.info["turns"] == 2
        assert first[-1] in stops or len(first) == 4 or first[-1] == SPECIAL["eos"]
        assert second[-1] in stops or len(second) == 4 or second[-1] == SPECIAL["eos"]
        # The first turn began on the old version (the other episode's update may land during
        # it); the observation takes its last token's; the second turn is the new version's.
        assert set(s.versions[:start]) <= {base, base + 1}
        assert sorted(s.versions[:start]) == s.versions[:start]
        assert set(s.versions[start:start + len(observation)]) == {s.versions[start - 1]}
        assert set(s.versions[start + len(observation):]) == {base + 1}
    assert min(min(s.versions) for s in groups[0].samples) == base == groups[0].min_version


@pytest.mark.slow
def test_a_stalled_environment_fails_its_attempts_and_the_drop_is_recorded(setup, tmp_path):
    """Scoring past rollout.score_timeout_s fails the attempt (retried, then dropped with its
    reason in the drop log); once the environment answers in time, batches flow again."""
    import json
    import time

    from rl_jax import envs
    _, _, engine = setup
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"delay_s": 1.0, "until": time.time() + 3600}))
    env = envs.get("delayed", task="arithmetic",
                   task_kwargs={"num_digits": 2, "reverse_answer": False}, control=str(control))
    drops = tmp_path / "drops.jsonl"
    config = RolloutConfig(group_size=2, groups_per_batch=2, max_lag=4, max_retries=2,
                           score_timeout_s=0.25, drop_log=str(drops),
                           sampling=SamplingParams(max_new_tokens=4, temperature=1.0))
    it = iter(make_rollout(engine, config, env, size=64))
    try:
        # The module's engine has been updated by earlier tests: both sides start at its version.
        it.set_trainer_version(engine.version)
        it.set_generator_version(engine.version)
        it.start()
        deadline = time.monotonic() + 120
        while it.metrics().get("rollout/skipped_prompts", 0) < 1:  # stalled: nothing scores
            assert time.monotonic() < deadline, it.metrics()
            time.sleep(0.1)
        control.write_text(json.dumps({"delay_s": 0.0, "until": 0}))  # it answers again
        groups = next(it)
        metrics = it.metrics()
    finally:
        it.close()
    assert len(groups) == 2
    assert metrics["rollout/failures"] >= 2 and metrics["rollout/skipped_prompts"] >= 1
    lines = [json.loads(x) for x in drops.read_text().splitlines()]
    assert lines and {x["reason"] for x in lines} == {"failed"}
    assert not {x["position"] for x in lines} & {g.position for g in groups}
