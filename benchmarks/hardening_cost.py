r"""What the security checks cost the normal path, measured side by side in one run.

1. Weight updates, end to end, as a run makes them: a trainer process (8 host devices, FSDP)
   publishes over ``shm`` (streamed, the default transport on one host) to a generator process
   whose engine keeps decoding a full batch (8 sequences) throughout; its puller is already
   waiting for each version, as a live one is. Three arms take turns, in a rotating order:

   - ``off``: no finiteness check anywhere (``PublisherConfig.check_finite=False``,
     ``PullerConfig.check_finite=False`` and the engine told the values were checked: a
     combination that exists for this measurement only);
   - ``publisher``: the default: every staging copy also finds whether its values are finite
     (``rl_jax.transfer.finite.copy_finite``), the puller refuses on that finding and the
     engine skips its own pass;
   - ``engine``: only the engine checks, with its device-side reduction over the new weights
     (``Engine.update_weights`` without ``finite_checked``).

   Timed per update, on one clock (``CLOCK_MONOTONIC`` is shared by the processes): from the
   trainer's ``publish`` call to the engine accepting the checked weights (``update_weights``
   returned: every check is done) and to the new version serving (``wait_for_version``: adds
   the layout and the wait for a decode-step boundary, the same in every arm). The engine's
   decode tokens/s over a fixed window from the publish call (``--window_s``) shows what the
   check takes from decoding, and the trainer process's CPU time over the ``publish`` call
   (every staging thread) what the check adds to the staging work.
2. Serving: tokens/s of this project's generator server (``launch.generator_server``, a real
   process on loopback, started by ``ServerPool``) with an API key and an admin key against
   one without keys, the same requests, both servers up the whole time and taking turns; and
   the server's CPU seconds per thousand tokens (its threads' scheduler run time: what a check
   adds to the work, less noisy than wall time on a shared machine). With ``--control``, two
   open servers are compared the same way: the noise floor of this comparison.
3. Request checks alone: per-request CPU time of what the server does to an incoming
   ``/generate`` beyond a plain ``json.loads`` (the bounded JSON parser, the field checks of
   ``parse_generate`` and the key check), against the server's CPU time per request measured
   in part 2.

Every comparison is interleaved and repeated; the statistic judged is the median over rounds of
each round's ratio (checked / unchecked), since a round's arms run back to back while the
machine's load changes from second to second. ``within_2pct`` says whether the checks cost the
normal path at most 2%.

    python benchmarks/hardening_cost.py [--sizes=100MB,300MB] [--dtypes=float32,bfloat16]
        [--rounds=15] [--http_rounds=15] [--requests=96] [--parts=updates,serving]

Writes ``benchmarks/results/hardening_cost.json``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import transfer_throughput  # noqa: E402  (the trainer worker and the model sizes)

_SIZES = flags.DEFINE_list("sizes", ["100MB", "300MB"],
                           f"Model sizes (float32 bytes) of {sorted(transfer_throughput.SIZES)}.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Generator weight dtypes.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Rounds of updates per size (each arm once).")
_WINDOW = flags.DEFINE_float("window_s", 1.0, "Decode window timed from each publish call.")
_HTTP_ROUNDS = flags.DEFINE_integer("http_rounds", 15, "Interleaved pairs of serving rounds.")
_REQUESTS = flags.DEFINE_integer("requests", 96, "Requests per serving round.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 8, "Requests in flight at once.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per request.")
_CONTROL = flags.DEFINE_bool("control", True, "Also compare two open servers the same way "
                              "(the noise floor of the keyed-vs-open comparison).")
_PARTS = flags.DEFINE_list("parts", ["updates", "serving"], "Parts to measure (updates, "
                          "serving: serving includes the request checks alone); a subset "
                          "replaces those parts of an existing results file.")
_OUT = flags.DEFINE_string("out", str(RESULTS / "hardening_cost.json"), "Results file.")
_ROLE = flags.DEFINE_string("role", None, "Worker role (internal).")

LIMIT = 1.02  # a check may cost at most 2% of the normal path
ARMS = ("off", "publisher", "engine")
API, ADMIN = "bench-api-key-8f3a1c2e9d7b4a60", "bench-admin-key-0b6e5d4c3a2f1e98"


def ratio_summary(on: list[float], off: list[float], *, higher_is_better: bool = False) -> dict:
    """Medians and bests of both sides, and the median over rounds of ``on / off``; ``cost``:
    the fraction the checked side loses (positive: slower), judged against :data:`LIMIT`."""
    best = max if higher_is_better else min
    pairs = statistics.median(a / b for a, b in zip(on, off))
    cost = (1 / pairs if higher_is_better else pairs) - 1
    return {"on_median": statistics.median(on), "off_median": statistics.median(off),
            "on_best": best(on), "off_best": best(off), "ratio_median_of_rounds": pairs,
            "ratio_best": best(on) / best(off), "cost": cost,
            "within_2pct": bool(cost <= LIMIT - 1), "on_all": on, "off_all": off}


# ---- 1. weight updates: the generator worker ---------------------------------------------------

def generator_main():
    """Commands on stdin, replies on stdout (``transfer_throughput``'s protocol)."""
    reply = transfer_throughput.reply
    live = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "setup":
            if live is not None:
                live.close()
            live = LiveGenerator(cmd)
            reply(nbytes=live.nbytes)
        elif cmd["cmd"] == "update":
            reply(**live.update(cmd["arm"]))
        elif cmd["cmd"] == "tokens":
            reply(tokens=live.tokens_between(cmd["t0"], cmd["t1"]))
        elif cmd["cmd"] == "quit":
            if live is not None:
                live.close()
            reply(ok=True)
            return


class LiveGenerator:
    """An engine decoding a full batch without pause, a puller waiting for versions, and a
    sampler of the engine's generated-token counter (every 2 ms)."""

    def __init__(self, cmd):
        import dataclasses

        import jax
        import numpy as np

        from rl_jax.generator.engine.core import Engine
        from rl_jax.generator.engine.config import EngineConfig
        from rl_jax.generator.engine.weights import generator_rules
        from rl_jax.generator.types import GenerateRequest, SamplingParams
        from rl_jax.trainer.state import ModelSpec
        from rl_jax.transfer.puller.generator import GeneratorPuller
        from rl_jax.transfer.config import PullerConfig

        cfg = transfer_throughput.model_config(cmd["size"])
        spec = ModelSpec(cfg, mesh=None, rules=generator_rules())
        rng = np.random.default_rng(1)
        params = jax.tree.map(
            lambda a, s: jax.device_put(rng.standard_normal(a.shape, np.float32)
                                        .astype(cmd["dtype"]), s),
            spec.abstract_params, spec.param_shardings)
        self.nbytes = int(sum(x.nbytes for x in jax.tree.leaves(params)))
        self.engine = engine = Engine(cfg, params, version=0, rules=generator_rules(),
                                      engine_config=EngineConfig(max_slots=8, max_seq_len=512))
        self.stop = threading.Event()
        self.samples: list[tuple[float, int]] = []
        self.batches = 0

        def load():
            while not self.stop.is_set():
                engine.submit(GenerateRequest([1, 2, 3], SamplingParams(
                    max_new_tokens=400, temperature=1.0, ignore_eos=True, n=8))).result()
                self.batches += 1

        def sample():
            while not self.stop.is_set():
                self.samples.append((time.perf_counter(), engine.stats["generated_tokens"]))
                time.sleep(0.002)

        self.threads = [threading.Thread(target=load, daemon=True),
                        threading.Thread(target=sample, daemon=True)]
        for t in self.threads:
            t.start()
        while self.batches < 2:  # every decode length and the admission path compiled
            time.sleep(0.05)
        self.config = PullerConfig(timeout_s=600)
        self.configs = {arm: dataclasses.replace(self.config, check_finite=arm == "publisher")
                        for arm in ARMS}
        self.puller = GeneratorPuller(cmd["url"], transports=["shm"], config=self.config)
        self.puller.puller(engine.params).register()

    def update(self, arm: str) -> dict:
        puller = self.puller.puller(self.engine.params)
        puller.config = self.configs[arm]
        update = self.puller.pull_latest(self.engine, wait_s=120)
        assert update.finite_checked == (arm == "publisher"), (arm, update.finite_checked)
        start_cpu = time.thread_time()
        self.engine.update_weights(update.params, update.version,
                                   finite_checked=arm != "engine")
        accepted = time.perf_counter()
        engine_check_cpu = time.thread_time() - start_cpu
        assert self.engine.wait_for_version(update.version, 120)
        served = time.perf_counter()
        metrics = update.metrics.to_json()
        del update
        return {"accepted": accepted, "served": served, "metrics": metrics,
                "engine_check_cpu_s": engine_check_cpu}

    def tokens_between(self, t0: float, t1: float) -> float:
        import numpy as np
        samples = [s for s in list(self.samples) if s[0] >= t0 - 1.0]  # a consistent copy
        times = np.array([s[0] for s in samples])
        counts = np.array([s[1] for s in samples], np.float64)
        return float(np.interp(t1, times, counts) - np.interp(t0, times, counts))

    def close(self):
        self.stop.set()
        self.engine.abort()
        for t in self.threads:
            t.join(60)
        self.engine.shutdown()


class Worker(transfer_throughput.Proc):
    """A worker process of this benchmark (or of ``transfer_throughput`` for the trainer)."""

    def __init__(self, script: Path, role: str, devices: int):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu")
        self.p = subprocess.Popen([sys.executable, str(script), f"--role={role}"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)


def time_updates(sizes: list[str], dtypes: list[str], rounds: int, window_s: float) -> list:
    os.environ.setdefault("RL_JAX_TRANSFER_TOKEN", secrets.token_urlsafe(32))
    trainer = Worker(Path(transfer_throughput.__file__), "trainer", 8)
    generator = Worker(Path(__file__), "generator", 1)
    rows, version = [], 0
    try:
        for size in sizes:
            for dtype in dtypes:
                setup = trainer.ask(cmd="setup", size=size, transport="shm", disk_dir="",
                                    threads=0)
                # the tokens/s window: the generator's sampler and the trainer share the clock
                gen = generator.ask(cmd="setup", size=size, dtype=dtype, url=setup["url"])
                trainer.ask(cmd="wait")
                runs = {arm: {"accepted_s": [], "served_s": [], "decode_tok_s": [],
                              "engine_check_cpu_s": [], "publish_s": [], "publish_cpu_s": []}
                        for arm in ARMS}
                for r in range(rounds + 1):  # round 0 warms every arm up (not recorded)
                    order = ARMS[r % 3:] + ARMS[:r % 3]
                    for arm in order:
                        version += 1
                        generator.send(cmd="update", arm=arm)
                        time.sleep(0.05)  # the puller is waiting, as a live one is
                        pub = trainer.ask(cmd="publish", version=version,
                                          check=arm == "publisher")
                        assert not pub["errors"] and not pub["nonfinite"], pub
                        got = generator.reply()
                        rest = pub["start"] + window_s - time.perf_counter()
                        if rest > 0:
                            time.sleep(rest)
                        tokens = generator.ask(cmd="tokens", t0=pub["start"],
                                               t1=pub["start"] + window_s)["tokens"]
                        if r == 0:
                            continue
                        runs[arm]["accepted_s"].append(got["accepted"] - pub["start"])
                        runs[arm]["served_s"].append(got["served"] - pub["start"])
                        runs[arm]["decode_tok_s"].append(tokens / window_s)
                        runs[arm]["engine_check_cpu_s"].append(got["engine_check_cpu_s"])
                        runs[arm]["publish_s"].append(pub["seconds"])
                        runs[arm]["publish_cpu_s"].append(pub["cpu_s"])
                        time.sleep(0.2)
                row = {"size": size, "dtype": dtype, "model_bytes": gen["nbytes"],
                       "rounds": rounds, "runs": runs}
                for arm in ARMS[1:]:
                    row[arm] = {
                        "accepted": ratio_summary(runs[arm]["accepted_s"],
                                                  runs["off"]["accepted_s"]),
                        "served": ratio_summary(runs[arm]["served_s"], runs["off"]["served_s"]),
                        "publish": ratio_summary(runs[arm]["publish_s"],
                                                 runs["off"]["publish_s"]),
                        "publish_cpu": ratio_summary(runs[arm]["publish_cpu_s"],
                                                     runs["off"]["publish_cpu_s"]),
                        "decode_tok_s": ratio_summary(runs[arm]["decode_tok_s"],
                                                      runs["off"]["decode_tok_s"],
                                                      higher_is_better=True)}
                rows.append(row)
                p, e = row["publisher"], row["engine"]
                print(f"update {size} {dtype} ({gen['nbytes'] / 1e6:.0f} MB): publish -> "
                      f"accepted, median off {1e3 * p['accepted']['off_median']:.1f} ms; cost "
                      f"(median of rounds) of the publisher's check "
                      f"{p['accepted']['cost']:+.1%}, the engine's {e['accepted']['cost']:+.1%};"
                      f" publish -> serving {p['served']['cost']:+.1%} / "
                      f"{e['served']['cost']:+.1%}; decode tok/s {p['decode_tok_s']['cost']:+.1%}"
                      f" / {e['decode_tok_s']['cost']:+.1%}; the publisher's CPU per version "
                      f"{1e3 * p['publish_cpu']['off_median']:.1f} ms off, "
                      f"{p['publish_cpu']['cost']:+.1%} checked", flush=True)
    finally:
        for proc in (generator, trainer):
            try:
                proc.ask(cmd="quit")
            except Exception:  # already gone: the error that ended the run is what matters
                proc.p.kill()
    return rows


# ---- 2. serving over HTTP ---------------------------------------------------------------------

def write_checkpoint(root: Path) -> Path:
    """A small random HF checkpoint with a character tokenizer: per-request work (HTTP, keys,
    validation) is a large share of its serving time, the worst case for the checks."""
    from flax import nnx

    from rl_jax.data.tokenizer import build_char_tokenizer
    from rl_jax.models.config import ModelConfig
    from rl_jax.models.hf import save_pretrained
    from rl_jax.models.transformer import Transformer

    tokenizer = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=")
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return save_pretrained(model, root / "model", tokenizer=tokenizer)


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s live threads so far, to the nanosecond (the scheduler's
    run time of each, ``/proc/PID/task/*/schedstat``: a round's few hundred milliseconds in
    clock ticks would be resolved to 4% only); from ``/proc/PID/stat``'s ticks where schedstat
    is missing."""
    total, found = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
            found = True
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    if found:
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_body(i: int, new_tokens: int) -> dict:
    return {"input_ids": [1, 3 + i % 20, 5, 7 + i % 11],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "seed": i,
                                "ignore_eos": True}}


def serving_round(url: str, headers: dict[str, str], requests: int, concurrency: int,
                  new_tokens: int, pid: int) -> tuple[float, float, float]:
    """Completion tokens per second of ``requests`` requests, ``concurrency`` in flight; the
    server's CPU seconds per thousand tokens and per request."""
    def one(i: int) -> int:
        request = urllib.request.Request(
            url + "/generate", data=json.dumps(request_body(i, new_tokens)).encode(),
            headers={"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(request, timeout=300) as response:
            data = json.loads(response.read())
        return int(data["meta_info"]["completion_tokens"])

    start, cpu = time.perf_counter(), cpu_seconds(pid)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    used = cpu_seconds(pid) - cpu
    return tokens / (time.perf_counter() - start), 1000 * used / tokens, used / requests


def time_serving(rounds: int, requests: int, concurrency: int, new_tokens: int,
                 control: bool = False) -> dict:
    """Keyed against open servers; with ``control``, two open servers the same way (what two
    identical server processes differ by here: the noise floor of the comparison)."""
    from rl_jax.generator.auth import Keys
    from rl_jax.generator.launcher.pool import PoolConfig, ServerPool

    env = (("XLA_FLAGS", ""), ("JAX_PLATFORMS", "cpu"), ("TOKENIZERS_PARALLELISM", "false"))
    with tempfile.TemporaryDirectory(prefix="rl_jax-hardening-") as tmp:
        model = write_checkpoint(Path(tmp))
        pools = {keyed: ServerPool(PoolConfig(
            model=str(model), ports=(0,), max_slots=concurrency, max_seq_len=128, env=env,
            startup_timeout=600, log_dir=str(Path(tmp) / ("keyed" if keyed else "open")),
            keys=Keys(API, ADMIN) if keyed and not control else Keys()))
            for keyed in (True, False)}
        headers = {True: {} if control else {"Authorization": f"Bearer {API}"}, False: {}}
        try:
            for pool in pools.values():
                pool.start(wait=False)
            for pool in pools.values():
                pool.wait_healthy()
            urls = {keyed: pool.urls[0] for keyed, pool in pools.items()}
            pids = {keyed: pool.processes[0].pid for keyed, pool in pools.items()}
            # Warm-up: the server compiles some admission shapes (cache sizes, prefill
            # lengths) on first use; a few rounds meet them all, and connections are warm.
            for keyed in (True, False):
                for _ in range(5):
                    serving_round(urls[keyed], headers[keyed], requests, concurrency,
                                  new_tokens, pids[keyed])
            runs = {(keyed, m): [] for keyed in (True, False) for m in ("tok_s", "cpu", "req")}
            for r in range(rounds):
                for keyed in ((True, False) if r % 2 == 0 else (False, True)):
                    rate, cpu, per_request = serving_round(
                        urls[keyed], headers[keyed], requests, concurrency, new_tokens,
                        pids[keyed])
                    runs[keyed, "tok_s"].append(rate)
                    runs[keyed, "cpu"].append(cpu)
                    runs[keyed, "req"].append(per_request)
        finally:
            for pool in pools.values():
                pool.stop()
    return {"tok_s": ratio_summary(runs[True, "tok_s"], runs[False, "tok_s"],
                                   higher_is_better=True),
            "server_cpu_s_per_1k_tokens": ratio_summary(runs[True, "cpu"], runs[False, "cpu"]),
            "server_cpu_s_per_request": statistics.median(runs[True, "req"] + runs[False, "req"]),
            "requests": requests, "concurrency": concurrency, "new_tokens": new_tokens}


# ---- 3. the request checks alone --------------------------------------------------------------

def time_request_checks(new_tokens: int, repeats: int = 20000) -> dict:
    """CPU seconds per request of a plain ``json.loads`` and of what the server runs instead
    (bounded parse, ``parse_generate`` with the server's limits, the key check)."""
    from rl_jax.generator.auth import Keys, check_request
    from rl_jax.generator.json_body import parse_json_body
    from rl_jax.generator.protocol import parse_generate

    keys = Keys(API, ADMIN)
    headers = {"Authorization": f"Bearer {API}", "Content-Type": "application/json"}
    bodies = [json.dumps(request_body(i, new_tokens)).encode() for i in range(64)]

    def plain(raw):
        return json.loads(raw)

    def checked(raw):
        assert check_request("/generate", headers, keys) is None
        return parse_generate(parse_json_body(raw), tokenize=None, vocab_size=64,
                              max_seq_len=128, max_sequences=4096, max_text_chars=1 << 20)

    times = {"plain": [], "checked": []}
    for r in range(5):
        for name, fn in (("plain", plain), ("checked", checked))[::1 if r % 2 == 0 else -1]:
            start = time.thread_time()
            for i in range(repeats):
                fn(bodies[i % len(bodies)])
            times[name].append((time.thread_time() - start) / repeats)
    return {"plain_s": min(times["plain"]), "checked_s": min(times["checked"]),
            "extra_s": min(times["checked"]) - min(times["plain"])}


def main(argv):
    del argv
    if _ROLE.value == "generator":
        return generator_main()
    import jax

    unknown = [s for s in _SIZES.value if s not in transfer_throughput.SIZES]
    if unknown:
        raise app.UsageError(f"--sizes: unknown {unknown}; known "
                             f"{sorted(transfer_throughput.SIZES)}")
    unknown = sorted(set(_PARTS.value) - {"updates", "serving"})
    if unknown:
        raise app.UsageError(f"--parts: unknown {unknown}; known: updates, serving")
    out = Path(_OUT.value)
    result = {}
    if set(_PARTS.value) != {"updates", "serving"} and out.is_file():
        result = json.loads(out.read_text())  # the other parts as last measured
    result.update({
        "statistic": "interleaved arms; the median over rounds of each round's ratio "
                     "(checked / unchecked) is judged, the ratio of the bests beside it",
        "limit": LIMIT})
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
               "load_avg_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if "updates" in _PARTS.value:
        result["updates"] = time_updates(_SIZES.value, _DTYPES.value, _ROUNDS.value,
                                         _WINDOW.value)
        result["updates_machine"] = {**machine, "load_avg_end": os.getloadavg()}
    if "serving" in _PARTS.value:
        serving = time_serving(_HTTP_ROUNDS.value, _REQUESTS.value, _CONCURRENCY.value,
                               _NEW_TOKENS.value)
        t, c = serving["tok_s"], serving["server_cpu_s_per_1k_tokens"]
        print(f"serving: keyed vs open tokens/s {t['cost']:+.1%} (median of rounds; bests "
              f"{t['on_best']:.0f} / {t['off_best']:.0f}), server CPU per token "
              f"{c['cost']:+.1%}", flush=True)
        result["serving"] = serving
        if _CONTROL.value:
            same = time_serving(_HTTP_ROUNDS.value, _REQUESTS.value, _CONCURRENCY.value,
                                _NEW_TOKENS.value, control=True)
            t, c = same["tok_s"], same["server_cpu_s_per_1k_tokens"]
            print(f"control, open vs open: tokens/s {t['cost']:+.1%}, server CPU per token "
                  f"{c['cost']:+.1%}", flush=True)
            result["serving_control"] = same
        checks = time_request_checks(_NEW_TOKENS.value)
        checks["server_cpu_s_per_request"] = serving["server_cpu_s_per_request"]
        checks["cost"] = checks["extra_s"] / serving["server_cpu_s_per_request"]
        checks["within_2pct"] = bool(checks["cost"] <= LIMIT - 1)
        print(f"request checks: {1e6 * checks['checked_s']:.1f} us per request against "
              f"{1e6 * checks['plain_s']:.1f} us for json.loads: "
              f"{1e6 * checks['extra_s']:.1f} us more, {checks['cost']:.2%} of the server's "
              f"CPU per request ({1e3 * checks['server_cpu_s_per_request']:.2f} ms)",
              flush=True)
        result["request_checks"] = checks
        result["serving_machine"] = {**machine, "load_avg_end": os.getloadavg()}
    result.pop("machine", None)
    out = Path(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
