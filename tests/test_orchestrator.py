"""The RL run end to end: real generator server processes on loopback, the weight publisher, the
rollout pipeline and the trainer, started by ``python -m launch.train`` as a user would.

A base policy is trained once per test session with the supervised recipe (shortened), then each
test runs the RL recipe in a fresh work directory with small batches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ml_collections import ConfigDict

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# A small RL run: 16 prompts × 4 samples per step, one server, held-out set of 64.
SMALL = [
    "--config.rollout.groups_per_batch=16", "--config.rollout.group_size=4",
    "--config.eval.examples=64", "--config.eval.every=0", "--config.generator.max_slots=32",
    "--config.checkpoint.every=2", "--config.cpus.trainer=", "--config.cpus.generators=",
    "--config.cpus.rollout=",
    "--config.generator.warmup_shapes=False",
    # The export is the last step's policy (the parameter average has a test of its own).
    "--config.trainer.ema_decay=0",
    # No time limit (the learning-rate schedule then follows steps alone, so sync runs repeat
    # exactly) and no dynamic filtering (a weak base policy would filter most groups).
    "--config.trainer.time_limit_s=0", "--config.rollout.filter_zero_signal=False",
]


def launch(workdir: Path, *flags: str, base: Path | None = None, wait: bool = True,
           timeout: float = 600, config: str = "configs/tiny_rl.py"
           ) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.train", f"--config={config}",
           f"--workdir={workdir}", *SMALL, *flags]
    if base is not None:
        cmd.append(f"--config.base.checkpoint={base}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def records(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(workdir: Path) -> dict[int, dict]:
    """The last record of every step that trained (a resumed run rewrites lost steps)."""
    return {r["step"]: r for r in records(workdir) if "loss/loss" in r}


@pytest.fixture(scope="session")
def base_policy(tmp_path_factory) -> Path:
    """The supervised tiny model on 2-digit addition, shortened to 150 steps."""
    workdir = tmp_path_factory.mktemp("base")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py",
         f"--workdir={workdir}", "--config.trainer.steps=150", "--config.logging.eval_every=150",
         "--config.task.num_digits=2",
         "--config.data.eval_examples=64"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir / "hf"


def test_async_run_end_to_end(base_policy, tmp_path):
    """Async mode: every output is written, staleness stays within max_lag, the generators
    ran every version the trainer published, policy snapshots are written, and the last line
    is the accuracy line."""
    workdir = tmp_path / "async"
    result = launch(workdir, "--config.trainer.steps=6", "--config.rollout.max_lag=2",
                    "--config.eval.every=3", "--config.export.every=3", base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("held-out accuracy: "), lines[-3:]
    before, after = (float(x) for x in lines[-1].split(": ")[1].split(" -> "))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["mode"] == "async" and summary["steps"] == 6
    assert summary["held_out_accuracy_before"] == pytest.approx(before, abs=0.005)
    assert summary["held_out_accuracy_after"] == pytest.approx(after, abs=0.005)
    assert summary["final_version"] == 6  # the final eval ran on the final weights
    assert summary["staleness/max"] <= 2
    assert sum(summary["staleness_histogram"].values()) == 6 * 16
    assert summary.get("gate/late", 0) == 0
    # launch to the end of the first step (a run's start-up, compilations included)
    assert 0 < summary["time_to_first_step_s"] < summary["wall_s"] + 600
    assert any(line.startswith("first step ") for line in result.stdout.splitlines())
    assert summary["generators_priority"] in ("default", "nice 10", "autogroup nice 10")
    # CPU seconds per thread over the steps, of this process and of the generator server
    trainer_cpu, generator_cpu = summary["trainer_cpu_seconds"], summary["generator_cpu_seconds"]
    assert trainer_cpu["main"] > 0 and "engine" in generator_cpu
    assert 0 < sum(trainer_cpu.values()) + sum(generator_cpu.values()) < 2 * summary["wall_s"]
    # garbage collections during the loop, setup's objects frozen out of them (rl_jax.heap)
    assert summary["trainer_gc"]["frozen_objects"] > 10_000
    assert 0 <= summary["generator_gc_pause_s"] < summary["wall_s"]
    # decode steps per decode batch size (a power of two up to the server's slots)
    batches = {int(b): n for b, n in summary["generator_decode_batches"].items()}
    assert batches and all(n > 0 and b & (b - 1) == 0 for b, n in batches.items()), batches
    assert summary["generator_counters"]["decode_steps"] == sum(batches.values())
    steps = train_records(workdir)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for r in steps.values():
        assert np.isfinite(r["loss/loss"]) and r["staleness/batch_max"] <= 2
        assert r["version"] == r["step"]
        for key in ("reward/mean", "reward/std", "loss/clipped_fraction", "loss/entropy_mean",
                    "loss/ratio_ess", "generator/tokens_per_s", "trainer/tokens_per_s",
                    "generator/idle_fraction", "trainer/idle_fraction", "weights/total_s"):
            assert key in r, key
    assert [r for r in records(workdir) if "eval/accuracy" in r]
    for name in ("progress.png", "hf/config.json", "hf/model.safetensors", "hf/tokenizer.json"):
        assert (workdir / name).is_file(), name
    assert list((workdir / "tb").glob("events.out.tfevents.*"))
    # The exported policy differs from the base (it was trained).
    from safetensors.numpy import load_file
    new, old = load_file(workdir / "hf/model.safetensors"), \
        load_file(base_policy / "model.safetensors")
    assert any(not np.array_equal(new[k], old[k]) for k in old)
    # Snapshots of versions 3 and 6 with the wall time of their step; the last is the export.
    from rl_jax.orchestrator.snapshots import list_snapshots
    snapshots = list_snapshots(workdir)
    assert [meta["version"] for meta, _ in snapshots] == [3, 6]
    for meta, path in snapshots:
        assert meta["step"] == meta["version"]
        # taken after its train step, before the step's record
        assert steps[meta["step"] - 1]["wall_s"] <= meta["wall_s"] <= steps[meta["step"]]["wall_s"]
        assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    first, last = (load_file(path / "model.safetensors") for _, path in snapshots)
    assert all(np.array_equal(last[k], new[k]) for k in new)
    assert any(not np.array_equal(first[k], last[k]) for k in new)


def _server_tracebacks(log: str) -> list[str]:
    """The tracebacks in an SGLang server's log (the log line before each), but for its own
    warning when the request it sends itself after start-up (``/freeze_gc``) fails, as it may on
    a busy host: that warning's chained tracebacks run until the server's next log record."""
    found, record, excused = [], "", False
    for line in log.splitlines():
        if line.startswith("["):  # a new log record: "[2026-11-28 19:42:01] ..."
            record, excused = line, "freeze_gc failed" in line
        elif line.startswith("Traceback") and not excused:
            found.append(record)
    return found


def _sidecar_dirs() -> set[str]:
    from rl_jax.transfer.config import default_staging_dir
    return {p.name for p in Path(default_staging_dir()).glob("rl_jax-sglang-sidecar-*")}


@pytest.mark.parametrize("weights", ["disk", "sidecar"])
def test_async_run_on_a_real_sglang_server(base_policy, tmp_path, weights):
    """The tiny recipe with a real SGLang server (configs/tiny_rl_sglang.py, SGLang in its own
    environment started by the launcher): versions reach it after every step, staleness stays
    within max_lag, every trained token's version comes from SGLang's spans, and it trains.
    Versions go as checkpoints the trainer writes (``disk``) or through a weight sidecar that
    pulls them over the transfer service (``sidecar``): no checkpoint per step, nothing left
    behind."""
    from sglang_fixtures import sglang_python
    sglang_python()  # installed (else a failure naming the install command)
    workdir = tmp_path / "sglang"
    before = _sidecar_dirs()
    result = launch(workdir, "--config.trainer.steps=4", "--config.rollout.max_lag=1",
                    f"--config.generator.sglang_weights={weights}",
                    base=base_policy, config="configs/tiny_rl_sglang.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("held-out accuracy: ")
    assert "ignores sampling seeds" in result.stderr  # said once
    assert result.stderr.count("ignores sampling seeds") == 1
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_version"] == 4
    assert summary["staleness/max"] <= 1 and summary.get("gate/late", 0) == 0
    assert sum(summary["staleness_histogram"].values()) == 4 * 16
    steps = train_records(workdir)
    assert sorted(steps) == [1, 2, 3, 4]
    for r in steps.values():
        assert np.isfinite(r["loss/loss"]) and r["staleness/batch_max"] <= 1
        assert r["version"] == r["step"]
    log = "".join(p.read_text() for p in (workdir / "generators").glob("sglang-server-*.log"))
    assert "/update_weights_from_disk" in log and not _server_tracebacks(log), log[-3000:]
    assert "new_version='4'" in log  # SGLang's own record of the versions it took
    written = list((workdir / "weights").glob("*")) if (workdir / "weights").exists() else []
    if weights == "disk":
        assert written  # the trainer's checkpoints, one per version (the newest kept)
        return
    assert not written
    sidecar_log = (workdir / "generators" / "sidecar-0.log").read_text()
    assert "rl_jax sglang sidecar ready at http://127.0.0.1:" in sidecar_log
    assert "Traceback" not in sidecar_log
    assert _sidecar_dirs() <= before  # its tmpfs images removed when the run stopped it
    left = subprocess.run(["pgrep", "-f", "rl_jax.transfer.sglang.sidecar"], capture_output=True)
    assert left.returncode == 1, left.stdout


def test_ema_of_parameters_is_exported_and_evaluated(base_policy, tmp_path):
    """With trainer.ema_decay, the export is the moving average of the policies of every step
    (recomputed here from the per-version snapshots and the base policy), and the final
    evaluation ran on it, published to the generators as the version after the last step."""
    from safetensors.numpy import load_file

    from rl_jax.orchestrator.snapshots import list_snapshots
    from rl_jax.trainer.state import ema_decay_at

    workdir = tmp_path / "ema"
    result = launch(workdir, "--config.mode=sync", "--config.trainer.steps=4",
                    "--config.trainer.ema_decay=0.5", "--config.export.every=1",
                    base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_version"] == 5
    assert summary["final_weights"] == "average (ema_decay=0.5, 4 updates)"
    snapshots = list_snapshots(workdir)
    assert [meta["version"] for meta, _ in snapshots] == [1, 2, 3, 4]
    average = {k: v.astype(np.float64) for k, v in
               load_file(base_policy / "model.safetensors").items()}
    for n, (_, path) in enumerate(snapshots):
        decay = ema_decay_at(0.5, n)
        policy = load_file(path / "model.safetensors")
        average = {k: decay * average[k] + (1 - decay) * policy[k] for k in average}
    exported = load_file(workdir / "hf/model.safetensors")
    last = load_file(snapshots[-1][1] / "model.safetensors")
    assert any(not np.allclose(exported[k], last[k], atol=1e-6) for k in exported)
    for k in exported:
        np.testing.assert_allclose(exported[k], average[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_ema_decay_follows_the_first_updates():
    from rl_jax.trainer.state import ema_decay_at
    assert [round(ema_decay_at(0.95, n), 4) for n in (0, 1, 10, 100, 1000)] == [
        0.1, 0.1818, 0.55, 0.9182, 0.95]
    assert ema_decay_at(0.0, 5) == 0.0
    with pytest.raises(ValueError, match="EMA decay must be in"):
        ema_decay_at(1.0, 0)


def test_sync_resume_after_kill_repeats_the_losses(base_policy, tmp_path):
    """Sync mode is deterministic (seeded sampling, batches in prompt order): a run killed with
    SIGKILL after its step-2 checkpoint and started again with the same command samples the
    same tokens and trains steps 3 and 4 with the losses of a run that was never interrupted."""
    flags = ("--config.mode=sync", "--config.trainer.steps=4", "--config.checkpoint.every=2",
             "--config.checkpoint.use_async=False")
    reference = tmp_path / "reference"
    result = launch(reference, *flags, base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    workdir = tmp_path / "killed"
    process = launch(workdir, *flags, base=base_policy, wait=False)
    deadline = time.monotonic() + 300
    try:
        while 3 not in train_records(workdir):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # trainer and its generator servers
        process.wait()
    result = launch(workdir, *flags, base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    want, got = train_records(reference), train_records(workdir)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        # The same tokens were sampled and rewarded ...
        for key in ("reward/mean", "reward/std", "rollout/accuracy", "loss/tokens"):
            assert got[step][key] == want[step][key], (step, key)
        # ... and trained on with the same loss. The behaviour log-probs the server returns are
        # rounded differently when its batch is composed differently (float32), so the loss
        # (near 0: advantages have mean 0) agrees to float32 rounding, not bit for bit.
        assert abs(got[step]["loss/loss"] - want[step]["loss/loss"]) < 1e-6, step
        assert got[step]["loss/grad_norm"] == pytest.approx(want[step]["loss/grad_norm"],
                                                            rel=1e-5), step
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 4


def test_time_limit_stop_and_resume_train_every_prompt_once(base_policy, tmp_path):
    """Async mode stopped by its time limit mid-run, when the next batch has usually been taken
    ahead (prefetched) already: the checkpoint keeps every admitted prompt that was not
    trained, and the resumed run trains each of them, none twice. (With max_lag 2, every group
    is trained within 3 steps of its admission, so 3 steps after the resume cover them all.)"""
    workdir = tmp_path / "stopped"
    flags = ("--config.trainer.steps=40", "--config.rollout.max_lag=2",
             "--config.checkpoint.use_async=False")
    result = launch(workdir, *flags, "--config.trainer.time_limit_s=1.0", base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = train_records(workdir)
    assert 1 <= len(first) <= 37, sorted(first)
    latest = max(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
    assert latest == len(first)
    meta = json.loads((workdir / "checkpoints" / str(latest) / "metadata" / "metadata")
                      .read_text())
    pending = meta["rollout"]["pending"]
    assert pending and len(pending) == len(set(pending))
    trained_first = {p for r in first.values() for p in r["rollout/prompts"]}
    assert not trained_first & set(pending)

    result = launch(workdir, *flags, base=base_policy)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = train_records(workdir)
    assert sorted(steps) == list(range(1, 41))
    later = [p for step in range(latest + 1, 41) for p in steps[step]["rollout/prompts"]]
    assert len(later) == len(set(later)) and not trained_first & set(later)
    assert set(pending) <= set(later), sorted(set(pending) - set(later))
    # Every prompt admitted before the stop (positions below next_position) was trained.
    admitted = set(range(meta["rollout"]["next_position"]))
    assert admitted <= trained_first | set(later), sorted(admitted - trained_first - set(later))


def test_a_dead_generator_server_is_restarted(base_policy, tmp_path):
    """Killing the only generator server mid-run: it is restarted, pulls the current weights,
    and the run finishes every step without losing a prompt."""
    workdir = tmp_path / "fault"
    process = launch(workdir, "--config.trainer.steps=8", base=base_policy, wait=False)
    deadline = time.monotonic() + 300
    try:
        while 2 not in train_records(workdir):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        killed = subprocess.run(["pkill", "-KILL", "-f",
                                 f"rl_jax.generator.server.serve.*{base_policy}"])
        assert killed.returncode == 0
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, out[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 8 and sum(summary["generator_restarts"].values()) == 1
    assert summary["final_version"] == 8
    assert summary.get("rollout/skipped_prompts", 0) == 0


@pytest.mark.parametrize("override, message", [
    ({"rollout.max_lag": -1}, "rollout.max_lag must be an integer >= 0"),
    ({"mode": "fast"}, "mode must be one of"),
    ({"rollout.group_size": 1}, "rollout.group_size must be >= 2"),
    ({"loss.name": "ppo2"}, "loss.name must be one of"),
    ({"loss.options": ConfigDict({"epsilon": 0.1})}, "loss.options"),
    ({"trainer.steps": 0}, "trainer.steps must be an integer >= 1"),
    ({"eval.concurrency": 0}, "eval.concurrency must be an integer >= 1"),
    ({"generator.urls": ("localhost:30000",)}, "generator.urls must be http(s) URLs"),
    ({"rollout.rows_per_batch": 12, "trainer.micro_batch_rows": 8},
     "rollout.rows_per_batch=12 is not divisible by trainer.micro_batch_rows=8"),
    ({"trainer.num_microbatches": 2}, "exclude each other"),
    ({"generator.data_parallel": 0}, "generator.data_parallel must be an integer >= 1"),
    ({"generator.decode_steps": 0}, "generator.decode_steps must be an integer >= 1"),
    ({"cpus.generators_nice": -5}, "cpus.generators_nice must be an integer from 0"),
    ({"cpus.generators_nice": 20}, "cpus.generators_nice must be an integer from 0"),
    ({"export.every": -1}, "export.every must be an integer >= 0"),
    ({"trainer.ema_decay": 1.0}, "trainer.ema_decay must be in [0, 1)"),
    ({"trainer.ema_decay": -0.1}, "trainer.ema_decay must be in [0, 1)"),
    ({"generator.data_parallel": 3},
     "generator.max_slots=64 does not split evenly over generator.data_parallel=3"),
])
def test_static_config_checks(override, message):
    from rl_jax.orchestrator.config import validate
    from rl_jax.recipe.schema import RLConfigError
    c = _load(ROOT / "configs/tiny_rl.py")
    for key, value in override.items():
        block, _, name = key.rpartition(".")
        target = c[block] if block else c
        with target.unlocked() if hasattr(target, "unlocked") else c.unlocked():
            target[name] = value
    with pytest.raises(RLConfigError, match=re.escape(message)):
        validate(c)


@pytest.mark.parametrize("flag, message", [
    ("--config.rollout.max_lag=-1", "rollout.max_lag must be an integer >= 0"),
    ("--config.rollout.rows_per_batch=3", "not divisible"),
    ("--config.rollout.seq_len=8", "rollout.seq_len=8 is shorter than the longest sample"),
    ("--config.generator.urls=('http://127.0.0.1:9',)", "unreachable"),
    ("--config.rollout.nonsense=1", "nonsense"),
    ("--config.cpus.rollout=99", "cpus.rollout='99': CPU cores [99] do not exist here"),
])
def test_bad_configs_stop_at_start_with_one_line(base_policy, tmp_path, flag, message):
    """From the command line: one line on stderr, no traceback, before any generation."""
    extra = (("--config.trainer.micro_batch_rows=0", "--config.trainer.num_microbatches=2")
             if "rows_per_batch" in flag else ())
    result = launch(tmp_path / "bad", flag, *extra, base=base_policy, timeout=180)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_realistic_recipes_are_complete():
    """The GPU/TPU recipes load, validate, and name every block the run reads."""
    from rl_jax.orchestrator.config import validate
    sys.path.insert(0, str(ROOT))
    reference = _load(ROOT / "configs/tiny_rl.py")
    recipes = sorted((ROOT / "configs").glob("qwen*.py"))
    assert recipes
    for path in recipes:
        c = _load(path)
        validate(c)
        assert c.recipe == "rl" and c.base.checkpoint
        assert c.generator.kind == "sglang"
        _same_keys(reference, c, path.name)


def _load(path: Path) -> ConfigDict:
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _same_keys(reference: ConfigDict, c: ConfigDict, name: str, prefix: str = ""):
    for key, value in reference.items():
        assert key in c, f"{name} lacks {prefix}{key}"
        if isinstance(value, ConfigDict) and key not in ("kwargs", "options", "shape"):
            _same_keys(value, c[key], name, f"{prefix}{key}.")


def test_two_trainer_processes_share_one_mesh(base_policy, tmp_path):
    """launch.trainer on two processes (4 host devices each, one (1, 8, 1) mesh) with a
    generator server given by URL: process 0 drives the rollout and publishes, both train.
    (The tiny vocabulary of 15 tokens cannot be split over a tensor axis.) The server is keyed
    (API and admin keys from its environment); the trainers read the keys from files."""
    from rl_jax.generator.launcher.pool import free_port
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    keys = {"RL_JAX_API_KEY": "api-" + os.urandom(16).hex(),
            "RL_JAX_ADMIN_API_KEY": "admin-" + os.urandom(16).hex()}
    # The publisher's token, shared by the trainers and the server they did not start.
    env["RL_JAX_TRANSFER_TOKEN"] = "transfer-" + os.urandom(16).hex()
    (tmp_path / "api").write_text(keys["RL_JAX_API_KEY"])
    (tmp_path / "admin").write_text(keys["RL_JAX_ADMIN_API_KEY"])
    key_files = [f"--config.generator.auth.api_key_file={tmp_path / 'api'}",
                 f"--config.generator.auth.admin_api_key_file={tmp_path / 'admin'}"]
    # The server pulls only from the publisher it is started with (its transfer token is bound
    # to it): process 0's, on a port chosen here.
    publisher_port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "launch.generator_server", f"--model={base_policy}", "--port=0",
         "--max_seq_len=64", "--max_slots=32", f"--parent_pid={os.getpid()}",
         f"--publisher_url=http://127.0.0.1:{publisher_port}", "--nopull_on_start"],
        cwd=ROOT, env={**env, **keys}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        url = None
        for line in server.stdout:
            match = re.search(r"ready at (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "the generator server did not start"
        port = free_port()
        workdir = tmp_path / "mp"
        procs = [subprocess.Popen(
            [sys.executable, "-m", "launch.trainer", "--config=configs/tiny_rl.py",
             f"--workdir={workdir}", f"--coordinator=127.0.0.1:{port}", "--num_processes=2",
             f"--process_id={i}", f"--generator_urls={url}", *SMALL,
             f"--config.base.checkpoint={base_policy}", "--config.trainer.steps=3",
             "--config.mesh.fsdp=8", "--config.mesh.tensor=1",
             "--config.trainer.micro_batch_rows=8",
             f"--config.transfer.port={publisher_port}", *key_files],
            cwd=ROOT, env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-3000:]
        assert outputs[0].strip().splitlines()[-1].startswith("held-out accuracy: ")
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["final_version"] == 3
        assert sorted(train_records(workdir)) == [1, 2, 3]
        for key in keys.values():
            assert not any(key in out for out in outputs)
        # Without the keys a trainer stops at once: the server refuses it.
        refused = subprocess.run(
            [sys.executable, "-m", "launch.trainer", "--config=configs/tiny_rl.py",
             f"--workdir={tmp_path / 'refused'}", f"--generator_urls={url}", *SMALL,
             f"--config.base.checkpoint={base_policy}", "--config.trainer.steps=1"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and "Traceback" not in refused.stderr
        assert "refused this run's API key (HTTP 401)" in refused.stderr.strip().splitlines()[-1]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_a_named_shape_without_checkpoint_starts_from_random_weights(tmp_path):
    """model.shape names a shape (rl_jax.models.shapes) and no base checkpoint is given: the run
    writes random weights of that shape with a byte-level tokenizer and trains from them."""
    from rl_jax.models.hf import read_config
    from rl_jax.models.shapes import shape

    workdir = tmp_path / "shaped"
    result = launch(workdir, "--config.model.shape=tiny", "--config.base.lm_config=",
                    "--config.mode=sync", "--config.trainer.steps=2",
                    "--config.generator.max_seq_len=96", "--config.rollout.seq_len=96")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_config(workdir / "base/hf") == shape("tiny")
    assert read_config(workdir / "hf") == shape("tiny")
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["parameters"] == shape("tiny").num_params()
    result = launch(tmp_path / "bad", "--config.model.shape=gpt-5", "--config.base.lm_config=",
                    timeout=180)
    assert result.returncode != 0
    assert "model.shape: unknown model shape 'gpt-5'" in result.stderr.strip().splitlines()[-1]


# A run on random weights of the tiny shape (no base policy): a few seconds per step.
TINY = ["--config.model.shape=tiny", "--config.base.lm_config=", "--config.mode=sync",
        "--config.generator.max_seq_len=96", "--config.rollout.seq_len=96"]


def launch_with_small_tmpfs(workdir: Path, mountpoint: str, *flags: str
                            ) -> subprocess.CompletedProcess:
    """``launch`` in a mount namespace of its own where ``mountpoint`` is a 64 KiB tmpfs, far
    too small for a version of the tiny shape (~0.5 MB): the host's mounts are untouched."""
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_rl.py",
           f"--workdir={workdir}", *SMALL, *TINY, *flags]
    script = f'mount -t tmpfs -o size=64k tmpfs "{mountpoint}" && exec "$@"'
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", *cmd], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def _can_mount_a_tmpfs() -> str | None:
    probe = subprocess.run(["unshare", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()}"


def test_a_full_dev_shm_stops_the_run_with_one_line_and_keeps_its_checkpoint(tmp_path):
    """The weights of a version find no room in /dev/shm (a 64 KiB tmpfs over it) and no
    transport to fall back to: the run stops with one line naming the directory, the bytes and
    the checkpoint kept (no traceback); resumed with room, it continues from that checkpoint."""
    if (problem := _can_mount_a_tmpfs()) is not None:
        pytest.skip(problem)
    workdir = tmp_path / "run"
    result = launch(workdir, *TINY, "--config.trainer.steps=2", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checkpoints = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    assert checkpoints[-1] == "2", checkpoints
    # Resumed with a full /dev/shm: version 2 cannot be staged for the fresh server.
    result = launch_with_small_tmpfs(workdir, "/dev/shm", "--config.trainer.steps=4")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: StagingSpaceStop: version 2 could not be staged"), last
    assert "/dev/shm/" in last and "bytes free" in last and "transfer.staging_dir" in last, last
    assert f"its last checkpoint (step 2, in {workdir / 'checkpoints'}) is kept" in last, last
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == checkpoints
    # With room again it resumes from step 2 and finishes.
    result = launch(workdir, *TINY, "--config.trainer.steps=4", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(train_records(workdir)) == [1, 2, 3, 4]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 4


def test_a_full_staging_dir_falls_back_to_disk(tmp_path):
    """transfer.staging_dir names a directory without room, and `disk` is among the
    transports: every version goes over disk instead, and the run completes."""
    if (problem := _can_mount_a_tmpfs()) is not None:
        pytest.skip(problem)
    staging = tmp_path / "staging"
    staging.mkdir()
    workdir = tmp_path / "run"
    result = launch_with_small_tmpfs(workdir, str(staging), "--config.trainer.steps=2",
                                     f"--config.transfer.staging_dir={staging}",
                                     "--config.transfer.transports=('shm', 'disk')")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert "offering version 1 over ['disk'] instead" in result.stderr, result.stderr[-3000:]
    assert json.loads((workdir / "summary.json").read_text())["final_version"] == 2
    result = launch(tmp_path / "bad", *TINY, "--config.transfer.staging_dir=/nonexistent/dir",
                    timeout=180)
    assert result.returncode == 2
    assert ("transfer.staging_dir='/nonexistent/dir' is not a writable directory"
            in result.stderr.strip().splitlines()[-1]), result.stderr[-2000:]
