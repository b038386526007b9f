"""The generator's prompt attention through the trainer's fused kernels: the splash kernel (run
in Pallas' interpreter, the backend taken for a TPU) against XLA's attention in the prefill and
in the engine's generations, per-bucket fallback to XLA, the selection by backend, dtype and
devices with its start-up compile probe, and the errors a named kernel gives where it cannot run.
cuDNN's kernel needs a GPU to lower: its selection and fallback are checked here, its numbers by
``benchmarks/accelerator_check.py`` on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.decode import prefill
from rl_jax.generator.engine.runner import ModelRunner
from rl_jax.generator.server.config import ServerConfig, check_server_config, resolve_auto
from rl_jax.generator.types import GenerateRequest, GeneratorError, SamplingParams
from rl_jax.models import fused_attention as fa
from rl_jax.models.config import ConfigError, ModelConfig
from rl_jax.trainer.state import ModelSpec

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
SPLASH = fa.splash_attention


@pytest.fixture
def on_tpu(monkeypatch):
    """The backend taken for a TPU, the splash kernel interpreted; the calls it gets."""
    calls = []

    def interpreted(q, k, v, segment_ids):
        calls.append(q.shape)
        return SPLASH(q, k, v, segment_ids, interpret=True)

    monkeypatch.setattr(fa, "current_backend", lambda: "tpu")
    monkeypatch.setattr(fa, "splash_attention", interpreted)
    return calls


def _prompts(p, lengths, seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), p), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(1, CFG.vocab_size, n)
    return jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)


@pytest.fixture(scope="module")
def params():
    return ModelSpec(CFG, mesh=None).init_params(3)


def test_prefill_through_splash_matches_xla(params, on_tpu):
    """Ragged prompts in a 128-token bucket: the same keys and values at every prompt position
    and the same next-token logits, with the kernel called once per layer scan."""
    tokens, lengths = _prompts(128, [100, 37, 128, 1])
    common = dict(cfg=CFG, dtype=jnp.float32)
    k_ref, v_ref, logits_ref = jax.jit(lambda *a: prefill(*a, **common))(
        params, tokens, lengths)
    k, v, logits = jax.jit(lambda *a: prefill(*a, attention_impl="auto", **common))(
        params, tokens, lengths)
    assert on_tpu == [(4, 128, CFG.num_heads, CFG.head_dim)]
    for row, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(k[:, row, :n], k_ref[:, row, :n], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(v[:, row, :n], v_ref[:, row, :n], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(logits, logits_ref, atol=2e-5, rtol=2e-5)
    # the kernel is not a no-op: attention over the whole row (one segment) differs
    k_all, _, logits_all = jax.jit(lambda *a: prefill(*a, attention_impl="auto", **common))(
        params, tokens, jnp.full_like(lengths, 128))
    assert float(jnp.max(jnp.abs(logits_all - logits_ref))) > 1e-3


def test_short_buckets_run_on_xla_under_auto(params, on_tpu):
    """A bucket splash cannot take (64 tokens) runs XLA's attention, bit for bit."""
    tokens, lengths = _prompts(64, [60, 5])
    common = dict(cfg=CFG, dtype=jnp.float32)
    ref = jax.jit(lambda *a: prefill(*a, **common))(params, tokens, lengths)
    got = jax.jit(lambda *a: prefill(*a, attention_impl="auto", **common))(
        params, tokens, lengths)
    assert on_tpu == []
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_engine_generates_the_same_tokens_with_splash_prefill(params, on_tpu):
    """Greedy generations of prompts prefilled in 128-token buckets: the same tokens and
    log-probabilities with the splash prompt attention as with XLA's."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (90, 17, 128)]
    outputs = {}
    for prefill_attention in ("splash", "xla"):
        engine = Engine(CFG, params, engine_config=EngineConfig(
            max_slots=4, max_seq_len=144, min_prefill_bucket=128, page_size=16,
            prefill_attention=prefill_attention))
        try:
            assert engine.prefill_attention_backend == prefill_attention
            futures = [engine.submit(GenerateRequest(p, SamplingParams(
                max_new_tokens=12, temperature=0.0, ignore_eos=True))) for p in prompts]
            outputs[prefill_attention] = [f.result(timeout=300) for f in futures]
        finally:
            engine.shutdown()
    assert on_tpu  # the splash engine's prefill ran the kernel
    for (splash,), (xla,) in zip(outputs["splash"], outputs["xla"]):
        assert len(splash.output_ids) == 12
        assert splash.output_ids == xla.output_ids
        np.testing.assert_allclose(splash.output_logprobs, xla.output_logprobs, atol=1e-4)


def test_selection_by_backend_dtype_and_devices(monkeypatch, caplog):
    def runner(**kw):
        return ModelRunner(CFG, max_slots=2, max_seq_len=32, **kw).prefill_attention_backend

    assert runner() == "xla"  # CPU: no fused prompt kernel
    with pytest.raises(GeneratorError, match="prefill attention: attention='cudnn' cannot run: "
                                             "cuDNN flash attention needs an NVIDIA GPU"):
        runner(prefill_attention="cudnn")
    with pytest.raises(GeneratorError, match="attention must be one of .*'flash'"):
        runner(prefill_attention="flash")
    # Taken for a GPU, cuDNN is chosen, and compiled once at start: here (no cuDNN) that fails,
    # so auto falls back to XLA saying why, and the named kernel is an error naming why.
    monkeypatch.setattr(fa, "current_backend", lambda: "cuda")
    with caplog.at_level("WARNING"):
        assert runner(dtype=jnp.bfloat16) == "xla"
    assert "cudnn prefill attention does not compile here, using XLA's" in caplog.text
    with pytest.raises(GeneratorError, match="prefill attention 'cudnn' does not compile here"):
        runner(dtype=jnp.bfloat16, prefill_attention="cudnn")
    monkeypatch.setattr(fa, "compile_problem", lambda *a, **k: None)  # as on a GPU
    assert runner(dtype=jnp.bfloat16) == "cudnn"
    assert runner(dtype=jnp.bfloat16, prefill_attention="xla") == "xla"
    assert runner() == "xla"  # float32: cuDNN takes bfloat16/float16 only
    with pytest.raises(GeneratorError, match="needs bfloat16 or float16, got float32"):
        runner(prefill_attention="cudnn")
    monkeypatch.setattr(fa, "current_backend", lambda: "tpu")
    assert runner() == "splash"
    mesh = jax.make_mesh((1, 2), ("data", "tensor"))
    assert runner(mesh=mesh) == "xla"  # the kernel is not partitioned over a mesh
    with pytest.raises(GeneratorError, match="runs on one device here, the mesh has 2"):
        runner(mesh=mesh, prefill_attention="splash")


def test_configs_refuse_unknown_kernels_by_name():
    with pytest.raises(GeneratorError, match="prefill_attention must be one of .*'flash'"):
        EngineConfig(prefill_attention="flash")
    with pytest.raises(ConfigError, match="prefill_attention_backend must be one of .*'fa3'"):
        check_server_config(resolve_auto(ServerConfig(model="m", prefill_attention_backend="fa3"),
                                         backend="cpu"))
