"""Named shapes of published decoder checkpoints, without their weights.

Each entry is the architecture part of the model's published ``config.json`` (vocabulary,
widths, depth, heads, rotary settings, tied embeddings), so that benchmarks, the systems model
and recipes can build a randomly initialised model of a real shape (``shape("qwen2.5-0.5b")``)
and plan or measure it without downloading anything. ``python -m rl_jax.models.shapes`` lists
them with their parameter counts.
"""

from __future__ import annotations

import dataclasses

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
    # Llama 3.x
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, 64, tied=True, rope=_LLAMA32_ROPE),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, 128, tied=True, rope=_LLAMA32_ROPE),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, 128, tied=False, rope=_LLAMA31_ROPE),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 8, 128, tied=False, rope=_LLAMA31_ROPE),
    # Small shapes of the same structure for tests and CPU runs of the benchmarks.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16,
                        architecture="Qwen2ForCausalLM", attention_bias=True,
                        tie_word_embeddings=True, eos_token_id=0),
    "small": ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=8, num_kv_heads=4, head_dim=32, eos_token_id=0),
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


def main():
    print(f"{'shape':<16}{'params':>10}{'non-embedding':>15}  vocab    layers  heads/kv  head_dim")
    for name in shape_names():
        cfg = SHAPES[name]
        print(f"{name:<16}{cfg.num_params() / 1e9:>9.3f}B"
              f"{cfg.num_params(include_embeddings=False) / 1e9:>14.3f}B  {cfg.vocab_size:<8} "
              f"{cfg.num_layers:<7} {cfg.num_heads}/{cfg.num_kv_heads:<7} {cfg.head_dim}")


if __name__ == "__main__":
    main()
