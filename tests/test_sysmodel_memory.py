"""The systems model's memory per device against what XLA compiles.

Each case compiles a program ahead of time from abstract shapes only (nothing runs) and compares
``compiled.memory_analysis()``'s peak (arguments + outputs - aliased + temporaries) with
:mod:`rl_jax.sysmodel.memory`'s prediction: the trainer's step (``make_train_step``, and
``StreamingTrainStep``'s accumulation and update programs) on one device and on 8 forced host
devices, in float32, bfloat16 over float32 master weights and bfloat16, with and without
gradient accumulation and remat, at reduced shapes and at the full qwen2.5-0.5b shape (compiled
only: no parameter is allocated); the generator's prefill and decode programs (``ModelRunner``)
and its KV page pool as the engine allocates it from a budget. The model is asked for
``backend="cpu"``: XLA's CPU backend carries bfloat16 products in float32 and neither fuses the
log-probabilities' elementwise work nor updates the donated state in place, which accelerators
do. Most cases compute in float32, where the CPU's activations have the dtype an accelerator's
would.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from rl_jax.models.shapes import shape as named_shape
from rl_jax.sysmodel.accelerators import get_accelerator
from rl_jax.sysmodel.errors import SysModelError
from rl_jax.sysmodel.memory import trainer_memory
from rl_jax.sysmodel.memory_serving import generator_memory
from rl_jax.sysmodel.shape import ModelShape

TOLERANCE = 0.15
GIB = 2 ** 30


def compiled_peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def model_config(name: str, layers: int | None = None):
    cfg = named_shape(name)
    return dataclasses.replace(cfg, num_layers=layers) if layers else cfg


def compile_train_step(cfg, *, batch, seq, mesh_shape, remat, block, dtype="float32",
                       param_dtype="float32", accumulation="none",
                       lora_rank=0) -> dict[str, int]:
    """The compiled peak of each program of the train step on micro-batches of ``batch`` rows:
    ``{"step": ...}`` (``make_train_step``; two micro-batches in a ``lax.scan`` for
    ``accumulation="scan"``) or ``{"accumulate": ..., "apply": ...}`` (``StreamingTrainStep``),
    compiled from abstract shapes (no parameter is allocated)."""
    from rl_jax.models.lora import LoraConfig
    from rl_jax.sharding import make_mesh
    from rl_jax.trainer.state import ModelSpec, OptimizerConfig, abstract_state, make_optimizer
    from rl_jax.trainer.step import (LMBatch, StreamingTrainStep, causal_lm_loss,
                                     default_batch_sharding, make_train_step)
    devices = jax.devices()[:mesh_shape[0] * mesh_shape[1] * mesh_shape[2]]
    mesh = make_mesh(*mesh_shape, devices=devices)
    spec = ModelSpec(cfg, mesh=mesh, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype),
                     remat=remat, attention="xla",
                     lora=LoraConfig(rank=lora_rank) if lora_rank else None)
    tx = make_optimizer(OptimizerConfig())
    loss = functools.partial(causal_lm_loss, block_size=block)
    if accumulation == "streaming":
        step = StreamingTrainStep(spec, tx, loss, micro_rows=batch)
        abstract = LMBatch.abstract(batch, seq)
        step.compile(abstract)
        _, accumulate, apply = step._programs[_shape_key(abstract)]
        return {"accumulate": compiled_peak(accumulate), "apply": compiled_peak(apply)}
    micro = 2 if accumulation == "scan" else 1
    step = make_train_step(spec, tx, loss, num_microbatches=micro)
    abstract = LMBatch.abstract(micro * batch, seq, sharding=default_batch_sharding(spec))
    return {"step": compiled_peak(step.lower(abstract_state(tx, spec), abstract).compile())}


def _shape_key(abstract):
    from rl_jax.trainer.step import _shape_key as key
    return key(abstract)


def check_trainer_memory(name, layers, batch, seq, mesh, remat, block, dtype,
                         param_dtype="float32", accumulation="none", lora_rank=0):
    """Every compiled program of the step within :data:`TOLERANCE` of the model's figure."""
    cfg = model_config(name, layers)
    compiled = compile_train_step(cfg, batch=batch, seq=seq, mesh_shape=mesh, remat=remat,
                                  block=block, dtype=dtype, param_dtype=param_dtype,
                                  accumulation=accumulation, lora_rank=lora_rank)
    predicted = trainer_memory(ModelShape.from_model_config(cfg), batch=batch, seq=seq,
                               mesh=mesh, dtype=dtype, param_dtype=param_dtype, remat=remat,
                               logits_block=block, attention="materialised", backend="cpu",
                               accumulation=accumulation, lora_rank=lora_rank)
    programs = predicted.notes["programs"]
    assert set(programs) == set(compiled)
    errors = {k: programs[k] / compiled[k] - 1 for k in compiled}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), (
        f"{name} x{cfg.num_layers} {batch}x{seq} mesh {mesh} remat {remat} {dtype} over "
        f"{param_dtype}, accumulation {accumulation}: predicted {predicted.describe()}; "
        + ", ".join(f"{k} {programs[k] / 2**30:.3f} GiB against compiled "
                    f"{compiled[k] / 2**30:.3f} GiB ({errors[k]:+.1%})" for k in compiled))
    return predicted, compiled


