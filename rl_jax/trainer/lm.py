"""The causal-LM (supervised) recipe: trains a model on a synthetic task and exports an HF
checkpoint, the base policy for RL recipes.

Outputs in ``workdir``: ``checkpoints/`` (orbax, resumable), ``metrics.jsonl``,
``summary.json``, ``training.png`` and ``hf/`` (``config.json``, ``model.safetensors``,
``tokenizer.json``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from rl_jax import distributed
from rl_jax.data.arithmetic import ArithmeticTask
from rl_jax.data.lm import eval_arrays, examples_per_row, exact_match, lm_batches
from rl_jax.data.scratchpad import ScratchpadAdditionTask
from rl_jax.data.tokenizer import build_char_tokenizer, special_token_ids
from rl_jax.errors import UserError
from rl_jax.metrics import MetricsWriter, plot_curves, write_json
from rl_jax.models.config import DTYPES, ModelConfig
from rl_jax.models.hf import load_pretrained, read_config, save_pretrained
from rl_jax.models.lora import LoraConfig, LoraConfigError
from rl_jax.models.lora_export import save_merged, save_peft_adapter
from rl_jax.sharding import make_mesh
from rl_jax.trainer.checkpoint import Checkpointer
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state, init_state,
                                  learning_rate_schedule, make_optimizer)
from rl_jax.trainer.step import (LMBatch, causal_lm_loss, default_batch_sharding, global_batch,
                                 make_eval_step, make_train_step)

log = logging.getLogger(__name__)

BATCH_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


class RecipeConfigError(UserError, ValueError):
    """A recipe config that cannot run."""


def _dtype(name: str):
    if name not in DTYPES:
        raise RecipeConfigError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_config(c: ml_collections.ConfigDict, vocab_size: int,
                 special: dict[str, int]) -> ModelConfig:
    m = c.model
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, architecture=m.architecture, rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=m.architecture in ("Qwen2ForCausalLM", "SeedOssForCausalLM"),
        qk_norm=m.architecture == "Qwen3ForCausalLM",
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"])


def validate(c: ml_collections.ConfigDict, mesh_batch_size: int):
    """Refuses configs that cannot run, with one message naming the problem."""
    if c.trainer.steps < 1:
        raise RecipeConfigError(f"trainer.steps must be >= 1, got {c.trainer.steps}")
    rows, micro = c.data.rows_per_batch, c.trainer.num_microbatches
    if micro < 1 or rows % micro:
        raise RecipeConfigError(f"data.rows_per_batch={rows} is not divisible by "
                                f"trainer.num_microbatches={micro}")
    if (rows // micro) % mesh_batch_size:
        raise RecipeConfigError(
            f"each micro-batch has {rows // micro} rows, not divisible by the {mesh_batch_size} "
            "batch shards of the mesh (data × fsdp)")
    if c.task.loss_on not in ("answer", "all"):
        raise RecipeConfigError(f"task.loss_on must be 'answer' or 'all', got {c.task.loss_on!r}")
    if c.task.get("kind", "addition") not in TASKS:
        raise RecipeConfigError(f"task.kind must be one of {sorted(TASKS)}, got "
                                f"{c.task.kind!r}")


TASKS = ("addition", "scratchpad", "tool_traces")


def lora_config(c: ml_collections.ConfigDict) -> LoraConfig | None:
    """The recipe's optional ``lora`` block (``enabled``, ``rank``, ``alpha``, ``dropout``,
    ``targets``; defaults: :class:`rl_jax.models.lora.LoraConfig`) → adapters to train on a
    frozen base, or None."""
    block = c.get("lora")
    if block is None or not block.get("enabled", False):
        return None
    fields = {k: v for k, v in block.to_dict().items() if k != "enabled"}
    if "targets" in fields:
        fields["targets"] = tuple(fields["targets"])
    try:
        return LoraConfig(**fields)
    except TypeError as e:
        raise RecipeConfigError(f"lora: {e}") from e
    except LoraConfigError as e:
        raise RecipeConfigError(str(e)) from e


def make_task(c: ml_collections.ConfigDict) -> ArithmeticTask | ScratchpadAdditionTask:
    """The recipe's train-split task: ``task.kind`` "addition" (``num_digits``,
    ``reverse_answer``), "scratchpad" (``min_digits``, ``max_digits``, ``power``) or
    "tool_traces" (those and ``tool_fraction``, ``malformed_fraction``, ``style``:
    :class:`rl_jax.envs.tool_traces.ToolTraces`)."""
    t = c.task
    try:
        if t.get("kind", "addition") == "scratchpad":
            return ScratchpadAdditionTask(min_digits=t.min_digits, max_digits=t.max_digits,
                                          power=t.power, seed=c.seed)
        if t.get("kind") == "tool_traces":
            from rl_jax.envs.tool_traces import ToolTraces
            return ToolTraces(min_digits=t.min_digits, max_digits=t.max_digits, power=t.power,
                              tool_fraction=t.tool_fraction,
                              malformed_fraction=t.malformed_fraction, style=t.style,
                              seed=c.seed)
        return ArithmeticTask(num_digits=t.num_digits, reverse_answer=t.reverse_answer,
                              seed=c.seed)
    except (ValueError, AttributeError) as e:
        raise RecipeConfigError(f"task: {e}") from None


def run(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) the recipe in ``c``; returns the summary it writes."""
    distributed.initialize(c.distributed.coordinator, c.distributed.num_processes,
                           c.distributed.process_id)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
    validate(c, mesh.shape["data"] * mesh.shape["fsdp"])
    task = make_task(c)
    tokenizer = build_char_tokenizer(task.ALPHABET, words=getattr(task, "WORDS", ()))
    special = special_token_ids(tokenizer)

    if c.model.init_from:
        cfg = read_config(c.model.init_from)
        if cfg.vocab_size < tokenizer.get_vocab_size():
            raise RecipeConfigError(
                f"model.init_from={c.model.init_from} has vocab_size={cfg.vocab_size}, smaller "
                f"than the task tokenizer's {tokenizer.get_vocab_size()} tokens")
    else:
        cfg = model_config(c, tokenizer.get_vocab_size(), special)
    lora = lora_config(c)
    spec = ModelSpec(cfg, mesh=mesh, dtype=_dtype(c.model.dtype),
                     param_dtype=_dtype(c.model.param_dtype), remat=c.model.remat,
                     scan_layers=bool(c.model.get("scan_layers", True)), lora=lora)
    opt_cfg = OptimizerConfig(total_steps=c.trainer.steps, **c.optimizer.to_dict())
    tx = make_optimizer(opt_cfg)
    schedule = learning_rate_schedule(opt_cfg)

    checkpointer = Checkpointer(workdir / "checkpoints", keep=c.checkpoint.keep,
                                every=c.checkpoint.every, use_async=c.checkpoint.use_async)
    def initial_params():
        if c.model.init_from:
            # A LoRA run's adapters are not in the checkpoint: split_frozen adds fresh ones.
            return spec.split(load_pretrained(c.model.init_from, mesh, spec.dtype,
                                              param_dtype=spec.param_dtype, rules=spec.rules))
        return spec.init_params(c.seed)

    if checkpointer.latest_step() is not None:
        target = abstract_state(tx, spec)
        if lora is not None:  # checkpoints hold the adapters only; the base is rebuilt
            target = target.replace(frozen=spec.split_frozen(initial_params(), c.seed)[1])
        state, meta, _ = checkpointer.restore(target)
        next_batch = int(meta["next_batch"])
        log.info("resumed from %s at step %d (batch %d)", checkpointer.directory,
                 int(state.step), next_batch)
    else:
        state = init_state(tx, spec, *spec.split_frozen(initial_params(), c.seed))
        next_batch = 0
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    log.info("model: %s, %.2fM %sparameters, mesh %s", cfg.architecture, n_params / 1e6,
             "trained (adapter) " if lora else "", dict(mesh.shape))

    batches = lm_batches(task, tokenizer, rows_per_batch=c.data.rows_per_batch,
                         seq_len=c.data.seq_len, seed=c.seed,
                         loss_on_all_tokens=c.task.loss_on == "all")
    batch_sharding = default_batch_sharding(spec)
    step_fn = make_train_step(spec, tx, lambda m, b: causal_lm_loss(
        m, b, block_size=c.trainer.logits_block_size),
        num_microbatches=c.trainer.num_microbatches, batch_sharding=batch_sharding)
    eval_fn = make_eval_step(spec, _eval_loss(c.trainer.logits_block_size),
                             batch_sharding=batch_sharding)
    n_eval = c.data.eval_examples
    eval_batch = eval_arrays(task, tokenizer, n_eval, c.data.seq_len,
                             rows_multiple_of=mesh.shape["data"] * mesh.shape["fsdp"])
    eval_device = global_batch(LMBatch.from_numpy(eval_batch), batch_sharding)

    def evaluate(params) -> dict[str, float]:
        loss_sum, denom, m = eval_fn(params, eval_device, state.frozen)
        correct = exact_match(eval_batch, n_eval, is_argmax=np.asarray(m["is_argmax"]) > 0)
        return {"eval_loss": float(loss_sum / denom), "eval_exact_match": float(correct.mean())}

    writer = MetricsWriter(workdir)
    # `stop_after` ends training early on the schedule of `steps` (a partly trained base policy).
    total = min(c.trainer.steps, c.trainer.get("stop_after", 0) or c.trainer.steps)
    tokens_per_batch = c.data.rows_per_batch * c.data.seq_len  # token slots
    start_step = int(state.step) + int(state.skipped)
    bar = tqdm(total=total, initial=min(start_step, total), desc="train", unit="step",
               disable=jax.process_index() != 0, dynamic_ncols=True)
    window_start, window_steps = time.perf_counter(), 0
    acc: dict[str, float] = {}
    metrics = None
    for i in range(start_step, total):
        host = batches[next_batch]
        batch = global_batch(LMBatch.from_numpy({k: host[k] for k in BATCH_KEYS}),
                             batch_sharding)
        state, metrics = step_fn(state, batch)
        next_batch += 1
        window_steps += 1
        for k in ("nll_sum", "tokens", "correct_tokens", "skipped"):
            acc[k] = acc.get(k, 0.0) + metrics[k]
        done = i + 1
        if done % c.logging.every == 0 or done == total:
            acc = {k: float(v) for k, v in acc.items()}
            elapsed = time.perf_counter() - window_start
            record = {"loss": acc["nll_sum"] / max(acc["tokens"], 1.0),
                      "token_accuracy": acc["correct_tokens"] / max(acc["tokens"], 1.0),
                      "grad_norm": float(metrics["grad_norm"]),
                      "learning_rate": float(schedule(int(state.step))),
                      "skipped_steps": int(state.skipped),
                      "tokens_per_s": window_steps * tokens_per_batch / elapsed,
                      "elapsed_s": elapsed}
            if done % c.logging.eval_every == 0 or done == total:
                record.update(evaluate(state.params))
            writer.write(done, **record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['token_accuracy']:.3f}",
                            **({"em": f"{record['eval_exact_match']:.3f}"}
                               if "eval_exact_match" in record else {}),
                            tok_s=f"{record['tokens_per_s']:.0f}")
            acc, window_start, window_steps = {}, time.perf_counter(), 0
        checkpointer.save(done, state, {"next_batch": next_batch}, force=done == total)
        bar.update(1)
    bar.close()
    checkpointer.wait()
    checkpointer.close()

    final = evaluate(state.params)
    if lora is None:
        export_dir = save_pretrained(spec.merge(state.params), workdir / "hf",
                                     tokenizer=tokenizer, dtype=_dtype(c.export.dtype))
    else:  # the merged model, and the adapters alone in PEFT's format
        full = {**state.frozen, "layers": {**state.frozen["layers"], **state.params["layers"]}}
        export_dir = save_merged(workdir / "hf", cfg, full, lora, tokenizer=tokenizer,
                                 dtype=_dtype(c.export.dtype))
        save_peft_adapter(workdir / "adapter", state.params, cfg, lora,
                          base_model=str(c.model.init_from))
    summary = {"steps": int(state.step), "skipped_steps": int(state.skipped),
               "parameters": int(n_params), "export": str(export_dir), **final,
               **({} if getattr(task, "VARIABLE_LENGTH", False) else {
                   "examples_per_batch": c.data.rows_per_batch * examples_per_row(
                       task, c.data.seq_len)})}
    write_json(workdir / "summary.json", summary)
    steps, loss = writer.series("loss")
    esteps, em = writer.series("eval_exact_match")
    plot_curves(workdir / "training.png",
                [("loss (nats/token)", [("train", steps, loss)]),
                 ("held-out exact match", [("greedy", esteps, em)])],
                title=f"{cfg.architecture} {n_params / 1e6:.2f}M on " + (
                    f"{task.min_digits}-{task.max_digits}-digit scratchpad addition"
                    if isinstance(task, ScratchpadAdditionTask)
                    else f"{task.min_digits}-{task.max_digits}-digit addition with a calculator"
                    if hasattr(task, "example_segments")
                    else f"{task.num_digits}-digit addition"))
    log.info("done: %s", summary)
    if jax.process_index() == 0:
        print(f"exported {export_dir}: eval exact match {final['eval_exact_match']:.3f}, "
              f"eval loss {final['eval_loss']:.4f}", flush=True)
    return summary


def _eval_loss(block_size: int):
    def loss(model, batch):
        stats = model.token_stats(batch.tokens, batch.targets, batch.positions,
                                  batch.segment_ids, block_size=block_size)
        mask = batch.loss_mask
        return (-jnp.sum(stats["logprobs"] * mask), jnp.sum(mask),
                {"is_argmax": stats["is_argmax"]})
    return loss
