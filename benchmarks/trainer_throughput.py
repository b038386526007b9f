"""Trainer throughput against a measured ceiling, and blockwise vs full log-probs.

Everything is measured side by side in one run, so ratios are meaningful even on a shared, noisy
machine:

1. ceiling: dense matmul FLOP/s of this backend (the best a train step could reach);
2. train step: tokens/s and model FLOP/s (6·params·tokens + attention) → MFU against (1), with
   the layers as a rolled ``lax.scan`` and unrolled (``scan_layers``), side by side;
3. log-probs over a large vocabulary: blockwise vs full logits, compiled temporary memory and time
   for forward+backward.

With ``--shape=NAME`` (a named shape of ``rl_jax.models.shapes``, e.g. ``qwen2.5-0.5b``, random
weights) it times that model's train step instead, at ``--shape_batches`` (``BxT``), beside
``--torch``: the same HF architecture in PyTorch (``transformers``, SDPA attention, float32,
``torch.optim.AdamW``), one forward, backward and optimizer step on the same tokens, best of the
same repeats: ``jax_over_torch`` is the ratio of tokens/s (the aim is >= 1).

Usage: python benchmarks/trainer_throughput.py [--quick]
       python benchmarks/trainer_throughput.py --shape=qwen2.5-0.5b --torch
           --shape_batches=1x512 --out=benchmarks/results/trainer_qwen2.5-0.5b.json
Writes benchmarks/results/trainer_throughput.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.config import ModelConfig
from rl_jax.models.logprobs import blockwise_token_logprobs, full_token_logprobs
from rl_jax.trainer.state import ModelSpec, OptimizerConfig, init_state, make_optimizer
from rl_jax.trainer.step import LMBatch, causal_lm_loss, make_train_step

RESULTS = Path(__file__).parent / "results"


def timed(fn, *args, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds per call after warm-up (results blocked on)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_ceiling(n: int = 1024) -> float:
    a = jnp.ones((n, n), jnp.float32)
    b = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / timed(f, a, b, repeats=10)


def train_step_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Forward+backward FLOPs of one step: 6·N per token plus attention scores and values."""
    tokens = batch * seq
    dense = 6 * cfg.num_params(include_embeddings=False) * tokens
    unembed = 6 * cfg.hidden_size * cfg.vocab_size * tokens
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * tokens
    return float(dense + unembed + attention)


def bench_train_step(cfg: ModelConfig, batch: int, seq: int, scan_layers: bool = True,
                     repeats: int = 5) -> dict:
    spec = ModelSpec(cfg, mesh=None, scan_layers=scan_layers)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-4, warmup_steps=1, total_steps=1000))
    # The state is donated and carried from step to step, as the trainer runs it (PyTorch's
    # optimizer updates in place too): without donation every step allocates a new copy of the
    # parameters and moments.
    holder = [init_state(tx, spec, spec.init_params(seed=0))]
    step = make_train_step(spec, tx, causal_lm_loss)
    rng = np.random.RandomState(0)
    data = LMBatch.from_numpy(dict(
        tokens=rng.randint(0, cfg.vocab_size, (batch, seq)),
        targets=rng.randint(0, cfg.vocab_size, (batch, seq)),
        loss_mask=np.ones((batch, seq)), positions=np.tile(np.arange(seq), (batch, 1)),
        segment_ids=np.ones((batch, seq))))
    data = jax.device_put(data)
    def run():
        holder[0], metrics = step(holder[0], data)
        return metrics["loss"]

    seconds = timed(run, warmup=2 if repeats >= 5 else 1, repeats=repeats)
    flops = train_step_flops(cfg, batch, seq)
    return {"params": cfg.num_params(), "batch": batch, "seq": seq, "scan_layers": scan_layers,
            "step_s": seconds, "tokens_per_s": batch * seq / seconds,
            "flops_per_s": flops / seconds}


