"""Weight transfer throughput per transport against a memcpy of the same bytes, and the
in-flight pause of a live generator.

Two OS processes on loopback, as in a real run: a trainer (8 host devices, parameters sharded
FSDP) publishes, a generator (1 device: the whole model on one device) pulls. For each model size
(float32 parameters; ``model_bytes`` = their total size) and transport (``rl_jax.transfer``: shm,
socket, jax_transfer, disk), after two warm-up rounds, each round times:

- memcpy: ``np.copyto`` of ``model_bytes`` into a warm destination (a single copy of the same
  bytes; best of 3), in this driver process, right before the round: the ceiling the round's
  steps are compared with;
- publish: ``Publisher.publish`` in the trainer (trainer shards -> generator layout, checksums,
  announce). Host transports copy each byte once into a staging slot and hash it;
- pull: manifest in hand -> verified arrays in the generator's layout (``Puller.pull``). ``shm``
  copies nothing: the arrays alias the staging slot and each byte is hashed once; ``socket``
  copies each byte once into the generator's buffer (through the kernel) and hashes it;
- publish+pull (end to end): from the trainer's call to verified arrays in the generator, which
  is already waiting for the version (as a live generator's puller is), on one clock
  (``CLOCK_MONOTONIC`` is shared by the processes). A streamed ``shm`` version is announced
  before it is staged, so its pull runs alongside the publish; the others start once it
  returned.

Ratios are ``best memcpy time / best time`` over the same interleaved rounds (the machine is
shared, best-of filters other processes' interference): 1.0 means the step moved the model as
fast as one plain copy of it; the aim is >= 0.5 for the fastest transport's publish+pull at
>= 100 MB.

The pause is measured on a live engine decoding a full batch (8 sequences) while versions are
published, pulled and swapped in: a watcher thread records when each decode step's result is
ready on the device (the engine's own pipelining untouched). The pause of an update is the gap
between the last step under the old weights and the first under the new ones, minus the median
gap; it is compared with the pure copy time of the model (memcpy, measured in the generator
process). The same statistic over ordinary steps (no swap) is reported as the noise floor, and
the decode time lost while the update is pulled and laid out in the background (steps that
overlap that work, minus the median) is reported as ``background_slowdown_s``.
Aim: every update's pause <= 2x the pure copy time (median and max reported).

Usage: python benchmarks/transfer_throughput.py [--quick] [--repeats N] [--variants=shm,...]
Writes benchmarks/results/transfer_throughput.json and transfer_throughput.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# (label, transport, threads): shm also with two threads staging shards (copy + hash) in the
# publisher and two hashing them in the puller (which pays off only when cores are idle), side
# by side with the default (all in the calling thread).
# shm streams by default (the version is announced before it is staged and verified as it is
# written); "shm/not streamed" is the same transport announcing only staged versions.
VARIANTS = (("shm", "shm", 0), ("shm/2 threads", "shm", 2),
            ("shm/not streamed", "shm", -2), ("socket", "socket", 0),
            ("jax_transfer", "jax_transfer", 0), ("disk", "disk", 0))
# name -> (hidden, layers, vocab); intermediate = 4 * hidden, heads of 64; float32.
SIZES = {"10MB": (256, 2, 4096), "100MB": (512, 4, 8192), "300MB": (768, 8, 12288),
         "1GB": (1024, 13, 16384)}


def model_config(size: str):
    from rl_jax.models.config import ModelConfig
    hidden, layers, vocab = SIZES[size]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64,
                       head_dim=64)


class Memcpy:
    """Times single copies of ``nbytes`` into a warm destination (``np.copyto``)."""

    def __init__(self, nbytes: int):
        import numpy as np
        self.src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
        self.dst = np.empty_like(self.src)
        self.dst[:] = 1
        self.copy()

    def copy(self) -> float:
        import numpy as np
        start = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - start

    def best(self, repeats: int = 5) -> float:
        return min(self.copy() for _ in range(repeats))


# ---- worker processes -------------------------------------------------------------------------

def reply(**data):
    print("@@ " + json.dumps(data), flush=True)


def trainer_main():
    import jax
    import numpy as np

    from rl_jax.sharding import make_mesh
    from rl_jax.trainer.state import ModelSpec
    from rl_jax.transfer.config import PublisherConfig
    from rl_jax.transfer.publisher.core import Publisher

    publisher, params, spec = None, None, None
    bump = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            if publisher is not None:
                publisher.close()
            if spec is None or spec.config != model_config(cmd["size"]):
                params = None
                spec = ModelSpec(model_config(cmd["size"]), mesh=make_mesh(data=1, fsdp=8))
                rng = np.random.default_rng(0)
                params = jax.tree.map(
                    lambda a, s: jax.device_put(rng.standard_normal(a.shape, np.float32), s),
                    spec.abstract_params, spec.param_shardings)
            threads = cmd.get("threads", 0)
            publisher = Publisher(PublisherConfig(
                transports=(cmd["transport"],), disk_dir=cmd["disk_dir"],
                staging_threads=abs(threads), stream=threads >= 0), spec=spec)
            reply(url=publisher.url,
                  nbytes=int(sum(x.nbytes for x in jax.tree.leaves(params))))
        elif cmd["cmd"] == "wait":
            reply(ok=publisher.wait_for_layouts(1, 120))
        elif cmd["cmd"] == "publish":
            if "check" in cmd:  # the staging copies' finiteness check (hardening_cost.py)
                publisher.config = dataclasses.replace(publisher.config,
                                                       check_finite=cmd["check"])
            start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            cpu = time.process_time()  # every thread of this process: the staging's work
            stats = publisher.publish(params, cmd["version"])
            cpu = time.process_time() - cpu
            params = bump(params)  # the next "train step" donates the published parameters
            jax.block_until_ready(params)
            reply(seconds=stats.seconds, bytes=dict(stats.bytes), errors=dict(stats.errors),
                  nonfinite=list(stats.nonfinite), start=start, cpu_s=cpu)
        elif cmd["cmd"] == "quit":
            if publisher is not None:
                publisher.close()
            reply(ok=True)
            return


def generator_main():
    import jax

    from rl_jax.generator.engine.weights import generator_rules
    from rl_jax.trainer.state import ModelSpec
    from rl_jax.transfer.config import PullerConfig
    from rl_jax.transfer.puller.core import Puller

    puller = pause = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            spec = ModelSpec(model_config(cmd["size"]), mesh=None, rules=generator_rules())
            target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  spec.abstract_params, spec.param_shardings)
            puller = Puller(cmd["url"], target, transports=[cmd["transport"]],
                            config=PullerConfig(timeout_s=600,
                                                digest_threads=abs(cmd.get("threads", 0))))
            puller.register()
            reply(ok=True)
        elif cmd["cmd"] == "pull":
            start = time.perf_counter()
            update = puller.pull(cmd["after"], wait_s=60)
            done = time.perf_counter()
            metrics = update.metrics.to_json()
            del update  # (shm: releases the staging slot its arrays alias)
            reply(metrics=metrics, with_manifest_s=done - start, done=done)
        elif cmd["cmd"] == "pause_start":
            pause = PauseTest(cmd)
            reply(ready=True)
        elif cmd["cmd"] == "pause_update":
            pause.update()
            reply(ok=True)
        elif cmd["cmd"] == "pause_end":
            reply(**pause.finish())
        elif cmd["cmd"] == "quit":
            reply(ok=True)
            return


class PauseTest:
    """A live engine decodes a full batch while versions are pulled and swapped in. A watcher
    thread records when each decode step's result is ready; gaps around the swaps are compared
    with the median gap (see the module docstring)."""

    def __init__(self, cmd):
        import queue

        import jax
        import numpy as np

        from rl_jax.generator.engine.core import Engine
        from rl_jax.generator.engine.config import EngineConfig
        from rl_jax.generator.engine.weights import generator_rules
        from rl_jax.generator.types import GenerateRequest, SamplingParams
        from rl_jax.trainer.state import ModelSpec
        from rl_jax.transfer.puller.generator import GeneratorPuller
        from rl_jax.transfer.config import PullerConfig

        cfg = model_config(cmd["size"])
        spec = ModelSpec(cfg, mesh=None, rules=generator_rules())
        rng = np.random.default_rng(1)
        params = jax.tree.map(
            lambda a, s: jax.device_put(rng.standard_normal(a.shape, np.float32), s),
            spec.abstract_params, spec.param_shardings)
        self.nbytes = int(sum(x.nbytes for x in jax.tree.leaves(params)))
        self.memcpy = Memcpy(self.nbytes)
        self.engine = engine = Engine(cfg, params, version=0, rules=generator_rules(),
                                      engine_config=EngineConfig(max_slots=8, max_seq_len=512))
        self.steps: list[tuple[float, float]] = []  # (dispatched, result ready)
        self.swaps: list[tuple[float, float]] = []  # (start, end) of Engine._swap_weights
        self.work: list[tuple[float, float]] = []  # (pull start, new weights laid out)
        self.copies: list[float] = []
        pending: queue.SimpleQueue = queue.SimpleQueue()
        decode, swap, prepare = engine.runner.decode, engine._swap_weights, engine.runner.prepare

        def timed_decode(*args, **kw):
            dispatched = time.perf_counter()
            out = decode(*args, **kw)
            pending.put((dispatched, out))
            return out

        def watch():
            while (item := pending.get()) is not None:
                jax.block_until_ready(item[1])
                self.steps.append((item[0], time.perf_counter()))

        def timed_swap(*args):
            start = time.perf_counter()
            swap(*args)
            self.swaps.append((start, time.perf_counter()))

        def timed_prepare(p):
            out = prepare(p)
            jax.block_until_ready(out)
            self.prepared = time.perf_counter()
            return out

        engine.runner.decode, engine._swap_weights = timed_decode, timed_swap
        engine.runner.prepare = timed_prepare
        self.pending = pending
        self.watcher = threading.Thread(target=watch, daemon=True)
        self.watcher.start()
        self.stop = threading.Event()
        self.batches = 0

        def load():
            while not self.stop.is_set():
                # one request of 8 samples: every batch is admitted in the same shape
                engine.submit(GenerateRequest([1, 2, 3], SamplingParams(
                    max_new_tokens=400, temperature=1.0, ignore_eos=True, n=8))).result()
                self.batches += 1

        self.thread = threading.Thread(target=load, daemon=True)
        self.thread.start()
        # Every decode cache length is compiled by the first batch; the second admits into a
        # cache at its longest, which compiles the prefill path and the cache's shrinking:
        # neither belongs to an update's pause.
        while self.batches < 2:
            time.sleep(0.05)
        self.warm = time.perf_counter()  # steps before this compiled the shapes: not noise
        self.puller = GeneratorPuller(cmd["url"], transports=[cmd["transport"]],
                                      config=PullerConfig(timeout_s=600))
        self.puller.puller(engine.params).register()

    def update(self) -> None:
        self.copies.append(self.memcpy.best(3))
        start = time.perf_counter()
        update = self.puller.pull_latest(self.engine, wait_s=120)
        self.engine.update_weights(update.params, update.version)
        self.engine.wait_for_version(update.version, 120)
        self.work.append((start, self.prepared))
        del update
        time.sleep(0.5)  # decode steps between updates: the noise floor's samples

    def finish(self) -> dict:
        import numpy as np
        self.stop.set()
        self.engine.abort()
        self.thread.join(60)
        self.engine.shutdown()
        self.pending.put(None)
        self.watcher.join(60)
        steps = sorted(self.steps)
        ready = np.array([s[1] for s in steps])
        gaps = np.diff(ready)
        median = float(np.median(gaps))
        pauses, slowdown, near = [], [], set()
        for (start, end), (work_start, work_end) in zip(self.swaps, self.work):
            # the first step dispatched after the swap, and the last one before it
            k = next(i for i, s in enumerate(steps) if s[0] >= end)
            pauses.append(float(ready[k] - ready[k - 1]) - median)
            overlapping = [i for i in range(1, len(steps))
                           if ready[i] > work_start and ready[i - 1] < work_end]
            slowdown.append(float(sum(gaps[i - 1] - median for i in overlapping)))
            near.update(range(min(overlapping + [k]) - 1, k + 2))
        ordinary = np.array([gaps[i - 1] - median for i in range(1, len(steps))
                             if i not in near and ready[i - 1] >= self.warm])
        copy_s = min(self.copies)
        return {"model_bytes": self.nbytes, "pure_copy_s": copy_s, "median_step_s": median,
                "decode_steps": len(steps), "swap_call_s": [e - s for s, e in self.swaps],
                "pause_s": pauses, "background_slowdown_s": slowdown,
                "pull_and_layout_s": [e - s for s, e in self.work],
                "noise_floor_s": {"median": float(np.median(ordinary)),
                                  "p90": float(np.percentile(ordinary, 90)),
                                  "max": float(ordinary.max()), "steps": len(ordinary)},
                "median_background_slowdown_s": float(np.median(slowdown)),
                "median_pause_vs_copy": float(np.median(pauses)) / copy_s,
                "max_pause_vs_copy": max(pauses) / copy_s}


# ---- driver -----------------------------------------------------------------------------------

class Proc:
    def __init__(self, role: str, devices: int):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu")
        self.p = subprocess.Popen([sys.executable, __file__, "--role", role],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def reply(self) -> dict:
        for line in self.p.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"worker exited with {self.p.wait()}")

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self.reply()


def ratios(row: dict) -> None:
    """Adds ``*_vs_memcpy``: the best single-copy time of the model's bytes over the best time of
    the step, over the same interleaved rounds (each round: a memcpy, then the step)."""
    copy_s = min(row["memcpy_s"])
    for key, times in (("publish", row["publish_s"]), ("pull", row["pull_s"]),
                       ("end_to_end", row["end_to_end_s"])):
        row[f"{key}_gbps"] = row["model_bytes"] / min(times) / 1e9
        row[f"{key}_vs_memcpy"] = copy_s / min(times)
    row["memcpy_gbps"] = row["model_bytes"] / copy_s / 1e9


def run(args) -> dict:
    sizes = ["10MB", "100MB"] if args.quick else list(SIZES)
    repeats = args.repeats or (3 if args.quick else 7)
    scratch = tempfile.TemporaryDirectory(prefix="transfer-bench-")
    disk_dir = Path(args.disk_dir or scratch.name)
    # The publisher (trainer) and its puller (generator) share the control channel's token.
    os.environ.setdefault("RL_JAX_TRANSFER_TOKEN", secrets.token_urlsafe(32))
    trainer, generator = Proc("trainer", 8), Proc("generator", 1)
    rows = []
    try:
        version = 0
        for size in sizes:
            memcpy = None
            for label, transport, threads in VARIANTS:
                if transport == "disk" and size == "1GB" and not args.disk_1gb:
                    continue
                if args.variants and label not in args.variants:
                    continue
                setup = trainer.ask(cmd="setup", size=size, transport=transport,
                                    disk_dir=str(disk_dir), threads=threads)
                nbytes = setup["nbytes"]
                memcpy = memcpy or Memcpy(nbytes)
                generator.ask(cmd="setup", size=size, url=setup["url"], transport=transport,
                              threads=threads)
                trainer.ask(cmd="wait")
                row = {"size": size, "model_bytes": nbytes, "transport": label,
                       "threads": threads,
                       "memcpy_s": [], "publish_s": [], "pull_s": [], "end_to_end_s": [],
                       "pull_fetch_s": [],
                       "pull_verify_s": []}
                for r in range(repeats + 2):  # two warm-up rounds: compiles, staging slots
                    version += 1
                    copy_s = memcpy.best(3)
                    # the generator is already waiting for the version, as a live one is
                    generator.send(cmd="pull", after=version - 1)
                    time.sleep(0.05)
                    pub = trainer.ask(cmd="publish", version=version)
                    assert not pub["errors"], pub
                    pulled = generator.reply()
                    got = pulled["metrics"]
                    if r >= 2:
                        row["memcpy_s"].append(copy_s)
                        row["publish_s"].append(pub["seconds"])
                        row["pull_s"].append(got["seconds"])
                        row["end_to_end_s"].append(pulled["done"] - pub["start"])
                        row["pull_fetch_s"].append(got["fetch_seconds"])
                        row["pull_verify_s"].append(got["verify_seconds"])
                        row["pull_bytes_moved"] = got["bytes"]
                ratios(row)
                rows.append(row)
                print(f"{size:>6} {label:>18}: publish {row['publish_vs_memcpy']:5.2f}x, "
                      f"pull {row['pull_vs_memcpy']:5.2f}x, publish+pull "
                      f"{row['end_to_end_vs_memcpy']:5.2f}x memcpy "
                      f"({row['memcpy_gbps']:.1f} GB/s)", flush=True)
            del memcpy
        pause_size = "10MB" if args.quick else "100MB"
        setup = trainer.ask(cmd="setup", size=pause_size, transport="shm",
                            disk_dir=str(disk_dir))
        assert generator.ask(cmd="pause_start", size=pause_size, url=setup["url"],
                             transport="shm")["ready"]
        trainer.ask(cmd="wait")
        for _ in range(4 if args.quick else 8):
            version += 1
            trainer.ask(cmd="publish", version=version)
            generator.ask(cmd="pause_update")
        pause = {"size": pause_size, **generator.ask(cmd="pause_end")}
        trainer.ask(cmd="quit")
        generator.ask(cmd="quit")
    finally:
        for p in (trainer, generator):
            if p.p.poll() is None:
                p.p.kill()
        scratch.cleanup()
    big = [r for r in rows if r["model_bytes"] >= 100e6]
    aim = {"target_ratio": 0.5, "target_pause_vs_copy": 2.0,
           "median_pause_vs_copy": pause["median_pause_vs_copy"],
           "max_pause_vs_copy": pause["max_pause_vs_copy"]}
    for key in ("end_to_end", "pull"):
        # per size >= 100 MB: the fastest transport's ratio
        aim[f"fastest_{key}_vs_memcpy_ge_100MB"] = {
            size: max(({"transport": r["transport"], "ratio": r[f"{key}_vs_memcpy"]}
                       for r in big if r["size"] == size), key=lambda x: x["ratio"])
            for size in dict.fromkeys(r["size"] for r in big)}
    return {"backend": "cpu", "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "quick": args.quick,
            "variants": args.variants or "all", "repeats": repeats,
            "definitions": {
                "model_bytes": "total bytes of the float32 parameters",
                "memcpy_s": "np.copyto of model_bytes into a warm destination (best of 3), "
                            "timed in the driver right before each round",
                "publish_s": "Publisher.publish: trainer shards -> generator layout in the "
                             "staging slot (one copy per byte) + per-shard checksums + announce",
                "end_to_end_s": "from the publish call to verified arrays in the generator "
                                "(waiting for the version beforehand); streamed shm pulls "
                                "overlap the publish",
                "pull_s": "Puller.pull from the manifest to verified arrays in the generator's "
                          "layout (shm: no copy, every byte hashed once; socket: one copy)",
                "x_vs_memcpy": "min(memcpy_s) / min(x_s) over the same rounds",
                "pause_s": "gap between the decode results of the last step under the old "
                           "weights and the first under the new, minus the median gap (negative: "
                           "the step after the swap came sooner than a median step)",
                "swap_call_s": "host time of Engine._swap_weights (between two decode steps)",
                "background_slowdown_s": "decode time lost (sum of gap - median) by steps "
                                         "overlapping the pull and the background layout of "
                                         "the new weights",
                "pure_copy_s": "one np.copyto of the model's bytes in the generator process"},
            "rows": rows, "pause": pause, "aim": aim}


def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "end_to_end_vs_memcpy", "publish + pull"),
                           (axes[1], "pull_vs_memcpy", "pull (generator side)")):
        for label, _, _ in VARIANTS:
            rows = [r for r in result["rows"] if r["transport"] == label]
            if rows:
                ax.plot([r["model_bytes"] / 1e6 for r in rows], [r[key] for r in rows], "o-",
                        label=label)
        ax.axhline(1.0, color="k", ls="--", lw=1, label="one memcpy of the model")
        ax.axhline(0.5, color="gray", ls=":", lw=1, label="aim: 0.5x memcpy")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model size (MB)")
        ax.set_ylabel("speed / memcpy of the same bytes")
        ax.set_title(f"{title}: trainer 8 devices FSDP -> generator 1 device", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 MB and 100 MB only")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--disk-1gb", action="store_true", help="also time disk at 1 GB")
    parser.add_argument("--variants", default="",
                        help="comma-separated labels to run (default all): "
                        + ", ".join(label for label, _, _ in VARIANTS))
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - {label for label, _, _ in VARIANTS})
    if unknown:
        parser.error(f"unknown variants {unknown}; known: "
                     + ", ".join(label for label, _, _ in VARIANTS))
    if args.role == "trainer":
        return trainer_main()
    if args.role == "generator":
        return generator_main()
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "transfer_throughput.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "transfer_throughput.png")
    for row in result["rows"]:
        print(f"{row['size']:>6} {row['transport']:>18}: publish+pull "
              f"{row['end_to_end_vs_memcpy']:5.2f}x memcpy, pull {row['pull_vs_memcpy']:5.2f}x, "
              f"publish {row['publish_vs_memcpy']:5.2f}x (memcpy {row['memcpy_gbps']:.1f} GB/s)")
    p = result["pause"]
    ms = lambda xs: [round(x * 1e3, 1) for x in xs]  # noqa: E731
    print(f"in-flight pause ({p['size']}): median step {p['median_step_s'] * 1e3:.1f} ms, "
          f"pauses {ms(p['pause_s'])} ms (swap calls {ms(p['swap_call_s'])} ms), pure copy "
          f"{p['pure_copy_s'] * 1e3:.1f} ms -> median {p['median_pause_vs_copy']:.2f}x copy, "
          f"max {p['max_pause_vs_copy']:.2f}x; noise floor (ordinary steps' gap - median): "
          f"p90 {p['noise_floor_s']['p90'] * 1e3:.1f} ms, max "
          f"{p['noise_floor_s']['max'] * 1e3:.1f} ms; decode time lost while pulling and "
          f"laying out: {ms(p['background_slowdown_s'])} ms (median "
          f"{p['median_background_slowdown_s'] * 1e3:.1f} ms)")
    aim = result["aim"]
    for key, what in (("end_to_end", "publish+pull"), ("pull", "pull")):
        best = aim[f"fastest_{key}_vs_memcpy_ge_100MB"]
        print(f"aim, fastest {what} >= {aim['target_ratio']}x memcpy: " + ", ".join(
            f"{size} {b['ratio']:.2f}x ({b['transport']})" for size, b in best.items()))
    print(f"aim, pause per update <= {aim['target_pause_vs_copy']}x copy: median "
          f"{aim['median_pause_vs_copy']:.2f}x, max {aim['max_pause_vs_copy']:.2f}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
