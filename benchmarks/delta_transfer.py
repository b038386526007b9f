r"""Bytes shipped and time per version: the ``delta`` transport against whole versions.

A real model of a named shape trains for ``--steps`` AdamW steps (float32 master weights,
next-token loss on random tokens: every weight gets a real gradient, at an RL-sized learning
rate, ``--lr``); after each step the parameters are published in bfloat16 (the generators'
dtype) and pulled by two pullers side by side in this process: one over ``socket`` (every byte
of every version, over HTTP) and one over ``delta`` (the changed bytes since its previous
version, zstd-compressed XORs, rebuilt and checked against the digests). The first version
comes whole to both.

Per version: bytes each puller received, the delta's share of a whole version, the fraction of
bfloat16 values that changed, and each pull's time on loopback; from those, the time a version
takes over a link of ``--link_gbps`` (bytes / link + the pull's time on loopback, which holds
the compression work). Writes ``benchmarks/results/delta_transfer.json``.

    python benchmarks/delta_transfer.py [--shape=qwen2.5-0.5b] [--steps=4] [--lr=1e-6]
        [--link_gbps=1,10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--link_gbps", default="1,10", help="links to price versions on (Gb/s)")
    parser.add_argument("--out", default=str(RESULTS / "delta_transfer.json"))
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from rl_jax.generator.engine.weights import generator_rules
    from rl_jax.models.shapes import shape as named_shape
    from rl_jax.trainer.state import ModelSpec, OptimizerConfig, init_state, make_optimizer
    from rl_jax.trainer.step import LMBatch, causal_lm_loss, make_train_step
    from rl_jax.transfer.config import PublisherConfig, PullerConfig
    from rl_jax.transfer.layout import flatten
    from rl_jax.transfer.publisher.core import Publisher
    from rl_jax.transfer.puller.core import Puller

    cfg = named_shape(args.shape)
    spec = ModelSpec(cfg, mesh=None, dtype=jnp.bfloat16)  # bf16 compute, f32 master weights
    tx = make_optimizer(OptimizerConfig(learning_rate=args.lr, warmup_steps=0,
                                        total_steps=max(args.steps, 1), final_lr_ratio=1.0))
    state = init_state(tx, spec, spec.init_params(seed=0))
    step = make_train_step(spec, tx, causal_lm_loss)
    gen = ModelSpec(cfg, mesh=None, rules=generator_rules())
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, ml_dtypes.bfloat16, sharding=s),
        gen.abstract_params, gen.param_shardings)
    publisher = Publisher(PublisherConfig(transports=("socket", "delta")), spec=spec)
    pullers = {t: Puller(publisher.url, target, transports=[t],
                         config=PullerConfig(timeout_s=600)) for t in ("socket", "delta")}
    for p in pullers.values():
        p.register()
    publisher.wait_for_layouts(1, 60)
    rng = np.random.default_rng(0)
    rows, previous = [], None
    try:
        for version in range(args.steps + 1):
            if version:
                tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
                batch = LMBatch.from_numpy({
                    "tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                    "loss_mask": np.ones((args.batch, args.seq)),
                    "positions": np.broadcast_to(np.arange(args.seq), (args.batch, args.seq)),
                    "segment_ids": np.ones((args.batch, args.seq))})
                state, metrics = step(state, batch)
                jax.block_until_ready(state.params)
            publisher.publish(state.params, version + 1)
            row = {"version": version + 1}
            for name, puller in pullers.items():
                start = time.perf_counter()
                update = puller.pull(version, wait_s=60)
                row[name] = {"bytes": update.metrics.bytes,
                             "seconds": time.perf_counter() - start}
                if name == "delta":
                    current = {n: np.asarray(v).view(np.uint16).copy()
                               for n, v in flatten(update.params).items()}
                del update
            if previous is not None:
                changed = sum(int((current[n] != previous[n]).sum()) for n in current)
                row["changed_fraction"] = changed / sum(v.size for v in current.values())
            previous = current
            row["delta_share"] = row["delta"]["bytes"] / row["socket"]["bytes"]
            rows.append(row)
            print(f"version {row['version']}: socket {row['socket']['bytes'] / 1e6:.1f} MB in "
                  f"{row['socket']['seconds']:.2f} s, delta {row['delta']['bytes'] / 1e6:.1f} "
                  f"MB ({row['delta_share']:.1%}) in {row['delta']['seconds']:.2f} s"
                  + (f"; {row['changed_fraction']:.2%} of bf16 values changed"
                     if "changed_fraction" in row else ""), flush=True)
        stats = dict(pullers["delta"]._pulls["delta"].stats)
    finally:
        publisher.close()
    later = rows[1:]
    links = [float(x) for x in args.link_gbps.split(",") if x]
    summary = {}
    for link in links:
        per = {t: float(np.median([r[t]["bytes"] * 8 / (link * 1e9) + r[t]["seconds"]
                                   for r in later])) for t in ("socket", "delta")}
        summary[f"{link:g}Gbps"] = {"socket_s": per["socket"], "delta_s": per["delta"],
                                    "speedup": per["socket"] / per["delta"]}
    result = {"shape": args.shape, "lr": args.lr, "steps": args.steps,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg": os.getloadavg()},
              "version_bytes": rows[0]["socket"]["bytes"], "rows": rows, "delta_stats": stats,
              "median_delta_share": float(np.median([r["delta_share"] for r in later])),
              "per_version_on_links": summary}
    print(f"median delta share {result['median_delta_share']:.1%} of a whole version; "
          + ", ".join(f"{k}: {v['socket_s']:.2f} s whole vs {v['delta_s']:.2f} s delta "
                      f"({v['speedup']:.1f}x)" for k, v in summary.items()), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
