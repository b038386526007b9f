"""The slot KV cache's layout and the operations on slots: admission, installation, moves.

The KV cache is slot-based, one slot per running sequence: keys ``[slots, K, Dh, kv_len]`` and
values ``[slots, K, kv_len, Dh]`` per layer (heads before positions, and key positions innermost,
so that both attention products are plain per-head matmuls over the cache where it lies). Each
layer's slots are split into chunks at the decode batch sizes (:func:`slot_chunks`: 8, 8, 16, 32,
... slots), one array each, ``k_cache[l][c]`` and ``v_cache[l][c]``: a step over the first
``batch`` slots attends over whole chunks where they lie. (Over one array, the first ``batch`` rows
would be a slice, which XLA copies: at batch 8 of 64 slots that copy costs a quarter of the step.)
Its length ``kv_len`` follows the longest running sequence (see :func:`kv_bucket`), so a decode
step reads and attends over the context the batch actually has, not the whole capacity; the
memory bound is ``2·L·slots·max_seq_len·K·Dh`` elements. A slot holding a sequence of length
``n`` has keys/values for positions ``0 .. n-2``; its last token is processed by the next decode
step, which writes position ``n-1`` and samples token ``n``.

Everything a decode step needs about a slot lives on the device in a :data:`SlotState` (its last
token, position, sampling parameters and random-key counters), so steps chain on the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.generator.sampling import pack, sample

# Per-layer cache layouts: keys [slots, K, Dh, kv_len], values [slots, K, kv_len, Dh]. Keys with
# positions innermost make the score product a plain [G, Dh] x [Dh, T] matmul per slot and head.
K_CACHE_AXES = ("act_batch", "act_kv_heads", "head_dim", "act_seq")
V_CACHE_AXES = ("act_batch", "act_kv_heads", "act_seq", "head_dim")
K_SEQ_AXIS, V_SEQ_AXIS = 3, 2
MIN_KV_LEN = 16
MIN_ADMIT = 8  # admissions install at least this many rows (padding dropped)
FINE_KV_LEN = 128

# Per-slot decode state: name -> dtype. All arrays are [slots].
SLOT_FIELDS = {
    "token": np.dtype(np.int32),  # last token of the sequence (the next step's input)
    "position": np.dtype(np.int32),  # its position (where the next step writes keys/values)
    "token_index": np.dtype(np.int32),  # index of the next sampled token in the completion
    "seed": np.dtype(np.uint32),
    "sample_index": np.dtype(np.int32),  # sample within its request (0..n-1)
    "temperature": np.dtype(np.float32),
    "top_k": np.dtype(np.int32),
    "top_p": np.dtype(np.float32),
    "min_p": np.dtype(np.float32),
}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "sample_index")
SlotState = dict[str, jax.Array]


def kv_bucket(needed: int, max_seq_len: int, minimum: int = MIN_KV_LEN) -> int:
    """The cache length for ``needed`` positions, within ``[minimum, max_seq_len]``: a power of
    two up to ``FINE_KV_LEN``, above it the smallest of ``2^i`` and ``1.5·2^i`` that holds them
    (at most a third of a bucket is padding where attention costs most; few sizes where it costs
    little, each size being one more compiled decode step)."""
    size = minimum
    while size < needed:
        if size >= FINE_KV_LEN and size * 3 // 2 >= needed and size % 2 == 0:
            size = size * 3 // 2
            break
        size *= 2
    return min(size, max_seq_len)


def batch_bucket(needed: int, max_slots: int, minimum: int = 8) -> int:
    """Slots a decode step covers when slots ``0..needed-1`` may be in use: a power of two of at
    least ``minimum``, at most ``max_slots``."""
    size = minimum
    while size < needed:
        size *= 2
    return min(size, max_slots)


def slot_chunks(max_slots: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of each cache chunk: the slots between consecutive decode batch sizes
    (:func:`batch_bucket`), so that every decode batch is a whole number of chunks."""
    stops = sorted({batch_bucket(n, max_slots) for n in range(1, max_slots + 1)})
    return tuple(zip([0, *stops[:-1]], stops))


def chunk_bounds(chunks: tuple[jax.Array, ...]) -> list[tuple[int, int]]:
    """``(start, stop)`` slots of each of one layer's cache chunks (from their shapes)."""
    bounds, start = [], 0
    for chunk in chunks:
        bounds.append((start, start + chunk.shape[0]))
        start += chunk.shape[0]
    return bounds


def _local_slots(slots: jax.Array, start: int, stop: int) -> jax.Array:
    """Global slot indices as indices into the chunk ``[start, stop)``; the others past its
    end (dropped by a scatter with ``mode="drop"``)."""
    return jnp.where((slots >= start) & (slots < stop), slots - start, stop - start)


