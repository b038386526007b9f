"""Memory per device of the trainer's step and of a generator server, from the model's shape
(the generator's and the host's terms: :mod:`rl_jax.sysmodel.memory_serving`).

Planned, not discovered: the planner rejects a layout whose trainer or generator does not fit
before anything is compiled. Every term below is an array the code builds, sized per device by
the sharding rules of :mod:`rl_jax.sharding` (``ShardingRules.default()`` for the trainer,
``generator_rules()`` for the generator); the docstrings name the code each term comes from.

Symbols: ``L`` layers, ``D`` hidden, ``F`` MLP hidden, ``H`` query heads, ``K`` key/value heads,
``Dh`` head dim, ``V`` vocabulary, ``B×T`` the batch (rows × tokens), mesh ``(data, fsdp,
tensor)``, ``c`` bytes of the computation dtype, ``p`` of the parameter dtype.

Trainer (``rl_jax.trainer.step.make_train_step``, state donated so outputs reuse the inputs):

- *state*: parameters (``p`` bytes) and AdamW's two moments (optax keeps them in the parameter
  dtype), split over ``fsdp`` (the ``embed`` axis) and ``tensor`` (heads, MLP, vocabulary);
  norms are replicated. Replicated over ``data``.
- *grads*: one gradient per parameter (``p`` bytes; on XLA's CPU backend float32, plus the cast
  to a narrower parameter dtype), live from the backward pass through the update (the
  global-norm clip reads all of them before any update).
- *accumulator*: with gradient accumulation over micro-batches (``accumulation``), the float32
  sum of their gradients, whatever the parameter dtype: the carry of ``make_train_step``'s
  ``lax.scan`` over micro-batches, or ``StreamingTrainStep``'s accumulator, which lives
  between its accumulation programs and its update program.
- *compute copies*: without remat and with a computation dtype other than the parameters',
  the layers' weights cast to the computation dtype, kept as residuals of the matmuls.
- *saved activations*: what the ``lax.scan`` over layers keeps for the backward pass, stacked
  ``[L, ...]``, per remat policy (:func:`saved_bytes_per_token`); tokens are split over
  ``data × fsdp`` (``act_batch``), heads and MLP over ``tensor``.
- the largest transient phase (:class:`TrainerMemory` names it ``peak_phase``):
  *logits*: the blockwise log-probability backward over the vocabulary
  (``rl_jax.models.logprobs``): the unembedding cast and laid out in ``[nb, D, block]`` blocks,
  its gradient in that layout, and ``[tokens, block]`` float32 blocks of logits and their
  cotangents; *layer*: the backward of one decoder layer (what the remat policy recomputes,
  the attention scores when materialised, and the cotangents); both next to the saved
  activations. *embedding*: the end of the backward pass, where the embedding lookup's
  gradient is scattered into a full ``[V, D]`` table (the lookup gathers the whole table:
  ``Transformer.__call__`` constrains it to be replicated; a streaming accumulation scatters
  it into its accumulator) beside the unembedding's gradient;
  *update* (XLA's CPU backend only): the optimizer update, which that backend does not do in
  place on the donated state (:func:`_cpu_update_bytes`).
- *ema*: a parameter average (``trainer.ema_decay``), beside the step.

With a streaming accumulation the model gives each compiled program's bytes
(``notes["programs"]``: ``accumulate`` takes the parameters and the accumulator, ``apply`` the
state and the accumulator) and, as ``total``, the process's: the moments beside the
accumulation program. Host memory outside XLA (the publisher's staging slots, each process's
runtime) is :func:`~rl_jax.sysmodel.memory_serving.host_memory`'s.

``backend="cpu"`` models what XLA's CPU backend compiles (the validation tests compile there);
``"accelerator"`` what GPU/TPU backends keep: the computation dtype, fused elementwise work and
in-place updates. One H100 (jax 0.11.2, bf16 compute, f32 parameters, qwen2.5-0.5b, cuDNN
attention where it applied) compiled 8.86 GiB at 8×1024 tokens with full remat (this model:
8.75 GiB fused), 10.61 GiB at 16×1024 (9.81), 13.16 GiB at 8×1024 with ``dots`` (13.39) and
87.15 GiB at 16×1024 without remat (79.65 with materialised scores).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_jax.sysmodel.accelerators import dtype_bytes
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.shape import ModelShape

REMAT_POLICIES = ("none", "full", "dots")
ATTENTION = ("materialised", "fused")
BACKENDS = ("accelerator", "cpu")
ACCUMULATION = ("none", "scan", "streaming")
GiB = 2 ** 30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device by term; ``total`` is what must fit on one device."""

    terms: dict[str, float]
    total: float
    peak_phase: str = ""
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"terms": dict(self.terms), "total": self.total, "peak_phase": self.peak_phase,
                **self.notes}

    def describe(self) -> str:
        """``12.3 GiB (state 5.5 + grads 1.8 + ...)``: the terms over 1% of the total."""
        parts = [f"{name} {value / GiB:.2f}" for name, value in self.terms.items()
                 if value >= 0.01 * self.total]
        phase = f"; peak in {self.peak_phase}" if self.peak_phase else ""
        return f"{self.total / GiB:.2f} GiB ({' + '.join(parts)} GiB{phase})"


