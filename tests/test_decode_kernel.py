"""The native decode attention kernels (rl_jax.generator.engine.kernels), over a contiguous and over
a
paged cache, against XLA's attention and each other, in the runner and the engine (a 1k-token
completion through a budgeted page pool), and their fallbacks."""

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rl_jax import native
from rl_jax.generator.engine import kernels
from rl_jax.models.config import ModelConfig

# Only a machine without a C++ compiler skips these; where one exists, a kernel that fails to
# build makes them fail.
pytestmark = pytest.mark.skipif(native.compiler("c++") is None,
                                reason="no C++ compiler for the native kernel")


def _inputs(rng, s, k, g, d, t):
    return (rng.standard_normal((s, k, g, d), np.float32),
            rng.standard_normal((s, k, d, t), np.float32),
            rng.standard_normal((s, k, t, d), np.float32))


# (query heads per kv head, head_dim): compiled specialisations (D of 32/64/128, G of 1/2/4/8)
# and the generic path (other shapes).
@pytest.mark.parametrize("g,d", [(1, 64), (2, 32), (4, 128), (8, 32), (2, 24), (3, 16),
                                 (2, 8)])
@pytest.mark.parametrize("t", [16, 40, 192])
def test_kernel_matches_xla_attention(g, d, t):
    import jax
    import jax.numpy as jnp
    from rl_jax.generator.engine.decode import attend
    rng = np.random.default_rng(g * 1000 + d + t)
    s, k = 13, 3
    q, keys, values = _inputs(rng, s, k, g, d, t)
    # every position from none-but-the-first to the whole cache, and past it
    positions = np.array([0, 1, t - 1, t, t + 7, 5 % t, 15 % t, 16 % t, 17 % t,
                          *rng.integers(0, t, s - 9)], np.int32)
    got = jax.jit(kernels.decode_attention)(q, keys, values, positions)
    want = jax.jit(lambda *a: attend(*a, dtype=jnp.float32))(q, keys, values, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_kernel_ignores_the_cache_past_each_position():
    """Keys and values after a slot's position do not change its output (not even NaN)."""
    import jax
    rng = np.random.default_rng(0)
    q, keys, values = _inputs(rng, 4, 2, 2, 32, 64)
    positions = np.array([3, 20, 40, 63], np.int32)
    fn = jax.jit(kernels.decode_attention)
    before = np.asarray(fn(q, keys, values, positions))
    for i, p in enumerate(positions):
        keys[i, :, :, p + 1:] = np.nan
        values[i, :, p + 1:] = np.nan
    np.testing.assert_array_equal(np.asarray(fn(q, keys, values, positions)), before)


def _paged(rng, keys, values, page_size, spare=5):
    """``keys [S, K, D, T]`` and ``values [S, K, T, D]`` scattered over shuffled pages of
    ``page_size`` positions (``T`` padded to whole pages with NaN), among ``spare`` unused
    pages of NaN: ``(k_pages [N, K, D, P], v_pages [N, K, P, D], table [S, W])``."""
    s, k, d, t = keys.shape
    w = -(-t // page_size)
    pad = w * page_size - t
    keys = np.pad(keys, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=np.nan)
    values = np.pad(values, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=np.nan)
    n = s * w + spare
    order = rng.permutation(n)
    table = order[:s * w].reshape(s, w).astype(np.int32)
    k_pages = np.full((n, k, d, page_size), np.nan, np.float32)
    v_pages = np.full((n, k, page_size, d), np.nan, np.float32)
    for i in range(s):
        for j in range(w):
            k_pages[table[i, j]] = keys[i, :, :, j * page_size:(j + 1) * page_size]
            v_pages[table[i, j]] = values[i, :, j * page_size:(j + 1) * page_size]
    return k_pages, v_pages, table


@pytest.mark.parametrize("g,d", [(1, 64), (2, 32), (4, 128), (8, 32), (2, 24), (3, 16)])
@pytest.mark.parametrize("page_size", [16, 64, 5])
def test_paged_kernel_equals_the_contiguous_kernel(g, d, page_size):
    """The same keys and values, contiguous or on shuffled pages (with NaN in every position
    past a slot's own): bit for bit the same attention, and XLA's over the gathered pages."""
    import jax
    import jax.numpy as jnp
    from rl_jax.generator.engine.decode import attend_pages
    rng = np.random.default_rng(g * 100 + d + page_size)
    s, k, t = 11, 3, 150
    q, keys, values = _inputs(rng, s, k, g, d, t)
    positions = np.array([0, 1, page_size - 1, page_size, page_size + 1, t - 1, t - 2,
                          *rng.integers(0, t, s - 7)], np.int32)
    for i, p in enumerate(positions):  # nothing past a slot's position may be read
        keys[i, :, :, p + 1:] = np.nan
        values[i, :, p + 1:] = np.nan
    k_pages, v_pages, table = _paged(rng, keys, values, page_size)
    live = np.nan_to_num(keys), np.nan_to_num(values)
    want = np.asarray(jax.jit(kernels.decode_attention)(q, *live, positions))
    got = np.asarray(jax.jit(kernels.paged_decode_attention)(q, k_pages, v_pages, table,
                                                              positions))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
    xla = jax.jit(lambda *a: attend_pages(*a, dtype=jnp.float32))(
        q, np.nan_to_num(k_pages), np.nan_to_num(v_pages), table, positions)
    np.testing.assert_allclose(np.asarray(xla), want, atol=1e-5, rtol=1e-5)


def test_paged_kernel_gives_zeros_for_a_slot_without_its_pages():
    """A slot whose attended positions name a page outside the pool (a free slot's table row)
    gets zeros; the other slots are unaffected."""
    import jax
    rng = np.random.default_rng(3)
    q, keys, values = _inputs(rng, 3, 2, 2, 32, 40)
    k_pages, v_pages, table = _paged(rng, keys, values, 16)
    positions = np.array([39, 39, 20], np.int32)
    fn = jax.jit(kernels.paged_decode_attention)
    before = np.asarray(fn(q, k_pages, v_pages, table, positions))
    table[1, 1] = len(k_pages)  # past the pool
    table[2, 2] = -1  # not attended: position 20 lies in page 1
    after = np.asarray(fn(q, k_pages, v_pages, table, positions))
    np.testing.assert_array_equal(after[1], 0)
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])


