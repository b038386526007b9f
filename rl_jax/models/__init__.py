"""Decoder-only transformers (Llama, Qwen2, Qwen3) with HF checkpoint interop."""

from rl_jax.models.build import abstract_model, create_model, iter_params, param_shardings
from rl_jax.models.config import ConfigError, ModelConfig
from rl_jax.models.hf import (CheckpointError, load_pretrained, load_tokenizer, read_config,
                              save_pretrained)
from rl_jax.models.logprobs import blockwise_token_logprobs, blockwise_token_stats
from rl_jax.models.transformer import Transformer

__all__ = [
    "CheckpointError", "ConfigError", "ModelConfig", "Transformer", "abstract_model",
    "blockwise_token_logprobs", "blockwise_token_stats", "create_model", "iter_params",
    "load_pretrained", "load_tokenizer", "param_shardings", "read_config", "save_pretrained",
]
