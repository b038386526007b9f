"""Tiny asynchronous RL recipe (CPU default): a partly trained addition model of
``configs/tiny_lm.py`` (2-digit operands) improves its held-out greedy accuracy with GRPO, trainer
and generator server in separate processes on separate cores, weights streamed to the server in
flight after every step, for 570 s of RL (the time limit; about eleven minutes in all on 2 CPU
cores).

    python -m launch.train --config=configs/tiny_rl.py --workdir=runs/tiny_rl

The base policy is ``base.checkpoint``; when that is empty the run first trains one with
``base.lm_config`` (about a minute) into ``<workdir>/base`` and starts from its HF export.
``--config.mode=sync`` or ``one_step_off`` runs the same recipe in the other modes.
"""

from ml_collections import ConfigDict

from rl_jax.recipe.schema import base_config


def get_config() -> ConfigDict:
    """The base recipe (rl_jax.recipe, where every field is described) with what differs."""
    c = base_config()

    # The policy to start from: an HF checkpoint directory, or "" to train one first with the
    # supervised recipe `lm_config` and these overrides: 2-digit addition, stopped after 175
    # of 300 steps (held-out exact match about 0.25), a policy with room to improve.
    c.base.lm_config = "configs/tiny_lm.py"
    c.base.lm_overrides = ("task.num_digits=2", "trainer.steps=300", "trainer.stop_after=175")
    # scan_layers=False: the 3 layers unrolled (see configs/tiny_lm.py).
    c.model.update(dtype="float32", remat="none", scan_layers=False)

    # The reward environment (rl_jax.envs.get(name, **kwargs)); train prompts come from its
    # train split, held-out prompts from its eval split (operand pairs never trained on).
    c.env.kwargs = ConfigDict(dict(num_digits=2, reverse_answer=False, partial_credit=False))

    c.rollout.update(
        max_lag=2,  # async mode: most optimizer steps a sample may lag behind the trainer
        max_new_tokens=8,
        seq_len=128,  # tokens per packed training row
        # A group's prompt is packed once and its completions attend to it: the trainer
        # computes (group_size - 1) x (prompt tokens - 1) fewer tokens per group (here 8
        # completions of ~4 tokens share a ~7-token prompt: ~2.4x fewer tokens per batch).
        share_prompts=True,
    )
    # options: fields of the loss's config (rl_jax.losses.make_config), e.g. correction="tis"
    # (truncated importance weights π_prox/μ on the policy term).
    c.loss.options = ConfigDict(dict(correction="none"))
    c.trainer.update(
        steps=2000,  # an upper bound: the time limit ends the run first on 2 CPU cores
        time_limit_s=570.0,  # > 0: stop (and export) after this many seconds of RL
        # On a CPU, micro-batches of about 256 token slots keep a step's activations in the
        # core's L2 cache: 2 x 128 trains ~1.8x more tokens/s than 8 x 128 here.
        micro_batch_rows=2,
        # Export (and evaluate at the end) an exponential moving average of the parameters
        # with this decay per step instead of the last step's (rl_jax.trainer.state.ema_update).
        ema_decay=0.99,
    )
    # schedule_on="progress": the cosine decay follows the run's progress, the larger of
    # steps / trainer.steps and wall time / trainer.time_limit_s, so a run stopped by its time
    # limit has decayed exactly when it stops ("steps": over trainer.steps updates).
    c.optimizer.update(learning_rate=5e-4, warmup_steps=5, final_lr_ratio=0.3, b2=0.98,
                       schedule_on="progress")

    # One server of this project started here; decode shapes compiled before serving (a slower
    # start, no stalls later).
    c.generator.update(max_seq_len=64, dtype="float32", warmup_shapes=True)
    # CPU cores of each pool ("" = no pinning), e.g. trainer "0" and generators "1". `rollout`:
    # the trainer process's host threads (rollout client, batch packing, evaluation, weight
    # sync); "" = the trainer's cores. `generators_nice`: the servers' CPU priority (0 default,
    # 19 lowest; rl_jax.generator.launcher.pool.PoolConfig.nice). With shared-prompt packing a train
    # step costs ~2.4x less, and the host threads share the trainer's core: the generator's core
    # is left to decoding, which dynamic filtering keeps busy.
    c.cpus.update(trainer="0", generators="1", rollout="0", generators_nice=10)

    # Held-out greedy evaluation: the first `examples` prompts of the environment's eval split.
    # The periodic ones run beside the rollout with at most `concurrency` requests at a time.
    c.eval.max_new_tokens = 8
    c.export.dtype = "float32"
    return c
