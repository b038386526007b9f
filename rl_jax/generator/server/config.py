"""The generator server's settings (:class:`ServerConfig`, the flags of
:mod:`rl_jax.generator.server.serve`), their checks, and how the automatic ones resolve for a
backend."""

from __future__ import annotations

import dataclasses

from rl_jax.generator import auth
from rl_jax.generator.engine import kernels
from rl_jax.models import fused_attention
from rl_jax.models.config import DTYPES, ConfigError


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str  # HF checkpoint directory (config.json, *.safetensors, optional tokenizer.json)
    host: str = "127.0.0.1"
    port: int = 30000  # 0 picks a free port (printed in the ready line)
    max_slots: int = 32
    max_seq_len: int = 512
    max_waiting: int = 4096
    max_prefill_tokens: int = 2048
    # "auto": bfloat16 on accelerators, float32 on CPUs (see resolve_auto)
    dtype: str = "auto"
    tensor_parallel: int = 1
    data_parallel: int = 1  # replicas of the model, each on tensor_parallel devices of its own
    # decode steps run as one program, admissions between programs (SGLang's
    # --num-continuous-decode-steps; see EngineConfig.decode_steps); 0: auto (resolve_auto)
    decode_steps: int = 0
    # decode attention (SGLang's --attention-backend): "auto" | "native" | "xla"
    # (see EngineConfig.attention)
    attention_backend: str = "auto"
    # prefill attention (SGLang's --prefill-attention-backend): "auto" | "xla" | "cudnn" |
    # "splash" (see EngineConfig.prefill_attention)
    prefill_attention_backend: str = "auto"
    # The paged KV cache (see EngineConfig): positions per page (SGLang's --page-size), and
    # its size per data-parallel replica, either in bytes (kv_cache_bytes) or, like SGLang's
    # --mem-fraction-static, as the share of a replica's memory (GPU/TPU memory; on CPU, the
    # host's memory over the replicas) that weights (parameters and their decode layout) and
    # the cache may take together. Both 0: max_slots × max_seq_len positions.
    page_size: int = 64
    kv_cache_bytes: int = 0
    mem_fraction_static: float = 0.0
    weight_version: int = 0
    strict: bool = True  # refuse sampling controls the engine cannot honour (else ignore them)
    warmup: bool = True  # compile prefill/decode before reporting ready
    warmup_shapes: bool = False  # ... every decode batch size and length (slower start)
    served_model_name: str | None = None
    parent_pid: int = 0  # when > 0, exit once that process is gone (set by the pool launcher)
    # The weight publisher of /update_weights_from_transfer: the only one this server pulls
    # from, and the only address its transfer token ($RL_JAX_TRANSFER_TOKEN) is sent to.
    publisher_url: str | None = None
    # With a publisher_url: pull the newest published version (if any) before serving, so a
    # server (re)started during a run never answers with weights older than the run's.
    pull_on_start: bool = True
    # API key and admin API key (rl_jax.generator.auth; never shown in a repr or a log)
    keys: auth.Keys = auth.NO_KEYS
    # Request bounds, checked before a request costs memory or time. Bodies larger than this
    # are refused (413) before they are read in full.
    max_request_bytes: int = 64 << 20
    # Characters of one prompt text tokenised at most; 0: derived from the tokenizer, twice
    # max_seq_len times its longest token (longer text could not fit max_seq_len).
    max_text_chars: int = 0
    # Seconds a connection may take to send a request's headers, and stay idle between
    # requests (aiohttp's keep-alive timer covers both; uvicorn, in front of SGLang, closes
    # idle ones after 5 s). Above the 15 s an aiohttp client keeps idle connections, so a
    # client never reuses one the server is closing.
    keepalive_timeout_s: float = 20.0
    # Seconds a request's body may take to arrive.
    body_timeout_s: float = 60.0


ACCELERATOR_DECODE_STEPS = 8


