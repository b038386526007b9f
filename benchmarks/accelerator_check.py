"""Both pools on whatever accelerator JAX sees, measured against its roofline and against the
systems model's prediction, for a named model shape.

One command, on any backend (GPU, TPU, CPU)::

    python benchmarks/accelerator_check.py --shape=qwen2.5-0.5b

measures, in this order, side by side in one run:

1. ceilings of this device: dense matmul FLOP/s in the compute dtype, HBM (or DRAM) read
   bandwidth, and host<->device copy bandwidth;
2. generator decode: the engine's raw decode step (several steps per dispatch, tokens kept on
   the device) and the engine end to end (scheduler, sampling, token read-back), tokens/s by
   batch, for each decode attention backend asked for; each row carries the fraction of the
   memory roofline (the systems model's ``RooflineLatency`` on the catalogue's datasheet
   figures) and the systems model's prediction at the planner's default efficiency;
3. trainer: one optimizer step (AdamW, compute dtype with float32 master weights) at the given
   micro-batches, tokens/s and MFU against the datasheet peak and the measured matmul, the
   compiled step's peak memory against the systems model's, and the model's prediction at
   its default MFU;
4. weight publication: one version of the model in the generator's dtype published from the
   trainer's float32 arrays to a puller already waiting for it, per transport (``shm``,
   streamed, as a live generator's; ``jax_transfer``, device memory to device memory), GB/s
   from the publish call to the pulled arrays, against one host memcpy of the same bytes
   measured in the same run, the measured device->host plus host->device copies, and a copy
   within device memory at the measured bandwidth.

Writes ``benchmarks/results/pools/checks/<device>.json`` (one entry per shape, merged with
earlier shapes of that device), ``checks/<device>.md``, and the accelerator table of
``benchmarks/results/pools/comparison.md``. Every part is timed against ``--budget_s`` and
writes its results as soon as it ends, so a run cut short keeps what it measured.

On a CPU (CI) it runs the ``tiny`` shape in float32:
``python benchmarks/accelerator_check.py --shape=tiny --dtype=float32 --out=/tmp/check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import pools  # noqa: E402  (benchmarks/pools.py: environment, device naming, comparison)
from generator_throughput import admit_prompts, engine_generate  # noqa: E402

from rl_jax.generator.engine.core import Engine  # noqa: E402
from rl_jax.generator.engine.config import EngineConfig  # noqa: E402
from rl_jax.generator.engine.runner import ModelRunner  # noqa: E402
from rl_jax.models.shapes import shape as named_shape  # noqa: E402
from rl_jax.sysmodel.accelerators import CATALOGUE, Accelerator  # noqa: E402
from rl_jax.sysmodel.shape import ModelShape  # noqa: E402
from rl_jax.sysmodel.latency import RooflineLatency  # noqa: E402
from rl_jax.sysmodel.latency import TrainerModel  # noqa: E402
from rl_jax.sysmodel.memory import trainer_memory  # noqa: E402
from rl_jax.trainer.state import ModelSpec, OptimizerConfig, init_state, make_optimizer  # noqa
from rl_jax.trainer.step import LMBatch, causal_lm_loss, make_train_step  # noqa: E402

RESULTS = BENCH_DIR / "results" / "pools"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# The planner's defaults (rl_jax.sysmodel.plan.PlanRequest): what a plan assumes before any
# measurement of the pools exists.
PLANNER_DECODE_EFFICIENCY = 0.6
PLANNER_MFU = 0.4
# device_kind substrings -> catalogue entry
KINDS = (("h200", "h200"), ("h100", "h100"), ("b200", "b200"), ("v5 lite", "tpu_v5e"),
         ("v5e", "tpu_v5e"), ("v5p", "tpu_v5p"), ("v6", "tpu_v6e"))

_T0 = time.perf_counter()


def log(message: str):
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


def block(x):
    return jax.block_until_ready(x)


def best_seconds(fn, *, warmup: int = 1, repeats: int = 3) -> float:
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---- the device and its ceilings
# ------------------------------------------------------------------

def catalogue_entry(env: dict) -> Accelerator | None:
    kind = env["device_kind"].lower()
    if env["backend"] == "cpu":
        return None
    for needle, name in KINDS:
        if needle in kind:
            return CATALOGUE[name]
    return None


def measure_ceilings(dtype, on_cpu: bool) -> dict:
    """Matmul FLOP/s in ``dtype``, read bandwidth of device memory, host<->device copies."""
    n = 1024 if on_cpu else 8192
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul_s = best_seconds(lambda: block(matmul(a)), repeats=5)
    nbytes = (256 if on_cpu else 2048) << 20
    x = jnp.ones((nbytes // 4 // 1024, 1024), jnp.float32)
    read = jax.jit(lambda x: jnp.sum(x, axis=0))
    read_s = best_seconds(lambda: block(read(x)), repeats=5)
    host = np.ones(((128 if on_cpu else 1024) << 20) // 4, np.float32)
    device = jax.devices()[0]
    h2d_s = best_seconds(lambda: block(jax.device_put(host, device)), repeats=3)
    on_device = block(jax.device_put(host, device))
    d2h_s = best_seconds(lambda: np.asarray(on_device + 0), repeats=3)  # fresh array each call
    del a, x, on_device
    return {"matmul_flops": 2 * n ** 3 / matmul_s, "matmul_n": n,
            "read_bytes_per_s": nbytes / read_s, "h2d_bytes_per_s": host.nbytes / h2d_s,
            "d2h_bytes_per_s": host.nbytes / d2h_s, "copy_bytes": host.nbytes}


def accelerator_for(env: dict, ceilings: dict, dtype_name: str) -> tuple[Accelerator, str]:
    """The catalogue entry of this device, or (CPU, unknown chips) one from the ceilings."""
    entry = catalogue_entry(env)
    if entry is not None:
        return entry, f"catalogue:{entry.name}"
    try:
        capacity = float(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # CPU devices report no memory statistics
        capacity = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    acc = Accelerator(
        name="measured", description=env["device_kind"],
        peak_flops={dtype_name: ceilings["matmul_flops"]},
        memory_bandwidth=ceilings["read_bytes_per_s"], memory_capacity=capacity,
        interconnect_bandwidth=2 * ceilings["d2h_bytes_per_s"], interconnect="host copy",
        collective_latency_s=20e-6, source="measured by benchmarks/accelerator_check.py")
    return acc, "measured"


def device_memory_limit() -> int | None:
    """Bytes the device's allocator may hand out (None where the backend does not say)."""
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # CPU devices report no memory statistics
        return None


