"""Completion records and their conversion into packed training batches.

A :class:`Sample` is the contract between generation and training: prompt and completion token
ids, per-token behaviour log-probabilities and policy versions, finish reason, reward and group.
:func:`pack_groups` turns groups of samples into fixed-shape ``[rows, seq_len]`` arrays, every
per-token field aligned with ``targets`` (the token predicted at that position).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rl_jax.data.packing import pack_sequences, pack_shared_prefixes
from rl_jax.losses.advantages import check_groups, get_advantage_estimator


@dataclasses.dataclass
class Sample:
    """One completion of one prompt.

    ``loss_mask`` weights each completion token (0 for tokens an environment wrote in a
    multi-turn episode); None means all ones.
    """

    group_id: int
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss_mask: list[float] | None = None

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclasses.dataclass
class Group:
    """The samples of one prompt (``position`` in the prompt stream identifies it).
    ``consumed_by``: the trainer version whose batch it was handed out in (None before)."""

    position: int
    samples: list[Sample]
    prompt: Any = None
    consumed_by: int | None = None

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([s.reward for s in self.samples], np.float32)


BATCH_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids", "prefix_ids",
                "advantages", "behaviour_logprobs", "versions")


class PackingError(ValueError):
    """A batch of samples that does not fit the configured rows."""


def bucket_rows(needed: int, multiple: int = 1, power_of_two: bool = True) -> int:
    """Rows for a batch that needs ``needed``: ``multiple · 2^k``, the smallest such ``>=
    needed``, so that variable batches compile to a few shapes only; or, without
    ``power_of_two``, the smallest multiple of ``multiple`` (for a train step that runs any
    number of fixed-shape micro-batches)."""
    units = max(1, -(-needed // multiple))
    return multiple * ((1 << (units - 1).bit_length()) if power_of_two else units)


@functools.lru_cache(maxsize=64)
def _compiled_estimator(name: str, num_groups: int, kwargs: tuple) -> Callable:
    return jax.jit(functools.partial(get_advantage_estimator(name), num_groups=num_groups,
                                     **dict(kwargs)))


def host_advantages(name: str, rewards: np.ndarray, group_ids: np.ndarray, num_groups: int,
                    **kwargs) -> np.ndarray:
    """The advantage estimator ``name`` on host arrays, as one compiled call on the host's CPU.

    Run eagerly, an estimator is a couple of dozen dispatched operations (several milliseconds
    of the trainer's thread per batch); compiled, one call per batch (one compilation per number
    of samples). The group ids are checked first, on the host, with the estimators' own errors.
    """
    check_groups(group_ids, num_groups)
    fn = _compiled_estimator(name, int(num_groups), tuple(sorted(kwargs.items())))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(fn(rewards, group_ids), np.float32)


def pack_groups(groups: Sequence[Group], *, seq_len: int, rows: int, advantage: str = "grpo",
                pad_id: int = 0, row_multiple: int = 1, power_of_two: bool = True,
                share_prompts: bool = False, **advantage_kwargs
                ) -> dict[str, np.ndarray]:
    """Advantages per group, then first-fit-decreasing packing into ``[rows, seq_len]``.

    ``rows=0`` sizes the batch to the samples: the rows packing needs, rounded up by
    :func:`bucket_rows` (to a power-of-two multiple of ``row_multiple``, or with
    ``power_of_two=False`` to a multiple of it). With ``share_prompts`` a group's prompt is
    written once and its completions attend to it
    (:func:`rl_jax.data.packing.pack_shared_prefixes`): the same log-probabilities for
    ``(group_size - 1) · (prompt length - 1)`` fewer tokens per group.

    Returns numpy arrays (all ``[rows, seq_len]``): ``tokens``, ``targets``, ``loss_mask``
    (completion tokens only), ``positions``, ``segment_ids``, ``prefix_ids`` (0 without shared
    prompts), ``advantages`` (the sample's advantage on each of its completion tokens),
    ``behaviour_logprobs`` and ``versions`` (-1 where no completion token is predicted), plus
    per-sample ``rewards [N]`` and ``sample_advantages [N]``.
    """
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise PackingError("no samples to pack")
    rewards = np.asarray([s.reward for s in samples], np.float32)
    group_ids = np.concatenate([np.full(len(g.samples), i) for i, g in enumerate(groups)])
    adv = host_advantages(advantage, rewards, group_ids, len(groups), **advantage_kwargs)
    seqs, masks = [], []
    for s in samples:
        if s.num_tokens > seq_len:
            raise PackingError(f"a sample of {s.num_tokens} tokens (prompt {len(s.prompt_ids)} + "
                               f"completion {len(s.completion_ids)}) exceeds seq_len={seq_len}")
        completion_mask = s.loss_mask if s.loss_mask is not None else [1.0] * len(
            s.completion_ids)
        seqs.append(list(s.prompt_ids) + list(s.completion_ids))
        masks.append([0.0] * len(s.prompt_ids) + [float(m) for m in completion_mask])
    if share_prompts:
        units, start = [], 0
        for g in groups:
            n = len(g.samples)
            prompts = {tuple(s.prompt_ids) for s in g.samples}
            if len(prompts) != 1:
                raise PackingError(f"group {g.position} holds {len(prompts)} different prompts; "
                                   "shared-prompt packing needs one per group")
            units.append((g.samples[0].prompt_ids,
                          [s.completion_ids for s in g.samples],
                          [m[len(s.prompt_ids):] for s, m in zip(g.samples,
                                                                 masks[start:start + n])]))
            start += n

        def pack(num_rows=None):
            return pack_shared_prefixes(units, seq_len, num_rows=num_rows, pad_id=pad_id)
    else:
        def pack(num_rows=None):
            return pack_sequences(seqs, seq_len, num_rows=num_rows, loss_masks=masks,
                                  pad_id=pad_id)
    if rows == 0:
        rows = bucket_rows(len(pack()[0]["tokens"]), row_multiple, power_of_two)
    packed, leftover = pack(rows)
    if leftover:
        needed = len(pack()[0]["tokens"])
        raise PackingError(f"{len(samples)} samples need {needed} rows of {seq_len} tokens but "
                           f"the batch has {rows}; raise rollout.rows_per_batch or seq_len")
    shape = packed["tokens"].shape
    advantages = np.zeros(shape, np.float32)
    behaviour = np.zeros(shape, np.float32)
    versions = np.full(shape, -1, np.int32)
    seq_index = packed["sequence_index"]
    for i, s in enumerate(samples):
        rows_i, cols_i = np.nonzero(seq_index == i)
        # Position p of sample i predicts its token p+1; completion token j is token P+j.
        j = packed["positions"][rows_i, cols_i] + 1 - len(s.prompt_ids)
        valid = (j >= 0) & (j < len(s.completion_ids))
        r, c, jj = rows_i[valid], cols_i[valid], j[valid]
        advantages[r, c] = adv[i]
        behaviour[r, c] = np.asarray(s.behaviour_logprobs, np.float32)[jj]
        versions[r, c] = np.asarray(s.versions, np.int32)[jj]
    out = {k: packed[k] for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
    out["prefix_ids"] = packed.get("prefix_ids", np.zeros(shape, np.int32))
    out.update(advantages=advantages, behaviour_logprobs=behaviour, versions=versions,
               rewards=rewards, sample_advantages=adv)
    return out
