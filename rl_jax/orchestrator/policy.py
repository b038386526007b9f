"""The trainer side of RL: the packed rollout batch and the policy loss over it.

A :class:`PolicyBatch` is what ``rl_jax.rollout.batching.GroupsToBatch`` packs (every field ``[B, T]``,
aligned with ``targets``). :func:`make_policy_loss` turns a registered loss
(``rl_jax.losses.get(name)``) into the trainer's ``loss_fn(model, batch)``: one forward pass
computes the current log-probs (blockwise over the vocabulary) and entropies of the targets, and
the loss compares them with the behaviour log-probs the generators recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.losses import get, make_config

POLICY_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids", "prefix_ids",
                 "advantages", "behaviour_logprobs")
INT_FIELDS = ("tokens", "targets", "positions", "segment_ids", "prefix_ids")


@flax.struct.dataclass
class PolicyBatch:
    """A packed RL batch; every field is ``[B, T]``.

    ``advantages`` is the sample's advantage on each of its completion tokens,
    ``behaviour_logprobs`` the generator's log-probability (nats) of each completion token under
    the weights that sampled it, ``loss_mask`` 1 on completion tokens the policy wrote,
    ``prefix_ids`` the segment of a shared prompt a completion's tokens attend to (0: none; see
    :func:`rl_jax.data.packing.pack_shared_prefixes`).
    """

    tokens: jax.Array
    targets: jax.Array
    loss_mask: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    prefix_ids: jax.Array
    advantages: jax.Array
    behaviour_logprobs: jax.Array

    @classmethod
    def from_numpy(cls, arrays: Mapping[str, np.ndarray]) -> "PolicyBatch":
        arrays = dict(arrays)
        if "prefix_ids" not in arrays:  # batches packed without shared prompts
            arrays["prefix_ids"] = np.zeros_like(np.asarray(arrays["segment_ids"]))
        return cls(**{k: np.asarray(arrays[k], np.int32 if k in INT_FIELDS else np.float32)
                      for k in POLICY_FIELDS})

    @classmethod
    def abstract(cls, batch_size: int, seq_len: int, sharding=None) -> "PolicyBatch":
        """Shapes for ahead-of-time compilation."""
        i = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
        f = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32, sharding=sharding)
        return cls(tokens=i, targets=i, loss_mask=f, positions=i, segment_ids=i, prefix_ids=i,
                   advantages=f, behaviour_logprobs=f)


def make_policy_loss(name: str, options: Mapping[str, Any] | None = None, *,
                     block_size: int = 4096, temperature: float = 1.0):
    """``loss_fn(model, batch) -> (loss_sum, denominator, metrics)`` for the trainer's step.

    The policy's log-probs are under ``softmax(logits / temperature)``, the distribution the
    generators sample from at that temperature (their behaviour log-probs are under it too), so
    that importance ratios compare like with like; ``temperature <= 0`` (greedy rollouts) uses
    the raw logits.

    Losses that weigh by a proximal policy (``decoupled_ppo``, or any ``correction``) get the
    current weights' log-probs without gradient: with one optimizer step per batch the policy
    before the update is the proximal policy.
    """
    temperature = float(temperature) if temperature > 0 else 1.0
    config = make_config(name, **dict(options or {}))
    loss = get(name)
    needs_proximal = name == "decoupled_ppo" or config.correction != "none"

    def loss_fn(model, batch: PolicyBatch):
        stats = model.token_stats(batch.tokens, batch.targets, batch.positions,
                                  batch.segment_ids, block_size=block_size,
                                  temperature=temperature, prefix_ids=batch.prefix_ids)
        logprobs = stats["logprobs"]
        proximal = jax.lax.stop_gradient(logprobs) if needs_proximal else None
        return loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
                    config=config, proximal_logprobs=proximal, entropy=stats["entropy"],
                    segment_ids=batch.segment_ids)

    return loss_fn
