"""The inference engine: behaviour log-probs equal the trainer's, in-flight weight updates,
pause modes, seeds, stop tokens, concurrency, tensor parallelism, bad requests, the paged KV
cache (shared prompt pages, pages given back, a budget too small for everything at once)."""

import concurrent.futures
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.weights import generator_rules, make_generator_meshes
from rl_jax.generator.types import GenerateRequest, GeneratorError, Overloaded, SamplingParams
from rl_jax.models.config import ModelConfig
from rl_jax.sharding import make_mesh
from rl_jax.trainer.state import ModelSpec

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, architecture="Qwen3ForCausalLM",
                  qk_norm=True)
EOS = 2


@pytest.fixture(scope="module")
def spec():
    return ModelSpec(CFG, mesh=None)


@pytest.fixture(scope="module")
def weights(spec):
    return spec.init_params(0), spec.init_params(1)


@pytest.fixture(scope="module")
def engine(weights):
    # Pages of 4 positions: prompts span several pages, the samples of one share its full ones.
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=8, max_seq_len=96,
                                                            page_size=4),
                 eos_token_ids=(EOS,))
    yield eng
    eng.shutdown()


_TRAINER_PROGRAMS: dict = {}  # id(spec) -> (spec, the jitted forward)


def trainer_logprobs(spec, params, prompt, output):
    """Log-probs of ``output`` given ``prompt`` from the trainer's forward pass, compiled once
    per 64-token bucket (the padding after the sequence cannot reach it: attention is
    causal)."""
    n = len(prompt) + len(output) - 1
    tokens, targets = np.zeros((2, 1, 64 * -(-n // 64)), np.int32)
    tokens[0, :n], targets[0, :n] = prompt + output[:-1], prompt[1:] + output
    held, forward = _TRAINER_PROGRAMS.get(id(spec), (None, None))
    if held is not spec:
        forward = jax.jit(lambda p, t, y: spec.merge(p).token_logprobs(t, y)[0])
        _TRAINER_PROGRAMS[id(spec)] = (spec, forward)
    return np.asarray(forward(params, tokens, targets)[0, len(prompt) - 1:n])


def req(prompt, **sampling):
    sampling.setdefault("ignore_eos", True)
    return GenerateRequest(list(prompt), SamplingParams(**sampling))


def test_logprobs_match_trainer_in_a_mixed_batch(spec, weights, engine):
    prompts = [[1, 5, 9], [1, 7, 7, 7, 3, 4, 5, 6, 10, 11], [1, 20], [1, 4, 4, 4, 4, 4]]
    futures = [engine.submit(req(p, max_new_tokens=12 + 3 * i, seed=i, n=2))
               for i, p in enumerate(prompts)]
    for p, f in zip(prompts, futures):
        for out in f.result(timeout=120):
            assert out.output_versions == [0] * len(out.output_ids)
            ref = trainer_logprobs(spec, weights[0], p, out.output_ids)
            np.testing.assert_allclose(out.output_logprobs, ref, atol=1e-4)
            assert out.finish_reason["type"] == "length"


def test_temperature_scales_the_reported_distribution(spec, weights, engine):
    out = engine.generate(req([1, 3, 5], max_new_tokens=10, temperature=0.5, seed=3))[0]
    model = spec.merge(weights[0])
    seq = [1, 3, 5] + out.output_ids
    hidden = model(jnp.asarray([seq[:-1]]))
    logits = np.asarray(model.logits(hidden))[0, 2:] / 0.5
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                              keepdims=True)) \
        - logits.max(-1, keepdims=True)
    ref = logp[np.arange(len(out.output_ids)), out.output_ids]
    np.testing.assert_allclose(out.output_logprobs, ref, atol=1e-4)


def test_seed_reproducible_and_independent_of_batch(engine):
    alone = engine.generate(req([1, 2, 3], max_new_tokens=16, seed=42, n=2))
    noise = [engine.submit(req([1, 9, 9, 9], max_new_tokens=20, seed=s)) for s in range(5)]
    crowded = engine.generate(req([1, 2, 3], max_new_tokens=16, seed=42, n=2))
    for f in noise:
        f.result(timeout=120)
    assert [o.output_ids for o in alone] == [o.output_ids for o in crowded]
    assert alone[0].output_ids != alone[1].output_ids  # samples of a group differ
    other = engine.generate(req([1, 2, 3], max_new_tokens=16, seed=43))
    assert other[0].output_ids != alone[0].output_ids


def test_a_sequence_left_in_a_high_slot_moves_down_and_continues_identically(spec, weights):
    """Twenty short samples take slots 0..19, a long one slot 20; once the short ones finish,
    the long one moves to slot 0 (decode batch 8 instead of 32) with its cache and state, and
    its tokens and log-probs equal those of the same request run alone."""
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=32, max_seq_len=96),
                 eos_token_ids=(EOS,))
    try:
        long_req = lambda: req([1, 6, 2, 8], max_new_tokens=40, seed=7)  # noqa: E731
        alone = eng.generate(long_req())[0]
        assert eng.stats["compactions"] == 0
        eng.pause("in_place")  # admit both in one scheduler pass: the long one gets slot 20
        deadline = time.monotonic() + 60
        while not eng.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        short = eng.submit(req([1, 3], max_new_tokens=3, seed=1, n=20))
        long_ = eng.submit(long_req())
        eng.resume()
        short.result(timeout=120)
        moved = long_.result(timeout=120)[0]
        assert eng.stats["compactions"] >= 1
        assert moved.output_ids == alone.output_ids
        np.testing.assert_allclose(moved.output_logprobs, alone.output_logprobs, atol=1e-5)
        ref = trainer_logprobs(spec, weights[0], [1, 6, 2, 8], moved.output_ids)
        np.testing.assert_allclose(moved.output_logprobs, ref, atol=1e-4)
    finally:
        eng.shutdown()