def resolve_auto(config: ServerConfig, backend: str | None = None) -> ServerConfig:
    """``config`` with its automatic settings made concrete for ``backend`` (default: JAX's):
    ``dtype="auto"`` is bfloat16 on accelerators and float32 on CPUs; ``decode_steps=0`` is
    :data:`ACCELERATOR_DECODE_STEPS` on accelerators (the host would otherwise launch every
    step's program and read its tokens back between steps) and 1 on CPUs (where a step is long
    enough that per-step host work is a small share, and admissions wait for a program's end)."""
    if config.dtype != "auto" and config.decode_steps != 0:
        return config
    import jax
    accelerator = (backend or jax.default_backend()) != "cpu"
    return dataclasses.replace(
        config,
        dtype=("bfloat16" if accelerator else "float32") if config.dtype == "auto"
        else config.dtype,
        decode_steps=(ACCELERATOR_DECODE_STEPS if accelerator else 1)
        if config.decode_steps == 0 else config.decode_steps)


def check_server_config(config: ServerConfig):
    """Refuses (:class:`ConfigError`, naming the setting) settings no engine can run with;
    ``config``'s automatic settings must be resolved (:func:`resolve_auto`)."""
    for name in ("max_slots", "max_seq_len", "max_waiting", "max_prefill_tokens",
                 "tensor_parallel", "data_parallel", "decode_steps"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.page_size < 1:
        raise ConfigError(f"page_size must be >= 1, got {config.page_size}")
    if config.kv_cache_bytes < 0:
        raise ConfigError(f"kv_cache_bytes must be >= 0, got {config.kv_cache_bytes}")
    if not 0 <= config.mem_fraction_static < 1:
        raise ConfigError(f"mem_fraction_static must be in [0, 1), got "
                          f"{config.mem_fraction_static}")
    if config.kv_cache_bytes and config.mem_fraction_static:
        raise ConfigError("give kv_cache_bytes or mem_fraction_static, not both")
    if config.max_slots % config.data_parallel:
        raise ConfigError(f"max_slots={config.max_slots} must split evenly over "
                          f"data_parallel={config.data_parallel} replicas")
    if config.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
    if config.attention_backend not in kernels.BACKENDS:
        raise ConfigError(f"attention_backend must be one of {kernels.BACKENDS}, got "
                          f"{config.attention_backend!r}")
    if config.prefill_attention_backend not in fused_attention.IMPLEMENTATIONS:
        raise ConfigError(f"prefill_attention_backend must be one of "
                          f"{fused_attention.IMPLEMENTATIONS}, got "
                          f"{config.prefill_attention_backend!r}")


def text_limit(tokenizer, max_seq_len: int) -> int | None:
    """Characters of text that may be tokenised for one prompt: twice what ``max_seq_len``
    tokens of the tokenizer's longest token could spell (None without a tokenizer)."""
    if tokenizer is None:
        return None
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max_seq_len * max(longest, 1)


def kv_cache_budget(mem_fraction: float, device_bytes: int, weight_bytes: int) -> int:
    """Bytes of KV cache when weights and cache may take ``mem_fraction`` of ``device_bytes``
    together (SGLang's ``--mem-fraction-static``), the weights ``weight_bytes``. Raises
    ValueError naming the fraction when nothing is left for the cache."""
    if not 0 < mem_fraction < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction}")
    budget = int(mem_fraction * device_bytes) - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"mem_fraction_static={mem_fraction} of {device_bytes / 2**30:.2f} GiB leaves "
            f"nothing for the KV cache beside {weight_bytes / 2**30:.2f} GiB of weights")
    return budget


def device_memory(devices, replicas: int) -> int:
    """Memory of one replica's ``devices``: their accelerator memory (``memory_stats``'
    ``bytes_limit``), or on CPU the host's physical memory over the ``replicas``."""
    import os
    limits = []
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if limits and len(limits) == len(devices):
        return sum(limits)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(replicas, 1)
