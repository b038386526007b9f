r"""Chaos soak of the asynchronous job: the tiny RL recipe (``configs/tiny_rl.py``, two generator
servers, loopback only) runs for a set wall time while faults from a seeded schedule hit it,
several at once; afterwards the run's own records are checked against invariants.

Faults (``--faults``, default all; each fault's target and outcome go to the report):

  kill_generator     ``kill -9`` of a generator server (the run's pool restarts it)
  kill_trainer       ``kill -9`` of the trainer, then the same command again (it resumes)
  stop_generator     ``SIGSTOP`` of a server for longer than the request and update time limits,
                     then ``SIGCONT``
  drop_pull          the publisher's TCP connections cut (``ss -K``) while servers pull
  corrupt_chunk      bytes of the newest staged version overwritten in shared memory
  full_shm           the publisher's staging tmpfs filled for a while (versions go over ``disk``)
  full_disk          the checkpoints' tmpfs filled for a while (saves are skipped, not fatal)
  join_leave         a third server joins the fleet (``POST /v1/generators``), later leaves
  slow_env           the reward environment stalls past ``rollout.score_timeout_s``
  garbage_generator  a server behind a proxy that corrupts its completions joins, later leaves

Invariants (from ``metrics.jsonl``, ``rollout_drops.jsonl``, checkpoints, the monitor's polls):
every trained prompt trained once, and every admitted prompt trained, pending in the last
checkpoint or dropped with a recorded reason; every trained step's staleness within ``max_lag``;
each server's weight version never decreasing; every checkpoint on disk restores; after each
resume the data order continues from the checkpoint (no position trained twice, none skipped);
the final export loads and was evaluated; no process, staging directory or shared-memory
segment of the run left behind.

    python tools/chaos.py --duration_s=1800 --seed=0 --out=chaos        # the soak
    python tools/chaos.py --duration_s=1800 --faults= --seed=1 --out=chaos_free  # no faults
    python tools/chaos.py --check=runs/chaos/chaos                     # invariants only

Writes ``benchmarks/results/<out>.json`` (faults, restarts, invariants, held-out accuracy, the
time each kind of fault cost) and ``<out>.png`` (a timeline of faults, server versions, staleness
and accuracy). Needs root for the tmpfs mounts of ``full_shm`` and ``full_disk`` (without it
those two are left out, and the report says so).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

FAULTS = ("kill_generator", "kill_trainer", "stop_generator", "drop_pull", "corrupt_chunk",
          "full_shm", "full_disk", "join_leave", "slow_env", "garbage_generator")
API_KEY, ADMIN_KEY, TOKEN = "chaos-api-key-0123456789", "chaos-admin-key-0123456789", \
    "chaos-transfer-token-0123456789"
MAX_LAG = 2
MAX_RESTARTS = 200  # a trainer that keeps dying on its own ends the soak
REQUEST_TIMEOUT_S, UPDATE_TIMEOUT_S, SCORE_TIMEOUT_S = 20.0, 20.0, 3.0

_DURATION = flags.DEFINE_float("duration_s", 1800.0, "Wall seconds of faults (the run trains "
                               "as long, plus the time restarts take).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the fault schedule and of the run.")
_FAULTS = flags.DEFINE_list("faults", list(FAULTS), "Fault kinds (empty: a fault-free run).")
_GAP = flags.DEFINE_float("mean_gap_s", 12.0, "Mean seconds between two fault starts "
                          "(exponential); faults last seconds to tens of seconds and overlap.")
_WORKDIR = flags.DEFINE_string("workdir", str(ROOT / "runs" / "chaos"), "Runs go here.")
_BASE = flags.DEFINE_string("base", "", "Base policy (HF dir); default: the tiny recipe's, "
                            "trained once into <workdir>/base.")
_OUT = flags.DEFINE_string("out", "chaos", "Run and result name.")
_CHECK = flags.DEFINE_string("check", "", "Only check the invariants of this finished run.")
_RESULTS = flags.DEFINE_string("results_dir", str(RESULTS), "Where the report goes.")


# ---- small helpers ------------------------------------------------------------------------------

def http(url: str, path: str, body: Any = None, *, method: str | None = None,
         key: str = ADMIN_KEY, timeout: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method or (
        "POST" if body is not None else "GET"), headers={"Authorization": f"Bearer {key}",
                                                         "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:500].decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


def mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                           str(path)], capture_output=True).returncode == 0


def fill(path: Path, seconds: float, stop: threading.Event) -> str:
    """Fills the filesystem of ``path`` for ``seconds`` (a file of zeros), then frees it."""
    filler = path / f"chaos-filler-{time.monotonic_ns()}"
    written = 0
    try:
        with open(filler, "wb") as f:
            block = b"\0" * (1 << 20)
            while True:
                try:
                    f.write(block)
                    f.flush()
                    written += len(block)
                except OSError:
                    break
        stop.wait(seconds)
    finally:
        filler.unlink(missing_ok=True)
    return f"{written >> 20} MiB written, full for {seconds:.0f} s"


def process_tree(pid: int) -> list:
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@dataclasses.dataclass
class Event:
    kind: str
    start: float
    end: float | None = None
    target: str = ""
    outcome: str = ""


# ---- the corrupting proxy (garbage_generator) --------------------------------------------------

class GarbageProxy:
    """An HTTP proxy in front of a real server that corrupts the completions of ``/generate``
    (every other answer): log-probs above zero, token ids outside the vocabulary, or fewer
    log-probs than tokens. Everything else passes through, so the server joins the fleet."""

    def __init__(self, upstream: str, seed: int):
        self.upstream, self.rng = upstream, random.Random(seed)
        self.url = ""
        self.corrupted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner = None

    def start(self) -> str:
        from aiohttp import web
        from rl_jax.generator.launcher.pool import free_port
        self._thread.start()
        port = free_port()

        async def serve():
            application = web.Application(client_max_size=64 << 20)
            application.router.add_route("*", "/{tail:.*}", self._forward)
            self._runner = web.AppRunner(application, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", port).start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(30)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        async with aiohttp.ClientSession() as session:
            async with session.request(request.method, self.upstream + request.path_qs,
                                       data=body, headers=headers) as answer:
                payload = await answer.read()
                status = answer.status
        if request.path == "/generate" and status == 200 and self.rng.random() < 0.5:
            payload = self._corrupt(payload)
        return web.Response(body=payload, status=status, content_type="application/json")

    def _corrupt(self, payload: bytes) -> bytes:
        try:
            data = json.loads(payload)
        except ValueError:
            return payload
        outs = data if isinstance(data, list) else [data]
        how = self.rng.choice(["logprob", "token", "short"])
        for out in outs:
            meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
            lps = meta.get("output_token_logprobs")
            if not lps:
                continue
            if how == "logprob":
                lps[0][0] = 3.5  # a probability above 1
            elif how == "token":
                out["output_ids"][0] = 10**9
                lps[0][1] = 10**9
            else:
                del lps[-1]
        self.corrupted += 1
        return json.dumps(data).encode()

    def stop(self):
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# ---- the harness ---------------------------------------------------------------------------------

class Chaos:
    def __init__(self, workdir: Path, base: Path, duration: float, kinds: list[str], seed: int):
        from rl_jax.generator.launcher.pool import free_port
        self.workdir, self.base, self.duration, self.seed = workdir, base, duration, seed
        self.rng = random.Random(seed)
        self.run_dir = workdir / "run"
        self.port = free_port()
        self.control = f"http://127.0.0.1:{self.port}"
        self.events: list[Event] = []
        self.restarts: list[dict[str, float]] = []
        # (time, "server url@trainer life", version): a resumed trainer restarts the versions
        # from its checkpoint's step (the steps after it are trained again), so versions only
        # increase within one life of the trainer
        self.versions: list[tuple[float, str, int]] = []
        self.notes: list[str] = []
        self.stop = threading.Event()
        self.trainer: subprocess.Popen | None = None
        self.lives = 0
        self.extra_pools: list[Any] = []
        self.slow_control = workdir / "slow_env.json"
        self.shm = workdir / "shm"
        self.ckpt = self.run_dir / "checkpoints"
        self.kinds = list(kinds)
        if workdir.exists():
            for mount in (self.shm, self.ckpt):
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        self.mounted = []
        for path, size, kind in ((self.shm, 256, "full_shm"), (self.ckpt, 128, "full_disk")):
            if mount_tmpfs(path, size):
                self.mounted.append(path)
            elif kind in self.kinds:
                self.kinds.remove(kind)
                self.notes.append(f"{kind} left out: mounting a tmpfs needs root")
        self.shm_before = set(os.listdir("/dev/shm"))

    # -- the run ----------------------------------------------------------------------------------

    def recipe(self) -> Path:
        """The tiny recipe with two servers, short time limits, a staging tmpfs with ``disk`` as
        the fallback, a scoring time limit, and a reward environment whose scoring can stall."""
        path = self.workdir / "chaos_recipe.py"
        path.write_text(f"""from ml_collections import ConfigDict

