"""Tokens/s of each pool on whatever ``jax.devices()`` is, recorded with the device and software,
and merged across accelerators into one comparison table.

One command runs, in this order (each part reuses the existing benchmark's functions):

1. generator: decode step latency and tokens/s against batch size, engine end to end and its raw
   jitted step, against the roofline of the measured matmul FLOP/s and read bandwidth
   (``generator_throughput.py``; no HF baseline here);
2. trainer: train-step tokens/s and MFU against the same measured matmul peak, for several
   micro-batch sizes (``trainer_throughput.py``);
3. transfer: weight publication + pull GB/s between a trainer process and a generator process
   (``transfer_throughput.py --quick``; CPU hosts only, its workers force host devices);
4. end to end: trained tokens/s of the tiny RL recipe in ``sync``, ``one_step_off`` and ``async``
   (``async_vs_sync.py --steps=20``, ``--steps=8`` with ``--quick``: trainer and generator
   server as separate processes), with the systems model's prediction of each mode beside it;
5. ahead-of-time compile check: the sharded train step of a realistic target (default Qwen2-1.5B
   shape, bf16 compute, f32 parameters, AdamW) lowered and compiled from ``ShapeDtypeStruct``s
   only, on 8 host CPU devices forced in a subprocess (``XLA_FLAGS`` set before jax is
   imported), for each requested ``data,fsdp,tensor`` mesh; reports the compiled per-device
   memory against the systems model's expectation. Sharding or memory errors of the target
   show up here without the hardware.

Every result carries device kind, count, platform and software versions. Output:
``results/pools/<device>.json`` (its ``models`` block has the generator benchmark's format, so
``launch.plan --latency_file`` reads it), ``results/pools/<device>.md``, a measured accelerator
description ``results/pools/accelerators/<device>.json`` (``launch.plan --accelerator=<it>``), and
``results/pools/comparison.md`` merging every ``results/pools/*.json``.

Usage: python benchmarks/pools.py [--quick] [--skip transfer,aot] [--aot-mesh 1,8,1 --aot-mesh 1,4,2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "pools"
PARTS = ("generator", "trainer", "transfer", "e2e", "aot")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")

# AOT targets: published config.json shapes (vocabulary, hidden, MLP, layers, heads, KV heads,
# head dim, tied embeddings, architecture).
AOT_TARGETS = {
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                       num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True,
                       architecture="Qwen2ForCausalLM", attention_bias=True),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                     num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False,
                     architecture="Qwen2ForCausalLM", attention_bias=True),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
                  num_heads=8, num_kv_heads=4, head_dim=32, tie_word_embeddings=False,
                  architecture="LlamaForCausalLM"),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
                 architecture="LlamaForCausalLM"),
}


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sibling(name: str):
    """The benchmark script ``benchmarks/<name>.py`` as a module."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return __import__(name)


# ---- environment ----------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    import jax
    devices = jax.devices()
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
            "device_count": len(devices), "process_count": jax.process_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu_model(), "cpus": os.cpu_count(), "versions": versions,
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average_before": list(os.getloadavg())}


def device_slug(env: dict) -> str:
    kind = env["device_kind"] if env["backend"] != "cpu" else env["cpu"]
    slug = f"{env['backend']}-{kind}-x{env['device_count']}".lower()
    return re.sub(r"[^a-z0-9.]+", "-", slug).strip("-")


# ---- the pools ------------------------------------------------------------------------------------

def measure_ceilings(quick: bool) -> dict:
    gen = sibling("generator_throughput")
    flops = gen.matmul_peak_flops((512, 1024) if quick else (1024, 2048))
    bandwidth = gen.memory_bandwidth(256 if quick else 512)
    return {"peak_flops": flops["flops_per_s"], "bandwidth": bandwidth["read_bytes_per_s"],
            "matmul": flops, "memory": bandwidth}


