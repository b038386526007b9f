"""The model layer on one device: blockwise log-probs, packing, padding, bf16, remat, unrolled
layers, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.models.build import abstract_model, create_model, iter_params
from rl_jax.models.config import ConfigError, ModelConfig
from rl_jax.models.logprobs import blockwise_token_logprobs, full_token_logprobs

# Every optional feature on (biases, output bias, q/k norms), grouped-query attention, a
# vocabulary that is not a power of two.
CONFIG = ModelConfig(vocab_size=83, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                     output_bias=True, qk_norm=True, rms_norm_eps=1e-6)


def random_model(config: ModelConfig = CONFIG, seed: int = 0, **kwargs) -> nnx.Module:
    """A model whose parameters are drawn with numpy (no PRNG kernels to compile).

    The initial parameters of :func:`create_model` (unit norms, zero biases, 0.02-scale weights)
    give near-uniform predictions; these make every parameter matter and spread logits over
    several nats. The values depend only on ``config`` and ``seed``, not on ``kwargs`` (dtypes,
    remat), so models built with different ``kwargs`` are comparable.
    """
    graphdef, state = nnx.split(abstract_model(config, **kwargs))
    rng = np.random.default_rng(seed)

    def draw(path, var):
        name = str(path[-1])
        noise = rng.standard_normal(var.shape).astype(np.float32)
        if "norm" in name:
            value = 1.0 + 0.2 * noise
        elif name.startswith("b"):
            value = 0.2 * noise
        elif name in ("embed", "lm_head"):
            value = 0.5 * noise
        else:
            value = noise / np.sqrt(config.hidden_size)
        return var.replace(jnp.asarray(value, var.dtype))

    return nnx.merge(graphdef, nnx.map_state(draw, state))


def random_tokens(shape, seed, vocab=CONFIG.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@nnx.jit(static_argnames=("block_size",))
def token_logprobs(model, tokens, targets, positions=None, segment_ids=None, block_size=32):
    return model.token_logprobs(tokens, targets, positions, segment_ids,
                                block_size=block_size)[0]


# ---- blockwise log-probs ------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, block_size", [(50, 16), (50, 7), (50, 50), (50, 64), (48, 16)])
def test_blockwise_equals_full(vocab, block_size):
    rng = np.random.default_rng(vocab * 100 + block_size)
    hidden = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    unembed = jnp.asarray(0.6 * rng.standard_normal((16, vocab)), jnp.float32)
    targets = rng.integers(0, vocab, (3, 5))
    # Targets in the last (partial) block and at both ends of the vocabulary.
    targets[0, :3] = [0, vocab - 1, vocab - 2]
    targets = jnp.asarray(targets)
    weight_lp = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    weight_ent = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)

    def objective(fn, hidden, unembed):
        lp, ent = fn(hidden, unembed, targets, return_entropy=True)
        return jnp.sum(weight_lp * lp + weight_ent * ent), (lp, ent)

    blockwise = lambda h, w, t, **kw: blockwise_token_logprobs(h, w, t, block_size=block_size,
                                                               **kw)
    grad = lambda fn: jax.jit(jax.grad(lambda h, w: objective(fn, h, w), argnums=(0, 1),
                                       has_aux=True))(hidden, unembed)
    (g_h, g_w), (lp, ent) = grad(blockwise)
    (ref_g_h, ref_g_w), (ref_lp, ref_ent) = grad(full_token_logprobs)

    assert lp.shape == ent.shape == (3, 5) and lp.dtype == ent.dtype == jnp.float32
    # The test is meaningful only if predictions are far from uniform.
    assert float(jnp.std(ref_lp)) > 1.0 and float(jnp.min(ref_ent)) < 0.9 * np.log(vocab)
    np.testing.assert_allclose(lp, ref_lp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=1e-5)
    np.testing.assert_allclose(g_h, ref_g_h, rtol=0, atol=1e-5)
    np.testing.assert_allclose(g_w, ref_g_w, rtol=0, atol=1e-5)


def test_blockwise_without_entropy_returns_none():
    hidden = jnp.ones((2, 4))
    lp, ent = blockwise_token_logprobs(hidden, jnp.eye(4, 6), jnp.array([1, 5]), block_size=4)
    assert ent is None
    np.testing.assert_allclose(lp, full_token_logprobs(hidden, jnp.eye(4, 6), jnp.array([1, 5]))[0],
                               rtol=0, atol=1e-6)


def test_blockwise_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="does not match"):
        blockwise_token_logprobs(jnp.ones((2, 3, 8)), jnp.ones((8, 10)), jnp.zeros((2, 4), int))
    with pytest.raises(ValueError, match="does not match"):
        blockwise_token_logprobs(jnp.ones((2, 8)), jnp.ones((6, 10)), jnp.zeros((2,), int))


def test_model_token_logprobs_match_full_logits():
    model = random_model()
    tokens = random_tokens((2, 9), seed=3)
    targets = jnp.roll(tokens, -1, axis=1)
    lp = token_logprobs(model, tokens, targets, block_size=20)
    logits = nnx.jit(lambda m, t: m.logits(m(t)))(model, tokens)
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-5)


# ---- packing and padding ------------------------------------------------------------------------

def test_packed_sequences_match_separate_runs():
    model = random_model()
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, CONFIG.vocab_size, 6), rng.integers(0, CONFIG.vocab_size, 9)

    def alone(seq):
        tokens = jnp.asarray(seq[None, :-1])
        return np.asarray(token_logprobs(model, tokens, jnp.asarray(seq[None, 1:])))[0]

    tokens = np.concatenate([first[:-1], second[:-1]])[None]
    targets = np.concatenate([first[1:], second[1:]])[None]
    segment_ids = np.array([[1] * 5 + [2] * 8])
    positions = np.array([list(range(5)) + list(range(8))])
    packed = np.asarray(token_logprobs(model, jnp.asarray(tokens), jnp.asarray(targets),
                                       jnp.asarray(positions), jnp.asarray(segment_ids)))[0]
    np.testing.assert_allclose(packed[:5], alone(first), rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed[5:], alone(second), rtol=0, atol=1e-5)

    # Without segment ids the second sequence would see the first: the mask matters.
    leaky = np.asarray(token_logprobs(model, jnp.asarray(tokens), jnp.asarray(targets),
                                      jnp.asarray(positions)))[0]
    assert np.max(np.abs(leaky[5:] - packed[5:])) > 1e-2


def padded_batch(seed: int = 1, length: int = 8, pad: int = 5):
    """One sequence of ``length`` tokens as two rows, right- and left-padded by ``pad`` tokens of
    segment 0 at position 0. Returns ``(sequence, (tokens, targets, positions, segment_ids))``."""
    seq = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, length)
    n = length - 1
    tokens, targets, positions, segment_ids = (np.zeros((2, n + pad), np.int32) for _ in range(4))
    for row, start in ((0, 0), (1, pad)):
        tokens[row, start:start + n] = seq[:-1]
        targets[row, start:start + n] = seq[1:]
        positions[row, start:start + n] = np.arange(n)
        segment_ids[row, start:start + n] = 1
    return seq, tuple(map(jnp.asarray, (tokens, targets, positions, segment_ids)))


@nnx.jit
def masked_loss_and_grads(model, tokens, targets, positions, segment_ids):
    """Mean negative log-prob over tokens of non-zero segments, and its parameter gradients."""
    mask = (segment_ids > 0).astype(jnp.float32)

    def loss(model):
        lp = model.token_logprobs(tokens, targets, positions, segment_ids, block_size=32)[0]
        return -jnp.sum(lp * mask) / jnp.sum(mask)

    return nnx.value_and_grad(loss)(model)


def test_padding_segment_is_finite_and_does_not_leak():
    model = random_model()
    seq, batch = padded_batch()
    n, pad = len(seq) - 1, batch[0].shape[1] - len(seq) + 1
    lp = np.asarray(token_logprobs(model, *batch))
    alone = np.asarray(token_logprobs(model, jnp.asarray(seq[None, :-1]),
                                      jnp.asarray(seq[None, 1:])))[0]
    assert np.all(np.isfinite(lp))
    np.testing.assert_allclose(lp[0, :n], alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(lp[1, pad:], alone, rtol=0, atol=1e-5)

    loss, grads = masked_loss_and_grads(model, *batch)
    np.testing.assert_allclose(loss, -np.mean(alone), rtol=1e-6)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))

    # A row that is padding only.
    zeros = jnp.zeros((1, 6), jnp.int32)
    assert np.all(np.isfinite(token_logprobs(model, zeros, zeros, zeros, zeros)))


# ---- numerics -----------------------------------------------------------------------------------

def test_bfloat16_forward_is_close_to_float32():
    tokens = random_tokens((2, 16), seed=5)
    targets = jnp.roll(tokens, -1, axis=1)
    f32 = random_model()
    ref = np.asarray(token_logprobs(f32, tokens, targets))
    # bf16 computation on f32 parameters, and bf16 parameters too (the same values, rounded).
    bf16_compute = random_model(dtype=jnp.bfloat16)
    bf16_params = random_model(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert bf16_params.layers.wq[...].dtype == jnp.bfloat16
    assert nnx.eval_shape(lambda m: m(tokens), bf16_params).dtype == jnp.bfloat16

    # Tolerance: bf16 keeps 8 significant bits (relative rounding up to 2^-9 ≈ 0.2%); logits
    # here reach ~10 in magnitude, so each rounding moves them by up to ~0.02 nats, compounded
    # over two layers. HF transformers in bf16 on weights of this scale is off from its own f32
    # by a mean of ~0.03 nats (max ~0.1) per token log-prob. We allow mean 0.06, max 0.3 nats.
    mean_tol, max_tol = 0.06, 0.3
    # Meaningful: the predictions are far from uniform, and a real bug (here: rotary positions
    # ignored) moves the log-probs far more than the tolerance.
    assert np.std(ref) > 2.0
    no_rope = np.asarray(token_logprobs(f32, tokens, targets, jnp.zeros_like(tokens)))
    assert np.mean(np.abs(no_rope - ref)) > 5 * mean_tol
    for model in (bf16_compute, bf16_params):
        lp = np.asarray(token_logprobs(model, tokens, targets))
        assert lp.dtype == np.float32 and np.all(np.isfinite(lp))
        assert np.mean(np.abs(lp - ref)) < mean_tol
        assert np.max(np.abs(lp - ref)) < max_tol


def assert_same_loss_and_grads(kwargs: dict, ref_kwargs: dict):
    """Masked loss and gradients of ``random_model(**kwargs)`` equal those of
    ``random_model(**ref_kwargs)`` to the float32 standard of this suite.

    Equivalent programs (rematerialised, unrolled) compute the same operations; XLA may fuse
    (and so round) them differently. The float32 gradients are themselves ~1.5e-6 (relative to
    each parameter's largest gradient) off a float64 computation, so "equal" means: loss to
    1e-6 relative, every gradient to 1e-5 of its parameter's largest one."""
    _, batch = padded_batch()
    ref_loss, ref_grads = masked_loss_and_grads(random_model(**ref_kwargs), *batch)
    loss, grads = masked_loss_and_grads(random_model(**kwargs), *batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=0)
    ref_grads = dict(iter_params(ref_grads))
    assert set(dict(iter_params(grads))) == set(ref_grads)
    for name, g in iter_params(grads):
        ref = np.asarray(ref_grads[name][...])
        scale = float(np.max(np.abs(ref)))
        assert scale > 0, name
        np.testing.assert_allclose(g[...], ref, rtol=0, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_same_loss_and_gradients(remat):
    assert_same_loss_and_grads(dict(remat=remat), dict(remat="none"))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_give_same_loss_and_gradients(remat):
    """``scan_layers=False`` runs the same layers unrolled."""
    assert_same_loss_and_grads(dict(remat=remat, scan_layers=False), dict(remat=remat))


def test_unknown_remat_is_refused():
    with pytest.raises(ValueError, match="remat must be"):
        create_model(CONFIG, remat="some")


# ---- configuration ------------------------------------------------------------------------------

def test_from_hf_reads_top_level_rope_theta():
    # The layout of released hub checkpoints (transformers < 5).
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "tie_word_embeddings": True,
        "eos_token_id": [2, 3]})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rms_norm_eps) == (16, 2, 1e-5)
    assert cfg.tie_word_embeddings and cfg.eos_token_id == (2, 3)
    assert not (cfg.attention_bias or cfg.output_bias or cfg.qk_norm)


