"""Tiny random checkpoints written by HF transformers (CPU torch), used as parity references."""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3", "seed_oss")


def write_hf_checkpoint(family: str, path: Path, *, tie: bool = False, seed: int = 0,
                        dtype: str = "float32", rope_scaling: dict | None = None):
    """Writes a tiny random ``family`` model with transformers; returns the torch model."""
    import torch
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, attention_bias=False,
                                       rope_scaling=rope_scaling)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    elif family == "seed_oss":
        # Both biases on (the released models have q/k/v biases only) so that parity covers both.
        cfg = transformers.SeedOssConfig(**common, head_dim=16, rope_theta=10000000.0,
                                         attention_bias=True, attention_out_bias=True)
        cls = transformers.SeedOssForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # HF initialises norms to 1 and biases to 0; randomise them so parity checks cover them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model, tokens):
    import numpy as np
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()
