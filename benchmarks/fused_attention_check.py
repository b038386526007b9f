"""One-shot check of the trainer's attention on this machine's backend.

Prints, and appends to ``$OUT/fused_attention.txt`` when ``OUT`` is set: the JAX version and
backend; ``rl_jax.models.fused_attention.check_fused_attention`` for several dtypes and head
sizes (the kernel "auto" picks against XLA on packed rows, outputs and gradients); the loss and a
gradient norm of a small Transformer with ``attention="auto"`` and ``"xla"``; and the time of one
attention forward and backward (B=4, T=4096, 16 query heads, 4 kv heads, head_dim 128) for XLA and
for the chosen kernel.

    PYTHONPATH=. python benchmarks/fused_attention_check.py
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.models import fused_attention as fa
from rl_jax.models.config import ModelConfig
from rl_jax.models.fused_attention import attention_mask
from rl_jax.models.transformer import Transformer

LOG_DIR = os.environ.get("OUT")


def report(*parts) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG_DIR:
        with open(os.path.join(LOG_DIR, "fused_attention.txt"), "a") as f:
            f.write(line + "\n")


def auto_choice(q: jax.Array) -> str:
    return fa.select_implementation(
        "auto", backend=fa.current_backend(), dtype=q.dtype, head_dim=q.shape[-1],
        q_len=q.shape[1], kv_len=q.shape[1], causal_self=True, has_segment_ids=True)


def model_check() -> None:
    cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64)
    *_, segment_ids = fa.packed_example(batch=2, length=256, heads=4, kv_heads=2, head_dim=64)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, segment_ids.shape), jnp.int32)
    for impl in ("auto", "xla"):
        model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attention=impl)
        step = nnx.value_and_grad(
            lambda m: (m(tokens, segment_ids=segment_ids).astype(jnp.float32) ** 2).mean())
        loss, grads = nnx.jit(step)(model)
        report("model", impl, "loss", float(loss), "|d wq|_1",
               float(jnp.abs(grads.layers.wq[...].astype(jnp.float32)).sum()))


def timing(batch: int = 4, length: int = 4096, heads: int = 16, kv_heads: int = 4,
           head_dim: int = 128, repeats: int = 10) -> None:
    q, k, v, segment_ids = fa.packed_example(batch=batch, length=length, heads=heads,
                                             kv_heads=kv_heads, head_dim=head_dim)
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
    mask = attention_mask(index, segment_ids, index, segment_ids)
    for impl in dict.fromkeys(("xla", auto_choice(q))):
        def loss(q, k, v, impl=impl):
            out = fa.fused_attention(q, k, v, mask, implementation=impl,
                                     segment_ids=segment_ids, causal_self=True)
            return out.astype(jnp.float32).sum()
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(step(q, k, v))
        start = time.perf_counter()
        for _ in range(repeats):
            grads = step(q, k, v)
        jax.block_until_ready(grads)
        ms = (time.perf_counter() - start) / repeats * 1e3
        report("time", impl, f"{ms:.2f} ms forward+backward", q.shape, k.shape)


def main() -> None:
    report("jax", jax.__version__, jax.devices(), "backend", fa.current_backend())
    for dtype, head_dim in ((jnp.bfloat16, 128), (jnp.bfloat16, 64), (jnp.float16, 128),
                            (jnp.float32, 128)):
        report(json.dumps(fa.check_fused_attention(dtype, head_dim=head_dim)))
    model_check()
    timing()


if __name__ == "__main__":
    main()