# (shape, layers, batch, seq, mesh, remat, logits block, computation dtype)
TRAIN_CASES = [
    ("tiny", None, 8, 128, (1, 1, 1), "none", 4096, "float32"),
    ("small", None, 4, 256, (1, 1, 1), "full", 4096, "float32"),
    ("small", None, 4, 256, (1, 1, 1), "full", 4096, "bfloat16"),
    ("small", None, 4, 256, (1, 1, 1), "dots", 2048, "float32"),
    ("small", None, 8, 256, (1, 4, 2), "none", 4096, "float32"),
    ("small", None, 8, 256, (1, 8, 1), "full", 4096, "float32"),
    ("qwen2.5-0.5b", 2, 2, 256, (1, 1, 1), "full", 4096, "float32"),
    ("qwen2.5-0.5b", 2, 8, 256, (1, 8, 1), "full", 4096, "float32"),
]


@pytest.mark.parametrize("name,layers,batch,seq,mesh,remat,block,dtype", TRAIN_CASES,
                         ids=["-".join(map(str, c[:1] + c[4:6] + c[7:])) for c in TRAIN_CASES])
def test_trainer_memory_matches_the_compiled_step(name, layers, batch, seq, mesh, remat, block,
                                                  dtype):
    check_trainer_memory(name, layers, batch, seq, mesh, remat, block, dtype)


# Low-rank adapters over a frozen base: (shape, layers, batch, seq, mesh, remat, dtype,
# parameter dtype, accumulation, rank).
LORA_CASES = [
    ("small", None, 4, 256, (1, 1, 1), "full", "float32", "float32", "none", 8),
    ("small", None, 4, 256, (1, 1, 1), "dots", "bfloat16", "bfloat16", "none", 8),
    ("small", None, 8, 256, (1, 4, 2), "none", "float32", "float32", "none", 16),
    ("small", None, 4, 256, (1, 1, 1), "full", "float32", "float32", "streaming", 8),
    ("qwen2.5-0.5b", 2, 2, 256, (1, 1, 1), "full", "bfloat16", "float32", "none", 16),
    ("qwen2.5-0.5b", 2, 8, 256, (1, 8, 1), "full", "float32", "float32", "none", 16),
]


@pytest.mark.parametrize("name,layers,batch,seq,mesh,remat,dtype,param_dtype,accumulation,rank",
                         LORA_CASES, ids=["-".join(map(str, c[:1] + c[4:]))
                                          for c in LORA_CASES])
def test_lora_trainer_memory_matches_the_compiled_step(name, layers, batch, seq, mesh, remat,
                                                       dtype, param_dtype, accumulation, rank):
    predicted, _ = check_trainer_memory(name, layers, batch, seq, mesh, remat, 4096, dtype,
                                        param_dtype, accumulation, lora_rank=rank)
    full = trainer_memory(ModelShape.from_model_config(model_config(name, layers)),
                          batch=batch, seq=seq, mesh=mesh, dtype=dtype,
                          param_dtype=param_dtype, remat=remat, backend="cpu",
                          accumulation=accumulation)
    assert predicted.terms["params"] < 0.2 * full.terms["params"]  # the adapters only
    assert "embedding" not in predicted.notes["phases"]  # no embedding gradient


