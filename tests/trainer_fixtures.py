"""Small shared builders for trainer tests."""

import numpy as np

from rl_jax.models.config import ModelConfig
from rl_jax.trainer.step import LMBatch

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8)


def random_batch(seed: int, batch: int = 8, seq: int = 16, vocab: int = 64,
                 packed: bool = True) -> LMBatch:
    """Random tokens in rows of two packed segments (segment 0 = padding at the end)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, (batch, seq))
    targets = rng.randint(0, vocab, (batch, seq))
    segment_ids = np.ones((batch, seq), np.int32)
    positions = np.tile(np.arange(seq), (batch, 1))
    if packed:
        cut = seq // 2
        segment_ids[:, cut:] = 2
        segment_ids[:, seq - 2:] = 0
        positions[:, cut:] -= cut
    mask = (rng.rand(batch, seq) > 0.3) & (segment_ids > 0)
    return LMBatch.from_numpy(dict(tokens=tokens, targets=targets, loss_mask=mask,
                                   positions=positions, segment_ids=segment_ids))