from rl_jax.recipe.checks import load_recipe_file


def get_config():
    c = load_recipe_file({str(ROOT / "configs" / "tiny_rl.py")!r})
    c.seed = {self.seed}
    c.base.checkpoint = {str(self.base)!r}
    c.env.name = "delayed"
    c.env.kwargs = ConfigDict(dict(task="arithmetic", control={str(self.slow_control)!r},
                                   task_kwargs=dict(num_digits=2, reverse_answer=False,
                                                    partial_credit=False)))
    c.trainer.update(time_limit_s={self.duration}, steps=100000)
    c.generator.update(num_servers=2, request_timeout_s={REQUEST_TIMEOUT_S})
    c.transfer.update(timeout_s={UPDATE_TIMEOUT_S}, port={self.port},
                      transports=("shm", "disk"), staging_dir={str(self.shm)!r})
    c.rollout.update(max_lag={MAX_LAG}, score_timeout_s={SCORE_TIMEOUT_S})
    c.checkpoint.update(every=10, keep=3)
    c.eval.every = 20
    c.logging.tensorboard = False
    return c
""")
        return path

    def command(self) -> list[str]:
        return [sys.executable, "-m", "launch.train", f"--config={self.recipe()}",
                f"--workdir={self.run_dir}"]

    def start_trainer(self):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(RL_JAX_API_KEY=API_KEY, RL_JAX_ADMIN_API_KEY=ADMIN_KEY,
                   RL_JAX_TRANSFER_TOKEN=TOKEN)
        self.lives += 1
        log = open(self.workdir / f"trainer-{self.lives}.log", "wb")
        self.trainer = subprocess.Popen(self.command(), cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def steps(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
        return rows

    def servers(self) -> list:
        if self.trainer is None or self.trainer.poll() is not None:
            return []
        return [p for p in process_tree(self.trainer.pid)
                if any("generator.server" in a or "generator_server" in a
                       for a in p.cmdline())]

    def members(self) -> list[str]:
        status, listed = http(self.control, "/v1/generators")
        return listed.get("members", []) if status == 200 and isinstance(listed, dict) else []

    def monitor(self):
        """Polls each member's weight version every second."""
        while not self.stop.wait(1.0):
            for url in self.members():
                status, answer = http(url, "/get_weight_version", key=API_KEY, timeout=2.0)
                version = answer.get("weight_version") if isinstance(answer, dict) else None
                if status == 200 and version is not None:
                    self.versions.append((time.time(), f"{url}@{self.lives}", int(version)))

    # -- faults -----------------------------------------------------------------------------------

    def fault(self, kind: str):
        event = Event(kind, time.time())
        self.events.append(event)
        try:
            event.target, event.outcome = getattr(self, f"_{kind}")()
        except Exception as e:  # the harness reports a fault it could not inject
            event.outcome = f"not injected: {type(e).__name__}: {e}"
        event.end = time.time()

    def _kill_generator(self):
        servers = self.servers()
        if not servers:
            return "", "no server running"
        victim = self.rng.choice(servers)
        victim.send_signal(signal.SIGKILL)
        return f"pid {victim.pid}", "killed"

    def _kill_trainer(self):
        trainer = self.trainer
        if trainer is None or trainer.poll() is not None:
            return "", "no trainer running"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        return f"pid {trainer.pid}", "killed (restarted by the harness)"

    def _stop_generator(self):
        servers = self.servers()
        if not servers:
            return "", "no server running"
        victim = self.rng.choice(servers)
        seconds = REQUEST_TIMEOUT_S + UPDATE_TIMEOUT_S + 5
        victim.send_signal(signal.SIGSTOP)
        self.stop.wait(seconds)
        try:
            victim.send_signal(signal.SIGCONT)
        except Exception:
            return f"pid {victim.pid}", f"stopped {seconds:.0f} s; gone before SIGCONT"
        return f"pid {victim.pid}", f"stopped {seconds:.0f} s"

    def _drop_pull(self):
        cut, deadline = 0, time.monotonic() + 3.0
        while time.monotonic() < deadline:
            out = subprocess.run(["ss", "-K", "-t", "state", "established", "(", "sport", "=",
                                  f":{self.port}", "or", "dport", "=", f":{self.port}", ")"],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                return "", f"ss -K failed: {out.stderr.strip()[:200]}"
            cut += max(len(out.stdout.strip().splitlines()) - 1, 0)
            time.sleep(0.1)
        return f"port {self.port}", f"{cut} connections cut"

    def _corrupt_chunk(self):
        files = [f for f in self.shm.rglob("*") if f.is_file() and f.stat().st_size > 8192]
        if not files:
            return "", "nothing staged"
        target = max(files, key=lambda f: f.stat().st_mtime)
        size = target.stat().st_size
        offset = self.rng.randrange(0, size - 4096)
        with open(target, "r+b") as f:
            f.seek(offset)
            f.write(os.urandom(4096))
        return f"{target.name}@{offset}", "4 KiB overwritten"

    def _full_shm(self):
        return str(self.shm), fill(self.shm, 20.0, self.stop)

    def _full_disk(self):
        return str(self.ckpt), fill(self.ckpt, 30.0, self.stop)

    def _start_server(self, name: str):
        from rl_jax.generator.auth import Keys
        from rl_jax.generator.launcher.pool import PoolConfig, ServerPool
        pool = ServerPool(PoolConfig(
            model=str(self.base), ports=(0,), max_slots=64, max_seq_len=64, dtype="float32",
            publisher_url=self.control, keys=Keys(API_KEY, ADMIN_KEY), startup_timeout=240,
            env=(("RL_JAX_TRANSFER_TOKEN", TOKEN),), log_dir=str(self.workdir / name)))
        self.extra_pools.append(pool)
        pool.start()
        return pool

    def join(self, url: str) -> tuple[int, Any]:
        """``POST /v1/generators``, again for up to 90 s while the trainer is (re)starting
        (it answers 503 until its own servers run its weights)."""
        deadline = time.monotonic() + 90
        while True:
            status, answer = http(self.control, "/v1/generators", {"url": url}, timeout=120)
            if status not in (0, 503) or time.monotonic() > deadline or self.stop.is_set():
                return status, answer
            time.sleep(2.0)

    def _join_leave(self):
        pool = self._start_server(f"joining-{len(self.extra_pools)}")
        url = pool.urls[0]
        try:
            status, answer = self.join(url)
            if status != 200:
                return url, f"join refused ({status}): {str(answer)[:200]}"
            self.stop.wait(30.0)
            status, answer = http(self.control, "/v1/generators", {"url": url},
                                  method="DELETE", timeout=60)
            left = "left" if status == 200 else f"leave answered {status}: {str(answer)[:100]}"
            return url, f"joined at version {answer.get('weight_version', '?')}, {left}" \
                if isinstance(answer, dict) else f"joined, {left}"
        finally:
            pool.stop()

    def _slow_env(self):
        seconds = 15.0
        self.slow_control.write_text(json.dumps({"delay_s": 2 * SCORE_TIMEOUT_S,
                                                 "until": time.time() + seconds}))
        self.stop.wait(seconds)
        return "env", f"scoring stalled {2 * SCORE_TIMEOUT_S:.0f} s per group for {seconds:.0f} s"

    def _garbage_generator(self):
        proxy = GarbageProxy("", self.rng.randrange(2**31))
        pool = self._start_server(f"garbage-{len(self.extra_pools)}")
        proxy.upstream = pool.urls[0]
        target, outcome = self._join_leave_through(proxy, pool)
        return target, f"{outcome}; {proxy.corrupted} answers corrupted"

    def _join_leave_through(self, proxy: GarbageProxy, pool) -> tuple[str, str]:
        url = proxy.start()
        try:
            status, answer = self.join(url)
            if status != 200:
                return url, f"join refused ({status}): {str(answer)[:200]}"
            self.stop.wait(20.0)
            status, answer = http(self.control, "/v1/generators", {"url": url},
                                  method="DELETE", timeout=60)
            return url, "joined, " + ("left" if status == 200 else
                                      f"leave answered {status}: {str(answer)[:100]}")
        finally:
            proxy.stop()
            pool.stop()

    # -- the soak ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        monitor = threading.Thread(target=self.monitor, daemon=True)
        self.start_trainer()
        start = time.time()
        monitor.start()
        threads: list[threading.Thread] = []
        order: list[str] = []
        next_fault = start + 30.0  # the first faults once the run trains
        try:
            while True:
                now = time.time()
                code = self.trainer.poll()
                if code == 0:
                    break
                if code is not None:  # killed (by a fault, or by a fault's effect): resume
                    died = now
                    if len(self.restarts) >= MAX_RESTARTS:
                        raise SystemExit(f"the trainer died {len(self.restarts) + 1} times; "
                                         f"last log: {self.workdir}/trainer-{self.lives}.log")
                    self.start_trainer()
                    self.restarts.append({"died": died, "restarted": time.time(),
                                          "exit_code": code})
                if now - start > 3 * self.duration + 600:
                    raise SystemExit("the run did not finish in three times its duration")
                if self.kinds and now < start + self.duration and now >= next_fault:
                    if not order:
                        order = self.rng.sample(self.kinds, len(self.kinds))
                    kind = order.pop()
                    t = threading.Thread(target=self.fault, args=(kind,), daemon=True)
                    t.start()
                    threads.append(t)
                    next_fault = now + self.rng.expovariate(1.0 / _GAP.value)
                time.sleep(0.2)
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=120)
            if self.trainer is not None and self.trainer.poll() is None:
                os.killpg(self.trainer.pid, signal.SIGKILL)
            for pool in self.extra_pools:
                pool.stop()
        return {"started": start, "ended": time.time()}

    def cleanup(self):
        for path in self.mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ---- invariants ---------------------------------------------------------------------------------

