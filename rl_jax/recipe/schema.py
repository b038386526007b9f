"""The sections of an RL recipe, each field with its one default and its own check (see
:mod:`rl_jax.recipe`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

from rl_jax.errors import UserError
from rl_jax.models.lora import DEFAULT_TARGETS, TARGETS

MODES = ("async", "one_step_off", "sync")
STALENESS_POLICIES = ("prevent", "drop")
GENERATOR_KINDS = ("rl_jax", "sglang")
REMAT_POLICIES = ("none", "full", "dots")
GROUP_ADVANTAGES = ("grpo", "rloo", "dr_grpo")  # compare the samples of one prompt
OVERLONG = ("keep", "filter", "penalize", "soft")  # what becomes of a cut-off completion


class RLConfigError(UserError, ValueError):
    """An RL recipe config that cannot run; the message names the field."""


# ---- field checks -------------------------------------------------------------------------------

Check = Callable[[Any], "str | None"]  # the complaint about a value, or None when it is fine


def at_least(minimum: int) -> Check:
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            return f"must be an integer >= {minimum}, got {v!r}"
    return check


def not_negative(v) -> str | None:
    if not v >= 0:
        return f"must be >= 0, got {v!r}"


def positive(v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        return f"must be a positive number, got {v!r}"


def one_of(*values: Any) -> Check:
    def check(v):
        if v not in values:
            return f"must be one of {values}, got {v!r}"
    return check


def fraction_below_one(v) -> str | None:
    if not 0.0 <= v < 1.0:
        return f"must be in [0, 1) (0: off), got {v!r}"


def http_urls(v) -> str | None:
    for url in v:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return f"must be http(s) URLs, got {url!r}"


def http_url_or_empty(v) -> str | None:
    if not isinstance(v, str) or (v and not v.startswith(("http://", "https://"))):
        return f'must be an http(s) URL or "", got {v!r}'


def lora_targets(v) -> str | None:
    unknown = [t for t in v if t not in TARGETS]
    if unknown or not v or len(set(v)) != len(v):
        return (f"must name each of {tuple(TARGETS)} at most once, at least one, got "
                f"{tuple(v)!r}")


def _f(default: Any, check: Check | None = None, *, kind: str = "") -> Any:
    """A field with its default and its own check; ``kind`` names what a value of the wrong
    type should have been (default: the field's type, "an integer")."""
    metadata = {"check": check, "kind": kind}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls)


# ---- the sections -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Base:
    """The policy to start from: an HF checkpoint directory, or "" to train one first with the
    supervised recipe file ``lm_config`` and its ``lm_overrides`` (``"key=value"``)."""

    checkpoint: str = _f("")
    lm_config: str = _f("")
    lm_overrides: tuple[str, ...] = _f(())


@dataclasses.dataclass(frozen=True)
class Model:
    """Compute and parameter dtypes, rematerialisation, layer scan; ``shape``: a named shape
    (:mod:`rl_jax.models.shapes`) to start from random weights of when ``base.checkpoint`` is
    empty, or a mapping of shape fields for the planner."""

    dtype: str = _f("bfloat16")
    param_dtype: str = _f("float32")
    remat: str = _f("full", one_of(*REMAT_POLICIES))
    scan_layers: bool = _f(True)
    shape: str | dict[str, Any] = _f("")


@dataclasses.dataclass(frozen=True)
class Lora:
    """Low-rank adapters on the attention and MLP projections (:mod:`rl_jax.models.lora`;
    :class:`rl_jax.models.lora.LoraConfig` holds the same defaults): the base frozen in
    ``model.dtype``, only the adapters trained. ``targets``: of q, k, v, o, gate, up, down."""

    enabled: bool = _f(False)
    rank: int = _f(16, at_least(1))
    alpha: float = _f(32.0, positive)  # the low-rank term is scaled by alpha / rank
    dropout: float = _f(0.0, fraction_below_one)
    targets: tuple[str, ...] = _f(DEFAULT_TARGETS, lora_targets)


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """Trainer mesh sizes; -1 takes the devices left."""

    data: int = _f(1, at_least(-1))
    fsdp: int = _f(-1, at_least(-1))
    tensor: int = _f(1, at_least(-1))


