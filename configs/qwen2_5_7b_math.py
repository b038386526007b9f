"""Qwen2.5-7B on competition math, asynchronous RL on two 8-GPU nodes (GPU recipe).

Eight GPUs of node 0 train (FSDP × tensor parallel); node 1 serves SGLang (four servers of TP 2);
weights go to the servers through SGLang's ``/update_weights_from_disk`` after every step, staleness
bounded by
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

from pathlib import Path

from ml_collections import ConfigDict

from rl_jax.recipe.checks import load_recipe_file


def get_config() -> ConfigDict:
    """The 1.5B recipe (``configs/qwen2_5_1_5b_math.py``) with what differs: the model, its
    mesh and servers on another node."""
    c = load_recipe_file(Path(__file__).with_name("qwen2_5_1_5b_math.py"))
    c.base.checkpoint = "checkpoints/qwen2.5-7b"
    # For planning (python -m launch.plan) without the checkpoint at hand.
    c.model.shape = ConfigDict(dict(
        hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, vocab_size=152064, tie_word_embeddings=False))
    c.mesh.tensor = 2
    c.trainer.num_microbatches = 32
    c.generator.update(urls=tuple(f"http://node1:{30000 + i}" for i in range(4)),
                       tensor_parallel=2, env=())
    return c
