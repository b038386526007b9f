"""Qwen2.5-1.5B on competition math, asynchronous RL on one 8-GPU node (GPU recipe).

Four GPUs train (FSDP), four serve SGLang (one server each, started here); weights go to the
servers through SGLang's ``/update_weights_from_disk`` after every step, staleness bounded by
``max_lag``. It does not run on CPU; ``tests/test_orchestrator.py`` checks it is complete.

    huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir checkpoints/qwen2.5-1.5b
    # data/math_train.jsonl and data/math500.jsonl: {"problem": ..., "answer": ...} per line
    CUDA_VISIBLE_DEVICES=0,1,2,3 python -m launch.train --config=configs/qwen2_5_1_5b_math.py \
        --workdir=runs/qwen1.5b_math

The servers see GPUs 4-7 (``generator.env``) and get random API keys for the run
(``generator.auth``). On several nodes start them with ``python -m sglang.launch_server --host
0.0.0.0 --config keys.yaml`` (a file only you read: ``api-key: ...``, ``admin-api-key: ...``),
list them in ``generator.urls`` and name the same keys' files in ``generator.auth`` (see
``configs/qwen2_5_7b_math.py`` and WORKSPACE.md, "Multi-host runs").
"""

from ml_collections import ConfigDict

from rl_jax.recipe.schema import base_config

CHAT = ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
        "\\boxed{}.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")


def get_config() -> ConfigDict:
    """The base recipe (rl_jax.recipe) with what differs."""
    c = base_config()
    c.base.checkpoint = "checkpoints/qwen2.5-1.5b"
    # For planning (python -m launch.plan) without the checkpoint at hand.
    with c.model.ignore_type():
        c.model.shape = ConfigDict(dict(
            hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
            num_kv_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True))
    c.mesh.fsdp = 4
    c.env.name = "math"
    c.env.kwargs = ConfigDict(dict(require_boxed=True, num_workers=8))
    c.data.update(path="data/math_train.jsonl", text_key="problem", template=CHAT)
    c.rollout.update(groups_per_batch=64, max_new_tokens=3072)
    c.loss.name = "reinforce_tis"
    c.loss.options = ConfigDict(dict(truncation=5.0))
    c.trainer.update(num_microbatches=16, logits_block_size=8192)
    c.generator.update(kind="sglang", num_servers=4, max_slots=256, startup_timeout_s=1200.0,
                       request_timeout_s=3600.0,
                       # The servers' GPUs (server i uses GPU i of these, --base-gpu-id i).
                       env=(("CUDA_VISIBLE_DEVICES", "4,5,6,7"),))
    c.transfer.update(transports=("disk",), timeout_s=600.0)
    c.eval.update(examples=500, every=25, max_new_tokens=3072, path="data/math500.jsonl",
                  concurrency=64)
    c.checkpoint.update(every=25, keep=3)
    return c