def _check_mesh(mesh: tuple[int, int, int]) -> tuple[int, int, int]:
    if len(mesh) != 3 or any(not isinstance(m, int) or isinstance(m, bool) or m < 1
                             for m in mesh):
        raise SysModelError(f"mesh must be three positive integers (data, fsdp, tensor), got "
                            f"{mesh!r}")
    return tuple(mesh)


def _positive(**values: int):
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SysModelError(f"{name} must be a positive integer, got {value!r}")


# ---- parameters per device -------------------------------------------------------------------

def param_elements_per_device(shape: ModelShape, fsdp: int, tensor: int) -> int:
    """Parameter elements one device holds under ``ShardingRules.default()``: matrices split
    over ``fsdp`` (their ``embed`` axis) and ``tensor`` (``vocab``, heads or ``mlp``); q/k/v
    biases over ``tensor``; the output bias over ``fsdp``; norms replicated. A dimension the
    mesh does not divide is counted rounded up (the largest shard)."""
    s = shape
    d, f, h, k, hd, v = (s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads,
                         s.head_dim, s.vocab_size)
    dd = _cdiv(d, fsdp)
    layer = (dd * _cdiv(h, tensor) * hd + 2 * dd * _cdiv(k, tensor) * hd  # wq, wk, wv
             + _cdiv(h, tensor) * hd * dd  # wo
             + 3 * dd * _cdiv(f, tensor)  # w_gate, w_up, w_down
             + 2 * d)  # attn_norm, mlp_norm
    if s.attention_bias:
        layer += (_cdiv(h, tensor) + 2 * _cdiv(k, tensor)) * hd
    if s.output_bias:
        layer += dd
    if s.qk_norm:
        layer += 2 * hd
    tables = (1 if s.tie_word_embeddings else 2) * _cdiv(v, tensor) * dd
    return s.num_layers * layer + tables + d


def layer_elements_per_device(shape: ModelShape, fsdp: int, tensor: int) -> int:
    """The decoder layers' share of :func:`param_elements_per_device` (the stacked ``[L, ...]``
    leaves: everything but the embedding tables and the final norm)."""
    s = shape
    dd = _cdiv(s.hidden_size, fsdp)
    tables = (1 if s.tie_word_embeddings else 2) * _cdiv(s.vocab_size, tensor) * dd
    return param_elements_per_device(s, fsdp, tensor) - tables - s.hidden_size


def largest_leaves_per_device(shape: ModelShape, fsdp: int, tensor: int) -> tuple[int, int]:
    """Elements per device of the largest parameter leaf (an embedding table, ``[V, D]``) and
    of the largest stacked layer leaf (``[L, D, max(F, H·Dh)]``: an MLP matrix)."""
    s = shape
    dd = _cdiv(s.hidden_size, fsdp)
    table = _cdiv(s.vocab_size, tensor) * dd
    layer = s.num_layers * dd * max(_cdiv(s.intermediate_size, tensor),
                                    _cdiv(s.num_heads, tensor) * s.head_dim)
    return table, layer


