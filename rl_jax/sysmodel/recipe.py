"""Reading a recipe config (an ``ml_collections.ConfigDict``) for the planner.

The model shape is found, in order, in

1. ``config.model.shape`` (fields of :class:`ModelShape`);
2. ``config.base.checkpoint``: an HF checkpoint directory with ``config.json``;
3. ``config.base.lm_config``: another recipe file whose model to use (RL recipes that train
   their own base policy first);
4. ``config.model`` itself (``hidden_size``, ... as in the supervised recipe), with the vocabulary
   of the synthetic task's character tokenizer unless ``model.vocab_size`` is given.

Rollout settings come from ``config.rollout`` (``group_size``, ``groups_per_batch``,
``max_new_tokens``, ``max_lag``), ``config.mode`` and ``config.generator``. An RL recipe
(``recipe = "rl"``) is read through its schema (:func:`rl_jax.recipe.checks.parse`, which refuses a
bad
field); any other config (a supervised recipe, a partial one written for planning) takes every
missing recipe field from the schema's defaults (:func:`recipe_value`). ``rollout.prompt_len``
(prompt tokens per sample) is the planner's own setting, default :data:`PROMPT_LEN`. Heavy
imports (the model config reader, the tokenizer) happen only on the branch that needs them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from rl_jax.recipe import checks, schema
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.shape import ModelShape

PROMPT_LEN = 256  # prompt tokens per sample when the config does not say
ROLLOUT_FIELDS = ("group_size", "groups_per_batch", "max_new_tokens", "max_lag")
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias")


def get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` or ``default`` when any part is missing or empty-None."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        except (AttributeError, KeyError):
            return default
    return default if node is None else node


def _as_dict(node: Any) -> dict[str, Any]:
    if hasattr(node, "to_dict"):
        return node.to_dict()
    return dict(node)


def load_config_file(path: str | Path) -> Any:
    """``get_config()`` of a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise SysModelError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise SysModelError(f"config file {path} has no get_config()")
    return module.get_config()


def model_shape(config: Any, *, base_dir: str | Path = ".", _depth: int = 0) -> ModelShape:
    """The model shape a recipe trains (see the module docstring for where it is looked up).
    ``base_dir`` resolves relative paths in the config."""
    shape = get(config, "model.shape")
    if isinstance(shape, str) and shape:  # a named shape (rl_jax.models.shapes)
        from rl_jax.models.config import ConfigError  # imports jax: only on this branch
        from rl_jax.models.shapes import shape as named_shape
        try:
            return ModelShape.from_model_config(named_shape(shape), name=shape)
        except ConfigError as e:
            raise SysModelError(f"model.shape: {e}")
    if shape is not None and shape != "":
        values = _as_dict(shape)
        return ModelShape.from_mapping(values, name=values.get("name") or "config model.shape")
    checkpoint = get(config, "base.checkpoint", "") or get(config, "model.init_from", "")
    if checkpoint:
        path = Path(base_dir) / checkpoint / "config.json"
        if not path.is_file():
            raise SysModelError(f"checkpoint {checkpoint} has no config.json")
        from rl_jax.models.config import ModelConfig  # imports jax: only on this branch
        try:
            cfg = ModelConfig.from_hf(json.loads(path.read_text()))
        except ValueError as e:
            raise SysModelError(f"{path}: {e}")
        return ModelShape.from_model_config(cfg, name=str(checkpoint))
    lm_config = get(config, "base.lm_config", "")
    if lm_config and _depth < 3:
        base = load_config_file(Path(base_dir) / lm_config)
        return model_shape(base, base_dir=base_dir, _depth=_depth + 1)
    model = get(config, "model")
    if model is not None and get(model, "hidden_size"):
        values = {k: get(model, k) for k in _SHAPE_FIELDS if get(model, k) is not None}
        if "attention_bias" not in values:
            values["attention_bias"] = get(model, "architecture") in ("Qwen2ForCausalLM",
                                                                      "SeedOssForCausalLM")
        vocab = values.get("vocab_size") or _task_vocab_size()
        name = f"{get(model, 'architecture', 'decoder')} (config model)"
        return ModelShape.from_mapping(values, vocab_size=vocab, name=name)
    raise SysModelError("the config names no model shape: give model.shape, base.checkpoint, "
                        "base.lm_config or model.hidden_size/...")


def _task_vocab_size() -> int:
    """Vocabulary of the synthetic arithmetic task's character tokenizer (the supervised
    recipe's model uses exactly this many tokens)."""
    from rl_jax.data.arithmetic import ArithmeticTask
    from rl_jax.data.tokenizer import build_char_tokenizer
    return build_char_tokenizer(ArithmeticTask.ALPHABET).get_vocab_size()


def recipe_value(config: Any, dotted: str) -> Any:
    """``config``'s value of the recipe field ``dotted`` (``"trainer.logits_block_size"``), or
    the schema's default when the config does not set it."""
    value = get(config, dotted)
    if value is not None:
        return value
    node: Any = schema.defaults()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def rollout_settings(config: Any) -> dict[str, Any]:
    """Rollout shape, staleness bound, mode and generator settings, with defaults filled in;
    ``defaulted`` lists the fields the config did not set."""
    if get(config, "recipe") == "rl":
        try:
            recipe = checks.parse(config, registries=False)
        except schema.RLConfigError as e:
            raise SysModelError(str(e)) from None
        out: dict[str, Any] = {k: getattr(recipe.rollout, k) for k in ROLLOUT_FIELDS}
        out["mode"] = recipe.mode
        defaulted = [k for k in (*ROLLOUT_FIELDS, "mode")
                     if get(config, k if k == "mode" else f"rollout.{k}") is None]
    else:
        out, defaulted = {}, []
        for key in (*ROLLOUT_FIELDS, "mode"):
            dotted = key if key == "mode" else f"rollout.{key}"
            if get(config, dotted) is None:
                defaulted.append(key)
            out[key] = recipe_value(config, dotted)
    out["prompt_len"] = get(config, "rollout.prompt_len") or get(config,
                                                                "rollout.max_prompt_tokens")
    if out["prompt_len"] is None:
        out["prompt_len"], _ = PROMPT_LEN, defaulted.append("prompt_len")
    out["dtype"] = get(config, "generator.dtype") or get(config, "model.dtype")
    out["param_dtype"] = get(config, "model.param_dtype")
    out["defaulted"] = defaulted
    return out