def bench_torch_train_step(cfg: ModelConfig, batch: int, seq: int, repeats: int) -> dict:
    """The same architecture in PyTorch (HF transformers, float32, SDPA): forward, cross-entropy
    over the vocabulary, backward and an AdamW step, best of ``repeats`` after one warm-up."""
    import torch
    import transformers

    hf = cfg.to_hf("float32")
    config = transformers.AutoConfig.for_model(
        hf.pop("model_type"), **{k: v for k, v in hf.items() if k != "architectures"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.RandomState(0)
    tokens = torch.from_numpy(rng.randint(0, cfg.vocab_size, (batch, seq)))
    targets = torch.from_numpy(rng.randint(0, cfg.vocab_size, (batch, seq)))

    def step():
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size).float(),
                                                 targets.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return {"params": sum(p.numel() for p in model.parameters()), "batch": batch, "seq": seq,
            "threads": torch.get_num_threads(), "step_s": best, "tokens_per_s": batch * seq / best,
            "flops_per_s": train_step_flops(cfg, batch, seq) / best}


def bench_logprobs(tokens: int, hidden: int, vocab: int, block: int) -> dict:
    rng = np.random.RandomState(0)
    h = jnp.asarray(rng.randn(tokens, hidden).astype(np.float32) * 0.1)
    w = jnp.asarray(rng.randn(hidden, vocab).astype(np.float32) * 0.1)
    t = jnp.asarray(rng.randint(0, vocab, tokens))
    out = {}
    for name, fn in (("blockwise", lambda h, w: blockwise_token_logprobs(
            h, w, t, block_size=block)[0].sum()), ("full", lambda h, w: full_token_logprobs(
                h, w, t)[0].sum())):
        grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        compiled = grad.lower(h, w).compile()
        mem = compiled.memory_analysis()
        out[name] = {"temp_bytes": int(mem.temp_size_in_bytes),
                     "seconds": timed(grad, h, w, repeats=3)}
    out["memory_ratio_full_over_blockwise"] = (out["full"]["temp_bytes"]
                                               / max(out["blockwise"]["temp_bytes"], 1))
    out["time_ratio_blockwise_over_full"] = out["blockwise"]["seconds"] / out["full"]["seconds"]
    out.update(tokens=tokens, hidden=hidden, vocab=vocab, block_size=block)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--shape", default=None,
                        help="a named shape (rl_jax.models.shapes) to time instead")
    parser.add_argument("--shape_batches", default="1x512",
                        help="comma-separated BxT of the named shape's steps")
    parser.add_argument("--torch", action="store_true",
                        help="time the same architecture's step in PyTorch beside it")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of a named shape")
    parser.add_argument("--unrolled", action="store_true",
                        help="the named shape's layers unrolled instead of a lax.scan")
    parser.add_argument("--out", default=str(RESULTS / "trainer_throughput.json"))
    args = parser.parse_args()

    print(f"backend: {jax.default_backend()} x{jax.device_count()} ({platform.processor()})")
    ceiling = matmul_ceiling(512 if args.quick else 1024)
    print(f"ceiling: dense f32 matmul {ceiling / 1e9:.1f} GFLOP/s")
    if args.shape:
        return main_shape(args, ceiling)

    models = {
        "tiny_lm (0.6M)": ModelConfig(vocab_size=15, hidden_size=128, intermediate_size=384,
                                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                                      tie_word_embeddings=True),
        "small (6M)": ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=768,
                                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32),
    }
    # (1, 320): the async-vs-sync benchmark's micro-batch (one packed row, 256 + 16 tokens).
    shapes = [(1, 320), (16, 128)] if args.quick else [(1, 320), (16, 128), (32, 256)]
    train = []
    for name, cfg in models.items():
        for batch, seq in shapes:
            pair = {}
            for scan in (True, False):
                r = bench_train_step(cfg, batch, seq, scan_layers=scan)
                r["model"] = name
                r["mfu_vs_matmul_ceiling"] = r["flops_per_s"] / ceiling
                train.append(r)
                pair[scan] = r
                print(f"train step {name:>15} B={batch:<3} T={seq:<4} "
                      f"{'scan    ' if scan else 'unrolled'} {r['tokens_per_s']:>9.0f} tok/s "
                      f"{r['flops_per_s'] / 1e9:6.2f} GFLOP/s  MFU vs ceiling "
                      f"{r['mfu_vs_matmul_ceiling']:.2f}")
            pair[False]["unrolled_over_scan"] = pair[True]["step_s"] / pair[False]["step_s"]
            print(f"{'':>26} unrolled / scan tokens/s: {pair[False]['unrolled_over_scan']:.2f}")

    lp = bench_logprobs(tokens=1024 if args.quick else 2048, hidden=256,
                        vocab=32768 if args.quick else 65536, block=4096)
    print(f"log-probs T={lp['tokens']} V={lp['vocab']}: temp memory full/blockwise "
          f"{lp['memory_ratio_full_over_blockwise']:.1f}x "
          f"({lp['full']['temp_bytes'] / 2**20:.0f} MiB vs "
          f"{lp['blockwise']['temp_bytes'] / 2**20:.0f} MiB), time blockwise/full "
          f"{lp['time_ratio_blockwise_over_full']:.2f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": jax.default_backend(), "devices": jax.device_count(),
                               "matmul_ceiling_flops": ceiling, "train_step": train,
                               "logprobs": lp}, indent=2))
    print(f"wrote {out}")