def test_lora_elements_are_the_adapters_a_version_moves():
    from rl_jax.models.lora import TARGETS
    from rl_jax.sysmodel.memory import LORA_TARGETS, lora_elements
    assert LORA_TARGETS == tuple(TARGETS)  # the same names as the trainer's
    shape = ModelShape.from_model_config(model_config("qwen2.5-0.5b"))
    d, f, q, kv = 896, 4864, 14 * 64, 2 * 64
    per_rank = 24 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    assert lora_elements(shape, 16) == 16 * per_rank
    # qwen2.5-0.5b at rank 16 on every projection: about 1.8% of its weights
    assert 0.01 < lora_elements(shape, 16) / shape.params < 0.03
    assert lora_elements(shape, 16, ("q", "v"), fsdp=4) < lora_elements(shape, 16, ("q", "v"))
    with pytest.raises(SysModelError, match="targets"):
        lora_elements(shape, 16, ("qkv",))


# The trainer's precisions (float32; bfloat16 compute over float32 master weights; bfloat16
# parameters and moments) with and without gradient accumulation and remat, at a reduced
# shape: (computation dtype, parameter dtype, remat, accumulation). With TRAIN_CASES and
# FULL_SHAPE_CASES every precision meets every remat and every accumulation at least once.
PRECISION_CASES = [
    ("bfloat16", "bfloat16", "full", "none"),
    ("float32", "float32", "none", "scan"),
    ("bfloat16", "bfloat16", "none", "scan"),
    ("float32", "float32", "full", "streaming"),
]


@pytest.mark.parametrize("dtype,param_dtype,remat,accumulation", PRECISION_CASES,
                         ids=["-".join(c) for c in PRECISION_CASES])
def test_trainer_memory_matches_every_precision_and_accumulation(dtype, param_dtype, remat,
                                                                 accumulation):
    check_trainer_memory("small", None, 4, 256, (1, 1, 1), remat, 4096, dtype, param_dtype,
                         accumulation)


# At the full qwen2.5-0.5b shape (494M parameters, vocabulary 151,936), compiled only: the
# recipes' micro-batch of 2 x 128 tokens.
FULL_SHAPE_CASES = [
    ("float32", "float32", "full", "none"),
    ("bfloat16", "float32", "none", "scan"),
    ("bfloat16", "float32", "full", "streaming"),
    ("bfloat16", "bfloat16", "none", "streaming"),
]


def test_the_cases_meet_every_precision_with_every_remat_and_accumulation():
    cases = ([(c[7], "float32", c[5], "none") for c in TRAIN_CASES] + PRECISION_CASES
             + FULL_SHAPE_CASES)
    precisions = {(dtype, param_dtype) for dtype, param_dtype, _, _ in cases}
    assert precisions == {("float32", "float32"), ("bfloat16", "float32"),
                          ("bfloat16", "bfloat16")}
    for precision in precisions:
        assert {c[2] for c in cases if c[:2] == precision} >= {"none", "full"}, precision
        assert {c[3] for c in cases if c[:2] == precision} == {"none", "scan", "streaming"}


@pytest.mark.parametrize("dtype,param_dtype,remat,accumulation", FULL_SHAPE_CASES,
                         ids=["-".join(c) for c in FULL_SHAPE_CASES])
def test_trainer_memory_matches_the_compiled_step_at_qwen2_5_0_5b(dtype, param_dtype, remat,
                                                                   accumulation):
    check_trainer_memory("qwen2.5-0.5b", None, 2, 128, (1, 1, 1), remat, 4096, dtype,
                         param_dtype, accumulation)