@dataclasses.dataclass(frozen=True)
class Env:
    """The reward environment: ``rl_jax.envs.get(name, **kwargs)``."""

    name: str = _f("arithmetic")
    kwargs: dict[str, Any] = _f({})


@dataclasses.dataclass(frozen=True)
class Data:
    """Train prompts: the environment's generator (``path`` "") or a JSONL / Parquet /
    ArrayRecord file; ``template`` wraps each prompt's text (``"{prompt}"`` marks it)."""

    path: str = _f("")
    text_key: str = _f("prompt")
    answer_key: str = _f("answer")
    template: str = _f("{prompt}", lambda v: None if "{prompt}" in v else
                       f"must contain '{{prompt}}', got {v!r}")
    shuffle: bool = _f(True)
    epochs: int = _f(0, at_least(0))


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Benchmarks: lognormal completion lengths generated with ignore_eos (median tokens, sigma
    of the log, cap; one length per sample or per prompt); sigma 0 = off."""

    median: float = _f(8.0)
    sigma: float = _f(0.0, not_negative)
    max: int = _f(64)
    per_sample: bool = _f(False)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Sampling, the staleness bound, grouping and packing of training batches."""

    group_size: int = _f(8, at_least(1))  # samples per prompt
    groups_per_batch: int = _f(32, at_least(1))  # prompts per optimizer step
    max_lag: int = _f(4, at_least(0))  # async: most steps a sample may lag the trainer
    staleness_policy: str = _f("prevent", one_of(*STALENESS_POLICIES))
    temperature: float = _f(1.0, not_negative)
    top_p: float = _f(1.0)
    top_k: int = _f(-1)
    max_new_tokens: int = _f(1024, at_least(1))
    ignore_eos: bool = _f(False)
    advantage: str = _f("grpo")
    filter_zero_signal: bool = _f(True)  # drop groups whose samples all got the same reward
    seq_len: int = _f(4096, at_least(2))  # tokens per packed training row
    share_prompts: bool = _f(True)  # a group's prompt packed once, its completions attend to it
    rows_per_batch: int = _f(0, at_least(0))  # 0: as many as each batch needs
    max_retries: int = _f(3, at_least(1))
    # A completion cut off at max_new_tokens: "keep" (scored as it is), "filter" (kept in its
    # group's baseline, never trained on: loss mask 0), "penalize" (reward = overlong_reward)
    # or "soft" (DAPO's soft overlong penalty, linear from 0 to -1 over the last
    # overlong_buffer tokens; 0 = max_new_tokens // 4).
    overlong: str = _f("keep", one_of(*OVERLONG))
    overlong_reward: float = _f(-1.0)
    overlong_buffer: int = _f(0, at_least(0))
    # Multi-turn episodes (tool use): completion tokens one policy turn may use (0: no limit
    # but max_new_tokens, which bounds the whole episode, observations included).
    max_tokens_per_turn: int = _f(0, at_least(0))
    # Most seconds the environment may take to score a group (0: no limit); a group that
    # takes longer is a failed attempt, retried up to max_retries times, then dropped.
    score_timeout_s: float = _f(0.0, not_negative)
    lengths: Lengths = _section(Lengths)


@dataclasses.dataclass(frozen=True)
class Loss:
    """A registered loss (:func:`rl_jax.losses.names`) and fields of its config."""

    name: str = _f("grpo")
    options: dict[str, Any] = _f({})