def test_kernel_on_two_devices_at_once_does_not_deadlock():
    """Programs with several kernel calls, dispatched to two host devices before either is
    awaited (as data-parallel replicas do), share XLA's thread pool: none waits forever for a
    helper task that cannot start."""
    import jax
    rng = np.random.default_rng(1)

    def four_calls(q, keys, values, positions):
        return [kernels.decode_attention(q[i::4], keys[i::4], values[i::4], positions[i::4])
                for i in range(4)]

    fn = jax.jit(four_calls)
    per_device = []
    for device in jax.devices()[:2]:  # each call large enough to be split over threads
        q, keys, values = _inputs(rng, 256, 4, 2, 32, 128)
        positions = rng.integers(0, 128, 256).astype(np.int32)
        per_device.append([jax.device_put(x, device) for x in (q, keys, values, positions)])
    for _ in range(100):
        out = [fn(*args) for args in per_device]
        jax.block_until_ready(out)


CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32)


def test_engine_samples_the_same_with_either_attention():
    """Seeded generations of a mixed batch (several lengths, so different positions per slot):
    the same tokens with the native kernel and with XLA's attention, log-probs within 1e-5."""
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.trainer.state import ModelSpec
    params = ModelSpec(CFG, mesh=None).init_params(3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (3, 9, 17, 30, 5, 12)]
    outputs = {}
    for attention in ("native", "xla"):
        engine = Engine(CFG, params, engine_config=EngineConfig(
            max_slots=8, max_seq_len=96, attention=attention))
        try:
            assert engine.attention_backend == attention
            futures = [engine.submit(GenerateRequest(p, SamplingParams(
                max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=7 + i)))
                for i, p in enumerate(prompts)]
            outputs[attention] = [f.result(timeout=300) for f in futures]
        finally:
            engine.shutdown()
    for (by_native,), (by_xla,) in zip(outputs["native"], outputs["xla"]):
        assert len(by_native.output_ids) == 40
        assert by_native.output_ids == by_xla.output_ids
        np.testing.assert_allclose(by_native.output_logprobs, by_xla.output_logprobs, atol=1e-5)


