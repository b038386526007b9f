"""The engine's settings: slots, lengths and queue limits, multi-step decoding, the decode
attention, and the paged KV cache's size and admission reserve (:class:`EngineConfig`, checked
when made; :class:`rl_jax.generator.engine.core.Engine` takes one)."""

from __future__ import annotations

import dataclasses

from rl_jax.generator.engine import kernels
from rl_jax.generator.engine.kv_cache import DEFAULT_PAGE_SIZE
from rl_jax.generator.types import GeneratorError
from rl_jax.models import fused_attention


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 32  # sequences decoded together (KV-cache slots)
    max_seq_len: int = 512  # prompt + completion tokens per slot
    max_waiting: int = 4096  # queued sequences before requests are refused (Overloaded)
    max_prefill_tokens: int = 2048  # prompt tokens prefilled per scheduler iteration
    min_prefill_bucket: int = 16
    # On a weight update, keep running sequences' KV cache (PipelineRL: cheap, the prefix's keys
    # and values stay those of the old weights) or recompute it under the new weights (exact
    # new-policy probabilities from the update on, at the cost of one prefill per sequence).
    recompute_kv_on_update: bool = False
    # Decode steps run as one program, their tokens read back together (SGLang's
    # --num-continuous-decode-steps): the per-step host work and program launch are shared by
    # that many tokens, which is most of a step at small batches. A sequence that stops inside
    # such a run has its later tokens dropped (computed in vain), and admissions and weight
    # swaps wait for the run's end.
    decode_steps: int = 1
    # Decode attention: "auto" (on CPU the native kernel where it runs, on GPU the Pallas one
    # where it compiles, else XLA's), "native", "pallas" or "xla" (see
    # rl_jax.generator.engine.kernels
    # and ModelRunner).
    attention: str = "auto"
    # Prefill attention (SGLang's --prefill-attention-backend): "auto" (cuDNN flash attention
    # on NVIDIA GPUs, splash on TPUs, for the prompt buckets they take, else XLA's), "xla",
    # "cudnn" or "splash" (see rl_jax.models.fused_attention and ModelRunner).
    prefill_attention: str = "auto"
    # Positions per page of the paged KV cache (SGLang's --page-size).
    page_size: int = DEFAULT_PAGE_SIZE
    # Bytes of KV cache per data-parallel replica (the page pool: keys and values of every
    # layer); 0: enough for every slot to hold max_seq_len positions (max_slots × max_seq_len).
    kv_cache_bytes: int = 0
    # Admission reserves this share of the pages running sequences may still take (SGLang's
    # new-token ratio): it starts at init_new_token_ratio, decays to min_new_token_ratio over
    # new_token_ratio_decay_steps decode steps, and returns to the start when sequences had to
    # be retracted for want of pages.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay_steps: int = 600

    def __post_init__(self):
        if self.decode_steps < 1:
            raise GeneratorError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.page_size < 1:
            raise GeneratorError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_cache_bytes < 0:
            raise GeneratorError(f"kv_cache_bytes must be >= 0 (0: max_slots x max_seq_len), "
                                 f"got {self.kv_cache_bytes}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise GeneratorError(
                f"need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1, got "
                f"{self.min_new_token_ratio} and {self.init_new_token_ratio}")
        if self.new_token_ratio_decay_steps < 1:
            raise GeneratorError(f"new_token_ratio_decay_steps must be >= 1, got "
                                 f"{self.new_token_ratio_decay_steps}")
        if self.attention not in kernels.BACKENDS:
            raise GeneratorError(f"attention must be one of {kernels.BACKENDS}, got "
                                 f"{self.attention!r}")
        if self.prefill_attention not in fused_attention.IMPLEMENTATIONS:
            raise GeneratorError(f"prefill_attention must be one of "
                                 f"{fused_attention.IMPLEMENTATIONS}, got "
                                 f"{self.prefill_attention!r}")
