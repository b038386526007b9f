"""The tiny asynchronous RL recipe (``configs/tiny_rl.py``) with a real SGLang server (0.5.23, its
CPU engine) as the generator, in SGLang's own environment, everything else the same: the same
base policy, prompts, reward, loss, steps and cores. Its learning per optimizer step is the
end-to-end check that the log-probs, weight versions and importance ratios read from SGLang are
right (compare with the tiny recipe's run: benchmarks/results/learning_study/).

    bash tools/sglang_cpu/install.sh .venv-sglang      # once: SGLang in a venv of its own
    python -m launch.train --config=configs/tiny_rl_sglang.py --workdir=runs/tiny_rl_sglang

Weights reach SGLang as an HF checkpoint written by the trainer's publisher and loaded with
``/update_weights_from_disk`` after every step, in flight (requests keep running; each token's
version comes back in ``meta_info.weight_versions``). SGLang ignores per-request sampling seeds
without ``--enable-deterministic-inference`` (which its CPU attention refuses), so repeated runs
differ by sampling; the run says so once.
"""

from pathlib import Path

from ml_collections import ConfigDict

from rl_jax.generator.launcher.pool import sglang_cpu_settings
from rl_jax.recipe.checks import load_recipe_file


def get_config() -> ConfigDict:
    c = load_recipe_file(Path(__file__).with_name("tiny_rl.py"))
    env, args = sglang_cpu_settings()
    c.generator.update(
        kind="sglang",
        # SGLang's own environment (tools/sglang_cpu/install.sh), relative to the working
        # directory the run starts in (the repository's root).
        python=".venv-sglang/bin/python",
        env=env, extra_args=args,
        warmup_shapes=False,  # this project's servers only (SGLang compiles nothing here)
    )
    # SGLang's CPU engine decodes this model several times slower than this project's server
    # (docs/performance.md), so a step takes ~2.7 s instead of ~0.5 s: a longer budget reaches
    # about the same number of optimizer steps as the tiny recipe's first 150 s.
    c.trainer.time_limit_s = 900.0
    return c
