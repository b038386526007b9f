"""Held-out accuracy of saved policies, outside any run: the recipe's greedy evaluation
(:func:`rl_jax.orchestrator.evaluation.evaluate`, the same held-out prompts, scorer and token
limit) of each HF checkpoint in turn, on one engine in this process.

A study measures learning against wall time this way (a run writes its policy every
``export.every`` steps with the wall time it had, :mod:`rl_jax.orchestrator.snapshots`, and runs
no periodic evals): an evaluation on the servers during a run takes generator time from the
rollout in the overlapped modes only (in ``sync`` mode it fills the generators' idle time while
the trainer trains), which would charge the modes unequally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_jax.orchestrator.evaluation import EvalResult, evaluate, held_out_prompts


def checkpoint_accuracies(config: Any, model_dirs: Sequence[str | Path], *,
                          examples: int | None = None, slots: int = 128,
                          max_seq_len: int | None = None) -> list[EvalResult]:
    """The recipe ``config``'s held-out evaluation (``eval.examples`` problems unless
    ``examples`` is given, ``eval.max_new_tokens``, its environment and prompt template) of every
    checkpoint in ``model_dirs`` (one architecture: the first is loaded, the others replace its
    weights as ``update_weights_from_disk`` does), in order."""
    import jax.numpy as jnp

    from rl_jax import envs
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.engine.local import LocalGenerator
    from rl_jax.generator.engine.weights import generator_rules, load_params
    from rl_jax.models.config import eos_ids
    from rl_jax.models.hf import load_tokenizer
    from rl_jax.orchestrator.setup import Codec, turn_stop_ids

    if not model_dirs:
        return []
    env = envs.get(config.env.name, **config.env.kwargs.to_dict())
    prompts = held_out_prompts(env, examples or config.eval.examples)
    cfg, params = load_params(model_dirs[0], mesh=None, rules=generator_rules(),
                              dtype=jnp.float32)
    codec = Codec(load_tokenizer(model_dirs[0]), cfg.bos_token_id, config.data.template)
    engine = Engine(cfg, params, rules=generator_rules(), dtype=jnp.float32,
                    eos_token_ids=eos_ids(cfg), engine_config=EngineConfig(
                        max_slots=slots, max_seq_len=max_seq_len or config.generator.max_seq_len))

    async def run() -> list[EvalResult]:
        generator = LocalGenerator(engine, owns_engine=True)
        results = []
        try:
            for i, path in enumerate(model_dirs):
                if i:
                    await generator.update_weights_from_disk(str(path))
                results.append(await evaluate(
                    generator, env, prompts, encode=codec.encode, decode=codec.decode,
                    max_new_tokens=config.eval.max_new_tokens, concurrency=slots,
                    tag=f"offline-{i}", encode_observation=codec.encode_observation,
                    turn_stop_token_ids=turn_stop_ids(codec, env)))
        finally:
            await generator.close()
        return results
    return asyncio.run(run())
