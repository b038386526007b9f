"""HTTP server speaking SGLang's API in front of one in-process :class:`Engine`.

One process: an aiohttp event loop answers HTTP while the engine's scheduler thread decodes;
``/generate`` awaits the engine's futures (``asyncio.wrap_future``), and blocking engine calls
(pause, abort, flush, weight loading) run in worker threads so the loop keeps answering health
probes. Endpoints (SGLang's names; the router probes the ``/server_info``-style aliases too):

  POST /generate                    text or input_ids (single or batch), sampling_params, ...
  GET  /health, /health_generate    200 while the engine runs (the latter generates one token)
  GET  /get_model_info, /model_info       model_path, is_generation, weight_version, ...
  GET  /get_server_info, /server_info     server arguments, load, engine counters
  GET  /get_load                    {"load": running + waiting sequences}
  GET  /get_weight_version          {"weight_version": int}
  GET/POST /flush_cache             clears the KV cache (400 while sequences run)
  POST /abort_request               {rid, abort_all}
  POST /pause_generation            {mode: abort | retract | in_place}
  POST /continue_generation
  POST /update_weights_from_disk    {model_path, load_format, abort_all_requests,
                                     weight_version, flush_cache, allow_older}; an in-flight
                                     swap
  GET  /v1/models                   OpenAI-style model list

Errors are JSON ``{"error": {"message", "type", "code"}}``: 400 for malformed or unservable
requests (which fields are honoured, ignored or refused: see ``protocol``), 404 for unknown
paths, 503 with ``Retry-After`` when the waiting queue is full, 503 once the engine has stopped.
A client that disconnects has its requests aborted. A refused request is logged as one warning
line; a 500 (with its traceback) is a bug.

Requests are bounded before they cost memory or time: bodies past ``max_request_bytes`` (413)
or slower than ``body_timeout_s`` (408); bodies nested deeper than 32 levels, holding ``NaN``,
``Infinity`` or integers outside int64 (400 naming the field: ``protocol.parse_json_body``);
sampling integers outside what the engine stores (int32), ``n`` x prompts above the queue
limit whatever ``max_new_tokens`` is, texts longer than ``max_text_chars`` before they are
tokenised. Parsing, tokenising, submitting, detokenising and serialising run in worker threads,
so health probes stay fast beside a big request. A connection gets ``keepalive_timeout_s`` to
send its headers and as long idle between requests. New weights, whichever path they take, are
checked where the engine takes them (``Engine.update_weights``): tree, shapes, floating dtypes,
finite values, and a version that does not go back unless the request sets ``allow_older``;
refused ones get a 400 saying why while the old weights keep serving. Weight versions are
integers (SGLang uses strings); every token's version is in
``meta_info.output_token_weight_versions``.

With ``ServerConfig.keys`` set, requests need SGLang's API key or admin API key
(``rl_jax.generator.auth``: 401/403 otherwise; ``/health`` stays open).

Differences from SGLang worth knowing: the engine stops on token ids only, so ``stop`` strings
are applied to the finished completion (decoding continues until a stop token or
``max_new_tokens``); ``stream: true`` sends one event per finished completion rather than
incremental text; ``/update_weights_from_disk`` swaps weights in flight instead of waiting for
running requests to finish.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

import rl_jax
from rl_jax.cpus import thread_cpu_seconds
from rl_jax.generator import auth
from rl_jax.generator.engine import PAUSE_MODES, Engine, EngineConfig
from rl_jax.generator.protocol import (ParsedGenerate, ProtocolError, apply_stop_strings,
                                       error_json, output_json, parse_generate, parse_json_body)
from rl_jax.generator import kernels
from rl_jax.generator.kv_cache import MIN_ADMIT, kv_bucket
from rl_jax.generator.types import GenerateRequest, GeneratorError, Overloaded, SamplingParams
from rl_jax.generator.weights import (SWAP_TIMEOUT_S, WeightsRefused, check_update,
                                      generator_rules, load_params, make_generator_meshes,
                                      wait_for_swap)
from rl_jax.heap import GcMonitor, freeze_long_lived
from rl_jax.models.config import DTYPES, ConfigError, eos_ids
from rl_jax.models.hf import CheckpointError, load_tokenizer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 512 << 20
# /generate requests up to this size (bytes), answers up to this many tokens, are handled on the
# event loop; bigger ones in worker threads.
INLINE_BYTES = 16 << 10
INLINE_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str  # HF checkpoint directory (config.json, *.safetensors, optional tokenizer.json)
    host: str = "127.0.0.1"
    port: int = 30000  # 0 picks a free port (printed in the ready line)
    max_slots: int = 32
    max_seq_len: int = 512
    max_waiting: int = 4096
    max_prefill_tokens: int = 2048
    # "auto": bfloat16 on accelerators, float32 on CPUs (see resolve_auto)
    dtype: str = "auto"
    tensor_parallel: int = 1
    data_parallel: int = 1  # replicas of the model, each on tensor_parallel devices of its own
    # decode steps run as one program, admissions between programs (SGLang's
    # --num-continuous-decode-steps; see EngineConfig.decode_steps); 0: auto (resolve_auto)
    decode_steps: int = 0
    # decode attention (SGLang's --attention-backend): "auto" | "native" | "xla"
    # (see EngineConfig.attention)
    attention_backend: str = "auto"
    weight_version: int = 0
    strict: bool = True  # refuse sampling controls the engine cannot honour (else ignore them)
    warmup: bool = True  # compile prefill/decode before reporting ready
    warmup_shapes: bool = False  # ... every decode batch size and length (slower start)
    served_model_name: str | None = None
    parent_pid: int = 0  # when > 0, exit once that process is gone (set by the pool launcher)
    publisher_url: str | None = None  # weight publisher for /update_weights_from_transfer
    # With a publisher_url: pull the newest published version (if any) before serving, so a
    # server (re)started during a run never answers with weights older than the run's.
    pull_on_start: bool = True
    # API key and admin API key (rl_jax.generator.auth; never shown in a repr or a log)
    keys: auth.Keys = auth.NO_KEYS
    # /update_weights_from_transfer may name another publisher than publisher_url. A keyed
    # server allows it too: the endpoint is an admin one, so its caller proved the key.
    allow_any_publisher: bool = False
    # Request bounds, checked before a request costs memory or time. Bodies larger than this
    # are refused (413) before they are read in full.
    max_request_bytes: int = 64 << 20
    # Characters of one prompt text tokenised at most; 0: derived from the tokenizer, twice
    # max_seq_len times its longest token (longer text could not fit max_seq_len).
    max_text_chars: int = 0
    # Seconds a connection may take to send a request's headers, and stay idle between
    # requests (aiohttp's keep-alive timer covers both; uvicorn, in front of SGLang, closes
    # idle ones after 5 s). Above the 15 s an aiohttp client keeps idle connections, so a
    # client never reuses one the server is closing.
    keepalive_timeout_s: float = 20.0
    # Seconds a request's body may take to arrive.
    body_timeout_s: float = 60.0


class EngineStopped(RuntimeError):
    """The engine's scheduler thread is not running (HTTP 503): nothing would be served."""


