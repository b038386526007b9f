"""Checks of an RL recipe config and the settings derived from it.

Everything a run can know before starting a process is checked here, so a bad config stops at
start with one :class:`RLConfigError` naming the problem.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

MODES = ("async", "one_step_off", "sync")


class RLConfigError(ValueError):
    """An RL recipe config that cannot run."""


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """How a mode drives the shared code path.

    Attributes:
      max_lag: the staleness bound the rollout gate enforces (sync 0, one_step_off 1).
      update_when_idle: apply new weights only once the generators have no admitted work
        (batch boundaries), instead of in flight between two decode steps.
      wait_for_update: the trainer waits until the generators run the new weights before it
        asks for the next batch (sync).
    """

    mode: str
    max_lag: int
    update_when_idle: bool
    wait_for_update: bool


def mode_settings(c: ml_collections.ConfigDict) -> ModeSettings:
    if c.mode == "async":
        return ModeSettings("async", int(c.rollout.max_lag), False, False)
    if c.mode == "one_step_off":
        return ModeSettings("one_step_off", 1, True, False)
    if c.mode == "sync":
        return ModeSettings("sync", 0, True, True)
    raise RLConfigError(f"mode must be one of {MODES}, got {c.mode!r}")


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RLConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise RLConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def max_new_tokens(c: ml_collections.ConfigDict) -> int:
    """Most completion tokens of one sample."""
    r = c.rollout
    return int(r.lengths.max) if r.lengths.sigma else int(r.max_new_tokens)


def max_sample_tokens(prompt_tokens: int, c: ml_collections.ConfigDict) -> int:
    """Most tokens one sample can have: prompt plus the completion limit."""
    return prompt_tokens + max_new_tokens(c)


def rows_per_batch(c: ml_collections.ConfigDict, max_prompt_tokens: int, row_multiple: int) -> int:
    """Rows of a packed training batch: ``rollout.rows_per_batch`` (checked to be a multiple of
    ``row_multiple``, batch shards × micro-batches), or 0: sized to each batch's samples
    (``rl_jax.rollout.records.bucket_rows``)."""
    r = c.rollout
    rows = int(r.rows_per_batch)
    longest = max_sample_tokens(max_prompt_tokens, c)
    if longest > r.seq_len:
        raise RLConfigError(
            f"rollout.seq_len={r.seq_len} is shorter than the longest sample (prompt "
            f"{max_prompt_tokens} + completion {max_new_tokens(c)} tokens)")
    if rows % row_multiple:
        raise RLConfigError(f"rollout.rows_per_batch={rows} is not divisible by {row_multiple} "
                            "(the mesh's batch shards × trainer.num_microbatches)")
    return rows


def validate(c: ml_collections.ConfigDict) -> ModeSettings:
    """Static checks (no files, processes or network); returns the mode's settings."""
    settings = mode_settings(c)
    r = c.rollout
    if c.mode == "async":
        _int("rollout.max_lag", r.max_lag, 0)
    _int("rollout.group_size", r.group_size, 1)
    _int("rollout.groups_per_batch", r.groups_per_batch, 1)
    _int("rollout.max_new_tokens", r.max_new_tokens, 1)
    _int("rollout.seq_len", r.seq_len, 2)
    _int("rollout.rows_per_batch", r.rows_per_batch, 0)
    _int("rollout.max_retries", r.max_retries, 1)
    if r.lengths.sigma < 0 or (r.lengths.sigma and (r.lengths.median <= 0 or
                                                   r.lengths.max < 1)):
        raise RLConfigError("rollout.lengths needs sigma >= 0 and, when sigma > 0, median > 0 "
                            f"and max >= 1; got {r.lengths.to_dict()}")
    if r.advantage in ("grpo", "rloo", "dr_grpo") and r.group_size < 2:
        raise RLConfigError(f"rollout.advantage={r.advantage!r} compares samples of one prompt: "
                            f"rollout.group_size must be >= 2, got {r.group_size}")
    if r.temperature < 0:
        raise RLConfigError(f"rollout.temperature must be >= 0, got {r.temperature}")
    if r.staleness_policy not in ("prevent", "drop"):
        raise RLConfigError(f"rollout.staleness_policy must be 'prevent' or 'drop', got "
                            f"{r.staleness_policy!r}")
    _int("trainer.steps", c.trainer.steps, 1)
    _int("trainer.num_microbatches", c.trainer.num_microbatches, 1)
    _int("trainer.micro_batch_rows", c.trainer.get("micro_batch_rows", 0), 0)
    if c.trainer.get("micro_batch_rows", 0) and c.trainer.num_microbatches != 1:
        raise RLConfigError("trainer.micro_batch_rows (fixed-shape micro-batches) and "
                            "trainer.num_microbatches > 1 exclude each other; set one")
    if c.trainer.get("micro_batch_rows", 0) and r.rows_per_batch % c.trainer.micro_batch_rows:
        raise RLConfigError(f"rollout.rows_per_batch={r.rows_per_batch} is not divisible by "
                            f"trainer.micro_batch_rows={c.trainer.micro_batch_rows}")
    if c.trainer.time_limit_s < 0:
        raise RLConfigError(f"trainer.time_limit_s must be >= 0, got {c.trainer.time_limit_s}")
    _positive("optimizer.learning_rate", c.optimizer.learning_rate)
    from rl_jax.trainer.state import SCHEDULE_CLOCKS
    schedule_on = c.optimizer.get("schedule_on", "steps")
    if schedule_on not in SCHEDULE_CLOCKS:
        raise RLConfigError(f"optimizer.schedule_on must be one of {SCHEDULE_CLOCKS}, got "
                            f"{schedule_on!r}")
    if not c.optimizer.get("final_lr_ratio", 0.1) >= 0:
        raise RLConfigError("optimizer.final_lr_ratio must be >= 0, got "
                            f"{c.optimizer.final_lr_ratio}")
    if not c.trainer.get("ess_lr_power", 0.0) >= 0:
        raise RLConfigError(f"trainer.ess_lr_power must be >= 0, got {c.trainer.ess_lr_power}")
    if not 0.0 <= c.trainer.get("ema_decay", 0.0) < 1.0:
        raise RLConfigError(f"trainer.ema_decay must be in [0, 1) (0: off), got "
                            f"{c.trainer.ema_decay}")
    if c.trainer.get("step_delay_s", 0.0) < 0:
        raise RLConfigError(f"trainer.step_delay_s must be >= 0, got {c.trainer.step_delay_s}")
    g = c.generator
    if g.kind not in ("rl_jax", "sglang"):
        raise RLConfigError(f"generator.kind must be 'rl_jax' or 'sglang', got {g.kind!r}")
    if not g.urls:
        _int("generator.num_servers", g.num_servers, 1)
    for url in g.urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RLConfigError(f"generator.urls must be http(s) URLs, got {url!r}")
    _int("generator.max_slots", g.max_slots, 1)
    for name in ("tensor_parallel", "data_parallel", "decode_steps"):
        if name in g:
            _int(f"generator.{name}", g[name], 1)
    if g.max_slots % g.get("data_parallel", 1):
        raise RLConfigError(f"generator.max_slots={g.max_slots} does not split evenly over "
                            f"generator.data_parallel={g.data_parallel} replicas")
    _check_auth(g.get("auth"))
    if "cpus" in c and "generators_nice" in c.cpus:
        from rl_jax.generator.launcher import LaunchError, check_nice
        try:
            check_nice(c.cpus.generators_nice, "cpus.generators_nice")
        except LaunchError as e:
            raise RLConfigError(str(e)) from None
    _int("eval.examples", c.eval.examples, 0)
    _int("eval.every", c.eval.every, 0)
    if "concurrency" in c.eval:
        _int("eval.concurrency", c.eval.concurrency, 1)
    _int("checkpoint.every", c.checkpoint.every, 1)
    if "every" in c.export:
        _int("export.every", c.export.every, 0)
    _int("logging.every", c.logging.every, 1)
    if c.loss.name not in _loss_names():
        raise RLConfigError(f"loss.name must be one of {_loss_names()}, got {c.loss.name!r}")
    from rl_jax.losses import LossConfigError, make_config
    try:
        make_config(c.loss.name, **c.loss.options.to_dict())
    except (LossConfigError, TypeError) as e:
        raise RLConfigError(f"loss.options: {e}") from None
    from rl_jax.losses import ADVANTAGE_ESTIMATORS
    if r.advantage not in ADVANTAGE_ESTIMATORS:
        raise RLConfigError(f"rollout.advantage must be one of {sorted(ADVANTAGE_ESTIMATORS)}, "
                            f"got {r.advantage!r}")
    from rl_jax import envs
    if c.env.name not in envs.names():
        raise RLConfigError(f"env.name must be one of {envs.names()}, got {c.env.name!r}")
    return settings


AUTH_SETTINGS = ("api_key_file", "admin_api_key_file", "generate_keys")


def _check_auth(auth: Any) -> None:
    """``generator.auth`` names key files (never keys: a config is saved and logged)."""
    if auth is None:
        return
    unknown = sorted(set(auth.keys()) - set(AUTH_SETTINGS))
    if unknown:
        raise RLConfigError(f"generator.auth has unknown settings {unknown} (known: "
                            f"{list(AUTH_SETTINGS)}); keys come from files or the environment "
                            "(RL_JAX_API_KEY, RL_JAX_ADMIN_API_KEY), never from the config")
    for name in AUTH_SETTINGS[:2]:
        if not isinstance(auth.get(name, ""), str):
            raise RLConfigError(f"generator.auth.{name} must be a file path or \"\", got "
                                f"{type(auth.get(name)).__name__}")
    if not isinstance(auth.get("generate_keys", False), bool):
        raise RLConfigError("generator.auth.generate_keys must be true or false, got "
                            f"{auth.get('generate_keys')!r}")


def _loss_names() -> tuple[str, ...]:
    from rl_jax.losses import names
    return names()
