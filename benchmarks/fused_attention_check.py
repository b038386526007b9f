"""Checks the fused attention the trainer picks on this backend against XLA (outputs, gradients),
the Transformer with attention="auto" against "xla", and times one fused attention forward and
backward against XLA's. Writes the lines it prints to $OUT/fused_attention.txt when OUT is set."""
import inspect, json, time, sys, os
LOG = open(os.path.join(os.environ.get("OUT", "/tmp"), "fused_attention.txt"), "a")
def out(*a):
    print(*a, flush=True); print(*a, file=LOG, flush=True)
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
out("jax", jax.__version__, jax.devices())
out("dpa", inspect.signature(jax.nn.dot_product_attention))
from jax.experimental.pallas.ops.tpu import splash_attention as sa
out("splash", inspect.signature(sa.make_splash_mqa_single_device))
from rl_jax.models import fused_attention as fa
from rl_jax.models.transformer import Transformer, check_fused_attention
from rl_jax.models.config import ModelConfig
out("backend", fa.current_backend())
res = {}
for dt, hd in ((jnp.bfloat16, 128), (jnp.bfloat16, 64), (jnp.float16, 128), (jnp.float32, 128)):
    if True:
        r = check_fused_attention(dt, head_dim=hd)
        res[f"{jnp.dtype(dt).name}/hd{hd}"] = r
        out(json.dumps(r))
# Transformer end to end: auto vs xla, packed rows with prefix and without
cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64)
_, _, _, seg = fa.packed_example(batch=2, length=256, heads=4, kv_heads=2, head_dim=64)
tok = jnp.asarray(np.random.default_rng(0).integers(0, 256, seg.shape), jnp.int32)
for impl in ("auto", "xla"):
    m = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attention=impl)
    g = nnx.value_and_grad(lambda m: (m(tok, segment_ids=seg).astype(jnp.float32) ** 2).mean())
    val, grads = nnx.jit(g)(m)
    res[f"model_{impl}"] = (float(val), float(jnp.abs(grads.layers.wq[...]).sum()))
    out("model", impl, res[f"model_{impl}"])
# timing fwd+bwd
B,T,H,K,D = 4, 4096, 16, 4, 128
q,k,v,seg = fa.packed_example(batch=B, length=T, heads=H, kv_heads=K, head_dim=D)
idx = jnp.broadcast_to(jnp.arange(T), (B,T))
from rl_jax.models.transformer import attention_mask
mask = attention_mask(idx, seg, idx, seg)
for impl in ("xla", fa.select_implementation("auto", backend=fa.current_backend(), dtype=q.dtype, head_dim=D, q_len=T, kv_len=T, causal_self=True, has_segment_ids=True)):
    f = jax.jit(jax.grad(lambda q,k,v: fa.fused_attention(q,k,v,mask,implementation=impl,segment_ids=seg,causal_self=True).astype(jnp.float32).sum(), argnums=(0,1,2)))
    jax.block_until_ready(f(q,k,v))
    t=time.perf_counter()
    for _ in range(10): out=f(q,k,v)
    jax.block_until_ready(out)
    out("time", impl, (time.perf_counter()-t)/10*1e3, "ms fwd+bwd", B,T,H,K,D)