def admit(k_cache, v_cache, state: SlotState, k_new, v_new, logits, rows, slots, values,
          fresh, *, filtered: bool):
    """Installs prefilled sequences in their slots and samples first tokens.

    Args:
      k_new, v_new: prefill keys/values ``[L, B, P, K, Dh]`` (``P <= kv_len``).
      logits: prefill logits ``[B, V]``.
      rows, slots: ``[M]``: sequence ``i`` takes prefill row ``rows[i]`` into slot ``slots[i]``
        (slots ``>= slots`` count, used for padding, are dropped).
      values: :data:`SlotState` fields ``[M]`` for the sequences (``token`` is the last token
        of resumed sequences, ``token_index`` the index of the token sampled here for fresh ones).
      fresh: ``[M]`` bool, whether the sequence samples its first token here (otherwise it
        resumes with ``values["token"]``).

    Returns ``(k_cache, v_cache, state, out)`` with ``out [3, M]`` packed as a decode step's
    (:func:`rl_jax.generator.sampling.pack`).
    The runner compiles the parts separately (:func:`first_tokens`, whose shapes do not depend
    on the cache, and :func:`install_kv` / :func:`install_state`, cheap scatters), so a new
    cache length costs only a small compilation.
    """
    k_rows, v_rows, tokens, out = first_tokens(k_new, v_new, logits, rows, values, fresh,
                                               filtered=filtered)
    k_cache, v_cache = install_kv(k_cache, v_cache, k_rows, v_rows, slots)
    return k_cache, v_cache, install_state(state, slots, values, fresh, tokens), out


def first_tokens(k_new, v_new, logits, rows, values, fresh, *, filtered: bool):
    """Per admitted sequence ``[M]``: its prefill keys/values ``[L, M, P, K, Dh]`` (row
    ``rows[i]`` of the prefill), its sampled first token ``[M]`` and the packed ``[3, M]``
    output (the resumed token where not ``fresh``)."""
    tokens, logprobs, unfiltered = sample(logits[rows],
                                          *(values[name] for name in SAMPLING_FIELDS),
                                          values["token_index"], filtered=filtered)
    out = pack(jnp.where(fresh, tokens, values["token"]), logprobs, unfiltered)
    return k_new[:, rows], v_new[:, rows], tokens, out


def install_kv(k_cache, v_cache, k_rows, v_rows, slots):
    """Keys/values ``[L, M, P, K, Dh]`` into the first ``P`` positions of ``slots [M]`` (slots
    past the cache are dropped); the only part of admission compiled per cache length."""
    p = k_rows.shape[2]

    def put_keys(chunk, local, new):  # [M, P, K, Dh] → [M, K, Dh, P]
        return chunk.at[local, :, :, :p].set(jnp.transpose(new, (0, 2, 3, 1)).astype(
            chunk.dtype), mode="drop")

    def put_values(chunk, local, new):  # [M, P, K, Dh] → [M, K, P, Dh]
        return chunk.at[local, :, :p].set(jnp.swapaxes(new, 1, 2).astype(chunk.dtype),
                                          mode="drop")

    def put(put_one, chunks, new):
        return tuple(put_one(c, _local_slots(slots, start, stop), new)
                     for c, (start, stop) in zip(chunks, chunk_bounds(chunks)))

    return (tuple(put(put_keys, chunks, k_rows[i]) for i, chunks in enumerate(k_cache)),
            tuple(put(put_values, chunks, v_rows[i]) for i, chunks in enumerate(v_cache)))


def install_state(state: SlotState, slots, values, fresh, tokens) -> SlotState:
    """Slot state of admitted sequences ``[M]`` (first tokens ``tokens`` where ``fresh``)."""
    tokens = jnp.where(fresh, tokens, values["token"])
    updates = dict(values, token=tokens, token_index=values["token_index"] + fresh)
    return {name: state[name].at[slots].set(updates[name].astype(state[name].dtype),
                                            mode="drop") for name in state}


def move_slots(k_cache, v_cache, state: SlotState, src, dst):
    """Moves sequences from slots ``src [N]`` to slots ``dst [N]``: their keys, values and slot
    state (pairs whose ``dst`` is past the cache, the padding, are dropped). Everything is read
    before anything is written."""
    def move(a):
        return a.at[dst].set(a[src], mode="drop")

    def move_chunks(chunks):
        rows = jnp.concatenate(chunks)[src]  # XLA fuses the concatenation into the gather
        return tuple(c.at[_local_slots(dst, start, stop)].set(rows, mode="drop")
                     for c, (start, stop) in zip(chunks, chunk_bounds(chunks)))

    return (tuple(map(move_chunks, k_cache)), tuple(map(move_chunks, v_cache)),
            {name: move(a) for name, a in state.items()})


def resize_cache(k_cache, v_cache, *, length: int):
    """Every layer's cache chunks padded with zeros or truncated to ``length`` positions."""
    def one(c, axis):
        if c.shape[axis] >= length:
            return jax.lax.slice_in_dim(c, 0, length, axis=axis)
        pad = [(0, 0)] * c.ndim
        pad[axis] = (0, length - c.shape[axis])
        return jnp.pad(c, pad)
    return (tuple(tuple(one(c, K_SEQ_AXIS) for c in chunks) for chunks in k_cache),
            tuple(tuple(one(c, V_SEQ_AXIS) for c in chunks) for chunks in v_cache))