# ---- generator
# --------------------------------------------------------------------------------------

def raw_decode(runner: ModelRunner, params, weights, prompts: np.ndarray, new_tokens: int,
               steps: int) -> tuple[float, float]:
    """Seconds per decode step of ``new_tokens`` steps run ``steps`` per program, tokens kept on
    the device (no host round trip inside the loop), and seconds to prefill and install the
    prompts."""
    b, p = prompts.shape
    start = time.perf_counter()
    block(admit_prompts(runner, params, prompts))
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    out = None
    for i in range(0, new_tokens, steps):
        out = runner.decode(weights, b, p + i + 1, False, steps=steps)
    block(out)
    return (time.perf_counter() - start) / (math.ceil(new_tokens / steps) * steps), prefill_s


def measure_decode(cfg, params, args, acc: Accelerator, dtype, dtype_name: str,
                   deadline: float, rows: list[dict], save) -> list[dict]:
    shape = ModelShape.from_model_config(cfg, name=args.shape)
    p, n = args.prompt_len, args.new_tokens
    context = p + n / 2
    max_seq_len = p + n + args.decode_steps + 16
    roof = RooflineLatency(shape, acc, dtype=dtype_name, max_context=max_seq_len)
    planned = RooflineLatency(shape, acc, dtype=dtype_name, efficiency=PLANNER_DECODE_EFFICIENCY,
                              max_context=max_seq_len)
    for b in args.batches:
        if time.perf_counter() > deadline:
            log(f"decode: budget spent, batches from {b} on skipped")
            break
        prompts = np.random.RandomState(b).randint(0, cfg.vocab_size, (b, p)).astype(np.int32)
        roof_s, planned_s = roof.step_seconds(b, context), planned.step_seconds(b, context)
        for attention in args.attention:
            row = {"batch": b, "attention": attention, "prompt_len": p, "new_tokens": n,
                   "context": context, "roofline_step_s": roof_s,
                   "memory_roofline_step_s": roof.memory_seconds(b, context),
                   "bound": roof.bound(b, context), "predicted_step_s": planned_s}
            try:
                runner = ModelRunner(cfg, max_slots=b, max_seq_len=max_seq_len, dtype=dtype,
                                     attention=attention)
                weights = block(runner.prepare(params))
                row["attention_used"] = getattr(runner, "attention_backend", None) or (
                    "native" if runner.native_attention else "xla")
                row["prefill_attention_used"] = runner.prefill_attention_backend
                start = time.perf_counter()
                raw_decode(runner, params, weights, prompts, n, args.decode_steps)  # compiles
                row["compile_s"] = time.perf_counter() - start
                runs = [raw_decode(runner, params, weights, prompts, n, args.decode_steps)
                        for _ in range(args.repeats)]
                raw, prefill_s = min(r[0] for r in runs), min(r[1] for r in runs)
                row.update(prefill_s=prefill_s, prefill_tok_s=b * p / prefill_s)
                row.update(raw_step_s=raw, raw_tok_s=b / raw,
                           raw_over_roofline=roof_s / raw,
                           raw_over_memory_roofline=roof.memory_seconds(b, context) / raw,
                           raw_over_predicted=planned_s / raw)
                log(f"decode B={b:<4} {attention:<6} raw {raw * 1e3:8.3f} ms/step "
                    f"{b / raw:>10,.0f} tok/s ({roof_s / raw:.2f} of roofline, predicted "
                    f"{planned_s * 1e3:.3f} ms; compiled in {row['compile_s']:.1f} s)")
                del runner, weights
                if not args.engine:
                    rows.append(row)
                    save()
                    continue
                start = time.perf_counter()
                engine = Engine(cfg, params, dtype=dtype, engine_config=EngineConfig(
                    max_slots=b, max_seq_len=max_seq_len, max_prefill_tokens=max(2048, b * p),
                    decode_steps=args.decode_steps, attention=attention))
                try:
                    for _ in range(2):  # compiles every shape a timed run meets
                        engine_generate(engine, prompts, n)
                        engine_generate(engine, prompts, 1)
                    row["engine_warmup_s"] = time.perf_counter() - start
                    full = min(engine_generate(engine, prompts, n) for _ in range(args.repeats))
                    first = min(engine_generate(engine, prompts, 1)
                                for _ in range(args.repeats))
                finally:
                    engine.shutdown()
                step = max(full - first, 1e-9) / max(n - 1, 1)
                row.update(engine_s=full, engine_prefill_s=first, engine_step_s=step,
                           engine_tok_s=b * n / full, engine_decode_tok_s=b / step,
                           engine_over_roofline=roof_s / step)
                log(f"decode B={b:<4} {attention:<6} engine {b * n / full:>10,.0f} tok/s end to "
                    f"end, {step * 1e3:.3f} ms/step (warm-up {row['engine_warmup_s']:.1f} s)")
            except Exception as e:  # one failing backend or batch must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                log(f"decode B={b} {attention}: FAILED {row['error'][:300]}")
                traceback.print_exc()
            rows.append(row)
            save()
            gc.collect()
    return rows