def surviving_steps(rows: list[dict]) -> list[dict]:
    """The step records of the history that survived: a resumed run writes again the steps after
    its checkpoint, and the later record of a step replaces the earlier ones (and every record
    after it in the old life)."""
    history: list[dict] = []
    for r in rows:
        if "loss/loss" not in r:
            continue
        while history and history[-1]["step"] >= r["step"]:
            history.pop()
        history.append(r)
    return history


def check(run_dir: Path, recipe: Path, versions: list[tuple[float, str, int]],
          shm_before: set[str], max_lag: int = MAX_LAG) -> dict[str, dict[str, Any]]:
    """Each invariant of a finished run: ``{name: {"ok", "detail"}}``."""
    out: dict[str, dict[str, Any]] = {}

    def verdict(name: str, ok: bool, detail: str):
        out[name] = {"ok": bool(ok), "detail": detail}

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if x.strip().startswith("{") and x.strip().endswith("}")]
    steps = surviving_steps(rows)
    trained = [p for r in steps for p in r.get("rollout/prompts", [])]
    duplicates = [p for p, n in collections.Counter(trained).items() if n > 1]
    verdict("trained_once", not duplicates and bool(trained),
            f"{len(trained)} prompts trained over {len(steps)} steps; twice: {duplicates[:10]}")
    drops_path = run_dir / "rollout_drops.jsonl"
    drops = [json.loads(x) for x in drops_path.read_text().splitlines()] \
        if drops_path.exists() else []
    dropped = {d["position"] for d in drops}
    from rl_jax.trainer.checkpoint import Checkpointer
    ckpt = Checkpointer(run_dir / "checkpoints")
    latest = ckpt.latest_step()
    meta = json.loads((run_dir / "checkpoints" / str(latest) / "metadata" / "metadata")
                      .read_text()) if latest is not None else {}
    rollout = meta.get("rollout", {})
    pending = set(rollout.get("pending", []))
    admitted = set(range(int(rollout.get("next_position", 0))))
    lost = sorted(admitted - set(trained) - pending - dropped)
    reasons = collections.Counter(d["reason"] for d in drops)
    verdict("none_lost", not lost, f"{len(admitted)} admitted; {len(pending)} pending at the end; "
            f"dropped with a reason: {dict(reasons)}; unaccounted: {lost[:10]}")
    late = [(r["step"], r.get("staleness/batch_max")) for r in steps
            if r.get("staleness/batch_max", 0) > max_lag]
    verdict("staleness_bounded", not late, f"max over steps "
            f"{max((r.get('staleness/batch_max', 0) for r in steps), default=0)}; "
            f"above {max_lag}: {late[:10]}")
    backwards = []
    last: dict[str, tuple[float, int]] = {}
    for t, url, v in sorted(versions):
        if url in last and v < last[url][1]:
            backwards.append((url, last[url][1], v))
        last[url] = (t, v)
    verdict("versions_increase", not backwards,
            f"{len(versions)} polls of {len(last)} servers; decreases: {backwards[:5]}")
    restored, failed = [], []
    import jax
    from rl_jax.models.config import DTYPES
    from rl_jax.models.hf import read_config
    from rl_jax.recipe.checks import load_recipe_file, parse
    from rl_jax.recipe.schema import to_dict
    from rl_jax.sharding import make_mesh
    from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state,
                                      make_optimizer)
    r = parse(load_recipe_file(recipe))
    spec = ModelSpec(read_config(r.base.checkpoint), mesh=make_mesh(1, 1, 1),
                     dtype=DTYPES[r.model.dtype], param_dtype=DTYPES[r.model.param_dtype],
                     remat=r.model.remat, scan_layers=r.model.scan_layers)
    tx = make_optimizer(OptimizerConfig(total_steps=r.trainer.steps, **to_dict(r.optimizer)))
    for s in ckpt.all_steps():
        try:
            ckpt.restore(abstract_state(tx, spec), step=s)
            restored.append(s)
        except Exception as e:  # every kind of damage is a finding
            failed.append((s, f"{type(e).__name__}: {str(e)[:100]}"))
    ckpt.close()
    verdict("checkpoints_restore", not failed and bool(restored),
            f"restored steps {restored}; failed: {failed}")
    orders = [p for r in steps for p in sorted(r.get("rollout/prompts", []))]
    verdict("order_continues", sorted(set(orders)) == sorted(orders) and bool(orders),
            "positions trained across every resume: each once (see trained_once); "
            f"{len(rows) - len([r for r in rows if 'loss/loss' not in r]) - len(steps)} "
            "step records replaced by resumed lives")
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").exists() else {}
    from rl_jax.models.hf import load_pretrained
    try:
        load_pretrained(run_dir / "hf", None, jax.numpy.float32)
        loads = "loads"
    except Exception as e:
        loads = f"does not load: {e}"
    accuracy = summary.get("held_out_accuracy_after")
    verdict("export_evaluated", loads == "loads" and accuracy is not None,
            f"final export {loads}; held-out accuracy {accuracy}")
    import psutil
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if p.pid != os.getpid()
            and str(run_dir) in " ".join(p.info["cmdline"] or [])]
    new_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
    verdict("nothing_left", not left and not new_shm,
            f"processes of the run: {left}; new /dev/shm entries: {new_shm}")
    return out


