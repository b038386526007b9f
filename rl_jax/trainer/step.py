"""The sharded train step: micro-batched gradient accumulation, optimizer update, non-finite guard.

A loss function has the signature ``loss_fn(model, batch) -> (loss_sum, denominator, metrics)``:
an *unreduced* sum and its denominator, so that accumulating both over micro-batches (and,
through the compiler, over shards) gives exactly the full-batch ``loss_sum / denominator``.
Metrics are sums too, except keys ending in ``_max`` (reduced by max) and ``_min`` (by min).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from rl_jax.models.transformer import Transformer
from rl_jax.trainer.state import ModelSpec, TrainState, abstract_state, state_shardings

LossFn = Callable[[Transformer, Any], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class LMBatch:
    """A packed causal-LM batch; every field is ``[B, T]``.

    ``targets[b, t]`` is the token predicted at ``tokens[b, t]``; ``loss_mask`` weights each
    prediction (0 for padding, segment ends and prompt tokens); ``positions`` restart at 0 in
    every segment; ``segment_ids`` are 1, 2, ... per packed sequence and 0 for padding.
    """

    tokens: jax.Array
    targets: jax.Array
    loss_mask: jax.Array
    positions: jax.Array
    segment_ids: jax.Array

    @classmethod
    def abstract(cls, batch_size: int, seq_len: int, sharding=None) -> "LMBatch":
        """Shapes for ahead-of-time compilation."""
        i = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
        f = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32, sharding=sharding)
        return cls(tokens=i, targets=i, loss_mask=f, positions=i, segment_ids=i)

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray]) -> "LMBatch":
        return cls(tokens=np.asarray(arrays["tokens"], np.int32),
                   targets=np.asarray(arrays["targets"], np.int32),
                   loss_mask=np.asarray(arrays["loss_mask"], np.float32),
                   positions=np.asarray(arrays["positions"], np.int32),
                   segment_ids=np.asarray(arrays["segment_ids"], np.int32))


def causal_lm_loss(model: Transformer, batch: LMBatch, *, block_size: int = 4096):
    """Token-level cross-entropy: ``(Σ mask·(−log p), Σ mask, metrics)``."""
    stats = model.token_stats(batch.tokens, batch.targets, batch.positions, batch.segment_ids,
                              block_size=block_size)
    mask = batch.loss_mask.astype(jnp.float32)
    nll = -jnp.sum(stats["logprobs"] * mask)
    denom = jnp.sum(mask)
    metrics = {"nll_sum": jax.lax.stop_gradient(nll), "tokens": denom,
               "correct_tokens": jnp.sum(stats["is_argmax"] * mask),
               "entropy_sum": jax.lax.stop_gradient(jnp.sum(stats["entropy"] * mask))}
    return nll, denom, metrics


def _reduce_metric(name: str, a: jax.Array, b: jax.Array) -> jax.Array:
    if name.endswith("_max"):
        return jnp.maximum(a, b)
    if name.endswith("_min"):
        return jnp.minimum(a, b)
    return a + b


def split_microbatches(batch: Any, num_micro: int) -> Any:
    """``[B, ...]`` → ``[num_micro, B / num_micro, ...]``, taking every ``num_micro``-th row so
    each micro-batch draws rows from every data shard (no shard sits idle)."""
    def split(x):
        b = x.shape[0]
        if b % num_micro:
            raise ValueError(f"batch size {b} is not divisible by {num_micro} micro-batches")
        return jnp.swapaxes(x.reshape((b // num_micro, num_micro) + x.shape[1:]), 0, 1)
    return jax.tree.map(split, batch)


def _grads_fn(spec: ModelSpec, loss_fn: LossFn):
    """``grads_of(params, frozen, batch, step, micro) -> (loss_sum, denominator, metrics,
    grads)``: the gradient with respect to ``params`` only (``frozen``: a LoRA run's base, or
    ``{}``); ``step`` and ``micro`` (int32 scalars) pick adapter-dropout masks."""
    def grads_of(params, frozen, batch, step, micro):
        key = spec.dropout_key(step, micro)

        def micro_loss(p):
            loss_sum, denom, metrics = loss_fn(spec.merge(p, frozen, key), batch)
            return loss_sum, (denom, metrics)
        (loss_sum, (denom, metrics)), grads = jax.value_and_grad(micro_loss, has_aux=True)(params)
        return loss_sum, denom, metrics, grads
    return grads_of


def make_train_step(spec: ModelSpec, tx: optax.GradientTransformation, loss_fn: LossFn, *,
                    num_microbatches: int = 1, batch_sharding: Any = None, donate: bool = True,
                    update_scale: UpdateScale | None = None):
    """A jitted ``step(state, batch) -> (state, metrics)`` with explicit shardings.

    The gradient is ``Σ_micro ∇loss_sum / Σ_micro denominator``. If the loss or the gradient
    norm is not finite, parameters and optimizer state are left unchanged, ``step`` does not
    advance and ``skipped`` is incremented. ``update_scale(metrics)`` (the batch's accumulated
    loss metrics → a scalar) multiplies the optimizer's update, i.e. this step's learning rate
    (e.g. :func:`ess_update_scale`).
    """
    shardings = state_shardings(tx, spec)
    batch_sharding = batch_sharding or default_batch_sharding(spec)

    grads_of = _grads_fn(spec, loss_fn)

    def step(state: TrainState, batch):
        params = state.params
        if num_microbatches == 1:
            loss_sum, denom, metrics, grads = grads_of(params, state.frozen, batch, state.step,
                                                       jnp.int32(0))
        else:
            micro = split_microbatches(batch, num_microbatches)
            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(grads_of, params, state.frozen, first, state.step,
                                    jnp.int32(0))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
            zeros = (zeros[0], zeros[1],
                     {k: _metric_identity(k, v) for k, v in zeros[2].items()},
                     jax.lax.with_sharding_constraint(zeros[3], spec.param_shardings)
                     if spec.mesh is not None else zeros[3])

            def body(acc, xs):
                mb, index = xs
                out = grads_of(params, state.frozen, mb, state.step, index)
                loss_acc = acc[0] + out[0]
                denom_acc = acc[1] + out[1]
                metrics_acc = {k: _reduce_metric(k, acc[2][k], out[2][k]) for k in acc[2]}
                grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc[3], out[3])
                return (loss_acc, denom_acc, metrics_acc, grads_acc), None

            (loss_sum, denom, metrics, grads), _ = jax.lax.scan(
                body, zeros, (micro, jnp.arange(num_microbatches, dtype=jnp.int32)))
        return apply_gradients(state, tx, loss_sum, denom, metrics, grads, update_scale)

    return jax.jit(step, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, spec.replicated()),
                   donate_argnums=(0,) if donate else ())


UpdateScale = Callable[[dict[str, jax.Array]], jax.Array]


def ess_update_scale(power: float = 1.0, floor: float = 0.05) -> UpdateScale:
    """``update_scale`` that multiplies a step's learning rate by ``max(ESS, floor) ** power``,
    the Kish effective sample size (a fraction in ``(0, 1]``) of the batch's importance ratios
    between the policy being trained and the one that sampled: stale or mismatched batches,
    whose gradient estimates have high variance, take smaller steps (after variance-controlled
    off-policy RL, e.g. VCPO). The ratios are the loss's ``behaviour_ratio`` (π_prox / μ) when it
    reports them, else its ``ratio`` (π_θ / π_old); batches without them are not scaled."""
    def scale(metrics: dict[str, jax.Array]) -> jax.Array:
        name = "behaviour_ratio" if "behaviour_ratio_sum" in metrics else "ratio"
        if f"{name}_sum" not in metrics or "tokens" not in metrics:
            return jnp.ones((), jnp.float32)
        total, sq = metrics[f"{name}_sum"], metrics[f"{name}_sq_sum"]
        tokens = metrics["tokens"]
        ess = jnp.where((tokens > 0) & (sq > 0), total * total / jnp.where(
            (tokens > 0) & (sq > 0), tokens * sq, 1.0), 1.0)
        return jnp.maximum(jnp.minimum(ess, 1.0), floor) ** power
    return scale


def apply_gradients(state: TrainState, tx: optax.GradientTransformation, loss_sum: jax.Array,
                    denom: jax.Array, metrics: dict[str, jax.Array], grads: Any,
                    update_scale: UpdateScale | None = None
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update from accumulated sums: ``grads / denom``, the update multiplied by
    ``update_scale(metrics)`` when given; if the loss or the gradient norm is not finite the
    state is kept and ``skipped`` counts it."""
    params = state.params
    safe_denom = jnp.where(denom > 0, denom, 1.0)
    loss = loss_sum / safe_denom
    grads = jax.tree.map(lambda g, p: (g / safe_denom).astype(p.dtype), grads, params)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, params)
    extra = {}
    if update_scale is not None:
        factor = update_scale(metrics).astype(jnp.float32)
        updates = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
        extra["update_scale"] = factor
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
    new_state = state.replace(
        step=state.step + ok.astype(jnp.int32),
        params=jax.tree.map(keep, new_params, params),
        opt_state=jax.tree.map(keep, new_opt_state, state.opt_state),
        skipped=state.skipped + (~ok).astype(jnp.int32))
    out = {"loss": loss, "denominator": denom, "grad_norm": grad_norm,
           "skipped": (~ok).astype(jnp.int32), **extra, **metrics}
    return new_state, out


