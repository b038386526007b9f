"""Sharded training: train state, train step, checkpoints, and the supervised LM recipe."""


