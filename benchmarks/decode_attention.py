"""Decode attention on this machine's default backend: the Pallas kernel
(``rl_jax.generator.engine.kernels.pallas_decode``) against XLA's ``attend``.

1. Agreement: both against a float64 reference over ragged positions (0, the cache's end, past
   it, random), GQA groups 1/2/7/8, head_dim 64/128, float32 and bfloat16, engine cache
   lengths; the kernel passes where its error is within twice XLA's error or a floor
   (1e-5 for float32, 1e-2 for bfloat16). Also: NaN in the cache past each position leaves
   the output unchanged.
2. Selection: which attention ``ModelRunner(attention="auto")`` picks for some head shapes.
3. The engine's greedy tokens with attention="pallas" against "xla" (a small random model).
4. Time of the attention alone (ragged and full positions) and of raw decode steps of a
   ModelRunner with attention="xla" against "pallas".

On CPU the kernel runs interpreted (correct, slow): run it on a GPU for meaningful times.
Writes ``benchmarks/results/decode_attention-<backend>.json`` (or ``$OUT/...`` when set).

    python benchmarks/decode_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from generator_throughput import best_time, log  # benchmarks/ is on sys.path as the script's dir
from rl_jax.generator.engine.decode import attend
from rl_jax.generator.engine.kernels import pallas_decode
from rl_jax.generator.engine.kv_cache import SLOT_FIELDS
from rl_jax.generator.engine.runner import ModelRunner
from rl_jax.models.config import ModelConfig

RESULTS = Path(os.environ.get("OUT") or Path(__file__).parent / "results")


def reference(q, keys, values, positions) -> np.ndarray:
    """float64 attention of ``q`` (scaled as attend scales it) over each slot's positions."""
    dtype = q.dtype
    q = np.asarray((q * jnp.asarray(q.shape[-1] ** -0.5, dtype)).astype(jnp.float32), np.float64)
    keys, values = (np.asarray(x.astype(jnp.float32), np.float64) for x in (keys, values))
    scores = np.einsum("skgx,skxt->skgt", q, keys)
    t = keys.shape[-1]
    scores = np.where(np.arange(t)[None, None, None] <= positions[:, None, None, None], scores,
                      -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("skgt,sktx->skgx", weights / weights.sum(-1, keepdims=True), values)


def agreement(interpret: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    kernel = jax.jit(lambda *a: pallas_decode.decode_attention(*a, interpret=interpret))
    rows = []
    for g in (1, 2, 7, 8):
        for d in (64, 128):
            for dtype in (jnp.float32, jnp.bfloat16):
                for t in (16, 192, 1024):
                    s, k = 16, 2
                    q, keys, values = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                                       for shape in ((s, k, g, d), (s, k, d, t), (s, k, t, d)))
                    positions = np.array([0, t - 1, t, 63 % t, 64 % t, 65 % t,
                                          *rng.integers(0, t, s - 6)], np.int32)
                    want = reference(q, keys, values, positions)
                    got = np.asarray(kernel(q, keys, values, positions).astype(jnp.float32))
                    xla = np.asarray(jax.jit(lambda *a, dt=dtype: attend(*a, dtype=dt))(
                        q, keys, values, positions).astype(jnp.float32))
                    err, xla_err = float(np.abs(got - want).max()), float(
                        np.abs(xla - want).max())
                    floor = 1e-5 if dtype == jnp.float32 else 1e-2
                    rows.append({"group": g, "head_dim": d, "dtype": jnp.dtype(dtype).name,
                                 "cache_len": t, "pallas_error": err, "xla_error": xla_err,
                                 "ok": bool(err <= max(2 * xla_err, floor))})
    # NaN past each position changes nothing
    q, keys, values = (rng.standard_normal(shape, np.float32)
                       for shape in ((8, 2, 4, 64), (8, 2, 64, 192), (8, 2, 192, 64)))
    positions = np.array([0, 5, 63, 64, 100, 150, 190, 191], np.int32)
    before = np.asarray(kernel(q, keys, values, positions))
    for i, p in enumerate(positions):
        keys[i, :, :, p + 1:] = np.nan
        values[i, :, p + 1:] = np.nan
    after = np.asarray(kernel(q, keys, values, positions))
    rows.append({"nan_past_position_unchanged": bool(np.array_equal(before, after)),
                 "ok": bool(np.array_equal(before, after) and np.isfinite(after).all())})
    return rows


def selection() -> dict:
    picked = {}
    for g, d in ((1, 64), (2, 128), (7, 64), (4, 32), (2, 24)):
        cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2 * g, num_kv_heads=2, head_dim=d)
        for dtype in (jnp.float32, jnp.bfloat16):
            runner = ModelRunner(cfg, max_slots=8, max_seq_len=512, dtype=dtype)
            picked[f"group{g}_dim{d}_{jnp.dtype(dtype).name}"] = runner.attention_backend
    return picked


def engine_tokens() -> dict:
    from rl_jax.generator.engine.config import EngineConfig
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.types import GenerateRequest, SamplingParams
    from rl_jax.trainer.state import ModelSpec
    cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=64)
    params = ModelSpec(cfg, mesh=None).init_params(3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (3, 9, 17, 30, 5, 12, 70)]
    result = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        outputs = {}
        for attention in ("pallas", "xla"):
            engine = Engine(cfg, params, dtype=dtype, engine_config=EngineConfig(
                max_slots=8, max_seq_len=256, attention=attention))
            try:
                assert engine.attention_backend == attention, engine.attention_backend
                futures = [engine.submit(GenerateRequest(p, SamplingParams(
                    max_new_tokens=40, temperature=0.0, ignore_eos=True))) for p in prompts]
                outputs[attention] = [f.result(timeout=300)[0] for f in futures]
            finally:
                engine.shutdown()
        same = [a.output_ids == b.output_ids for a, b in zip(outputs["pallas"], outputs["xla"])]
        diff = max(float(np.abs(np.subtract(a.output_logprobs, b.output_logprobs)).max())
                   for a, b in zip(outputs["pallas"], outputs["xla"]))
        result[jnp.dtype(dtype).name] = {"same_tokens": same, "max_logprob_diff": diff}
    return result