# Low-rank adapter targets (the names of ``rl_jax.models.lora.TARGETS``, kept here so this
# package imports no JAX).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def lora_elements(shape: ModelShape, rank: int, targets=LORA_TARGETS, fsdp: int = 1,
                  tensor: int = 1) -> int:
    """Adapter elements one device holds: per target ``A [L, in, r]`` and ``B [L, r, out]``,
    their ``in``/``out`` axes split like the weight they adapt (``embed`` over ``fsdp``; heads
    and ``mlp`` over ``tensor``), the rank whole. With ``fsdp = tensor = 1``: the adapters'
    size, what an adapter-only version moves."""
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise SysModelError(f"lora targets must be among {LORA_TARGETS}, got {list(targets)}")
    _positive(rank=rank)
    s = shape
    dd = _cdiv(s.hidden_size, fsdp)
    q = _cdiv(s.num_heads, tensor) * s.head_dim
    kv = _cdiv(s.num_kv_heads, tensor) * s.head_dim
    f = _cdiv(s.intermediate_size, tensor)
    sides = {"q": (dd, q), "k": (dd, kv), "v": (dd, kv), "o": (q, dd), "gate": (dd, f),
             "up": (dd, f), "down": (f, dd)}
    return s.num_layers * rank * sum(sum(sides[t]) for t in targets)


# ---- activations ------------------------------------------------------------------------------

def _activation_bytes(dtype: str, backend: str) -> int:
    """Bytes of an activation computed in ``dtype``: XLA's CPU backend carries bfloat16 and
    float16 products in float32 (the same step compiled in bfloat16 and in float32 has nearly
    the same peak there); accelerators keep the computation dtype."""
    if backend not in BACKENDS:
        raise SysModelError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return 4 if backend == "cpu" else dtype_bytes(dtype)


def _widths(shape: ModelShape, tensor: int) -> tuple[int, int, int, int, int]:
    """``D``, then per device (heads and MLP split over ``tensor``) ``H·Dh``, ``K·Dh``, ``F``
    and ``H``."""
    h = _cdiv(shape.num_heads, tensor)
    return (shape.hidden_size, h * shape.head_dim, _cdiv(shape.num_kv_heads, tensor)
            * shape.head_dim, _cdiv(shape.intermediate_size, tensor), h)


def saved_bytes_per_token(shape: ModelShape, *, remat: str, attention: str, dtype: str,
                          tensor: int = 1, seq: int = 1, backend: str = "accelerator") -> float:
    """Bytes one decoder layer keeps per token for the backward pass (``Transformer.__call__``'s
    ``lax.scan`` stacks them ``[L, ...]``); ``seq`` is the key length of the attention.

    - ``full`` (``jax.checkpoint`` of the layer): its input ``h`` ``[D]`` only.
    - ``dots`` (``dots_with_no_batch_dims_saveable``): the input and the outputs of the
      weight matmuls (einsums without batch dimensions): q, k, v ``(H+2K)·Dh``, the attention
      output projection ``D``, gate and up ``2F``, down ``D``. The attention products have
      batch dimensions: recomputed.
    - ``none``: the residuals of JAX's linearisation of ``decoder_layer``: the input and the
      attention block's output (the norms' inputs) and the two normalised inputs of the
      matmuls ``4D``, the norms' float32 normalised values ``2D``; rotated q and k, v and the
      attention output ``2(H+K)·Dh``; for ``silu(gate)·up``: gate, up, the sigmoid, the silu,
      their product and the silu's derivative ``6F``; for a materialised attention its float32
      masked scores and probabilities ``2·H·S`` (fused kernels keep a float32 log-sum-exp per
      head instead).
    """
    if remat not in REMAT_POLICIES:
        raise SysModelError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    if attention not in ATTENTION:
        raise SysModelError(f"attention must be one of {ATTENTION}, got {attention!r}")
    a = _activation_bytes(dtype, backend)
    d, q, kv, f, h = _widths(shape, tensor)
    if remat == "full":
        return float(d * a)
    if remat == "dots":
        return float((3 * d + q + 2 * kv + 2 * f) * a)
    scores = 2 * h * seq * 4 if attention == "materialised" else 2 * h * 4
    return float((4 * d + 2 * q + 2 * kv + 6 * f) * a + 2 * d * 4 + scores)


