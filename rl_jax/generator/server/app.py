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
  POST /init_weights_update_group, /destroy_weights_update_group, /begin_weight_update,
       /update_weights_from_distributed, /end_weight_update: SGLang's broadcast protocol
       (``distributed_endpoints``)
  GET  /v1/models                   OpenAI-style model list

Errors are JSON ``{"error": {"message", "type", "code"}}``: 400 for malformed or unservable
requests (which fields are honoured, ignored or refused: see ``protocol``), 404 for unknown
paths, 503 with ``Retry-After`` when the waiting queue is full, 503 once the engine has stopped.
A client that disconnects has its requests aborted. A refused request is logged as one warning
line; a 500 (with its traceback) is a bug.

Requests are bounded before they cost memory or time: bodies past ``max_request_bytes`` (413)
or slower than ``body_timeout_s`` (408); bodies nested deeper than 32 levels, holding ``NaN``,
``Infinity`` or integers outside int64 (400 naming the field: ``json_body.parse_json_body``);
sampling integers outside what the engine stores (int32), ``n`` x prompts above the queue
limit whatever ``max_new_tokens`` is, texts longer than ``max_text_chars`` before they are
tokenised. Parsing, tokenising, submitting, detokenising and serialising run in worker threads,
so health probes stay fast beside a big request. A connection gets ``keepalive_timeout_s`` to
send its headers and as long idle between requests. New weights, whichever path they take, are
checked where the engine takes them (``Engine.update_weights``): tree, shapes, floating dtypes,
finite values, and a version that does not go back unless the request sets ``allow_older``;
refused ones get a 400 saying why while the old weights keep serving. Weight versions are
integers (SGLang uses strings); every token's version is in
``meta_info.output_token_weight_versions`` and, as SGLang gives it, in the spans of
``meta_info.weight_versions``.

With ``ServerConfig.keys`` set, requests need SGLang's API key or admin API key
(``rl_jax.generator.auth``: 401/403 otherwise; ``/health`` stays open).

Differences from SGLang worth knowing: the engine stops on token ids only, so ``stop`` strings
are applied to the finished completion (decoding continues until a stop token or
``max_new_tokens``); ``stream: true`` sends one event per finished completion rather than
incremental text; ``/update_weights_from_disk`` swaps weights in flight instead of waiting for
running requests to finish.

This module holds the application (routes, ``/generate``, the control and information
endpoints, serving); its settings are :mod:`~rl_jax.generator.server.config`'s, loading the
checkpoint into an engine :mod:`~rl_jax.generator.server.setup`'s, the weight-update
endpoints :mod:`~rl_jax.generator.server.weight_endpoints`', compiling before serving
:mod:`~rl_jax.generator.server.warmup`'s, the aiohttp plumbing (bounded bodies, JSON errors, the
error
middleware) :mod:`~rl_jax.generator.server.httpio`'s; ``python -m rl_jax.generator.server.serve``
runs it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import signal
import sys
import threading
import time
from typing import Any

from aiohttp import web

import rl_jax
from rl_jax.cpus import thread_cpu_seconds
from rl_jax.generator import auth
from rl_jax.generator.engine.core import PAUSE_MODES, Engine
from rl_jax.generator.json_body import ProtocolError, parse_json_body
from rl_jax.generator.protocol import ParsedGenerate, parse_generate
from rl_jax.generator.responses import apply_stop_strings, error_json, output_json
from rl_jax.generator.server.config import ServerConfig, text_limit
from rl_jax.generator.server.distributed_endpoints import DistributedWeightEndpoints
from rl_jax.generator.server.httpio import (EngineStopped, NonFiniteAnswer, ProtocolLog,
                                            all_results, dumps, error_response, errors_middleware,
                                            exit_with_parent, json_response, read_body, sse_event)
from rl_jax.generator.server.setup import build_engine
from rl_jax.generator.server.warmup import compile_engine
from rl_jax.generator.server.weight_endpoints import WeightUpdateEndpoints
from rl_jax.generator.types import GenerateRequest, GeneratorError, Overloaded, SamplingParams
from rl_jax.heap import GcMonitor, freeze_long_lived
from rl_jax.models.config import eos_ids

log = logging.getLogger("rl_jax.generator.server")  # one logger for the server's modules

MAX_BODY_BYTES = 512 << 20
# /generate requests up to this size (bytes), answers up to this many tokens, are handled on the
# event loop; bigger ones in worker threads.
INLINE_BYTES = 16 << 10
INLINE_TOKENS = 4096


# ---- the server ---------------------------------------------------------------------------------