def measure_generator(quick: bool, ceilings: dict) -> list[dict]:
    import tempfile
    gen = sibling("generator_throughput")
    args = SimpleNamespace(no_hf=True, new_tokens=32 if quick else 128, prompt_len=32,
                           batches=[1, 16, 64] if quick else [1, 4, 16, 32, 64],
                           max_seq_len=512, repeats=2 if quick else 3)
    names = ["small"] if quick else ["small", "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        results = [gen.bench_model(name, gen.MODELS[name], args, ceilings, Path(tmp))
                   for name in names]
    for result in results:
        gen.print_table(result)
    return results


def measure_trainer(quick: bool, peak_flops: float) -> list[dict]:
    trainer = sibling("trainer_throughput")
    gen = sibling("generator_throughput")
    rows = []
    for micro in ([4, 16] if quick else [4, 8, 16, 32]):
        row = trainer.bench_train_step(gen.MODELS["small"], micro, 128)
        row.update(model="small", micro_batch=micro, mfu=row["flops_per_s"] / peak_flops)
        log(f"trainer small B={micro:<3} T=128: {row['tokens_per_s']:,.0f} tok/s, "
            f"MFU {row['mfu']:.2f} of the measured matmul peak")
        rows.append(row)
    return rows


def measure_transfer(env: dict) -> dict | None:
    if env["backend"] != "cpu":
        log("transfer: skipped (the transfer benchmark's workers run on host CPU devices)")
        return None
    transfer = sibling("transfer_throughput")
    return transfer.run(SimpleNamespace(quick=True, repeats=0, disk_dir=None, disk_1gb=False,
                                        variants=[]))