# ---- loading ------------------------------------------------------------------------------------

ACCELERATOR_DECODE_STEPS = 8


def resolve_auto(config: ServerConfig, backend: str | None = None) -> ServerConfig:
    """``config`` with its automatic settings made concrete for ``backend`` (default: JAX's):
    ``dtype="auto"`` is bfloat16 on accelerators and float32 on CPUs; ``decode_steps=0`` is
    :data:`ACCELERATOR_DECODE_STEPS` on accelerators (the host would otherwise launch every
    step's program and read its tokens back between steps) and 1 on CPUs (where a step is long
    enough that per-step host work is a small share, and admissions wait for a program's end)."""
    if config.dtype != "auto" and config.decode_steps != 0:
        return config
    import jax
    accelerator = (backend or jax.default_backend()) != "cpu"
    return dataclasses.replace(
        config,
        dtype=("bfloat16" if accelerator else "float32") if config.dtype == "auto"
        else config.dtype,
        decode_steps=(ACCELERATOR_DECODE_STEPS if accelerator else 1)
        if config.decode_steps == 0 else config.decode_steps)


def text_limit(tokenizer, max_seq_len: int) -> int | None:
    """Characters of text that may be tokenised for one prompt: twice what ``max_seq_len``
    tokens of the tokenizer's longest token could spell (None without a tokenizer)."""
    if tokenizer is None:
        return None
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max_seq_len * max(longest, 1)