def test_n_samples_share_one_prefill(engine):
    before = engine.stats["prefills"]
    outs = engine.generate(req([1, 4, 5, 6, 7], max_new_tokens=4, seed=1, n=4))
    assert engine.stats["prefills"] == before + 1
    assert [o.cached_tokens for o in outs] == [0, 5, 5, 5]
    assert len({o.rid for o in outs}) == 4


def test_requests_for_one_prompt_sent_together_share_its_prefill(engine):
    """A GRPO group sent as one request per sample (each with its own length and seed) is
    prefilled once, like the samples of one request, and samples exactly as requests sent
    alone; a different prompt between them starts a prefill group of its own."""
    prompt, other = [1, 4, 5, 6, 7], [1, 4, 5, 6, 8]
    requests = [req(prompt, max_new_tokens=3 + i, seed=10 + i) for i in range(3)]
    alone = [engine.generate(r)[0] for r in requests]
    engine.pause("in_place")  # all four wait together, admitted in one scheduler pass
    deadline = time.monotonic() + 60
    while not engine.paused and time.monotonic() < deadline:
        time.sleep(0.001)
    futures = [engine.submit(r) for r in requests[:2]]
    futures.append(engine.submit(req(other, max_new_tokens=2, seed=3)))
    futures.append(engine.submit(requests[2]))
    engine.resume()
    outs = [f.result(timeout=120)[0] for f in futures]
    assert [o.cached_tokens for o in outs] == [0, 5, 0, 0]
    for got, want in zip(outs[:2] + outs[3:], alone):
        assert got.output_ids == want.output_ids
        np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-5)


def test_greedy_filters_and_stop_tokens(engine):
    greedy = engine.generate(req([1, 6, 8], max_new_tokens=10, temperature=0.0))[0]
    top1 = engine.generate(req([1, 6, 8], max_new_tokens=10, top_k=1, seed=5))[0]
    tiny_p = engine.generate(req([1, 6, 8], max_new_tokens=10, top_p=1e-6, seed=9))[0]
    assert greedy.output_ids == top1.output_ids == tiny_p.output_ids
    stop_at = greedy.output_ids[3]
    first = greedy.output_ids.index(stop_at)
    stopped = engine.generate(req([1, 6, 8], max_new_tokens=10, temperature=0.0,
                                  stop_token_ids=(stop_at,)))[0]
    assert stopped.output_ids == greedy.output_ids[:first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}


def test_eos_ends_unless_ignored(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=64),
                 eos_token_ids=(EOS,))
    try:
        out = eng.generate(req([1, 3], max_new_tokens=8, temperature=0.0))[0]
        eos = out.output_ids[2]
        eng2 = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=64),
                      eos_token_ids=(eos,))
        stopped = eng2.generate(GenerateRequest([1, 3], SamplingParams(
            max_new_tokens=8, temperature=0.0)))[0]
        assert stopped.output_ids[-1] == eos and len(stopped.output_ids) <= 3
        assert stopped.finish_reason["type"] == "stop"
        ignored = eng2.generate(GenerateRequest([1, 3], SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True)))[0]
        assert len(ignored.output_ids) == 8
        eng2.shutdown()
    finally:
        eng.shutdown()


def _generate_across_update(weights, recompute: bool, meshes=None, decode_steps: int = 1,
                            **sampling):
    params = weights[0] if meshes is None else _place(weights[0], meshes[0])
    eng = Engine(CFG, params, meshes=meshes, engine_config=EngineConfig(
        max_slots=4, max_seq_len=160, recompute_kv_on_update=recompute,
        decode_steps=decode_steps))
    try:
        eng.pause("in_place")
        # Long enough that the update lands mid-generation however fast decoding runs.
        futures = [eng.submit(req([1, 2 + i, 3], max_new_tokens=150, seed=i, **sampling))
                   for i in range(3)]
        eng.resume()
        while eng.stats["generated_tokens"] < 3 * 10:
            time.sleep(0.005)
        eng.update_weights(weights[1] if meshes is None else _place(weights[1], meshes[0]),
                           version=1)
        outs = [f.result(timeout=120)[0] for f in futures]
        if meshes is not None:  # the three sequences were spread over the replicas
            assert all(eng.stats[f"replica{i}_admitted"] for i in range(len(meshes)))
    finally:
        eng.shutdown()
    return outs


def _place(params, mesh):
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.device_put(params, NamedSharding(mesh, PartitionSpec()))



@pytest.mark.parametrize("recompute,replicas,decode_steps",
                         [(False, 1, 1), (True, 1, 1), (True, 2, 1), (False, 1, 3),
                          (True, 1, 3)])
def test_in_flight_update_keeps_requests_and_records_versions(spec, weights, recompute,
                                                              replicas, decode_steps):
    meshes = make_generator_meshes(1, replicas) if replicas > 1 else None
    outs = _generate_across_update(weights, recompute, meshes, decode_steps)
    for i, out in enumerate(outs):
        prompt = [1, 2 + i, 3]
        versions = np.asarray(out.output_versions)
        assert len(out.output_ids) == 150  # nothing dropped
        assert np.all(np.diff(versions) >= 0) and versions[0] == 0 and versions[-1] == 1
        switch = int(np.argmax(versions == 1))
        old = trainer_logprobs(spec, weights[0], prompt, out.output_ids)
        np.testing.assert_allclose(out.output_logprobs[:switch], old[:switch], atol=1e-4)
        new = trainer_logprobs(spec, weights[1], prompt, out.output_ids)
        if recompute:
            # The KV cache was recomputed under the new weights: exact new-policy log-probs.
            np.testing.assert_allclose(out.output_logprobs[switch:], new[switch:], atol=1e-4)
        else:
            # PipelineRL: the prefix keeps old-weight keys/values, so the tokens after the
            # update are close to, but not exactly, the new policy's.
            gap = np.abs(np.asarray(out.output_logprobs[switch:]) - new[switch:])
            assert gap.max() > 1e-6