def test_the_streaming_step_plans_the_moments_beside_its_accumulation():
    """The process of a streaming step holds the moments beside the accumulation program
    (not one of its arguments), and an EMA beside everything."""
    shape = ModelShape.from_model_config(named_shape("qwen2.5-0.5b"))
    kw = dict(batch=2, seq=128, dtype="bfloat16", param_dtype="bfloat16", remat="none",
              backend="cpu")
    streaming = trainer_memory(shape, accumulation="streaming", **kw)
    programs = streaming.notes["programs"]
    moments = streaming.terms["moments"]
    assert streaming.total == max(programs["accumulate"] + moments, programs["apply"])
    assert streaming.terms["accumulator"] == 4 * streaming.terms["params"] / 2
    with_ema = trainer_memory(shape, accumulation="streaming", ema=True, **kw)
    assert with_ema.total == streaming.total + streaming.terms["params"]
    one = trainer_memory(shape, **kw)
    assert "accumulator" not in one.terms and one.notes["programs"]["step"] == one.total


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_generator_memory_matches_the_compiled_programs(tensor_parallel):
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.models.transformer import layer_param_specs
    from rl_jax.sharding import make_mesh
    cfg = model_config("small")
    slots, max_len, rows, prompt = 16, 512, 4, 128
    mesh = None
    if tensor_parallel > 1:
        mesh = make_mesh(data=1, fsdp=1, tensor=tensor_parallel,
                         devices=jax.devices()[:tensor_parallel])
    runner = ModelRunner(cfg, max_slots=slots, max_seq_len=max_len, mesh=mesh,
                         dtype=jnp.float32, attention="xla")
    axes = {"embed": ((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
            "final_norm": ((cfg.hidden_size,), ("norm",)),
            "lm_head": ((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab")),
            "layers": {name: ((cfg.num_layers,) + shp, logical)
                       for name, (shp, logical) in layer_param_specs(cfg).items()}}

    def struct(shape, logical):
        sharding = None if mesh is None else runner.rules.sharding(mesh, logical)
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    params = {name: struct(*value) for name, value in axes.items() if name != "layers"}
    params["layers"] = {name: struct(*value) for name, value in axes["layers"].items()}
    tokens = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
    prefill = runner._prefill.lower(params, tokens, jax.ShapeDtypeStruct((rows,), jnp.int32))
    weights = jax.eval_shape(runner._prepare, params)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         runner.state)
    table = jax.ShapeDtypeStruct((slots, runner.pages.width), jnp.int32)
    decode = runner._decode.lower(weights, *runner._cache_structs(), state, table,
                                  batch=slots, filtered=False)
    predicted = generator_memory(ModelShape.from_model_config(cfg),
                                 tensor_parallel=tensor_parallel, max_slots=slots,
                                 max_seq_len=max_len, dtype="float32",
                                 prefill_tokens=rows * prompt, prefill_len=prompt)
    programs = predicted.notes["programs"]
    for name, program in (("prefill", prefill), ("decode", decode)):
        compiled = compiled_peak(program.compile())
        error = programs[name] / compiled - 1
        assert abs(error) <= TOLERANCE, (f"{name} at tp={tensor_parallel}: predicted "
                                         f"{programs[name] / 2**20:.1f} MiB, compiled "
                                         f"{compiled / 2**20:.1f} MiB ({error:+.1%})")
    assert predicted.terms["kv_cache"] == runner.cache_bytes / tensor_parallel


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_generator_kv_cache_is_the_page_pool_its_budget_buys(tensor_parallel):
    """A budget of 37.5 pages of 16 positions: the runner the engine would build (37 pages,
    ``Engine``'s rounding) allocates exactly the model's bytes per device, whatever the slots
    and their max_seq_len; the pool's tokens are what sequences may hold together."""
    from rl_jax.generator.engine.runner import ModelRunner
    from rl_jax.sharding import make_mesh
    cfg = model_config("small")
    page = ModelRunner.page_bytes(cfg, 16, jnp.float32)
    budget = 37 * page + page // 2
    mesh = None
    if tensor_parallel > 1:
        mesh = make_mesh(data=1, fsdp=1, tensor=tensor_parallel,
                         devices=jax.devices()[:tensor_parallel])
    runner = ModelRunner(cfg, max_slots=64, max_seq_len=4096, mesh=mesh, dtype=jnp.float32,
                         attention="xla", page_size=16, num_pages=budget // page)
    per_device = sum(shard.data.nbytes for x in (*runner.k_cache, *runner.v_cache)
                     for shard in x.addressable_shards if shard.device == jax.devices()[0])
    predicted = generator_memory(ModelShape.from_model_config(cfg),
                                 tensor_parallel=tensor_parallel, max_slots=64,
                                 max_seq_len=4096, dtype="float32", page_size=16,
                                 kv_cache_bytes=budget)
    assert predicted.terms["kv_cache"] == per_device == runner.cache_bytes / tensor_parallel
    assert predicted.notes["kv_pages"] == 37 and predicted.notes["kv_tokens"] == 37 * 16
    unbudgeted = generator_memory(ModelShape.from_model_config(cfg),
                                  tensor_parallel=tensor_parallel, max_slots=64,
                                  max_seq_len=4096, dtype="float32", page_size=16)
    assert unbudgeted.terms["kv_cache"] == 64 * 256 * page / tensor_parallel
    with pytest.raises(SysModelError, match="holds no KV-cache page"):
        generator_memory(ModelShape.from_model_config(cfg), max_slots=4, max_seq_len=64,
                         page_size=16, kv_cache_bytes=page - 1, dtype="float32")


def test_host_memory_counts_the_staging_slots_and_runtimes():
    from rl_jax.sysmodel.memory_serving import RUNTIME_BYTES, host_memory
    shape = ModelShape.from_model_config(named_shape("qwen2.5-0.5b"))
    host = host_memory(shape, publish_dtype="bfloat16", staging_slots=2, processes=3)
    assert host.terms["staging"] == 2 * 2 * shape.params
    assert host.terms["runtime"] == 3 * RUNTIME_BYTES
    assert host.total == sum(host.terms.values())
    with pytest.raises(SysModelError, match="staging_slots"):
        host_memory(shape, staging_slots=0)


def test_memory_model_refuses_bad_input():
    shape = ModelShape.from_model_config(named_shape("tiny"))
    with pytest.raises(SysModelError, match="remat"):
        trainer_memory(shape, batch=1, seq=8, remat="some")
    with pytest.raises(SysModelError, match="mesh"):
        trainer_memory(shape, batch=1, seq=8, mesh=(1, 0, 1))
    with pytest.raises(SysModelError, match="batch"):
        trainer_memory(shape, batch=0, seq=8)
    with pytest.raises(SysModelError, match="attention"):
        trainer_memory(shape, batch=1, seq=8, attention="flash")
    with pytest.raises(SysModelError, match="accumulation must be one of"):
        trainer_memory(shape, batch=1, seq=8, accumulation="sum")
    with pytest.raises(SysModelError, match="max_slots"):
        generator_memory(shape, max_slots=0, max_seq_len=8)


def test_memory_scales_with_the_mesh_and_the_batch():
    shape = ModelShape.from_model_config(named_shape("qwen2.5-7b"))
    one = trainer_memory(shape, batch=8, seq=1024, mesh=(1, 8, 1))
    more = trainer_memory(shape, batch=8, seq=1024, mesh=(1, 16, 1))
    assert more.terms["params"] == pytest.approx(one.terms["params"] / 2, rel=0.01)
    double = trainer_memory(shape, batch=16, seq=1024, mesh=(1, 8, 1))
    assert double.notes["saved_activations_all"] == 2 * one.notes["saved_activations_all"]
    assert trainer_memory(shape, batch=128, seq=1024, mesh=(1, 8, 1)).total > one.total
    full = trainer_memory(shape, batch=8, seq=1024, mesh=(1, 8, 1), remat="full")
    none = trainer_memory(shape, batch=8, seq=1024, mesh=(1, 8, 1), remat="none")
    assert none.total > full.total
    tp = [generator_memory(shape, tensor_parallel=t, max_slots=64, max_seq_len=4096).total
          for t in (1, 2, 4)]
    assert tp[0] > tp[1] > tp[2]
    assert get_accelerator("h100").memory_capacity > 0


# ---- the planner -------------------------------------------------------------------------------

def plan_workload():
    from rl_jax.sysmodel.invariants import Workload
    from rl_jax.sysmodel.lengths import LogNormalLengths
    return Workload(prompt_len=256, group_size=4, groups_per_batch=8,
                    lengths=LogNormalLengths(256, 0.8, 1024), max_lag=2)


def test_sweep_rejects_layouts_that_do_not_fit_and_says_why():
    from rl_jax.sysmodel.sweep import SweepOptions, sweep
    big = ModelShape.from_model_config(named_shape("qwen2.5-32b"))
    opts = SweepOptions(num_steps=4, simulate_top=1, split_points=2, batches=(8, 32),
                        tensor_parallel=(1,))
    with pytest.raises(SysModelError, match="trainer memory does not fit on 1 chip ") as e:
        sweep(big, get_accelerator("tpu_v5e"), 2, plan_workload(), opts)
    assert "generator memory does not fit at tp=1" in str(e.value)


def test_sweep_keeps_layouts_that_fit_with_their_memory():
    from rl_jax.sysmodel.sweep import SweepOptions, sweep
    small = ModelShape.from_model_config(named_shape("qwen2.5-0.5b"))
    accelerator = get_accelerator("h100")
    opts = SweepOptions(num_steps=4, simulate_top=1, split_points=2, batches=(8, 32),
                        tensor_parallel=(1,), modes=("async",))
    res = sweep(small, accelerator, 2, plan_workload(), opts)
    assert res.best is not None
    budget = accelerator.memory_capacity * opts.memory_fraction
    row = res.best.row()
    assert 0 < row["trainer_gib_per_chip"] * 2**30 <= budget
    assert 0 < row["generator_gib_per_chip"] * 2**30 <= budget
    # The same model on a chip too small for its trainer: every layout is refused.
    seven = ModelShape.from_model_config(named_shape("qwen2.5-7b"))
    res = sweep(seven, accelerator, 8, plan_workload(), dataclasses.replace(
        opts, tensor_parallel=(1, 2)))
    assert all(r.trainer_bytes <= budget and r.generator_bytes <= budget
               for r in res.evaluated)
    refused = [k for k in res.rejected if k.startswith("trainer memory does not fit on ")]
    assert len(refused) == 1 and "GiB per chip" in refused[0]
    assert min(r.layout.num_train for r in res.evaluated) == res.rejected[refused[0]] + 1
    # With adapters over a frozen bf16 base the same model trains on fewer chips.
    lora = sweep(seven, accelerator, 8, plan_workload(), dataclasses.replace(
        opts, tensor_parallel=(1, 2), lora_rank=16))
    assert min(r.layout.num_train for r in lora.evaluated) < \
        min(r.layout.num_train for r in res.evaluated)


def test_sweep_plans_the_generators_kv_budget():
    """A KV-cache budget replaces slots x context: servers whose weights and budget do not fit
    a chip are refused, as is a budget that cannot hold one sequence of the longest context;
    one that fits is planned at its pool's size."""
    from rl_jax.sysmodel.sweep import SweepOptions, sweep
    small = ModelShape.from_model_config(named_shape("qwen2.5-0.5b"))
    h100 = get_accelerator("h100")
    opts = SweepOptions(num_steps=4, simulate_top=1, split_points=2, batches=(8, 512),
                        tensor_parallel=(1,), modes=("async",))
    budget = h100.memory_capacity * opts.memory_fraction
    fits = sweep(small, h100, 2, plan_workload(), dataclasses.replace(
        opts, kv_cache_bytes=int(20 * GIB)))
    assert fits.best is not None
    planned = generator_memory(small, max_slots=fits.best.layout.slots_per_server,
                               max_seq_len=plan_workload().max_context, page_size=64,
                               kv_cache_bytes=int(20 * GIB))
    assert planned.terms["kv_cache"] == pytest.approx(20 * GIB, rel=0.001)
    assert fits.best.generator_bytes >= planned.terms["kv_cache"]
    with pytest.raises(SysModelError, match="generator memory does not fit at tp=1") as e:
        sweep(small, h100, 2, plan_workload(), dataclasses.replace(
            opts, kv_cache_bytes=int(budget)))
    assert "at 8 slots" in str(e.value)
    page = 2 * small.num_layers * 64 * small.num_kv_heads * small.head_dim * 2
    with pytest.raises(SysModelError, match="holds 128 tokens, fewer than one sequence"):
        sweep(small, h100, 2, plan_workload(), dataclasses.replace(
            opts, kv_cache_bytes=2 * page))


def test_plan_prints_the_chosen_layouts_memory(tmp_path):
    from ml_collections import ConfigDict

    from rl_jax.sysmodel.plan import PlanRequest, run_plan
    cfg = named_shape("qwen2.5-0.5b")
    config = ConfigDict({"mode": "async", "model": {"dtype": "bfloat16", "shape": {
        f: getattr(cfg, f) for f in ("hidden_size", "intermediate_size", "num_layers",
                                     "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                                     "tie_word_embeddings", "attention_bias")}},
        "rollout": {"group_size": 4, "groups_per_batch": 8, "max_new_tokens": 512,
                    "max_lag": 2, "prompt_len": 64}})
    request = PlanRequest(accelerator="h100", num_accelerators=4, modes=("async",), steps=4,
                          simulate_top=1, split_points=2, batches=(8, 32),
                          tensor_parallel=(1,))
    report = run_plan(config, request, tmp_path)
    lines = {line.split(" (")[0]: line for line in report.text.splitlines()
             if "memory per chip" in line}
    assert set(lines) == {"trainer memory per chip", "generator memory per chip"}, report.text
    best = report.summary["best"]
    assert f"{best['trainer_gib_per_chip']:.2f} GiB" in lines["trainer memory per chip"]
    assert f"{best['generator_gib_per_chip']:.2f} GiB" in lines["generator memory per chip"]
    assert "kv_cache" in lines["generator memory per chip"]
