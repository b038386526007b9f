"""Input pipeline of the tiny causal-LM recipe: packed batches of arithmetic examples.

An example is ``<bos> prompt answer <eos>`` as token ids, with a loss on the answer and ``<eos>``
tokens (optionally on every token after ``<bos>``). ``lm_batches`` is a ``grain.MapDataset`` whose
element ``k`` is the ``k``-th packed training batch; it is a pure function of ``(task, seed, k)``, so
a run resumed at step ``k`` reads exactly the batch it would have read. ``eval_arrays`` packs a fixed
held-out set and records which positions decide each example's greedy exact match.
"""

from __future__ import annotations

import sys

import grain
import numpy as np
from tokenizers import Tokenizer

from rl_jax.data.arithmetic import ArithmeticTask
from rl_jax.data.packing import PackedBatch, pack_sequences
from rl_jax.data.scratchpad import ScratchpadAdditionTask
from rl_jax.data.tokenizer import encode, special_token_ids


Task = ArithmeticTask | ScratchpadAdditionTask


def max_example_length(task: Task) -> int:
    """Most tokens in an encoded example: ``<bos>`` + prompt + longest answer + ``<eos>``."""
    return 1 + task.prompt_length + task.max_answer_length + 1


class ExampleEncoder:
    """Maps an example index of ``task`` to ``{"tokens": int32 [L], "loss_mask": float32 [L]}``.

    ``loss_mask`` is aligned with ``tokens`` (the weight of predicting each token, as
    ``pack_sequences`` expects): 1 on the answer and ``<eos>`` tokens, or on every token but
    ``<bos>`` when ``loss_on_all_tokens``. A task with ``example_segments(index)`` (``(prompt,
    [(text, trained), ...])``: a trace with text an environment wrote) is trained on its
    ``trained`` segments only.
    """

    def __init__(self, task: Task, tokenizer: Tokenizer, *,
                 loss_on_all_tokens: bool = False):
        self.task = task
        self.tokenizer = tokenizer
        self.loss_on_all_tokens = loss_on_all_tokens
        ids = special_token_ids(tokenizer)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        encode(tokenizer, task.ALPHABET)  # fails early if the tokenizer cannot spell the task

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        if hasattr(self.task, "example_segments"):  # text the environment wrote: not trained
            prompt, segments = self.task.example_segments(int(index))
        else:
            prompt, answer = self.task.example(int(index))
            segments = [(answer, True)]
        prompt_ids = encode(self.tokenizer, prompt)
        tokens, loss_mask = [self.bos_id, *prompt_ids], [0.0] * (1 + len(prompt_ids))
        if self.loss_on_all_tokens:
            loss_mask[1:] = [1.0] * len(prompt_ids)
        for text, trained in segments:
            ids = encode(self.tokenizer, text)
            tokens += ids
            loss_mask += [1.0 if trained or self.loss_on_all_tokens else 0.0] * len(ids)
        return {"tokens": np.array([*tokens, self.eos_id], np.int32),
                "loss_mask": np.array([*loss_mask, 1.0], np.float32)}


def example_dataset(task: Task, tokenizer: Tokenizer, *,
                    loss_on_all_tokens: bool = False) -> grain.MapDataset:
    """``grain.MapDataset`` whose element ``i`` is example ``i`` of ``task``, encoded.

    Elements are ``{"tokens": int32 [L], "loss_mask": float32 [L]}`` (see ``ExampleEncoder``);
    the dataset is infinite (length ``sys.maxsize``).
    """
    encoder = ExampleEncoder(task, tokenizer, loss_on_all_tokens=loss_on_all_tokens)
    return grain.MapDataset.range(sys.maxsize).map(encoder)


class _DrawTaskIndex:
    """Stream position -> a task example index, uniform in ``[0, 2**62)`` (grain's per-index rng)."""

    def __call__(self, position: int, rng: np.random.Generator) -> int:
        del position
        return int(rng.integers(0, 2**62))


class _PackRows:
    """A batch of encoded examples -> one packed batch of exactly ``num_rows`` rows."""

    def __init__(self, seq_len: int, num_rows: int, pad_id: int):
        self.seq_len, self.num_rows, self.pad_id = seq_len, num_rows, pad_id

    def __call__(self, examples) -> PackedBatch:
        batch, leftover = pack_sequences(
            [e["tokens"] for e in examples], self.seq_len, num_rows=self.num_rows,
            loss_masks=[e["loss_mask"] for e in examples], pad_id=self.pad_id)
        if leftover:  # the examples-per-batch count guarantees a fit; this guards that arithmetic
            raise AssertionError(f"{len(leftover)} examples did not fit in {self.num_rows} rows")
        return batch


class _TokenBudgetBatch:
    """Batch ``k`` → examples drawn with a Philox generator seeded by ``(seed, k)`` while their
    tokens fit in ``num_rows * seq_len``, packed first-fit-decreasing (an example that the
    packing cannot place is left out, so the rows never overflow). A pure function of
    ``(task, seed, k)``, as a resumed run needs."""

    def __init__(self, encoder: ExampleEncoder, seq_len: int, num_rows: int, seed: int):
        self.encoder, self.seq_len, self.num_rows, self.seed = encoder, seq_len, num_rows, seed

    def __call__(self, k: int) -> PackedBatch:
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, 7, k])))
        budget, examples = self.num_rows * self.seq_len, []
        while True:
            example = self.encoder(int(rng.integers(0, 2**62)))
            if len(example["tokens"]) > budget:
                break
            budget -= len(example["tokens"])
            examples.append(example)
        batch, _ = pack_sequences([e["tokens"] for e in examples], self.seq_len,
                                  num_rows=self.num_rows,
                                  loss_masks=[e["loss_mask"] for e in examples],
                                  pad_id=self.encoder.pad_id)
        return batch