def trainer_filtered_logprobs(spec, params, prompt, output, temperature, top_k, top_p):
    """Per output token: log-probs under ``softmax(logits / T)`` and under the same restricted
    to top-k then top-p and renormalised, from the trainer's full logits (float64)."""
    model = spec.merge(params)
    hidden = model(jnp.asarray([prompt + output[:-1]]))
    logits = np.asarray(model.logits(hidden))[0, len(prompt) - 1:].astype(np.float64)
    full, filtered = [], []
    for row, tok in zip(logits, output):
        scaled = row / temperature
        p = np.exp(scaled - scaled.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        keep = np.zeros(len(p), bool)
        keep[order] = (np.arange(len(p)) < top_k) & (above < top_p)
        full.append(np.log(p[tok]))
        filtered.append(np.log(p[tok] / p[keep].sum()) if keep[tok] else -np.inf)
    return np.asarray(full), np.asarray(filtered)


def test_filtered_in_flight_tokens_carry_their_version_and_sampled_distribution(spec, weights):
    """Top-k/top-p sampling across an in-flight update (KV recomputed, so the reference is
    exact): every token carries the version that sampled it, its behaviour log-prob is under
    that version's filtered distribution, and the unfiltered one beside it under the full
    distribution; a per-token ratio against the trainer's log-probs of the same version is 1
    over the kept mass."""
    outs = _generate_across_update(weights, True, temperature=0.9, top_k=6, top_p=0.9)
    for i, out in enumerate(outs):
        prompt = [1, 2 + i, 3]
        versions = np.asarray(out.output_versions)
        assert set(versions.tolist()) == {0, 1} and np.all(np.diff(versions) >= 0)
        assert out.output_unfiltered_logprobs is not None
        full = np.empty(len(versions))
        filtered = np.empty(len(versions))
        for v in (0, 1):
            f, g = trainer_filtered_logprobs(spec, weights[v], prompt, out.output_ids, 0.9, 6,
                                             0.9)
            full[versions == v], filtered[versions == v] = f[versions == v], g[versions == v]
        assert np.all(np.isfinite(filtered))  # every sampled token was inside the filter
        # The trainer's own log-probs at the sampling temperature (what the policy loss uses).
        for v in (0, 1):
            model = spec.merge(weights[v])
            stats = model.token_stats(jnp.asarray([prompt + out.output_ids[:-1]]),
                                      jnp.asarray([prompt[1:] + out.output_ids]),
                                      temperature=0.9)
            np.testing.assert_allclose(np.asarray(stats["logprobs"][0, len(prompt) - 1:])[
                versions == v], full[versions == v], atol=2e-5)
        np.testing.assert_allclose(out.output_unfiltered_logprobs, full, atol=2e-4)
        np.testing.assert_allclose(out.output_logprobs, filtered, atol=2e-4)
        assert np.all(np.asarray(out.output_logprobs) >= np.asarray(
            out.output_unfiltered_logprobs) - 1e-6)
        assert np.any(np.asarray(out.output_logprobs) > np.asarray(
            out.output_unfiltered_logprobs) + 1e-3)  # the filter cut some mass


def test_multi_step_decoding_gives_the_tokens_of_single_steps(spec, weights):
    """Runs of several decode steps in one program sample every token exactly as one step at
    a time does (per-token keys), and sequences that stop or reach their length inside a run
    end there, whatever the run's length."""
    workload = [req([1, 5, 9], max_new_tokens=9, seed=1, n=2),
                req([1, 7, 7, 7, 3], max_new_tokens=13, seed=2),
                req([1, 20], max_new_tokens=6, temperature=0.0),
                req([1, 4, 4], max_new_tokens=11, top_k=3, seed=4, n=3),
                req([1, 6, 8], max_new_tokens=17, seed=5)]

    def run(decode_steps: int):
        eng = Engine(CFG, weights[0], eos_token_ids=(EOS,), engine_config=EngineConfig(
            max_slots=8, max_seq_len=64, decode_steps=decode_steps))
        try:
            first = eng.generate(req([1, 6, 8], max_new_tokens=17, seed=5))[0]
            stop_at = first.output_ids[6]  # stops the last request inside a run
            requests = workload[:-1] + [req([1, 6, 8], max_new_tokens=17, seed=5,
                                            stop_token_ids=(stop_at,))]
            eng.pause("in_place")  # admitted together, then decoded in runs
            futures = [eng.submit(r) for r in requests]
            eng.resume()
            outs = [f.result(timeout=120) for f in futures]
            return outs, dict(eng.stats), stop_at
        finally:
            eng.shutdown()

    single, single_stats, stop_at = run(1)
    multi, multi_stats, _ = run(4)
    assert single_stats["decode_dispatches"] == single_stats["decode_steps"]
    assert multi_stats["decode_dispatches"] < multi_stats["decode_steps"] / 2
    for a_outs, b_outs in zip(single, multi):
        for a, b in zip(a_outs, b_outs):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-6)
    stopped = multi[-1][0]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}
    # the first token comes from the prefill, the others in runs of 4: it ended inside one
    assert (len(stopped.output_ids) - 1) % 4 != 0
    assert [len(o.output_ids) for o in multi[0]] == [9, 9]
    ref = trainer_logprobs(spec, weights[0], [1, 7, 7, 7, 3], multi[1][0].output_ids)
    np.testing.assert_allclose(multi[1][0].output_logprobs, ref, atol=1e-4)
    with pytest.raises(GeneratorError, match="decode_steps"):
        EngineConfig(decode_steps=0)