def layer_backward_bytes_per_token(shape: ModelShape, *, remat: str, attention: str,
                                   dtype: str, tensor: int = 1, seq: int = 1,
                                   backend: str = "accelerator") -> float:
    """Bytes per token of one layer's backward beyond what is saved: what the remat policy
    recomputes (``full``: all of :func:`saved_bytes_per_token` with ``none``; ``dots``: what
    ``none`` keeps beyond ``dots``) and the cotangents: float32 at the residual stream ``2D``,
    q, k, v and the attention output ``2(H+K)·Dh``, the MLP's ``3F``, and for a materialised
    attention the float32 cotangent of the scores ``H·S`` (the softmax's backward is one
    fusion from the probabilities' cotangent to the scores')."""
    a = _activation_bytes(dtype, backend)
    d, q, kv, f, h = _widths(shape, tensor)
    scores = h * seq * 4 if attention == "materialised" else 0
    cotangents = 2 * d * 4 + (2 * q + 2 * kv + 3 * f) * a + scores
    kw = dict(attention=attention, dtype=dtype, tensor=tensor, seq=seq, backend=backend)
    everything = saved_bytes_per_token(shape, remat="none", **kw)
    if remat == "full":
        recompute = everything
    elif remat == "dots":
        recompute = everything - saved_bytes_per_token(shape, remat="dots", **kw)
    else:
        recompute = 0.0
    return float(recompute + cotangents)


# ---- the trainer -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainerMemory(MemoryBreakdown):
    """:func:`trainer_memory`'s breakdown: ``params``, ``moments``, the gradients (``grads``,
    ``accumulator``), ``compute_copies``, ``saved_activations`` and the peak phase's transient,
    plus ``ema`` when kept; ``notes["transients"]`` has every phase's, ``notes["programs"]``
    the bytes of each compiled program (what ``memory_analysis()`` reports: arguments +
    outputs - aliased + temporaries) and ``notes["phases"]`` every phase's live bytes."""


def _cpu_update_bytes(elements: int, p: int, table: int, layer_leaf: int) -> float:
    """Temporaries of the optimizer update on XLA's CPU backend, which does not update the
    donated state in place (buffer assignments of ``apply_gradients``, qwen2.5-0.5b at 2-24
    layers): float32 parameters keep the gradient divided by the denominator (every leaf) and
    the new values of the largest leaf and of two of the largest layer leaves; parameters of a
    narrower dtype get new parameters and both moments for every leaf (the update is computed
    in float32 and cast back)."""
    if p >= 4:
        return float(elements * p + (table + 2 * layer_leaf) * p)
    return float(3 * elements * p)


