"""Decoder-only transformers (Llama, Qwen2, Qwen3) with HF checkpoint interop."""


