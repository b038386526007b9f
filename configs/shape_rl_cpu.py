"""Asynchronous RL at a real model's shape on a 2-core CPU machine (random weights): Qwen2.5-0.5B's
shape by default (494M parameters, vocabulary 151,936, tied embeddings), the arithmetic
environment, a few steps of small batches with short completions; the trainer and one generator
server in their own processes on their own cores, each new version streamed to the server in
flight after every step, staleness bounded by ``max_lag``.

    python -m launch.train --config=configs/shape_rl_cpu.py --workdir=runs/shape_rl \
        [--config.model.shape=qwen3-0.6b]

It measures the system at real size (memory, staleness, step time against the systems model:
``benchmarks/real_shape_run.py``), not learning: a randomly initialised policy answers nothing
right, so every reward is 0 and every advantage 0 (the train step still computes every
gradient). The random weights are written once to ``<workdir>/base/hf`` (in the parameter
dtype, with a byte-level tokenizer covering the vocabulary).
"""

from ml_collections import ConfigDict

from rl_jax.recipe.schema import base_config

def get_config() -> ConfigDict:
    """The base recipe (rl_jax.recipe, where every field is described) with what differs."""
    c = base_config()

    # No checkpoint and no supervised base recipe: random weights of this named shape
    # (rl_jax.models.shapes; "tiny" and "small" run the same path in seconds).
    c.base.lm_config = ""
    # bfloat16 compute over bfloat16 parameters and AdamW moments (gradients accumulate in
    # float32 over micro-batches). What fits here: with float32 master weights and moments the
    # systems model puts the 0.5B trainer's compiled peak at 11.6 GiB, which with the generator
    # (3.8 GiB) and the shared-memory weight versions leaves too little of a 23 GiB machine
    # shared with other work; in bfloat16 it is 8.8 GiB (python -m launch.plan,
    # rl_jax.sysmodel.memory, checked against XLA's compiled figures). On a larger
    # host, --config.model.param_dtype=float32 is the mixed-precision recipe.
    # The layers stay in a lax.scan (faster than unrolled at this size on a CPU, and one layer
    # to compile); remat "none": a micro-batch of 2 x 128 tokens keeps ~1 GB of activations,
    # and recomputing the layers would cost a third more compute.
    c.model.update(shape="qwen2.5-0.5b", dtype="bfloat16", param_dtype="bfloat16",
                   remat="none", scan_layers=True)

    # 3-digit addition ("123+456=": 9 prompt tokens with the byte-level tokenizer's bos).
    c.env.kwargs = ConfigDict(dict(num_digits=3, reverse_answer=False))

    c.rollout.update(
        group_size=4, groups_per_batch=2,  # 8 samples per optimizer step
        max_lag=1,  # async: a batch is generated while the one before it trains
        max_new_tokens=16,
        # Every completion is exactly max_new_tokens long (a random policy stops at its eos
        # token with probability ~1/151,936 per token anyway): known lengths for the
        # systems model's prediction.
        ignore_eos=True,
        # A random policy gets no reward: keep the groups (dynamic filtering would drop all).
        filter_zero_signal=False,
        # A group's prompt packed once: 9 + 4 x 16 = 73 tokens, one group per row.
        seq_len=128, share_prompts=True,
    )
    c.trainer.update(
        steps=6,
        # One compiled [2, 128] micro-batch program: a batch of 2 groups is one micro-batch.
        micro_batch_rows=2,
        ema_decay=0.0,  # no parameter average: it would hold another float32 copy
    )
    c.optimizer.update(learning_rate=1e-6, warmup_steps=0)

    # One server of this project started here, in bfloat16 (versions are published in it);
    # 16 slots hold the two batches max_lag=1 keeps in flight. Every decode shape is compiled
    # before serving, so no step waits for a compilation later. (XLA's CPU backend runs
    # bfloat16 matmuls several times slower than float32 ones: on a CPU host this recipe's
    # decode is slower than a float32 server's; see docs/performance.md.)
    c.generator.update(max_slots=16, max_seq_len=32, dtype="bfloat16", warmup_shapes=True,
                       startup_timeout_s=1800.0)
    # Trainer and the rollout's host threads on core 0, the generator alone on core 1 at a
    # lower priority (as configs/tiny_rl.py).
    c.cpus.update(trainer="0", generators="1", rollout="0", generators_nice=10)
    # A few held-out prompts before and after (greedy, on the servers).
    c.eval.update(examples=8, every=0, max_new_tokens=16)
    # The train state (parameters and moments, 6 GB at 0.5B) is saved once, at the end.
    c.checkpoint.update(every=1_000_000, keep=1)
    c.export.dtype = "bfloat16"
    return c
