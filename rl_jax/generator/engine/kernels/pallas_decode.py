"""Decode attention as Pallas kernels (GPU via Triton; CPU in interpret mode, for tests): over
the engine's paged KV cache, read in place through each slot's page table
(:func:`paged_decode_attention`, what the runner uses), and over a contiguous per-slot cache
(:func:`decode_attention`).

One program per (slot, key/value head) computes all ``G`` query heads of that key/value head
together. It walks the slot's cache in blocks of ``block`` positions up to the slot's own
position only (a loop whose trip count is read from ``positions``), keeping a running maximum,
sum and weighted value sum (online softmax), so a slot at position ``p`` reads
``ceil((p + 1) / block)`` blocks of its keys and values however long the cache is. XLA's form,
:func:`rl_jax.generator.engine.decode.attend`, reads the cache's whole length for every slot. The
paged kernel's loop step is one page: it reads the page number from the slot's table row and
that page of the head's pool (the pool is one block whose pages are addressed, never copied),
so a slot reads ``ceil((p + 1) / P)`` pages and XLA's ``attend_pages`` copy of every slot's
pages into the contiguous form is not made.

Numerics follow ``attend``: the query is scaled by ``Dh ** -0.5`` in the computation dtype, the
score product accumulates in float32, the softmax weights are cast to the computation dtype for
the value product (float32 accumulation) and the normalisation comes after it.

Triton's constraints shape the wrapper: loads and dots take power-of-two shapes and a dot's
dimensions are at least 16, so the query heads are padded to a power of two of at least 16 (the
query is small; the cache is never copied), ``head_dim`` must be a power of two, and a cache
whose length is not a multiple of the block has its last block start earlier (its positions
already seen are masked out); caches shorter than 16 positions do not compile there, nor pages
of fewer than 16 positions or of a size that is not a power of two. On TPU the kernels go to
Mosaic untried: the contiguous one would copy each slot's whole cache into VMEM (the loop skips
the compute past the position, not the copy), the paged one the head's whole page pool, which
a real pool does not fit. The runner compiles the kernel for the model's heads and page size
at startup and keeps XLA's attention where that fails
(:func:`rl_jax.generator.engine.kernels.pallas_decode_attention_problem`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK = 64  # cache positions per loop step (GPU); smaller caches use their own length
MIN_DOT = 16  # Triton's smallest dot dimension
_MASKED = -1e30  # the score of a masked position (attend's additive bias)


def _power_of_two_at_least(n: int, minimum: int = 1) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


def _block_for(cache_len: int, block: int) -> int:
    """The positions per loop step: ``block``, or the largest power of two within a shorter
    cache."""
    size = 1
    while size * 2 <= min(cache_len, block):
        size *= 2
    return size


def _online_step(carry, q, keys, values, valid, valid_rows, *, dtype, precision):
    """One block of the online softmax: ``q [Gp, Dh]``, ``keys [Dh, n]``, ``values [n, Dh]``
    in ``dtype``, ``valid [1, n]`` / ``valid_rows [n, 1]`` the positions attended; the carry is
    the running weighted value sum, maximum and weight sum."""
    acc, top, total = carry
    scores = jnp.dot(q, keys, preferred_element_type=jnp.float32, precision=precision)
    scores = jnp.where(valid, scores, _MASKED)  # [Gp, n]
    new_top = jnp.maximum(top, jnp.max(scores, axis=1, keepdims=True))
    weights = jnp.exp(scores - new_top)
    # cache past the position may hold anything (even NaN): it must not reach the sum
    values = jnp.where(valid_rows, values, jnp.zeros_like(values))
    rescale = jnp.exp(top - new_top)
    acc = acc * rescale + jnp.dot(weights.astype(dtype), values,
                                  preferred_element_type=jnp.float32, precision=precision)
    total = total * rescale + jnp.sum(weights, axis=1, keepdims=True)
    return acc, new_top, total


def _finish(o_ref, loop_steps, step):
    """Runs ``step`` ``loop_steps`` times from an empty carry and writes the normalised sum."""
    groups, head_dim = o_ref.shape
    init = (jnp.zeros((groups, head_dim), jnp.float32),
            jnp.full((groups, 1), _MASKED, jnp.float32),
            jnp.zeros((groups, 1), jnp.float32))
    acc, _, total = lax.fori_loop(0, loop_steps, step, init)
    o_ref[...] = (acc / total).astype(o_ref.dtype)


def _kernel(pos_ref, q_ref, k_ref, v_ref, o_ref, *, block: int, cache_len: int,
            precision: Any):
    """One (slot, kv head): ``q_ref [Gp, Dh]`` (already scaled), ``k_ref [Dh, T]``,
    ``v_ref [T, Dh]``, ``pos_ref []``; writes ``o_ref [Gp, Dh]``."""
    dtype = q_ref.dtype
    position = pos_ref[()]
    q = q_ref[...]
    seen = jnp.minimum(position + 1, cache_len)  # positions attended: 0 .. seen-1
    row = lax.broadcasted_iota(jnp.int32, (1, block), 1)  # positions along a score row
    column = lax.broadcasted_iota(jnp.int32, (block, 1), 0)  # along a value column

    def step(i, carry):
        first = i * block
        start = jnp.minimum(first, cache_len - block)  # the last block may start earlier
        valid = (start + row >= first) & (start + row < seen)  # [1, block]
        valid_rows = (start + column >= first) & (start + column < seen)  # [block, 1]
        keys = k_ref[:, pl.ds(start, block)].astype(dtype)  # [Dh, block]
        values = v_ref[pl.ds(start, block), :].astype(dtype)  # [block, Dh]
        return _online_step(carry, q, keys, values, valid, valid_rows, dtype=dtype,
                            precision=precision)

    _finish(o_ref, pl.cdiv(seen, block), step)


def _compiler_params(platform: str) -> Any:
    """Triton's parameters on GPU (Pallas' default GPU lowering is otherwise Mosaic GPU,
    which this kernel's shapes do not suit), the default elsewhere."""
    if platform in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    return None


