"""Named shapes of published decoder checkpoints, without their weights.

Each entry is the architecture part of the model's published ``config.json`` (vocabulary,
widths, depth, heads, rotary settings, tied embeddings), so that benchmarks, the systems model
and recipes can build a randomly initialised model of a real shape (``shape("qwen2.5-0.5b")``)
and plan or measure it without downloading anything. ``python -m rl_jax.models.shapes`` lists
them with their parameter counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from rl_jax.models.config import ConfigError, ModelConfig

_QWEN_EOS = 151643  # <|endoftext|> of the Qwen2/2.5/3 tokenizers
_LLAMA3_BOS, _LLAMA3_EOS = 128000, 128001
# Llama 3.1/3.2 rotary scaling ("llama3" rope type) with its context-extension factor.
_LLAMA31_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
_LLAMA32_ROPE = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))


def _qwen2(vocab, hidden, mlp, layers, heads, kv, tied, max_pos=32768) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, architecture="Qwen2ForCausalLM",
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       attention_bias=True, max_position_embeddings=max_pos,
                       bos_token_id=_QWEN_EOS, eos_token_id=_QWEN_EOS)


def _qwen3(hidden, mlp, layers, heads, kv, tied) -> ModelConfig:
    return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=128,
                       architecture="Qwen3ForCausalLM", rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=tied, qk_norm=True,
                       max_position_embeddings=40960, bos_token_id=_QWEN_EOS,
                       eos_token_id=_QWEN_EOS)


def _llama3(hidden, mlp, layers, heads, kv, head_dim, tied, rope) -> ModelConfig:
    return ModelConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       architecture="LlamaForCausalLM", rope_theta=500_000.0,
                       rope_scaling=rope, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       max_position_embeddings=131072, bos_token_id=_LLAMA3_BOS,
                       eos_token_id=_LLAMA3_EOS)


SHAPES: dict[str, ModelConfig] = {
    # Qwen2.5 (Qwen2 architecture: q/k/v biases)
    "qwen2.5-0.5b": _qwen2(151936, 896, 4864, 24, 14, 2, tied=True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 8960, 28, 12, 2, tied=True, max_pos=131072),
    "qwen2.5-3b": _qwen2(151936, 2048, 11008, 36, 16, 2, tied=True),
    "qwen2.5-7b": _qwen2(152064, 3584, 18944, 28, 28, 4, tied=False, max_pos=131072),
    "qwen2.5-14b": _qwen2(152064, 5120, 13824, 48, 40, 8, tied=False, max_pos=131072),
    "qwen2.5-32b": _qwen2(152064, 5120, 27648, 64, 40, 8, tied=False, max_pos=131072),
    # Qwen3 dense (q/k RMSNorm, head_dim 128 at every size)
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, tied=False),
    # Llama 3.x
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, 64, tied=True, rope=_LLAMA32_ROPE),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, 128, tied=True, rope=_LLAMA32_ROPE),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, 128, tied=False, rope=_LLAMA31_ROPE),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 8, 128, tied=False, rope=_LLAMA31_ROPE),
    # Small shapes of the same structure for tests and CPU runs of the benchmarks.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16,
                        architecture="Qwen2ForCausalLM", attention_bias=True,
                        tie_word_embeddings=True, eos_token_id=511),
    "small": ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=8, num_kv_heads=4, head_dim=32, eos_token_id=8191),
}

ALIASES = {"qwen2-1.5b": "qwen2.5-1.5b", "qwen2-7b": "qwen2.5-7b", "llama-3-8b": "llama-3.1-8b"}


def shape_names() -> list[str]:
    return sorted(SHAPES)


def shape(name: str, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a named shape (case-insensitive), with ``overrides`` of its
    fields (e.g. ``max_position_embeddings``); an unknown name or field is an error naming the
    known ones."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(shape_names())}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown ModelConfig fields {unknown} in overrides of {name!r}")
    return dataclasses.replace(SHAPES[key], **overrides)


# ---- a checkpoint of a shape, with random weights ----------------------------------------------

SPECIAL_NAMES = {"qwen2": ("<|endoftext|>",), "qwen3": ("<|endoftext|>",),
                 "llama": ("<|begin_of_text|>", "<|end_of_text|>")}


def shape_tokenizer(cfg: ModelConfig):
    """A byte-level tokenizer whose ids cover ``cfg.vocab_size``: the 256 bytes first (any text
    encodes, one token per byte), the model's bos/eos tokens at their ids, and placeholder
    tokens for every other id (so every id the model can sample decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    if cfg.vocab_size < len(byte_chars) + 2:
        raise ConfigError(f"vocab_size={cfg.vocab_size} is smaller than the 256 byte tokens and "
                          "the special tokens a shape tokenizer needs")
    specials: dict[int, str] = {}
    names = iter(SPECIAL_NAMES.get(cfg.family, ("<s>", "</s>")))
    for tid in (cfg.bos_token_id, cfg.eos_token_id):
        tid = tid[0] if isinstance(tid, tuple) else tid
        if tid is not None and tid not in specials:
            if tid < len(byte_chars) or tid >= cfg.vocab_size:
                raise ConfigError(f"special token id {tid} must lie in [256, {cfg.vocab_size})")
            specials[tid] = next(names, f"<|special_{tid}|>")
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    for i in range(len(vocab), cfg.vocab_size):
        vocab[specials.get(i, f"<|reserved_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    return tok


def write_random_checkpoint(cfg: ModelConfig, path: str | os.PathLike, *, dtype: str = "bfloat16",
                            seed: int = 0, max_shard_bytes: int = 2 << 30) -> Path:
    """Writes an HF checkpoint of ``cfg`` with random weights (normal(0, 0.02) matrices and
    embeddings, unit norms, zero biases) in ``dtype``, ``config.json`` and a tokenizer covering
    the vocabulary (:func:`shape_tokenizer`). Tensors are generated one at a time and each
    safetensors shard is written as soon as it is full, so memory stays at about one shard
    whatever the model's size. Atomic: a complete directory replaces any old one."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from rl_jax.models.hf import INDEX_FILE, _replace_dir, hf_mappings, save_tokenizer

    np_dtype = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
                "float32": np.dtype(np.float32)}.get(dtype)
    if np_dtype is None:
        raise ConfigError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    rng = np.random.default_rng(seed)
    names = []
    for ours, m in hf_mappings(cfg).items():
        for i in (range(cfg.num_layers) if "{i}" in m.hf_name else (None,)):
            names.append((m.hf_name.format(i=i) if i is not None else m.hf_name, m.hf_shape,
                          ours.rsplit(".", 1)[-1]))

    def tensor(shape, kind):
        if "norm" in kind:
            return np.ones(shape, np_dtype)
        if kind.startswith("b"):  # biases
            return np.zeros(shape, np_dtype)
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= 0.02
        return out.astype(np_dtype)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        shard, size, files, weight_map, total = {}, 0, [], {}, 0

        def flush():
            file = f"shard-{len(files):05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            files.append((file, list(shard)))

        for name, shape, kind in names:
            nbytes = int(np.prod(shape)) * np_dtype.itemsize
            if shard and size + nbytes > max_shard_bytes:
                flush()
                shard, size = {}, 0
            shard[name] = tensor(shape, kind)
            size += nbytes
            total += nbytes
        flush()
        if len(files) == 1:
            os.replace(tmp / files[0][0], tmp / "model.safetensors")
        else:
            for k, (file, tensors) in enumerate(files):
                final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
                os.replace(tmp / file, tmp / final)
                weight_map.update({n: final for n in tensors})
            (tmp / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2))
        save_tokenizer(shape_tokenizer(cfg), tmp, cfg)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def list_shapes():
    print(f"{'shape':<16}{'params':>10}{'non-embedding':>15}  vocab    layers  heads/kv  head_dim")
    for name in shape_names():
        cfg = SHAPES[name]
        print(f"{name:<16}{cfg.num_params() / 1e9:>9.3f}B"
              f"{cfg.num_params(include_embeddings=False) / 1e9:>14.3f}B  {cfg.vocab_size:<8} "
              f"{cfg.num_layers:<7} {cfg.num_heads}/{cfg.num_kv_heads:<7} {cfg.head_dim}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m rl_jax.models.shapes",
        description="List the named model shapes, or write one as an HF checkpoint with random "
                    "weights.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="the shapes and their parameter counts (the default)")
    write = sub.add_parser("write", help="an HF checkpoint directory of a shape")
    write.add_argument("shape", help=f"one of: {', '.join(shape_names())}")
    write.add_argument("path", help="output directory (replaced atomically)")
    write.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    write.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "write":
        try:
            cfg = shape(args.shape)
        except ConfigError as e:
            parser.error(str(e))
        out = write_random_checkpoint(cfg, args.path, dtype=args.dtype, seed=args.seed)
        print(f"wrote {args.shape} ({cfg.num_params() / 1e9:.3f}B parameters, {args.dtype}) "
              f"to {out}")
    else:
        list_shapes()


if __name__ == "__main__":
    main()
