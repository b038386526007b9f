"""Compiling an engine's programs before it serves, by serving short requests: the first decode
and prefill, and optionally every decode and admission shape a run can meet, so that no request
waits for a compilation later."""

from __future__ import annotations

import logging
import threading
import time

from rl_jax.generator.engine.core import Engine
from rl_jax.generator.engine.kv_cache import MIN_ADMIT, batch_bucket, kv_bucket
from rl_jax.generator.types import GenerateRequest, SamplingParams

log = logging.getLogger("rl_jax.generator.server")  # one logger for the server's modules


def compile_engine(engine: Engine, max_seq_len: int, max_slots: int, *, all_shapes: bool):
    """Compiles prefill, decode and sampling with one short greedy request (per data-parallel
    replica); with ``all_shapes`` (the server's ``warmup_shapes``), also every decode shape a
    run can meet (each power-of-two batch up to a replica's slots, each grown to
    ``max_seq_len``) and every admission shape of prompts up to the shortest prefill bucket, so
    that no request waits for a compilation later (a second or more each on a CPU core).
    ``max_slots``: the server's, over all replicas."""
    steps = min(2, max_seq_len - 1)
    if steps > 0:
        _burst(engine, 1, 1, tag="first", max_new_tokens=steps, temperature=0.0)
    if not all_shapes or max_seq_len < 3:
        return
    start = time.perf_counter()
    slots = max_slots // engine.data_parallel  # per replica
    sizes = sorted({min(1 << k, slots) for k in range(slots.bit_length() + 1)})
    # A sequence may not need more pages than the cache holds.
    max_seq_len = min(max_seq_len, engine.runner.num_pages * engine.runner.page_size)
    # The decode programs compile in a second thread meanwhile (XLA compiles outside the GIL),
    # from the largest batch and widest page table down while the requests below meet them
    # from the smallest up: each is compiled once, by whichever gets to it first.
    batches = sorted({batch_bucket(n, slots) for n in sizes})  # what decode steps cover
    ahead = threading.Thread(target=_compile_decode, args=(engine, batches, max_seq_len),
                             name="warmup-compile")
    ahead.start()
    try:
        _compile_by_serving(engine, max_seq_len, slots, sizes)
    finally:
        ahead.join()
    log.info("compiled decode and prefill for batches %s up to %d tokens in %.1f s", sizes,
             max_seq_len, time.perf_counter() - start)


def _compile_decode(engine: Engine, batches: list[int], max_seq_len: int):
    """Compiles each replica's unfiltered decode program for every batch in ``batches`` and
    every page table width up to ``max_seq_len`` positions, largest first, without running
    them."""
    steps = engine.engine_config.decode_steps
    try:
        for runner, weights in zip(engine.runners, engine.decode_weights()):
            for batch in reversed(batches):
                for width in reversed(runner.decode_widths(max_seq_len)):
                    runner.compile_decode(weights, batch, width, False, steps)
    except Exception:  # what is missed here is compiled by the requests
        log.debug("compiling decode programs ahead failed", exc_info=True)


def _compile_by_serving(engine: Engine, max_seq_len: int, slots: int, sizes: list[int]):
    """Every decode batch grown to ``max_seq_len``, every admission shape, cache moves, and
    the decode steps of every page table width, by serving short requests (see
    :func:`compile_engine`)."""
    for n in sizes:
        _burst(engine, 1, n, tag=f"batch-{n}", max_new_tokens=max_seq_len - 1)
    # Admissions of several prompts at once (a batch of rollout groups, an evaluation set,
    # both mixed): the first tokens of every power-of-two prompt count × sequence count,
    # and installing every power-of-two sequence count at every cache length.
    for prompts in sizes:
        for n in sizes:
            if prompts * n <= slots and (n == 1 or prompts * n > MIN_ADMIT):
                _burst(engine, prompts, n, tag=f"{prompts}x{n}")
    for runner in engine.runners:  # moving sequences to lower slots (ContinuousBatcher._compact)
        runner.compile_move()
    # Decode steps whose attention reads whole pages take one program per page table width
    # (the native and Pallas kernels take the whole table: one width).
    lengths = sorted({kv_bucket(n, max_seq_len) for n in range(1, max_seq_len + 1)})
    if engine.runner.reads_own_length:
        lengths = lengths[:1]
    for length in lengths[1:]:
        for n in sizes:
            if n >= MIN_ADMIT or n == slots:
                # The cache stays this long when idle.
                _burst(engine, 1, 1, tag=f"grow-{length}", max_new_tokens=length - 1,
                       temperature=0.0)
                _burst(engine, 1, n, tag=f"{length}-{n}")


def _burst(engine: Engine, prompts: int, n: int, tag: str, max_new_tokens: int = 2,
           temperature: float = 1.0):
    """``prompts`` one-token requests of ``n`` samples for each data-parallel replica, all
    admitted in one scheduler pass (a new request goes to the replica with the most free
    slots, so each replica gets the same)."""
    engine.pause("in_place")
    deadline = time.monotonic() + 60
    while not engine.paused and time.monotonic() < deadline:
        time.sleep(0.001)
    futures = [engine.submit(GenerateRequest(
        [i % engine.config.vocab_size], SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True, n=n,
            seed=i),
        rid=f"warmup-{tag}-{i}")) for i in range(prompts * engine.data_parallel)]
    engine.resume()
    for future in futures:
        future.result(timeout=1800)