def measure_e2e(quick: bool) -> dict | None:
    """The three RL modes end to end (``async_vs_sync.py``, 20 steps or 8 when quick), in a
    scratch work directory; returns that benchmark's result (rows per mode, predictions)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="pools-e2e-") as tmp:
        cmd = [sys.executable, str(BENCH_DIR / "async_vs_sync.py"),
               f"--steps={8 if quick else 20}",
               f"--workdir={tmp}", f"--results_dir={tmp}"]
        log("e2e: " + " ".join(cmd[1:]))
        done = subprocess.run(cmd, cwd=BENCH_DIR.parent, capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
        if done.returncode != 0:
            log(f"e2e FAILED:\n{done.stderr[-3000:]}")
            return {"error": done.stderr[-3000:]}
        result = json.loads((Path(tmp) / "async_vs_sync.json").read_text())
    for row in result["rows"]:
        pred = result.get("predictions", {}).get("modes", {}).get(row["mode"], {})
        log(f"e2e {row['mode']:<13} {row['trained_tokens_per_s']:,.0f} trained tok/s "
            f"({row['vs_sync']:.2f}x sync), staleness max {row['staleness_max']:.0f}"
            + (f", predicted {pred['tokens_per_s']:,.0f} ({pred['relative_error']:+.0%})"
               if pred else ""))
    return result


# ---- ahead-of-time compile check ------------------------------------------------------------------

def aot_check(target: str, mesh_shape: tuple[int, int, int], batch: int, seq: int,
              microbatches: int, remat: str) -> dict:
    """Lowers and compiles the sharded train step of ``target`` from abstract shapes only."""
    import jax
    import jax.numpy as jnp

    from rl_jax.models.config import ModelConfig
    from rl_jax.sharding import make_mesh
    from rl_jax.sysmodel.shape import ModelShape
    from rl_jax.trainer.state import ModelSpec, OptimizerConfig, abstract_state, make_optimizer
    from rl_jax.trainer.step import (LMBatch, causal_lm_loss, default_batch_sharding,
                                     make_train_step)

    cfg = ModelConfig(**AOT_TARGETS[target])
    data, fsdp, tensor = mesh_shape
    out = {"target": target, "params": cfg.num_params(), "mesh": {"data": data, "fsdp": fsdp,
           "tensor": tensor}, "batch": batch, "seq": seq, "microbatches": microbatches,
           "remat": remat, "devices": jax.device_count(), "dtype": "bfloat16",
           "param_dtype": "float32"}
    start = time.perf_counter()
    try:
        mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
        spec = ModelSpec(cfg, mesh=mesh, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         remat=remat)
        tx = make_optimizer(OptimizerConfig())
        step = make_train_step(spec, tx, causal_lm_loss, num_microbatches=microbatches)
        state = abstract_state(tx, spec)
        tokens = LMBatch.abstract(batch, seq, sharding=default_batch_sharding(spec))
        lowered = step.lower(state, tokens)
        out["lower_s"] = time.perf_counter() - start
        compiled = lowered.compile()
        out["compile_s"] = time.perf_counter() - start - out["lower_s"]
    except Exception as e:  # the point of the check: report what fails to shard or compile
        out.update(ok=False, error=f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}")
        return out
    mem = compiled.memory_analysis()
    stats = {name: int(getattr(mem, f"{name}_size_in_bytes")) for name in
             ("argument", "output", "alias", "temp", "generated_code")}
    stats["peak_estimate"] = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    shape = ModelShape.from_model_config(cfg)
    # f32 parameters and two f32 Adam moments, split over the fsdp and tensor axes
    out.update(ok=True, per_device_bytes=stats,
               expected_state_bytes_per_device=shape.params * (4 + 8) / (fsdp * tensor),
               xla_cost_flops=float(cost.get("flops", 0.0)) if cost else None,  # per device
               model_train_flops=shape.train_flops_per_token(seq) * batch * seq)
    return out


def run_aot(args) -> list[dict]:
    results = []
    for mesh in args.aot_mesh:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--role", "aot", "--aot-target", args.aot_target,
               "--aot-mesh", mesh, "--aot-batch", str(args.aot_batch), "--aot-seq",
               str(args.aot_seq), "--aot-microbatches", str(args.aot_microbatches),
               "--aot-remat", args.aot_remat]
        log(f"AOT: {args.aot_target} on mesh (data, fsdp, tensor) = ({mesh}) of 8 host devices")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("@@ ")]
        if proc.returncode or not lines:
            results.append({"target": args.aot_target, "mesh": mesh, "ok": False,
                            "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"})
        else:
            results.append(json.loads(lines[-1][3:]))
        r = results[-1]
        if r["ok"]:
            mem = r["per_device_bytes"]
            log(f"AOT ok in {r['lower_s'] + r['compile_s']:.1f} s: per device arguments "
                f"{mem['argument'] / 2**30:.2f} GiB (model: state "
                f"{r['expected_state_bytes_per_device'] / 2**30:.2f} GiB), temporaries "
                f"{mem['temp'] / 2**30:.2f} GiB, peak estimate {mem['peak_estimate'] / 2**30:.2f} GiB")
        else:
            log(f"AOT FAILED: {r['error'][:500]}")
    return results


# ---- reports ----------------------------------------------------------------------------------------

def measured_accelerator(env: dict, ceilings: dict, transfer: dict | None) -> dict:
    """An accelerator description (``rl_jax.sysmodel.accelerators.Accelerator``) from this run's numbers."""
    rows = (transfer or {}).get("rows") or []
    link = (max(r["memcpy_gbps"] for r in rows) * 1e9 if rows else ceilings["bandwidth"])
    try:
        import jax
        capacity = jax.devices()[0].memory_stats()["bytes_limit"]
    except Exception:  # CPU devices report no memory stats
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"name": device_slug(env), "description": f"{env['device_kind']} ({env['cpu']})"
            if env["backend"] == "cpu" else env["device_kind"],
            "peak_flops": {"float32": ceilings["peak_flops"]},
            "memory_bandwidth": ceilings["bandwidth"], "memory_capacity": float(capacity),
            "interconnect_bandwidth": 2 * link, "interconnect": "memcpy" if rows else
            "memory (unmeasured link)", "collective_latency_s": 20e-6,
            "source": f"measured by benchmarks/pools.py on {env['date']}"}


