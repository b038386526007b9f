"""Generator decode throughput against HF transformers and the machine's roofline.

Everything is measured side by side in one run, so ratios are meaningful even on a shared, noisy
machine:

1. ceilings: dense matmul FLOP/s (a large jitted matmul) and memory read bandwidth (a jitted
   reduction over a large array, 512 MiB: main memory) of this backend, at the start of the run,
   and again for every batch size, interleaved with its timed runs (see below);
2. per model and batch size ``B``, the decode step latency and tokens/s of
   - ``raw``: the engine's jitted decode step with its sampling (``ModelRunner.decode``), tokens
     fed back on the device, no host sync inside the loop: the engine's ceiling. Its attention
     is the native CPU kernel where it builds (``rl_jax.generator.engine.kernels``: each slot's
     cache
     read up to its position only, slots split over XLA's threads); the same step with XLA's
     attention (the pages of the longest sequence's length bucket gathered, read whole, on one
     thread) is timed beside it as
     ``raw_xla_attention``;
   - ``engine``: ``Engine.generate`` end to end with ``B`` concurrent requests (scheduler, host
     transfers and per-token bookkeeping included);
   - ``engine dp``: the same engine with ``--data-parallel`` replicas (default 2), each with
     ``B / dp`` slots, its own KV cache and weights on its own host device, every decode step
     dispatched to all before any is awaited (``Engine(meshes=...)``, the server's
     ``--data_parallel``): one replica's matmuls run while another reads its cache. The process
     runs with that many host devices (``--xla_force_host_platform_device_count``), the
     one-device engine on the first;
   - ``hf``: transformers' ``generate`` on the same weights (written with ``save_pretrained``,
     loaded with ``AutoModelForCausalLM``), sampled at temperature 1 without top-k/top-p, EOS
     ignored, the same number of new tokens; with 2 and with 1 torch threads, the faster kept;
   - ``roofline``: ``max(bytes / bandwidth, FLOPs / peak)`` per step, where bytes are the weights
     a step reads plus the KV cache of the actual context (not the cache's capacity) and FLOPs
     are ``2·params·B`` plus attention. ``bandwidth`` is measured reading an array of exactly
     the step's bytes over and over, as decode steps re-read their weights and cache: when they
     fit in the last-level cache this is the cache's bandwidth, otherwise main memory's.
     ``roofline_dram`` (the same with the main-memory bandwidth, a looser bound for models that
     stay in cache) is reported beside it;
   - ``roofline_run``: the same bound with the best sustained ceilings of the whole run (see
     :func:`rejudge`). The aim (``engine_over_roofline_run`` at the best batch size) is judged
     against it, so a ceiling measured low beside one batch size cannot pass it.

The per-batch ceilings are *sustained* rates (back-to-back calls for about a quarter second,
the best of the repeats), measured in the same repeat loop as the engine: on a shared machine a
ceiling timed in a quiet moment, or as the best of a few millisecond-long calls, would catch bursts
of both cores that a second-long generation never sees, and the other way round.

For ``engine`` and ``hf`` the per-step latency is ``(t(N) - t(1)) / (N - 1)``: the time of a
generation of ``N`` new tokens minus that of a 1-token generation (prefill and first token), over
the remaining decode steps. ``wall tok/s`` is ``B·N / t(N)`` (prefill included).

The runs of one batch size are interleaved and repeated, and each time is the minimum over the
repeats: other processes on a shared machine only ever add time, and torch's OpenMP threads suffer
far more from them than XLA's thread pool (several times slower decode steps under load, which is
also why HF gets its better thread count), so a median would mostly measure the neighbours. The
load average is recorded with the results.

The roofline aim is judged on the better engine layout, each at its own best batch size.

Usage: python benchmarks/generator_throughput.py [--quick] [--data-parallel 2]
Writes benchmarks/results/generator_throughput.json and generator_throughput.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def _data_parallel_arg(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--data-parallel", type=int, default=2)
    return parser.parse_known_args(argv)[0].data_parallel


if __name__ == "__main__":  # host devices for the data-parallel engine, before jax starts
    _DP = _data_parallel_arg(sys.argv[1:])
    if _DP > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={_DP}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from rl_jax.generator.engine import kernels  # noqa: E402
from rl_jax.generator.engine.core import Engine  # noqa: E402
from rl_jax.generator.engine.config import EngineConfig  # noqa: E402
from rl_jax.generator.engine.decode import attend_pages  # noqa: E402
from rl_jax.generator.engine.kv_cache import SLOT_FIELDS, kv_bucket, pages_for  # noqa: E402
from rl_jax.generator.engine.runner import ModelRunner  # noqa: E402
from rl_jax.generator.engine.sampling import sample  # noqa: E402
from rl_jax.generator.engine.weights import make_generator_meshes  # noqa: E402
from rl_jax.generator.types import GenerateRequest, SamplingParams  # noqa: E402
from rl_jax.models.config import ModelConfig  # noqa: E402
from rl_jax.models.hf import save_pretrained  # noqa: E402
from rl_jax.trainer.state import ModelSpec  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# torch thread counts tried for HF; the faster is reported. Two threads win on a quiet machine,
# but torch's OpenMP slows down several-fold when other processes take a core, one thread much less.
HF_THREADS = (2, 1)

MODELS = {
    "small": ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=8, num_kv_heads=4, head_dim=32),
    "tiny": ModelConfig(vocab_size=1024, hidden_size=96, intermediate_size=256, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=24),
}


def log(message: str):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def best_time(fn, *, warmup: int = 2, repeats: int = 5) -> float:
    """Minimum seconds per call of ``fn`` (which blocks on its result) after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.min(times))


