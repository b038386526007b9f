"""Weight transfer throughput per transport against this machine's memcpy bandwidth.

Two OS processes on loopback, as in a real run: a trainer (8 host devices, parameters sharded
FSDP) publishes, a generator (1 device: the whole model on one device) pulls. For each model size
and transport (``rl_jax.transfer``: shm, socket, jax_transfer, disk), after a warm-up round:

- publish: ``Publisher.publish`` in the trainer (reshard/stage + checksums + announce);
- pull: manifest → verified arrays in the generator's layout (``Puller.pull``);
- publish+pull: the two added (the time from the trainer's call to usable weights);

each reported in GB/s (best of the repeats: the machine is shared) and as a ratio to memcpy
bandwidth, measured in the same run (NumPy copy
of a 256 MiB buffer into a warm and into a fresh destination, best of several). The in-flight
pause is measured on a live engine decoding a full batch while versions arrive: the longest gap
between two decode steps around an update, minus the median step, against the model's pure copy
time. Aim: fastest transport >= 50% of memcpy for >= 100 MB; pause <= 2x copy time.

Usage: python benchmarks/transfer_throughput.py [--quick] [--repeats N]
Writes benchmarks/results/transfer_throughput.json and transfer_throughput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TRANSPORTS = ("shm", "socket", "jax_transfer", "disk")
# name -> (hidden, layers, vocab); intermediate = 4 * hidden, heads of 64; float32.
SIZES = {"10MB": (256, 2, 4096), "100MB": (512, 4, 8192), "300MB": (768, 8, 12288),
         "1GB": (1024, 13, 16384)}


def model_config(size: str):
    from rl_jax.models import ModelConfig
    hidden, layers, vocab = SIZES[size]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64,
                       head_dim=64)


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7) -> dict[str, float]:
    """Best-of-``repeats`` NumPy copy bandwidth (bytes/s) into a warm and a fresh buffer."""
    import numpy as np
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1
    warm, fresh = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        warm.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(np.empty_like(src), src)
        fresh.append(time.perf_counter() - t)
    return {"warm": nbytes / min(warm), "fresh": nbytes / min(fresh)}


# ---- worker processes -------------------------------------------------------------------------

def reply(**data):
    print("@@ " + json.dumps(data), flush=True)


def trainer_main():
    import jax
    import numpy as np

    from rl_jax.sharding import make_mesh
    from rl_jax.trainer.state import ModelSpec
    from rl_jax.transfer import Publisher, PublisherConfig

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
            publisher = Publisher(PublisherConfig(transports=(cmd["transport"],),
                                                  disk_dir=cmd["disk_dir"]), spec=spec)
            reply(url=publisher.url,
                  nbytes=int(sum(x.nbytes for x in jax.tree.leaves(params))))
        elif cmd["cmd"] == "wait":
            reply(ok=publisher.wait_for_layouts(1, 120))
        elif cmd["cmd"] == "publish":
            stats = publisher.publish(params, cmd["version"])
            params = bump(params)  # the next "train step" donates the published parameters
            jax.block_until_ready(params)
            reply(seconds=stats.seconds, bytes=dict(stats.bytes), errors=dict(stats.errors))
        elif cmd["cmd"] == "quit":
            if publisher is not None:
                publisher.close()
            reply(ok=True)
            return


def generator_main():
    import jax
    import numpy as np

    from rl_jax.generator.runner import generator_rules
    from rl_jax.trainer.state import ModelSpec
    from rl_jax.transfer import Puller, PullerConfig

    puller = pause = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            spec = ModelSpec(model_config(cmd["size"]), mesh=None, rules=generator_rules())
            target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  spec.abstract_params, spec.param_shardings)
            puller = Puller(cmd["url"], target, transports=[cmd["transport"]],
                            config=PullerConfig(timeout_s=600))
            puller.register()
            reply(ok=True)
        elif cmd["cmd"] == "pull":
            start = time.perf_counter()
            update = puller.pull(cmd["after"], wait_s=60)
            total = time.perf_counter() - start
            reply(metrics=update.metrics.to_json(), with_manifest_s=total)
            del update
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
    """A live engine decodes a full batch while versions are pulled and swapped in; decode-step
    gaps around the swaps are compared with the median step."""

    def __init__(self, cmd):
        import jax
        import numpy as np

        from rl_jax.generator.engine import Engine, EngineConfig
        from rl_jax.generator.runner import generator_rules
        from rl_jax.generator.types import GenerateRequest, SamplingParams
        from rl_jax.trainer.state import ModelSpec
        from rl_jax.transfer import GeneratorPuller, PullerConfig

        cfg = model_config(cmd["size"])
        spec = ModelSpec(cfg, mesh=None, rules=generator_rules())
        rng = np.random.default_rng(1)
        params = jax.tree.map(
            lambda a, s: jax.device_put(rng.standard_normal(a.shape, np.float32), s),
            spec.abstract_params, spec.param_shardings)
        self.engine = engine = Engine(cfg, params, version=0, rules=generator_rules(),
                                      engine_config=EngineConfig(max_slots=8, max_seq_len=512))
        self.steps: list[float] = []
        self.swaps: list[float] = []
        self.pulls: list[float] = []
        decode, swap = engine.runner.decode, engine._swap_weights

        def timed_decode(*args, **kw):
            out = decode(*args, **kw)
            jax.block_until_ready(out)
            self.steps.append(time.perf_counter())
            return out

        def timed_swap(p, v):
            self.swaps.append(time.perf_counter())
            return swap(p, v)

        engine.runner.decode, engine._swap_weights = timed_decode, timed_swap
        self.stop = threading.Event()

        def load():
            while not self.stop.is_set():
                futures = [engine.submit(GenerateRequest([1, 2, 3], SamplingParams(
                    max_new_tokens=400, temperature=1.0, ignore_eos=True))) for _ in range(8)]
                for f in futures:
                    f.result()

        self.thread = threading.Thread(target=load, daemon=True)
        self.thread.start()
        while len(self.steps) < 20:
            time.sleep(0.05)
        self.puller = GeneratorPuller(cmd["url"], transports=[cmd["transport"]],
                                      config=PullerConfig(timeout_s=600))
        self.puller.puller(engine.params).register()

    def update(self) -> None:
        update = self.puller.pull_latest(self.engine, wait_s=120)
        self.engine.update_weights(update.params, update.version)
        self.engine.wait_for_version(update.version, 120)
        self.pulls.append(update.metrics.seconds)
        time.sleep(0.3)  # a few decode steps after the swap

    def finish(self) -> dict:
        import numpy as np
        self.stop.set()
        self.engine.abort()
        self.thread.join(60)
        self.engine.shutdown()
        steps = self.steps
        median = float(np.median(np.diff(np.array(steps))))
        around = []
        for t in self.swaps:
            after = [i for i, s in enumerate(steps) if s > t]
            if after and after[0] > 0:
                around.append(float(steps[after[0]] - steps[after[0] - 1]))
        return {"median_step_s": median, "swap_step_s": around,
                "pause_s": [max(0.0, a - median) for a in around], "pull_s": self.pulls}


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


def run(args) -> dict:
    import numpy as np
    sizes = ["10MB", "100MB"] if args.quick else list(SIZES)
    repeats = args.repeats or (2 if args.quick else 3)
    scratch = tempfile.TemporaryDirectory(prefix="transfer-bench-")
    disk_dir = Path(args.disk_dir or scratch.name)
    memcpy_before = memcpy_bandwidth()
    trainer, generator = Proc("trainer", 8), Proc("generator", 1)
    rows = []
    try:
        version = 0
        for size in sizes:
            for transport in TRANSPORTS:
                if transport == "disk" and size == "1GB" and not args.disk_1gb:
                    continue
                setup = trainer.ask(cmd="setup", size=size, transport=transport,
                                    disk_dir=str(disk_dir))
                generator.ask(cmd="setup", size=size, url=setup["url"], transport=transport)
                trainer.ask(cmd="wait")
                publish_s, pull, pull_total = [], [], []
                for r in range(repeats + 2):  # two warm-up rounds: compiles, both staging slots
                    version += 1
                    pub = trainer.ask(cmd="publish", version=version)
                    assert not pub["errors"], pub
                    got = generator.ask(cmd="pull", after=version - 1)
                    if r >= 2:
                        publish_s.append(pub["seconds"])
                        pull.append(got["metrics"])
                        pull_total.append(got["with_manifest_s"])
                nbytes = setup["nbytes"]
                best_pub = min(publish_s)
                best_pull = min(m["seconds"] for m in pull)
                row = {"size": size, "model_bytes": nbytes, "transport": transport,
                       "publish_s": publish_s, "pull_s": [m["seconds"] for m in pull],
                       "pull_fetch_s": [m["fetch_seconds"] for m in pull],
                       "pull_verify_s": [m["verify_seconds"] for m in pull],
                       "pull_bytes_moved": pull[-1]["bytes"],
                       "publish_gbps": nbytes / best_pub / 1e9,
                       "pull_gbps": nbytes / best_pull / 1e9,
                       "end_to_end_gbps": nbytes / min(p + q["seconds"] for p, q in
                                                       zip(publish_s, pull)) / 1e9}
                rows.append(row)
                print(f"{size:>6} {transport:>12}: publish {row['publish_gbps']:6.2f} GB/s, "
                      f"pull {row['pull_gbps']:6.2f} GB/s, publish+pull "
                      f"{row['end_to_end_gbps']:6.2f} GB/s", flush=True)
        pause = None
        pause_size = "10MB" if args.quick else "100MB"
        setup = trainer.ask(cmd="setup", size=pause_size, transport="shm",
                            disk_dir=str(disk_dir))
        assert generator.ask(cmd="pause_start", size=pause_size, url=setup["url"],
                             transport="shm")["ready"]
        trainer.ask(cmd="wait")
        for _ in range(4):
            version += 1
            trainer.ask(cmd="publish", version=version)
            generator.ask(cmd="pause_update")
        pause = {"size": pause_size, "model_bytes": setup["nbytes"],
                 **generator.ask(cmd="pause_end")}
        trainer.ask(cmd="quit")
        generator.ask(cmd="quit")
    finally:
        for p in (trainer, generator):
            if p.p.poll() is None:
                p.p.kill()
        scratch.cleanup()
    memcpy_after = memcpy_bandwidth()
    memcpy = {k: max(memcpy_before[k], memcpy_after[k]) for k in memcpy_before}
    for row in rows:
        for key in ("publish", "pull", "end_to_end"):
            row[f"{key}_vs_memcpy"] = row[f"{key}_gbps"] * 1e9 / memcpy["warm"]
    copy_s = pause["model_bytes"] / memcpy["warm"]
    pause["pure_copy_s"] = copy_s
    pause["max_pause_vs_copy"] = max(pause["pause_s"]) / copy_s if pause["pause_s"] else None
    big = [r for r in rows if r["model_bytes"] >= 100e6]
    best = max(big, key=lambda r: r["end_to_end_vs_memcpy"]) if big else None
    best_pull = max(big, key=lambda r: r["pull_vs_memcpy"]) if big else None
    return {"backend": "cpu", "machine": platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "quick": args.quick, "repeats": repeats,
            "memcpy_bytes_per_s": memcpy, "memcpy_runs": [memcpy_before, memcpy_after],
            "rows": rows, "pause": pause,
            "aim": {"fastest_end_to_end_vs_memcpy_ge_100MB": None if best is None else
                    {"transport": best["transport"], "size": best["size"],
                     "ratio": best["end_to_end_vs_memcpy"]},
                    "fastest_pull_vs_memcpy_ge_100MB": None if best_pull is None else
                    {"transport": best_pull["transport"], "size": best_pull["size"],
                     "ratio": best_pull["pull_vs_memcpy"]},
                    "target_ratio": 0.5, "max_pause_vs_copy": pause["max_pause_vs_copy"],
                    "target_pause_vs_copy": 2.0}}


def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    memcpy = result["memcpy_bytes_per_s"]["warm"] / 1e9
    for ax, key, title in ((axes[0], "end_to_end_gbps", "publish + pull"),
                           (axes[1], "pull_gbps", "pull (generator side)")):
        for transport in TRANSPORTS:
            rows = [r for r in result["rows"] if r["transport"] == transport]
            if rows:
                ax.plot([r["model_bytes"] / 1e6 for r in rows], [r[key] for r in rows], "o-",
                        label=transport)
        ax.axhline(memcpy, color="k", ls="--", lw=1, label=f"memcpy {memcpy:.1f} GB/s")
        ax.axhline(memcpy / 2, color="gray", ls=":", lw=1, label="50% memcpy (aim)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model size (MB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{title}: trainer 8 devices FSDP -> generator 1 device")
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
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "trainer":
        return trainer_main()
    if args.role == "generator":
        return generator_main()
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "transfer_throughput.json"
    out.write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "transfer_throughput.png")
    m = result["memcpy_bytes_per_s"]
    print(f"memcpy: {m['warm'] / 1e9:.2f} GB/s (warm destination), "
          f"{m['fresh'] / 1e9:.2f} GB/s (fresh)")
    for row in result["rows"]:
        print(f"{row['size']:>6} {row['transport']:>12}: publish+pull "
              f"{row['end_to_end_vs_memcpy']:5.1%} of memcpy, pull {row['pull_vs_memcpy']:5.1%}, "
              f"publish {row['publish_vs_memcpy']:5.1%}")
    p = result["pause"]
    print(f"in-flight pause ({p['size']}): median step {p['median_step_s'] * 1e3:.1f} ms, "
          f"pauses {[round(x * 1e3, 1) for x in p['pause_s']]} ms, pure copy "
          f"{p['pure_copy_s'] * 1e3:.1f} ms -> max {p['max_pause_vs_copy']:.2f}x copy")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