class GeneratorServer(WeightUpdateEndpoints):
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
        self._pullers: dict[str, Any] = {}  # publisher URL -> rl_jax.transfer.puller.generator.GeneratorPuller
        self.distributed = DistributedWeightEndpoints(self)  # SGLang's broadcast protocol
        self.gc = GcMonitor().install()
        self.max_text_chars = config.max_text_chars or text_limit(tokenizer, config.max_seq_len)

    @classmethod
    def from_config(cls, config: ServerConfig) -> "GeneratorServer":
        """Checks ``config``, loads its checkpoint into a new engine
        (:func:`~rl_jax.generator.server.setup.build_engine`), then pulls the first weights and
        compiles as ``config`` asks."""
        built = build_engine(config, Engine)
        server = cls(built.engine, built.config, tokenizer=built.tokenizer, mesh=built.mesh,
                     rules=built.rules, dtype=built.dtype)
        if built.config.publisher_url and built.config.pull_on_start:
            server.pull_initial_weights()
        if built.config.warmup:
            server.warmup()
        return server

    def warmup(self):
        """Compiles the engine's programs before serving (:func:`warmup.compile_engine`)."""
        compile_engine(self.engine, self.config.max_seq_len, self.config.max_slots,
                       all_shapes=self.config.warmup_shapes)

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
                       else await all_results(submitted))
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
        if not parsed.as_list:
            return dumps(answers[0]).encode()
        # One answer at a time: the C encoder holds the GIL for a whole call, and one call over
        # thousands of answers would stall the event loop (health probes) for its full length.
        return b"[" + b", ".join(dumps(a).encode() for a in answers) + b"]"

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
                    await sse_event(response, error_json(str(e), "internal_error", 500))
                    continue
                chunks = await asyncio.to_thread(
                    lambda: [self._answer(parsed, i, out) for out in outs])
                for j, chunk in enumerate(chunks):
                    if parsed.as_list:
                        chunk["index"] = offsets[i] + j
                    try:
                        await sse_event(response, chunk)
                    except NonFiniteAnswer as e:  # in-band too: nothing of it was written
                        log.error("%s", e)
                        await sse_event(response, error_json(str(e), "internal_error", 500))

    # ---- control --------------------------------------------------------------------------------

    async def health(self, request):
        if not self.alive():
            return error_response("the engine's scheduler is not running", "unavailable", 503)
        return json_response({"status": "ok", "weight_version": self.engine.version,
                               "paused": self.engine.paused})

    async def health_generate(self, request):
        """Generates one token unless the engine is paused or already busy (then its scheduler
        being alive is enough, as in SGLang)."""
        if not self.alive():
            return error_response("the engine's scheduler is not running", "unavailable", 503)
        load = self.engine.load()
        if self.engine.paused or load["running"] or load["waiting"]:
            return await self.health(request)
        probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0,
                                                    ignore_eos=True))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(probe)), 20)
        except (asyncio.TimeoutError, Overloaded, GeneratorError) as e:
            return error_response(f"health generation failed: {e!r}", "unavailable", 503)
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
        return json_response(self._model_info())

    async def server_info(self, request):
        c = self.config
        load = self.engine.load()
        cache = self.engine.cache_usage()
        return json_response({
            **self._model_info(), "host": c.host, "port": request.url.port or c.port,
            "tp_size": c.tensor_parallel, "dp_size": c.data_parallel, "dtype": c.dtype,
            "num_continuous_decode_steps": c.decode_steps,
            "attention_backend": self.engine.attention_backend,
            "prefill_attention_backend": self.engine.prefill_attention_backend,
            "max_running_requests": c.max_slots, "context_length": c.max_seq_len,
            "max_total_num_tokens": cache["pages"] * cache["page_size"], "page_size":
            cache["page_size"], "kv_cache_bytes": cache["bytes"],
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
        return json_response({"load": load["running"] + load["waiting"], **load})

    async def weight_version(self, request):
        return json_response({"weight_version": self.engine.version})

    async def models(self, request):
        return json_response({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(self.started),
            "owned_by": "rl_jax", "root": self.model_path,
            "max_model_len": self.config.max_seq_len}]})

    async def flush_cache(self, request):
        self._require_alive()
        if await asyncio.to_thread(self.engine.flush_cache):
            return json_response({"success": True, "message": "Cache flushed."})
        return json_response({"success": False, "message": "Cache not flushed: sequences are "
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
        return json_response({"success": True})

    async def pause_generation(self, request):
        self._require_alive()
        body = await self._json_body(request, optional=True)
        mode = "abort" if body.get("mode") is None else body["mode"]
        if not isinstance(mode, str) or mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r:.60}")
        await asyncio.to_thread(self.engine.pause, mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok",
                               "mode": mode})

    async def continue_generation(self, request):
        self._require_alive()
        await self._json_body(request, optional=True)
        await asyncio.to_thread(self.engine.resume)
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ---- app ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        @web.middleware
        async def count(request, handler):
            self.http_requests[request.path] += 1
            return await handler(request)

        middlewares = [count, errors_middleware]
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
                               self.update_weights_from_transfer),
                              *self.distributed.routes()):
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
                               keepalive_timeout=self.config.keepalive_timeout_s,
                               logger=ProtocolLog())
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"rl_jax generator server ready at http://{self.config.host}:{port} "
              f"(model {self.model_path}, weight version {self.engine.version}, "
              f"max_slots {self.config.max_slots}, max_seq_len {self.config.max_seq_len})",
              flush=True)
        watchdog = (asyncio.create_task(exit_with_parent(self.config.parent_pid, stop))
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
