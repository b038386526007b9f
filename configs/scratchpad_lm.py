"""Supervised recipe of the long-addition task (CPU default): the tiny model of
``configs/tiny_lm.py`` learns to add two 2- to 25-digit numbers by writing out every column
(:mod:`rl_jax.data.scratchpad`; completions of 25 to 301 tokens, median 61). It stops
part-way, so its HF checkpoint is a base policy for ``configs/scratchpad_rl.py``.

    python -m launch.train --config=configs/scratchpad_lm.py --workdir=runs/scratchpad_lm
"""

import importlib.util
from pathlib import Path

from ml_collections import ConfigDict


def _tiny_lm():
    spec = importlib.util.spec_from_file_location("tiny_lm", Path(__file__).with_name("tiny_lm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config() -> ConfigDict:
    c = _tiny_lm()
    c.task = ConfigDict(dict(kind="scratchpad", min_digits=2, max_digits=25, power=1.3,
                             loss_on="answer", num_digits=0, reverse_answer=False))
    # Rows of 512 tokens hold the longest example (<bos>, 3 x 25 + 1 prompt characters, 300 of
    # work, <eos>); a batch is filled by tokens (about 80 examples).
    c.data = ConfigDict(dict(rows_per_batch=16, seq_len=512, eval_examples=256))
    c.trainer.update(steps=600, stop_after=0)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=50, final_lr_ratio=0.05)
    c.logging.update(every=20, eval_every=100)
    return c