@dataclasses.dataclass(frozen=True)
class Trainer:
    steps: int = _f(1000, at_least(1))
    time_limit_s: float = _f(0.0, not_negative)  # > 0: stop (and export) after this long
    num_microbatches: int = _f(1, at_least(1))
    micro_batch_rows: int = _f(0, at_least(0))  # > 0: fixed [rows, seq_len] micro-batches
    logits_block_size: int = _f(4096, at_least(1))
    prefetch: bool = _f(True)  # take and pack the next batch while this one trains
    ess_lr_power: float = _f(0.0, not_negative)
    ema_decay: float = _f(0.0, fraction_below_one)  # > 0: export a parameter average
    step_delay_s: float = _f(0.0, not_negative)  # benchmarks: a slower trainer


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """AdamW and its schedule (:class:`rl_jax.trainer.state.OptimizerConfig`)."""

    learning_rate: float = _f(1e-6, positive)
    warmup_steps: int = _f(10, at_least(0))
    final_lr_ratio: float = _f(1.0, not_negative)
    b1: float = _f(0.9)
    b2: float = _f(0.999)
    eps: float = _f(1e-8)
    weight_decay: float = _f(0.0, not_negative)
    max_grad_norm: float = _f(1.0)
    schedule_on: str = _f("steps")  # "steps" | "progress"


@dataclasses.dataclass(frozen=True)
class Auth:
    """Files holding the servers' API keys (never keys: a config is saved and logged), else the
    environment (RL_JAX_API_KEY, RL_JAX_ADMIN_API_KEY); servers started here without either get
    random keys for the run when ``generate_keys``."""

    api_key_file: str = _f("", kind='a file path or ""')
    admin_api_key_file: str = _f("", kind='a file path or ""')
    generate_keys: bool = _f(True)


@dataclasses.dataclass(frozen=True)
class Generator:
    """The generator pool: ``urls`` of running servers, or ``num_servers`` started here;
    with ``router_url``, an ``sglang-router`` in front of them (requests go through it, weight
    updates to each of its workers, and its workers join and leave the run:
    :mod:`rl_jax.orchestrator.fleet`)."""

    kind: str = _f("rl_jax", one_of(*GENERATOR_KINDS))
    urls: tuple[str, ...] = _f((), http_urls)
    num_servers: int = _f(1)
    max_slots: int = _f(64, at_least(1))
    max_seq_len: int = _f(4096, at_least(2))
    dtype: str = _f("bfloat16")
    tensor_parallel: int = _f(1, at_least(1))
    data_parallel: int = _f(1, at_least(1))
    decode_steps: int = _f(1, at_least(1))  # decode steps per program
    startup_timeout_s: float = _f(600.0, positive)
    restart_dead: bool = _f(True)
    request_timeout_s: float = _f(600.0, positive)
    warmup_shapes: bool = _f(False)  # compile every decode shape before serving
    env: tuple[tuple[str, str], ...] = _f(())  # the servers' environment
    extra_args: tuple[str, ...] = _f(())
    # The Python that runs the servers ("" = the trainer's). SGLang runs in an environment of
    # its own: the python of that venv or container (on CPU: tools/sglang_cpu/install.sh).
    python: str = _f("")
    # How SGLang servers take each version: "disk" (the trainer writes an HF checkpoint that
    # every server loads; needs a filesystem the servers share with the trainer) or "sidecar"
    # (a sidecar beside each server pulls it over `transfer.transports` and hands it over
    # locally: rl_jax.orchestrator.sidecars), by tmpfs ("disk") or shared-memory tensors
    # ("tensor", needs torch in the trainer's environment): `sidecar_handoff`.
    sglang_weights: str = _f("disk", one_of("disk", "sidecar"))
    sidecar_handoff: str = _f("disk", one_of("disk", "tensor"))
    auth: Auth = _section(Auth)
    router_url: str = _f("", http_url_or_empty)
    router_poll_s: float = _f(2.0, positive)  # seconds between two reads of its worker list


@dataclasses.dataclass(frozen=True)
class Cpus:
    """CPU cores of each pool ("" = no pinning) and the servers' nice level (CPU runs only)."""

    trainer: str = _f("")
    generators: str = _f("")
    rollout: str = _f("")
    generators_nice: int = _f(0)