def test_pause_retract_requeues_and_finishes_identically(weights):
    # Long enough that the pause always lands mid-sequence (the engine decodes a token in well
    # under a millisecond here; 30 tokens could finish before the pause was taken).
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=256))
    try:
        reference = eng.generate(req([1, 8, 9], max_new_tokens=200, seed=11))[0]
        fut = eng.submit(req([1, 8, 9], max_new_tokens=200, seed=11))
        while eng.stats["generated_tokens"] < reference.completion_tokens + 8:
            time.sleep(0.002)
        eng.pause("retract")
        assert eng.load()["running"] == 0 and not fut.done()
        assert eng.stats["retracted_sequences"] >= 1
        eng.resume()
        out = fut.result(timeout=120)[0]
        assert out.output_ids == reference.output_ids
        np.testing.assert_allclose(out.output_logprobs, reference.output_logprobs, atol=1e-5)
    finally:
        eng.shutdown()


def test_pause_in_place_and_abort(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=96))
    try:
        fut = eng.submit(req([1, 5], max_new_tokens=80, seed=1))
        while eng.stats["generated_tokens"] < 5:
            time.sleep(0.002)
        eng.pause("in_place")
        frozen = eng.stats["generated_tokens"]
        time.sleep(0.2)
        assert eng.stats["generated_tokens"] == frozen and eng.load()["running"] == 1
        eng.resume()
        assert len(fut.result(timeout=120)[0].output_ids) == 80

        slow = eng.submit(req([1, 5], max_new_tokens=80, seed=2))
        one = eng.submit(GenerateRequest([1, 6], SamplingParams(max_new_tokens=80,
                                                                ignore_eos=True), rid="mine"))
        while eng.stats["generated_tokens"] < frozen + 90:
            time.sleep(0.002)
        eng.abort("mine")
        aborted = one.result(timeout=60)[0]
        assert aborted.finish_reason["type"] == "abort" and len(aborted.output_ids) < 80
        eng.pause("abort")
        assert slow.result(timeout=60)[0].finish_reason["type"] == "abort"
        eng.resume()
        assert len(eng.generate(req([1, 5], max_new_tokens=3))[0].output_ids) == 3
    finally:
        eng.shutdown()


def test_many_concurrent_clients_with_few_slots(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=3, max_seq_len=64))
    try:
        alone = {s: eng.generate(req([1, s % 7 + 3], max_new_tokens=6 + s % 5, seed=s))[0]
                 for s in range(12)}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda s: eng.generate(
                req([1, s % 7 + 3], max_new_tokens=6 + s % 5, seed=s))[0], range(12)))
        for s, out in enumerate(results):
            assert out.output_ids == alone[s].output_ids
        assert eng.load() == {"running": 0, "waiting": 0, "free_slots": 3}
    finally:
        eng.shutdown()


def test_tensor_parallel_engine_matches_single_device(weights):
    mesh = make_mesh(data=1, fsdp=1, tensor=2, devices=__import__("jax").devices()[:2])
    tp_spec = ModelSpec(CFG, mesh=mesh, rules=generator_rules())
    params = jax.device_put(weights[0], tp_spec.param_shardings)
    assert params["layers"]["wq"].sharding.spec[2] == "tensor"
    tp = Engine(CFG, params, engine_config=EngineConfig(max_slots=4, max_seq_len=64),
                mesh=mesh, rules=generator_rules())
    single = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=64))
    try:
        a = tp.generate(req([1, 2, 3, 4], max_new_tokens=12, seed=5))[0]
        b = single.generate(req([1, 2, 3, 4], max_new_tokens=12, seed=5))[0]
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
    finally:
        tp.shutdown()
        single.shutdown()


@pytest.mark.parametrize("tensor", [1, 2])
def test_data_parallel_replicas_match_single_device(spec, weights, tensor):
    """Two replicas (each on one device, or tensor-parallel over two) share out the requests
    and produce the tokens and log-probs one device does; samples of one request admitted
    together share one prefill on one replica."""
    meshes = make_generator_meshes(tensor, 2)
    params = jax.device_put(weights[0], ModelSpec(CFG, mesh=meshes[0],
                                                  rules=generator_rules()).param_shardings)
    dp = Engine(CFG, params, meshes=meshes, rules=generator_rules(), eos_token_ids=(EOS,),
                engine_config=EngineConfig(max_slots=8, max_seq_len=96))
    single = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=8, max_seq_len=96),
                    eos_token_ids=(EOS,))
    try:
        assert dp.data_parallel == 2 and dp.load()["free_slots"] == 8
        requests = [([1, 3 + i, 5, 7][:2 + i % 3], dict(max_new_tokens=10 + 7 * i, seed=i,
                                                        n=1 + i % 3, ignore_eos=i % 2 == 0))
                    for i in range(8)]
        dp.pause("in_place")  # admitted together: both replicas fill up, the rest waits
        futures = [dp.submit(GenerateRequest(p, SamplingParams(**s))) for p, s in requests]
        dp.resume()
        got = [f.result(timeout=120) for f in futures]
        want = [single.generate(GenerateRequest(p, SamplingParams(**s))) for p, s in requests]
        assert dp.stats["replica0_admitted"] and dp.stats["replica1_admitted"]
        for (prompt, _), outs, refs in zip(requests, got, want):
            assert [o.output_ids for o in outs] == [o.output_ids for o in refs]
            # Samples admitted together share a prefill (a full replica can split a request).
            assert outs[0].cached_tokens == 0
            assert {o.cached_tokens for o in outs} <= {0, len(prompt)}
            for o, r in zip(outs, refs):
                np.testing.assert_allclose(o.output_logprobs, r.output_logprobs, atol=1e-5)
                np.testing.assert_allclose(
                    o.output_logprobs, trainer_logprobs(spec, weights[0], prompt, o.output_ids),
                    atol=1e-4)
        shared = sum(o.cached_tokens > 0 for outs in got for o in outs)
        assert shared >= 4
        assert dp.load() == {"running": 0, "waiting": 0, "free_slots": 8}
        assert dp.flush_cache()
    finally:
        dp.shutdown()
        single.shutdown()