# ---- trainer
# ------------------------------------------------------------------------------------------

def measure_trainer(cfg, args, acc: Accelerator, dtype, dtype_name: str,
                    deadline: float, rows: list[dict], save) -> list[dict]:
    shape = ModelShape.from_model_config(cfg, name=args.shape)
    from rl_jax.models.fused_attention import check_fused_attention
    try:  # which attention kernel the training graph uses here, and whether it matched XLA's
        args.attention_check = check_fused_attention(dtype, head_dim=cfg.head_dim)
        log(f"trainer attention: {args.attention_check['implementation']} (matched XLA: "
            f"{args.attention_check['matched']}, max abs error "
            f"{args.attention_check['max_abs_error']:.2e})")
    except Exception as e:
        args.attention_check = {"error": f"{type(e).__name__}: {e}"[:2000]}
        log(f"trainer attention check FAILED: {args.attention_check['error'][:300]}")
    spec = ModelSpec(cfg, mesh=None, dtype=dtype, param_dtype=jnp.float32, remat=args.remat)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-5, warmup_steps=1, total_steps=1000))
    state = init_state(tx, spec, spec.init_params(seed=0))
    step = make_train_step(spec, tx, causal_lm_loss, donate=True)
    peak = acc.flops(dtype_name)
    for batch, seq in args.train_shapes:
        if time.perf_counter() > deadline:
            log(f"trainer: budget spent, {batch}x{seq} on skipped")
            break
        row = {"batch": batch, "seq": seq, "remat": args.remat,
               "flops_per_token": shape.train_flops_per_token(seq)}
        try:
            rng = np.random.RandomState(0)
            data = jax.device_put(LMBatch.from_numpy(dict(
                tokens=rng.randint(0, cfg.vocab_size, (batch, seq)),
                targets=rng.randint(0, cfg.vocab_size, (batch, seq)),
                loss_mask=np.ones((batch, seq)), positions=np.tile(np.arange(seq), (batch, 1)),
                segment_ids=np.ones((batch, seq)))))
            start = time.perf_counter()
            compiled = step.lower(state, data).compile()
            row["compile_s"] = time.perf_counter() - start
            memory = compiled.memory_analysis()
            if memory is not None:
                row["compiled_bytes"] = {
                    "argument": int(memory.argument_size_in_bytes),
                    "output": int(memory.output_size_in_bytes),
                    "temp": int(memory.temp_size_in_bytes),
                    "alias": int(memory.alias_size_in_bytes)}
                row["compiled_peak_bytes"] = int(
                    memory.argument_size_in_bytes + memory.output_size_in_bytes
                    + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
            row["predicted_state_bytes"] = shape.train_state_bytes("float32")
            impl = (args.attention_check or {}).get("implementation", "xla")
            predicted_memory = trainer_memory(
                shape, batch=batch, seq=seq, dtype=dtype_name, param_dtype="float32",
                remat=args.remat, logits_block=4096,
                attention="materialised" if impl == "xla" else "fused",
                backend="cpu" if jax.default_backend() == "cpu" else "accelerator")
            row["predicted_peak_bytes"] = float(predicted_memory.total)
            limit = device_memory_limit()
            if limit and row.get("compiled_peak_bytes", 0) > limit:
                raise MemoryError(
                    f"the compiled step needs {row['compiled_peak_bytes'] / 2**30:.2f} GiB, the "
                    f"device has {limit / 2**30:.2f} GiB: use remat or a smaller micro-batch")

            def one():
                nonlocal state
                state, metrics = compiled(state, data)
                block(metrics["loss"])

            seconds = best_seconds(one, warmup=1, repeats=args.repeats)
            tokens = batch * seq
            flops = row["flops_per_token"] * tokens
            predicted = TrainerModel.from_flops(shape, acc, 1, mfu=PLANNER_MFU, seq_len=seq,
                                                dtype=dtype_name, param_dtype="float32")
            predicted_s = predicted.step_seconds(tokens)
            row.update(step_s=seconds, tokens_per_s=tokens / seconds, flops_per_s=flops / seconds,
                       mfu=flops / seconds / peak,
                       mfu_vs_matmul=flops / seconds / args.ceilings["matmul_flops"],
                       predicted_step_s=predicted_s, measured_over_predicted=predicted_s / seconds)
            log(f"train {batch}x{seq} remat={args.remat}: {seconds * 1e3:.1f} ms/step "
                f"{tokens / seconds:>10,.0f} tok/s MFU {row['mfu']:.3f} (vs measured matmul "
                f"{row['mfu_vs_matmul']:.3f}); predicted {predicted_s * 1e3:.1f} ms; compiled "
                f"peak {row.get('compiled_peak_bytes', 0) / 2**30:.2f} GiB (predicted "
                f"{row['predicted_peak_bytes'] / 2**30:.2f})")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"train {batch}x{seq}: FAILED {row['error'][:300]}")
        rows.append(row)
        save()
        gc.collect()
    del state
    return rows


