"""The RL run: trainer, generator pool, weight transfer and rollout pipeline wired together.

    trainer (this process, its mesh) ──publish──► Publisher ──pull──► generator servers
          ▲                                                             │ (own processes)
          └── PolicyBatch ◄── GroupsToBatch ◄── RolloutIterator ◄───────┘ completions
                                                 (staleness gate, env rewards)

One code path for the three modes (:mod:`rl_jax.orchestrator.config`): the mode only sets the
staleness bound, when new weights reach the servers (in flight or at batch boundaries) and
whether the trainer waits for them.

Outputs in ``workdir``: ``checkpoints/`` (trainer state + rollout state, resumable by running
the same command again), ``metrics.jsonl``, ``tb/`` (TensorBoard), ``summary.json``,
``progress.png`` (reward and accuracy against wall time), ``hf/`` (the final policy),
``generators/`` (server logs). The last line printed is ``held-out accuracy: BEFORE -> AFTER``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_collections

from rl_jax.orchestrator.config import RLConfigError, validate

log = logging.getLogger(__name__)


# ---- the base policy ----

def random_base(name: str, workdir: Path, *, dtype: str = "float32") -> Path:
    """``model.shape="qwen2.5-0.5b"`` (a name of :mod:`rl_jax.models.shapes`) without a
    checkpoint: the run starts from random weights of that shape, written once to
    ``workdir/base/hf`` with a byte-level tokenizer covering the vocabulary (for measuring
    real shapes, not for learning)."""
    from rl_jax.models.config import ConfigError
    from rl_jax.models.shapes import shape, write_random_checkpoint
    try:
        cfg = shape(name)
    except ConfigError as e:
        raise RLConfigError(f"model.shape: {e}") from None
    hf = workdir / "base" / "hf"
    if (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file():
        from rl_jax.models.hf import read_config
        if read_config(hf) == cfg:
            return hf
    print(f"no base policy: random weights of the {name} shape into {hf}", flush=True)
    write_random_checkpoint(cfg, hf, dtype=dtype)
    return hf


def ensure_base_checkpoint(c: ml_collections.ConfigDict, workdir: Path) -> Path:
    """The HF directory of the starting policy, training it first when the config says so."""
    if c.distributed.num_processes > 1 and not c.base.checkpoint:
        raise RLConfigError("a multi-process trainer needs base.checkpoint (an HF directory "
                            "every process can read)")
    if c.base.checkpoint:
        path = Path(c.base.checkpoint).expanduser()
        if not (path / "config.json").is_file():
            raise RLConfigError(f"base.checkpoint={c.base.checkpoint} is not an HF checkpoint "
                                "directory (no config.json)")
        return path.absolute()
    named = c.get("model", {}).get("shape")
    if isinstance(named, str) and named:
        return random_base(named, workdir, dtype=c.model.get("param_dtype", "float32"))
    if not c.base.lm_config:
        raise RLConfigError("set base.checkpoint (an HF directory) or base.lm_config")
    base = workdir / "base"
    hf = base / "hf"
    if (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file():
        return hf
    lm_config = Path(c.base.lm_config)
    if not lm_config.is_file():
        raise RLConfigError(f"base.lm_config={c.base.lm_config} does not exist")
    cmd = [sys.executable, "-m", "launch.train", f"--config={lm_config}", f"--workdir={base}",
           *(f"--config.{o}" for o in c.base.lm_overrides)]
    print(f"no base policy yet: training it with {lm_config} into {base}", flush=True)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0 or not (hf / "config.json").is_file():
        raise RLConfigError(f"training the base policy failed ({' '.join(cmd)} exited with "
                            f"{result.returncode})")
    return hf


def cpu_placement_off_cpu(c: ml_collections.ConfigDict, backend: str | None = None) -> bool:
    """Core pinning and the servers' nice level (``c.cpus``) place CPU pools: on an
    accelerator backend they would only confine the host threads that feed the chips, so they
    are switched off there (one warning names them). Returns whether anything was switched off.
    """
    import jax
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return False
    placed = {k: c.cpus[k] for k in ("trainer", "generators", "rollout", "generators_nice")
              if c.cpus.get(k)}
    if not placed:
        return False
    log.warning("cpus.%s apply to pools on CPUs; the trainer runs on %s, so they are ignored",
                ", cpus.".join(f"{k}={v!r}" for k, v in placed.items()), backend)
    for key in placed:
        c.cpus[key] = 0 if key == "generators_nice" else ""
    return True


# ---- the run ------------------------------------------------------------------------------------

def run(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the RL recipe ``c`` in ``workdir``; returns the summary it writes."""
    settings = validate(c)
    workdir_path = Path(workdir).absolute()
    workdir_path.mkdir(parents=True, exist_ok=True)
    base_dir = ensure_base_checkpoint(c, workdir_path)
    # Joined before anything asks JAX for its backend (cpu_placement_off_cpu does).
    from rl_jax import distributed
    distributed.initialize(c.distributed.coordinator, c.distributed.num_processes,
                           c.distributed.process_id)
    cpu_placement_off_cpu(c)
    if c.cpus.trainer:
        from rl_jax import cpus
        try:
            cpus.pin(c.cpus.trainer)
        except (ValueError, OSError) as e:
            raise RLConfigError(f"cpus.trainer={c.cpus.trainer!r}: {e}") from None
    if c.cpus.generators and not c.generator.urls:
        from rl_jax import cpus
        try:
            cpus.parse_cores(c.cpus.generators)
        except ValueError as e:
            raise RLConfigError(f"cpus.generators={c.cpus.generators!r}: {e}") from None
    if c.cpus.get("rollout"):
        from rl_jax import cpus
        try:
            cpus.existing_cores(c.cpus.rollout)
        except ValueError as e:
            raise RLConfigError(f"cpus.rollout={c.cpus.rollout!r}: {e}") from None
    from rl_jax.orchestrator.session import Session
    with Session(c, settings, workdir_path, base_dir) as session:
        return session.run()