def test_data_parallel_configuration_errors(weights):
    meshes = make_generator_meshes(1, 2)
    with pytest.raises(GeneratorError, match="does not split evenly over 2"):
        Engine(CFG, weights[0], meshes=meshes, engine_config=EngineConfig(max_slots=5))
    with pytest.raises(GeneratorError, match="share devices"):
        Engine(CFG, weights[0], meshes=[meshes[0], meshes[0]])
    with pytest.raises(GeneratorError, match="either mesh or meshes"):
        Engine(CFG, weights[0], mesh=meshes[0], meshes=meshes)


def test_flush_cache_only_when_idle(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=2, max_seq_len=64))
    try:
        assert eng.flush_cache()
        eng.pause("in_place")
        fut = eng.submit(req([1, 2], max_new_tokens=5))
        eng.resume()
        eng.pause("in_place")
        running = eng.load()["running"]
        assert eng.flush_cache() == (running == 0)
        eng.resume()
        fut.result(timeout=60)
        assert eng.flush_cache()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("request_, message", [
    (GenerateRequest([]), "input_ids is empty"),
    (GenerateRequest([1, 48]), "outside the vocabulary"),
    (GenerateRequest([1, -1]), "outside the vocabulary"),
    (GenerateRequest([1] * 90, SamplingParams(max_new_tokens=10)), "exceeds"),
])
def test_bad_requests_are_refused(engine, request_, message):
    with pytest.raises(GeneratorError, match=message):
        engine.submit(request_)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(n=0), "n must be"), (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(GeneratorError, match=message):
        SamplingParams(**kwargs)


def test_overload_and_duplicate_ids(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=1, max_seq_len=64,
                                                            max_waiting=2))
    try:
        eng.pause("in_place")
        a = eng.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="a"))
        with pytest.raises(GeneratorError, match="already running"):
            eng.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="a"))
        eng.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
        with pytest.raises(Overloaded, match="retry later"):
            eng.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
        eng.resume()
        a.result(timeout=60)
        zero = eng.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=0)))[0]
        assert zero.output_ids == [] and zero.finish_reason["type"] == "length"
    finally:
        eng.shutdown()


def test_a_stopped_engine_refuses_control_instead_of_hanging(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=2, max_seq_len=64,
                                                            max_waiting=4))
    with pytest.raises(GeneratorError, match="can never be queued"):
        eng.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2, n=5)))
    assert eng.alive
    eng.shutdown()
    assert not eng.alive
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not running"):
        eng.pause("in_place")
    assert time.monotonic() - start < 5


# ---- sampling, cache buckets, decode scheduling ----------------------------------------------

def reference_filter(scaled, top_k, top_p, min_p):
    """Sort-based top-k / top-p / min-p keep mask of one row (NumPy, float64)."""
    scaled = np.asarray(scaled, np.float64)
    desc = -np.sort(-scaled)
    keep = np.ones(scaled.shape, bool)
    if top_k > 0:
        keep &= scaled >= desc[min(top_k, len(desc)) - 1]
    probs_desc = np.exp(desc - desc.max())
    probs_desc /= probs_desc.sum()
    if top_p < 1:
        before = np.cumsum(probs_desc) - probs_desc
        keep &= scaled >= desc[before < top_p].min()
    probs = np.exp(scaled - scaled.max())
    return keep & (probs >= min_p)


@pytest.mark.parametrize("filters", ["top_k and top_p", "top_k only", "top_p only", "min_p only"])
def test_filter_mask_matches_a_sorting_reference(filters):
    """Batches whose rows mix every filter, and batches where no row asks for top-p, or for
    top-k, or for either (the searches nobody asks for are skipped)."""
    from rl_jax.generator.engine.sampling import filter_mask
    rng = np.random.default_rng(0)
    rows, vocab = 24, 300
    scaled = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    scaled[::3] = np.round(scaled[::3] * 2) / 2  # many ties
    top_k = rng.choice([-1, 1, 3, 17, 299, 300, 1000], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.05, 1e-6], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.1, 0.5], rows).astype(np.float32)
    if filters in ("top_p only", "min_p only"):
        top_k[:] = -1
    if filters in ("top_k only", "min_p only"):
        top_p[:] = 1.0
    top = scaled.max(-1, keepdims=True)
    unnormalised = np.exp(scaled - top)
    mask = jax.jit(filter_mask)(scaled, unnormalised, unnormalised.sum(-1), top_k, top_p, min_p)
    for r in range(rows):
        want = reference_filter(scaled[r], top_k[r], top_p[r], min_p[r])
        np.testing.assert_array_equal(np.asarray(mask[r]), want,
                                      err_msg=f"row {r}: k={top_k[r]} p={top_p[r]} "
                                              f"min_p={min_p[r]}")


