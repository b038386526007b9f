"""Data: prompts, tokenizers, synthetic tasks, sequence packing and grain input pipelines.

Import each name from its module (``rl_jax.data.prompts``, ``rl_jax.data.arithmetic``,
``rl_jax.data.lm``, ``rl_jax.data.packing``, ``rl_jax.data.tokenizer``, ``rl_jax.data.sources``);
the light ones (prompts, arithmetic) do not import grain or JAX.
"""
