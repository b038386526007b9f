"""rl_jax: asynchronous reinforcement learning for language models in JAX."""

__version__ = "0.1.0"