def test_inverse_cdf_picks_by_prefix_sums_and_never_a_zero_weight():
    from rl_jax.generator.engine.sampling import inverse_cdf
    rng = np.random.default_rng(1)
    for vocab in (5, 48, 1000):
        weights = rng.random((64, vocab)).astype(np.float32)
        weights[rng.random((64, vocab)) < 0.6] = 0.0
        weights[:, vocab // 2] += 0.5  # every row has mass
        u = rng.random(64).astype(np.float32)
        u[:4] = 0.0  # the first non-zero entry
        got = np.asarray(inverse_cdf(weights, u))
        cum = np.cumsum(weights.astype(np.float64), axis=-1)
        want = np.array([np.searchsorted(c, x * c[-1], side="right") for c, x in zip(cum, u)])
        assert np.all(weights[np.arange(64), got] > 0)
        # Equal except where float32 rounding moved a boundary by a hair.
        close = np.isclose(cum[np.arange(64), np.minimum(want, got)], u * cum[:, -1], rtol=1e-5)
        assert np.all((got == want) | close)
        assert np.all(got[:4] == np.argmax(weights[:4] > 0, axis=-1))


def test_sampled_tokens_follow_the_distribution_and_greedy_takes_the_first_maximum():
    from rl_jax.generator.engine.sampling import sample
    rows, vocab = 4096, 40
    logits = np.random.default_rng(2).standard_normal(vocab).astype(np.float32)
    logits[7] = logits[31] = logits.max() + 1.0  # a tie for the maximum
    tile = np.broadcast_to(logits, (rows, vocab))
    ones, zeros = np.ones(rows, np.float32), np.zeros(rows, np.int32)
    seeds = np.arange(rows, dtype=np.uint32)
    tokens, logprobs, unfiltered = sample(tile, ones * 0.7, zeros - 1, ones, ones * 0, seeds,
                                          zeros, zeros, filtered=False)
    np.testing.assert_array_equal(np.asarray(unfiltered), np.asarray(logprobs))
    scaled = logits.astype(np.float64) / 0.7
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    chi2 = ((counts - rows * probs) ** 2 / (rows * probs)).sum()
    assert chi2 < 80  # 39 degrees of freedom: p < 1e-4 for a correct sampler
    np.testing.assert_allclose(np.asarray(logprobs), np.log(probs)[np.asarray(tokens)],
                               atol=1e-5)
    greedy, _, _ = sample(tile[:3], ones[:3] * 0, zeros[:3] - 1, ones[:3], ones[:3] * 0,
                          seeds[:3], zeros[:3], zeros[:3], filtered=False)
    assert np.asarray(greedy).tolist() == [7, 7, 7]


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.2),
                                               (8, 0.8, 0.05)])
def test_filtered_sampling_reports_the_sampled_distribution_and_unbiased_ratios(top_k, top_p,
                                                                                min_p):
    """With top-k/top-p/min-p the behaviour log-prob is that of the filtered, renormalised
    distribution the token was drawn from; importance ratios ``π(y) / μ(y)`` against it estimate
    ``E_π[f]`` over the kept tokens without bias, against the unfiltered one they do not."""
    from rl_jax.generator.engine.sampling import sample
    rows, vocab, temperature = 16384, 40, 0.8
    logits = np.random.default_rng(4).standard_normal(vocab).astype(np.float32) * 1.5
    tile = np.broadcast_to(logits, (rows, vocab))
    ones, zeros = np.ones(rows, np.float32), np.zeros(rows, np.int32)
    tokens, logprobs, unfiltered = (np.asarray(x) for x in sample(
        tile, ones * temperature, zeros + top_k, ones * top_p, ones * min_p,
        np.arange(rows, dtype=np.uint32), zeros, zeros, filtered=True))
    # The reference filter (float64): top-k, then top-p over the probabilities sorted
    # descending (keep while the mass strictly above is < top_p), then min-p.
    scaled = logits.astype(np.float64) / temperature
    pi = np.exp(scaled - scaled.max())
    pi /= pi.sum()
    order = np.argsort(-pi, kind="stable")
    keep = np.zeros(vocab, bool)
    above = np.concatenate([[0.0], np.cumsum(pi[order])[:-1]])
    keep[order] = (np.arange(vocab) < (top_k if top_k > 0 else vocab)) & (above < top_p)
    keep &= pi >= min_p * pi.max()
    mu = np.where(keep, pi, 0.0) / np.where(keep, pi, 0.0).sum()
    assert keep.sum() < vocab and np.all(keep[tokens])
    np.testing.assert_allclose(logprobs, np.log(mu[tokens]), atol=2e-5)
    np.testing.assert_allclose(unfiltered, np.log(pi[tokens]), atol=2e-5)
    counts = np.bincount(tokens, minlength=vocab)[keep]
    expected = rows * mu[keep]
    assert ((counts - expected) ** 2 / expected).sum() < 3 * keep.sum() + 30
    # Importance-weighted estimate of E_π[f · 1{kept}] for a test function f.
    f = np.cos(np.arange(vocab))
    target = np.sum(pi[keep] * f[keep])
    ratio = np.exp(np.log(pi[tokens]) - logprobs)
    estimate = np.mean(ratio * f[tokens])
    stderr = np.std(ratio * f[tokens]) / np.sqrt(rows)
    assert abs(estimate - target) < 4 * stderr
    biased = np.mean(np.exp(np.log(pi[tokens]) - unfiltered) * f[tokens])
    assert abs(biased - target) > 4 * stderr


def test_kv_and_batch_buckets():
    from rl_jax.generator.engine.kv_cache import batch_bucket, kv_bucket
    sizes = [kv_bucket(n, 4096) for n in range(1, 4097)]
    assert sizes[0] == 16 and sizes[-1] == 4096
    assert all(size >= n for n, size in enumerate(sizes, 1))
    assert all(3 * (size - n) <= size for n, size in enumerate(sizes, 1) if n > 128)
    assert len(set(sizes)) == 14  # 16, 32, 64, 128, 192, 256, 384, ..., 3072, 4096
    assert kv_bucket(90, 96) == 96
    assert [batch_bucket(n, 48) for n in (1, 8, 9, 17, 33, 48)] == [8, 8, 16, 32, 48, 48]


def test_decode_covers_the_lowest_slots_in_use(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=32, max_seq_len=64))
    batches = []
    decode = eng.runner.decode

    def recording(*args, **kwargs):
        batches.append(args[1])
        return decode(*args, **kwargs)

    eng.runner.decode = recording
    try:
        outs = [eng.submit(req([1, 3 + i], max_new_tokens=6, seed=i)) for i in range(3)]
        assert all(len(f.result(timeout=120)[0].output_ids) == 6 for f in outs)
        assert batches and max(batches) == 8
        # All 20 waiting at once (else a loaded machine may admit and finish some before the
        # last are submitted, and they never run 17 at a time).
        eng.pause("in_place")
        deadline = time.monotonic() + 60
        while not eng.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        many = [eng.submit(req([1, 3], max_new_tokens=4, seed=i)) for i in range(20)]
        eng.resume()
        for f in many:
            f.result(timeout=120)
        assert max(batches) == 32 and eng.load()["free_slots"] == 32
    finally:
        eng.shutdown()


