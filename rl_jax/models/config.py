"""Model configuration for the Llama / Qwen2 / Qwen3 / Seed-OSS decoder families, read from and
written to Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from rl_jax.errors import UserError

# HF architecture name → family. The family decides defaults the HF classes hard-code.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Llama with q/k/v biases by default and the output projection's bias a separate option
    # (``attention_out_bias``).
    "SeedOssForCausalLM": "seed_oss",
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "seed_oss": "SeedOssForCausalLM"}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(UserError, ValueError):
    """A model configuration that this library cannot build."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    ``attention_bias`` adds biases to the q/k/v projections (Qwen2 always, Llama/Qwen3 when their
    config says so, Seed-OSS unless it says not); ``output_bias`` adds one to the output
    projection (Llama/Qwen3 with ``attention_bias``, Seed-OSS with ``attention_out_bias``);
    ``qk_norm`` applies RMSNorm over ``head_dim`` to q and k (Qwen3).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of "
                              f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; supported: "
                              f"{sorted(ARCHITECTURES)}")

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def num_params(self, include_embeddings: bool = True) -> int:
        d, f, h, k, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                          self.num_kv_heads, self.head_dim)
        per_layer = d * hd * (h + 2 * k) + h * hd * d + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += hd * (h + 2 * k)
        if self.output_bias:
            per_layer += d
        if self.qk_norm:
            per_layer += 2 * hd
        total = self.num_layers * per_layer + d
        if include_embeddings:
            total += self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return total

    # ---- HF config.json ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the contents of an HF ``config.json``."""
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type", ""))
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {arch!r} (architectures={archs}, "
                f"model_type={hf.get('model_type')!r}); supported: {sorted(ARCHITECTURES)}")
        family = ARCHITECTURES[arch]

        def need(key):
            if key not in hf:
                raise ConfigError(f"config.json is missing required key {key!r}")
            return hf[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = hf.get("head_dim") or hidden // heads
        # transformers >= 5 nests rope settings under `rope_parameters`; older files use
        # top-level `rope_theta` and `rope_scaling`.
        rope_params = hf.get("rope_parameters") or {}
        rope_theta = rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or {
            k: v for k, v in rope_params.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(f"unsupported rope scaling type {rope_type!r}; supported: "
                              "default, linear, llama3")
        rope_scaling = None
        if rope_type != "default":
            scaling = {**scaling, "rope_type": rope_type}
            scaling.pop("type", None)
            rope_scaling = tuple(sorted(scaling.items()))
        # Qwen2/Qwen3 configs carry `sliding_window` but switch it off with
        # `use_sliding_window: false`; Mistral's is on whenever set.
        if hf.get("use_sliding_window") or (hf.get("sliding_window")
                                            and hf.get("use_sliding_window", True)):
            raise ConfigError(f"sliding-window attention (sliding_window="
                              f"{hf.get('sliding_window')}) is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu)")
        if hf.get("mlp_bias"):
            raise ConfigError("MLP biases (mlp_bias=true) are not supported")
        # (q/k/v bias, output bias): what each family's HF class builds.
        bias = bool(hf.get("attention_bias", False))
        biases = {"qwen2": (True, False),
                  "seed_oss": (bool(hf.get("attention_bias", True)),
                               bool(hf.get("attention_out_bias", False)))
                  }.get(family, (bias, bias))
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            architecture=arch,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=biases[0],
            output_bias=biases[1],
            qk_norm=family == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """Contents of an HF ``config.json`` that transformers and SGLang load."""
        model_type = {v: k for k, v in MODEL_TYPES.items()}[self.architecture]
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.family == "qwen2":
            out["use_sliding_window"] = False
        elif self.family == "seed_oss":
            # This model has no dropout; SeedOssConfig's defaults are 0.1.
            out.update(attention_bias=self.attention_bias, attention_out_bias=self.output_bias,
                       mlp_bias=False, attention_dropout=0.0, residual_dropout=0.0)
        else:
            out["attention_bias"] = self.attention_bias
            if self.family == "llama":
                out["mlp_bias"] = False
        return out


def eos_ids(config: ModelConfig) -> tuple[int, ...]:
    """The end-of-sequence token ids of ``config`` (HF's ``eos_token_id``: none, one or a
    list) as a tuple."""
    eos = config.eos_token_id
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
