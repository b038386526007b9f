"""The settings an RL recipe's mode implies, and the checks that need what a run knows only
once it has started (its prompts, its mesh).

Every field of the recipe is checked once, by :func:`rl_jax.recipe.checks.parse` (:func:`validate`
here calls it), so a bad config stops at start with one :class:`RLConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_jax.recipe.checks import parse
from rl_jax.recipe.schema import MODES, RLConfigError, RLRecipe



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


def mode_settings(c: RLRecipe) -> ModeSettings:
    """The settings of ``c.mode`` (checked by :func:`rl_jax.recipe.checks.parse`)."""
    if c.mode == "async":
        return ModeSettings("async", int(c.rollout.max_lag), False, False)
    if c.mode == "one_step_off":
        return ModeSettings("one_step_off", 1, True, False)
    if c.mode == "sync":
        return ModeSettings("sync", 0, True, True)
    raise RLConfigError(f"mode must be one of {MODES}, got {c.mode!r}")


def max_new_tokens(c: RLRecipe) -> int:
    """Most completion tokens of one sample."""
    r = c.rollout
    return int(r.lengths.max) if r.lengths.sigma else int(r.max_new_tokens)


def max_sample_tokens(prompt_tokens: int, c: RLRecipe) -> int:
    """Most tokens one sample can have: prompt plus the completion limit."""
    return prompt_tokens + max_new_tokens(c)


def rows_per_batch(c: RLRecipe, max_prompt_tokens: int, row_multiple: int) -> int:
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


def validate(c: Any) -> ModeSettings:
    """The recipe ``c`` checked (:func:`rl_jax.recipe.checks.parse`: no files, processes or
    network);
    returns the mode's settings."""
    return mode_settings(parse(c))
