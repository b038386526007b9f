"""The paged KV cache's layout and the operations on it: pages, page tables, admission, moves.

The KV cache is a pool of fixed-size pages shared by all running sequences (vLLM's
PagedAttention, SGLang's token pool with ``--page-size``): per layer, keys
``[pages, K, Dh, page_size]`` and values ``[pages, K, page_size, Dh]`` (heads before positions,
and key positions innermost, so that both attention products are plain per-head matmuls over a
page where it lies). A sequence holds the pages of its positions, listed in its slot's row of
the page table (:class:`PageTable`, on the host; each decode step takes the rows of its batch):
position ``t`` lies in page ``table[slot, t // page_size]`` at offset ``t % page_size``. Pages are
taken as a sequence grows and given back when it finishes, so the cache holds the tokens of the
running sequences (at most ``page_size - 1`` unused positions each) rather than
``slots × max_seq_len``; the pool's size is the memory budget (``EngineConfig.kv_cache_bytes``).
The samples of one prompt share the pages its prompt fills (a page is free when no table row
lists it: :class:`PageTable` counts references); each holds a page of its own from the prompt's
last, partly filled one on. A slot holding a sequence of length ``n`` has keys/values for
positions ``0 .. n-2``; its last token is processed by the next decode step, which writes
position ``n-1`` and samples token ``n``. Table entries of pages a slot does not hold name page
``pages`` (past the pool): writes there are dropped, and attention over them is never used (a
free slot's step, or a step past a sequence's last token).

Everything a decode step needs about a slot lives on the device in a :data:`SlotState` (its last
token, position, sampling parameters and random-key counters), so steps chain on the device.
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.generator.engine.sampling import pack, sample

# Per-layer page pool layouts: keys [pages, K, Dh, page_size], values [pages, K, page_size, Dh].
# Keys with positions innermost make the score product a plain [G, Dh] x [Dh, T] matmul per
# slot, head and page.
K_CACHE_AXES = (None, "act_kv_heads", "head_dim", None)
V_CACHE_AXES = (None, "act_kv_heads", None, "head_dim")
MIN_KV_LEN = 16
MIN_ADMIT = 8  # admissions install at least this many rows (padding dropped)
FINE_KV_LEN = 128
DEFAULT_PAGE_SIZE = 64

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
    """The attended length for ``needed`` positions, within ``[minimum, max_seq_len]``: a power
    of two up to ``FINE_KV_LEN``, above it the smallest of ``2^i`` and ``1.5·2^i`` that holds
    them (at most a third of a bucket is padding where attention costs most; few sizes where it
    costs little, each size being one more compiled decode step). Decode steps whose attention
    reads the table's pages whole (XLA's, the Pallas kernel) take the pages of this many
    positions; the native kernel reads each slot's own length and takes the whole table."""
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


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold ``positions`` positions."""
    return -(-max(positions, 0) // page_size)


class PageTable:
    """The host side of a paged cache: which pages each slot holds, and the free pages.

    ``table [max_slots, width]`` int32 lists each slot's pages in position order
    (``width = pages_for(max_seq_len)``); entries past a slot's pages hold ``num_pages`` (no
    page). A page is listed by one slot or, for a prompt's full pages, by every sample of it;
    it returns to the free pages when the last slot listing it lets it go. Free pages are
    taken lowest first. Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_seq_len: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.width = pages_for(max_seq_len, page_size)
        self.table = np.full((max_slots, self.width), num_pages, np.int32)
        self.held = np.zeros((max_slots,), np.int32)  # pages listed per slot
        self.refs = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages))  # a heap

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def grow(self, slot: int, positions: int) -> bool:
        """Gives ``slot`` the pages of its first ``positions`` positions (at most the table's
        width); False, taking nothing, when the free pages do not suffice."""
        want = min(pages_for(positions, self.page_size), self.width)
        extra = want - int(self.held[slot])
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        for j in range(int(self.held[slot]), want):
            page = heapq.heappop(self._free)
            self.refs[page] = 1
            self.table[slot, j] = page
        self.held[slot] = want
        return True

    def share(self, src: int, dst: int, count: int):
        """Lists the first ``count`` pages of slot ``src`` as the first of slot ``dst`` (which
        holds none): the full pages of a prompt its samples share."""
        if self.held[dst]:
            raise ValueError(f"slot {dst} already holds pages")
        pages = self.table[src, :count]
        self.table[dst, :count] = pages
        self.refs[pages] += 1
        self.held[dst] = count

    def release(self, slot: int):
        """Lets go of every page of ``slot`` (free once no other slot lists them)."""
        n = int(self.held[slot])
        for page in self.table[slot, :n].tolist():
            self.refs[page] -= 1
            if self.refs[page] == 0:
                heapq.heappush(self._free, page)
        self.table[slot] = self.num_pages
        self.held[slot] = 0

    def move(self, src: int, dst: int):
        """Moves slot ``src``'s pages to the free slot ``dst``."""
        self.table[dst], self.held[dst] = self.table[src], self.held[src]
        self.table[src], self.held[src] = self.num_pages, 0

    def reset(self):
        self.__init__(self.num_pages, self.page_size, self.table.shape[0],
                      self.width * self.page_size)