def parse_version(value: Any, current: int) -> int:
    """A request's ``weight_version`` (int or integer string; None → current + 1)."""
    if value is None:
        return current + 1
    if isinstance(value, bool):
        raise ProtocolError(f"weight_version must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"weight_version must be an integer (this engine counts optimizer "
                            f"steps), got {value!r}") from None


# ---- the server ---------------------------------------------------------------------------------

class GeneratorServer:
    """The aiohttp application around one engine (built by :meth:`from_config`)."""

    def __init__(self, engine: Engine, config: ServerConfig, *, tokenizer=None, mesh=None,
                 rules=None, dtype=None):
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.mesh, self.rules, self.dtype = mesh, rules, dtype
        self.model_path = str(config.model)
        self.started = time.time()
        self.http_requests: collections.Counter = collections.Counter()  # path -> count
        self._groups: dict[str, list[str]] = {}  # HTTP-level rid -> engine rids
        self._update_lock: asyncio.Lock | None = None
        self._pullers: dict[str, Any] = {}  # publisher URL -> rl_jax.transfer.GeneratorPuller
        self.gc = GcMonitor().install()
        self.max_text_chars = config.max_text_chars or text_limit(tokenizer, config.max_seq_len)

    @classmethod
    def from_config(cls, config: ServerConfig) -> "GeneratorServer":
        config = resolve_auto(config)
        for name in ("max_slots", "max_seq_len", "max_waiting", "max_prefill_tokens",
                     "tensor_parallel", "data_parallel", "decode_steps"):
            if getattr(config, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)}")
        if config.max_slots % config.data_parallel:
            raise ConfigError(f"max_slots={config.max_slots} must split evenly over "
                              f"data_parallel={config.data_parallel} replicas")
        if config.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        if config.attention_backend not in kernels.BACKENDS:
            raise ConfigError(f"attention_backend must be one of {kernels.BACKENDS}, got "
                              f"{config.attention_backend!r}")
        dtype = DTYPES[config.dtype]
        meshes = None  # one device
        if config.tensor_parallel * config.data_parallel > 1:
            meshes = make_generator_meshes(config.tensor_parallel, config.data_parallel)
        mesh = meshes[0] if meshes else None
        rules = generator_rules()
        model_config, params = load_params(config.model, mesh=mesh, rules=rules, dtype=dtype)
        tokenizer = None
        if (Path(config.model) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(config.model)
        engine = Engine(model_config, params, version=config.weight_version, meshes=meshes,
                        rules=rules, dtype=dtype, eos_token_ids=eos_ids(model_config),
                        engine_config=EngineConfig(
                            max_slots=config.max_slots, max_seq_len=config.max_seq_len,
                            max_waiting=config.max_waiting,
                            max_prefill_tokens=config.max_prefill_tokens,
                            decode_steps=config.decode_steps,
                            attention=config.attention_backend))
        server = cls(engine, config, tokenizer=tokenizer, mesh=mesh, rules=rules, dtype=dtype)
        if config.publisher_url and config.pull_on_start:
            server.pull_initial_weights()
        if config.warmup:
            server.warmup()
        return server

    def pull_initial_weights(self):
        """Pulls the newest version published at ``config.publisher_url``, if newer than the
        loaded one; a publisher that cannot be reached is logged and the loaded weights kept."""
        from rl_jax.transfer import GeneratorPuller, TransferError
        url = self.config.publisher_url
        puller = self._pullers.setdefault(url, GeneratorPuller(url))
        try:
            update = puller.pull_latest(self.engine, wait_s=0.0)
        except (TransferError, OSError) as e:
            log.warning("no initial weights from %s (serving version %d): %s", url,
                        self.engine.version, e)
            return
        if update is not None:
            try:
                self.engine.update_weights(update.params, update.version,
                                           finite_checked=update.finite_checked)
            except WeightsRefused as e:
                log.warning("initial weights from %s refused (serving version %d): %s", url,
                            self.engine.version, e)
                return
            if not wait_for_swap(self.engine, update.params):
                raise EngineStopped("the engine did not apply the initial weights")
            log.info("pulled initial weight version %d from %s", update.version, url)

    def warmup(self):
        """Compiles prefill, decode and sampling with one short greedy request (per
        data-parallel replica); with ``warmup_shapes``, also every decode shape a run can meet
        (each power-of-two batch up to a replica's slots, each grown to ``max_seq_len``) and
        every admission shape of prompts up to the shortest prefill bucket, so that no request
        waits for a compilation later (a second or more each on a CPU core)."""
        steps = min(2, self.config.max_seq_len - 1)
        if steps > 0:
            self._burst(1, 1, tag="first", max_new_tokens=steps, temperature=0.0)
        if not self.config.warmup_shapes or self.config.max_seq_len < 3:
            return
        start = time.perf_counter()
        slots = self.config.max_slots // self.engine.data_parallel  # per replica
        sizes = sorted({min(1 << k, slots) for k in range(slots.bit_length() + 1)})
        for n in sizes:
            self._burst(1, n, tag=f"batch-{n}", max_new_tokens=self.config.max_seq_len - 1)
        # Admissions of several prompts at once (a batch of rollout groups, an evaluation set,
        # both mixed): the first tokens of every power-of-two prompt count × sequence count,
        # and installing every power-of-two sequence count at every cache length.
        for prompts in sizes:
            for n in sizes:
                if prompts * n <= slots and (n == 1 or prompts * n > MIN_ADMIT):
                    self._burst(prompts, n, tag=f"{prompts}x{n}")
        lengths = sorted({kv_bucket(n, self.config.max_seq_len)
                          for n in range(1, self.config.max_seq_len + 1)})
        for runner in self.engine.runners:
            for length in lengths:  # moving sequences to lower slots (see Engine._compact)
                runner.compile_move(length)
            runner.compile_shrinks(lengths)  # the cache shrinking as long sequences finish
        for length in lengths[1:]:
            for n in sizes:
                if n >= MIN_ADMIT or n == slots:
                    # The cache stays this long when idle.
                    self._burst(1, 1, tag=f"grow-{length}", max_new_tokens=length - 1,
                                temperature=0.0)
                    self._burst(1, n, tag=f"{length}-{n}")
        log.info("compiled decode and prefill for batches %s up to %d tokens in %.1f s", sizes,
                 self.config.max_seq_len, time.perf_counter() - start)

    def _burst(self, prompts: int, n: int, tag: str, max_new_tokens: int = 2,
               temperature: float = 1.0):
        """``prompts`` one-token requests of ``n`` samples for each data-parallel replica, all
        admitted in one scheduler pass (a new request goes to the replica with the most free
        slots, so each replica gets the same)."""
        self.engine.pause("in_place")
        deadline = time.monotonic() + 60
        while not self.engine.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        futures = [self.engine.submit(GenerateRequest(
            [i % self.engine.config.vocab_size], SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True, n=n,
                seed=i),
            rid=f"warmup-{tag}-{i}")) for i in range(prompts * self.engine.data_parallel)]
        self.engine.resume()
        for future in futures:
            future.result(timeout=1800)

    # ---- helpers --------------------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.model_path

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def alive(self) -> bool:
        return self.engine.alive  # the scheduler thread; dead after shutdown/crash

    def _require_alive(self):
        """Engine calls block until the scheduler thread applies them: refuse them once it is
        gone instead of hanging."""
        if not self.alive():
            raise EngineStopped("the engine's scheduler is not running")

    async def _json_body(self, request: web.Request, optional: bool = False) -> dict[str, Any]:
        """The request's JSON object, read within this server's size and time bounds and
        parsed off the event loop (see :func:`read_body`, :func:`parse_json_body`)."""
        raw = await read_body(request, self.config.max_request_bytes,
                              self.config.body_timeout_s)
        if not raw.strip():
            if optional:
                return {}
            raise ProtocolError("the request body is empty; send a JSON object")
        if len(raw) < 4096:
            return parse_json_body(raw)
        return await asyncio.to_thread(parse_json_body, raw)

    async def _abort(self, rids: list[str]):
        for rid in rids:
            await asyncio.to_thread(self.engine.abort, rid)

    # ---- /generate ------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        self._require_alive()
        # Tokenising and submitting a big request run off the event loop (health probes stay
        # fast behind it); a small one costs less than the hand-over to a thread.
        small = (request.content_length or INLINE_BYTES + 1) <= INLINE_BYTES
        parse = functools.partial(
            parse_generate, body, tokenize=self._tokenize if self.tokenizer else None,
            vocab_size=self.engine.config.vocab_size, max_seq_len=self.config.max_seq_len,
            strict=self.config.strict, max_sequences=self.config.max_waiting,
            max_text_chars=self.max_text_chars)
        parsed = parse() if small else await asyncio.to_thread(parse)
        submitted = (self._submit_all(parsed) if small
                     else await asyncio.to_thread(self._submit_all, parsed))
        group = body.get("rid") if isinstance(body.get("rid"), str) else None
        engine_rids = [it.request.rid for it in parsed.items]
        if group:
            self._groups[group] = engine_rids
        try:
            if parsed.stream:
                return await self._stream(request, parsed,
                                          [asyncio.wrap_future(f) for f in submitted])
            results = (await asyncio.gather(*map(asyncio.wrap_future, submitted)) if small
                       else await _all_results(submitted))
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            await asyncio.shield(self._abort(engine_rids))
            raise
        except Exception:  # one request of a batch failed: the others' work is wasted
            await self._abort(engine_rids)
            raise
        finally:
            if group:
                self._groups.pop(group, None)
        # Detokenising and serialising a big answer run off the event loop too.
        tokens = sum(len(out.output_ids) for outs in results for out in outs)
        data = (self._answers_json(parsed, results) if small and tokens <= INLINE_TOKENS
                else await asyncio.to_thread(self._answers_json, parsed, results))
        return web.Response(body=data, content_type="application/json")

    def _submit_all(self, parsed: ParsedGenerate) -> list[concurrent.futures.Future]:
        """Queues every prompt of a request (all or none: a refusal aborts those queued)."""
        futures = []
        try:
            for item in parsed.items:
                futures.append(self.engine.submit(item.request))
        except (GeneratorError, Overloaded):
            for item in parsed.items[:len(futures)]:
                self.engine.abort(item.request.rid)
            raise
        return futures

    def _answers_json(self, parsed: ParsedGenerate, results) -> bytes:
        answers = [self._answer(parsed, i, out)
                   for i, outs in enumerate(results) for out in outs]
        return json.dumps(answers if parsed.as_list else answers[0]).encode()

    def _answer(self, parsed: ParsedGenerate, i: int, out) -> dict[str, Any]:
        item = parsed.items[i]
        if self.tokenizer is not None and item.stop_strings:
            out = apply_stop_strings(out, item.stop_strings,
                                     lambda ids: self._decode(ids, item.skip_special_tokens))
        return output_json(out, item, weight_version=self.engine.version,
                           decode=self._decode if self.tokenizer else None,
                           token_text=self._token_text if self.tokenizer else None,
                           return_text_in_logprobs=parsed.return_text_in_logprobs)

    async def _stream(self, request, parsed: ParsedGenerate, futures) -> web.StreamResponse:
        """Server-sent events: one ``data:`` event per finished completion (with its ``index``
        in the flattened, prompt-major answer list for batches), then ``data: [DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        offsets = [0]
        for item in parsed.items:
            offsets.append(offsets[-1] + item.request.sampling.n)
        pending = {f: i for i, f in enumerate(futures)}
        try:
            await self._stream_events(response, parsed, pending, offsets)
        except ConnectionResetError:  # the client went away
            await self._abort([parsed.items[i].request.rid for i in pending.values()])
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_events(self, response, parsed, pending, offsets):
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for f in done:
                i = pending.pop(f)
                try:
                    outs = f.result()
                except Exception as e:  # headers are sent: report in-band, as SGLang does
                    await _sse(response, error_json(str(e), "internal_error", 500))
                    continue
                chunks = await asyncio.to_thread(
                    lambda: [self._answer(parsed, i, out) for out in outs])
                for j, chunk in enumerate(chunks):
                    if parsed.as_list:
                        chunk["index"] = offsets[i] + j
                    await _sse(response, chunk)

    # ---- control --------------------------------------------------------------------------------

    async def health(self, request):
        if not self.alive():
            return _error("the engine's scheduler is not running", "unavailable", 503)
        return _json_response({"status": "ok", "weight_version": self.engine.version,
                               "paused": self.engine.paused})

    async def health_generate(self, request):
        """Generates one token unless the engine is paused or already busy (then its scheduler
        being alive is enough, as in SGLang)."""
        if not self.alive():
            return _error("the engine's scheduler is not running", "unavailable", 503)
        load = self.engine.load()
        if self.engine.paused or load["running"] or load["waiting"]:
            return await self.health(request)
        probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                    ignore_eos=True))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(probe)), 20)
        except (asyncio.TimeoutError, Overloaded, GeneratorError) as e:
            return _error(f"health generation failed: {e!r}", "unavailable", 503)
        return await self.health(request)

    def _model_info(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {"model_path": self.model_path, "tokenizer_path": self.model_path if
                self.tokenizer else None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.engine.version,
                "served_model_name": self.served_model_name, "architecture": cfg.architecture,
                "vocab_size": cfg.vocab_size, "max_seq_len": self.config.max_seq_len,
                "eos_token_ids": list(eos_ids(cfg))}

    async def model_info(self, request):
        return _json_response(self._model_info())

    async def server_info(self, request):
        c = self.config
        load = self.engine.load()
        return _json_response({
            **self._model_info(), "host": c.host, "port": request.url.port or c.port,
            "tp_size": c.tensor_parallel, "dp_size": c.data_parallel, "dtype": c.dtype,
            "num_continuous_decode_steps": c.decode_steps,
            "attention_backend": self.engine.attention_backend,
            "max_running_requests": c.max_slots, "context_length": c.max_seq_len,
            "max_total_num_tokens": c.max_slots * c.max_seq_len,
            "max_queued_requests": c.max_waiting, "max_prefill_tokens": c.max_prefill_tokens,
            "strict_sampling_params": c.strict, "paused": self.engine.paused,
            "version": f"rl_jax-{rl_jax.__version__}",
            "internal_states": [{**load, **dict(self.engine.stats)}],
            "http_requests": dict(self.http_requests),
            # per thread name, since the server started (see rl_jax.cpus.thread_cpu_seconds)
            "cpu_seconds_by_thread": thread_cpu_seconds(),
            # Python's garbage collections by generation since the server started, and their
            # pauses (rl_jax.heap)
            "gc": self.gc.stats()})

    async def get_load(self, request):
        load = self.engine.load()
        return _json_response({"load": load["running"] + load["waiting"], **load})

    async def weight_version(self, request):
        return _json_response({"weight_version": self.engine.version})

    async def models(self, request):
        return _json_response({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(self.started),
            "owned_by": "rl_jax", "root": self.model_path,
            "max_model_len": self.config.max_seq_len}]})

    async def flush_cache(self, request):
        self._require_alive()
        if await asyncio.to_thread(self.engine.flush_cache):
            return _json_response({"success": True, "message": "Cache flushed."})
        return _json_response({"success": False, "message": "Cache not flushed: sequences are "
                               "running (retry when idle)."}, status=400)

    async def abort_request(self, request):
        self._require_alive()
        body = await self._json_body(request, optional=True)
        rid = body.get("rid")
        abort_all = body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise ProtocolError(f"rid must be a string, got {rid!r}")
        if not isinstance(abort_all, bool):
            raise ProtocolError(f"abort_all must be true or false, got {abort_all!r}")
        if abort_all:
            await asyncio.to_thread(self.engine.abort, None)
        elif rid:
            await self._abort(list(dict.fromkeys([rid, *self._groups.get(rid, ())])))
        else:
            raise ProtocolError("give rid or abort_all=true")
        return _json_response({"success": True})

    async def pause_generation(self, request):
        self._require_alive()
        body = await self._json_body(request, optional=True)
        mode = body.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await asyncio.to_thread(self.engine.pause, mode)
        return _json_response({"message": "Generation paused successfully.", "status": "ok",
                               "mode": mode})

    async def continue_generation(self, request):
        self._require_alive()
        await self._json_body(request, optional=True)
        await asyncio.to_thread(self.engine.resume)
        return _json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request):
        """Loads an HF checkpoint of the same shape and swaps it in between two decode steps;
        running sequences continue under the new version (no pause needed)."""
        body = await self._json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path (an HF checkpoint directory) is required")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise ProtocolError(f"load_format={load_format!r} is not supported "
                                f"(HF safetensors directories only: auto or safetensors)")
        for name in ("abort_all_requests", "flush_cache", "allow_older"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise ProtocolError(f"{name} must be true or false, got {body[name]!r:.60}")
        self._require_alive()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            version = parse_version(body.get("weight_version"), self.engine.version)
            try:
                check_update(self.engine.config, path)
                _, params = await asyncio.to_thread(load_params, path, mesh=self.mesh,
                                                    rules=self.rules, dtype=self.dtype)
            except CheckpointError as e:
                return _json_response({"success": False, "message": str(e),
                                       **error_json(str(e), "invalid_request_error", 400)},
                                      status=400)
            start = time.perf_counter()
            refused = await self._install(params, version, bool(body.get("allow_older")))
            if refused is not None:
                return refused
            if body.get("abort_all_requests"):
                await asyncio.to_thread(self.engine.abort, None)
            swapped = await asyncio.to_thread(wait_for_swap, self.engine, params)
            if not swapped:
                return _error(f"the engine did not apply the new weights within "
                              f"{SWAP_TIMEOUT_S:.0f} s", "internal_error", 500)
            if body.get("flush_cache", True):
                await asyncio.to_thread(self.engine.flush_cache)
            self.model_path = path
        return _json_response({
            "success": True, "num_paused_requests": 0, "weight_version": version,
            "message": f"Succeeded to update model weights from {path}; weight version "
                       f"{version} (swapped in {1000 * (time.perf_counter() - start):.0f} ms)."})

    async def update_weights_from_transfer(self, request):
        """Pulls the newest weights from the trainer's publisher (rl_jax.transfer) straight into
        the engine's shardings, verifies their checksums, and swaps them in between two decode
        steps. Body: ``publisher_url`` (default: the server's), ``weight_version`` (pull at least
        this version), ``wait_s`` (wait this long for a newer version), ``transport``."""
        from rl_jax.transfer import GeneratorPuller, PublisherNotAllowed, TransferError
        from rl_jax.transfer import pinned_publisher

        body = await self._json_body(request, optional=True)
        try:
            url = pinned_publisher(body.get("publisher_url"), self.config.publisher_url,
                                   self.config.allow_any_publisher or bool(self.config.keys))
        except PublisherNotAllowed as e:
            return _error(str(e), "forbidden", 403)
        except ValueError as e:
            raise ProtocolError(f"publisher_url: {e}") from None
        wait_s = body.get("wait_s", 0.0)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or wait_s < 0:
            raise ProtocolError(f"wait_s must be a non-negative number, got {wait_s!r}")
        if wait_s > 3600:
            raise ProtocolError(f"wait_s must be at most 3600 s, got {wait_s!r:.60}")
        transport = body.get("transport")
        if transport is not None and not isinstance(transport, str):
            raise ProtocolError(f"transport must be a string, got {transport!r:.60}")
        allow_older = body.get("allow_older", False)
        if not isinstance(allow_older, bool):
            raise ProtocolError(f"allow_older must be true or false, got {allow_older!r:.60}")
        min_version = body.get("weight_version")
        if min_version is not None:
            min_version = parse_version(min_version, self.engine.version)
        self._require_alive()
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if min_version is not None and self.engine.version >= min_version:
                return _json_response({"success": True, "weight_version": self.engine.version,
                                       "message": f"already at version {self.engine.version}"})
            puller = self._pullers.setdefault(url, GeneratorPuller(url))
            try:
                update = await asyncio.to_thread(puller.pull_latest, self.engine,
                                                 wait_s=float(wait_s), min_version=min_version,
                                                 transport=transport)
            except TransferError as e:
                return _json_response({"success": False, "message": str(e),
                                       "weight_version": self.engine.version,
                                       **error_json(str(e), "transfer_error", 400)}, status=400)
            if update is None:
                return _json_response({"success": True, "weight_version": self.engine.version,
                                       "message": "no newer version was published"})
            start = time.perf_counter()
            refused = await self._install(update.params, update.version, allow_older,
                                          finite_checked=update.finite_checked)
            if refused is not None:
                return refused
            if not await asyncio.to_thread(wait_for_swap, self.engine, update.params):
                return _error(f"the engine did not apply the new weights within "
                              f"{SWAP_TIMEOUT_S:.0f} s", "internal_error", 500)
            swap_ms = 1000 * (time.perf_counter() - start)
        return _json_response({"success": True, "weight_version": update.version,
                               "swap_ms": swap_ms, "transfer": update.metrics.to_json(),
                               "message": f"pulled weight version {update.version}"})

    async def _install(self, params, version: int, allow_older: bool, *,
                       finite_checked: bool = False) -> web.Response | None:
        """Hands new weights to the engine, which checks them (off the event loop); the 400
        answer saying why when it refuses them (the old weights keep serving), else None."""
        try:
            await asyncio.to_thread(self.engine.update_weights, params, version,
                                    allow_older=allow_older, finite_checked=finite_checked)
        except WeightsRefused as e:
            log.warning("refused weight version %d (serving version %d): %s", version,
                        self.engine.version, e)
            return _json_response({"success": False, "message": str(e),
                                   "weight_version": self.engine.version,
                                   **error_json(str(e), "invalid_request_error", 400)},
                                  status=400)
        return None

    # ---- app ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        @web.middleware
        async def count(request, handler):
            self.http_requests[request.path] += 1
            return await handler(request)

        middlewares = [count, _errors_middleware]
        if self.config.keys:
            middlewares.insert(1, auth.aiohttp_middleware(self.config.keys, error_json))
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        add = app.router.add_route
        for method in ("POST", "PUT"):
            add(method, "/generate", self.generate)
        for path, handler in (("/health", self.health), ("/health_generate", self.health_generate),
                              ("/get_model_info", self.model_info),
                              ("/model_info", self.model_info),
                              ("/get_server_info", self.server_info),
                              ("/server_info", self.server_info), ("/get_load", self.get_load),
                              ("/get_weight_version", self.weight_version),
                              ("/v1/models", self.models)):
            add("GET", path, handler)
        for method in ("GET", "POST"):
            add(method, "/flush_cache", self.flush_cache)
        for path, handler in (("/abort_request", self.abort_request),
                              ("/pause_generation", self.pause_generation),
                              ("/continue_generation", self.continue_generation),
                              ("/update_weights_from_disk", self.update_weights_from_disk),
                              ("/update_weights_from_transfer",
                               self.update_weights_from_transfer)):
            add("POST", path, handler)
        return app

    async def serve(self, stop: asyncio.Event | None = None):
        """Serves until ``stop`` is set (or SIGINT/SIGTERM), then shuts the engine down."""
        stop = stop or asyncio.Event()
        warning = auth.exposure_warning(self.config.host, self.config.keys)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                               keepalive_timeout=self.config.keepalive_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"rl_jax generator server ready at http://{self.config.host}:{port} "
              f"(model {self.model_path}, weight version {self.engine.version}, "
              f"max_slots {self.config.max_slots}, max_seq_len {self.config.max_seq_len})",
              flush=True)
        watchdog = (asyncio.create_task(_exit_with_parent(self.config.parent_pid, stop))
                    if self.config.parent_pid > 0 else None)
        try:
            await stop.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await runner.cleanup()
            await asyncio.to_thread(self.engine.shutdown)


def run(config: ServerConfig):
    """Loads the model, starts the engine and serves HTTP until SIGINT/SIGTERM."""
    server = GeneratorServer.from_config(config)
    # The process is the server's: full collections would otherwise traverse everything
    # loading and compiling left (a long pause with the GIL held, decoding stopped; rl_jax.heap).
    freeze_long_lived()
    asyncio.run(server.serve())


# ---- plumbing -----------------------------------------------------------------------------------

async def _exit_with_parent(parent_pid: int, stop: asyncio.Event, interval: float = 1.0):
    """Sets ``stop`` once process ``parent_pid`` is gone (a killed test run or launcher must not
    leave servers behind). A direct parent is gone as soon as this process is re-parented."""
    def alive():
        if direct:
            return os.getppid() == parent_pid
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    direct = os.getppid() == parent_pid
    while alive():
        await asyncio.sleep(interval)
    log.warning("parent process %d is gone; shutting down", parent_pid)
    stop.set()


async def _all_results(futures: list[concurrent.futures.Future]) -> list:
    """The results of the engine's ``futures``, in order, awaited as one: a single wake-up of
    the event loop when the last is done (or the first fails), whatever their number."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def settle(result_or_error, failed: bool):
        if done.done():
            return
        if failed:
            done.set_exception(result_or_error)
        else:
            done.set_result(result_or_error)

    def finished(future: concurrent.futures.Future):
        error = None if future.cancelled() else future.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if error is not None:
            loop.call_soon_threadsafe(settle, error, True)
        elif last:
            loop.call_soon_threadsafe(settle, None, False)

    if not futures:
        return []
    for future in futures:
        future.add_done_callback(finished)
    await done
    return [f.result() for f in futures]