def test_weights_are_laid_out_off_the_scheduler_thread(weights):
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=96))
    threads = []
    prepare = eng.runner.prepare
    # Compiled before the request: with a cold cache the update's first layout could outlast the
    # request's remaining tokens, and the update would land after it ended.
    prepare(weights[1])

    def recording(params):
        threads.append(threading.current_thread().name)
        return prepare(params)

    eng.runner.prepare = recording
    try:
        fut = eng.submit(req([1, 2, 3], max_new_tokens=90, seed=0))
        while eng.stats["generated_tokens"] < 5:
            time.sleep(0.002)
        eng.update_weights(weights[1], version=1)
        assert eng.wait_for_version(1, timeout=60) and eng.params is weights[1]
        out = fut.result(timeout=120)[0]
        assert out.output_versions[0] == 0 and out.output_versions[-1] == 1
        assert threads == ["engine-weights"]
        with pytest.raises(GeneratorError, match="do not match"):
            eng.update_weights({"embed": weights[1]["embed"]}, version=2)
    finally:
        eng.shutdown()


def test_the_next_cache_length_is_compiled_ahead(weights):
    from jax import monitoring
    compiles = []

    def count(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    monitoring.register_event_duration_secs_listener(count)
    try:
        _decode_across_a_cache_length(weights, compiles)
    finally:
        monitoring.unregister_event_duration_listener(count)


def _decode_across_a_cache_length(weights, compiles):
    from rl_jax.generator.engine.kv_cache import SLOT_FIELDS
    from rl_jax.generator.engine.runner import ModelRunner
    runner = ModelRunner(CFG, max_slots=8, max_seq_len=96, page_size=16)
    assert not runner.native_attention  # XLA's attention: one program per attended length
    params = weights[0]
    decode_weights = runner.prepare(params)
    k, v, logits = runner.prefill(params, np.ones((8, 16), np.int32), np.full(8, 10, np.int32))
    values = {name: np.zeros(8, dtype) for name, dtype in SLOT_FIELDS.items()}
    values.update(position=np.full(8, 10), temperature=np.ones(8), top_p=np.ones(8))
    slots = np.arange(8, dtype=np.int32)
    runner.admit(k, v, logits, slots, slots, values, np.ones(8, bool), False)
    for slot in range(8):
        assert runner.pages.grow(slot, 22)
    runner.decode(decode_weights, 8, 12, False, kv_horizon=40)  # one page: two compile ahead
    assert runner.kv_len == 16
    runner._compiling[(8, 32, False, 1)].wait(timeout=120)
    before = len(compiles)
    out = runner.decode(decode_weights, 8, 20, False, kv_horizon=40)  # grows to two pages
    jax.block_until_ready(out)
    assert runner.kv_len == 32 and len(compiles) == before


def test_runner_pages_prompts_shares_them_and_moves_slots(weights):
    """Admission gives each sequence the pages of its prompt (sequences of one prefill row share
    its full pages and each holds its own copy of the last, partly filled one), writes the
    prefill's keys and values there, page by page; a move carries a sequence's page table row
    and state to another slot, the cache staying where it is; pages return when no slot lists
    them."""
    import jax.numpy as jnp
    from rl_jax.generator.engine.kv_cache import SLOT_FIELDS, PageTable
    from rl_jax.generator.engine.runner import ModelRunner
    runner = ModelRunner(CFG, max_slots=32, max_seq_len=64, page_size=4)
    assert runner.num_pages == 32 * 16 and runner.pages.free_pages == 32 * 16
    assert runner.cache_bytes == 2 * CFG.num_layers * 32 * 64 * CFG.num_kv_heads * CFG.head_dim * 4
    params = weights[0]
    k, v, logits = runner.prefill(params, np.arange(1, 1 + 3 * 16).reshape(3, 16),
                                  np.array([10, 5, 7], np.int32))
    values = {name: np.zeros(4, dtype) for name, dtype in SLOT_FIELDS.items()}
    values.update(position=np.array([10, 10, 5, 7]), temperature=np.ones(4), top_p=np.ones(4),
                  token_index=np.zeros(4))
    slots = np.array([3, 12, 27, 20], np.int32)
    rows = np.array([0, 0, 1, 2], np.int32)  # two samples of the first prompt
    runner.admit(k, v, logits, rows, slots, values, np.ones(4, bool), False)
    table = runner.pages.table
    assert runner.pages.held[[3, 12, 27, 20]].tolist() == [3, 3, 2, 2]
    assert table[3, :2].tolist() == table[12, :2].tolist()  # positions 0..7 shared
    assert table[3, 2] != table[12, 2]  # positions 8, 9: each sample's own page
    assert runner.pages.free_pages == 32 * 16 - (3 + 1 + 2 + 2)
    pool_k = [np.asarray(layer) for layer in runner.k_cache]
    pool_v = [np.asarray(layer) for layer in runner.v_cache]
    for slot, row, length in ((3, 0, 10), (12, 0, 10), (27, 1, 5), (20, 2, 7)):
        for layer in range(CFG.num_layers):
            pages = table[slot, :runner.pages.held[slot]]
            keys = np.concatenate(list(pool_k[layer][pages]), axis=-1)[..., :length]
            vals = np.concatenate(list(pool_v[layer][pages]), axis=-2)[:, :length]
            np.testing.assert_array_equal(keys, np.transpose(np.asarray(k[layer, row, :length]),
                                                             (1, 2, 0)))
            np.testing.assert_array_equal(vals, np.swapaxes(np.asarray(v[layer, row, :length]),
                                                            0, 1))
    rows_before = table[[27, 12]].copy()
    state = {name: np.asarray(a)[[3, 12, 27]] for name, a in runner.state.items()}
    runner.move(np.array([27, 12], np.int32), np.array([9, 0], np.int32))
    np.testing.assert_array_equal(runner.pages.table[[9, 0]], rows_before)
    assert runner.pages.held[[27, 12]].tolist() == [0, 0]
    for name, a in runner.state.items():
        np.testing.assert_array_equal(np.asarray(a)[[3, 0, 9]], state[name])
    out = runner.decode(runner.prepare(params), 16, 16, False)  # slots 0..15
    assert np.asarray(out).shape == (3, 16)  # tokens, log-probs, unfiltered log-probs
    assert jnp.asarray(runner.state["token_index"])[9] == 2  # moved sequence decoded
    for slot in (3, 0, 9, 20):
        runner.pages.release(slot)
    assert runner.pages.free_pages == runner.num_pages
    assert (runner.pages.refs == 0).all() and (runner.pages.table == runner.num_pages).all()
    small = PageTable(num_pages=3, page_size=4, max_slots=2, max_seq_len=64)
    assert small.grow(0, 9) and small.free_pages == 0
    assert not small.grow(1, 1) and small.held[1] == 0  # nothing taken when it cannot fit
    with pytest.raises(GeneratorError, match="KV-cache pages"):
        runner.admit(k, v, logits, np.zeros(1, np.int32), np.array([5], np.int32),
                     {**values, "position": np.array([64 * 16 * 32])}, np.ones(1, bool), False)


def test_samples_share_prompt_pages_and_every_page_comes_back(spec, weights, engine):
    """While the four samples of a 10-token prompt run, they list the same two full prompt
    pages (pages of 4) and one page each from the prompt's last one on; their tokens and
    log-probs are the trainer's; once done, every page is free again."""
    prompt = [1, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    engine.pause("in_place")
    deadline = time.monotonic() + 60
    while not engine.paused and time.monotonic() < deadline:
        time.sleep(0.001)
    start = engine.stats["generated_tokens"]
    future = engine.submit(req(prompt, max_new_tokens=30, seed=5, n=4))
    engine.resume()
    while engine.stats["generated_tokens"] - start < 4 * 3 and not future.done():
        time.sleep(0.001)
    engine.pause("in_place")
    replica = engine._replicas[0]
    table = replica.runner.pages
    running = sorted(replica.running)
    if len(running) == 4:  # not already finished on a fast machine
        rows = table.table[running]
        assert (rows[:, :2] == rows[0, :2]).all()
        assert len(set(rows[:, 2].tolist())) == 4
        assert (table.refs[rows[0, :2]] == 4).all()
    engine.resume()
    outs = future.result(timeout=120)
    for out in outs:
        ref = trainer_logprobs(spec, weights[0], prompt, out.output_ids)
        np.testing.assert_allclose(out.output_logprobs, ref, atol=1e-4)
    usage = engine.cache_usage()
    assert usage["free_pages"] == usage["pages"] == 8 * 24 and usage["page_size"] == 4


def test_a_cache_too_small_for_every_sequence_retracts_and_recomputes(spec, weights):
    """A budget of 24 pages of 8 tokens for 8 sequences that grow to 9 pages each: admission
    takes what fits, and when running sequences run the pool dry, the ones with the fewest
    tokens go back to the queue (SGLang's retraction) and are recomputed later; every sequence
    completes with the trainer's log-probs, and every page comes back."""
    from rl_jax.generator.engine.runner import ModelRunner
    page = ModelRunner.page_bytes(CFG, 8, jnp.float32)
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(
        max_slots=8, max_seq_len=128, page_size=8, kv_cache_bytes=24 * page + page - 1,
        init_new_token_ratio=0.1, min_new_token_ratio=0.1))
    try:
        assert eng.cache_usage()["pages"] == 24
        prompts = [[1, 3 + i, 5, 7, 9 + i][:3 + i % 3] for i in range(8)]
        futures = [eng.submit(req(p, max_new_tokens=64, seed=i)) for i, p in enumerate(prompts)]
        outs = [f.result(timeout=300)[0] for f in futures]
        assert eng.stats["retracted_sequences"] > 0 and eng.stats["kv_cache_full"] > 0
        for p, out in zip(prompts, outs):
            assert len(out.output_ids) == 64 and out.finish_reason["type"] == "length"
            ref = trainer_logprobs(spec, weights[0], p, out.output_ids)
            np.testing.assert_allclose(out.output_logprobs, ref, atol=1e-4)
        usage = eng.cache_usage()
        assert usage["free_pages"] == usage["pages"]
    finally:
        eng.shutdown()


def test_a_request_that_can_never_fit_the_cache_is_refused(weights):
    from rl_jax.generator.engine.runner import ModelRunner
    page = ModelRunner.page_bytes(CFG, 16, jnp.float32)
    eng = Engine(CFG, weights[0], engine_config=EngineConfig(
        max_slots=4, max_seq_len=256, page_size=16, kv_cache_bytes=4 * page))
    try:
        with pytest.raises(GeneratorError, match=r"needs 5 KV-cache pages of 16 tokens, more "
                                                 r"than the whole cache holds \(4 pages"):
            eng.submit(req([1] * 10, max_new_tokens=60))
        with pytest.raises(GeneratorError, match="max_seq_len=256"):
            eng.submit(req([1] * 10, max_new_tokens=250))
        out = eng.generate(req([1, 2] * 5, max_new_tokens=54, n=2, seed=3), timeout=120)
        assert [len(o.output_ids) for o in out] == [54, 54]  # 4 pages each, one after the other
    finally:
        eng.shutdown()
    with pytest.raises(GeneratorError, match="holds no KV-cache page"):
        Engine(CFG, weights[0], engine_config=EngineConfig(max_slots=4, max_seq_len=64,
                                                          kv_cache_bytes=100))
    with pytest.raises(GeneratorError, match="kv_cache_bytes must be >= 0"):
        EngineConfig(kv_cache_bytes=-1)
