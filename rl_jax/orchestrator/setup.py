"""The parts of an RL run, each built by its own class with the state it needs, owned and called by
:class:`rl_jax.orchestrator.session.Session`: :class:`ModelParts` (the model, its data, the
optimizer and loss), :class:`TrainerParts` (train step, state, checkpoints),
:class:`GeneratorParts` (publisher, server pool, clients, weight sync, fleet) and
:func:`start_rollout` (the rollout pipeline)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax import distributed, envs
from rl_jax.data import sources
from rl_jax.data.sources import env_source, prompt_dataset
from rl_jax.envs.shaping import RewardShaping
from rl_jax.generator.client.core import ClientConfig, GeneratorClient
from rl_jax.generator.client.identity import UnsupportedServer
from rl_jax.generator.launcher.pool import PoolConfig
from rl_jax.generator.types import SamplingParams
from rl_jax.models.config import DTYPES
from rl_jax.models.hf import load_pretrained, load_tokenizer, read_config, save_pretrained
from rl_jax.models.lora import LoraConfig, merge_adapters
from rl_jax.models.lora_export import save_merged, save_peft_adapter
from rl_jax.orchestrator.accounting import PoolSampler
from rl_jax.orchestrator.config import (ModeSettings, max_new_tokens, max_sample_tokens,
                                        rows_per_batch)
from rl_jax.orchestrator.evaluation import held_out_prompts
from rl_jax.orchestrator.fleet import Fleet
from rl_jax.orchestrator.policy import PolicyBatch, make_policy_loss
from rl_jax.orchestrator.pool import BackgroundLoop, GeneratorPool, check_keys
from rl_jax.orchestrator.router import RouterError, RouterWorkers
from rl_jax.orchestrator.weights import WeightSync
from rl_jax.recipe.schema import RLConfigError, RLRecipe, to_dict
from rl_jax.rollout.batching import GroupsToBatch
from rl_jax.rollout.config import RolloutConfig
from rl_jax.rollout.pipeline import RolloutDataset
from rl_jax.rollout.request_plan import LognormalLengths
from rl_jax.sharding import make_mesh
from rl_jax.trainer.checkpoint import Checkpointer
from rl_jax.trainer.state import (ModelSpec, OptimizerConfig, abstract_state, ema_update,
                                  init_state, learning_rate_schedule, make_optimizer)
from rl_jax.trainer.step import (StreamingTrainStep, default_batch_sharding, ess_update_scale,
                                 make_train_step)
from rl_jax.transfer.config import PublisherConfig
from rl_jax.transfer.publisher.core import Publisher

log = logging.getLogger(__name__)


class Codec:
    """Text ↔ token ids for prompts and completions: the prompt is put into ``template``
    (``"{prompt}"`` marks it), and ``<bos>`` goes first when the model has one."""

    def __init__(self, tokenizer, bos_id: int | None, template: str = "{prompt}"):
        self.tokenizer, self.bos_id, self.template = tokenizer, bos_id, template

    def encode(self, text: str) -> list[int]:
        text = self.template.replace("{prompt}", text)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_observation(self, text: str) -> list[int]:
        """Text an environment inserts in an episode (a tool's result): no template, no
        ``<bos>``, and never an error for what a tool printed: a character the vocabulary
        cannot spell (a character-level tokenizer's) becomes ``?``, or is dropped."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        except Exception:  # tokenizers raises its own exception types for unknown characters
            vocab = self.tokenizer.get_vocab()
            known = "".join(ch if ch in vocab else "?" if "?" in vocab else "" for ch in text)
            return list(self.tokenizer.encode(known, add_special_tokens=False).ids)

    def token_of(self, text: str) -> int:
        """The id of ``text`` if it is exactly one token; ``ValueError`` otherwise."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens, not one, in this tokenizer")
        return int(ids[0])


def prompt_source(c: RLRecipe, env, path: str | None = None) -> Any:
    """Prompts of ``path`` (default ``data.path``; JSONL, Parquet or ArrayRecord), or the
    environment's train split when there is no path."""
    d = c.data
    name = d.path if path is None else path
    if not name:
        return env_source(env, "train")
    path = Path(name)
    if not path.exists():
        raise RLConfigError(f"{name} does not exist (data.path / eval.path)")
    kwargs = dict(text_key=d.text_key, answer_key=d.answer_key or None)
    try:
        if path.suffix == ".jsonl":
            return sources.jsonl_source(path, **kwargs)
        if path.suffix == ".parquet":
            return sources.parquet_source(path, **kwargs)
        if path.suffix in (".array_record", ".arrayrecord"):
            return sources.array_record_source(path, **kwargs)
    except sources.SourceError as e:
        raise RLConfigError(f"{name}: {e}") from None
    raise RLConfigError(f"{name}: use a .jsonl, .parquet or .array_record file")


def turn_stop_ids(codec: Codec, env: Any) -> tuple[int, ...]:
    """The tokens that end a policy turn of ``env``'s episodes (its ``stop_texts``: a tool
    call's ``</tool_call>``), each one token of the policy's tokenizer."""
    if getattr(env, "max_turns", 1) <= 1:
        return ()
    try:
        return tuple(codec.token_of(text) for text in getattr(env, "stop_texts", ()))
    except ValueError as e:
        raise RLConfigError(f"env {getattr(env, 'name', '')!r} ends turns at a text that must "
                            f"be one token of the base policy's tokenizer: {e}") from None


DROP_LOG = "rollout_drops.jsonl"  # in the run's workdir: every prompt dropped untrained


def rollout_config(c: RLRecipe, settings: ModeSettings, *, score_until: Any = None,
                   turn_stops: tuple[int, ...] = (), drop_log: str | None = None
                   ) -> RolloutConfig:
    """The rollout pipeline's settings from the recipe and its mode (the mode's staleness
    bound, not ``rollout.max_lag``, outside async mode)."""
    r = c.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, ignore_eos=r.ignore_eos,
                              seed=c.seed)
    # This project's servers started here queue at most PoolConfig.max_waiting sequences
    # each: admitting more groups than fit gets requests refused as overloaded. A quarter
    # of the queue stays free for evaluations and retries.
    in_flight_cap = None
    if c.generator.kind == "rl_jax" and not c.generator.urls:
        in_flight_cap = (PoolConfig.max_waiting * 3 // 4) * int(c.generator.num_servers) \
            // r.group_size
        if in_flight_cap < r.groups_per_batch:
            raise RLConfigError(
                f"rollout.groups_per_batch={r.groups_per_batch} groups of {r.group_size} "
                f"exceed what {c.generator.num_servers} server(s) queue "
                f"({PoolConfig.max_waiting} sequences each)")
    shaping = None
    if r.overlong == "penalize":
        shaping = RewardShaping(max_tokens=r.max_new_tokens, truncated_reward=r.overlong_reward)
    elif r.overlong == "soft":
        shaping = RewardShaping(length_penalty="overlong", max_tokens=r.max_new_tokens,
                                cache_tokens=r.overlong_buffer or max(r.max_new_tokens // 4, 1))
    return RolloutConfig(group_size=r.group_size, groups_per_batch=r.groups_per_batch,
                         shaping=shaping, overlong_filter=r.overlong == "filter",
                         max_in_flight_groups=in_flight_cap, max_lag=settings.max_lag,
                         staleness_policy=r.staleness_policy, sampling=sampling,
                         max_retries=r.max_retries, filter_zero_signal=r.filter_zero_signal,
                         length_of=None if not r.lengths.sigma else LognormalLengths(
                             r.lengths.median, r.lengths.sigma, r.lengths.max, c.seed),
                         per_sample_lengths=r.lengths.per_sample, score_until=score_until,
                         max_tokens_per_turn=r.max_tokens_per_turn or None,
                         turn_stop_token_ids=tuple(turn_stops), drop_log=drop_log,
                         score_timeout_s=r.score_timeout_s or None)


class ModelParts:
    """The policy's model and what a run reads with it: its config, tokenizer and prompt codec,
    the mesh and model spec, the environment and its prompts, the batch geometry, the optimizer
    and the loss. Every trainer process builds it first."""

    def __init__(self, c: RLRecipe, base_dir: Path):
        distributed.initialize(c.distributed.coordinator, c.distributed.num_processes,
                               c.distributed.process_id)
        self.model_config = read_config(base_dir)
        self.tokenizer = load_tokenizer(base_dir)
        self.codec = Codec(self.tokenizer, self.model_config.bos_token_id, c.data.template)
        self.mesh = make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
        lora = None if not c.lora.enabled else LoraConfig(
            rank=c.lora.rank, alpha=c.lora.alpha, dropout=c.lora.dropout,
            targets=tuple(c.lora.targets))
        self.spec = ModelSpec(self.model_config, mesh=self.mesh, dtype=DTYPES[c.model.dtype],
                              param_dtype=DTYPES[c.model.param_dtype], remat=c.model.remat,
                              scan_layers=c.model.scan_layers, lora=lora)
        # The model the generators run (a LoRA run's: the base with its adapters merged in).
        self.plain_spec = self.spec if lora is None else ModelSpec(
            self.model_config, mesh=self.mesh, dtype=DTYPES[c.model.dtype],
            param_dtype=DTYPES[c.model.param_dtype], remat=c.model.remat,
            scan_layers=c.model.scan_layers)
        self.env = envs.get(c.env.name, **c.env.kwargs)
        self.turn_stops = turn_stop_ids(self.codec, self.env)
        self.prompt_source = prompt_source(c, self.env)
        if c.eval.path:
            held_out = prompt_source(c, self.env, path=c.eval.path)
            self.eval_prompts = [held_out[i] for i in range(min(c.eval.examples,
                                                                 len(held_out)))]
        else:
            self.eval_prompts = held_out_prompts(self.env, c.eval.examples)
        sample_prompts = [self.prompt_source[i] for i in
                          range(min(256, len(self.prompt_source)))] + self.eval_prompts
        self.max_prompt_tokens = max(len(self.codec.encode(p.text)) for p in sample_prompts)
        shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro_rows = int(c.trainer.micro_batch_rows)
        if micro_rows and micro_rows % shards:
            raise RLConfigError(f"trainer.micro_batch_rows={micro_rows} is not divisible by the "
                                f"mesh's {shards} batch shards (data × fsdp)")
        self.row_multiple = micro_rows or shards * c.trainer.num_microbatches
        self.rows = rows_per_batch(c, self.max_prompt_tokens, self.row_multiple)
        if max_sample_tokens(self.max_prompt_tokens, c) > c.generator.max_seq_len:
            raise RLConfigError(
                f"generator.max_seq_len={c.generator.max_seq_len} is shorter than a prompt "
                f"({self.max_prompt_tokens} tokens) plus the completion limit "
                f"({max_new_tokens(c)} tokens)")
        opt = OptimizerConfig(total_steps=c.trainer.steps, **to_dict(c.optimizer))
        self.optimizer_config = opt
        # Compiled once and called here: evaluated eagerly, the schedule's first call dispatches
        # (and compiles) a few dozen small operations on the trainer's thread.
        self.schedule = jax.jit(learning_rate_schedule(opt))
        jax.block_until_ready(self.schedule(0))
        self.tx = make_optimizer(opt)
        self.batch_sharding = default_batch_sharding(self.spec)
        loss_fn = make_policy_loss(c.loss.name, dict(c.loss.options),
                                   block_size=c.trainer.logits_block_size,
                                   temperature=c.rollout.temperature)
        self.loss_fn = loss_fn


class TrainerParts:
    """The heavy part of the trainer's setup, which the generator servers' start-up overlaps: the
    compiled train step, the checkpointer, the train state (restored, or from the base policy)
    with the checkpoint's ``meta``, and the parameter average (``ema``)."""

    def __init__(self, c: RLRecipe, model: ModelParts, workdir: Path, base_dir: Path,
                 closers: list):
        """The heavy part of the trainer's setup (what the generator servers' start-up
        overlaps): the compiled train step, the train state (restored or from the base
        policy) and its warm-up."""
        loss_fn = model.loss_fn
        micro_rows = int(c.trainer.micro_batch_rows)
        power = c.trainer.ess_lr_power
        update_scale = ess_update_scale(power) if power else None
        if micro_rows:
            # Batches of any size run as fixed-shape micro-batches: compiled once, here.
            self.train_step = StreamingTrainStep(model.spec, model.tx, loss_fn,
                                                 micro_rows=micro_rows,
                                                 batch_sharding=model.batch_sharding,
                                                 update_scale=update_scale)
            seconds = self.train_step.compile(PolicyBatch.abstract(micro_rows,
                                                                   c.rollout.seq_len))
            log.info("train step compiled for micro-batches of %d x %d in %.1f s", micro_rows,
                     c.rollout.seq_len, seconds)
        else:
            self.train_step = make_train_step(model.spec, model.tx, loss_fn,
                                              num_microbatches=c.trainer.num_microbatches,
                                              batch_sharding=model.batch_sharding,
                                              update_scale=update_scale)
        self.checkpointer = Checkpointer(workdir / "checkpoints", keep=c.checkpoint.keep,
                                         every=c.checkpoint.every,
                                         use_async=c.checkpoint.use_async)
        closers.append(self.checkpointer.close)
        self.meta: dict[str, Any] = {}
        self.spec, self.base_dir = model.spec, base_dir

        def base_params():  # a LoRA run: the frozen base and fresh adapters of the seed
            return model.spec.split_frozen(model.spec.split(load_pretrained(
                base_dir, model.mesh, model.spec.dtype, param_dtype=model.spec.param_dtype,
                rules=model.spec.rules)), c.seed)

        if self.checkpointer.latest_step() is not None:
            target = abstract_state(model.tx, model.spec)
            if model.spec.lora is not None:  # checkpoints hold the adapters only
                target = target.replace(frozen=base_params()[1])
            self.state, self.meta, _ = self.checkpointer.restore(target)
            log.info("resumed from %s at policy version %d", self.checkpointer.directory,
                     int(self.state.step))
        else:
            self.state = init_state(model.tx, model.spec, *base_params())
        self.n_params = sum(x.size for x in jax.tree.leaves(self.state.params))
        # A LoRA run's generators get the base with the adapters merged in (full versions).
        self._merge = None if model.spec.lora is None else jax.jit(
            lambda adapters, frozen: merge_adapters(
                {**frozen, "layers": {**frozen["layers"], **adapters["layers"]}},
                model.spec.lora))
        # An exponential moving average of the parameters, exported and evaluated at the end in
        # place of the last step's (the generators always sample from the trained policy).
        # It lives beside the train state, not in its checkpoints: a resumed run restarts it.
        self.ema_decay = c.trainer.ema_decay
        self.ema, self.ema_updates = None, 0
        if self.ema_decay:
            self.ema = jax.tree.map(jnp.copy, self.state.params)
            if self.meta:
                log.info("parameter average restarts from the resumed parameters")
            # Compiled here, not after the first step (JAX's cache serves the first call).
            ema_update.lower(self.ema, self.state.params, jnp.float32(0.0)).compile()
        if micro_rows:
            seconds = self.train_step.warm(self.state.params,
                                           PolicyBatch.abstract(micro_rows, c.rollout.seq_len),
                                           frozen=self.state.frozen)
            log.info("train step warmed up in %.2f s", seconds)

    def for_generators(self, params: Any) -> Any:
        """The parameters a version gives the generators: ``params`` themselves, or for a LoRA
        run the base with these adapters merged in."""
        return params if self._merge is None else self._merge(params, self.state.frozen)

    def export(self, params: Any, path: Path, *, tokenizer: Any, dtype: Any) -> Path:
        """``params`` as an HF checkpoint at ``path``; a LoRA run's merged into the base, and
        its adapters alone in PEFT's format beside it (``<path>/../adapter``)."""
        if self._merge is None:
            return save_pretrained(self.spec.merge(params), path, tokenizer=tokenizer,
                                   dtype=dtype)
        full = {**self.state.frozen, "layers": {**self.state.frozen["layers"],
                                                **params["layers"]}}
        save_peft_adapter(Path(path).parent / "adapter", params, self.spec.config,
                          self.spec.lora, base_model=str(self.base_dir))
        return save_merged(path, self.spec.config, full, self.spec.lora, tokenizer=tokenizer,
                           dtype=dtype)


class GeneratorParts:
    """The generator side of a run (process 0): the weight publisher and the server pool, started
    at once without waiting (their start-up overlaps the trainer's); :meth:`connect` then waits
    for the servers and builds the clients, the weight sync and the fleet."""

    def __init__(self, c: RLRecipe, model: ModelParts, workdir: Path, base_dir: Path,
                 compilation_cache_dir: str, closers: list):
        self.c, self.closers, self.workdir = c, closers, workdir
        self.vocab_size = model.model_config.vocab_size  # answers' token ids are checked
        # SGLang servers load checkpoints, unless sidecars pull for them
        # (generator.sglang_weights); this project's servers pull themselves.
        sglang_disk = c.generator.kind == "sglang" and c.generator.sglang_weights == "disk"
        self.weight_method = "disk" if (sglang_disk or tuple(
            c.transfer.transports) == ("disk",)) else "transfer"
        transports = (("disk",) if self.weight_method == "disk"
                      else tuple(c.transfer.transports))
        staging_dir = c.transfer.staging_dir or None
        if staging_dir is not None and not (os.path.isdir(staging_dir)
                                            and os.access(staging_dir, os.W_OK | os.X_OK)):
            raise RLConfigError(f"transfer.staging_dir={staging_dir!r} is not a writable "
                                "directory")
        # `disk` beside other transports: the fallback when host staging has no room.
        self.publisher = Publisher(PublisherConfig(
            host=c.transfer.host, port=c.transfer.port, transports=transports,
            staging_dir=staging_dir,
            disk_dir=str(workdir / "weights") if "disk" in transports else None),
            spec=model.spec)
        self.closers.append(self.publisher.close)
        self.pool = GeneratorPool(c.generator, model_dir=base_dir,
                                  publisher_url=self.publisher.url, cpu_cores=c.cpus.generators,
                                  nice=c.cpus.generators_nice,
                                  log_dir=workdir / "generators",
                                  compilation_cache_dir=compilation_cache_dir,
                                  sidecar_transport=c.transfer.transport)
        self.closers.append(self.pool.stop)
        # Until connect() serves the fleet's routes, a join with the right key is told to try
        # again (503), not refused as unauthorized.
        self.publisher.add_routes(Fleet.starting_routes(), token=self._fleet_token(),
                                  max_body_bytes=4096)
        self._pool_started = time.perf_counter()
        self.pool.start(wait=False)

    def _fleet_token(self) -> str | None:
        keys = self.pool.keys
        return keys.admin_api_key or keys.api_key or None

    def connect(self, trainer: TrainerParts, *, update_when_idle: bool,
                generation_idle: Callable[[], bool], on_applied: Callable[[int], None]):
        """Waits for the servers, checks them (health, keys, SGLang release), builds the clients,
        the weight sync and the fleet, and brings every server to the ``trainer``'s version."""
        state = trainer.state
        c = self.c
        method = self.weight_method
        self.pool.wait_started()
        log.info("generator pool up %.1f s after its start: %s",
                 time.perf_counter() - self._pool_started, self.pool.urls)
        client_config = ClientConfig(request_timeout=c.generator.request_timeout_s,
                                     control_timeout=max(c.transfer.timeout_s, 60.0),
                                     vocab_size=self.vocab_size)
        self.control_loop = BackgroundLoop("generator-control")
        self.closers.append(self.control_loop.close)
        # With a router: requests go through it; weight updates and control calls go to each
        # server (its workers and the servers of this run).
        router, servers = None, list(self.pool.urls)
        if c.generator.router_url:
            router = RouterWorkers(c.generator.router_url, self.pool.keys,
                                   timeout_s=max(c.transfer.timeout_s, 60.0))
            try:
                servers += [u for u in router.healthy() if u not in servers]
            except RouterError as e:
                raise RLConfigError(f"generator.router_url: {e}") from None
            if not servers:
                raise RLConfigError(f"generator.router_url={c.generator.router_url} lists no "
                                    "healthy worker and generator.num_servers is 0")
        self.control = GeneratorClient(servers, client_config, keys=self.pool.keys)
        self.closers.append(lambda: self.control_loop.run(self.control.close(), timeout=30))
        if c.generator.urls or router is not None:
            health = self.control_loop.run(self.control.check_health(), timeout=60)
            down = sorted(url for url, ok in health.items() if not ok)
            if down:
                raise RLConfigError(f"generator server(s) {', '.join(down)} unreachable (no "
                                    "answer at /health)")
        self.control_loop.run(check_keys(self.control), timeout=60)
        try:  # an SGLang release this project does not support stops the run here
            identities = self.control_loop.run(self.control.identify_servers(), timeout=60)
        except UnsupportedServer as e:
            raise RLConfigError(str(e)) from None
        self.rollout_client = GeneratorClient(
            servers if router is None else [router.url], client_config, keys=self.pool.keys)
        for server in self.rollout_client.servers:  # seeds a server ignores are said once
            server.identity = identities.get(server.url)
        self.sampler = PoolSampler([self.rollout_client, self.control])
        self.closers.append(self.sampler.close)
        # Updates go to the servers, or to their weight sidecars (one per SGLang server).
        weight_client = self.control
        if self.pool.sidecars is not None:
            weight_client = GeneratorClient(self.pool.weight_urls, client_config,
                                            keys=self.pool.keys)
            self.closers.append(
                lambda: self.control_loop.run(weight_client.close(), timeout=30))
        self.weights = WeightSync(
            self.publisher, weight_client, self.control_loop, method=method,
            update_when_idle=update_when_idle,
            generation_idle=generation_idle,
            on_applied=on_applied, timeout_s=c.transfer.timeout_s,
            transport=c.transfer.transport)
        self.closers.append(self.weights.close)
        # Servers join and leave through the publisher's control server, authenticated with
        # the servers' admin key (the transfer token where they have no keys).
        self.fleet = Fleet(self.control, self.control_loop, self.rollout_client, self.weights,
                           self.pool, router=router, poll_s=c.generator.router_poll_s,
                           joins_refused=None if self.pool.sidecars is None else (
                               "this run's SGLang servers take weights through sidecars it "
                               "started (generator.sglang_weights='sidecar'); a server joining "
                               "would have none"))
        self.publisher.add_routes(self.fleet.routes(), token=self._fleet_token(),
                                  max_body_bytes=4096)
        if method == "transfer" and not c.generator.urls and c.generator.num_servers:
            if not self.publisher.wait_for_layouts(1, timeout=60):
                raise RLConfigError("no generator server registered with the weight publisher")
        # Bring every server to the trainer's version before any rollout.
        version = int(state.step)
        versions = self.control_loop.run(self.control.weight_versions(), timeout=60)
        if version == 0 and versions and all(v == 0 for v in versions.values()):
            self.weights.published = self.weights.applied = 0
        else:
            self.weights.publish(trainer.for_generators(state.params), version)
            self.weights.wait_applied(version)
        try:  # servers of this run into the router; then its worker list is followed
            self.fleet.start()
        except RouterError as e:
            raise RLConfigError(f"generator.router_url: {e}") from None
        self.closers.append(self.fleet.close)


def start_rollout(c: RLRecipe, settings: ModeSettings, model: ModelParts, meta: dict[str, Any],
                  version: int, generators: GeneratorParts, closers: list,
                  score_until: tuple[int, ...]) -> tuple[Any, GroupsToBatch]:
    """The rollout (an iterator of batches of groups, resumed from ``meta``) and the map that
    packs its groups into train batches."""
    r = c.rollout
    config = rollout_config(c, settings, score_until=score_until, turn_stops=model.turn_stops,
                            drop_log=str(generators.workdir / DROP_LOG))
    state = dict(meta.get("rollout") or {})
    state.update(trainer_version=version, generator_version=generators.weights.applied)
    prompts = prompt_dataset(model.prompt_source, seed=c.seed,
                             shuffle=bool(c.data.path) and c.data.shuffle,
                             num_epochs=None if not c.data.epochs or not c.data.path
                             else int(c.data.epochs))
    dataset = RolloutDataset(prompts, model.env, generators.rollout_client,
                             encode=model.codec.encode, decode=model.codec.decode,
                             encode_observation=model.codec.encode_observation,
                             config=config, state=state, close_generator=True)
    rollout = iter(dataset)
    closers.append(rollout.close)
    to_batch = GroupsToBatch(seq_len=r.seq_len, rows=model.rows, advantage=r.advantage,
                             pad_id=model.model_config.pad_token_id or 0,
                             row_multiple=model.row_multiple,
                             power_of_two=not c.trainer.micro_batch_rows,
                             share_prompts=r.share_prompts)
    to_batch.warm(r.groups_per_batch, r.group_size)
    return rollout, to_batch