# ---- ceilings -----------------------------------------------------------------------------------

def matmul_peak_flops(sizes=(1024, 2048)) -> dict:
    """Best FLOP/s of a square float32 matmul over ``sizes``."""
    per_size = {}
    for n in sizes:
        a = jnp.ones((n, n), jnp.float32)
        f = jax.jit(lambda x, y: x @ y)
        seconds = best_time(lambda: jax.block_until_ready(f(a, a)), repeats=10)
        per_size[n] = 2 * n ** 3 / seconds
    return {"flops_per_s": max(per_size.values()), "per_size": per_size}


def memory_bandwidth(mib: int = 512) -> dict:
    """Bytes/s of a jitted reduction (reads ``mib`` MiB) and of an elementwise copy (reads and
    writes it); the read bandwidth is the roofline's (a decode step mostly reads)."""
    x = jnp.ones((mib * 2 ** 20 // 4 // 1024, 1024), jnp.float32)
    nbytes = x.size * 4
    read = jax.jit(lambda x: jnp.sum(x, axis=0))
    copy = jax.jit(lambda x: x * 1.0001)
    read_s = best_time(lambda: jax.block_until_ready(read(x)), repeats=7)
    copy_s = best_time(lambda: jax.block_until_ready(copy(x)), repeats=7)
    return {"read_bytes_per_s": nbytes / read_s, "copy_bytes_per_s": 2 * nbytes / copy_s,
            "array_bytes": nbytes}


def _read_loops(nbytes: int) -> list:
    """Jitted ways of reading a float32 array of about ``nbytes`` (a sum to one number and row
    sums; which is faster depends on the size and the machine), each as ``(fn, bytes per
    call)``; a call reads the array several times when it is under 8 MiB."""
    x = jnp.ones((max(nbytes // 4 // 1024, 1), 1024), jnp.float32)
    reps = max(1, -(-(8 << 20) // x.nbytes))
    loops = []
    for axis in (None, 1):
        def body(i, acc, x, axis=axis):  # scaled by i: the reads cannot leave the loop
            return acc + jnp.sum(jnp.sum(x * (i + 1).astype(jnp.float32), axis=axis))

        f = jax.jit(lambda x, body=body: jax.lax.fori_loop(
            0, reps, lambda i, acc: body(i, acc, x), jnp.zeros((), jnp.float32)))
        loops.append(((lambda f=f: f(x)), reps * x.nbytes))
    return loops


def sustained_rate(fn, work: float, seconds: float = 0.25) -> float:
    """``work`` per second of ``fn`` (which dispatches asynchronously) called back to back for
    about ``seconds``."""
    jax.block_until_ready(fn())
    calls, start = 0, time.perf_counter()
    while True:
        out = fn()
        calls += 1
        if calls % 4 == 0:
            jax.block_until_ready(out)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return work * calls / elapsed


class Ceilings:
    """Sustained matmul FLOP/s (square ``n``-matmul), read bandwidth of main memory (512 MiB)
    and of a working set of a given size, measured on demand; compiled once."""

    def __init__(self, matmul_n: int = 1024, dram_mib: int = 512):
        a = jnp.ones((matmul_n, matmul_n), jnp.float32)
        f = jax.jit(lambda x: x @ x)
        self._matmul = (lambda: f(a)), 2 * matmul_n ** 3
        self._dram = _read_loops(dram_mib << 20)
        self._reads: dict[int, list] = {}

    def measure(self, working_set_bytes: int) -> dict:
        if working_set_bytes not in self._reads:
            self._reads[working_set_bytes] = _read_loops(working_set_bytes)
        dram = max(sustained_rate(*read) for read in self._dram)
        # A working set smaller than main memory is never read slower than main memory; below
        # a few MiB the reduction itself, not the memory, limits the measurement.
        working_set = max([dram] + [sustained_rate(*read)
                                    for read in self._reads[working_set_bytes]])
        return {"peak_flops": sustained_rate(*self._matmul), "bandwidth": working_set,
                "dram_bandwidth": dram, "working_set_bytes": working_set_bytes}


def best_ceilings(measured: list[dict]) -> dict:
    """The highest of each rate over repeated :meth:`Ceilings.measure` results."""
    out = dict(measured[0])
    for key in ("peak_flops", "bandwidth", "dram_bandwidth"):
        out[key] = max(m[key] for m in measured)
        out[f"{key}_all"] = [m[key] for m in measured]
    return out


def roofline_step(cfg: ModelConfig, batch: int, context: float, peak_flops: float,
                  bandwidth: float, itemsize: int = 4) -> dict:
    """Roofline of one decode step of ``batch`` sequences with mean ``context`` tokens cached.

    Bytes: every weight a step reads (all but the embedding table, of which ``batch`` rows; the
    whole table when tied, as it is the unembedding) plus the KV cache of the context, read, and
    the new keys/values, written. FLOPs: 2 per weight per sequence plus attention scores and
    values over the context.
    """
    d, layers = cfg.hidden_size, cfg.num_layers
    dense = cfg.num_params(include_embeddings=False)
    unembed = cfg.vocab_size * d
    weight_bytes = (dense + unembed) * itemsize + batch * d * itemsize
    kv_per_token = 2 * layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    kv_bytes = kv_per_token * batch * (context + 1)
    flops = 2 * (dense + unembed) * batch + 4 * layers * cfg.num_heads * cfg.head_dim * (
        context + 1) * batch
    memory_s, compute_s = (weight_bytes + kv_bytes) / bandwidth, flops / peak_flops
    return {"step_s": max(memory_s, compute_s), "memory_s": memory_s, "compute_s": compute_s,
            "bound": "memory" if memory_s >= compute_s else "compute",
            "bytes": weight_bytes + kv_bytes, "flops": flops}


# ---- the engine ---------------------------------------------------------------------------------

def prompts_for(cfg: ModelConfig, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, prompt_len)).astype(
        np.int32)


def admit_prompts(runner: ModelRunner, params, prompts: np.ndarray, position: int | None = None):
    """Prefills ``prompts [B, P]`` into slots ``0..B-1`` and samples their first tokens; the
    slots continue at ``position`` (default ``P``) and hold the KV-cache pages of
    ``max_seq_len`` positions. Returns the packed first tokens."""
    b, p = prompts.shape
    for slot in range(b):  # a slot takes pages only when it holds none
        runner.pages.release(slot)
    k, v, logits = runner.prefill(params, prompts, np.full((b,), p, np.int32))
    values = {name: np.zeros((b,), dtype) for name, dtype in SLOT_FIELDS.items()}
    values.update(position=np.full((b,), p if position is None else position),
                  seed=np.arange(b), temperature=np.ones(b), top_k=np.full(b, -1),
                  top_p=np.ones(b))
    slots = np.arange(b, dtype=np.int32)
    out = runner.admit(k, v, logits, slots, slots, values, np.ones((b,), bool), False)
    for slot in range(b):  # the pages of every position later steps write (as the engine gives)
        runner.pages.grow(slot, runner.max_seq_len)
    return out


def raw_decode_steps(runner: ModelRunner, params, weights, prompts: np.ndarray,
                     new_tokens: int) -> float:
    """Prefills ``prompts`` into slots ``0..B-1`` and runs ``new_tokens - 1`` decode+sample
    steps (``ModelRunner.decode``: tokens stay on the device, no host sync inside the loop);
    returns seconds per step (decode loop only)."""
    b, p = prompts.shape
    jax.block_until_ready(admit_prompts(runner, params, prompts))
    start = time.perf_counter()
    for i in range(1, new_tokens):
        out = runner.decode(weights, b, p + i, False)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / max(new_tokens - 1, 1)


def dense_matmuls(weights: dict, x: jax.Array) -> jax.Array:
    """Every dense matmul of a decode step of ``x [B, D]``, at its shapes (fused query/key/value,
    output, fused gate/up, down, unembedding), chained so none can be dropped; no attention,
    norms or sampling."""
    for layer in weights["layers"]:
        qkv = x @ layer["wqkv"]
        out = qkv[:, :layer["wo"].shape[0]] @ layer["wo"]
        gate_up = jnp.einsum("sd,dcf->scf", x + out, layer["w_gate_up"])
        x = x + out + (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]) @ layer["w_down"]
    return x @ weights["unembed"]


def step_components(runner: ModelRunner, params, weights, batch: int, position: int) -> dict:
    """Seconds of a raw step (``decode``: the model and sampling, ``batch`` slots at about
    ``position``) and of its pieces alone: ``matmuls`` (:func:`dense_matmuls`), ``attention``
    (every layer's attention over the cache at the length the step reads, ``attention_kv_len``,
    in the runner's form; with the native kernel, XLA's form as ``attention_xla``),
    ``sample`` (sampling from ``[batch, V]`` logits), plus ``sample_filtered``, the sampling path
    that top-k/top-p requests switch on (top-k 50 and top-p 0.9 here; not used by the
    benchmark's requests), and ``sample_top_p``, the same path with top-p 0.9 alone (one search
    of the threshold instead of two)."""
    cfg = runner.config
    prompts = prompts_for(cfg, batch, 16, seed=7)
    jax.block_until_ready(admit_prompts(runner, params, prompts, position=position))
    decode_s = best_time(lambda: jax.block_until_ready(
        runner.decode(weights, batch, position + 16, False)), repeats=10)
    logits = jax.random.normal(jax.random.key(0), (batch, cfg.vocab_size)) * 3
    ones, zeros = jnp.ones((batch,)), jnp.zeros((batch,), jnp.int32)
    seeds = jnp.arange(batch, dtype=jnp.uint32)
    plain = (ones, zeros - 1, ones, ones * 0, seeds, zeros, zeros)
    filtered = (ones, zeros + 50, ones * 0.9, ones * 0, seeds, zeros, zeros)
    top_p = (ones, zeros - 1, ones * 0.9, ones * 0, seeds, zeros, zeros)
    sample_fn = jax.jit(sample, static_argnames="filtered")
    x = jax.random.normal(jax.random.key(1), (batch, cfg.hidden_size))
    matmuls = jax.jit(dense_matmuls)
    kv_heads = cfg.num_kv_heads
    q = jax.random.normal(jax.random.key(2), (batch, kv_heads, cfg.num_heads // kv_heads,
                                              cfg.head_dim))
    positions = jnp.full((batch,), position + 16, jnp.int32)
    caches = list(zip(runner.k_cache, runner.v_cache))  # per layer, the page pools
    full = jnp.asarray(runner.pages.table[:batch])
    # XLA's form: the pages of the step's bucket gathered (decode.attend_pages)
    bucket = full[:, :pages_for(kv_bucket(position + 17, runner.max_seq_len), runner.page_size)]
    attention_xla = jax.jit(lambda q, caches: [
        attend_pages(q, k, v, bucket, positions, dtype=q.dtype) for k, v in caches])
    attention = attention_xla
    extra = {}
    if runner.native_attention:  # the runner's form, and XLA's beside it
        attention = jax.jit(lambda q, caches: [
            kernels.paged_decode_attention(q, k, v, full, positions) for k, v in caches])
        extra["attention_xla"] = best_time(
            lambda: jax.block_until_ready(attention_xla(q, caches)), repeats=10)
    return {**extra,
        "decode": decode_s,
        "matmuls": best_time(lambda: jax.block_until_ready(matmuls(weights, x)), repeats=10),
        "attention": best_time(lambda: jax.block_until_ready(attention(q, caches)), repeats=10),
        "attention_kv_len": runner.kv_len,
        "sample": best_time(lambda: jax.block_until_ready(
            sample_fn(logits, *plain, filtered=False)), repeats=10),
        "sample_filtered": best_time(lambda: jax.block_until_ready(
            sample_fn(logits, *filtered, filtered=True)), warmup=1, repeats=5),
        "sample_top_p": best_time(lambda: jax.block_until_ready(
            sample_fn(logits, *top_p, filtered=True)), warmup=1, repeats=5)}


def component_rooflines(cfg: ModelConfig, batch: int, context: float, kv_len: int,
                        ceilings: dict, itemsize: int = 4) -> dict:
    """Each piece's own roofline (seconds): ``matmuls`` (weights read once, 2 FLOPs per weight
    per sequence), ``attention`` (the live context's keys and values, 4 FLOPs per element per
    query head; ``attention_read`` the same with the cache length the step reads) and ``sample``
    (the logits read twice)."""
    peak, bw = ceilings["peak_flops"], ceilings["bandwidth"]
    mm = cfg.num_params(include_embeddings=False) + cfg.vocab_size * cfg.hidden_size
    kv_elems = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * batch
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * batch * (context + 1)
    return {"matmuls": max(mm * itemsize / bw, 2 * mm * batch / peak),
            "attention": max(kv_elems * (context + 1) * itemsize / bw, attn_flops / peak),
            "attention_read": kv_elems * kv_len * itemsize / bw,
            "sample": 2 * batch * cfg.vocab_size * 4 / bw}


def engine_generate(engine: Engine, prompts: np.ndarray, new_tokens: int) -> float:
    """Seconds for ``B`` concurrent requests of ``new_tokens`` sampled tokens each.

    The requests are queued while the engine is paused, so they are admitted together (one
    prefill batch, the same shapes every run) rather than as the scheduler happens to see them.
    """
    sampling = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True,
                               seed=i) for i in range(len(prompts))]
    engine.pause("in_place")
    futures = [engine.submit(GenerateRequest(prompt.tolist(), sp))
               for prompt, sp in zip(prompts, sampling)]
    start = time.perf_counter()
    engine.resume()
    outputs = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    assert all(len(o[0].output_ids) == new_tokens for o in outputs)
    return seconds


# ---- HF transformers ----------------------------------------------------------------------------

def load_hf(cfg: ModelConfig, params, directory: Path):
    import torch
    from transformers import AutoModelForCausalLM
    spec = ModelSpec(cfg, mesh=None)
    save_pretrained(spec.merge(params), directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = prompts_for(cfg, 2, 16, seed=1)
    with torch.inference_mode():
        hf_logits = model(torch.from_numpy(ids).long()).logits.numpy()
    ours = spec.merge(params)
    hidden = ours(jnp.asarray(ids))
    our_logits = np.asarray(ours.logits(hidden))
    return model, float(np.abs(hf_logits - our_logits).max())


def hf_generate(model, prompts: np.ndarray, new_tokens: int, threads: int) -> float:
    import torch
    from transformers import GenerationConfig
    torch.set_num_threads(threads)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0)
    # generate() fills an unset EOS from the checkpoint's own generation config: cleared there,
    # or a sampled EOS would end a generation early.
    model.generation_config.eos_token_id = None
    ids = torch.from_numpy(prompts).long()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        seconds = time.perf_counter() - start
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return seconds


# ---- one model ----------------------------------------------------------------------------------

def data_parallel_engine(cfg: ModelConfig, params, replicas: int, engine_config: EngineConfig
                         ) -> Engine:
    """An engine with ``replicas`` data-parallel replicas, one per host device."""
    meshes = make_generator_meshes(1, replicas)
    placed = jax.device_put(params, NamedSharding(meshes[0], PartitionSpec()))
    return Engine(cfg, placed, meshes=meshes, engine_config=engine_config)


def bench_model(name: str, cfg: ModelConfig, args, ceilings: dict, workdir: Path) -> dict:
    spec = ModelSpec(cfg, mesh=None)
    params = spec.init_params(seed=0)
    dp = args.data_parallel
    hf_model, parity = (None, None) if args.no_hf else load_hf(cfg, params, workdir / name)
    log(f"{name}: {cfg.num_params() / 1e6:.2f}M params"
        + ("" if parity is None else f", HF logits parity {parity:.1e}"))
    n, p = args.new_tokens, args.prompt_len
    context = p + (n - 1) / 2  # mean cached context of a decode step
    meter = Ceilings()
    rows = []
    for b in args.batches:
        working_set = int(roofline_step(cfg, b, context, 1.0, 1.0)["bytes"])
        prompts = prompts_for(cfg, b, p, seed=b)
        runner = ModelRunner(cfg, max_slots=b, max_seq_len=args.max_seq_len)
        weights = runner.prepare(params)
        # the same raw step with XLA's attention, beside the native kernel's
        runner_xla = (ModelRunner(cfg, max_slots=b, max_seq_len=args.max_seq_len,
                                  attention="xla") if runner.native_attention else None)
        engine_config = EngineConfig(max_slots=b, max_seq_len=args.max_seq_len,
                                     max_prefill_tokens=max(2048, b * p))
        engine = Engine(cfg, params, engine_config=engine_config)
        engines = {"engine": engine}
        if dp > 1 and b % dp == 0:
            engines["engine_dp"] = data_parallel_engine(cfg, params, dp, engine_config)
        # Warm-up: compiles every shape the timed runs meet (prefill, decode, sampling buckets).
        raw_decode_steps(runner, params, weights, prompts, n)
        if runner_xla is not None:
            raw_decode_steps(runner_xla, params, weights, prompts, n)
        for _ in range(2):  # the second run meets the cache sizes of a timed one
            for eng in engines.values():
                engine_generate(eng, prompts, n)
                engine_generate(eng, prompts, 1)
        threads = [] if hf_model is None else HF_THREADS
        for t in threads:
            hf_generate(hf_model, prompts, min(n, 8), threads=t)
        raw, raw_xla, measured = [], [], []
        eng_n, eng_1 = {k: [] for k in engines}, {k: [] for k in engines}
        hf_n, hf_1 = {t: [] for t in threads}, {t: [] for t in threads}
        for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
            raw.append(raw_decode_steps(runner, params, weights, prompts, n))
            if runner_xla is not None:
                raw_xla.append(raw_decode_steps(runner_xla, params, weights, prompts, n))
            for kind, eng in engines.items():
                eng_n[kind].append(engine_generate(eng, prompts, n))
                eng_1[kind].append(engine_generate(eng, prompts, 1))
            for t in threads:
                hf_n[t].append(hf_generate(hf_model, prompts, n, threads=t))
                hf_1[t].append(hf_generate(hf_model, prompts, 1, threads=t))
            measured.append(meter.measure(working_set))
        parts = step_components(runner, params, weights, b, p + n // 2)
        parts_context = p + n // 2 + 16  # the components' step attends over this many tokens
        for eng in engines.values():
            eng.shutdown()
        del runner, runner_xla, engine, engines, eng
        gc.collect()
        best = lambda xs: float(np.min(xs))  # noqa: E731
        row_ceilings = best_ceilings(measured)
        roof = roofline_step(cfg, b, context, peak_flops=row_ceilings["peak_flops"],
                             bandwidth=row_ceilings["bandwidth"])
        roof_dram = roofline_step(cfg, b, context, peak_flops=row_ceilings["peak_flops"],
                                  bandwidth=row_ceilings["dram_bandwidth"])
        row = {"batch": b, "raw_step_s": best(raw),
               **({"raw_xla_attention_step_s": best(raw_xla)} if raw_xla else {}),
               **{f"{kind}_step_s": (best(eng_n[kind]) - best(eng_1[kind])) / (n - 1)
                  for kind in eng_n},
               **{f"{kind}_wall_s": best(eng_n[kind]) for kind in eng_n},
               "roofline_step_s": roof["step_s"], "roofline": roof,
               "roofline_dram_step_s": roof_dram["step_s"], "roofline_dram": roof_dram,
               "ceilings": row_ceilings,
               "components_roofline_s": component_rooflines(
                   cfg, b, parts_context, parts["attention_kv_len"], row_ceilings),
               "components_s": parts,
               "times_s": {"raw_step": raw, "engine_n": eng_n, "engine_1": eng_1, "hf_n": hf_n,
                           "hf_1": hf_1}}
        if threads:  # HF's best torch thread count at this batch size
            hf_step = {t: (best(hf_n[t]) - best(hf_1[t])) / (n - 1) for t in threads}
            t = min(threads, key=hf_step.get)
            row.update(hf_step_s=hf_step[t], hf_wall_s=best(hf_n[t]), hf_threads=t,
                       hf_step_s_by_threads=hf_step)
        if "engine_dp_step_s" in row:
            row["data_parallel"] = dp
        for kind in ("raw", "engine", "engine_dp", "hf", "roofline"):
            if f"{kind}_step_s" in row:
                row[f"{kind}_tok_s"] = b / row[f"{kind}_step_s"]
        row["raw_over_roofline"] = row["roofline_step_s"] / row["raw_step_s"]
        for kind in eng_n:
            row[f"{kind}_wall_tok_s"] = b * n / row[f"{kind}_wall_s"]
            row[f"{kind}_over_roofline"] = row["roofline_step_s"] / row[f"{kind}_step_s"]
            row[f"{kind}_over_roofline_dram"] = (row["roofline_dram_step_s"]
                                                 / row[f"{kind}_step_s"])
            if threads:
                row[f"{kind}_over_hf"] = row["hf_step_s"] / row[f"{kind}_step_s"]
                row[f"{kind}_over_hf_wall"] = row["hf_wall_s"] / row[f"{kind}_wall_s"]
        if threads:
            row["hf_wall_tok_s"] = b * n / row["hf_wall_s"]
            row["raw_over_hf"] = row["hf_step_s"] / row["raw_step_s"]
        rows.append(row)
        own = row["components_roofline_s"]
        log(f"{name} B={b:<3} step ms: raw {row['raw_step_s'] * 1e3:7.2f}  "
            + (f"(XLA attention {row['raw_xla_attention_step_s'] * 1e3:.2f})  "
               if raw_xla else "")
            + f"engine {row['engine_step_s'] * 1e3:7.2f}  "
            + (f"engine dp{dp} {row['engine_dp_step_s'] * 1e3:7.2f}  "
               if "engine_dp_step_s" in row else "")
            + (f"hf {row['hf_step_s'] * 1e3:7.2f} ({row['hf_threads']} thr)  " if threads else "")
            + f"roofline {row['roofline_step_s'] * 1e3:6.2f} ({roof['bound']}; "
            f"{row_ceilings['peak_flops'] / 1e9:.0f} GFLOP/s, {row_ceilings['bandwidth'] / 1e9:.0f}"
            f" GB/s at {working_set / 2 ** 20:.0f} MiB; main memory "
            f"{row_ceilings['dram_bandwidth'] / 1e9:.0f} GB/s: {roof_dram['step_s'] * 1e3:.2f})"
            f"\n    alone, ms (own roofline): step {parts['decode'] * 1e3:.2f}; matmuls "
            f"{parts['matmuls'] * 1e3:.2f} ({own['matmuls'] * 1e3:.2f}), attention "
            f"{parts['attention'] * 1e3:.2f} ({own['attention'] * 1e3:.2f}; reading "
            f"{parts['attention_kv_len']} positions {own['attention_read'] * 1e3:.2f}"
            + (f"; XLA's form {parts['attention_xla'] * 1e3:.2f}" if "attention_xla" in parts
               else "")
            + f"), sampling "
            f"{parts['sample'] * 1e3:.2f} ({own['sample'] * 1e3:.2f}); filtered sampling "
            f"{parts['sample_filtered'] * 1e3:.2f} (top-p alone "
            f"{parts['sample_top_p'] * 1e3:.2f})")
    del hf_model
    gc.collect()
    return {"model": name, "params": cfg.num_params(), "config": cfg.to_hf(),
            "hf_logits_parity": parity, "rows": rows, "summary": summarize(rows)}


def rejudge(results: list[dict]) -> dict:
    """Each row's roofline again, against the run's best sustained ceilings: the highest matmul
    rate measured beside any batch size of any model, and for bandwidth the higher of the row's
    own working-set rate and the best main-memory rate of the run. A ceiling measured low beside
    one batch size (a neighbour busy on the other core while the engine happened not to be
    slowed) would otherwise flatter that row; the hardware's bound does not change from one
    batch size to the next. Adds ``roofline_run``, ``*_over_roofline_run`` and the summaries'
    aims judged on them; returns the run's ceilings."""
    rows = [r for result in results for r in result["rows"]]
    run = {"peak_flops": max(x for r in rows for x in r["ceilings"]["peak_flops_all"]),
           "dram_bandwidth": max(x for r in rows for x in r["ceilings"]["dram_bandwidth_all"])}
    for r in rows:
        roof = r["roofline"]
        bandwidth = max(r["ceilings"]["bandwidth"], run["dram_bandwidth"])
        memory_s, compute_s = roof["bytes"] / bandwidth, roof["flops"] / run["peak_flops"]
        r["roofline_run"] = {"step_s": max(memory_s, compute_s), "memory_s": memory_s,
                             "compute_s": compute_s, "bandwidth": bandwidth,
                             "bound": "memory" if memory_s >= compute_s else "compute"}
        for kind in ("raw", "engine", "engine_dp"):
            if f"{kind}_step_s" in r:
                r[f"{kind}_over_roofline_run"] = (r["roofline_run"]["step_s"]
                                                  / r[f"{kind}_step_s"])
    for result in results:
        result["summary"] = summarize(result["rows"])
    return run


def summarize(rows: list[dict]) -> dict:
    best_engine = max(rows, key=lambda r: r["engine_tok_s"])
    best_raw = max(rows, key=lambda r: r["raw_tok_s"])
    out = {
        "engine_best_batch": best_engine["batch"],
        "engine_over_roofline_at_best_batch": best_engine["engine_over_roofline"],
        "engine_over_roofline_dram_at_best_batch": best_engine["engine_over_roofline_dram"],
        "raw_best_batch": best_raw["batch"],
        "raw_over_roofline_at_best_batch": best_raw["raw_over_roofline"],
        "engine_over_roofline_max": max(r["engine_over_roofline"] for r in rows),
        "raw_over_roofline_max": max(r["raw_over_roofline"] for r in rows),
    }
    big = [r for r in rows if r["batch"] >= 16 and "engine_over_hf" in r]
    if big:
        out["engine_over_hf_min_at_batch_ge_16"] = min(r["engine_over_hf"] for r in big)
        out["aim_2x_hf_at_batch_ge_16"] = out["engine_over_hf_min_at_batch_ge_16"] >= 2
    judged = "engine_over_roofline"
    if "engine_over_roofline_run" in best_engine:
        judged = "engine_over_roofline_run"
        out["engine_over_roofline_run_at_best_batch"] = best_engine["engine_over_roofline_run"]
        out["engine_over_roofline_run_max"] = max(r["engine_over_roofline_run"] for r in rows)
    out["aim_layout"] = "one device"
    out["aim_engine_over_roofline_at_best_batch"] = best_engine[judged]
    dp_rows = [r for r in rows if "engine_dp_tok_s" in r]
    if dp_rows:
        best_dp = max(dp_rows, key=lambda r: r["engine_dp_tok_s"])
        dp_judged = judged.replace("engine_", "engine_dp_", 1)
        out.update({"engine_dp_best_batch": best_dp["batch"],
                    "data_parallel": best_dp["data_parallel"],
                    "engine_dp_over_engine_at_its_best_batch":
                        best_dp["engine_dp_tok_s"] / best_engine["engine_tok_s"],
                    f"{dp_judged}_at_best_batch": best_dp[dp_judged]})
        if best_dp[dp_judged] > out["aim_engine_over_roofline_at_best_batch"]:
            out["aim_layout"] = f"{best_dp['data_parallel']} data-parallel replicas"
            out["aim_engine_over_roofline_at_best_batch"] = best_dp[dp_judged]
    out["aim_half_roofline_at_best_batch"] = out["aim_engine_over_roofline_at_best_batch"] >= 0.5
    return out


def print_table(result: dict):
    rows = result["rows"]
    has_hf = "hf_step_s" in rows[0]
    print(f"\n{result['model']} ({result['params'] / 1e6:.2f}M params): decode step latency (ms) "
          "and tokens/s")
    head = (f"{'B':>4} | {'raw ms':>7} {'engine ms':>9} " + (f"{'hf ms':>7} " if has_hf else "")
            + f"{'roof ms':>7} {'bound':>7} | {'raw tok/s':>9} {'engine':>8} "
            + (f"{'hf':>8} " if has_hf else "") + f"{'roofline':>8} | "
            + (f"{'eng/hf':>6} {'raw/hf':>6} " if has_hf else "") + f"{'eng/roof':>8} "
            f"{'raw/roof':>8} {'eng/dram':>8} {'eng/run':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['batch']:>4} | {r['raw_step_s'] * 1e3:7.2f} {r['engine_step_s'] * 1e3:9.2f} "
              + (f"{r['hf_step_s'] * 1e3:7.2f} " if has_hf else "")
              + f"{r['roofline_step_s'] * 1e3:7.2f} {r['roofline']['bound']:>7} | "
              f"{r['raw_tok_s']:9.0f} {r['engine_tok_s']:8.0f} "
              + (f"{r['hf_tok_s']:8.0f} " if has_hf else "") + f"{r['roofline_tok_s']:8.0f} | "
              + (f"{r['engine_over_hf']:6.2f} {r['raw_over_hf']:6.2f} " if has_hf else "")
              + f"{r['engine_over_roofline']:8.2f} {r['raw_over_roofline']:8.2f} "
              f"{r['engine_over_roofline_dram']:8.2f} {r['engine_over_roofline_run']:8.2f}")
    dp_rows = [r for r in rows if "engine_dp_step_s" in r]
    if dp_rows:
        print(f"with {dp_rows[0]['data_parallel']} data-parallel replicas (one host device each):")
        for r in dp_rows:
            speedup = r["engine_step_s"] / r["engine_dp_step_s"]
            print(f"{r['batch']:>4} | engine dp {r['engine_dp_step_s'] * 1e3:7.2f} ms "
                  f"{r['engine_dp_tok_s']:8.0f} tok/s, {speedup:.2f}x the one-device engine; "
                  f"dp/roof {r['engine_dp_over_roofline']:.2f}, dp/run "
                  f"{r['engine_dp_over_roofline_run']:.2f}"
                  + (f", dp/hf {r['engine_dp_over_hf']:.2f}" if has_hf else ""))
    s = result["summary"]
    print(f"best engine batch {s['engine_best_batch']}: "
          f"{s['engine_over_roofline_at_best_batch']:.2f} of roofline (max over batches "
          f"{s['engine_over_roofline_max']:.2f}; of the main-memory roofline "
          f"{s['engine_over_roofline_dram_at_best_batch']:.2f}); raw step at its best batch "
          f"{s['raw_best_batch']}: {s['raw_over_roofline_at_best_batch']:.2f}; against the run's "
          f"best ceilings {s['engine_over_roofline_run_at_best_batch']:.2f} (max over batches "
          f"{s['engine_over_roofline_run_max']:.2f})")
    if "engine_over_hf_min_at_batch_ge_16" in s:
        print(f"engine/HF at batch >= 16: min {s['engine_over_hf_min_at_batch_ge_16']:.2f}x "
              f"(aim >= 2x: {'met' if s['aim_2x_hf_at_batch_ge_16'] else 'NOT met'}); "
              f"aim >= 50% of roofline (the run's best ceilings) at best batch: "
              f"{s['aim_engine_over_roofline_at_best_batch']:.2f} with {s['aim_layout']}, "
              f"{'met' if s['aim_half_roofline_at_best_batch'] else 'NOT met'}")


def plot(results: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4.2 * len(results)), squeeze=False)
    styles = {"raw": ("engine: jitted step", "C0", "o-"), "engine": ("engine: end to end", "C1",
              "s-"), "engine_dp": ("engine: data-parallel replicas", "C3", "D-"),
              "hf": ("HF generate", "C2", "^-"), "roofline": ("roofline", "k", "--")}
    for (ax_lat, ax_tps), result in zip(axes, results):
        rows = result["rows"]
        batches = [r["batch"] for r in rows]
        for kind, (label, color, style) in styles.items():
            have = [r for r in rows if f"{kind}_step_s" in r]
            if not have:
                continue
            if kind == "engine_dp":
                label = f"engine: {have[0]['data_parallel']} data-parallel replicas"
            ax_lat.plot([r["batch"] for r in have], [r[f"{kind}_step_s"] * 1e3 for r in have],
                        style, color=color, label=label)
            ax_tps.plot([r["batch"] for r in have], [r[f"{kind}_tok_s"] for r in have], style,
                        color=color, label=label)
        title = f"{result['model']} ({result['params'] / 1e6:.1f}M params)"
        ax_lat.set(xscale="log", yscale="log", xlabel="batch size",
                   ylabel="decode step latency (ms)", title=f"{title}: step latency")
        ax_tps.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s",
                   title=f"{title}: throughput")
        for ax in (ax_lat, ax_tps):
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.grid(True, which="both", alpha=0.3)
        ax_lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one model, three batch sizes, 32 new tokens, two repeats")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated of {sorted(MODELS)} or named shapes "
                        "(rl_jax.models.shapes, e.g. qwen2.5-0.5b: random weights)")
    parser.add_argument("--out", default=str(RESULTS / "generator_throughput.json"),
                        help="results file (a PNG beside it)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=512,
                        help="engine KV-cache length per slot (EngineConfig default: 512)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--data-parallel", type=int, default=2,
                        help="replicas of the data-parallel engine, one host device each (1: none)")
    args = parser.parse_args()
    if args.data_parallel > jax.device_count():
        parser.error(f"--data-parallel={args.data_parallel} needs as many host devices; this "
                     f"process has {jax.device_count()} (XLA_FLAGS sets another count)")
    args.models = (args.models or ("small" if args.quick else "small,tiny")).split(",")
    from rl_jax.models.shapes import shape as named_shape
    configs = {name: MODELS[name] if name in MODELS else named_shape(name)
               for name in args.models}
    args.batches = [int(b) for b in (args.batches or ("1,16,64" if args.quick
                                                      else "1,4,16,32,64,128,256")).split(",")]
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)
    args.repeats = args.repeats or (2 if args.quick else 3)

    load_before = os.getloadavg()
    log(f"backend: {jax.default_backend()} x{jax.device_count()} ({platform.processor()}), "
        f"models {args.models}, batches {args.batches}, prompt {args.prompt_len} + "
        f"{args.new_tokens} new tokens, max_seq_len {args.max_seq_len}")
    if not args.no_hf:
        import torch
        log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    flops = matmul_peak_flops((512, 1024) if args.quick else (1024, 2048))
    bw = memory_bandwidth(256 if args.quick else 512)
    ceilings = {"peak_flops": flops["flops_per_s"], "bandwidth": bw["read_bytes_per_s"],
                "matmul": flops, "memory": bw}
    log(f"ceilings: matmul {flops['flops_per_s'] / 1e9:.1f} GFLOP/s, read bandwidth "
        f"{bw['read_bytes_per_s'] / 2 ** 30:.1f} GiB/s (copy {bw['copy_bytes_per_s'] / 2 ** 30:.1f}"
        " GiB/s)")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results.append(bench_model(name, configs[name], args, ceilings, Path(tmp)))
    ceilings["run"] = rejudge(results)
    log(f"the run's best sustained ceilings: matmul {ceilings['run']['peak_flops'] / 1e9:.0f} "
        f"GFLOP/s, main memory {ceilings['run']['dram_bandwidth'] / 1e9:.0f} GB/s")
    for result in results:
        print_table(result)
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on "
          f"{os.cpu_count()} cores")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "backend": jax.default_backend(), "devices": jax.device_count(),
        "settings": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "max_seq_len": args.max_seq_len, "repeats": args.repeats,
                     "sampling": "temperature 1, no top-k/top-p, EOS ignored", "quick": args.quick},
        "load_average": load, "cpus": os.cpu_count(), "ceilings": ceilings,
        "models": results}, indent=2, default=str))
    png = out.with_suffix(".png")
    plot(results, png)
    log(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
