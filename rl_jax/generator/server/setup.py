"""What a generator server loads before it serves: its settings checked, its meshes, the
checkpoint and tokenizer, the KV cache's size, and the engine over them (:func:`build_engine`).
The HTTP application around the engine is :mod:`rl_jax.generator.server.app`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax

from rl_jax.generator.engine.config import EngineConfig
from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.weights import generator_rules, load_params, make_generator_meshes
from rl_jax.generator.server.config import (ServerConfig, check_server_config, device_memory,
                                            kv_cache_budget, resolve_auto)
from rl_jax.models.config import DTYPES, ConfigError, eos_ids
from rl_jax.models.hf import load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BuiltEngine:
    """An engine serving ``config``'s checkpoint, with what the server keeps beside it."""

    engine: Engine
    config: ServerConfig  # with its automatic settings resolved (resolve_auto)
    tokenizer: Any  # None when the checkpoint has no tokenizer.json
    mesh: Any  # the first replica's mesh (None: one device)
    rules: Any  # the sharding rules the weights are placed by
    dtype: Any


def build_engine(config: ServerConfig, engine_class: type = Engine) -> BuiltEngine:
    """Resolves and checks ``config`` (:class:`ConfigError` naming the bad setting), builds the
    meshes, loads the checkpoint (and its tokenizer, if any), sizes the KV cache
    (``kv_cache_bytes``, or ``mem_fraction_static`` of device memory less the weights and their
    decode layout) and starts an ``engine_class`` over them."""
    config = resolve_auto(config)
    check_server_config(config)
    dtype = DTYPES[config.dtype]
    meshes = None  # one device
    if config.tensor_parallel * config.data_parallel > 1:
        meshes = make_generator_meshes(config.tensor_parallel, config.data_parallel)
    mesh = meshes[0] if meshes else None
    rules = generator_rules()
    model_config, params = load_params(config.model, mesh=mesh, rules=rules, dtype=dtype)
    tokenizer = None
    if (Path(config.model) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(config.model)
    kv_cache_bytes = config.kv_cache_bytes
    if config.mem_fraction_static:
        # The engine holds the parameters and their decode layout (the same bytes again).
        weight_bytes = 2 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        try:
            kv_cache_bytes = kv_cache_budget(
                config.mem_fraction_static, device_memory(devices, config.data_parallel),
                weight_bytes)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    engine = engine_class(model_config, params, version=config.weight_version, meshes=meshes,
                          rules=rules, dtype=dtype, eos_token_ids=eos_ids(model_config),
                          engine_config=EngineConfig(
                              max_slots=config.max_slots, max_seq_len=config.max_seq_len,
                              max_waiting=config.max_waiting,
                              max_prefill_tokens=config.max_prefill_tokens,
                              decode_steps=config.decode_steps,
                              attention=config.attention_backend,
                              prefill_attention=config.prefill_attention_backend,
                              page_size=config.page_size,
                              kv_cache_bytes=kv_cache_bytes))
    usage = engine.cache_usage()
    log.info("KV cache: %d pages of %d tokens (%.1f MiB over %d replicas)", usage["pages"],
             usage["page_size"], usage["bytes"] / 2**20, engine.data_parallel)
    return BuiltEngine(engine, config, tokenizer, mesh, rules, dtype)