def test_native_attention_refused_where_it_cannot_run():
    import jax.numpy as jnp
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.generator.types import GeneratorError
    with pytest.raises(GeneratorError, match="float32"):
        ModelRunner(CFG, max_slots=8, max_seq_len=32, dtype=jnp.bfloat16, attention="native")
    with pytest.raises(GeneratorError, match="attention must be one of"):
        ModelRunner(CFG, max_slots=8, max_seq_len=32, attention="flash")
    assert not ModelRunner(CFG, max_slots=8, max_seq_len=32, dtype=jnp.bfloat16).native_attention
    assert ModelRunner(CFG, max_slots=8, max_seq_len=32).native_attention
    # heads without a specialisation: XLA's attention unless the kernel is asked for
    odd = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=24)
    assert not ModelRunner(odd, max_slots=8, max_seq_len=32).native_attention
    assert ModelRunner(odd, max_slots=8, max_seq_len=32, attention="native").native_attention


def test_without_a_compiler_the_engine_falls_back_to_xla(tmp_path):
    """No compiler (and nothing cached): a warning naming the reason, XLA's attention."""
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from rl_jax.generator.engine import kernels
        print("available", kernels.decode_attention_available())
    """)
    env = {"PATH": str(tmp_path), "CXX": "", "RL_JAX_KERNEL_CACHE": str(tmp_path / "cache"),
           "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "available False" in result.stdout
    assert "no C++ compiler found" in result.stdout


def test_a_failing_build_is_reported_and_falls_back(tmp_path, monkeypatch, caplog):
    """A compiler that fails: the reason is logged, and the kernel is not used."""
    compiler = tmp_path / "broken-cxx"
    compiler.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("RL_JAX_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not kernels.decode_attention_available()
    assert "broken compiler" in caplog.text


def test_a_long_completion_through_a_budgeted_page_pool():
    """Completions of 1,200 tokens (two samples of one prompt, which share its full page, and a
    third request) through a pool of 48 pages of 64 tokens, too few for all three at once:
    every token's log-prob is the trainer's (float32), and every page comes back."""
    import jax.numpy as jnp
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.trainer.state import ModelSpec
    spec = ModelSpec(CFG, mesh=None)
    params = spec.init_params(5)
    page = ModelRunner.page_bytes(CFG, 64, jnp.float32)
    engine = Engine(CFG, params, engine_config=EngineConfig(
        max_slots=8, max_seq_len=2048, kv_cache_bytes=48 * page, attention="native"))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, CFG.vocab_size, 100).tolist(),
               rng.integers(1, CFG.vocab_size, 30).tolist()]
    try:
        assert engine.attention_backend == "native" and engine.cache_usage()["pages"] == 48
        pair = engine.submit(GenerateRequest(prompts[0], SamplingParams(
            max_new_tokens=1200, temperature=1.0, ignore_eos=True, seed=1, n=2)))
        third = engine.submit(GenerateRequest(prompts[1], SamplingParams(
            max_new_tokens=1200, temperature=1.0, ignore_eos=True, seed=2)))
        outs = [(prompts[0], o) for o in pair.result(timeout=600)]
        outs += [(prompts[1], o) for o in third.result(timeout=600)]
        usage = engine.cache_usage()
        assert usage["free_pages"] == usage["pages"]
    finally:
        engine.shutdown()
    model = spec.merge(params)
    for prompt, out in outs:
        assert len(out.output_ids) == 1200
        tokens = jnp.asarray([prompt + out.output_ids[:-1]])
        targets = jnp.asarray([prompt[1:] + out.output_ids])
        lp, _ = model.token_logprobs(tokens, targets)
        np.testing.assert_allclose(out.output_logprobs,
                                   np.asarray(lp[0, len(prompt) - 1:]), atol=1e-4)
