"""Time to bring a running real SGLang server (0.5.23, its CPU engine) to a new weight version, by
each path this project has to it, against a memcpy of the same bytes measured in the same run.

Variants (one server, started as ``tests/sglang_fixtures.py`` starts it; versions count up):

- ``sidecar/disk`` and ``sidecar/tensor``: the trainer's ``Publisher.publish`` (shm staging,
  checksums, finiteness), then the sidecar (:mod:`rl_jax.transfer.sglang.sidecar`, in this
  process) pulls the version over ``shm``, verifies it, writes the HF image and hands it to
  SGLang: ``/update_weights_from_disk`` of a ``model.safetensors`` in tmpfs, or
  ``/update_weights_from_tensor`` of torch shared memory. Timed from the publish call to the
  sidecar's return (the server answered with the new version); split into publish, pull
  (manifest to verified arrays), fill (the HF image) and server (SGLang's load).
- ``broadcast``: ``rl_jax.transfer.sglang.broadcast.SGLangWeightSender.send`` (HF tensors gathered
on this
  host and broadcast over gloo from rank 0; ``master_port=0``, ``pause_mode="in_place"``, its
  default 512 MB buckets), timed around ``send``.
- ``memcpy``: ``np.copyto`` of every parameter into a warm buffer (the model's bytes, once;
  best of 3 per round): the ceiling.

Every version publishes the checkpoint's own weights (SGLang loads them whatever they hold); at
the end the server's greedy log-probs must equal those before the first update, bit for bit.
After two warm-up rounds (each path alternates two images: both get written once),
``--rounds`` rounds each time every variant once, interleaved (the order reversed every other
round). Ratios
are ``best memcpy / best time`` (1.0: the path moved the model as fast as one plain copy).

Shapes: ``tiny`` (the tests' checkpoint, ``tests/generator_fixtures.write_checkpoints``) and
``qwen2.5-0.5b`` (random weights of the real shape, ``python -m rl_jax.models.shapes write``).
``--dtype`` is the server's dtype and the one published (float32 by default; bfloat16 halves
every copy). The run needs about 3.5 GiB for SGLang's processes and ``MEMORY_FACTORS`` times
the model's bytes (parameters, staging, SGLang's weights; each sidecar's two tmpfs files or
shared buffers; the broadcast's gather), about 16 GiB for the 0.5B shape in float32 with every
variant, and refuses to start when less is available (``--allow_overcommit``; fewer
``--variants`` or ``--dtype=bfloat16`` need less).

Usage: python benchmarks/sglang_weight_paths.py [--shape=tiny|qwen2.5-0.5b] [--rounds 3]
           [--dtype=float32|bfloat16] [--variants=sidecar/disk,sidecar/tensor,broadcast]
Writes benchmarks/results/sglang_weight_paths.json (one entry per shape, dtype and variant set
unless all: the machine,
CPUs and load average before and after, the settings, every time and the ratios) and prints a
table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from generator_fixtures import http, write_checkpoints  # noqa: E402
from rl_jax.generator.launcher.pool import ServerPool  # noqa: E402
from rl_jax.generator.engine.weights import load_params  # noqa: E402
from rl_jax.models.hf import read_config  # noqa: E402
from rl_jax.transfer.publisher.core import Publisher  # noqa: E402
from rl_jax.transfer.config import PublisherConfig  # noqa: E402
from rl_jax.transfer.layout import flatten  # noqa: E402
from rl_jax.transfer.sglang.broadcast import SGLangWeightSender  # noqa: E402
from rl_jax.transfer.sglang.sidecar import SGLangSidecar  # noqa: E402
from sglang_fixtures import greedy, pool_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("sidecar/disk", "sidecar/tensor", "broadcast")
# Memory the run takes: SGLang's processes (``SGLANG_BASE_BYTES``) and these multiples of the
# model's bytes: the parameters, the staging slot and SGLang's weights; each sidecar's images;
# the broadcast's gather (fitted to the peaks measured: 9.9 GB for every variant at 0.5B in
# bfloat16, 12.5 GB for sidecar/disk and broadcast in float32, parameters included)
MEMORY_FACTORS = {"base": 3.0, "sidecar/disk": 1.5, "sidecar/tensor": 1.5, "broadcast": 0.5}
SGLANG_BASE_BYTES = 7 << 29  # 3.5 GiB
PROMPT = [1, 3, 4, 5, 6, 7]
WARMUP_ROUNDS = 2  # every path alternates two images: both are written once before timing


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class MemoryWatch:
    """The lowest ``MemAvailable`` seen every 0.2 s in a daemon thread (what the run took, SGLang
    included, beside whatever else the machine did meanwhile)."""

    def __init__(self):
        self.start = self.lowest = available_memory()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            self.lowest = min(self.lowest, available_memory())
            time.sleep(0.2)


def checkpoint(shape: str, root: Path) -> Path:
    if shape == "tiny":
        return write_checkpoints(root, names=("a",))["a"]
    subprocess.run([sys.executable, "-m", "rl_jax.models.shapes", "write", shape,
                    str(root / shape), "--dtype", "float32"], check=True, cwd=ROOT)
    return root / shape


def memcpy_seconds(params: dict, repeats: int = 3) -> float:
    """Best time of one ``np.copyto`` of every parameter into a warm buffer."""
    arrays = [np.asarray(a) for a in flatten(params).values()]
    dst = np.empty(max(a.nbytes for a in arrays), np.uint8)
    best = np.inf
    for _ in range(repeats + 1):  # the first warms the buffer
        start = time.perf_counter()
        for a in arrays:
            np.copyto(dst[:a.nbytes].view(a.dtype).reshape(a.shape), a)
        best = min(best, time.perf_counter() - start)
    return best


def via_sidecar(publisher, sidecar, params, version: int) -> dict:
    start = time.perf_counter()
    stats = publisher.publish(params, version)
    published = time.perf_counter()
    update = sidecar.update(min_version=version, wait_s=60)
    total = time.perf_counter() - start
    assert update is not None and update.version == version, update
    return {"seconds": total, "publish_s": published - start, "pull_s": update.metrics.seconds,
            "fill_s": update.fill_seconds,
            "server_s": update.handoff_seconds - update.fill_seconds,
            "staged_bytes": sum(stats.bytes.values()), "pulled_bytes": update.metrics.bytes}


def via_broadcast(sender, params, version: int) -> dict:
    start = time.perf_counter()
    stats = sender.send(params, version)
    return {"seconds": time.perf_counter() - start, "buckets": stats.buckets,
            "paused": stats.paused, "bytes": stats.bytes}


def served_version(url: str) -> str:
    return http(url, "/model_info")[1]["weight_version"]


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sglang_weight_paths-"))
    try:
        return measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path) -> dict:
    model = checkpoint(args.shape, work / "ckpt")
    config = read_config(model)
    _, params = load_params(model, mesh=None, rules=None, dtype=args.dtype)
    model_bytes = sum(np.asarray(a).nbytes for a in flatten(params).values())
    need = SGLANG_BASE_BYTES + model_bytes * (
        MEMORY_FACTORS["base"] + sum(MEMORY_FACTORS[v] for v in args.variants))
    if need > available_memory() and not args.allow_overcommit:
        raise SystemExit(f"this run needs about {need / 2**30:.1f} GiB, "
                         f"{available_memory() / 2**30:.1f} GiB are available "
                         "(--dtype=bfloat16, fewer --variants, or --allow_overcommit)")
    log(f"{args.shape}: {model_bytes / 1e6:.1f} MB of {args.dtype} parameters; starting SGLang")
    memory = MemoryWatch()
    fraction = max(0.1, min(0.9, (1.25 * model_bytes + (1 << 30)) / available_memory()))
    start = time.perf_counter()
    config_ = pool_config("sglang", model, work / "logs")
    pool = ServerPool(dataclasses.replace(
        config_, dtype=args.dtype, startup_timeout=900,
        extra_args=config_.extra_args + ("--mem-fraction-static", f"{fraction:.2f}"))).start()
    startup_s = time.perf_counter() - start
    url = pool.urls[0]
    log(f"SGLang up in {startup_s:.0f} s at {url}")
    _, baseline, _ = greedy(url, PROMPT, 4, http)
    publisher = Publisher(PublisherConfig(transports=("shm",),
                                          staging_dir=str(work / "staging")))
    paths, sidecars, sender = {}, [], None
    try:
        for variant in args.variants:
            if variant.startswith("sidecar/"):
                sidecar = SGLangSidecar(publisher.url, url, handoff=variant.split("/")[1],
                                        shm_dir=args.shm_dir, model_path=str(model))
                sidecars.append(sidecar)
                sidecar.update()  # registers its layout
                paths[variant] = lambda v, s=sidecar: via_sidecar(publisher, s, params, v)
            else:
                sender = SGLangWeightSender([url], config, master_address="127.0.0.1",
                                            master_port=0, pause_mode="in_place")
                paths[variant] = lambda v: via_broadcast(sender, params, v)
        version = int(served_version(url))
        times: dict[str, list] = {v: [] for v in (*args.variants, "memcpy")}
        load_before = os.getloadavg()
        for r in range(WARMUP_ROUNDS + args.rounds):
            order = list(paths) if r % 2 else list(reversed(paths))
            timed = r >= WARMUP_ROUNDS
            seconds = {}
            for variant in order:
                version += 1
                record = paths[variant](version)
                assert served_version(url) == str(version), variant
                seconds[variant] = record["seconds"]
                if timed:
                    times[variant].append(record)
            memcpy = memcpy_seconds(params)
            if timed:
                times["memcpy"].append({"seconds": memcpy})
            log(f"round {r}{'' if timed else ' (warm-up)'}: " + ", ".join(
                f"{v} {seconds[v]:.4f} s" for v in order) + f", memcpy {memcpy:.4f} s")
        _, final, _ = greedy(url, PROMPT, 4, http)
        assert np.array_equal(final, baseline), (final, baseline)
        load_after = os.getloadavg()
    finally:
        for sidecar in sidecars:
            sidecar.close()
        if sender is not None:
            sender.close()
        publisher.close()
        pool.stop()
    best_memcpy = min(t["seconds"] for t in times["memcpy"])
    summary = {}
    for variant in args.variants:
        best = min(times[variant], key=lambda t: t["seconds"])
        summary[variant] = {"best_s": best["seconds"], "median_s": float(np.median(
            [t["seconds"] for t in times[variant]])), "ratio_to_memcpy": best_memcpy
            / best["seconds"], "best": best}
    return {"shape": args.shape, "dtype": args.dtype, "model_bytes": model_bytes,
            "config": {"layers": config.num_layers, "hidden": config.hidden_size,
                       "vocab": config.vocab_size},
            "settings": {"rounds": args.rounds, "warmup_rounds": WARMUP_ROUNDS,
                         "variants": list(args.variants),
                         "transport": "shm", "sglang_startup_s": startup_s,
                         "mem_fraction_static": round(fraction, 2),
                         "memcpy_best_s": best_memcpy,
                         "memcpy_gbps": model_bytes / best_memcpy / 1e9},
            "machine": {"cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                        "load_average_before": load_before, "load_average_after": load_after,
                        "memory_available_bytes": memory.start,
                        "memory_taken_peak_bytes": memory.start - memory.lowest,
                        "date": time.strftime("%Y-%m-%d %H:%M")},
            "summary": summary, "times": times}


def print_table(result: dict) -> None:
    print(f"\n{result['shape']} ({result['dtype']}, {result['model_bytes'] / 1e6:.1f} MB), "
          f"memcpy best {result['settings']['memcpy_best_s'] * 1e3:.2f} ms "
          f"({result['settings']['memcpy_gbps']:.2f} GB/s)")
    print(f"{'variant':<16}{'best s':>10}{'median s':>10}{'memcpy/best':>13}   breakdown of best")
    for variant, row in result["summary"].items():
        parts = {k: v for k, v in row["best"].items() if k.endswith("_s")}
        text = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in parts.items())
        print(f"{variant:<16}{row['best_s']:>10.3f}{row['median_s']:>10.3f}"
              f"{row['ratio_to_memcpy']:>13.3f}   {text}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=("tiny", "qwen2.5-0.5b"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shm_dir", default=None, help="the sidecar's tmpfs (default /dev/shm)")
    parser.add_argument("--allow_overcommit", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "sglang_weight_paths.json"))
    args = parser.parse_args()
    args.variants = tuple(v for v in args.variants.split(",") if v)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    result = {**run(args), "command": " ".join([Path(sys.executable).name, *sys.argv])}
    print_table(result)
    out = Path(args.out)
    everything = json.loads(out.read_text()) if out.exists() else {}
    subset = "" if set(args.variants) == set(VARIANTS) else "/" + ",".join(args.variants)
    everything[f"{args.shape}/{args.dtype}{subset}"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(everything, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