def trainer_memory(shape: ModelShape, *, batch: int, seq: int,
                   mesh: tuple[int, int, int] = (1, 1, 1), dtype: str = "bfloat16",
                   param_dtype: str = "float32", remat: str = "full", logits_block: int = 4096,
                   attention: str = "materialised", backend: str = "accelerator",
                   accumulation: str = "none", ema: bool = False, lora_rank: int = 0,
                   lora_targets=LORA_TARGETS) -> TrainerMemory:
    """Peak bytes per device of one train step on micro-batches of ``batch × seq`` tokens (the
    module docstring lists the terms).

    Args:
      shape: the model.
      batch, seq: rows and tokens per row of the (micro-)batch the step compiles for.
      mesh: ``(data, fsdp, tensor)`` device counts.
      dtype, param_dtype: computation and parameter dtypes.
      remat: the layer's rematerialisation (``ModelSpec(remat=...)``).
      logits_block: vocabulary columns per block of the log-probabilities
        (``trainer.logits_block_size``).
      attention: ``"materialised"`` (XLA's ``dot_product_attention``: ``[B, H, T, S]`` float32
        scores) or ``"fused"`` (cuDNN/splash kernels: no scores in memory).
      backend: ``"accelerator"`` (GPU/TPU) or ``"cpu"``: XLA's CPU backend carries bfloat16
        products in float32 and does not fuse the elementwise work of the blockwise
        log-probabilities into their matmuls (five ``[tokens, block]`` float32 arrays live in
        its backward instead of two), as its buffer assignment shows.
      accumulation: how gradients of several micro-batches are summed (always in float32):
        ``"none"`` (one batch: ``make_train_step(num_microbatches=1)``), ``"scan"``
        (``make_train_step(num_microbatches>1)``: a ``lax.scan`` over micro-batches in one
        program) or ``"streaming"`` (``StreamingTrainStep``, the RL trainer with
        ``trainer.micro_batch_rows``: an accumulation program per micro-batch, then an update
        program; the accumulator lives between them, and the moments, not arguments of the
        accumulation program, beside it).
      ema: an exponential moving average of the parameters is kept (``trainer.ema_decay``):
        one more copy of the parameters, outside the compiled step.
      lora_rank, lora_targets: low-rank adapters train (``lora.enabled``): the base is
        ``frozen`` in the computation dtype (XLA's CPU backend also keeps the layers' stacks
        cast to float32 when that dtype is narrower); parameters, moments and gradients are the
        adapters' (:func:`lora_elements`); the unembedding's blocks carry no gradient, and no
        embedding gradient is scattered (no ``embedding`` phase).
    """
    data, fsdp, tensor = _check_mesh(mesh)
    _positive(batch=batch, seq=seq, logits_block=logits_block)
    if accumulation not in ACCUMULATION:
        raise SysModelError(f"accumulation must be one of {ACCUMULATION}, got "
                            f"{accumulation!r}")
    kw = dict(remat=remat, attention=attention, dtype=dtype, tensor=tensor, seq=seq,
              backend=backend)
    saved_per_token = saved_bytes_per_token(shape, **kw)  # checks remat, attention, backend
    s = shape
    c, p = dtype_bytes(dtype), dtype_bytes(param_dtype)
    d, v, L = s.hidden_size, s.vocab_size, s.num_layers
    n = _cdiv(batch, data * fsdp) * seq  # tokens per device
    elements = param_elements_per_device(s, fsdp, tensor)
    cpu = backend == "cpu"

    lora = lora_rank > 0
    trainable = lora_elements(s, lora_rank, lora_targets, fsdp, tensor) if lora else elements
    frozen = elements * c if lora else 0
    params = trainable * p
    moments = 2 * trainable * p
    # The backward's gradients: in the parameter dtype; XLA's CPU backend computes them in
    # float32 and casts the stacked result, so a narrower parameter dtype has both.
    grads = trainable * (4 + (p if p < 4 else 0)) if cpu else trainable * p
    accumulator = trainable * 4 if accumulation != "none" else 0
    if lora and remat == "dots":
        # The dots policy also saves the adapters' matmul outputs: each target's low-rank
        # product [r] and its delta at the target's output width.
        a = _activation_bytes(dtype, backend)
        _, q, kv, f, _ = _widths(s, tensor)
        width = {"q": q, "k": kv, "v": kv, "o": d, "gate": f, "up": f, "down": d}
        saved_per_token += sum(width[t] + lora_rank for t in lora_targets) * a
    saved = L * n * saved_per_token
    # Without remat the backward keeps each layer's weights cast to the computation dtype (the
    # matmuls' residuals), stacked [L, ...]; a rematerialised layer casts them again. A frozen
    # base already is in that dtype; XLA's CPU backend casts its narrower stacks to float32.
    if lora:
        copies = layer_elements_per_device(s, fsdp, tensor) * 4 if cpu and c < 4 else 0
    else:
        copies = (layer_elements_per_device(s, fsdp, tensor) * c
                  if c != p and remat == "none" else 0)

    # Blockwise log-probabilities (models/logprobs.py): the unembedding [D, V] is all-gathered
    # over fsdp and laid out [nb, D, block] in the compute dtype (one copy; one more when it is
    # cast or transposed first: another dtype, or tied to the embedding; split over fsdp when
    # tied, beside the whole lookup table and its gradient). Its gradient is
    # accumulated in that layout (the unembedding's share of ``grads``; a separate array when
    # the dtypes differ, or under fsdp, where it is whole until reduce-scattered). Per block
    # the backward keeps float32 [n, block] logits and cotangents (whole on every
    # tensor-parallel device: the scan's blocks are split, not their columns), and the hidden
    # states' float32 cotangent [n, D].
    block = min(logits_block, v)
    v_local = _cdiv(_cdiv(v, block) * block, tensor)
    retyped = s.tie_word_embeddings or c != p
    n_copies = (2 if retyped else 1) + (1 if c != p or fsdp > 1 else 0)
    if lora:
        # A frozen table: its blocks (on a CPU carried in float32) and no gradient. Under fsdp
        # the blocks stay split and are gathered one at a time, beside (when tied) the
        # lookup's whole gathered table.
        c_table = 4 if cpu else c
        n_copies = 2 if s.tie_word_embeddings else 1
        unembed = n_copies * d * v_local * c_table
        if fsdp > 1:
            unembed = (n_copies * d * _cdiv(v_local, fsdp) * c_table
                       + (v * d if s.tie_word_embeddings else d * block) * c_table)
    elif s.tie_word_embeddings and fsdp > 1:
        # Tied under fsdp: the transposed table's blocks stay split over fsdp, while the
        # lookup's whole gathered table and its whole gradient stay live through the backward.
        unembed = n_copies * d * _cdiv(v_local, fsdp) * c + 2 * v * d * p
    else:
        unembed = n_copies * d * v_local * c
    buffers = 5 if cpu else 2
    logits_phase = unembed + buffers * n * block * 4 + n * d * 4

    layer_phase = n * layer_backward_bytes_per_token(s, **kw)

    # End of the backward pass: the lookup's gradient scattered into a replicated [V, D] table
    # of the parameter dtype (the lookup gathered the whole table), next to the unembedding's
    # gradient still in blocks and re-laid out as [V, D] before the two are reduce-scattered
    # (and added, when tied).
    # A streaming accumulation scatters the lookup's gradient into the donated accumulator.
    split = fsdp if s.tie_word_embeddings else 1  # the tied table's blocks stay split
    embedding_phase = ((v * d * p if accumulation != "streaming" else 0)
                       + d * _cdiv(v_local, split) * (p + c))

    backward = {"logits": logits_phase, "layer": layer_phase}
    if not lora:
        backward["embedding"] = embedding_phase
    # Saved activations (and cast weights) are live through the logits and layer phases; they
    # are freed as the backward scan ends, before the embedding and update phases.
    held = {name: (saved + copies if name in ("logits", "layer") else 0.0) for name in backward}
    # The optimizer update reads the gradient (the float32 accumulator, when accumulating, else
    # the gradient in the parameter dtype) beside the state; on a CPU with its temporaries.
    update_in = accumulator if accumulation != "none" else trainable * p
    table, layer_leaf = largest_leaves_per_device(s, fsdp, tensor) if not lora else (0, 0)
    update = _cpu_update_bytes(trainable, p, table, layer_leaf) if cpu else 0.0

    # Live bytes of each phase. The accumulation program of the streaming step takes the
    # parameters and the accumulator, not the moments.
    state = params + moments + frozen
    weights = params + frozen if accumulation == "streaming" else state
    phases = {name: weights + accumulator + grads + held[name] + value
              for name, value in backward.items()}
    phases["update"] = state + update_in + update
    transients = {**backward, "update": update}
    if accumulation == "streaming":
        backward_peak = max(phases[name] for name in backward)
        programs = {"accumulate": float(backward_peak), "apply": float(phases["update"])}
        # The process: the moments live beside the accumulation program.
        phases = {name: value + (moments if name in backward else 0.0)
                  for name, value in phases.items()}
    phase = max(phases, key=phases.get)
    if accumulation != "streaming":
        programs = {"step": float(phases[phase])}
    in_backward = phase in backward
    terms = {"frozen": float(frozen), "params": float(params), "moments": float(moments),
             "grads": float(grads if in_backward else
                            (update_in if accumulation == "none" else 0.0)),
             "accumulator": float(accumulator),
             "compute_copies": float(copies if phase in ("logits", "layer") else 0.0),
             "saved_activations": float(saved if phase in ("logits", "layer") else 0.0),
             phase: float(transients[phase])}
    if ema:
        terms["ema"] = float(params)
    terms = {name: value for name, value in terms.items() if value or name == phase}
    return TrainerMemory(terms, float(sum(terms.values())), phase, notes={
        "tokens_per_device": n, "transients": {k: float(x) for k, x in transients.items()},
        "phases": {k: float(x) for k, x in phases.items()}, "programs": programs,
        "saved_activations_all": float(saved), "accumulation": accumulation})

