"""Data: tokenizers, synthetic tasks, sequence packing and grain input pipelines."""

from rl_jax.data.arithmetic import ArithmeticTask, operand_pair_in_eval
from rl_jax.data.lm import (ExampleEncoder, eval_arrays, exact_match, example_dataset,
                            examples_per_row, lm_batches, max_example_length)
from rl_jax.data.packing import PACKED_KEYS, PackedBatch, pack_sequences, packing_stats
from rl_jax.data.tokenizer import (alphabet_of, build_char_tokenizer, decode, encode,
                                   special_token_ids)

__all__ = [
    "ArithmeticTask", "operand_pair_in_eval",
    "ExampleEncoder", "eval_arrays", "exact_match", "example_dataset", "examples_per_row",
    "lm_batches", "max_example_length",
    "PACKED_KEYS", "PackedBatch", "pack_sequences", "packing_stats",
    "alphabet_of", "build_char_tokenizer", "decode", "encode", "special_token_ids",
]
