"""Model shape: parameter count, FLOPs per token (training and decode), bytes of weights and KV.

Conventions (the same as ``benchmarks/trainer_throughput.py`` and the decode roofline of
``benchmarks/generator_throughput.py``, so measured MFU and predicted throughput agree):

- *matmul parameters* ``N_mm`` = every weight a token multiplies by: all non-embedding weights
  plus the unembedding (``vocab × hidden``). The input embedding is a gather (no FLOPs).
- training: ``6·N_mm`` FLOPs per token plus attention ``12·L·H·D·T`` per token for a sequence of
  ``T`` tokens (scores and values, forward and backward; causal masking not discounted).
- decode: ``2·N_mm`` FLOPs per token plus attention ``4·L·H·D·c`` at context length ``c``.
- KV cache: ``2·L·K·D`` elements per token (keys and values of every layer), times the dtype size.

Symbols: ``L`` layers, ``H`` query heads, ``K`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rl_jax.sysmodel.accelerators import dtype_bytes
from rl_jax.sysmodel.errors import SysModelError

_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
           "head_dim", "vocab_size")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama / Qwen2 / Qwen3 layout: gated MLP with three
    matrices, grouped-query attention)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    output_bias: bool = False  # a bias on the attention output projection (Llama/Qwen3 option)
    qk_norm: bool = False  # RMSNorm weights over head_dim for q and k (Qwen3)
    name: str = ""

    def __post_init__(self):
        for field in _FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SysModelError(f"model shape: {field} must be a positive integer, got "
                                    f"{value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SysModelError(f"model shape: num_heads={self.num_heads} is not a multiple of "
                                f"num_kv_heads={self.num_kv_heads}")

    # ---- parameters ---------------------------------------------------------------------------

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention, gated MLP, two norms)."""
        d, f, h, k, hd = (self.hidden_size, self.intermediate_size, self.num_heads,
                          self.num_kv_heads, self.head_dim)
        attention = d * hd * (h + 2 * k) + h * hd * d
        bias = hd * (h + 2 * k) if self.attention_bias else 0
        bias += d if self.output_bias else 0
        qk_norm = 2 * hd if self.qk_norm else 0
        return attention + bias + qk_norm + 3 * d * f + 2 * d

    @property
    def dense_params(self) -> int:
        """Non-embedding parameters: layers and the final norm."""
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Embedding table, plus a separate unembedding unless tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def params(self) -> int:
        """All parameters (what a checkpoint stores and a weight transfer moves)."""
        return self.dense_params + self.embedding_params

    @property
    def matmul_params(self) -> int:
        """Weights every token is multiplied by: dense weights plus the unembedding."""
        return self.dense_params + self.vocab_size * self.hidden_size

    # ---- FLOPs --------------------------------------------------------------------------------

    def train_flops_per_token(self, seq_len: float) -> float:
        """Forward+backward FLOPs per token of a training sequence of ``seq_len`` tokens."""
        attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6.0 * self.matmul_params + attention

    def decode_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of one decoded token attending to ``context`` cached tokens."""
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context
        return 2.0 * self.matmul_params + attention

    def prefill_flops_per_token(self, prompt_len: float) -> float:
        """Forward FLOPs per prompt token of a prefill (causal: mean context is half)."""
        return self.decode_flops_per_token(prompt_len / 2)

    # ---- bytes --------------------------------------------------------------------------------

    def weight_bytes(self, dtype: str = "bfloat16") -> float:
        """Bytes of all weights stored in ``dtype``."""
        return float(self.params * dtype_bytes(dtype))

    def decode_weight_bytes(self, dtype: str = "bfloat16") -> float:
        """Bytes of weights one decode step reads (everything but the input embedding table,
        which is read only at the batch's rows; all of it when tied, as it is the unembedding)."""
        return float(self.matmul_params * dtype_bytes(dtype))

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        """KV-cache bytes of one token: keys and values of every layer."""
        return float(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype))

    def train_state_bytes(self, param_dtype: str = "float32") -> float:
        """Parameters, gradients (param dtype) and two float32 Adam moments."""
        return float(self.params * (2 * dtype_bytes(param_dtype) + 8))

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, vocab_size: int | None = None,
                     name: str = "") -> "ModelShape":
        """From a mapping with this class's field names (e.g. a config's ``model.shape``);
        ``head_dim`` defaults to ``hidden_size // num_heads``, ``num_kv_heads`` to
        ``num_heads``; ``vocab_size`` may be supplied separately."""
        data = dict(values)
        if vocab_size is not None and not data.get("vocab_size"):
            data["vocab_size"] = vocab_size
        missing = [f for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                               "vocab_size") if not data.get(f)]
        if missing:
            raise SysModelError(f"model shape lacks {missing}")
        heads = int(data["num_heads"])
        return cls(
            hidden_size=int(data["hidden_size"]), intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_layers"]), num_heads=heads,
            num_kv_heads=int(data.get("num_kv_heads") or heads),
            head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
            vocab_size=int(data["vocab_size"]),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=bool(data.get("attention_bias", False)),
            output_bias=bool(data.get("output_bias", False)),
            qk_norm=bool(data.get("qk_norm", False)),
            name=name or str(data.get("name", "")))

    @classmethod
    def from_model_config(cls, cfg: Any, name: str = "") -> "ModelShape":
        """From an ``rl_jax.models.config.ModelConfig`` (or anything with its attributes)."""
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                   attention_bias=bool(getattr(cfg, "attention_bias", False)),
                   output_bias=bool(getattr(cfg, "output_bias", False)),
                   qk_norm=bool(getattr(cfg, "qk_norm", False)), name=name)

    def describe(self) -> str:
        return (f"{self.name + ': ' if self.name else ''}{self.params / 1e6:,.1f}M params "
                f"({self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads / "
                f"{self.num_kv_heads} KV heads × {self.head_dim}, vocab {self.vocab_size})")


# Reference shapes for examples and benchmarks (from the models' published config.json files).
QWEN2_1_5B = ModelShape(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                        num_kv_heads=2, head_dim=128, vocab_size=151936,
                        tie_word_embeddings=True, attention_bias=True, name="Qwen2-1.5B")
QWEN2_7B = ModelShape(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                      num_kv_heads=4, head_dim=128, vocab_size=152064, attention_bias=True,
                      name="Qwen2-7B")
