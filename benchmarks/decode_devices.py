"""Decode steps split over host devices: one runner against K runners on K devices, side by side.

A decode step runs its ops one after another: the dense matmuls (compute-bound) and the attention
over the KV cache (memory-bound) never overlap within one step. Two independent steps on two
host devices of one process can: one device's matmuls run while the other reads its cache. This
measures how much, for the engine's own jitted decode step (``ModelRunner.decode``, sampling
included, tokens fed back on the device):

- ``one``: one runner with ``B`` slots on one device, ``N - 1`` decode steps;
- ``split K``: ``K`` runners, each with ``B / K`` slots and its own cache on its own host device
  (``--xla_force_host_platform_device_count``), every step dispatched to all of them before any
  is awaited.

Each ``K`` is measured in its own process with exactly ``K`` host devices, beside ``one`` in
that process: the count matters (with 4 devices in the process, 2 runners on 2 of them gain
~5% where they gain ~20% in a process of 2). Each time is the best of ``--repeats`` interleaved
runs (other processes only ever add time); the ratio ``one / split`` is printed per batch
size.

Usage: python benchmarks/decode_devices.py [--model small] [--batches 32,64,128] [--splits 2,4]
Writes benchmarks/results/decode_devices.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="a model of generator_throughput.py")
    parser.add_argument("--batches", default="32,64,128", help="comma-separated batch sizes")
    parser.add_argument("--splits", default="2,4", help="comma-separated device counts K")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=512,
                        help="KV-cache length per slot (EngineConfig default: 512)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main():
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    splits = [int(k) for k in args.splits.split(",")]
    bad = [(b, k) for b in batches for k in splits if k < 2 or b % k]
    if bad:
        sys.exit(f"every batch size must split evenly over every K >= 2; not {bad}")
    if len(splits) > 1:  # one process per K, each with exactly K host devices
        import subprocess
        parts = []
        for k in splits:
            cmd = [sys.executable, __file__, *sys.argv[1:], f"--splits={k}"]
            done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            print(done.stdout, end="", flush=True)
            parts.append(json.loads((RESULTS_DIR / "decode_devices.json").read_text()))
        rows = {}
        for part in parts:
            for row in part["rows"]:
                merged = rows.setdefault(row["batch"], {"batch": row["batch"], "step_s": {},
                                                        "times_s": {}, "one_over_split": {}})
                k = part["splits"][0]
                merged["step_s"][f"one ({k} devices)"] = row["step_s"]["one"]
                merged["times_s"][f"one ({k} devices)"] = row["times_s"]["one"]
                for key in ("step_s", "times_s", "one_over_split"):
                    merged[key].update({n: v for n, v in row[key].items() if n != "one"})
        result = {**parts[0], "splits": splits, "rows": [rows[b] for b in batches]}
        (RESULTS_DIR / "decode_devices.json").write_text(json.dumps(result, indent=1))
        print("ratios one / split:", "; ".join(
            f"batch {r['batch']}: " + ", ".join(f"{n} {v:.2f}x"
                                               for n, v in r["one_over_split"].items())
            for r in result["rows"]))
        print(f"wrote {RESULTS_DIR / 'decode_devices.json'}")
        return
    # The device count must be set before jax is imported.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={max(splits)}").strip()
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parent.parent))
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from generator_throughput import MODELS, admit_prompts, log, prompts_for

    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.sharding import make_mesh
    from rl_jax.trainer.state import ModelSpec

    if args.model not in MODELS:
        sys.exit(f"--model must be one of {sorted(MODELS)}, not {args.model!r}")
    cfg = MODELS[args.model]
    params = ModelSpec(cfg, mesh=None).init_params(seed=0)
    devices = jax.devices()
    max_seq_len = args.max_seq_len
    p, n = args.prompt_len, args.new_tokens

    def runners(k: int, batch: int) -> list:
        """``k`` runners of ``batch / k`` slots, one per device, with their own weights."""
        out = []
        for device in devices[:k]:
            mesh = make_mesh(data=1, fsdp=1, tensor=1, devices=[device])
            placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
            runner = ModelRunner(cfg, max_slots=batch // k, max_seq_len=max_seq_len, mesh=mesh)
            out.append((runner, placed, runner.prepare(placed)))
        return out

    def seconds_per_step(group: list, prompts) -> float:
        """Prefills each runner's share of ``prompts``, then times ``n - 1`` decode steps with
        every runner's step dispatched before any is awaited."""
        share = len(prompts) // len(group)
        for j, (runner, placed, _) in enumerate(group):
            jax.block_until_ready(admit_prompts(runner, placed, prompts[j * share:(j + 1) * share]))
        outs = []
        start = time.perf_counter()
        for i in range(1, n):
            outs = [runner.decode(weights, share, p + i, False) for runner, _, weights in group]
        jax.block_until_ready(outs)
        return (time.perf_counter() - start) / (n - 1)

    rows = []
    log(f"{args.model}: {cfg.num_params() / 1e6:.2f}M params on {len(devices)} host devices "
        f"({os.cpu_count()} cores)")
    for batch in batches:
        prompts = prompts_for(cfg, batch, p, seed=batch)
        groups = {"one": runners(1, batch), **{f"split {k}": runners(k, batch) for k in splits}}
        for group in groups.values():  # warm-up: compiles every cache length the runs meet
            seconds_per_step(group, prompts)
        times = {name: [] for name in groups}
        for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
            for name, group in groups.items():
                times[name].append(seconds_per_step(group, prompts))
        best = {name: min(t) for name, t in times.items()}
        row = {"batch": batch, "step_s": best, "times_s": times,
               "one_over_split": {name: best["one"] / s for name, s in best.items()
                                  if name != "one"}}
        rows.append(row)
        log(f"batch {batch:4d}: one device {best['one'] * 1e3:.2f} ms/step; " + ", ".join(
            f"{name} {best[name] * 1e3:.2f} ms ({row['one_over_split'][name]:.2f}x)"
            for name in groups if name != "one"))
        del groups
    result = {"model": args.model, "cores": os.cpu_count(), "splits": splits,
              "prompt_len": p, "new_tokens": n, "max_seq_len": max_seq_len,
              "repeats": args.repeats, "load_average": os.getloadavg(), "rows": rows}
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "decode_devices.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
