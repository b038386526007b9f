"""The model shape and parameters shared by the transfer tests and their worker processes."""

import jax
import numpy as np

from rl_jax.models.config import ModelConfig

# ~1.4 MB of float32 parameters: every dimension with an "embed" axis divides by 8.
CONFIG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32)


def make_params(spec, seed: int):
    """Random parameters drawn in NumPy and placed in ``spec``'s shardings (nothing compiles)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s),
        spec.abstract_params, spec.param_shardings)