def admit(k_pages, v_pages, state: SlotState, k_new, v_new, logits, rows, pages, slots, values,
          fresh, *, filtered: bool):
    """Installs prefilled sequences in their pages and slots and samples first tokens.

    Args:
      k_new, v_new: prefill keys/values ``[L, B, T, K, Dh]``.
      logits: prefill logits ``[B, V]``.
      rows, slots: ``[M]``: sequence ``i`` takes prefill row ``rows[i]`` into slot ``slots[i]``
        (slots ``>= slots`` count, used for padding, are dropped).
      pages: ``[M, ceil(T / page_size)]``: the pages sequence ``i``'s prefill positions go to,
        page by page (the pool's size where nothing is written: past the prompt, pages already
        written by another sample of the same prompt, padding).
      values: :data:`SlotState` fields ``[M]`` for the sequences (``token`` is the last token
        of resumed sequences, ``token_index`` the index of the token sampled here for fresh ones).
      fresh: ``[M]`` bool, whether the sequence samples its first token here (otherwise it
        resumes with ``values["token"]``).

    Returns ``(k_pages, v_pages, state, out)`` with ``out [3, M]`` packed as a decode step's
    (:func:`rl_jax.generator.engine.sampling.pack`).
    The runner compiles the parts separately (:func:`first_tokens`, and :func:`install_kv` /
    :func:`install_state`, cheap scatters).
    """
    k_rows, v_rows, tokens, out = first_tokens(k_new, v_new, logits, rows, values, fresh,
                                               filtered=filtered)
    k_pages, v_pages = install_kv(k_pages, v_pages, k_rows, v_rows, pages)
    return k_pages, v_pages, install_state(state, slots, values, fresh, tokens), out


def first_tokens(k_new, v_new, logits, rows, values, fresh, *, filtered: bool):
    """Per admitted sequence ``[M]``: its prefill keys/values ``[L, M, T, K, Dh]`` (row
    ``rows[i]`` of the prefill), its sampled first token ``[M]`` and the packed ``[3, M]``
    output (the resumed token where not ``fresh``)."""
    tokens, logprobs, unfiltered = sample(logits[rows],
                                          *(values[name] for name in SAMPLING_FIELDS),
                                          values["token_index"], filtered=filtered)
    out = pack(jnp.where(fresh, tokens, values["token"]), logprobs, unfiltered)
    return k_new[:, rows], v_new[:, rows], tokens, out


def install_kv(k_pages, v_pages, k_rows, v_rows, pages):
    """Keys/values ``[L, M, T, K, Dh]`` of positions ``0..T-1`` into the pages ``[M, n]``
    (``n = ceil(T / page_size)``; entries past the pool are dropped)."""
    size = k_pages[0].shape[3]
    m, t = k_rows.shape[1], k_rows.shape[2]
    n = pages.shape[1]
    flat = pages.reshape(-1)

    def paged(new):  # [M, T, K, Dh] -> [M·n, page_size, K, Dh]
        new = jnp.pad(new, ((0, 0), (0, n * size - t), (0, 0), (0, 0)))
        return new.reshape(m * n, size, *new.shape[2:])

    def put_keys(pool, new):  # [M·n, page_size, K, Dh] -> [M·n, K, Dh, page_size]
        return pool.at[flat].set(jnp.transpose(paged(new), (0, 2, 3, 1)).astype(pool.dtype),
                                 mode="drop")

    def put_values(pool, new):  # -> [M·n, K, page_size, Dh]
        return pool.at[flat].set(jnp.swapaxes(paged(new), 1, 2).astype(pool.dtype),
                                 mode="drop")

    return (tuple(put_keys(pool, k_rows[i]) for i, pool in enumerate(k_pages)),
            tuple(put_values(pool, v_rows[i]) for i, pool in enumerate(v_pages)))


def install_state(state: SlotState, slots, values, fresh, tokens) -> SlotState:
    """Slot state of admitted sequences ``[M]`` (first tokens ``tokens`` where ``fresh``)."""
    tokens = jnp.where(fresh, tokens, values["token"])
    updates = dict(values, token=tokens, token_index=values["token_index"] + fresh)
    return {name: state[name].at[slots].set(updates[name].astype(state[name].dtype),
                                            mode="drop") for name in state}


def move_state(state: SlotState, src, dst) -> SlotState:
    """Moves the slot state of slots ``src [N]`` to slots ``dst [N]`` (pairs whose ``dst`` is
    past the slots, the padding, are dropped); their pages move with their page table rows
    (:meth:`PageTable.move`), the cache itself stays where it is."""
    return {name: a.at[dst].set(a[src], mode="drop") for name, a in state.items()}


def gather_pages(k_pool, v_pool, table):
    """A layer's keys ``[S, K, Dh, W·P]`` and values ``[S, K, W·P, Dh]`` of the slots whose page
    table rows are ``table [S, W]`` (entries past the pool read zeros): the contiguous form
    that XLA's attention and the Pallas kernel take (a copy of the pages read)."""
    s, w = table.shape
    keys = jnp.take(k_pool, table, axis=0, mode="fill", fill_value=0)  # [S, W, K, Dh, P]
    values = jnp.take(v_pool, table, axis=0, mode="fill", fill_value=0)  # [S, W, K, P, Dh]
    k, hd, p = keys.shape[2:]
    keys = jnp.transpose(keys, (0, 2, 3, 1, 4)).reshape(s, k, hd, w * p)
    values = jnp.transpose(values, (0, 2, 1, 3, 4)).reshape(s, k, w * p, hd)
    return keys, values
