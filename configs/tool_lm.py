"""Supervised recipe of the tool-use task (CPU default): the tiny model of ``configs/tiny_lm.py``
learns traces of long additions (2 to 12 digits, ``"48213+90577="``) answered either in its head
or through a calculator call in Qwen's Hermes format (:mod:`rl_jax.envs.tool_traces`): 30% of
the traces call the calculator and a quarter of those first write the call wrongly, read the
environment's error and write it again. Its HF checkpoint is the base policy of
``configs/tool_rl.py``: it calls the tool on a minority of problems and sometimes malformed, and
answers long sums in its head poorly.

    python -m launch.train --config=configs/tool_lm.py --workdir=runs/tool_lm
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
    c.task = ConfigDict(dict(kind="tool_traces", min_digits=2, max_digits=12, power=0.0,
                             tool_fraction=0.3, malformed_fraction=0.25, style="plain",
                             loss_on="answer", num_digits=0, reverse_answer=False))
    # Rows of 512 tokens hold the longest trace (a malformed call, its error, the call, the
    # result and the answer: about 420 characters, fewer tokens); batches are filled by tokens.
    c.data = ConfigDict(dict(rows_per_batch=16, seq_len=512, eval_examples=256))
    c.trainer.update(steps=600, stop_after=0)
    c.optimizer.update(learning_rate=3e-3, warmup_steps=50, final_lr_ratio=0.05)
    c.logging.update(every=20, eval_every=100)
    return c
