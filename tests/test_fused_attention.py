"""The attention switch: which kernel each backend, dtype and shape gets, the splash kernel (in
Pallas' interpreter) against the XLA reference on packed rows with grouped-query heads, and the
model's "auto" default leaving the CPU path exactly as it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.models import fused_attention as fa
from rl_jax.models.config import ModelConfig
from rl_jax.models.fused_attention import attention_mask
from rl_jax.models.transformer import Transformer, decoder_layer, rotary_tables

FIT = dict(dtype=jnp.bfloat16, head_dim=128, q_len=512, kv_len=512, causal_self=True,
           has_segment_ids=True)


def select(requested="auto", backend="cpu", **overrides):
    return fa.select_implementation(requested, backend=backend, **{**FIT, **overrides})


# ---- selection ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, expected", [
    ("cpu", "xla"), ("cuda", "cudnn"), ("tpu", "splash"), ("gpu", "xla")])
def test_auto_picks_the_backends_fused_kernel(backend, expected):
    assert select(backend=backend) == expected


@pytest.mark.parametrize("overrides", [
    dict(dtype=jnp.float32), dict(head_dim=256), dict(head_dim=100), dict(q_len=511, kv_len=511),
    dict(causal_self=False)])
def test_auto_on_cuda_falls_back_to_xla_when_cudnn_cannot_take_the_inputs(overrides):
    assert select(backend="cuda", **overrides) == "xla"
    with pytest.raises(ValueError, match="attention='cudnn' cannot run"):
        select("cudnn", backend="cuda", **overrides)


def test_cudnn_takes_prefix_masks_and_float16():
    assert select(backend="cuda", has_segment_ids=False) == "cudnn"
    assert select(backend="cuda", dtype=jnp.float16, head_dim=64) == "cudnn"


@pytest.mark.parametrize("overrides", [
    dict(has_segment_ids=False), dict(q_len=320, kv_len=320), dict(num_devices=4),
    dict(causal_self=False)])
def test_auto_on_tpu_falls_back_to_xla_when_splash_cannot_take_the_inputs(overrides):
    assert select(backend="tpu", **overrides) == "xla"
    with pytest.raises(ValueError, match="attention='splash' cannot run"):
        select("splash", backend="tpu", **overrides)


def test_splash_takes_float32_on_tpu():
    assert select(backend="tpu", dtype=jnp.float32) == "splash"


@pytest.mark.parametrize("backend", ["cpu", "cuda", "tpu"])
def test_xla_is_always_xla(backend):
    assert select("xla", backend=backend, dtype=jnp.float32, causal_self=False) == "xla"


def test_named_kernels_on_the_wrong_backend_raise():
    with pytest.raises(ValueError, match="needs an NVIDIA GPU.*'cpu'"):
        select("cudnn", backend="cpu")
    with pytest.raises(ValueError, match="needs a TPU.*'cuda'"):
        select("splash", backend="cuda")


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="'flash'"):
        select("flash")
    with pytest.raises(ValueError, match="'flash'"):
        Transformer(tiny_config(), rngs=nnx.Rngs(0), attention="flash")


def test_the_current_backend_here_is_the_cpu():
    assert fa.current_backend() == "cpu"


# ---- splash kernel (interpreted) against the reference -----------------------------------------

def reference(q, k, v, segment_ids, prefix_ids=None):
    b, t = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention_mask(index, segment_ids, index, segment_ids, prefix_ids)
    return fa.xla_attention(q, k, v, mask)


def test_packed_example_has_several_segments_and_padding_per_row():
    *_, segment_ids = fa.packed_example(batch=2, length=256, heads=4, kv_heads=2, head_dim=64)
    ids = np.asarray(segment_ids)
    for row in ids:
        assert len(set(row[row > 0])) >= 3 and row[-1] == 0
        assert np.all(np.diff(row[row > 0]) >= 0)


def test_splash_matches_reference_on_packed_rows_with_grouped_heads():
    q, k, v, segment_ids = fa.packed_example(batch=2, length=256, heads=4, kv_heads=2,
                                             head_dim=64, dtype=jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent)

    def splash(q, k, v):
        return fa.splash_attention(q, k, v, segment_ids, interpret=True)

    def ref(q, k, v):
        return reference(q, k, v, segment_ids)

    np.testing.assert_allclose(jax.jit(splash)(q, k, v), ref(q, k, v), atol=2e-5, rtol=2e-5)
    got = jax.jit(jax.grad(loss(splash), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=2e-4, err_msg=f"d{name}")


def test_splash_is_not_the_unsegmented_attention():
    """The comparison above can fail: without segment ids the kernel's output differs."""
    q, k, v, segment_ids = fa.packed_example(batch=1, length=256, heads=2, kv_heads=1,
                                             head_dim=64, dtype=jnp.float32)
    one_segment = jnp.ones_like(segment_ids)
    out = fa.splash_attention(q, k, v, one_segment, interpret=True)
    np.testing.assert_allclose(out, reference(q, k, v, one_segment), atol=2e-5, rtol=2e-5)
    assert float(jnp.max(jnp.abs(out - reference(q, k, v, segment_ids)))) > 0.1