def _query(q: jax.Array, interpret: bool) -> tuple[jax.Array, int, Any]:
    """``q [S, K, G, Dh]`` scaled by ``Dh ** -0.5`` in its dtype (as ``attend``), its query
    heads padded to a power of two of at least 16 for Triton's dots (not in the interpreter);
    the padded head count and the dots' precision."""
    groups, head_dim = q.shape[2], q.shape[3]
    padded = groups if interpret else _power_of_two_at_least(groups, MIN_DOT)
    q = q * jnp.asarray(head_dim ** -0.5, q.dtype)
    if padded != groups:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - groups), (0, 0)))
    return q, padded, lax.Precision.HIGHEST if q.dtype == jnp.float32 else None


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, positions: jax.Array,
                     *, interpret: bool = False, block: int = BLOCK,
                     platform: str | None = None) -> jax.Array:
    """Attention of one query per slot over its cache: ``q [S, K, G, Dh]`` in the computation
    dtype, ``keys [S, K, Dh, T]`` and ``values [S, K, T, Dh]`` in the cache dtype; cache
    positions ``<= positions [S]`` are attended (all of them where a position is ``>= T``).
    Returns ``[S, K, G, Dh]`` in ``q``'s dtype, as :func:`rl_jax.generator.engine.decode.attend`.

    ``interpret``: run the kernel in Pallas' interpreter (any backend, slow; for tests on
    CPU). ``block``: cache positions per loop step, a power of two. ``platform``: the backend
    it is compiled for (default ``jax.default_backend()``).
    """
    slots, kv_heads, groups, head_dim = q.shape
    cache_len = values.shape[2]
    if keys.shape != (slots, kv_heads, head_dim, cache_len) or values.shape != (
            slots, kv_heads, cache_len, head_dim):
        raise ValueError(f"keys {keys.shape} and values {values.shape} do not match q "
                         f"{q.shape}: expected keys [S, K, Dh, T] and values [S, K, T, Dh]")
    if positions.shape != (slots,):
        raise ValueError(f"positions {positions.shape} must be [{slots}]")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    dtype = q.dtype
    step_block = _block_for(cache_len, block)
    q, padded, precision = _query(q, interpret)
    kernel = functools.partial(_kernel, block=step_block, cache_len=cache_len,
                               precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(slots, kv_heads),
        in_specs=[
            pl.BlockSpec((None,), lambda s, k: (s,)),
            pl.BlockSpec((None, None, padded, head_dim), lambda s, k: (s, k, 0, 0)),
            pl.BlockSpec((None, None, head_dim, cache_len), lambda s, k: (s, k, 0, 0)),
            pl.BlockSpec((None, None, cache_len, head_dim), lambda s, k: (s, k, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, padded, head_dim), lambda s, k: (s, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, padded, head_dim), dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(
            platform or jax.default_backend()),
        name="rl_jax_decode_attention",
    )(positions.astype(jnp.int32), q, keys, values)
    return out[:, :, :groups] if padded != groups else out


# ---- over the paged cache ------------------------------------------------------------------------

def _paged_kernel(pos_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, num_pages: int,
                  width: int, precision: Any):
    """One (slot, kv head) over its pages: ``table_ref [W]`` (the slot's page table row),
    ``k_ref [N, Dh, P]`` and ``v_ref [N, P, Dh]`` (the head's whole page pools), ``q_ref
    [Gp, Dh]`` (already scaled), ``pos_ref []``; writes ``o_ref [Gp, Dh]``. A table entry past
    the pool (``>= N``) reads as zeros, as ``kv_cache.gather_pages``."""
    dtype = q_ref.dtype
    size = k_ref.shape[2]
    position = pos_ref[()]
    q = q_ref[...]
    seen = jnp.minimum(position + 1, width * size)  # positions attended: 0 .. seen-1
    row = lax.broadcasted_iota(jnp.int32, (1, size), 1)
    column = lax.broadcasted_iota(jnp.int32, (size, 1), 0)

    def step(i, carry):
        entry = table_ref[i]
        inside = entry < num_pages
        page = jnp.clip(entry, 0, num_pages - 1)
        keys = jnp.where(inside, k_ref[page].astype(dtype), 0)  # [Dh, P]
        values = jnp.where(inside, v_ref[page].astype(dtype), 0)  # [P, Dh]
        first = i * size
        return _online_step(carry, q, keys, values, first + row < seen,
                            first + column < seen, dtype=dtype, precision=precision)

    _finish(o_ref, pl.cdiv(seen, size), step)


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           table: jax.Array, positions: jax.Array, *, interpret: bool = False,
                           platform: str | None = None) -> jax.Array:
    """Attention of one query per slot over its pages, read in place: ``q [S, K, G, Dh]`` in the
    computation dtype, page pools ``k_pool [N, K, Dh, P]`` and ``v_pool [N, K, P, Dh]`` in the
    cache dtype, page table rows ``table [S, W]`` (int32; entries ``>= N`` read as zeros);
    positions ``<= positions [S]`` (at most ``W·P - 1``) are attended. Returns ``[S, K, G, Dh]``
    in ``q``'s dtype: :func:`rl_jax.generator.engine.decode.attend_pages` without its copy of the
    pages (one loop step per page, up to the slot's position).

    On GPU (Triton) the page size and ``head_dim`` must be powers of two of at least 16 (a dot's
    smallest dimension). ``interpret``/``platform``: as :func:`decode_attention`.
    """
    slots, kv_heads, groups, head_dim = q.shape
    num_pages, size = k_pool.shape[0], k_pool.shape[3]
    if k_pool.shape != (num_pages, kv_heads, head_dim, size) or v_pool.shape != (
            num_pages, kv_heads, size, head_dim):
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} do not match q "
                         f"{q.shape}: expected [N, K, Dh, P] and [N, K, P, Dh]")
    if table.ndim != 2 or table.shape[0] != slots:
        raise ValueError(f"table {table.shape} must be [{slots}, W]")
    if positions.shape != (slots,):
        raise ValueError(f"positions {positions.shape} must be [{slots}]")
    dtype = q.dtype
    width = table.shape[1]
    q, padded, precision = _query(q, interpret)
    kernel = functools.partial(_paged_kernel, num_pages=num_pages, width=width,
                               precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(slots, kv_heads),
        in_specs=[
            pl.BlockSpec((None,), lambda s, k: (s,)),
            pl.BlockSpec((None, width), lambda s, k: (s, 0)),
            pl.BlockSpec((None, None, padded, head_dim), lambda s, k: (s, k, 0, 0)),
            pl.BlockSpec((num_pages, None, head_dim, size), lambda s, k: (0, k, 0, 0)),
            pl.BlockSpec((num_pages, None, size, head_dim), lambda s, k: (0, k, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, padded, head_dim), lambda s, k: (s, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((slots, kv_heads, padded, head_dim), dtype),
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(
            platform or jax.default_backend()),
        name="rl_jax_paged_decode_attention",
    )(positions.astype(jnp.int32), table.astype(jnp.int32), q, k_pool, v_pool)
    return out[:, :, :groups] if padded != groups else out