def _json_response(data: Any, status: int = 200, headers=None) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def _error(message: str, kind: str, status: int, headers=None) -> web.Response:
    return _json_response(error_json(message, kind, status), status=status, headers=headers)


async def _sse(response: web.StreamResponse, data: Any):
    await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes, announced or not, and (408) when
    it takes longer than ``timeout`` seconds to arrive."""
    size = request.content_length
    if size is not None and size > limit:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=size,
            reason=f"the request body ({size} bytes) is larger than this server's limit of "
                   f"{limit} bytes")
    chunks, total = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                total += len(chunk)
                if total > limit:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=limit, actual_size=total,
                        reason=f"the request body is larger than this server's limit of "
                               f"{limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            reason=f"the request body did not arrive within {timeout:g} s") from None
    return b"".join(chunks)


def _refused(request: web.Request, status: int, message: str):
    """One warning line for a refused request (no traceback: the client erred, not the
    server)."""
    log.warning("%d %s %s from %s: %.300s", status, request.method, request.path,
                request.remote, message)


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except Overloaded as e:
        return _error(str(e), "overloaded", 503, headers={"Retry-After": "1"})
    except EngineStopped as e:
        return _error(str(e), "unavailable", 503)
    except (GeneratorError, CheckpointError) as e:
        _refused(request, 400, str(e))
        return _error(str(e), "invalid_request_error", 400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "payload_too_large"}.get(e.status, "http_error")
        message = {404: f"no endpoint {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.status,
                                                                                  e.reason)
        _refused(request, e.status, message)
        return _error(message, kind, e.status)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("error serving %s %s", request.method, request.path)
        return _error(f"{type(e).__name__}: {e}", "internal_error", 500)