def main_shape(args, ceiling: float) -> None:
    """A named shape's train step (and PyTorch's beside it): ``--shape``."""
    from rl_jax.models.shapes import shape as named_shape
    cfg = named_shape(args.shape)
    rows = []
    for spec in args.shape_batches.split(","):
        batch, seq = (int(v) for v in spec.lower().split("x"))
        row = {"model": args.shape, "jax": bench_train_step(cfg, batch, seq,
                                                             scan_layers=not args.unrolled,
                                                             repeats=args.repeats)}
        row["jax"]["mfu_vs_matmul_ceiling"] = row["jax"]["flops_per_s"] / ceiling
        print(f"train step {args.shape} B={batch} T={seq} jax: {row['jax']['step_s']:.2f} s, "
              f"{row['jax']['tokens_per_s']:.1f} tok/s, MFU vs ceiling "
              f"{row['jax']['mfu_vs_matmul_ceiling']:.2f}", flush=True)
        if args.torch:
            row["torch"] = bench_torch_train_step(cfg, batch, seq, args.repeats)
            row["torch"]["mfu_vs_matmul_ceiling"] = row["torch"]["flops_per_s"] / ceiling
            row["jax_over_torch"] = row["jax"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
            print(f"{'':>20} torch: {row['torch']['step_s']:.2f} s, "
                  f"{row['torch']['tokens_per_s']:.1f} tok/s ({row['torch']['threads']} "
                  f"threads) -> jax / torch {row['jax_over_torch']:.2f}", flush=True)
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"backend": jax.default_backend(), "devices": jax.device_count(),
              "matmul_ceiling_flops": ceiling, "shape": args.shape,
              "params": cfg.num_params(), "rows": rows}
    out.write_text(json.dumps(result, indent=2))
    plot_shape(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot_shape(result: dict, path: Path) -> None:
    """Tokens/s and MFU (against the run's matmul ceiling) of each batch shape, JAX beside
    PyTorch where it ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    labels = [f"{r['jax']['batch']}x{r['jax']['seq']}" for r in rows]
    at = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s"),
                           (axes[1], "mfu_vs_matmul_ceiling", "MFU vs the matmul ceiling")):
        ax.bar(at - 0.2, [r["jax"][key] for r in rows], width=0.4, label="JAX (this project)")
        if any("torch" in r for r in rows):
            ax.bar(at + 0.2, [r.get("torch", {}).get(key, 0.0) for r in rows], width=0.4,
                   label="PyTorch (transformers)")
        ax.set_xticks(at, labels)
        ax.set_xlabel("batch x tokens")
        ax.set_title(f"{result['shape']} train step: {title}")
        ax.legend(fontsize=8)
    for i, r in enumerate(rows):
        if "jax_over_torch" in r:
            axes[0].annotate(f"{r['jax_over_torch']:.2f}x", (i, r["jax"]["tokens_per_s"]),
                             ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
