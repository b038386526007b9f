"""The grain map after the rollout stage: groups → advantages → packed batch + metrics."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rl_jax.rollout.records import Group, host_advantages, pack_groups


@dataclasses.dataclass(frozen=True)
class GroupsToBatch:
    """grain map: groups → advantages → packed ``[rows, seq_len]`` numpy batch + metrics."""

    seq_len: int
    rows: int  # 0: as many as the samples need, rounded up by records.bucket_rows
    advantage: str = "grpo"
    pad_id: int = 0
    row_multiple: int = 1  # rows=0: a multiple of this (batch shards × micro-batches)
    power_of_two: bool = True  # rows=0: row_multiple · 2^k rows (else any multiple)
    share_prompts: bool = False  # a group's prompt packed once (records.pack_groups)

    def warm(self, num_groups: int, group_size: int):
        """Compiles the advantage estimator for batches of ``num_groups`` groups of
        ``group_size`` samples (see :func:`records.host_advantages`), so that the first batch
        does not wait for it."""
        group_ids = np.repeat(np.arange(num_groups), group_size)
        host_advantages(self.advantage, np.zeros(len(group_ids), np.float32), group_ids,
                        num_groups)

    def __call__(self, groups: list[Group]) -> dict[str, Any]:
        # Prompt-stream order, not completion order: the same groups always pack the same way.
        groups = sorted(groups, key=lambda g: g.position)
        batch = pack_groups(groups, seq_len=self.seq_len, rows=self.rows,
                            advantage=self.advantage, pad_id=self.pad_id,
                            row_multiple=self.row_multiple, power_of_two=self.power_of_two,
                            share_prompts=self.share_prompts)
        rewards = batch["rewards"]
        solve = np.asarray([float(np.mean(g.rewards >= 1.0)) for g in groups])
        samples = [s for g in groups for s in g.samples]
        lengths = np.asarray([len(s.completion_ids) for s in samples], np.float64)
        batch["metrics"] = {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "groups/zero_signal": float(np.mean([np.ptp(g.rewards) == 0 for g in groups])),
            "groups/solve_rate_band": float(np.mean((solve > 0) & (solve < 1))),
            "tokens/completion": float(sum(len(s.completion_ids) for g in groups
                                           for s in g.samples)),
            "versions/min": float(min(g.min_version for g in groups)),
            # The completions' lengths, those cut at the limit, and those whose tokens came
            # from two or more weight versions (an update landed while they were generated).
            "completions/length_mean": float(lengths.mean()),
            "completions/length_p50": float(np.percentile(lengths, 50)),
            "completions/length_p95": float(np.percentile(lengths, 95)),
            "completions/length_max": float(lengths.max()),
            "completions/truncated": float(np.mean([s.finish_reason == "length"
                                                    for s in samples])),
            "completions/multi_version": float(np.mean([len(set(s.versions)) > 1
                                                        for s in samples])),
            "positions": [g.position for g in groups],
            **episode_metrics([s.info for s in samples]),
        }
        return batch


def episode_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """Multi-turn episodes' turns and tool use (:class:`rl_jax.envs.tool_use.ToolUseEnv`'s
    ``info``): per episode, tool calls, malformed calls and failed calls; the fraction of
    episodes that called a tool; the fraction of call attempts that were well-formed."""
    out: dict[str, float] = {}
    n = max(len(infos), 1)
    if any("turns" in i for i in infos):
        out["episodes/turns_mean"] = sum(float(i.get("turns", 1)) for i in infos) / n
    if any("tool_calls" in i for i in infos):
        calls = sum(float(i.get("tool_calls", 0)) for i in infos)
        malformed = sum(float(i.get("format_errors", 0)) for i in infos)
        out.update({
            "tools/calls_per_episode": calls / n,
            "tools/format_errors_per_episode": malformed / n,
            "tools/failed_calls_per_episode": sum(float(i.get("tool_errors", 0))
                                                  for i in infos) / n,
            "tools/episodes_calling": sum(float(i.get("tool_calls", 0) > 0) for i in infos) / n,
            "tools/well_formed": calls / (calls + malformed) if calls + malformed else 1.0,
        })
    return out
