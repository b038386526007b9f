"""Long-completion asynchronous RL recipe (CPU default): the tiny model learns to add two 2- to
25-digit numbers by writing out every column (``configs/scratchpad_lm.py``,
:mod:`rl_jax.envs.scratchpad`). Its completions run from 25 to 301 tokens (median about 61,
95th percentile about 250), their length set by the problem: a synchronous step waits for its
longest sample, completions cross weight updates while they are generated, and the trainer's
batches vary in tokens from step to step.

    python -m launch.train --config=configs/scratchpad_rl.py --workdir=runs/scratchpad_rl

The base policy is ``base.checkpoint``; when that is empty the run first trains one with
``configs/scratchpad_lm.py`` stopped after 300 of its 600 steps (held-out greedy exact match
0.30: problems of 2 columns 0.81, 3 columns 0.49, 4 columns 0.10, longer ones none; about six
minutes) into ``<workdir>/base``. ``--config.mode=sync`` or ``one_step_off``
runs the same recipe in the other modes.
"""

from ml_collections import ConfigDict

from rl_jax.recipe.schema import base_config


def get_config() -> ConfigDict:
    c = base_config()
    c.base.lm_config = "configs/scratchpad_lm.py"
    c.base.lm_overrides = ("trainer.stop_after=300",)
    c.model.update(dtype="float32", remat="none", scan_layers=False)

    c.env.name = "scratchpad"
    c.env.kwargs = ConfigDict(dict(min_digits=2, max_digits=25, power=1.3))

    c.rollout.update(
        max_lag=4,
        groups_per_batch=8,
        group_size=8,
        # the longest work (25 digits: 300 characters) and <eos>
        max_new_tokens=320,
        # a completion cut off at the limit stays in its group's baseline, untrained
        overlong="filter",
        seq_len=512,
        share_prompts=True,
        # At temperature 1 the base's samples solve 0.33 / 0.12 / 0 of the 2- / 3- / 4-column
        # problems that it solves 0.81 / 0.49 / 0.10 of greedily: almost every group beyond
        # two columns is all wrong, RL trains on 2-column problems alone, and held-out accuracy
        # first fell (0.30 -> 0.18 by step 84). At 0.7 (0.52 / 0.28 / 0.01) 3-column problems
        # carry signal from the start and accuracy rose from the first evaluation.
        temperature=0.7,
    )
    # Completions cross weight updates while they are generated: the policy term is weighted
    # by each token's truncated importance ratio against its own behaviour log-prob.
    c.loss.options = ConfigDict(dict(correction="tis"))
    c.trainer.update(
        steps=3000,  # an upper bound: the time limit ends the run first on 2 CPU cores
        time_limit_s=600.0,
        # fixed [2, 512] micro-batches: a step's rows follow its tokens, with no recompilation
        micro_batch_rows=2,
        ema_decay=0.99,
    )
    # RL's gradients here are few and noisy (a batch is mostly 2- and 3-column problems) and
    # Adam scales them to full-size steps: at 3e-4 the policy moved ~1e-2 nats per token a step
    # and held-out accuracy fell before it rose (0.30 -> 0.18-0.22 around step 85); at 1e-4 it
    # rose from the first evaluation (0.30 -> 0.43 at step 41). A 30-step warm-up for the
    # fresh Adam state.
    c.optimizer.update(learning_rate=1e-4, warmup_steps=30, final_lr_ratio=0.3, b2=0.98,
                       schedule_on="progress")
    c.generator.update(max_seq_len=512, dtype="float32", warmup_shapes=True)
    c.cpus.update(trainer="0", generators="1", rollout="0", generators_nice=10)
    # 256 held-out problems: a standard error of about 0.03 at accuracy 0.4
    c.eval.update(examples=256, every=20, max_new_tokens=320)
    c.export.dtype = "float32"
    return c
