"""The rollout pipeline's settings (:class:`RolloutConfig`): the group shape, the staleness
bound, retries and backoff, reward shaping and filtering, multi-turn limits and the forced
lengths of benchmarks. :mod:`rl_jax.rollout.pipeline` reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rl_jax.envs.shaping import RewardShaping
from rl_jax.generator.types import SamplingParams
from rl_jax.recipe.schema import Rollout as RecipeRollout


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The pipeline's settings. The group shape, staleness bound and retries default to the
    recipe's defaults (:class:`rl_jax.recipe.schema.Rollout`); a run sets every field from its recipe
    (:func:`rl_jax.orchestrator.setup.rollout_config`), so the others' defaults serve library
    users only."""

    group_size: int = RecipeRollout.group_size  # samples per prompt
    groups_per_batch: int = RecipeRollout.groups_per_batch
    max_lag: int = RecipeRollout.max_lag
    staleness_policy: str = RecipeRollout.staleness_policy
    max_in_flight_groups: int | None = None
    sampling: SamplingParams = SamplingParams(max_new_tokens=32)
    # generation/scoring failures of one prompt before it is skipped
    max_retries: int = RecipeRollout.max_retries
    shaping: RewardShaping | None = None  # length penalties on top of the environment's reward
    # DAPO's overlong filtering: a completion cut off by the length limit is kept in its group
    # (its reward counts in the group's baseline) with loss mask 0, so it is never trained on.
    overlong_filter: bool = False
    # DAPO-style dynamic sampling: a group whose rewards are all equal (no learning signal) is
    # discarded and another prompt takes its place.
    filter_zero_signal: bool = False
    # Skip prompts whose solve rate over their last `solve_rate_window` samples is 0 or 1
    # (None: never skip). Keys are the prompts' positions modulo `solve_rate_period` (the
    # source length when the stream repeats epochs), so that epochs share a history.
    solve_rate_window: int | None = None
    solve_rate_period: int | None = None
    # Multi-turn episodes: completion tokens one policy turn may use (the episode as a whole,
    # observations included, stays within sampling.max_new_tokens). None: no per-turn limit.
    max_tokens_per_turn: int | None = None
    # Multi-turn episodes: tokens that end a policy turn besides end-of-sequence (a tool call's
    # closing token, ``</tool_call>``: the environment answers the call before the policy goes
    # on). The token is kept in the turn.
    turn_stop_token_ids: tuple[int, ...] = ()
    # A JSONL file the rollout appends a line to for every prompt it drops without training
    # it ({"position", "reason", "time"}; reasons "zero_signal", "solved_or_unsolved",
    # "failed", "too_stale"), so that a run's records account for every prompt it admitted.
    # None: not kept.
    drop_log: str | None = None
    # Most seconds the environment may take to score one group's completions (None: no
    # limit); a group that takes longer is a failed attempt, retried up to max_retries.
    score_timeout_s: float | None = None
    # Wait this long before re-sending a prompt no generator server could take (all down or
    # restarting); such waits do not count against max_retries.
    unavailable_backoff_s: float = 1.0
    # Forced completion lengths (benchmarks): (position, sample index) -> max_new_tokens,
    # generated with ignore_eos so that each completion has exactly that length. With
    # `per_sample_lengths` every sample of a group gets its own length (one request per sample,
    # each with its own seed); without, the group's samples share the length of sample 0 and
    # one request with n = group_size. None: sampling's own max_new_tokens.
    length_of: Callable[[int, int], int] | None = None
    per_sample_lengths: bool = False
    # With length_of: the environment scores the completion up to its first of these tokens
    # (what the policy answered before it was made to go on).
    score_until: tuple[int, ...] = ()