# ---- weight publication
# ----------------------------------------------------------------------------------

def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Best time of one host memcpy of ``nbytes`` into a warm destination (``np.copyto``)."""
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


def measure_publication(cfg, args, dtype, repeats: int, transport: str = "shm") -> dict:
    """One version of the model in the generator's dtype, published from the trainer's
    float32 parameters over ``transport`` to a puller already waiting for it (as a live
    generator's is: over ``shm`` the version streams, verified block by block as it is staged;
    ``jax_transfer`` moves device arrays between device memories with no host bounce), timed
    from the ``publish`` call to the pulled arrays ready; against one host memcpy of the same
    bytes, measured in the same run, and a device-memory copy at the measured bandwidth."""
    from rl_jax.generator.engine.weights import generator_rules
    from rl_jax.transfer.config import PublisherConfig, PullerConfig
    from rl_jax.transfer.publisher.core import Publisher
    from rl_jax.transfer.puller.core import Puller

    spec = ModelSpec(cfg, mesh=None)  # the trainer's float32 parameters
    params = spec.init_params(seed=0)
    gen_spec = ModelSpec(cfg, mesh=None, rules=generator_rules(), param_dtype=dtype)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          gen_spec.abstract_params, gen_spec.param_shardings)
    version_bytes = int(sum(math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
                            for t in jax.tree.leaves(target)))
    config = PublisherConfig(transports=(transport,))
    if args.staging_threads is not None:
        config = dataclasses.replace(config, staging_threads=args.staging_threads)
    publisher = Publisher(config, spec=spec)
    rows, memcpy = [], []
    try:
        puller = Puller(publisher.url, target, transports=[transport],
                        config=PullerConfig(timeout_s=600))
        puller.register()
        publisher.wait_for_layouts(1, 60)
        for version in range(1, repeats + 2):
            pulled: dict = {}

            def pull(have=version - 1, into=pulled):
                update = puller.pull(have, wait_s=120)
                block(jax.tree.leaves(update.params))
                into["at"] = time.perf_counter()

            waiting = threading.Thread(target=pull, name="puller")
            waiting.start()
            time.sleep(0.1)  # the puller is waiting, as a live one is
            start = time.perf_counter()
            stats = publisher.publish(params, version)
            published = time.perf_counter()
            waiting.join()
            if version > 1:  # the first one allocates the staging slots
                rows.append({"publish_s": published - start, "total_s": pulled["at"] - start,
                             "publisher_s": stats.seconds})
                memcpy.append(memcpy_seconds(version_bytes, 1))  # interleaved: same load
    finally:
        publisher.close()
    best = min(rows, key=lambda r: r["total_s"])
    ceil = args.ceilings
    copy_s = version_bytes / ceil["d2h_bytes_per_s"] + version_bytes / ceil["h2d_bytes_per_s"]
    device_copy_s = 2 * version_bytes / ceil["read_bytes_per_s"]  # read and write once
    memcpy_s = min(memcpy)
    out = {"version_bytes": version_bytes, "dtype": jnp.dtype(dtype).name,
           "transport": transport, "streamed": transport == "shm",
           "staging_threads": config.staging_threads, "runs": rows,
           "device_copy_s": device_copy_s,
           "end_to_end_over_device_copy": device_copy_s / best["total_s"],
           "publish_gbps": version_bytes / best["publish_s"] / 1e9,
           "end_to_end_gbps": version_bytes / best["total_s"] / 1e9,
           "memcpy_s": memcpy_s, "memcpy_gbps": version_bytes / memcpy_s / 1e9,
           "end_to_end_over_memcpy": memcpy_s / best["total_s"],
           "host_copies_s": copy_s, "end_to_end_over_host_copies": copy_s / best["total_s"]}
    log(f"publication of {version_bytes / 1e9:.2f} GB ({out['dtype']}, {transport}) to a "
        f"waiting puller: "
        f"{out['end_to_end_gbps']:.2f} GB/s end to end (publish call {out['publish_gbps']:.2f} "
        f"GB/s) = {out['end_to_end_over_memcpy']:.2f}x one memcpy of the same bytes "
        f"({out['memcpy_gbps']:.2f} GB/s)")
    return out


# ---- reports
# ------------------------------------------------------------------------------------------------

def summary(entry: dict) -> dict:
    """Headline figures of one shape's check: best decode, best trainer, publication."""
    out = {}
    decode = [r for r in entry.get("decode", []) if "raw_step_s" in r]
    if decode:
        best = max(decode, key=lambda r: r["raw_tok_s"])
        out["decode"] = {k: best.get(k) for k in (
            "batch", "attention", "attention_used", "raw_tok_s", "raw_over_memory_roofline",
            "raw_over_roofline", "raw_over_predicted", "engine_tok_s", "engine_decode_tok_s",
            "engine_over_roofline")}
    train = [r for r in entry.get("trainer", []) if "step_s" in r]
    if train:
        best = max(train, key=lambda r: r["tokens_per_s"])
        out["trainer"] = {k: best.get(k) for k in (
            "batch", "seq", "tokens_per_s", "mfu", "mfu_vs_matmul", "measured_over_predicted",
            "compiled_peak_bytes", "predicted_peak_bytes")}
    if entry.get("publication") and "end_to_end_gbps" in entry["publication"]:
        out["publication"] = {k: entry["publication"].get(k) for k in (
            "version_bytes", "end_to_end_gbps", "end_to_end_over_host_copies",
            "end_to_end_over_memcpy")}
    return out


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def gib(value) -> float | None:
    return None if value is None else value / 2 ** 30


