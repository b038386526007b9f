"""Packing variable-length token sequences into fixed ``[rows, seq_len]`` arrays.

Sequences are placed first-fit-decreasing (longest first, each into the first row with room), then
laid out in each row in placement order. A packed batch is a plain ``dict`` of numpy arrays, all
``[rows, seq_len]``:

- ``tokens`` (int32): input ids; ``pad_id`` after the last segment of a row.
- ``targets`` (int32): the next token of the same segment; ``pad_id`` at a segment's last token
  and on padding.
- ``loss_mask`` (float32): weight of predicting ``targets``; 0 at a segment's last token and on
  padding.
- ``positions`` (int32): 0, 1, ... restarting in every segment; 0 on padding.
- ``segment_ids`` (int32): 1, 2, ... for the segments of a row in order; 0 on padding.
- ``sequence_index`` (int32): index (into the list given to ``pack_sequences``) of the sequence
  a token belongs to; -1 on padding.

These are the ``positions`` and ``segment_ids`` that ``rl_jax.models.transformer.Transformer``
takes for packed rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PackedBatch = dict[str, np.ndarray]

PACKED_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids", "sequence_index")


class _FirstFit:
    """First fit over ``num_bins`` bins of equal capacity in O(log bins) per query.

    A max segment tree over remaining capacities; ``place(n)`` puts ``n`` units into the
    lowest-numbered bin that still has room and returns it, or -1 if none has.
    """

    def __init__(self, num_bins: int, capacity: int):
        self.size = 1
        while self.size < max(num_bins, 1):
            self.size *= 2
        self.tree = np.full(2 * self.size, -1, np.int64)
        self.tree[self.size:self.size + num_bins] = capacity
        for node in range(self.size - 1, 0, -1):
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def place(self, n: int) -> int:
        tree = self.tree
        if tree[1] < n:
            return -1
        node = 1
        while node < self.size:
            node = 2 * node if tree[2 * node] >= n else 2 * node + 1
        tree[node] -= n
        leaf, node = node, node // 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
        return leaf - self.size


def pack_sequences(
    seqs: Sequence[Sequence[int]],
    seq_len: int,
    num_rows: int | None = None,
    loss_masks: Sequence[Sequence[float]] | None = None,
    pad_id: int = 0,
) -> tuple[PackedBatch, list[int]]:
    """Packs ``seqs`` into rows of ``seq_len`` tokens, first-fit-decreasing.

    Args:
      seqs: token-id sequences, each of length ``1..seq_len``.
      seq_len: tokens per row.
      num_rows: rows to fill; ``None`` uses as many rows as first-fit-decreasing needs.
      loss_masks: per-token weights aligned with ``seqs``: ``loss_masks[i][t]`` weighs the
        prediction of token ``t`` of sequence ``i`` (from token ``t - 1``), so ``[i][0]`` is
        never used. ``None`` weighs every next-token prediction by 1.
      pad_id: id written on padding and as the target of each segment's last token.

    Returns:
      ``(batch, leftover)``: the packed arrays (see the module docstring), ``[num_rows, seq_len]``
      when ``num_rows`` is given and ``[rows needed, seq_len]`` otherwise; and the indices into
      ``seqs`` (ascending) of the sequences that did not fit in ``num_rows`` rows.

    Raises:
      ValueError: a sequence is empty or longer than ``seq_len``, or a mask's length differs.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if num_rows is not None and num_rows < 0:
        raise ValueError(f"num_rows must be non-negative, got {num_rows}")
    lengths = [len(s) for s in seqs]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(f"sequences {empty[:10]} are empty")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > seq_len]
    if too_long:
        shown = ", ".join(f"#{i}: {n} tokens" for i, n in too_long[:10])
        raise ValueError(f"{len(too_long)} sequence(s) longer than seq_len={seq_len} "
                         f"({shown}{', ...' if len(too_long) > 10 else ''})")
    if loss_masks is not None:
        if len(loss_masks) != len(seqs):
            raise ValueError(f"{len(loss_masks)} loss masks for {len(seqs)} sequences")
        bad = [(i, len(m), n) for i, (m, n) in enumerate(zip(loss_masks, lengths)) if len(m) != n]
        if bad:
            i, m, n = bad[0]
            raise ValueError(f"loss mask {i} has {m} entries for a sequence of {n} tokens")

    # First-fit-decreasing; ties keep input order so the result is a function of the input alone.
    order = sorted(range(len(seqs)), key=lambda i: (-lengths[i], i))
    bins = _FirstFit(len(seqs) if num_rows is None else num_rows, seq_len)
    rows: list[list[int]] = []
    leftover = []
    for i in order:
        row = bins.place(lengths[i])
        if row < 0:
            leftover.append(i)
            continue
        while len(rows) <= row:
            rows.append([])
        rows[row].append(i)
    num_out = len(rows) if num_rows is None else num_rows

    shape = (num_out, seq_len)
    tokens = np.full(shape, pad_id, np.int32)
    targets = np.full(shape, pad_id, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    sequence_index = np.full(shape, -1, np.int32)
    for r, members in enumerate(rows):
        offset = 0
        for segment, i in enumerate(members, start=1):
            n = lengths[i]
            span = slice(offset, offset + n)
            seq = np.asarray(seqs[i], np.int32)
            tokens[r, span] = seq
            targets[r, offset:offset + n - 1] = seq[1:]
            if loss_masks is None:
                loss_mask[r, offset:offset + n - 1] = 1.0
            else:
                loss_mask[r, offset:offset + n - 1] = np.asarray(loss_masks[i], np.float32)[1:]
            positions[r, span] = np.arange(n, dtype=np.int32)
            segment_ids[r, span] = segment
            sequence_index[r, span] = i
            offset += n
    batch = dict(tokens=tokens, targets=targets, loss_mask=loss_mask, positions=positions,
                 segment_ids=segment_ids, sequence_index=sequence_index)
    return batch, sorted(leftover)


def packing_stats(batch: PackedBatch) -> dict[str, float]:
    """Counts of a packed batch.

    Returns:
      ``num_sequences`` (segments), ``num_tokens`` (non-padding tokens), ``num_loss_tokens``
      (positions with a non-zero loss weight) and ``fill_ratio`` (non-padding share of
      ``rows * seq_len``, 0 for an empty batch).
    """
    segment_ids = np.asarray(batch["segment_ids"])
    num_tokens = int((segment_ids > 0).sum())
    return dict(
        num_sequences=int(segment_ids.max(axis=-1, initial=0).sum()),
        num_tokens=num_tokens,
        num_loss_tokens=int((np.asarray(batch["loss_mask"]) != 0).sum()),
        fill_ratio=num_tokens / segment_ids.size if segment_ids.size else 0.0,
    )


def pack_shared_prefixes(
    groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]], Sequence[Sequence[float]]]],
    seq_len: int,
    num_rows: int | None = None,
    pad_id: int = 0,
) -> tuple[PackedBatch, list[int]]:
    """Packs groups of sequences that share a prompt, the prompt written once per group.

    Group ``g = (prompt, completions, masks)`` stands for the sequences ``prompt + completions[i]``
    (``masks[i][j]`` weighs the prediction of ``completions[i][j]``). In a row the group becomes
    a *prefix* segment, ``prompt[:-1]`` at positions ``0 .. P-2``, then one *branch* segment per
    completion, ``[prompt[-1]] + completions[i][:-1]`` at positions ``P-1 ..``, whose targets are
    ``completions[i]``: every branch token attends causally to its own branch and to the prefix
    (``prefix_ids`` holds the prefix's segment id on branch tokens, 0 elsewhere), so each branch
    sees exactly the context of its unshared sequence, and the prompt's ``P - 1`` tokens are
    computed once instead of once per completion. The last completion token, which predicts
    nothing, is not written. A group longer than ``seq_len`` is split into several units, each
    with its own copy of the prefix. Units are placed first-fit-decreasing.

    Returns ``(batch, leftover)`` as :func:`pack_sequences`, plus ``prefix_ids``; the sequences
    are numbered in order (group 0's completions first): ``sequence_index`` holds the number on
    branch tokens and -1 on prefixes and padding; ``leftover`` lists the sequences of units that
    did not fit. Prompts must have at least one token, completions too.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    units: list[tuple[list[int], list[tuple[int, list[int], list[float]]]]] = []
    first = 0
    for g, (prompt, completions, masks) in enumerate(groups):
        prompt = list(prompt)
        if not prompt:
            raise ValueError(f"group {g} has an empty prompt")
        if len(masks) != len(completions):
            raise ValueError(f"group {g}: {len(masks)} masks for {len(completions)} completions")
        branches = []
        for i, (c, m) in enumerate(zip(completions, masks)):
            if not c:
                raise ValueError(f"group {g}: completion {i} is empty")
            if len(m) != len(c):
                raise ValueError(f"group {g}: mask {i} has {len(m)} entries for "
                                 f"{len(c)} tokens")
            if len(prompt) + len(c) - 1 > seq_len:
                raise ValueError(f"group {g}: prompt {len(prompt)} + completion {len(c)} tokens "
                                 f"exceed seq_len={seq_len} + 1")
            branches.append((first + i, list(c), [float(x) for x in m]))
        first += len(completions)
        prefix = prompt[:-1]
        unit: list = []
        used = len(prefix)
        for branch in branches:
            if unit and used + len(branch[1]) > seq_len:
                units.append((prompt, unit))
                unit, used = [], len(prefix)
            unit.append(branch)
            used += len(branch[1])
        if unit:
            units.append((prompt, unit))

    lengths = [len(p) - 1 + sum(len(c) for _, c, _ in bs) for p, bs in units]
    order = sorted(range(len(units)), key=lambda u: (-lengths[u], u))
    bins = _FirstFit(len(units) if num_rows is None else num_rows, seq_len)
    rows: list[list[int]] = []
    leftover: list[int] = []
    for u in order:
        row = bins.place(lengths[u])
        if row < 0:
            leftover.extend(i for i, _, _ in units[u][1])
            continue
        while len(rows) <= row:
            rows.append([])
        rows[row].append(u)
    num_out = len(rows) if num_rows is None else num_rows

    shape = (num_out, seq_len)
    out = dict(tokens=np.full(shape, pad_id, np.int32), targets=np.full(shape, pad_id, np.int32),
               loss_mask=np.zeros(shape, np.float32), positions=np.zeros(shape, np.int32),
               segment_ids=np.zeros(shape, np.int32), prefix_ids=np.zeros(shape, np.int32),
               sequence_index=np.full(shape, -1, np.int32))
    for r, members in enumerate(rows):
        offset, segment = 0, 0
        for u in members:
            prompt, branches = units[u]
            prefix_segment = 0
            if len(prompt) > 1:
                segment += 1
                prefix_segment = segment
                n = len(prompt) - 1
                span = slice(offset, offset + n)
                out["tokens"][r, span] = prompt[:-1]
                out["targets"][r, span] = prompt[1:]
                out["positions"][r, span] = np.arange(n)
                out["segment_ids"][r, span] = segment
                offset += n
            for i, completion, mask in branches:
                segment += 1
                n = len(completion)
                span = slice(offset, offset + n)
                out["tokens"][r, span] = [prompt[-1]] + completion[:-1]
                out["targets"][r, span] = completion
                out["loss_mask"][r, span] = mask
                out["positions"][r, span] = np.arange(len(prompt) - 1, len(prompt) - 1 + n)
                out["segment_ids"][r, span] = segment
                out["prefix_ids"][r, span] = prefix_segment
                out["sequence_index"][r, span] = i
                offset += n
    return out, sorted(leftover)
