"""Qwen2.5-7B on competition math, asynchronous RL on two 8-GPU nodes (GPU recipe).

Eight GPUs of node 0 train (FSDP × tensor parallel); node 1 serves SGLang (four servers of TP 2);
weights go to the servers through SGLang's ``/update_weights_from_disk`` after every step, staleness bounded by
``max_lag``. It does not run on CPU; ``tests/test_orchestrator.py`` checks it is complete.

    huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir checkpoints/qwen2.5-7b
    # data/math_train.jsonl and data/math500.jsonl: {"problem": ..., "answer": ...} per line
    # both nodes: the servers' API keys in files only this user reads (SGLang's own YAML
    # settings file for the servers, one key per file for the trainer)
    umask 077; mkdir -p keys; openssl rand -hex 32 > keys/api; openssl rand -hex 32 > keys/admin
    printf 'api-key: %s\nadmin-api-key: %s\n' $(cat keys/api) $(cat keys/admin) > keys/sglang.yaml
    # node 1, four times (ports 30000-30003, GPUs 0-1, 2-3, ...), reachable from node 0:
    python -m sglang.launch_server --model-path checkpoints/qwen2.5-7b --tp-size 2 \
        --host 0.0.0.0 --port 30000 --config keys/sglang.yaml
    # node 0:
    python -m launch.train --config=configs/qwen2_5_7b_math.py \
        --workdir=runs/qwen7b_math --config.generator.auth.api_key_file=keys/api \
        --config.generator.auth.admin_api_key_file=keys/admin

The servers run on another node and are listed in ``generator.urls``; weights reach them as HF
checkpoints on a filesystem both nodes share (``<workdir>/weights``); see WORKSPACE.md,
"Multi-host runs".
"""

from ml_collections import ConfigDict

CHAT = ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.recipe = "rl"
    c.mode = "async"
    c.seed = 0
    c.base = ConfigDict(dict(checkpoint="checkpoints/qwen2.5-7b", lm_config="",
                            lm_overrides=()))
    c.model = ConfigDict(dict(
        dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True,
        # For planning (python -m launch.plan) without the checkpoint at hand.
        shape=ConfigDict(dict(hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, head_dim=128, vocab_size=152064,
                              tie_word_embeddings=False)),
    ))
    c.mesh = ConfigDict(dict(data=1, fsdp=4, tensor=2))
    c.env = ConfigDict(dict(name="math", kwargs=ConfigDict(dict(require_boxed=True,
                                                                num_workers=8))))
    c.data = ConfigDict(dict(path="data/math_train.jsonl", text_key="problem",
                             answer_key="answer", template=CHAT, shuffle=True, epochs=0))
    c.rollout = ConfigDict(dict(
        group_size=8, groups_per_batch=64, max_lag=4, staleness_policy="prevent",
        temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=3072, ignore_eos=False,
        advantage="grpo", filter_zero_signal=True, seq_len=4096, rows_per_batch=0,
        share_prompts=True, max_retries=3,
        lengths=ConfigDict(dict(median=8.0, sigma=0.0, max=64, per_sample=False)),
    ))
    c.loss = ConfigDict(dict(name="reinforce_tis", options=ConfigDict(dict(truncation=5.0))))
    c.trainer = ConfigDict(dict(steps=1000, time_limit_s=0.0, num_microbatches=32,
                                micro_batch_rows=0, logits_block_size=8192,
                                prefetch=True, ess_lr_power=0.0, step_delay_s=0.0,
                                ema_decay=0.0))
    c.optimizer = ConfigDict(dict(learning_rate=1e-6, warmup_steps=10, final_lr_ratio=1.0,
                                  b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                  max_grad_norm=1.0, schedule_on="steps"))
    c.generator = ConfigDict(dict(
        kind="sglang", urls=tuple(f"http://node1:{30000 + i}" for i in range(4)),
        num_servers=4, max_slots=256, max_seq_len=4096, dtype="bfloat16", tensor_parallel=2,
        data_parallel=1, decode_steps=1,
        startup_timeout_s=1200.0, restart_dead=True, warmup_shapes=False,
        request_timeout_s=3600.0,
        # API keys (rl_jax.generator.auth): files holding them, else the environment
        # (RL_JAX_API_KEY, RL_JAX_ADMIN_API_KEY); servers started here without either get random
        # keys for the run. Keys never go in a config (it is saved and logged).
        auth=ConfigDict(dict(api_key_file="", admin_api_key_file="", generate_keys=True)),
    ))
    c.cpus = ConfigDict(dict(trainer="", generators="", rollout="", generators_nice=0))
    c.transfer = ConfigDict(dict(transports=("disk",), transport="auto", host="127.0.0.1",
                                 port=0, timeout_s=600.0))
    c.eval = ConfigDict(dict(examples=500, every=25, max_new_tokens=3072,
                             path="data/math500.jsonl", concurrency=64))
    c.checkpoint = ConfigDict(dict(every=25, keep=3, use_async=True))
    c.logging = ConfigDict(dict(every=1, tensorboard=True))
    c.distributed = ConfigDict(dict(coordinator="", num_processes=1, process_id=0))
    # JAX's persistent compilation cache of the trainer and the servers started here: "auto"
    # (~/.cache/rl_jax/xla, private to the user), a directory, or "" (off). A second run of
    # the recipe loads its compiled programs instead of compiling them.
    c.compilation_cache_dir = "auto"
    # The final policy goes to <workdir>/hf; every > 0 also writes one every that many steps
    # to <workdir>/hf_steps/step_N (rl_jax.orchestrator.snapshots), e.g. to evaluate later.
    c.export = ConfigDict(dict(dtype="bfloat16", every=0))
    return c