@dataclasses.dataclass(frozen=True)
class Transfer:
    transports: tuple[str, ...] = _f(("shm",))
    transport: str = _f("auto")
    host: str = _f("127.0.0.1")
    port: int = _f(0, at_least(0))
    timeout_s: float = _f(120.0, positive)
    # Where the publisher stages versions for `shm` and `socket` ("" = /dev/shm when writable,
    # else the temp directory); a version it has no room for goes over `disk` when that is among
    # the transports, else stops the run with one line.
    staging_dir: str = _f("")


@dataclasses.dataclass(frozen=True)
class Eval:
    """Held-out greedy evaluation; periodic ones keep at most ``concurrency`` requests."""

    examples: int = _f(256, at_least(0))
    every: int = _f(10, at_least(0))
    max_new_tokens: int = _f(1024, at_least(1))
    path: str = _f("")
    concurrency: int = _f(16, at_least(1))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    every: int = _f(10, at_least(1))
    keep: int = _f(2, at_least(1))
    use_async: bool = _f(True)


@dataclasses.dataclass(frozen=True)
class Logging:
    every: int = _f(1, at_least(1))
    tensorboard: bool = _f(True)


@dataclasses.dataclass(frozen=True)
class Distributed:
    coordinator: str = _f("")
    num_processes: int = _f(1, at_least(1))
    process_id: int = _f(0, at_least(0))


@dataclasses.dataclass(frozen=True)
class Export:
    """The final policy goes to ``<workdir>/hf``; ``every`` > 0 also writes one every that many
    steps to ``<workdir>/hf_steps/step_N``."""

    dtype: str = _f("bfloat16")
    every: int = _f(0, at_least(0))


@dataclasses.dataclass(frozen=True)
class RLRecipe:
    """An RL recipe (``recipe = "rl"``); ``mode`` in :data:`MODES`."""

    recipe: str = _f("rl", one_of("rl"))
    mode: str = _f("async", one_of(*MODES))
    seed: int = _f(0)
    # JAX's persistent compilation cache: "auto" (~/.cache/rl_jax/xla), a directory, or "".
    compilation_cache_dir: str = _f("auto")
    base: Base = _section(Base)
    model: Model = _section(Model)
    lora: Lora = _section(Lora)
    mesh: MeshAxes = _section(MeshAxes)
    env: Env = _section(Env)
    data: Data = _section(Data)
    rollout: Rollout = _section(Rollout)
    loss: Loss = _section(Loss)
    trainer: Trainer = _section(Trainer)
    optimizer: Optimizer = _section(Optimizer)
    generator: Generator = _section(Generator)
    cpus: Cpus = _section(Cpus)
    transfer: Transfer = _section(Transfer)
    eval: Eval = _section(Eval)
    checkpoint: Checkpoint = _section(Checkpoint)
    logging: Logging = _section(Logging)
    distributed: Distributed = _section(Distributed)
    export: Export = _section(Export)


# ---- building -----------------------------------------------------------------------------------

def defaults() -> RLRecipe:
    """The recipe of all defaults."""
    return RLRecipe()


def to_dict(recipe: Any) -> dict[str, Any]:
    """A recipe (or section) as nested plain dicts."""
    return {f.name: (to_dict(v) if dataclasses.is_dataclass(v) else
                     dict(v) if isinstance(v, Mapping) else v)
            for f in dataclasses.fields(recipe) for v in [getattr(recipe, f.name)]}


def base_config():
    """The base recipe as an ``ml_collections.ConfigDict`` (every field at its default), for
    recipe files to change what differs."""
    from ml_collections import ConfigDict
    return ConfigDict(to_dict(defaults()))

def field_names(cls: type = RLRecipe, prefix: str = "") -> list[str]:
    """Every leaf field's dotted name."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += field_names(hints[f.name], prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out