def checks_markdown(records: list[dict]) -> list[str]:
    """The accelerator table of ``comparison.md``: one row per device and shape."""
    lines = ["## Accelerator check", "",
             "Written by `benchmarks/accelerator_check.py` from `results/pools/checks/*.json`. "
             "Decode: raw decode step at the best batch (tokens/s; fraction of the memory "
             "roofline from the datasheet; measured against the systems model's prediction at "
             "its default efficiency 0.6, 1.0 = exact), and the engine end to end at that "
             "batch; train: AdamW step with float32 master weights, MFU against the datasheet "
             "peak, measured against the prediction at MFU 0.4; publication: one version in the "
             "generator's dtype, publish + pull (shm).", "",
             "| device | shape | dtype | date | jax | decode tok/s (B) | / mem roofline | "
             "/ predicted | engine tok/s | train tok/s (BxT) | MFU | / predicted | "
             "publication GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        env = record["env"]
        for name, entry in sorted(record["shapes"].items()):
            s = summary(entry)
            d, t, p = s.get("decode", {}), s.get("trainer", {}), s.get("publication", {})
            lines.append(
                f"| {env['device_kind']} x{env['device_count']} | {name} | {entry['dtype']} | "
                f"{entry['date'][:10]} | {env['versions'].get('jax')} | "
                f"{fmt(d.get('raw_tok_s'), ',.0f')} ({d.get('batch', '-')}, "
                f"{d.get('attention_used', '-')}) | {fmt(d.get('raw_over_memory_roofline'), '.2f')}"
                f" | {fmt(d.get('raw_over_predicted'), '.2f')} | "
                f"{fmt(d.get('engine_tok_s'), ',.0f')} | {fmt(t.get('tokens_per_s'), ',.0f')} "
                f"({t.get('batch', '-')}x{t.get('seq', '-')}) | {fmt(t.get('mfu'), '.3f')} | "
                f"{fmt(t.get('measured_over_predicted'), '.2f')} | "
                f"{fmt(p.get('end_to_end_gbps'), '.2f')} |")
    return lines


def record_markdown(record: dict) -> str:
    env = record["env"]
    lines = [f"# Accelerator check on {env['device_kind']} x{env['device_count']} "
             f"({env['backend']})", "",
             f"commit {env['commit']}, {env['cpu']}, {env['cpus']} CPUs, python "
             f"{env['python']}, " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
             ""]
    for name, entry in sorted(record["shapes"].items()):
        c = entry["ceilings"]
        lines += [f"## {name} ({entry['params'] / 1e9:.3f}B params, {entry['dtype']}), "
                  f"{entry['date']}", "", f"`{entry['command']}`", "",
                  f"Ceilings: matmul {c['matmul_flops'] / 1e12:,.1f} TFLOP/s measured "
                  f"(datasheet {entry['accelerator']['peak_flops']:.3g}), read "
                  f"{c['read_bytes_per_s'] / 1e9:,.0f} GB/s (datasheet "
                  f"{entry['accelerator']['memory_bandwidth'] / 1e9:,.0f}), host->device "
                  f"{c['h2d_bytes_per_s'] / 1e9:.1f} GB/s, device->host "
                  f"{c['d2h_bytes_per_s'] / 1e9:.1f} GB/s.", "",
                  "| batch | attention | raw ms/step | raw tok/s | / roofline | / mem roofline "
                  "| predicted ms | engine tok/s | engine ms/step | prefill (attention) tok/s "
                  "| error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in entry.get("decode", []):
            lines.append(
                f"| {r['batch']} | {r.get('attention_used', r['attention'])} | "
                f"{fmt(r.get('raw_step_s', None) and r['raw_step_s'] * 1e3, '.3f')} | "
                f"{fmt(r.get('raw_tok_s'), ',.0f')} | {fmt(r.get('raw_over_roofline'), '.2f')} | "
                f"{fmt(r.get('raw_over_memory_roofline'), '.2f')} | "
                f"{r['predicted_step_s'] * 1e3:.3f} | {fmt(r.get('engine_tok_s'), ',.0f')} | "
                f"{fmt(r.get('engine_step_s', None) and r['engine_step_s'] * 1e3, '.3f')} | "
                f"{fmt(r.get('prefill_tok_s'), ',.0f')} ({r.get('prefill_attention_used', '-')})"
                f" | {r.get('error', '')[:120]} |")
        lines += ["", "| train BxT | remat | ms/step | tok/s | MFU | MFU vs matmul | "
                  "predicted ms | compiled peak GiB | predicted peak GiB | error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in entry.get("trainer", []):
            lines.append(
                f"| {r['batch']}x{r['seq']} | {r['remat']} | "
                f"{fmt(r.get('step_s', None) and r['step_s'] * 1e3, '.1f')} | "
                f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.3f')} | "
                f"{fmt(r.get('mfu_vs_matmul'), '.3f')} | "
                f"{fmt(r.get('predicted_step_s', None) and r['predicted_step_s'] * 1e3, '.1f')} | "
                f"{fmt(r.get('compiled_peak_bytes', None) and r['compiled_peak_bytes'] / 2**30, '.2f')}"
                f" | {fmt(gib(r.get('predicted_peak_bytes')), '.2f')} | "
                f"{r.get('error', '')[:120]} |")
        for pub in (entry.get("publication_by_transport")
                    or {"shm": entry.get("publication") or {}}).values():
            lines += publication_lines(pub)
        lines.append("")
    return "\n".join(lines)


def publication_lines(pub: dict) -> list[str]:
    """The report's sentence on one publication row."""
    if "end_to_end_gbps" not in pub:
        return (["", f"Publication ({pub.get('transport', 'shm')}) failed: {pub['error'][:300]}"]
                if pub.get("error") else [])
    streamed = ", streamed" if pub.get("streamed") else ""
    text = (f"to a waiting puller ({pub['dtype']}, {pub['transport']}{streamed}): "
            f"{pub['end_to_end_gbps']:.2f} GB/s from the publish call to the pulled arrays")
    if "end_to_end_over_memcpy" in pub:
        text += (f", {pub['end_to_end_over_memcpy']:.2f}x one memcpy of the same bytes "
                 f"({pub['memcpy_gbps']:.2f} GB/s, same run)")
    text += (f"; {pub['end_to_end_over_host_copies']:.2f} of a device->host plus a host->device "
             "copy")
    if "end_to_end_over_device_copy" in pub:
        text += f", {pub['end_to_end_over_device_copy']:.2f} of a device-memory copy"
    return ["", f"Publication of one {pub['version_bytes'] / 1e9:.2f} GB version {text}."]


def write_comparison(results_dir: Path):
    """``comparison.md``: the pools table (``pools.py`` results) and the accelerator table."""
    records = []
    for path in sorted((results_dir / "checks").glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            continue
    text = pools.comparison_markdown(pools.merge_all(results_dir))
    text += "\n" + "\n".join(checks_markdown(records)) + "\n"
    (results_dir / "comparison.md").write_text(text)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, t = item.partition("x")
        out.append((int(b), int(t)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="rl_jax.models.shapes name")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="compute dtype (default: bfloat16 on accelerators, float32 on CPU)")
    parser.add_argument("--batches", default=None, help="decode batches, e.g. 1,16,64,256")
    parser.add_argument("--attention", default=None,
                        help="decode attention backends to compare (default: auto,xla)")
    parser.add_argument("--prompt_len", type=int, default=None)
    parser.add_argument("--new_tokens", type=int, default=None)
    parser.add_argument("--decode_steps", type=int, default=None,
                        help="decode steps per dispatch (default 8 on accelerators, 1 on CPU)")
    parser.add_argument("--train", default=None, help="trainer micro-batches BxT, e.g. 8x2048")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    parser.add_argument("--parts", default="trainer,publication,decode",
                        help="what to measure, in this order")
    parser.add_argument("--no_engine", dest="engine", action="store_false",
                        help="decode: the raw step only, not the engine end to end")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="shm,jax_transfer",
                        help="publication: transports measured, the first one in the summary")
    parser.add_argument("--staging_threads", type=int, default=None,
                        help="publication: PublisherConfig.staging_threads (default: its own)")
    parser.add_argument("--budget_s", type=float, default=420.0,
                        help="no new measurement starts after this many seconds")
    parser.add_argument("--out", default=str(RESULTS), help="results directory")
    args = parser.parse_args()

    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    dtype_name = args.dtype or ("float32" if on_cpu else "bfloat16")
    dtype = DTYPES[dtype_name]
    args.batches = [int(b) for b in (args.batches or ("1,8,32" if on_cpu else
                                                       "1,16,64,256")).split(",")]
    args.attention = (args.attention or "auto,xla").split(",")
    args.prompt_len = args.prompt_len or (16 if on_cpu else 128)
    # 64 new tokens after 128: every decode step fits one cache length (one program per batch)
    args.new_tokens = args.new_tokens or (16 if on_cpu else 64)
    args.decode_steps = args.decode_steps or (1 if on_cpu else 8)
    args.train_shapes = parse_shapes(args.train or ("4x64" if on_cpu else "8x1024,16x1024"))
    parts = args.parts.split(",")
    unknown = set(parts) - {"decode", "trainer", "publication"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    deadline = _T0 + args.budget_s

    cfg = named_shape(args.shape)
    env = pools.environment()
    slug = pools.device_slug(env)
    out_dir = Path(args.out)
    (out_dir / "checks").mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "checks" / f"{slug}.json"
    record = {"env": env, "shapes": {}}
    if json_path.is_file():
        try:
            previous = json.loads(json_path.read_text())
            record["shapes"] = dict(previous.get("shapes", {}))
        except json.JSONDecodeError:
            pass
    log(f"{env['device_kind']} x{env['device_count']} ({backend}), jax "
        f"{env['versions'].get('jax')}; shape {args.shape} ({cfg.num_params() / 1e9:.3f}B), "
        f"{dtype_name}")

    ceilings = measure_ceilings(dtype, on_cpu)
    args.ceilings = ceilings
    acc, acc_source = accelerator_for(env, ceilings, dtype_name)
    log(f"ceilings: matmul {ceilings['matmul_flops'] / 1e12:.2f} TFLOP/s, read "
        f"{ceilings['read_bytes_per_s'] / 1e9:.0f} GB/s, h2d {ceilings['h2d_bytes_per_s'] / 1e9:.1f}"
        f" GB/s, d2h {ceilings['d2h_bytes_per_s'] / 1e9:.1f} GB/s; systems model: {acc_source}")
    entry = {"shape": args.shape, "params": cfg.num_params(), "dtype": dtype_name,
             "date": time.strftime("%Y-%m-%d %H:%M:%S"),
             "command": "python benchmarks/accelerator_check.py " + " ".join(sys.argv[1:]),
             "ceilings": ceilings,
             "accelerator": {"source": acc_source, "name": acc.name,
                             "peak_flops": acc.flops(dtype_name),
                             "memory_bandwidth": acc.memory_bandwidth},
             "settings": {"batches": args.batches, "attention": args.attention,
                          "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "decode_steps": args.decode_steps, "train": args.train_shapes,
                          "remat": args.remat, "repeats": args.repeats}}
    record["shapes"][args.shape] = entry

    def save():
        json_path.write_text(json.dumps(record, indent=1, default=float))
        (out_dir / "checks" / f"{slug}.md").write_text(record_markdown(record))
        write_comparison(out_dir)

    save()
    for part in parts:
        if part == "decode":
            spec = ModelSpec(cfg, mesh=None)
            params = spec.init_params(seed=0)
            entry["decode"] = []
            measure_decode(cfg, params, args, acc, dtype, dtype_name, deadline, entry["decode"],
                           save)
            del params
        elif part == "trainer":
            entry["trainer"] = []
            measure_trainer(cfg, args, acc, dtype, dtype_name, deadline, entry["trainer"], save)
            entry["trainer_attention"] = args.attention_check
        else:
            entry["publication_by_transport"] = by_transport = {}
            for transport in args.transports.split(","):
                if time.perf_counter() > deadline:
                    by_transport[transport] = {"transport": transport,
                                               "error": "skipped: time budget spent"}
                    continue
                try:
                    by_transport[transport] = measure_publication(cfg, args, dtype,
                                                                  args.repeats, transport)
                except Exception as e:
                    by_transport[transport] = {"transport": transport,
                                               "error": f"{type(e).__name__}: {e}"[:2000]}
                    log(f"publication ({transport}): FAILED "
                        f"{by_transport[transport]['error'][:300]}")
                    traceback.print_exc()
                save()
            entry["publication"] = next(iter(by_transport.values()))
        gc.collect()
        save()
    entry["summary"] = summary(entry)
    entry["wall_s"] = time.perf_counter() - _T0
    save()
    log(f"wrote {json_path} and {out_dir / 'comparison.md'}")
    print(json.dumps(entry["summary"], indent=1, default=float))


if __name__ == "__main__":
    main()