# ---- the model  ----------------------------------------------------------------------------------

def tiny_config():
    return ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def test_auto_model_on_cpu_is_exactly_the_xla_model():
    cfg = tiny_config()
    *_, segment_ids = fa.packed_example(batch=2, length=64, heads=4, kv_heads=2, head_dim=16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, segment_ids.shape), jnp.int32)
    prefix = jnp.where(segment_ids > 1, 1, 0)
    outs = {}
    for impl in ("auto", "xla"):
        model = Transformer(cfg, rngs=nnx.Rngs(0), attention=impl)
        assert model.attention == impl
        outs[impl] = [model(tokens, segment_ids=segment_ids),
                      model(tokens, segment_ids=segment_ids, prefix_ids=prefix)]
    for auto, xla in zip(outs["auto"], outs["xla"]):
        np.testing.assert_array_equal(auto, xla)
    assert float(jnp.max(jnp.abs(outs["auto"][0] - outs["auto"][1]))) > 0


def test_decoder_layer_with_splash_matches_xla(monkeypatch):
    """A layer's attention through the splash kernel equals XLA's: the backend is taken for a TPU
    and the kernel runs in Pallas' interpreter."""
    cfg = tiny_config()
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    weights = jax.tree.map(lambda x: x[0], model.layers.weights())
    *_, segment_ids = fa.packed_example(batch=2, length=128, heads=4, kv_heads=2, head_dim=16)
    b, t = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = attention_mask(index, segment_ids, index, segment_ids)
    h = jnp.asarray(np.random.default_rng(2).normal(size=(b, t, cfg.hidden_size)), jnp.float32)
    cos, sin = rotary_tables(index, cfg.head_dim, cfg.rope_theta)
    common = dict(cos=cos, sin=sin, mask=mask, dtype=jnp.float32)
    want, _ = decoder_layer(h, weights, cfg, **common)
    calls = []

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return SPLASH(*args, **kwargs, interpret=True)

    monkeypatch.setattr(fa, "current_backend", lambda: "tpu")
    monkeypatch.setattr(fa, "splash_attention", interpreted)
    got, _ = decoder_layer(h, weights, cfg, attention_impl="auto", segment_ids=segment_ids,
                           **common)
    assert calls == [(b, t, cfg.num_heads, cfg.head_dim)]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # With a cache the layer attends over it on XLA, and a named fused kernel refuses.
    with pytest.raises(ValueError, match="only for causal self-attention"):
        cache = (jnp.zeros((b, t, 2, 16)), jnp.zeros((b, t, 2, 16)), jnp.zeros((b,), jnp.int32))
        decoder_layer(h, weights, cfg, attention_impl="splash", cache=cache, **common)


SPLASH = fa.splash_attention


def test_check_fused_attention_on_cpu_reports_xla():
    result = fa.check_fused_attention(jnp.float32, batch=1, length=128, heads=2, kv_heads=1,
                                      head_dim=32)
    assert result["implementation"] == "xla" and result["backend"] == "cpu"
    assert result["max_abs_error"] == 0.0 and result["matched"]
    assert result["xla_vs_f32"] == 0.0
    with pytest.raises(ValueError, match="attention='cudnn' cannot run"):
        fa.check_fused_attention(jnp.bfloat16, implementation="cudnn", batch=1, length=128,
                                 heads=2, kv_heads=1, head_dim=32)
