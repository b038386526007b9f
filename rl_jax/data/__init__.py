"""Data: prompts, tokenizers, synthetic tasks, sequence packing and grain input pipelines.

The names below are loaded on first use (PEP 562), so that importing a light module of this
package (``rl_jax.data.prompts``, ``rl_jax.data.arithmetic``) does not import grain and jax.
"""

import importlib

_EXPORTS = {
    "rl_jax.data.arithmetic": ("ArithmeticTask", "operand_pair_in_eval"),
    "rl_jax.data.lm": ("ExampleEncoder", "eval_arrays", "exact_match", "example_dataset",
                       "examples_per_row", "lm_batches", "max_example_length"),
    "rl_jax.data.packing": ("PACKED_KEYS", "PackedBatch", "pack_sequences", "packing_stats"),
    "rl_jax.data.prompts": ("Prompt", "PromptGenerator"),
    "rl_jax.data.tokenizer": ("alphabet_of", "build_char_tokenizer", "decode", "encode",
                              "special_token_ids"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