class StreamingTrainStep:
    """A train step over any number of fixed-shape micro-batches.

    ``step(state, batch)`` takes a host batch (a pytree of numpy ``[R, T]`` arrays, ``R`` a
    multiple of ``micro_rows``) and runs one compiled gradient-accumulation program per
    ``[micro_rows, T]`` slice, then one compiled optimizer update: batches whose size varies
    from step to step (RL batches packed from completions of varying length) share two programs,
    compiled once, ahead of time by :meth:`compile`, and waste at most ``micro_rows - 1`` padding
    rows. The update equals :func:`make_train_step` on the whole batch up to the order of float
    summation (the loss convention: sums over micro-batches, divided once).
    """

    def __init__(self, spec: ModelSpec, tx: optax.GradientTransformation, loss_fn: LossFn, *,
                 micro_rows: int, batch_sharding: Any = None,
                 update_scale: UpdateScale | None = None):
        if micro_rows < 1:
            raise ValueError(f"micro_rows must be >= 1, got {micro_rows}")
        self.spec, self.micro_rows, self._tx = spec, micro_rows, tx
        self.batch_sharding = batch_sharding or default_batch_sharding(spec)
        self._shardings = state_shardings(tx, spec)
        rep = spec.replicated()

        grads_of = _grads_fn(spec, loss_fn)

        def accumulate(params, frozen, acc, batch, step, micro):
            loss_sum, denom, metrics, grads = grads_of(params, frozen, batch, step, micro)
            return (acc[0] + loss_sum, acc[1] + denom,
                    {k: _reduce_metric(k, acc[2][k], metrics[k]) for k in acc[2]},
                    jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc[3], grads))

        def apply(state, acc):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc[3], state.params)
            return apply_gradients(state, tx, acc[0], acc[1], acc[2], grads, update_scale)

        self._grads_of, self._accumulate_fn, self._apply_fn = grads_of, accumulate, apply
        self._rep = rep
        self._programs: dict[tuple, Any] = {}

    def _acc_shapes(self, abstract_batch):
        counter = jax.ShapeDtypeStruct((), jnp.int32)
        shapes = jax.eval_shape(self._grads_of, self.spec.abstract_params,
                                self.spec.frozen_abstract, abstract_batch, counter, counter)
        rep = self._rep
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
        metrics = {k: jax.ShapeDtypeStruct(v.shape, jnp.float32, sharding=rep)
                   for k, v in shapes[2].items()}
        grads = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.float32,
                                                                sharding=sh),
                             shapes[3], self.spec.param_shardings)
        return (scalar, scalar, metrics, grads)

    def compile(self, abstract_micro_batch: Any) -> float:
        """Compiles the accumulation, zero-init and update programs for micro-batches shaped like
        ``abstract_micro_batch`` (``ShapeDtypeStruct``s of ``[micro_rows, T]``); returns the
        seconds it took."""
        start = time.perf_counter()
        key = _shape_key(abstract_micro_batch)
        if key in self._programs:
            return 0.0
        acc = self._acc_shapes(abstract_micro_batch)
        acc_shardings = jax.tree.map(lambda s: s.sharding, acc)
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                            sharding=self.batch_sharding),
                             abstract_micro_batch)
        state = abstract_state(self._tx, self.spec)

        def zeros():
            return (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                    {k: _metric_identity(k, jnp.zeros(v.shape, jnp.float32))
                     for k, v in acc[2].items()},
                    jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), acc[3]))

        programs = (
            jax.jit(zeros, out_shardings=acc_shardings).lower().compile(),
            jax.jit(self._accumulate_fn, in_shardings=(
                self.spec.param_shardings, self.spec.frozen_shardings, acc_shardings,
                self.batch_sharding, self._rep, self._rep), out_shardings=acc_shardings,
                donate_argnums=(2,)).lower(state.params, state.frozen, acc, batch, state.step,
                                           state.step).compile(),
            jax.jit(self._apply_fn, in_shardings=(self._shardings, acc_shardings),
                    out_shardings=(self._shardings, self._rep),
                    donate_argnums=(0,)).lower(state, acc).compile())
        self._programs[key] = programs
        return time.perf_counter() - start

    def warm(self, params: Any, abstract_micro_batch: Any, frozen: Any = None) -> float:
        """Runs the zero-init and accumulation programs once on an all-zero micro-batch shaped
        like ``abstract_micro_batch`` and discards the result (the state is untouched), so that
        the first real step does not pay their first execution (buffer allocation, first-touch
        page faults: about as long as a step again on a CPU). Returns the seconds it took."""
        start = time.perf_counter()
        self.compile(abstract_micro_batch)
        zeros, accumulate, _ = self._programs[_shape_key(abstract_micro_batch)]
        micro = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_micro_batch)
        jax.block_until_ready(accumulate(params, {} if frozen is None else frozen, zeros(),
                                         global_batch(micro, self.batch_sharding),
                                         np.int32(0), np.int32(0)))
        return time.perf_counter() - start

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        leaves = jax.tree.leaves(batch)
        rows = leaves[0].shape[0]
        m = self.micro_rows
        if rows % m or rows == 0:
            raise ValueError(f"batch of {rows} rows is not a positive multiple of "
                             f"micro_rows={m}")
        slices = [jax.tree.map(lambda x, i=i: x[i:i + m], batch) for i in range(0, rows, m)]
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), slices[0])
        self.compile(abstract)
        zeros, accumulate, apply = self._programs[_shape_key(abstract)]
        acc = zeros()
        # One transfer for every micro-batch: device_put has a fixed cost per call.
        for index, micro in enumerate(global_batch(slices, self.batch_sharding)):
            acc = accumulate(state.params, state.frozen, acc, micro, state.step,
                             np.int32(index))
        return apply(state, acc)



