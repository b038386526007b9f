"""Tool-use RL recipe (CPU default): the tiny model learns to use a calculator for long
additions (:class:`rl_jax.envs.tool_use.ToolUseEnv` around ``long_addition``, 2 to 12 digits).
A turn that calls the calculator (``<tool_call>{...}</tool_call>``: generation stops at the
closing token) gets its result back as a ``<tool_response>`` turn (masked out of the loss); the
first turn without a call is the answer. A malformed call costs 0.2 of reward and a turn.

The base policy is ``base.checkpoint``; when that is empty the run first trains one with
``configs/tool_lm.py`` into ``<workdir>/base`` (it calls the tool on about 30% of problems,
a quarter of those malformed at first). ``--config.env.kwargs.tools=()`` runs the same recipe
with no tools (every call is then an unknown tool).

    python -m launch.train --config=configs/tool_rl.py --workdir=runs/tool_rl
"""

from ml_collections import ConfigDict

from rl_jax.recipe.schema import base_config


def get_config() -> ConfigDict:
    c = base_config()
    c.base.lm_config = "configs/tool_lm.py"
    c.model.update(dtype="float32", remat="none", scan_layers=False)

    c.env.name = "tool_use"
    c.env.kwargs = ConfigDict(dict(
        task="long_addition", task_kwargs=dict(min_digits=2, max_digits=12),
        tools=("calculator",), max_turns=3, max_calls_per_turn=1, style="plain",
        format_penalty=-0.2))

    c.rollout.update(
        max_lag=4,
        groups_per_batch=8,
        group_size=8,
        # a whole episode: a malformed call, its error, the call, the result, the answer
        max_new_tokens=320,
        max_tokens_per_turn=128,
        overlong="filter",
        seq_len=512,
        share_prompts=True,
        temperature=1.0,
    )
    c.loss.options = ConfigDict(dict(correction="tis"))
    c.trainer.update(steps=3000, time_limit_s=600.0, micro_batch_rows=2, ema_decay=0.99)
    c.optimizer.update(learning_rate=1e-4, warmup_steps=30, final_lr_ratio=0.3, b2=0.98,
                       schedule_on="progress")
    c.generator.update(max_seq_len=512, dtype="float32", warmup_shapes=True)
    c.cpus.update(trainer="0", generators="1", rollout="0", generators_nice=10)
    c.eval.update(examples=256, every=20, max_new_tokens=320)
    c.export.dtype = "float32"
    return c
