"""HF checkpoint interop against real transformers checkpoints: logits parity, save/load round
trips (single file, sharded, bf16, with a tokenizer), and refusals of broken checkpoints."""

import copy
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import hf_reference
from rl_jax.models import hf
from rl_jax.models.build import iter_params
from rl_jax.sharding import ShardingError, make_mesh

# Parity tolerance on float32 logits (observed: ~3e-7).
ATOL = 1e-4
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TOKENS = np.random.default_rng(0).integers(3, 96, (2, 12))


def sharpen(torch_model, path: Path):
    """Rescales a fresh transformers model's weights and saves it again to ``path``.

    transformers initialises every matrix with std 0.02: attention is then nearly uniform and
    logits nearly flat, so a wrong rotary embedding or mask would move logits by little more than
    the parity tolerance. With std ``1/sqrt(fan_in)`` (embeddings 0.5) attention is sharp and
    logits spread over several units.
    """
    import torch

    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if p.ndim == 2:
                target = 0.5 if "embed_tokens" in name or "lm_head" in name else p.shape[1] ** -0.5
                p.mul_(target / 0.02)
    torch_model.save_pretrained(path, safe_serialization=True)
    return torch_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(family, tie=False, **kw) -> (path, torch model)``; each is written once."""
    cache = {}

    def get(family: str, tie: bool = False, **kwargs):
        key = json.dumps([family, tie, kwargs], sort_keys=True)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf-{family}-{'tied' if tie else 'untied'}")
            model = hf_reference.write_hf_checkpoint(family, path, tie=tie, **kwargs)
            cache[key] = path, sharpen(model, path)
        return cache[key]

    return get


@nnx.jit
def logits_of(model, tokens, positions=None, segment_ids=None):
    return model.logits(model(tokens, positions, segment_ids))


def params(model) -> dict[str, np.ndarray]:
    return {name: np.asarray(v[...]) for name, v in iter_params(nnx.state(model, nnx.Param))}


def assert_same_params(a, b):
    a, b = params(a), params(b)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name]), name


def broken_copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def edit_config(path: Path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(92)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


# ---- parity with transformers -------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", hf_reference.FAMILIES)
def test_logits_match_transformers(checkpoint, family, tie):
    path, torch_model = checkpoint(family, tie)
    model = hf.load_pretrained(path)
    assert model.config.family == family and model.config.tie_word_embeddings == tie
    assert ("lm_head" in params(model)) == (not tie)
    ref = hf_reference.hf_logits(torch_model, TOKENS)
    ours = np.asarray(logits_of(model, jnp.asarray(TOKENS)))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", hf_reference.FAMILIES)
def test_explicit_positions_and_left_padding_match_transformers(checkpoint, family):
    """Row 0: explicit positions 0..T-1 and one segment (the defaults). Row 1: left padding as
    segment 0, against transformers with an attention mask and position ids."""
    import torch

    path, torch_model = checkpoint(family)
    model = hf.load_pretrained(path)
    pad = 4
    t = TOKENS.shape[1]
    attention_mask = np.ones((2, t), np.int64)
    attention_mask[1, :pad] = 0
    tokens = TOKENS.copy()
    tokens[1, :pad] = 0
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.as_tensor(tokens),
                          attention_mask=torch.as_tensor(attention_mask),
                          position_ids=torch.as_tensor(positions)).logits.numpy()
    ours = np.asarray(logits_of(model, jnp.asarray(tokens), jnp.asarray(positions, jnp.int32),
                                jnp.asarray(attention_mask, jnp.int32)))
    np.testing.assert_allclose(ours[0], ref[0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(ours[1, pad:], ref[1, pad:], rtol=0, atol=ATOL)
    np.testing.assert_allclose(ours[0], hf_reference.hf_logits(torch_model, tokens[:1])[0],
                               rtol=0, atol=ATOL)


def test_llama3_rope_scaling_matches_transformers(checkpoint, tmp_path):
    path, torch_model = checkpoint("llama", rope_scaling=dict(LLAMA3_SCALING))
    # transformers accepted the config (it keeps the scaling as given).
    kept = {k: v for k, v in torch_model.config.rope_parameters.items() if k != "rope_theta"}
    assert kept == LLAMA3_SCALING
    model = hf.load_pretrained(path)
    assert model.config.rope_scaling_dict == LLAMA3_SCALING
    # 200 tokens: well past original_max_position_embeddings=64, so the scaled low frequencies
    # matter. The same weights without scaling give clearly different logits.
    tokens = np.random.default_rng(1).integers(0, 96, (1, 200))
    ref = hf_reference.hf_logits(torch_model, tokens)
    _, unscaled_model = checkpoint("llama")  # same seed, hence the same weights
    unscaled = hf_reference.hf_logits(unscaled_model, tokens)
    assert np.max(np.abs(unscaled - ref)) > 100 * ATOL
    ours = np.asarray(logits_of(model, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL)

    # The scaling survives a save: transformers reads our config.json the same way.
    import transformers

    hf.save_pretrained(model, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    np.testing.assert_allclose(hf_reference.hf_logits(reloaded, tokens), ref, rtol=0, atol=ATOL)
    assert hf.load_pretrained(tmp_path / "saved").config == model.config


# ---- round trips --------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", hf_reference.FAMILIES)
def test_save_round_trip_is_exact_and_loads_in_transformers(checkpoint, tmp_path, family, tie):
    import transformers

    path, torch_model = checkpoint(family, tie)
    model = hf.load_pretrained(path)
    out = hf.save_pretrained(model, tmp_path / "saved")
    assert out == tmp_path / "saved"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_params(hf.load_pretrained(out), model)
    assert hf.load_pretrained(out).config == model.config

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(torch_model)
    assert reloaded.config.tie_word_embeddings == tie
    np.testing.assert_allclose(hf_reference.hf_logits(reloaded, TOKENS),
                               hf_reference.hf_logits(torch_model, TOKENS), rtol=0, atol=ATOL)


def test_sharded_save_round_trip(checkpoint, tmp_path):
    import transformers

    path, torch_model = checkpoint("qwen2")
    model = hf.load_pretrained(path)
    out = hf.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=60_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3 and "model.safetensors" not in files
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors"
                     for k in range(1, len(files) + 1)]
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    stored = {}
    for file in files:
        stored.update({name: (file, t) for name, t in load_file(str(out / file)).items()})
    assert {n: f for n, (f, _) in stored.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in stored.values())
    for file in files:  # no shard above the limit unless it holds a single larger tensor
        tensors = load_file(str(out / file))
        assert sum(t.nbytes for t in tensors.values()) <= 60_000 or len(tensors) == 1

    assert_same_params(hf.load_pretrained(out), model)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_reference.hf_logits(reloaded, TOKENS),
                               hf_reference.hf_logits(torch_model, TOKENS), rtol=0, atol=ATOL)


def test_bfloat16_load_and_save(checkpoint, tmp_path):
    path, torch_model = checkpoint("qwen3")
    f32 = hf.load_pretrained(path)
    bf16 = hf.load_pretrained(path, dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    f32_params, bf16_params = params(f32), params(bf16)
    for name, value in bf16_params.items():
        assert value.dtype == ml_dtypes.bfloat16, name
        # The stored float32 values, rounded to nearest: exactly what jnp's cast gives.
        assert np.array_equal(value, np.asarray(jnp.asarray(f32_params[name], jnp.bfloat16))), name
    # Accuracy yardstick: transformers' own bf16 forward on the same weights. Both are off the
    # float32 logits (magnitude up to ~15 here) by a mean of ~0.035 and a max of ~0.2; ours may
    # be at most 1.5x (mean) and 2x (max) as far off.
    import torch

    ref = hf_reference.hf_logits(torch_model, TOKENS)
    hf_bf16_error = np.abs(
        hf_reference.hf_logits(copy.deepcopy(torch_model).to(torch.bfloat16), TOKENS) - ref)
    error = np.abs(np.asarray(logits_of(bf16, jnp.asarray(TOKENS))) - ref)
    assert np.all(np.isfinite(error))
    assert np.mean(error) <= 1.5 * np.mean(hf_bf16_error)
    assert np.max(error) <= 2.0 * np.max(hf_bf16_error)

    # Save a float32 model as bf16: the file holds bf16 tensors and reloads bit-exactly.
    out = hf.save_pretrained(f32, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {
        np.dtype(ml_dtypes.bfloat16)}
    assert_same_params(hf.load_pretrained(out, dtype=jnp.bfloat16), bf16)
    # A bf16 model saves as bf16 without being asked, and a float32 load of it upcasts exactly.
    out2 = hf.save_pretrained(bf16, tmp_path / "bf16-again")
    assert json.loads((out2 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    upcast = params(hf.load_pretrained(out2))
    for name, value in bf16_params.items():
        assert upcast[name].dtype == np.float32
        assert np.array_equal(upcast[name], value.astype(np.float32)), name


def test_save_with_tokenizer(checkpoint, tmp_path):
    path, _ = checkpoint("llama")
    model = hf.load_pretrained(path)
    tokenizer = word_level_tokenizer()
    out = hf.save_pretrained(model, tmp_path / "with-tokenizer", tokenizer=tokenizer)
    assert (out / "tokenizer.json").is_file()
    loaded = hf.load_tokenizer(out)
    text = "w1 w17 <s> w91 unknown"
    assert loaded.encode(text).ids == tokenizer.encode(text).ids == [5, 21, 1, 95, 3]
    assert loaded.get_vocab_size() == tokenizer.get_vocab_size() == model.config.vocab_size
    special = json.loads((out / "tokenizer_config.json").read_text())
    # config: bos 1, eos 2, pad 0
    assert (special["bos_token"], special["eos_token"], special["pad_token"]) == (
        "<s>", "</s>", "<pad>")
    assert_same_params(hf.load_pretrained(out), model)


def test_save_replaces_an_existing_directory(checkpoint, tmp_path):
    llama = hf.load_pretrained(checkpoint("llama")[0])
    qwen3 = hf.load_pretrained(checkpoint("qwen3")[0])
    target = tmp_path / "model"
    hf.save_pretrained(llama, target, tokenizer=word_level_tokenizer(), max_shard_bytes=60_000)
    (target / "stale.txt").write_text("from an earlier run")
    assert (target / hf.INDEX_FILE).is_file()

    hf.save_pretrained(qwen3, target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert_same_params(hf.load_pretrained(target), qwen3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left over

    # A save that fails part-way leaves the old directory as it was.
    with pytest.raises(AttributeError):
        hf.save_pretrained(llama, target, tokenizer=object())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert_same_params(hf.load_pretrained(target), qwen3)


# ---- refusals -----------------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(hf.CheckpointError, match="does not exist"):
        hf.load_pretrained(tmp_path / "nowhere")


def test_missing_config(checkpoint, tmp_path):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(hf.CheckpointError, match="config.json is missing"):
        hf.load_pretrained(path)


@pytest.mark.parametrize("content, message", [
    (b'{"architectures": ["LlamaForCausalLM"],', "config.json is not valid JSON"),
    (b"\xff\xfe\x00garbage", "config.json is not valid JSON"),
    (b"[1, 2]", "config.json must hold a JSON object, got list"),
], ids=["truncated", "binary", "array"])
def test_config_not_json(checkpoint, tmp_path, content, message):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    (path / "config.json").write_bytes(content)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load_pretrained(path)


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     "unknown architecture 'GPT2LMHeadModel'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_attention_heads=3), "not a multiple of num_kv_heads"),
])
def test_unsupported_config(checkpoint, tmp_path, changes, message):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    edit_config(path, **changes)
    with pytest.raises(hf.CheckpointError, match=message):
        hf.load_pretrained(path)


def test_no_safetensors(checkpoint, tmp_path):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(hf.CheckpointError, match=r"no \*\.safetensors files"):
        hf.load_pretrained(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 12], ids=["half", "last-byte", "header"])
def test_truncated_safetensors(checkpoint, tmp_path, keep):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    file = path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    with pytest.raises(hf.CheckpointError, match="model.safetensors is not a readable "
                                                 "safetensors file"):
        hf.load_pretrained(path)


def test_missing_tensor(checkpoint, tmp_path):
    path = broken_copy(checkpoint("qwen2")[0], tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(hf.CheckpointError,
                       match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.k_proj\.bias"):
        hf.load_pretrained(path)


def test_untied_config_without_lm_head(checkpoint, tmp_path):
    path = broken_copy(checkpoint("llama", True)[0], tmp_path)
    edit_config(path, tie_word_embeddings=False)
    with pytest.raises(hf.CheckpointError, match=r"missing 1 tensor.*'lm_head\.weight'"):
        hf.load_pretrained(path)


def test_extra_tensor(checkpoint, tmp_path):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    edit_config(path, num_hidden_layers=1)
    with pytest.raises(hf.CheckpointError, match=r"does not use.*model\.layers\.1\."):
        hf.load_pretrained(path)


@pytest.mark.parametrize("changes, tensor, found, implied", [
    (dict(intermediate_size=128), "mlp", "(160, 64)", "(128, 64)"),
    (dict(hidden_size=32), "model.embed_tokens.weight", "(96, 64)", "(96, 32)"),
])
def test_shape_mismatch(checkpoint, tmp_path, changes, tensor, found, implied):
    path = broken_copy(checkpoint("llama")[0], tmp_path)
    edit_config(path, **changes)
    with pytest.raises(hf.CheckpointError, match="shape mismatch") as e:
        hf.load_pretrained(path)
    assert tensor in str(e.value) and found in str(e.value) and implied in str(e.value)


@pytest.fixture
def sharded_copy(checkpoint, tmp_path):
    model = hf.load_pretrained(checkpoint("llama")[0])
    return hf.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=60_000)


def test_index_names_a_missing_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("model-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(hf.CheckpointError, match=f"{shard.name} is listed in "
                                                 "model.safetensors.index.json but missing"):
        hf.load_pretrained(sharded_copy)


def test_index_not_json(sharded_copy):
    (sharded_copy / hf.INDEX_FILE).write_text('{"weight_map": ')
    with pytest.raises(hf.CheckpointError, match="is not a valid safetensors index"):
        hf.load_pretrained(sharded_copy)


def test_index_places_a_tensor_in_the_wrong_shard(sharded_copy):
    index = json.loads((sharded_copy / hf.INDEX_FILE).read_text())
    name = "model.norm.weight"
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    (sharded_copy / hf.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(hf.CheckpointError, match=f"says '{name}' is in"):
        hf.load_pretrained(sharded_copy)


def test_corrupt_or_missing_tokenizer(tmp_path):
    with pytest.raises(hf.CheckpointError, match="tokenizer.json is missing"):
        hf.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(hf.CheckpointError, match="tokenizer.json is not a valid tokenizer file"):
        hf.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(hf.CheckpointError, match="tokenizer.json is not a valid tokenizer file"):
        hf.load_tokenizer(tmp_path)


def test_mesh_that_does_not_divide_a_dimension(checkpoint):
    path, _ = checkpoint("llama")  # 2 key/value heads
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    with pytest.raises(ShardingError, match=r"layers\.wk: dimension 'kv_heads' of size 2 is not "
                                            r"divisible by mesh axes \('tensor',\)"):
        hf.load_pretrained(path, mesh=mesh)
