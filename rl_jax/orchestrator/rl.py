"""The RL run: trainer, generator pool, weight transfer and rollout pipeline wired together.

    trainer (this process, its mesh) ──publish──► Publisher ──pull──► generator servers
          ▲                                                             │ (own processes)
          └── PolicyBatch ◄── GroupsToBatch ◄── RolloutIterator ◄───────┘ completions
                                                 (staleness gate, env rewards)

One code path for the three modes (:mod:`rl_jax.orchestrator.config`): the mode only sets the
staleness bound, when new weights reach the servers (in flight or at batch boundaries) and
whether the trainer waits for them.

Generator servers can join and leave while the run goes on, through the weight publisher's
control server or an ``sglang-router``'s worker list (:mod:`rl_jax.orchestrator.fleet`).

Outputs in ``workdir``: ``checkpoints/`` (trainer state + rollout state, resumable by running
the same command again), ``metrics.jsonl``, ``tb/`` (TensorBoard), ``summary.json``,
``progress.png`` (reward and accuracy against wall time), ``hf/`` (the final policy),
``generators/`` (server logs). The last line printed is ``held-out accuracy: BEFORE -> AFTER``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rl_jax.orchestrator.config import mode_settings
from rl_jax.recipe.checks import apply_overrides, load_recipe_file, parse, replace_fields
from rl_jax.recipe.schema import RLConfigError, RLRecipe

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


def ensure_base_checkpoint(c: Any, workdir: Path) -> Path:
    """The HF directory of the starting policy, training it first when the recipe ``c`` (an
    :class:`RLRecipe` or its ConfigDict) says so."""
    c = parse(c)
    if c.distributed.num_processes > 1 and not c.base.checkpoint:
        raise RLConfigError("a multi-process trainer needs base.checkpoint (an HF directory "
                            "every process can read)")
    if c.base.checkpoint:
        path = Path(c.base.checkpoint).expanduser()
        if not (path / "config.json").is_file():
            raise RLConfigError(f"base.checkpoint={c.base.checkpoint} is not an HF checkpoint "
                                "directory (no config.json)")
        return path.absolute()
    if isinstance(c.model.shape, str) and c.model.shape:
        return random_base(c.model.shape, workdir, dtype=c.model.param_dtype)
    if not c.base.lm_config:
        raise RLConfigError("set base.checkpoint (an HF directory) or base.lm_config")
    base = workdir / "base"
    hf = base / "hf"
    if (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file():
        return hf
    train_base_policy(c.base.lm_config, c.base.lm_overrides, base)
    if not (hf / "config.json").is_file():
        raise RLConfigError(f"training the base policy with {c.base.lm_config} wrote no "
                            f"{hf / 'config.json'}")
    return hf


def train_base_policy(lm_config: str, overrides: tuple[str, ...], workdir: Path) -> None:
    """Trains the supervised recipe file ``lm_config`` with ``overrides`` (``"key=value"``, as
    ``--config.key=value`` would set them) into ``workdir``, in this process: the function
    ``python -m launch.train`` calls for recipe "lm" (:func:`rl_jax.trainer.lm.run`). It runs
    before this process joins a multi-process mesh or pins its cores, on the same devices."""
    path = Path(lm_config)
    if not path.is_file():
        raise RLConfigError(f"base.lm_config={lm_config} does not exist")
    config = load_recipe_file(path)
    apply_overrides(config, overrides, what="base.lm_overrides")
    if config.get("recipe") != "lm":
        raise RLConfigError(f"base.lm_config={lm_config} is not a supervised (recipe 'lm') "
                            f"recipe, it has recipe {config.get('recipe')!r}")
    print(f"no base policy yet: training it with {path} into {workdir}", flush=True)
    from rl_jax.trainer import lm
    lm.run(config, str(workdir))


def cpu_placement_off_cpu(c: RLRecipe, backend: str | None = None) -> RLRecipe:
    """Core pinning and the servers' nice level (``c.cpus``) place CPU pools: on an
    accelerator backend they would only confine the host threads that feed the chips, so they
    are switched off there (one warning names them). Returns the recipe with them off (``c``
    itself when nothing was switched off)."""
    import jax
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return c
    placed = {k: getattr(c.cpus, k) for k in ("trainer", "generators", "rollout",
                                               "generators_nice") if getattr(c.cpus, k)}
    if not placed:
        return c
    log.warning("cpus.%s apply to pools on CPUs; the trainer runs on %s, so they are ignored",
                ", cpus.".join(f"{k}={v!r}" for k, v in placed.items()), backend)
    return replace_fields(c, {f"cpus.{key}": 0 if key == "generators_nice" else ""
                              for key in placed})


# ---- the run ------------------------------------------------------------------------------------

def run(c: Any, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) the RL recipe ``c`` (an :class:`RLRecipe` or its ConfigDict, checked
    here) in ``workdir``; returns the summary it writes."""
    c = parse(c)
    settings = mode_settings(c)
    workdir_path = Path(workdir).absolute()
    workdir_path.mkdir(parents=True, exist_ok=True)
    # Joined before anything asks JAX for its backend (cpu_placement_off_cpu, a base policy's
    # training do); what JAX's cluster detection found becomes the recipe's.
    from rl_jax import distributed
    d = c.distributed
    distributed.initialize(d.coordinator, d.num_processes, d.process_id)
    if d.coordinator == distributed.AUTO:
        import jax
        c = replace_fields(c, {"distributed.num_processes": jax.process_count(),
                               "distributed.process_id": jax.process_index()})
        distributed.remember(c.distributed.coordinator, c.distributed.num_processes,
                             c.distributed.process_id)
    base_dir = ensure_base_checkpoint(c, workdir_path)
    c = cpu_placement_off_cpu(c)
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
    if c.cpus.rollout:
        from rl_jax import cpus
        try:
            cpus.existing_cores(c.cpus.rollout)
        except ValueError as e:
            raise RLConfigError(f"cpus.rollout={c.cpus.rollout!r}: {e}") from None
    from rl_jax.orchestrator.session import Session
    with Session(c, settings, workdir_path, base_dir) as session:
        return session.run()
