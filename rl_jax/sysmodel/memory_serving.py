"""Memory per device of a generator server, and the host memory of a run outside XLA, from the
model's shape (the trainer's step: :mod:`rl_jax.sysmodel.memory`)."""

from __future__ import annotations

import dataclasses

from rl_jax.sysmodel.accelerators import dtype_bytes
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.memory import MemoryBreakdown, _cdiv, _positive
from rl_jax.sysmodel.shape import ModelShape

# Positions per page of the generator's KV cache
# (rl_jax.generator.engine.kv_cache.DEFAULT_PAGE_SIZE,
# SGLang's --page-size): the systems model imports nothing of the runtime.
DEFAULT_PAGE_SIZE = 64


# ---- the generator ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GeneratorMemory(MemoryBreakdown):
    """:func:`generator_memory`'s breakdown; ``notes["programs"]`` has the bytes the prefill and
    decode programs hold (their arguments, outputs and temporaries)."""


def generator_memory(shape: ModelShape, *, tensor_parallel: int = 1, max_slots: int,
                     max_seq_len: int, dtype: str = "bfloat16", prefill_tokens: int = 2048,
                     prefill_len: int | None = None, cache_dtype: str | None = None,
                     swap: bool = True, page_size: int = DEFAULT_PAGE_SIZE,
                     kv_cache_bytes: int = 0) -> GeneratorMemory:
    """Bytes per device of one generator server (``rl_jax.generator.engine.runner.ModelRunner``
    under
    the engine), tensor parallel over ``tensor_parallel`` chips (``generator_rules()``: heads,
    MLP and vocabulary split; the hidden axis whole).

    Terms:
      params: the parameters as the trainer lays them out, in ``dtype`` (the engine keeps them
        for prefill and as the reference of weight updates).
      decode_weights: ``prepare_decode_weights``: every layer's matrices re-laid out (fused
        q/k/v, fused gate/up) in ``dtype``, and the unembedding ``[D, V]`` (a transposed copy
        when tied; an untied head of the same dtype is the parameter itself).
      kv_cache: ``ModelRunner.cache_bytes``, the page pool: ``kv_cache_bytes`` (the server's
        ``--kv_cache_bytes`` or what ``--mem_fraction_static`` leaves beside the weights, per
        data-parallel replica) rounded down to whole pages of ``page_size`` positions
        (``2·L·page_size·K·Dh`` of ``cache_dtype`` each), as ``Engine`` sizes it: sequences
        take pages for their live tokens only. Without a budget, enough pages for every slot
        to hold ``max_seq_len`` positions. Key/value heads split over the chips (a chip keeps
        at least one head). ``notes["kv_pages"]`` and ``notes["kv_tokens"]`` say what it
        holds.
      weight_update: with ``swap``, a second set of parameters and decode weights, prepared
        while the current ones still decode (``generator.weights.WeightPreparer``).
      prefill / decode: the larger transient of the two programs. Prefill (``runner.prefill``
        on ``prefill_tokens`` tokens in rows of ``prefill_len``, default one row): its keys and
        values ``[L, tokens, K, Dh]``, one layer's live activations per token (the residual
        stream, a norm's float32 values and output ``3D``, then the larger of the attention
        block: q, k, v and its output ``2(H+K)·Dh`` with float32 scores and probabilities
        ``2·H·prefill_len``, and the MLP: gate, up and their product ``3F``) and float32 logits
        per row. A decode step: float32 logits ``[slots, V]`` and the sampler's exponentials.
    """
    _positive(tensor_parallel=tensor_parallel, max_slots=max_slots, max_seq_len=max_seq_len,
              prefill_tokens=prefill_tokens)
    s = shape
    tp = tensor_parallel
    c = dtype_bytes(dtype)
    kv_c = dtype_bytes(cache_dtype or dtype)
    d, hd, L, v = s.hidden_size, s.head_dim, s.num_layers, s.vocab_size
    h, k, f = _cdiv(s.num_heads, tp), _cdiv(s.num_kv_heads, tp), _cdiv(s.intermediate_size, tp)
    v_local = _cdiv(v, tp)
    layer = d * (h + 2 * k) * hd + h * hd * d + 3 * d * f + 2 * d
    if s.attention_bias:
        layer += (h + 2 * k) * hd
    if s.output_bias:
        layer += d
    if s.qk_norm:
        layer += 2 * hd
    tables = (1 if s.tie_word_embeddings else 2) * v_local * d
    params = (L * layer + tables + d) * c
    decode = (L * layer + (v_local * d if s.tie_word_embeddings else 0)) * c
    _positive(page_size=page_size)
    if not isinstance(kv_cache_bytes, int) or isinstance(kv_cache_bytes, bool) \
            or kv_cache_bytes < 0:
        raise SysModelError(f"kv_cache_bytes must be an integer >= 0, got {kv_cache_bytes!r}")
    # Engine/ModelRunner: pages of the whole replica's heads; each chip holds its heads' share.
    page_bytes = 2 * L * page_size * s.num_kv_heads * hd * kv_c
    if kv_cache_bytes:
        pages = kv_cache_bytes // page_bytes
        if pages < 1:
            raise SysModelError(f"kv_cache_bytes={kv_cache_bytes} holds no KV-cache page (one "
                                f"page of {page_size} positions takes {page_bytes} bytes)")
    else:
        pages = max_slots * _cdiv(max_seq_len, page_size)
    kv_cache = 2 * L * pages * page_size * k * hd * kv_c
    length = min(prefill_len or prefill_tokens, max_seq_len, prefill_tokens)
    rows = _cdiv(prefill_tokens, length)
    tokens = rows * length
    prefill_kv = 2 * L * tokens * k * hd * c
    # A forward pass frees what it no longer needs: per token the residual stream, a norm's
    # float32 values and its output, then the larger of the attention block (q, k, v, the
    # attention output, float32 scores and probabilities) and the MLP (gate, up, product).
    attention_block = (2 * h + 2 * k) * hd * c + 2 * h * length * 4
    prefill_layer = tokens * (2 * d * c + d * 4 + max(attention_block, 3 * f * c))
    prefill = prefill_kv + prefill_layer + rows * v_local * 4
    decode_logits = 2 * max_slots * v_local * 4
    terms = {"params": float(params), "decode_weights": float(decode),
             "kv_cache": float(kv_cache)}
    if swap:
        terms["weight_update"] = float(params + decode)
    phase = "prefill" if prefill >= decode_logits else "decode"
    terms[phase] = float(max(prefill, decode_logits))
    # What each compiled program holds: prefill reads the parameters; a decode step reads the
    # decode weights (layers, the input embedding and the unembedding) and the cache.
    programs = {"prefill": float(params + prefill),
                "decode": float((L * layer + 2 * v_local * d + d) * c + kv_cache
                                + decode_logits)}
    return GeneratorMemory(terms, float(sum(terms.values())), phase, notes={
        "prefill_rows": rows, "prefill_len": length, "programs": programs, "kv_pages": pages,
        "kv_tokens": pages * page_size, "page_size": page_size})


