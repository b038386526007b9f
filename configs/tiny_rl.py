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


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.recipe = "rl"
    c.mode = "async"  # async | one_step_off | sync
    c.seed = 0

    # The policy to start from: an HF checkpoint directory, or "" to train one first with the
    # supervised recipe `lm_config` and these overrides: 2-digit addition, stopped after 175
    # of 300 steps (held-out exact match about 0.25), a policy with room to improve.
    c.base = ConfigDict(dict(checkpoint="", lm_config="configs/tiny_lm.py", lm_overrides=(
        "task.num_digits=2", "trainer.steps=300", "trainer.stop_after=175")))
    # scan_layers=False: the 3 layers unrolled (see configs/tiny_lm.py).
    # shape: a named shape (rl_jax.models.shapes, e.g. "qwen2.5-0.5b") to start from random
    # weights of, when base.checkpoint is empty (for measuring real shapes, not for learning).
    c.model = ConfigDict(dict(dtype="float32", param_dtype="float32", remat="none",
                              scan_layers=False, shape=""))
    c.mesh = ConfigDict(dict(data=1, fsdp=-1, tensor=1))

    # The reward environment (rl_jax.envs.get(name, **kwargs)); train prompts come from its
    # train split, held-out prompts from its eval split (operand pairs never trained on).
    c.env = ConfigDict(dict(name="arithmetic",
                            kwargs=ConfigDict(dict(num_digits=2, reverse_answer=False,
                                               partial_credit=False))))
    # Train prompts: the environment's own generator (path "") or a JSONL / Parquet /
    # ArrayRecord file of records with `text_key` (and `answer_key`); `template` wraps each
    # prompt's text before tokenisation (e.g. a chat template), "{prompt}" marks the text.
    c.data = ConfigDict(dict(path="", text_key="prompt", answer_key="answer",
                             template="{prompt}", shuffle=True, epochs=0))

    c.rollout = ConfigDict(dict(
        group_size=8,  # samples per prompt
        groups_per_batch=32,  # prompts per optimizer step
        max_lag=2,  # async mode: most optimizer steps a sample may lag behind the trainer
        staleness_policy="prevent",
        temperature=1.0, top_p=1.0, top_k=-1,
        max_new_tokens=8,
        ignore_eos=False,
        advantage="grpo",
        # Dynamic sampling (DAPO): groups whose samples all got the same reward carry no
        # signal; they are dropped before training and another prompt takes their place.
        filter_zero_signal=True,
        seq_len=128,  # tokens per packed training row
        # A group's prompt is packed once and its completions attend to it: the trainer
        # computes (group_size - 1) x (prompt tokens - 1) fewer tokens per group (here 8
        # completions of ~4 tokens share a ~7-token prompt: ~2.4x fewer tokens per batch).
        share_prompts=True,
        rows_per_batch=0,  # 0: as many rows as each batch needs (a few bucketed sizes)
        max_retries=3,
        # Benchmarks: lognormal completion lengths, generated with ignore_eos (median tokens,
        # sigma of the log, cap; one length per sample, or per prompt); sigma 0 = off.
        lengths=ConfigDict(dict(median=8.0, sigma=0.0, max=64, per_sample=False)),
    ))
    # options: fields of the loss's config (rl_jax.losses.make_config), e.g. correction="tis"
    # (truncated importance weights π_prox/μ on the policy term).
    c.loss = ConfigDict(dict(name="grpo", options=ConfigDict(dict(correction="none"))))
    c.trainer = ConfigDict(dict(
        steps=2000,  # an upper bound: the time limit ends the run first on 2 CPU cores
        time_limit_s=570.0,  # > 0: stop (and export) after this many seconds of RL
        num_microbatches=1,
        # > 0: every batch runs as fixed [micro_batch_rows, seq_len] micro-batches (one compiled
        # program whatever the batch's size; padding at most micro_batch_rows - 1 rows).
        # On a CPU, micro-batches of about 256 token slots keep a step's activations in the
        # core's L2 cache: 2 x 128 trains ~1.8x more tokens/s than 8 x 128 here.
        micro_batch_rows=2,
        logits_block_size=4096,
        # Take and pack the next batch in a background thread while the current one trains.
        prefetch=True,
        # > 0: every step's learning rate times max(ESS, 0.05) ** ess_lr_power, the effective
        # sample size of the batch's importance ratios (stale batches take smaller steps).
        ess_lr_power=0.0,
        # > 0: export (and evaluate at the end) an exponential moving average of the parameters
        # with this decay per step instead of the last step's (rl_jax.trainer.state.ema_update).
        ema_decay=0.99,
        # Benchmarks: seconds of sleep after every step (a slower trainer, so that generation
        # runs ahead and samples reach the staleness bound).
        step_delay_s=0.0,
    ))
    # schedule_on="progress": the cosine decay follows the run's progress, the larger of
    # steps / trainer.steps and wall time / trainer.time_limit_s, so a run stopped by its time
    # limit has decayed exactly when it stops ("steps": over trainer.steps updates).
    c.optimizer = ConfigDict(dict(learning_rate=5e-4, warmup_steps=5, final_lr_ratio=0.3,
                                  b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.0,
                                  max_grad_norm=1.0, schedule_on="progress"))

    # Generator pool: `urls` of running servers (this project's or SGLang's), or servers started
    # here (`num_servers`, kind "rl_jax" or "sglang").
    c.generator = ConfigDict(dict(
        kind="rl_jax", urls=(), num_servers=1, max_slots=64, max_seq_len=64,
        dtype="float32", tensor_parallel=1, data_parallel=1, startup_timeout_s=600.0,
        # Decode steps per program, admissions between programs (SGLang's
        # --num-continuous-decode-steps).
        decode_steps=1,
        restart_dead=True, request_timeout_s=600.0,
        # Compile every decode shape before serving (a slower start, no stalls later).
        warmup_shapes=True,
        # API keys (rl_jax.generator.auth): files holding them, else the environment
        # (RL_JAX_API_KEY, RL_JAX_ADMIN_API_KEY); servers started here without either get random
        # keys for the run. Keys never go in a config (it is saved and logged).
        auth=ConfigDict(dict(api_key_file="", admin_api_key_file="", generate_keys=True)),
    ))
    # CPU cores of each pool ("" = no pinning), e.g. trainer "0" and generators "1". `rollout`:
    # the trainer process's host threads (rollout client, batch packing, evaluation, weight
    # sync); "" = the trainer's cores. `generators_nice`: the servers' CPU priority (0 default,
    # 19 lowest; rl_jax.generator.launcher.PoolConfig.nice). With shared-prompt packing a train
    # step costs ~2.4x less, and the host threads share the trainer's core: the generator's core
    # is left to decoding, which dynamic filtering keeps busy.
    c.cpus = ConfigDict(dict(trainer="0", generators="1", rollout="0", generators_nice=10))
    c.transfer = ConfigDict(dict(transports=("shm",), transport="auto", host="127.0.0.1",
                                 port=0, timeout_s=120.0))

    # Held-out greedy evaluation: the first `examples` prompts of the environment's eval split,
    # or of the file `path` (same format as data.path). The periodic ones run beside the rollout
    # with at most `concurrency` requests at a time, leaving it the other slots.
    c.eval = ConfigDict(dict(examples=256, every=10, max_new_tokens=8, path="", concurrency=16))
    c.checkpoint = ConfigDict(dict(every=10, keep=2, use_async=True))
    c.logging = ConfigDict(dict(every=1, tensorboard=True))
    c.distributed = ConfigDict(dict(coordinator="", num_processes=1, process_id=0))
    # JAX's persistent compilation cache of the trainer and the servers started here: "auto"
    # (~/.cache/rl_jax/xla, private to the user), a directory, or "" (off). A second run of
    # the recipe loads its compiled programs instead of compiling them.
    c.compilation_cache_dir = "auto"
    # The final policy goes to <workdir>/hf; every > 0 also writes one every that many steps
    # to <workdir>/hf_steps/step_N (rl_jax.orchestrator.snapshots), e.g. to evaluate later.
    c.export = ConfigDict(dict(dtype="float32", every=0))
    return c
