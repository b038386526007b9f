"""Named model shapes (rl_jax.models.shapes): the published architectures' parameter counts,
lookups, and HF checkpoints of a shape with random weights that this library and transformers
both load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rl_jax.models.config import ConfigError
from rl_jax.models.shapes import (SHAPES, main, shape, shape_names, shape_tokenizer,
                                  write_random_checkpoint)
from rl_jax.sysmodel.shape import ModelShape

# Parameter counts of the published checkpoints (their safetensors totals).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-3b": 3_085_938_688,
    "qwen3-0.6b": 596_049_920, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264,
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_shapes_have_the_published_parameter_counts(name):
    cfg = shape(name)
    assert cfg.num_params() == PUBLISHED_PARAMS[name]
    # the systems model counts the same parameters
    assert ModelShape.from_model_config(cfg).params == PUBLISHED_PARAMS[name]


# The model cards' rounded totals and non-embedding counts, in billions: a check of the counts
# above that does not go through the same arithmetic.
MODEL_CARD_BILLIONS = {"qwen2.5-3b": (3.09, 2.77), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95),
                       "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2)}


@pytest.mark.parametrize("name", sorted(MODEL_CARD_BILLIONS))
def test_parameter_counts_round_to_the_model_cards(name):
    cfg = shape(name)
    total, non_embedding = MODEL_CARD_BILLIONS[name]
    embedding = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    digits = len(str(total).split(".")[1])
    assert round(PUBLISHED_PARAMS[name] / 1e9, digits) == total
    digits = len(str(non_embedding).split(".")[1])
    assert round((PUBLISHED_PARAMS[name] - embedding) / 1e9, digits) == non_embedding


def test_shape_lookup_is_case_insensitive_takes_aliases_and_overrides():
    assert shape("Qwen2.5-0.5B") == SHAPES["qwen2.5-0.5b"]
    assert shape("qwen2-1.5b") == SHAPES["qwen2.5-1.5b"]
    assert shape("qwen3-0.6b", max_position_embeddings=4096).max_position_embeddings == 4096
    with pytest.raises(ConfigError, match="unknown model shape 'gpt-5'.*qwen2.5-0.5b"):
        shape("gpt-5")
    with pytest.raises(ConfigError, match=r"unknown ModelConfig fields \['hidden'\]"):
        shape("tiny", hidden=3)
    assert "llama-3.1-8b" in shape_names()


def test_named_shapes_round_trip_through_hf_config():
    from rl_jax.models.config import ModelConfig
    for name in ("qwen2.5-0.5b", "qwen3-1.7b", "llama-3.2-1b", "llama-3.1-8b"):
        cfg = shape(name)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, name




def test_shape_tokenizer_covers_the_vocabulary_and_any_text():
    cfg = shape("qwen2.5-0.5b")
    tok = shape_tokenizer(cfg)
    assert tok.get_vocab_size() == cfg.vocab_size
    assert tok.token_to_id("<|endoftext|>") == cfg.eos_token_id
    text = "Solve 12 + 7 = ? \u00e9\u4e2d\n"
    ids = tok.encode(text).ids
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode([cfg.vocab_size - 1]) != ""  # every id decodes
    llama = shape_tokenizer(shape("llama-3.2-1b"))
    assert llama.token_to_id("<|begin_of_text|>") == 128000
    assert llama.token_to_id("<|end_of_text|>") == 128001


def test_random_checkpoint_loads_here_and_in_transformers(tmp_path):
    """A Qwen3-structured small shape (q/k norms, GQA) in sharded bf16 files: our loader and
    transformers read the same weights and give the same logits."""
    import torch
    import transformers

    from rl_jax.models.hf import load_pretrained, load_tokenizer, read_config
    from rl_jax.models.transformer import Transformer  # noqa: F401  (the loader's model)

    cfg = shape("qwen3-0.6b", hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, vocab_size=512, eos_token_id=300,
                bos_token_id=300)
    path = write_random_checkpoint(cfg, tmp_path / "ckpt", dtype="float32",
                                   max_shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # it really was sharded
    assert read_config(path) == cfg
    assert load_tokenizer(path).get_vocab_size() == 512
    model = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = np.array([[1, 5, 300, 42, 7, 9]], np.int32)
    ours = np.asarray(model.logits(model(tokens)))
    theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.detach().numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4)
    # the same seed gives the same weights; norms start at one, biases at zero
    again = write_random_checkpoint(cfg, tmp_path / "again", dtype="float32")
    from safetensors.numpy import load_file
    merged = {}
    for file in sorted(set(index["weight_map"].values())):
        merged.update(load_file(path / file))
    other = load_file(again / "model.safetensors")
    assert set(merged) == set(other)
    assert all(np.array_equal(merged[k], other[k]) for k in merged)
    assert np.all(merged["model.norm.weight"] == 1)


def test_write_command_names_a_bad_shape_and_writes_bf16(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["write", "gpt-5", str(tmp_path / "x")])
    assert "unknown model shape 'gpt-5'" in capsys.readouterr().err
    main(["write", "tiny", str(tmp_path / "tiny")])
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["vocab_size"] == 512
    with pytest.raises(ConfigError, match="dtype must be"):
        write_random_checkpoint(SHAPES["tiny"], tmp_path / "y", dtype="int8")
