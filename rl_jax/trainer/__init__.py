"""Sharded training: train state, train step, checkpoints, and the supervised LM recipe."""

from rl_jax.trainer.checkpoint import Checkpointer, CheckpointRestoreError
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, TrainState, abstract_state,
                                  init_state, learning_rate_at, learning_rate_schedule,
                                  make_optimizer, set_learning_rate)
from rl_jax.trainer.step import (LMBatch, causal_lm_loss, global_batch, make_eval_step,
                                 make_train_step)

__all__ = [
    "CheckpointRestoreError", "Checkpointer", "LMBatch", "ModelSpec", "OptimizerConfig",
    "TrainState", "abstract_state", "causal_lm_loss", "global_batch", "init_state",
    "learning_rate_at", "learning_rate_schedule", "make_eval_step", "make_optimizer",
    "make_train_step", "set_learning_rate",
]