# ---- the host, outside XLA -----------------------------------------------------------------

# Resident bytes of one trainer or generator process beyond its arrays (Python, JAX's runtime,
# compiled programs): ~0.5 GiB each at the tiny shape on this project's CPU machines.
RUNTIME_BYTES = 2 ** 29
# Staging slots of the publisher's host versions (rl_jax.transfer.publisher.staging.HostStaging): a
# server pulling over shared memory holds the slot of its live version while the next version
# is written into another; more slots are made only while pullers hold older ones.
STAGING_SLOTS = 2


def host_memory(shape: ModelShape, *, publish_dtype: str = "bfloat16",
                staging_slots: int = STAGING_SLOTS, processes: int = 2,
                runtime_bytes: int = RUNTIME_BYTES) -> MemoryBreakdown:
    """Host bytes of an RL run that no XLA program's memory analysis sees, to be added to the
    trainer's and the generators' :func:`trainer_memory` / :func:`generator_memory` when they
    share a host (a CPU machine; on accelerators these bytes are host RAM, not device memory).

    Terms:
      staging: the weight publisher's host staging slots (``shm`` and ``socket`` transports,
        files in ``/dev/shm``): ``staging_slots`` whole versions in the generators' dtype
        ``publish_dtype``. A server that pulls over shared memory keeps arrays that alias its
        slot's bytes, so with the generator's ``params`` term these bytes are counted twice:
        the sum is an upper bound by one version per server.
      runtime: ``processes`` × ``runtime_bytes`` (Python, JAX's runtime, compiled programs;
        one trainer process and one per generator server).
    """
    _positive(staging_slots=staging_slots, processes=processes)
    if not isinstance(runtime_bytes, int) or runtime_bytes < 0:
        raise SysModelError(f"runtime_bytes must be an integer >= 0, got {runtime_bytes!r}")
    terms = {"staging": float(staging_slots * shape.weight_bytes(publish_dtype)),
             "runtime": float(processes * runtime_bytes)}
    return MemoryBreakdown(terms, float(sum(terms.values())), notes={
        "staging_slots": staging_slots, "processes": processes})