def examples_per_row(task: Task, seq_len: int) -> int:
    """Examples packed per row: ``seq_len // max_example_length(task)``, so any draw fits."""
    longest = max_example_length(task)
    if seq_len < longest:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest example ({longest} tokens "
                         f"of {task})")
    return seq_len // longest


def lm_batches(task: Task, tokenizer: Tokenizer, *, rows_per_batch: int, seq_len: int,
               seed: int, loss_on_all_tokens: bool = False) -> grain.MapDataset:
    """Packed training batches: an infinite ``grain.MapDataset``, element ``k`` = batch ``k``.

    Each batch packs ``rows_per_batch * examples_per_row(task, seq_len)`` training examples,
    first-fit-decreasing, into ``[rows_per_batch, seq_len]`` arrays (keys as in
    ``rl_jax.data.packing``; ``sequence_index`` indexes the examples within the batch). Example
    ``j`` of batch ``k`` is task example ``I(seed, k * E + j)``, where ``I`` draws an index uniformly
    from ``[0, 2**62)`` with grain's per-element Philox generator; batch ``k`` is thus determined
    by ``(task, seed, k)`` alone.

    Args:
      task: a train-split ``ArithmeticTask``.
      tokenizer: a character tokenizer covering ``task.ALPHABET`` (e.g. ``build_char_tokenizer``).
      rows_per_batch: rows per batch.
      seq_len: tokens per row; at least ``max_example_length(task)``.
      seed: selects the example stream.
      loss_on_all_tokens: weigh every next-token prediction, not only the answer and ``<eos>``.
    """
    if task.split != "train":
        raise ValueError(f"lm_batches trains on the train split; got a {task.split!r} task")
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be positive, got {rows_per_batch}")
    encoder = ExampleEncoder(task, tokenizer, loss_on_all_tokens=loss_on_all_tokens)
    if getattr(task, "VARIABLE_LENGTH", False):  # lengths vary by 10x: fill rows by tokens
        examples_per_row(task, seq_len)  # validates seq_len
        return grain.MapDataset.range(sys.maxsize).map(
            _TokenBudgetBatch(encoder, seq_len, rows_per_batch, seed))
    per_batch = rows_per_batch * examples_per_row(task, seq_len)
    return (grain.MapDataset.range(sys.maxsize)
            .random_map(_DrawTaskIndex(), seed=seed)
            .map(encoder)
            .batch(per_batch, drop_remainder=True,
                   batch_fn=_PackRows(seq_len, rows_per_batch, encoder.pad_id)))


def eval_arrays(task: Task, tokenizer: Tokenizer, n: int, seq_len: int, *,
                rows_multiple_of: int = 1) -> PackedBatch:
    """The first ``n`` eval-split examples of ``task``, packed, with exact-match bookkeeping.

    Returns:
      The packed arrays ``[rows, seq_len]`` of ``pack_sequences`` (loss on answer and ``<eos>``;
      ``sequence_index`` is the eval example index), with rows padded to a multiple of
      ``rows_multiple_of``, plus ``example_id`` (int32 ``[rows, seq_len]``): the eval example whose
      answer or ``<eos>`` token is the target at that position, -1 elsewhere. Greedy decoding
      reproduces example ``e`` exactly iff ``argmax logits == targets`` at every position with
      ``example_id == e`` under teacher forcing; see ``exact_match``.
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    examples_per_row(task, seq_len)  # validates seq_len
    encoder = ExampleEncoder(task.with_split("eval"), tokenizer)
    examples = [encoder(i) for i in range(n)]
    batch, leftover = pack_sequences([e["tokens"] for e in examples], seq_len,
                                     loss_masks=[e["loss_mask"] for e in examples],
                                     pad_id=encoder.pad_id)
    assert not leftover
    rows = batch["tokens"].shape[0]
    extra = -rows % rows_multiple_of
    if extra:
        fill = {"tokens": encoder.pad_id, "targets": encoder.pad_id, "sequence_index": -1}
        batch = {k: np.concatenate([v, np.full((extra, seq_len), fill.get(k, 0), v.dtype)])
                 for k, v in batch.items()}
    batch["example_id"] = np.where(batch["loss_mask"] > 0, batch["sequence_index"],
                                   -1).astype(np.int32)
    return batch


def exact_match(batch: PackedBatch, n: int, *, predicted: np.ndarray | None = None,
                is_argmax: np.ndarray | None = None) -> np.ndarray:
    """Per-example greedy exact match under teacher forcing.

    Args:
      batch: an ``eval_arrays`` batch.
      n: number of examples in it.
      predicted: ``[rows, seq_len]`` argmax token ids of the model run on ``batch["tokens"]``;
      is_argmax: or ``[rows, seq_len]`` bool, whether each target is the model's argmax (as
        ``Transformer.token_stats`` returns). Give exactly one of the two.

    Returns:
      bool ``[n]``: every answer and ``<eos>`` position of the example predicted its target.
    """
    if (predicted is None) == (is_argmax is None):
        raise ValueError("give exactly one of predicted and is_argmax")
    example_id = batch["example_id"]
    given = np.asarray(predicted if is_argmax is None else is_argmax)
    if given.shape != example_id.shape:
        raise ValueError(f"{'predicted' if is_argmax is None else 'is_argmax'} {given.shape} does "
                         f"not match the batch {example_id.shape}")
    correct = given == batch["targets"] if is_argmax is None else given.astype(bool)
    wrong = ~correct & (example_id >= 0)
    return np.bincount(example_id[wrong], minlength=n)[:n] == 0
