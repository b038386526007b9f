"""The Pallas decode attention (rl_jax.generator.engine.kernels.pallas_decode) against XLA's
attention,
in Pallas' interpreter on CPU, in the runner and the engine, and its selection by backend."""

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.generator.engine import kernels
from rl_jax.generator.engine.decode import attend
from rl_jax.generator.engine.kernels import pallas_decode
from rl_jax.generator.engine.kv_cache import kv_bucket
from rl_jax.models.config import ModelConfig


def _inputs(rng, s, k, g, d, t, dtype):
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                 for shape in ((s, k, g, d), (s, k, d, t), (s, k, t, d)))


def _positions(rng, s, t, block):
    """Ragged positions: the first only, the cache's last and past it, around block edges,
    random."""
    edges = [0, t - 1, t, block - 1, block, block + 1, 2 * block + 3]
    return np.array([*(p % (t + 1) for p in edges), *rng.integers(0, t, s - len(edges))],
                    np.int32)


def _interpreted(block):
    return jax.jit(lambda *a: pallas_decode.decode_attention(*a, interpret=True, block=block))


# (query heads per kv head, head_dim, cache length, cache dtype, block): engine kv buckets
# (kv_bucket: 16, 64, 192, 384) and a cache of max_seq_len 100 (not a multiple of the block);
# small blocks make many loop steps and an overlapping last block.
CASES = [(1, 64, 16, jnp.float32, 64), (2, 128, 64, jnp.bfloat16, 16),
         (7, 64, 192, jnp.float32, 64), (7, 128, 100, jnp.bfloat16, 32),
         (2, 64, 384, jnp.float32, 128), (1, 128, 192, jnp.bfloat16, 64),
         (2, 64, 100, jnp.float32, 16)]


@pytest.mark.parametrize("g,d,t,dtype,block", CASES)
def test_kernel_matches_xla_attention(g, d, t, dtype, block):
    rng = np.random.default_rng(g * 1000 + d + t)
    s, k = 11, 2
    q, keys, values = _inputs(rng, s, k, g, d, t, dtype)
    positions = _positions(rng, s, t, block)
    got = _interpreted(block)(q, keys, values, positions)
    want = jax.jit(lambda *a: attend(*a, dtype=dtype))(q, keys, values, positions)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of weights and output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