# ---- the report ---------------------------------------------------------------------------------

def time_lost(events: list[Event], steps: list[dict]) -> dict[str, float]:
    """Per fault kind, the seconds training stalled beyond its usual pace: the longest gap
    between two step records in the 120 s after each fault's start, less the median gap."""
    times = sorted(r["time"] for r in steps if "time" in r)
    gaps = [b - a for a, b in zip(times, times[1:])]
    usual = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    lost: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        window = [b - a for a, b in zip(times, times[1:]) if b >= e.start and a <= e.start + 120]
        lost[e.kind].append(max(max(window, default=0.0) - usual, 0.0))
    return {k: round(sum(v) / len(v), 2) for k, v in lost.items()}


def plot(path: Path, events: list[Event], versions, steps, restarts, start: float, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 1, figsize=(12, 10), sharex=True)
    kinds = sorted({e.kind for e in events})
    for e in events:
        y = kinds.index(e.kind)
        axes[0].plot([e.start - start, (e.end or e.start) - start], [y, y], lw=5)
    for r in restarts:
        axes[0].axvline(r["died"] - start, color="k", ls=":", lw=1)
    axes[0].set_yticks(range(len(kinds)), kinds, fontsize=7)
    axes[0].set_title("faults (dotted: trainer restarts)", fontsize=9)
    by_url = collections.defaultdict(list)
    for t, url, v in versions:
        by_url[url].append((t - start, v))
    for url, pts in by_url.items():
        axes[1].plot(*zip(*pts), ".", ms=2, label=url.rsplit(":", 1)[-1])  # port@life
    axes[1].set_title("weight version on each server", fontsize=9)
    axes[1].legend(fontsize=6)
    s = [r for r in steps if "time" in r]
    axes[2].plot([r["time"] - start for r in s], [r.get("staleness/batch_max", 0) for r in s],
                 ".", ms=2)
    axes[2].set_title("staleness (batch max)", fontsize=9)
    ev = [r for r in steps if "eval/accuracy" in r and "time" in r]
    axes[3].plot([r["time"] - start for r in ev], [r["eval/accuracy"] for r in ev], "o-", ms=3)
    axes[3].set_title("held-out accuracy", fontsize=9)
    axes[3].set_xlabel("seconds since the start")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ensure_base(workdir: Path) -> Path:
    if _BASE.value:
        return Path(_BASE.value).absolute()
    from rl_jax.orchestrator.rl import ensure_base_checkpoint
    from rl_jax.recipe.checks import load_recipe_file
    config = load_recipe_file(ROOT / "configs" / "tiny_rl.py")
    return ensure_base_checkpoint(config, workdir / "base")