def _shape_key(abstract: Any) -> tuple:
    return tuple(jax.tree.leaves(jax.tree.map(lambda s: (s.shape, str(s.dtype)), abstract)))

def _metric_identity(name: str, zero: jax.Array) -> jax.Array:
    if name.endswith("_max"):
        return jnp.full_like(zero, -jnp.inf)
    if name.endswith("_min"):
        return jnp.full_like(zero, jnp.inf)
    return zero


def make_eval_step(spec: ModelSpec, loss_fn: LossFn, *, batch_sharding: Any = None):
    """A jitted ``eval(params, batch, frozen=None) -> (loss_sum, denominator, metrics)`` (no
    gradients; ``frozen``: a LoRA run's base)."""
    batch_sharding = batch_sharding or default_batch_sharding(spec)

    def evaluate(params, batch, frozen):
        return loss_fn(spec.merge(params, frozen), batch)

    jitted = jax.jit(evaluate, in_shardings=(spec.param_shardings, batch_sharding,
                                             spec.frozen_shardings),
                     out_shardings=spec.replicated())

    def run(params, batch, frozen=None):
        return jitted(params, batch, {} if frozen is None else frozen)

    return run


def global_batch(batch: Any, sharding: Any) -> Any:
    """The full global host batch (identical on every process) → global arrays laid out by
    ``sharding``; each device receives only its own rows."""
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), batch)


def global_batch_from_local(batch: Any, sharding: Any) -> Any:
    """This process's rows of a batch → global arrays (``make_array_from_process_local_data``)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def batch_partition_spec(spec: ModelSpec) -> PartitionSpec:
    """``[B, T]`` batches: rows split over the mesh axes of ``act_batch``."""
    return spec.rules.spec(("act_batch", "act_seq"))


def default_batch_sharding(spec: ModelSpec) -> Any:
    if spec.mesh is None:
        return spec.replicated()
    return NamedSharding(spec.mesh, batch_partition_spec(spec))