def test_float32_compute_over_a_bfloat16_cache():
    """The cache in bf16, the computation in f32 (the runner's cache_dtype): as attend over the
    cache cast to f32."""
    rng = np.random.default_rng(5)
    q, keys, values = _inputs(rng, 9, 2, 2, 64, 64, jnp.bfloat16)
    q = q.astype(jnp.float32)
    positions = _positions(rng, 9, 64, 16)
    got = _interpreted(16)(q, keys, values, positions)
    want = attend(q, keys.astype(jnp.float32), values.astype(jnp.float32), positions,
                  dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_kernel_ignores_the_cache_past_each_position():
    """Keys and values after a slot's position do not change its output (not even NaN)."""
    rng = np.random.default_rng(0)
    q, keys, values = (np.array(x) for x in _inputs(rng, 4, 2, 2, 32, 64, jnp.float32))
    positions = np.array([3, 20, 40, 63], np.int32)
    fn = _interpreted(16)
    before = np.asarray(fn(q, keys, values, positions))
    for i, p in enumerate(positions):
        keys[i, :, :, p + 1:] = np.nan
        values[i, :, p + 1:] = np.nan
    np.testing.assert_array_equal(np.asarray(fn(q, keys, values, positions)), before)
    assert np.isfinite(before).all()


def test_bad_shapes_are_refused():
    q = jnp.zeros((4, 2, 2, 32))
    keys, values = jnp.zeros((4, 2, 32, 16)), jnp.zeros((4, 2, 16, 32))
    with pytest.raises(ValueError, match="keys .* and values .* do not match q"):
        pallas_decode.decode_attention(q, values, keys, jnp.zeros(4, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="positions"):
        pallas_decode.decode_attention(q, keys, values, jnp.zeros(3, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="block must be a power of two"):
        pallas_decode.decode_attention(q, keys, values, jnp.zeros(4, jnp.int32), interpret=True,
                                       block=48)


@pytest.mark.parametrize("g,d,t,dtype,cache_dtype", [
    (7, 128, 192, jnp.bfloat16, jnp.bfloat16), (1, 64, 16, jnp.float32, jnp.float32),
    (2, 64, 100, jnp.float32, jnp.bfloat16), (8, 128, 4096, jnp.bfloat16, jnp.bfloat16)])
def test_the_gpu_lowering_is_triton_ir(g, d, t, dtype, cache_dtype):
    """Lowered for CUDA on this machine (no GPU needed): Triton, not Mosaic GPU (whose copies
    this kernel's shapes do not suit), including a cache that is not a multiple of the block
    and float32 dots (at full precision)."""
    args = (jax.ShapeDtypeStruct((8, 2, g, d), dtype),
            jax.ShapeDtypeStruct((8, 2, d, t), cache_dtype),
            jax.ShapeDtypeStruct((8, 2, t, d), cache_dtype),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    lowered = jax.jit(lambda *a: pallas_decode.decode_attention(*a, platform="gpu")).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_the_decode_step_lowers_for_gpu_with_the_kernel():
    """The runner's whole decode step with the paged Pallas kernel lowers for CUDA: one Triton
    call per layer, and no copy of the pages into the contiguous form (no gather of the
    pools)."""
    from rl_jax.generator.engine.decode import decode
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.trainer.state import ModelSpec
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64)
    runner = ModelRunner(cfg, max_slots=16, max_seq_len=100, dtype=jnp.bfloat16,
                         attention="xla", page_size=16)
    weights = runner.prepare(ModelSpec(cfg, mesh=None).init_params(0))
    table = jax.ShapeDtypeStruct((16, runner.pages.width), jnp.int32)

    def lowered(attention):
        step = jax.jit(partial(decode, batch=16, filtered=True, cfg=cfg, dtype=jnp.bfloat16,
                               max_seq_len=100, attention=attention))
        return step.trace(weights, runner.k_cache, runner.v_cache, runner.state, table).lower(
            lowering_platforms=("cuda",)).as_text()

    text = lowered(partial(kernels.pallas_paged_decode_attention, platform="gpu"))
    assert text.count("__gpu$xla.gpu.triton") == 2
    pool_gathers = [line for line in lowered(None).splitlines()
                    if "stablehlo.gather" in line and "x16xbf16>" in line]
    assert pool_gathers  # XLA's attend_pages copies the pages: the pattern finds it
    assert not [line for line in text.splitlines()
                if "stablehlo.gather" in line and "x16xbf16>" in line]


CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32)


def test_engine_decodes_the_same_tokens_with_either_attention(caplog):
    """Greedy generations of a mixed batch (several lengths, so different positions per slot,
    across two kv buckets): the same tokens with the Pallas kernel and with XLA's attention."""
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.trainer.state import ModelSpec
    params = ModelSpec(CFG, mesh=None).init_params(3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (3, 9, 14, 5)]
    assert kv_bucket(14, 32) == 16 and kv_bucket(14 + 10, 32) == 32  # grows mid-generation
    outputs = {}
    for attention in ("pallas", "xla"):
        with caplog.at_level(logging.WARNING):
            engine = Engine(CFG, params, engine_config=EngineConfig(
                max_slots=8, max_seq_len=32, attention=attention, page_size=16))
        try:
            assert engine.attention_backend == attention
            futures = [engine.submit(GenerateRequest(p, SamplingParams(
                max_new_tokens=10, temperature=0.0, ignore_eos=True))) for p in prompts]
            outputs[attention] = [f.result(timeout=300) for f in futures]
        finally:
            engine.shutdown()
    assert "runs in Pallas' interpreter" in caplog.text
    for (pallas,), (xla,) in zip(outputs["pallas"], outputs["xla"]):
        assert len(pallas.output_ids) == 10
        assert pallas.output_ids == xla.output_ids
        np.testing.assert_allclose(pallas.output_logprobs, xla.output_logprobs, atol=1e-5)


def test_selection_by_backend():
    """auto on CPU never picks the interpreted kernel; pallas is refused on several devices;
    unknown names are refused; a kernel that does not compile is reported with its reason."""
    from jax.sharding import AxisType
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.generator.types import GeneratorError
    assert "pallas" in kernels.BACKENDS
    auto = ModelRunner(CFG, max_slots=8, max_seq_len=32)
    assert auto.attention_backend in ("native", "xla")
    assert auto.attention_backend == ("native" if kernels.decode_attention_available()
                                      else "xla")
    assert ModelRunner(CFG, max_slots=8, max_seq_len=32,
                       dtype=jnp.bfloat16).attention_backend == "xla"
    runner = ModelRunner(CFG, max_slots=8, max_seq_len=32, dtype=jnp.bfloat16,
                         attention="pallas", page_size=8)
    assert runner.attention_backend == "pallas" and not runner.native_attention
    # it reads each slot's pages up to its position: one decode program per batch, over the
    # whole table, where XLA's attention takes one per length bucket
    assert runner.decode_widths() == [runner.pages.width] == [4]
    assert len(ModelRunner(CFG, max_slots=8, max_seq_len=32, dtype=jnp.bfloat16,
                           attention="xla", page_size=8).decode_widths()) > 1
    mesh = jax.make_mesh((1, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(GeneratorError, match="pallas decode attention requested, but it runs "
                                             "on one device only"):
        ModelRunner(CFG, max_slots=8, max_seq_len=32, mesh=mesh, attention="pallas")
    with pytest.raises(GeneratorError, match="attention must be one of"):
        ModelRunner(CFG, max_slots=8, max_seq_len=32, attention="flash")
    # compiled (not interpreted) for CPU, Pallas has no lowering: a reason, not an exception
    problem = kernels.pallas_decode_attention_problem(
        kv_heads=2, group=2, head_dim=32, max_seq_len=64, dtype=jnp.float32,
        cache_dtype=jnp.float32, platform="cpu")
    assert problem is not None
    assert "does not compile for 2 query heads per key/value head of head_dim 32" in problem


# ---- the paged kernel ----------------------------------------------------------------------------

def _paged_inputs(rng, s, k, g, d, size, pages, width, dtype):
    """A query per slot, random page pools, and table rows naming pages in a shuffled order
    (shared by several slots, as a group's prompt pages are) with entries past the pool at the
    ends of some rows (a free slot's table)."""
    q = jnp.asarray(rng.standard_normal((s, k, g, d), np.float32), dtype)
    k_pool = jnp.asarray(rng.standard_normal((pages, k, d, size), np.float32), dtype)
    v_pool = jnp.asarray(rng.standard_normal((pages, k, size, d), np.float32), dtype)
    table = rng.permutation(np.resize(np.arange(pages), s * width)).reshape(s, width)
    table[1, width // 2:] = pages  # entries past the pool read as zeros
    return q, k_pool, v_pool, jnp.asarray(table, jnp.int32)


def _paged_positions(rng, s, size, width):
    edges = [0, size - 1, size, size + 1, width * size - 1, 2 * size - 1]
    return np.array([*(min(p, width * size - 1) for p in edges),
                     *rng.integers(0, width * size, s - len(edges))], np.int32)


# (query heads per kv head, head_dim, page size, pages per table row, cache dtype)
PAGED_CASES = [(1, 64, 16, 4, jnp.float32), (2, 128, 64, 3, jnp.bfloat16),
               (7, 64, 16, 12, jnp.float32), (8, 128, 32, 5, jnp.bfloat16),
               (2, 32, 5, 7, jnp.float32)]


@pytest.mark.parametrize("g,d,size,width,dtype", PAGED_CASES)
def test_paged_kernel_matches_xla_attention_over_the_pages(g, d, size, width, dtype):
    from rl_jax.generator.engine.decode import attend_pages
    rng = np.random.default_rng(g * 100 + d + size)
    s, k = 9, 2
    q, k_pool, v_pool, table = _paged_inputs(rng, s, k, g, d, size, 2 * width + 3, width, dtype)
    positions = _paged_positions(rng, s, size, width)
    got = jax.jit(lambda *a: pallas_decode.paged_decode_attention(*a, interpret=True))(
        q, k_pool, v_pool, table, positions)
    want = jax.jit(lambda *a: attend_pages(*a, dtype=dtype))(q, k_pool, v_pool, table,
                                                             positions)
    assert got.shape == want.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of weights and output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


def test_paged_kernel_reads_only_its_pages_up_to_its_position():
    """Values in other slots' pages, and in a slot's own pages past its position, do not change
    its output (not even NaN)."""
    rng = np.random.default_rng(4)
    size, width, pages = 16, 4, 12
    q, k_pool, v_pool, _ = _paged_inputs(rng, 3, 2, 2, 32, size, pages, width, jnp.float32)
    table = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], np.int32)
    positions = np.array([20, 47, 5], np.int32)
    fn = jax.jit(lambda *a: pallas_decode.paged_decode_attention(*a, interpret=True))
    before = np.asarray(fn(q, k_pool, v_pool, table, positions))
    k_pool, v_pool = np.array(k_pool), np.array(v_pool)
    for row, position in zip(table, positions):
        page, offset = row[position // size], position % size
        k_pool[page, :, :, offset + 1:] = np.nan
        v_pool[page, :, offset + 1:] = np.nan
        k_pool[row[position // size + 1:]] = np.nan
        v_pool[row[position // size + 1:]] = np.nan
    np.testing.assert_array_equal(np.asarray(fn(q, k_pool, v_pool, table, positions)), before)
    assert np.isfinite(before).all()


def test_paged_kernel_refuses_bad_shapes():
    q = jnp.zeros((4, 2, 2, 32))
    k_pool, v_pool = jnp.zeros((6, 2, 32, 16)), jnp.zeros((6, 2, 16, 32))
    table, positions = jnp.zeros((4, 3), jnp.int32), jnp.zeros(4, jnp.int32)
    run = partial(pallas_decode.paged_decode_attention, interpret=True)
    with pytest.raises(ValueError, match="k_pool .* and v_pool .* do not match q"):
        run(q, v_pool, k_pool, table, positions)
    with pytest.raises(ValueError, match=r"table \(3, 3\) must be \[4, W\]"):
        run(q, k_pool, v_pool, table[:3], positions)
    with pytest.raises(ValueError, match="positions"):
        run(q, k_pool, v_pool, table, positions[:3])


@pytest.mark.parametrize("g,d,size,pages,width,dtype", [
    (7, 128, 16, 1000, 7, jnp.bfloat16), (1, 64, 64, 40, 3, jnp.float32),
    (8, 128, 64, 4096, 64, jnp.bfloat16)])
def test_the_paged_gpu_lowering_is_triton_ir(g, d, size, pages, width, dtype):
    """Lowered for CUDA on this machine (no GPU needed), pools and table widths that are not
    powers of two included."""
    args = (jax.ShapeDtypeStruct((8, 2, g, d), dtype),
            jax.ShapeDtypeStruct((pages, 2, d, size), dtype),
            jax.ShapeDtypeStruct((pages, 2, size, d), dtype),
            jax.ShapeDtypeStruct((8, width), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32))
    lowered = jax.jit(lambda *a: pallas_decode.paged_decode_attention(*a, platform="gpu")).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