def main(argv):
    del argv
    if _CHECK.value:
        run_dir = Path(_CHECK.value) / "run"
        print(json.dumps(check(run_dir, Path(_CHECK.value) / "chaos_recipe.py", [],
                               set(os.listdir("/dev/shm"))), indent=1))
        return
    unknown = sorted(set(_FAULTS.value) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}; known: {', '.join(FAULTS)}")
    root = Path(_WORKDIR.value).absolute()
    base = ensure_base(root)
    chaos = Chaos(root / _OUT.value, base, _DURATION.value, list(_FAULTS.value), _SEED.value)
    print(f"chaos: {_DURATION.value:.0f} s, faults {chaos.kinds or 'none'}, seed {_SEED.value}; "
          f"run in {chaos.run_dir}", flush=True)
    try:
        span = chaos.run()
        rows = chaos.steps()
        invariants = check(chaos.run_dir, chaos.workdir / "chaos_recipe.py", chaos.versions,
                           chaos.shm_before)
    finally:
        chaos.cleanup()
    steps = surviving_steps(rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    summary = json.loads((chaos.run_dir / "summary.json").read_text())
    counts = collections.Counter(e.kind for e in chaos.events)
    result = {
        "command": " ".join(["python", "tools/chaos.py", *sys.argv[1:]]),
        "duration_s": _DURATION.value, "seed": _SEED.value, "faults": chaos.kinds,
        "notes": chaos.notes, "wall_s": span["ended"] - span["started"],
        "fault_counts": dict(counts), "restarts": chaos.restarts,
        "events": [dataclasses.asdict(e) for e in chaos.events],
        "invariants": invariants, "all_invariants_hold": all(v["ok"] for v in
                                                               invariants.values()),
        "held_out_accuracy_after": summary.get("held_out_accuracy_after"),
        "held_out_curve": [(r.get("wall_s"), r["step"], r["eval/accuracy"]) for r in evals],
        "steps": len(steps), "train_wall_s": summary.get("wall_s"),
        "time_lost_s": time_lost(chaos.events, steps),
        "host": {"cpus": os.cpu_count(), "load": os.getloadavg()},
    }
    results = Path(_RESULTS.value)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{_OUT.value}.json").write_text(json.dumps(result, indent=1))
    plot(results / f"{_OUT.value}.png", chaos.events, chaos.versions, rows, chaos.restarts,
         span["started"], f"chaos: {sum(counts.values())} faults in {_DURATION.value:.0f} s, "
         f"seed {_SEED.value}; final held-out accuracy {result['held_out_accuracy_after']}")
    for name, v in invariants.items():
        print(f"{'ok  ' if v['ok'] else 'FAIL'} {name}: {v['detail']}")
    print(f"faults: {dict(counts)}; restarts: {len(chaos.restarts)}; held-out accuracy "
          f"{result['held_out_accuracy_after']}; time lost per fault (s): "
          f"{result['time_lost_s']}")
    print(f"wrote {results / _OUT.value}.json and .png")
    if not result["all_invariants_hold"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
