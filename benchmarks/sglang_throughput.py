"""Decode throughput of this project's generator server, a real SGLang server and HF transformers'
``generate``, on the same weights, prompts and machine, side by side in one run.

The three generators:

- ``rl_jax``: this project's generator server (``python -m rl_jax.generator.server.serve``), over
HTTP;
- ``sglang``: a real SGLang 0.5.23 server (``python -m sglang.launch_server``, the environment
  ``tools/sglang_cpu/install.sh`` makes in ``.venv-sglang``) on its CPU engine, over HTTP;
- ``hf``: transformers' ``generate`` in this process (torch on the CPU, SDPA attention).

``sglang`` and ``hf`` both compute with torch, whose OpenMP threads slow down many-fold when
another process takes a core (in one run on this 2-core machine at load average 7, HF's decode
step at B=8 took 353 ms with 2 threads and 2.4 ms with 1; see ``generator_throughput.py``). So
each runs with every torch thread count of ``--threads`` (default 2 and 1; ``--quick``: 1 only)
and the faster is kept per batch size: ``hf`` by ``torch.set_num_threads``, ``sglang`` as one
server per count with ``OMP_NUM_THREADS`` (on a CPU without AMX SGLang neither binds nor sets its
threads: torch's default, one per core).
``rl_jax`` runs once, on XLA's own thread pool over all cores (which suffers far less from load).

Both servers are started by the project's launcher
(:class:`rl_jax.generator.launcher.pool.ServerPool`)
exactly as ``tests/sglang_fixtures.py`` starts them (SGLang with ``sglang_cpu_settings()``), both
with float32 weights, the same ``max_slots`` (the largest batch size; SGLang's
``--max-running-requests``) and ``max_seq_len`` (SGLang's ``--context-length``), one decode step
per scheduler iteration. SGLang's ``--mem-fraction-static`` is the tests' 0.1 unless the weights
need more (the 0.5B shape: SGLang's KV budget is that share of the free memory minus the weights,
so it is raised to leave about 1 GiB of KV cache; the value is in the JSON).

What SGLang's CPU path is on this machine: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``,
``--device cpu``) computes every layer with its own plain torch code, attention with its
``torch_native`` backend, because its CPU kernels (``sgl_kernel``'s CPU ops: fused norms,
activations, GEMMs, attention) are used only where the CPU has Intel AMX, which this CPU lacks
(``grep -c amx /proc/cpuinfo`` is 0; recorded in the JSON). The CUDA-only ``sgl_kernel`` package
is replaced by a stand-in whose every function raises (``tools/sglang_cpu/``); the run points the
stand-in's call log (``RL_JAX_SGL_KERNEL_CALLS``) at a file and records that it stayed empty. No
``torch.compile`` (SGLang's default). So ``sglang`` here measures SGLang's scheduler, tokenizer
and detokenizer processes and HTTP front plus plain eager torch, not its tuned kernels: it is no
measure of SGLang on a GPU or on an AMX CPU.

Workloads, per batch size ``B`` (``--shape=tiny``: 1, 8, 32; ``qwen2.5-0.5b``: 1, 8, 16;
``--quick``: 1, 8): ``B`` random prompts of 16 tokens (the same ids for every generator), each
sampled at temperature 1 (no top-k/top-p), EOS ignored, ``N`` new tokens (tiny: 64, 0.5B: 32;
``--quick``: 32 and 16) and, separately, 1 new token. A server gets the ``B`` prompts in ONE
``/generate`` call (``input_ids`` a list of lists), so both servers see the same batch at once;
``hf`` generates the ``B`` prompts as one tensor.

Per generator and ``B``: the per-step latency ``(t(N) - t(1)) / (N - 1)`` (the generation of
``N`` tokens minus a 1-token generation, i.e. prefill, first token and the HTTP round trip, over
the remaining decode steps), ``tok/s = B / step`` and ``wall tok/s = B·N / t(N)`` (prefill and
HTTP included). Each time is the minimum over all its repeats (other processes only ever add
time), and the ratios ``rl_jax/sglang``, ``rl_jax/hf`` and ``sglang/hf`` are of tok/s (and of
wall tok/s beside them).

What is interleaved and what is not: only one generator runs at a time (one server started,
measured and stopped before the next starts; ``hf`` loads its model only in its own phase), so
they never share the cores. Within a generator's phase, after a warm-up generation of every
shape (this compiles the rl_jax server's programs), each repeat runs every batch size, ``t(1)``
then ``t(N)``, so the batch sizes and both lengths are interleaved, and so are ``hf``'s thread
counts (``sglang``'s are servers started one after the other within the phase). The generators
themselves are not interleaved within a round (restarting a server per measurement would cost far
more than the measurements); instead the whole sequence of phases runs in ``--rounds`` rounds
(default 2, ``--quick`` 1), the second in reverse order (rl_jax, sglang, hf, then hf, sglang,
rl_jax), with every server started afresh, and the minimum is taken over the repeats of all
rounds, so a slow stretch of the machine that hits one phase is not the only measurement of that
generator. A
ceiling (numpy float32 1024-matmul GFLOP/s, best of 5) and the load average are recorded at the
start of every phase: a phase measured on a much busier machine shows there.

Shapes: ``tiny`` (the default): generator_throughput.py's ``tiny`` (vocab 1024, hidden 96, 3
layers, 4 heads / 2 KV heads of 24) as a Llama checkpoint with random float32 weights and a
tokenizer of its whole vocabulary (``rl_jax.models.shapes.write_random_checkpoint``, which writes
the ``tokenizer_config.json`` SGLang needs). ``qwen2.5-0.5b``: random weights of the real shape,
float32, written by ``python -m
rl_jax.models.shapes write qwen2.5-0.5b DIR --dtype float32`` (one ``model.safetensors``, 2 GB,
``config.json``, a byte-level ``tokenizer.json`` covering the vocabulary,
``tokenizer_config.json``); ``--checkpoint DIR`` reuses one written before.

Usage:
    python benchmarks/sglang_throughput.py [--quick] [--shape=tiny|qwen2.5-0.5b]
        [--kinds=rl_jax,sglang,hf] [--threads=2,1] [--rounds R] [--repeats K]
        [--checkpoint DIR] [--out FILE]
Writes benchmarks/results/sglang_throughput.json (tiny) or sglang_throughput_<shape>.json, with
the machine (CPU model, cores, AMX, load average before and after), the settings, every time and
the numbers; ``--quick`` writes the same file, marked ``"quick": true``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from generator_throughput import MODELS, hf_generate  # the same model and HF baseline
from rl_jax.generator.launcher.pool import PoolConfig, ServerPool, sglang_cpu_settings
from rl_jax.models.shapes import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
KINDS = ("rl_jax", "sglang", "hf")
PROMPT_LEN = 16
MAX_SEQ_LEN = 128  # both servers; prompt + N new tokens fit
# torch threads of hf and of SGLang's server (OMP_NUM_THREADS), the faster kept per batch size:
# two win on a quiet machine, but torch's OpenMP slows down many-fold when other processes take
# a core, one thread much less (see generator_throughput.py).
TORCH_THREADS = (2, 1)
SGLANG_MEM_FRACTION = 0.1  # sglang_cpu_settings()'s, the tests'
SGLANG_KV_RESERVE = 1 << 30  # KV cache bytes SGLang is left beside its weights

# per shape: (batch sizes, new tokens), full and --quick
SHAPES = {
    "tiny": {"batches": (1, 8, 32), "new_tokens": 64,
             "quick_batches": (1, 8), "quick_new_tokens": 32, "startup_timeout": 240},
    "qwen2.5-0.5b": {"batches": (1, 8, 16), "new_tokens": 32,
                     "quick_batches": (1, 8), "quick_new_tokens": 16, "startup_timeout": 900},
}
# generator_throughput.py's "tiny" model, its special tokens after the byte-level tokenizer's
# 256 bytes (rl_jax.models.shapes.shape_tokenizer puts them there).
TINY = dataclasses.replace(MODELS["tiny"], bos_token_id=1021, eos_token_id=1022,
                           pad_token_id=1023)


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- checkpoints --------------------------------------------------------------------------------

def write_tiny_checkpoint(path: Path) -> Path:
    """generator_throughput.py's "tiny" model with random float32 weights and a tokenizer of its
    whole vocabulary (``rl_jax.models.shapes.write_random_checkpoint``)."""
    return write_random_checkpoint(TINY, path, dtype="float32")


def write_shape_checkpoint(shape: str, path: Path) -> Path:
    """A named shape with random float32 weights, by the shapes CLI in a child process (its
    memory, one 2 GB shard for the 0.5B shape, is gone before any generator starts)."""
    subprocess.run([sys.executable, "-m", "rl_jax.models.shapes", "write", shape, str(path),
                    "--dtype", "float32"], check=True, cwd=ROOT)
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---- the servers, as tests/sglang_fixtures.py starts them --------------------------------------

def server_env() -> tuple[tuple[str, str], ...]:
    """tests/generator_fixtures.server_env: one CPU device, no tokenizer threads."""
    flags = os.environ.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", "")
    return (("XLA_FLAGS", flags), ("JAX_PLATFORMS", "cpu"), ("TOKENIZERS_PARALLELISM", "false"))


def available_memory() -> int:
    """Bytes of memory free for a new process, as SGLang reads it on the CPU (MemAvailable,
    capped by the cgroup's limit)."""
    free = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(free, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return free


def sglang_mem_fraction(weight_bytes: int) -> float:
    """The tests' 0.1, or the share of free memory that holds the weights and
    ``SGLANG_KV_RESERVE`` of KV cache where 0.1 would not (SGLang's KV budget on the CPU is
    ``fraction · free memory before loading − the weights``)."""
    need = 1.25 * weight_bytes + SGLANG_KV_RESERVE
    return float(min(0.9, max(SGLANG_MEM_FRACTION, np.ceil(100 * need / available_memory()) / 100)))


def pool_config(kind: str, model: Path, log_dir: Path, *, max_slots: int, max_seq_len: int,
                startup_timeout: float, mem_fraction: float = SGLANG_MEM_FRACTION,
                env: tuple[tuple[str, str], ...] = ()) -> PoolConfig:
    """tests/sglang_fixtures.pool_config with this run's slots, context and timeout."""
    common = dict(model=str(model), kind=kind, ports=(0,), max_slots=max_slots,
                  max_seq_len=max_seq_len, dtype="float32", startup_timeout=startup_timeout,
                  log_dir=str(log_dir))
    if kind == "rl_jax":
        return PoolConfig(**common, env=server_env())
    env_extra = env
    env, args = sglang_cpu_settings()
    args = list(args)
    args[args.index("--mem-fraction-static") + 1] = f"{mem_fraction:g}"
    return PoolConfig(**common, python=str(SGLANG_PYTHON),
                      env=env + env_extra + (("RL_JAX_SGL_KERNEL_CALLS",
                                                 str(log_dir / "sgl_kernel_calls")),),
                      extra_args=tuple(args))


def post(url: str, path: str, body: dict, timeout: float = 1800.0):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}{path}: HTTP {e.code}: {e.read().decode()[:500]}") from e


def server_info(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/get_server_info", timeout=30) as response:
            info = json.loads(response.read())
    except (OSError, ValueError) as e:
        return {"error": str(e)}
    keep = ("version", "max_running_requests", "context_length", "attention_backend", "device",
            "dtype", "mem_fraction_static", "max_total_num_tokens", "enable_torch_compile",
            "disable_radix_cache", "num_continuous_decode_steps", "max_slots", "max_seq_len")
    return {k: info[k] for k in keep if k in info}


def server_generate(url: str, prompts: np.ndarray, new_tokens: int) -> float:
    """Seconds for one ``/generate`` call with the ``B`` prompts as a batch."""
    body = {"input_ids": prompts.tolist(),
            "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens,
                                "ignore_eos": True}}
    start = time.perf_counter()
    out = post(url, "/generate", body)
    seconds = time.perf_counter() - start
    outs = out if isinstance(out, list) else [out]
    assert len(outs) == len(prompts), (len(outs), len(prompts))
    assert all(len(o["output_ids"]) == new_tokens for o in outs), \
        [len(o["output_ids"]) for o in outs]
    return seconds


# ---- HF transformers, as generator_throughput.hf_generate --------------------------------------

# ---- measurement --------------------------------------------------------------------------------

def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 ``n``-matmul GFLOP/s of numpy (its BLAS threads): the machine's state."""
    a = np.ones((n, n), np.float32)
    best = np.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def measure(variants: dict, prompts: dict, new_tokens: int, repeats: int, times: dict):
    """Warm-up, then ``repeats`` rounds of every batch size and variant, ``t(1)`` then
    ``t(N)``; appends to ``times[variant][B]["1" | "n"]``."""
    for fn in variants.values():
        for p in prompts.values():
            fn(p, new_tokens)
            fn(p, 1)
    for _ in range(repeats):
        for b, p in prompts.items():
            for name, fn in variants.items():
                slot = times.setdefault(name, {}).setdefault(b, {"1": [], "n": []})
                slot["1"].append(fn(p, 1))
                slot["n"].append(fn(p, new_tokens))


def run_phase(kind: str, model: Path, workdir: Path, args, prompts: dict, times: dict,
              phase: dict, servers: dict):
    """One generator's phase: ``hf`` with each of ``args.threads``; ``sglang`` one server per
    thread count in ``args.threads`` (``OMP_NUM_THREADS``; started, measured, stopped in turn);
    ``rl_jax`` one server (XLA's own thread pool)."""
    if kind == "hf":
        import torch
        from transformers import AutoModelForCausalLM
        threads_before = torch.get_num_threads()
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        servers.setdefault("hf", {"attention": getattr(hf.config, "_attn_implementation", None)})
        try:
            measure({t: (lambda p, n, t=t: hf_generate(hf, p, n, t)) for t in args.threads},
                    prompts, args.new_tokens, args.repeats, times)
        finally:
            torch.set_num_threads(threads_before)
            del hf
            gc.collect()
        return
    for threads in (args.threads if kind == "sglang" else ("server",)):
        label = kind if threads == "server" else f"{kind} ({threads} threads)"
        log_dir = workdir / f"logs-{kind}-{phase['round']}-{threads}"
        log_dir.mkdir(parents=True)
        mem_fraction = sglang_mem_fraction(checkpoint_bytes(model)) if kind == "sglang" else None
        config = pool_config(kind, model, log_dir, max_slots=max(args.batches),
                             max_seq_len=MAX_SEQ_LEN, startup_timeout=args.startup_timeout,
                             **({"mem_fraction": mem_fraction,
                                 "env": (("OMP_NUM_THREADS", str(threads)),)}
                                if kind == "sglang" else {}))
        start = time.perf_counter()
        pool = ServerPool(config).start()
        try:
            startup = time.perf_counter() - start
            phase.setdefault("startup_s", {})[str(threads)] = startup
            url = pool.urls[0]
            record = servers.setdefault(kind, {})
            record.update(command=pool.commands()[0], info=server_info(url))
            if mem_fraction is not None:
                record.setdefault("mem_fraction_static", {})[str(threads)] = mem_fraction
            log(f"{label} ready in {startup:.0f} s at {url}")
            measure({threads: lambda p, n: server_generate(url, p, n)}, prompts,
                    args.new_tokens, args.repeats, times)
        finally:
            pool.stop()
        if kind == "sglang":
            calls = log_dir / "sgl_kernel_calls"
            text = calls.read_text() if calls.exists() else None
            record.setdefault("sgl_kernel_calls", {})[str(threads)] = text
            if text is not None:  # each stand-in raises, so the requests would have failed first
                log(f"WARNING: SGLang called sgl_kernel stand-ins: {text[:200]}")


def summarize(times: dict, batches, new_tokens: int) -> dict:
    """Per kind and ``B``: step latency from the best variant's minimum times, tok/s, wall tok/s;
    then the ratios."""
    results: dict = {}
    for kind, by_variant in times.items():
        for b in batches:
            rows = []
            for variant, t in by_variant.items():
                if b not in t:
                    continue
                t1, tn = min(t[b]["1"]), min(t[b]["n"])
                step = (tn - t1) / (new_tokens - 1)
                rows.append({"variant": variant, "t_1_s": t1, "t_n_s": tn, "step_s": step,
                             "tok_s": b / step if step > 0 else None,
                             "wall_tok_s": b * new_tokens / tn,
                             "times_1_s": t[b]["1"], "times_n_s": t[b]["n"]})
            if rows:
                best = min(rows, key=lambda r: r["step_s"] if r["step_s"] > 0 else np.inf)
                entry = {k: v for k, v in best.items() if not k.startswith("times")}
                if len(rows) > 1:
                    entry["by_variant"] = rows
                else:
                    entry.update(times_1_s=best["times_1_s"], times_n_s=best["times_n_s"])
                results.setdefault(kind, {})[b] = entry
    ratios: dict = {}
    for b in batches:
        for x, y in (("rl_jax", "sglang"), ("rl_jax", "hf"), ("sglang", "hf")):
            rx, ry = results.get(x, {}).get(b), results.get(y, {}).get(b)
            if rx and ry:
                ratios.setdefault(b, {})[f"{x}/{y}"] = {
                    "tok_s": rx["tok_s"] / ry["tok_s"] if rx["tok_s"] and ry["tok_s"] else None,
                    "wall_tok_s": rx["wall_tok_s"] / ry["wall_tok_s"]}
    return {"results": results, "ratios": ratios}


def print_table(summary: dict, args):
    results, ratios = summary["results"], summary["ratios"]
    print(f"\nshape {args.shape}: {PROMPT_LEN}-token prompts + N={args.new_tokens} new tokens, "
          f"temperature 1, EOS ignored; min over {args.repeats} repeats x {args.rounds} round(s)")
    print(f"{'kind':>7} {'B':>4} {'step ms':>9} {'tok/s':>9} {'wall tok/s':>11} "
          f"{'t(1) s':>8} {'t(N) s':>8}  variant")
    for kind in args.kinds:
        for b, r in results.get(kind, {}).items():
            tok = f"{r['tok_s']:9.1f}" if r["tok_s"] else f"{'-':>9}"
            print(f"{kind:>7} {b:>4} {r['step_s'] * 1e3:9.2f} {tok} {r['wall_tok_s']:11.1f} "
                  f"{r['t_1_s']:8.3f} {r['t_n_s']:8.3f}  "
                  + (f"{r['variant']} threads" if kind != "rl_jax" else ""))
    if ratios:
        names = sorted({k for r in ratios.values() for k in r},
                       key=["rl_jax/sglang", "rl_jax/hf", "sglang/hf"].index)
        print("\nratios of tok/s (of wall tok/s in brackets)")
        print(f"{'B':>4} " + "".join(f"{n:>18}" for n in names))
        for b, r in ratios.items():
            cells = [f"{'-':>18}" if n not in r else
                     f"{(r[n]['tok_s'] or float('nan')):9.2f} ({r[n]['wall_tok_s']:5.2f})"
                     for n in names]
            print(f"{b:>4} " + "".join(cells))


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
    return {"cpu": model, "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "amx": sorted(f for f in flags if f.startswith("amx")),
            "amx_lines_in_cpuinfo": cpuinfo.count("amx"),
            "avx512f": "avx512f" in flags, "memory_available_bytes": available_memory(),
            "python": platform.python_version()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--quick", action="store_true",
                        help="batch sizes 1 and 8, fewer new tokens, 2 repeats, one round")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated of {KINDS}, in the first round's order")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of all phases (default 2, --quick 1); even rounds reverse")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per phase (default 3, --quick 2)")
    parser.add_argument("--threads", default=None,
                        help="comma-separated torch thread counts for hf and sglang, the faster "
                        "kept per batch size (default 2,1; --quick 1)")
    parser.add_argument("--checkpoint", default=None,
                        help="an existing checkpoint of the shape (default: write one)")
    parser.add_argument("--out", default=None, help="results file")
    args = parser.parse_args()
    settings = SHAPES[args.shape]
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {KINDS}")
    if "sglang" in args.kinds and not SGLANG_PYTHON.exists():
        parser.error(f"real SGLang is not installed at {SGLANG_PYTHON.parent.parent}: run "
                     "`bash tools/sglang_cpu/install.sh .venv-sglang`")
    args.batches = settings["quick_batches" if args.quick else "batches"]
    args.new_tokens = settings["quick_new_tokens" if args.quick else "new_tokens"]
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.threads = [int(t) for t in (args.threads or ("1" if args.quick else
                                                       ",".join(map(str, TORCH_THREADS)))
                                     ).split(",")]
    args.startup_timeout = settings["startup_timeout"]
    out = Path(args.out) if args.out else RESULTS / (
        "sglang_throughput.json" if args.shape == "tiny"
        else f"sglang_throughput_{args.shape}.json")

    started = time.perf_counter()
    load_before = os.getloadavg()
    info = machine()
    log(f"{info['cpu']}, {info['cpus']} cores, AMX: {info['amx'] or 'none'}; load average "
        f"{load_before}; shape {args.shape}, batches {args.batches}, N={args.new_tokens}, "
        f"{args.repeats} repeats x {args.rounds} round(s), kinds {args.kinds}")
    times: dict = {}
    phases: list[dict] = []
    servers: dict = {}
    with tempfile.TemporaryDirectory(prefix="sglang_throughput-") as tmp:
        workdir = Path(tmp)
        if args.checkpoint:
            model = Path(args.checkpoint)
        else:
            t0 = time.perf_counter()
            model = (write_tiny_checkpoint(workdir / "model") if args.shape == "tiny"
                     else write_shape_checkpoint(args.shape, workdir / "model"))
            log(f"wrote the checkpoint in {time.perf_counter() - t0:.0f} s")
        config = json.loads((model / "config.json").read_text())
        rng = np.random.default_rng(0)
        prompts = {b: rng.integers(3, config["vocab_size"], (b, PROMPT_LEN)).astype(np.int64)
                   for b in args.batches}
        for r in range(args.rounds):
            for kind in (args.kinds if r % 2 == 0 else args.kinds[::-1]):
                phase = {"round": r, "kind": kind, "load_before": os.getloadavg(),
                         "matmul_gflops": matmul_gflops()}
                log(f"round {r}: {kind} (matmul {phase['matmul_gflops']:.0f} GFLOP/s, load "
                    f"{phase['load_before'][0]:.2f})")
                t0 = time.perf_counter()
                run_phase(kind, model, workdir, args, prompts, times.setdefault(kind, {}),
                          phase, servers)
                phase.update(seconds=time.perf_counter() - t0, load_after=os.getloadavg())
                phases.append(phase)
                log(f"round {r}: {kind} done in {phase['seconds']:.0f} s")
    summary = summarize(times, args.batches, args.new_tokens)
    print_table(summary, args)
    load = {"before": load_before, "after": os.getloadavg()}
    elapsed = time.perf_counter() - started
    print(f"\nload average (1, 5, 15 min) before {load['before']}, after {load['after']} on "
          f"{info['cpus']} cores; {elapsed:.0f} s")

    import torch
    import transformers
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "sglang_throughput", "command": " ".join(sys.argv), "machine": info,
        "load_average": load, "elapsed_s": elapsed,
        "settings": {"shape": args.shape, "model": config, "checkpoint": args.checkpoint,
                     "quick": args.quick,
                     "kinds": args.kinds, "batches": list(args.batches),
                     "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens,
                     "max_seq_len": MAX_SEQ_LEN, "max_slots": max(args.batches),
                     "dtype": "float32", "repeats": args.repeats, "rounds": args.rounds,
                     "sampling": "temperature 1, no top-k/top-p, EOS ignored",
                     "torch_threads": list(args.threads), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "servers": servers, "phases": phases, **summary}, indent=2, default=str))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