def test_from_hf_reads_transformers5_rope_parameters():
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    # (transformers adds rope_theta to the dict it is given: pass a copy.)
    hf = transformers.LlamaConfig(**common, rope_theta=250000.0,
                                  rope_scaling=dict(llama3)).to_dict()
    assert "rope_parameters" in hf and "rope_theta" not in hf  # the transformers 5 layout
    hf["architectures"] = ["LlamaForCausalLM"]
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 250000.0
    assert cfg.rope_scaling_dict == llama3

    hf = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0).to_dict()
    cfg = ModelConfig.from_hf(hf)  # no `architectures`: found from model_type
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.family == "qwen3"
    assert cfg.rope_theta == 1000000.0 and cfg.rope_scaling is None
    assert cfg.head_dim == 32 and cfg.qk_norm and not cfg.attention_bias

    cfg = ModelConfig.from_hf(transformers.Qwen2Config(**common).to_dict())
    assert cfg.family == "qwen2" and cfg.attention_bias and not cfg.output_bias

    # Seed-OSS: q/k/v biases unless switched off, the output bias a separate option.
    hf = transformers.SeedOssConfig(**common, head_dim=16).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.family == "seed_oss" and cfg.attention_bias and not cfg.output_bias
    for key in ("attention_bias", "attention_out_bias"):
        hf.pop(key)
    assert ModelConfig.from_hf(hf) == cfg  # the class's defaults
    cfg = ModelConfig.from_hf({**hf, "attention_bias": False, "attention_out_bias": True})
    assert not cfg.attention_bias and cfg.output_bias


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, architecture="LlamaForCausalLM",
                attention_bias=True, output_bias=True, tie_word_embeddings=True,
                rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                              ("low_freq_factor", 1.0),
                              ("original_max_position_embeddings", 64), ("rope_type", "llama3")),
                bos_token_id=1, eos_token_id=2, pad_token_id=0),
    ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, architecture="Qwen2ForCausalLM",
                attention_bias=True, rope_theta=1e6,
                rope_scaling=(("factor", 4.0), ("rope_type", "linear")), eos_token_id=(5, 6)),
    ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2,
                num_kv_heads=2, head_dim=6, architecture="Qwen3ForCausalLM", qk_norm=True,
                rms_norm_eps=1e-5, max_position_embeddings=128),
    ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, architecture="SeedOssForCausalLM",
                attention_bias=True, output_bias=False, rope_theta=1e7, bos_token_id=0,
                eos_token_id=2, pad_token_id=1),
], ids=["llama", "qwen2", "qwen3", "seed_oss"])
def test_config_hf_round_trip(cfg):
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["GPT2LMHeadModel"]), "unknown architecture 'GPT2LMHeadModel'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "unsupported rope scaling type 'yarn'"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), "sliding-window"),
    (dict(num_key_value_heads=3), "not a multiple of num_kv_heads=3"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_from_hf_refusals(change, message):
    # Qwen configs carry a window that `use_sliding_window: false` switches off: accepted.
    ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 16,
                         "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                         "num_attention_heads": 4, "sliding_window": 4096,
                         "use_sliding_window": False})
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 16, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, **change}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(hf)


def test_from_hf_names_a_missing_key():
    with pytest.raises(ConfigError, match="missing required key 'intermediate_size'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 16, "hidden_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 4})
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        ModelConfig.from_hf([1, 2])


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("features", [
    dict(),
    dict(attention_bias=True),
    dict(attention_bias=True, output_bias=True, qk_norm=True),
])
def test_num_params_counts_actual_parameters(tie, features):
    cfg = ModelConfig(vocab_size=37, hidden_size=24, intermediate_size=40, num_layers=3,
                      num_heads=6, num_kv_heads=2, head_dim=6, tie_word_embeddings=tie,
                      **features)
    # The abstract model has the real parameters' shapes without materialising them.
    params = dict(iter_params(nnx.state(abstract_model(cfg), nnx.Param)))
    assert cfg.num_params() == sum(int(np.prod(v.shape)) for v in params.values())
    embeddings = sum(int(np.prod(v.shape)) for name, v in params.items()
                     if name in ("embed", "lm_head"))
    assert cfg.num_params(include_embeddings=False) == cfg.num_params() - embeddings
    assert ("lm_head" in params) == (not tie)