def attention_times(quick: bool) -> list[dict]:
    rows = []
    k, g, d, dtype = 8, 4, 128, jnp.bfloat16
    rng = np.random.default_rng(1)
    xla = jax.jit(lambda *a: attend(*a, dtype=dtype))
    pallas = jax.jit(pallas_decode.decode_attention)
    for s in ((8, 64) if quick else (8, 64, 256)):
        for t in ((1024,) if quick else (1024, 4096)):
            q = jnp.asarray(rng.standard_normal((s, k, g, d)), dtype)
            keys = jnp.asarray(rng.standard_normal((s, k, d, t)), dtype)
            values = jnp.asarray(rng.standard_normal((s, k, t, d)), dtype)
            for name, positions in (("ragged", rng.integers(0, t, s)),
                                    ("full", np.full(s, t - 1))):
                positions = jnp.asarray(positions, jnp.int32)
                row = {"slots": s, "kv_heads": k, "group": g, "head_dim": d, "cache_len": t,
                       "positions": name}
                for label, fn in (("xla", xla), ("pallas", pallas)):
                    row[f"{label}_ms"] = 1e3 * best_time(
                        lambda fn=fn: jax.block_until_ready(fn(q, keys, values, positions)), repeats=10)
                live = float(np.sum(np.minimum(np.asarray(positions) + 1, t)))
                itemsize = jnp.dtype(dtype).itemsize  # keys and values of the positions read
                row["pallas_live_GBps"] = 2 * live * k * d * itemsize / row["pallas_ms"] / 1e6
                row["xla_whole_GBps"] = 2 * s * t * k * d * itemsize / row["xla_ms"] / 1e6
                rows.append(row)
                log(f"attention {row}")
    return rows


DECODE_MODEL = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                           num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64)


def decode_steps(shapes, cfg: ModelConfig = DECODE_MODEL, steps: int = 32) -> list[dict]:
    """ms per raw decode step (``ModelRunner.decode``) with each attention, for
    ``(batch, prompt_len)`` in ``shapes``; the slots sit at positions spread over the prompt."""
    from rl_jax.trainer.state import ModelSpec
    params = ModelSpec(cfg, mesh=None).init_params(0)
    rows = []
    for batch, prompt_len in shapes:
        row = {"batch": batch, "prompt_len": prompt_len,
               "model": f"hidden{cfg.hidden_size}_l{cfg.num_layers}_h{cfg.num_heads}"
                        f"_kv{cfg.num_kv_heads}_d{cfg.head_dim}"}
        prompts = np.random.RandomState(0).randint(0, cfg.vocab_size, (batch, prompt_len))
        for attention in ("xla", "pallas"):
            runner = ModelRunner(cfg, max_slots=batch, max_seq_len=prompt_len + 200,
                                 dtype=jnp.bfloat16, attention=attention)
            weights = runner.prepare(params)
            lengths = np.full((batch,), prompt_len, np.int32)
            # ragged: slots sit at positions spread over the prompt length
            positions = np.linspace(prompt_len // 4, prompt_len, batch).astype(np.int32)
            kv, vv, logits = runner.prefill(params, prompts.astype(np.int32), lengths)
            values = {name: np.zeros((batch,), dt) for name, dt in SLOT_FIELDS.items()}
            values.update(position=positions, seed=np.arange(batch),
                          temperature=np.ones(batch), top_k=np.full(batch, -1),
                          top_p=np.ones(batch))
            slots = np.arange(batch, dtype=np.int32)
            jax.block_until_ready(runner.admit(kv, vv, logits, slots, slots, values,
                                               np.ones((batch,), bool), False))
            for slot in range(batch):  # the pages of the positions the steps write
                runner.pages.grow(slot, runner.max_seq_len)
            out = None
            for i in range(3):  # compile
                out = runner.decode(weights, batch, prompt_len + 1 + i, False)
            jax.block_until_ready(out)
            start = time.perf_counter()
            for i in range(steps):
                out = runner.decode(weights, batch, prompt_len + 4 + i, False)
            jax.block_until_ready(out)
            row[f"{attention}_step_ms"] = 1e3 * (time.perf_counter() - start) / steps
            row["kv_len"] = runner.kv_len
            del runner, weights
        rows.append(row)
        log(f"decode {row}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timing shapes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    backend = jax.default_backend()
    log(f"backend {backend}: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    results = {"backend": backend, "device": jax.devices()[0].device_kind,
               "jax": jax.__version__}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"decode_attention-{backend}.json"

    def save():  # after each part: a run cut short keeps what it measured
        path.write_text(json.dumps(results, indent=1))

    results["agreement"] = agreement(interpret=backend == "cpu")
    save()
    bad = [r for r in results["agreement"] if not r["ok"]]
    log(f"agreement: {len(results['agreement']) - len(bad)} ok, {len(bad)} not: {bad}")
    results["auto_selection"] = selection()
    log(f"auto selection {results['auto_selection']}")
    save()
    results["engine"] = engine_tokens()
    log(f"engine {results['engine']}")
    save()
    if backend != "cpu":
        results["attention"] = attention_times(args.quick)
        save()
        results["decode"] = decode_steps(((64, 500),) if args.quick else
                                         ((8, 500), (64, 1500)))
    save()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