def summary_row(result: dict) -> dict:
    env = result["env"]
    row = {"device": f"{env['device_kind']} x{env['device_count']}", "backend": env["backend"],
           "date": env["date"][:10], "jax": env["versions"].get("jax"),
           "matmul_tflops": result["ceilings"]["peak_flops"] / 1e12,
           "read_gbps": result["ceilings"]["bandwidth"] / 1e9}
    small = [m for m in result.get("models") or [] if m["model"] == "small"]
    if small:
        best = max(small[0]["rows"], key=lambda r: r["engine_tok_s"])
        row.update(decode_tok_s=best["engine_tok_s"], decode_batch=best["batch"],
                   decode_vs_roofline=best["engine_over_roofline"])
    if result.get("trainer"):
        best = max(result["trainer"], key=lambda r: r["tokens_per_s"])
        row.update(train_tok_s=best["tokens_per_s"], train_mfu=best["mfu"],
                   train_micro=best["micro_batch"])
    if result.get("transfer"):
        big = [r for r in result["transfer"]["rows"] if r["model_bytes"] >= 100e6]
        if big:
            best = max(big, key=lambda r: r["end_to_end_gbps"])
            row.update(transfer_gbps=best["end_to_end_gbps"], transfer_via=best["transport"])
    e2e = result.get("e2e") or {}
    by_mode = {r["mode"]: r for r in e2e.get("rows", [])}
    if "async" in by_mode and "sync" in by_mode:
        row.update(e2e_sync_tok_s=by_mode["sync"]["trained_tokens_per_s"],
                   e2e_async_tok_s=by_mode["async"]["trained_tokens_per_s"],
                   e2e_async_vs_sync=by_mode["async"]["vs_sync"])
    if result.get("aot"):
        row["aot"] = "; ".join(
            (f"{a['target']} ({a['mesh']['data']},{a['mesh']['fsdp']},{a['mesh']['tensor']}): "
             f"{a['per_device_bytes']['peak_estimate'] / 2**30:.1f} GiB/device")
            if a.get("ok") else f"{a['target']} ({a['mesh']}): FAILED" for a in result["aot"])
    return row


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def comparison_markdown(results: list[dict]) -> str:
    lines = ["# Pools across accelerators", "",
             "Written by `benchmarks/pools.py` from `results/pools/*.json`. Decode: the engine "
             "end to end on the 7M-parameter `small` model at its best batch; train: the same "
             "model, T=128, best micro-batch; MFU against the measured matmul peak; transfer: "
             "fastest publish+pull at >= 100 MB; e2e: trained tokens/s of the tiny RL recipe, "
             "sync and async (20 steps); AOT: compiled per-device peak of the train step "
             "target.", "",
             "| device | backend | date | jax | matmul TFLOP/s | read GB/s | decode tok/s (B) | "
             "decode / roofline | train tok/s (micro) | MFU | transfer GB/s | "
             "e2e tok/s sync / async | AOT |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        r = summary_row(result)
        lines.append(
            f"| {r['device']} | {r['backend']} | {r['date']} | {r['jax']} | "
            f"{r['matmul_tflops']:.3f} | {r['read_gbps']:.1f} | "
            f"{fmt(r.get('decode_tok_s'), ',.0f')} ({r.get('decode_batch', '-')}) | "
            f"{fmt(r.get('decode_vs_roofline'), '.2f')} | {fmt(r.get('train_tok_s'), ',.0f')} "
            f"({r.get('train_micro', '-')}) | {fmt(r.get('train_mfu'), '.2f')} | "
            f"{fmt(r.get('transfer_gbps'), '.2f')} {r.get('transfer_via', '')} | "
            f"{fmt(r.get('e2e_sync_tok_s'), ',.0f')} / {fmt(r.get('e2e_async_tok_s'), ',.0f')} "
            f"({fmt(r.get('e2e_async_vs_sync'), '.2f')}x) | {r.get('aot', '-')} |")
    return "\n".join(lines) + "\n"


def run_markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# Pools on {env['device_kind']} x{env['device_count']} ({env['backend']})", "",
             f"{env['date']}, commit {env['commit']}, {env['cpu']}, {env['cpus']} CPUs, "
             f"python {env['python']}, " + ", ".join(f"{k} {v}" for k, v in
                                                     env["versions"].items()), "",
             f"Ceilings: matmul {result['ceilings']['peak_flops'] / 1e9:,.1f} GFLOP/s, read "
             f"bandwidth {result['ceilings']['bandwidth'] / 1e9:,.1f} GB/s.", ""]
    for model in result.get("models") or []:
        lines += [f"## Generator decode: {model['model']} ({model['params'] / 1e6:.1f}M params)",
                  "", "| batch | engine step ms | engine tok/s | raw step ms | roofline ms | "
                  "engine / roofline |", "|---|---|---|---|---|---|"]
        for r in model["rows"]:
            lines.append(f"| {r['batch']} | {r['engine_step_s'] * 1e3:.2f} | "
                         f"{r['engine_tok_s']:,.0f} | {r['raw_step_s'] * 1e3:.2f} | "
                         f"{r['roofline_step_s'] * 1e3:.2f} | {r['engine_over_roofline']:.2f} |")
        lines.append("")
    if result.get("trainer"):
        lines += ["## Trainer (small model, T=128)", "",
                  "| micro-batch | step s | tokens/s | GFLOP/s | MFU |", "|---|---|---|---|---|"]
        for r in result["trainer"]:
            lines.append(f"| {r['micro_batch']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['flops_per_s'] / 1e9:,.1f} | {r['mfu']:.2f} |")
        lines.append("")
    if result.get("transfer"):
        lines += ["## Weight transfer (trainer 8 host devices -> generator 1 device)", "",
                  "| size | transport | publish GB/s | pull GB/s | publish+pull GB/s |",
                  "|---|---|---|---|---|"]
        for r in result["transfer"]["rows"]:
            lines.append(f"| {r['size']} | {r['transport']} | {r['publish_gbps']:.2f} | "
                         f"{r['pull_gbps']:.2f} | {r['end_to_end_gbps']:.2f} |")
        lines.append("")
    e2e = result.get("e2e") or {}
    if e2e.get("rows"):
        predictions = e2e.get("predictions", {}).get("modes", {})
        lines += ["## End to end: the tiny RL recipe in each mode", "",
                  f"{e2e['steps']} steps of {e2e['batch']['groups_per_batch']} x "
                  f"{e2e['batch']['group_size']} samples, lognormal completion lengths "
                  f"(p99/p50 {e2e['lengths']['p99_over_p50']:.1f}).", "",
                  "| mode | trained tok/s | vs sync | staleness max | trainer idle | "
                  "generator idle | predicted tok/s | error |", "|---|---|---|---|---|---|---|---|"]
        for r in e2e["rows"]:
            p = predictions.get(r["mode"], {})
            lines.append(f"| {r['mode']} | {r['trained_tokens_per_s']:,.0f} | "
                         f"{r['vs_sync']:.2f} | {r['staleness_max']:.0f} | "
                         f"{r['trainer_idle_fraction']:.2f} | {r['generator_idle_fraction']:.2f} | "
                         f"{fmt(p.get('tokens_per_s'), ',.0f')} | "
                         f"{fmt(p.get('relative_error'), '+.0%')} |")
        lines.append("")
    if result.get("aot"):
        lines += ["## Ahead-of-time compile check of the train step", "",
                  "| target | mesh (d,f,t) | batch x seq | ok | compile s | args GiB/dev | "
                  "model state GiB/dev | temp GiB/dev | peak GiB/dev |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in result["aot"]:
            if a.get("ok"):
                m, gib = a["per_device_bytes"], 2 ** 30
                lines.append(
                    f"| {a['target']} | {a['mesh']['data']},{a['mesh']['fsdp']},"
                    f"{a['mesh']['tensor']} | {a['batch']} x {a['seq']} | yes | "
                    f"{a['compile_s']:.1f} | {m['argument'] / gib:.2f} | "
                    f"{a['expected_state_bytes_per_device'] / gib:.2f} | {m['temp'] / gib:.2f} | "
                    f"{m['peak_estimate'] / gib:.2f} |")
            else:
                lines.append(f"| {a['target']} | {a['mesh']} | | NO: {a['error'][:200]} | | | | | |")
        lines.append("")
    return "\n".join(lines)


def merge_all(directory: Path) -> list[dict]:
    results = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "env" in data and "ceilings" in data:
            results.append(data)
    return results


# ---- main -----------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to skip: {PARTS}")
    parser.add_argument("--aot-target", default="qwen2-1.5b", choices=sorted(AOT_TARGETS))
    parser.add_argument("--aot-mesh", action="append", default=None,
                        help="data,fsdp,tensor of 8 host devices (repeatable; default 1,8,1 and "
                             "1,4,2)")
    parser.add_argument("--aot-batch", type=int, default=8)
    parser.add_argument("--aot-seq", type=int, default=2048)
    parser.add_argument("--aot-microbatches", type=int, default=1)
    parser.add_argument("--aot-remat", default="full", choices=("none", "full", "dots"))
    parser.add_argument("--outdir", default=str(RESULTS))
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "aot":
        mesh = tuple(int(x) for x in args.aot_mesh[0].split(","))
        print("@@ " + json.dumps(aot_check(args.aot_target, mesh, args.aot_batch, args.aot_seq,
                                           args.aot_microbatches, args.aot_remat)), flush=True)
        return
    args.aot_mesh = args.aot_mesh or ["1,8,1", "1,4,2"]
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(PARTS)
    if unknown:
        parser.error(f"unknown parts to skip {sorted(unknown)}; parts: {PARTS}")

    env = environment()
    log(f"devices: {env['device_kind']} x{env['device_count']} ({env['backend']}), "
        f"{env['cpu']}; jax {env['versions']['jax']}")
    result = {"env": env, "settings": {"quick": args.quick, "skip": sorted(skip)}}
    result["ceilings"] = ceilings = measure_ceilings(args.quick)
    log(f"ceilings: matmul {ceilings['peak_flops'] / 1e9:.1f} GFLOP/s, read "
        f"{ceilings['bandwidth'] / 1e9:.1f} GB/s")
    if "generator" not in skip:
        result["models"] = measure_generator(args.quick, ceilings)
    if "trainer" not in skip:
        result["trainer"] = measure_trainer(args.quick, ceilings["peak_flops"])
    if "transfer" not in skip:
        result["transfer"] = measure_transfer(env)
    if "e2e" not in skip:
        result["e2e"] = measure_e2e(args.quick)
    if "aot" not in skip:
        result["aot"] = run_aot(args)
    env["load_average_after"] = list(os.getloadavg())

    out = Path(args.outdir)
    (out / "accelerators").mkdir(parents=True, exist_ok=True)
    slug = device_slug(env)
    (out / f"{slug}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{slug}.md").write_text(run_markdown(result))
    (out / "accelerators" / f"{slug}.json").write_text(json.dumps(
        measured_accelerator(env, ceilings, result.get("transfer")), indent=1))
    comparison = comparison_markdown(merge_all(out))
    (out / "comparison.md").write_text(comparison)
    print()
    print(comparison)
    log(f"wrote {out / (slug + '.json')}, {out / (slug + '.md')}, "
        f"{out / 'accelerators' / (slug + '.json')} and {out / 'comparison.md'}")


if __name__ == "__main__":
    main()
