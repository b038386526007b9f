"""SGLang's ``/generate`` requests, shared by the server and the client.

The server turns a JSON body (SGLang's ``GenerateReqInput``) into engine requests with
:func:`parse_generate`; the client builds bodies with :func:`request_json`, for this project's
servers and real SGLang servers alike. Both ends of every request field are here, so they change
together and can be read side by side.

Every field of SGLang's request and sampling parameters is recognised. A field is either
honoured, ignored (it cannot change what this engine computes: routing hints, metadata,
disaggregation, logging), or *unsupported*: accepted at its default value and refused with a 400
naming it otherwise, because silently ignoring it would return samples from another distribution
than the one asked for (penalties, grammars, logit bias, LoRA, images, input log-probs). A server
started with ``strict=False`` ignores unsupported values instead (logged once per field).
Unknown top-level fields are ignored, as SGLang does; unknown sampling fields are refused.

Beside it: :mod:`rl_jax.generator.json_body` (:func:`parse_json_body`, the
bounds every request body meets before its fields are read, and :class:`ProtocolError`) and
:mod:`rl_jax.generator.responses` (:func:`output_json`, the server's answer, and
:func:`outputs_from_json`, the client's reading of it; stop strings).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

from rl_jax.generator.json_body import INT64, ProtocolError
from rl_jax.generator.responses import PromptItem
from rl_jax.generator.types import GenerateRequest, GeneratorError, SamplingParams

log = logging.getLogger(__name__)

# SGLang treats temperatures below this as greedy.
GREEDY_TEMPERATURE = 1e-6
# The engine's per-slot sampling state holds top_k as int32.
INT32_MAX = (1 << 31) - 1
# Largest finite float32: a temperature above it would become infinite on the device.
FLOAT32_MAX = 3.4028234663852886e38


def _is_default(value: Any) -> bool:
    return value is None or value is False or value == 0 or value in ("", [], {}) or (
        isinstance(value, list) and all(v is None or v in ([], [None]) for v in value))


# ---- request fields -----------------------------------------------------------------------------

# Honoured: parsed below.
HONOURED_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream"})

# No effect on what this engine computes; accepted with any value.
IGNORED_FIELDS = frozenset({
    "session_id", "log_metrics", "modalities", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "kv_router_hint", "routing_key",
    "conversation_id", "http_worker_ipc", "background", "priority", "extra_key", "cache_salt",
    "no_logs", "custom_labels", "return_bytes", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned",
    "encoder_urls", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "routed_experts_start_len", "batch",
    "multi_item_delimiter_indices", "require_reasoning", "is_single", "batch_size",
    "parallel_sample_num"})

# Served only at their default value (None / False / 0 / empty).
UNSUPPORTED_FIELDS = {
    "input_embeds": "input embeddings",
    "image_data": "image inputs (text-only model)",
    "video_data": "video inputs (text-only model)",
    "audio_data": "audio inputs (text-only model)",
    "lora_path": "LoRA adapters",
    "lora_id": "LoRA adapters",
    "custom_logit_processor": "custom logit processors",
    "positional_embed_overrides": "embedding overrides",
    "session_params": "sessions",
    "token_ids_logprob": "log-probs of chosen token ids",
    "return_hidden_states": "hidden states",
    "return_routed_experts": "routed experts",
    "return_indexer_topk": "indexer top-k",
    "return_entropy": "entropies",
    "return_sampling_mask": "sampling masks",
    "return_flat_raw_top_logprobs": "top log-probs",
    "return_flat_raw_top_logprobs_b64": "top log-probs",
    "max_thinking_tokens": "thinking budgets",
}

# ---- sampling fields ----------------------------------------------------------------------------

HONOURED_SAMPLING = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
    "n", "sampling_seed", "seed", "stop", "skip_special_tokens", "no_stop_trim"})
IGNORED_SAMPLING = frozenset({
    "spaces_between_special_tokens", "stream_interval", "custom_params", "dtype",
    "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"})
# Sampling controls that change the distribution, with the value that means "off".
UNSUPPORTED_SAMPLING = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "logit_bias": None, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "stop_regex": None, "beam_width": 1}
KNOWN_SAMPLING = HONOURED_SAMPLING | IGNORED_SAMPLING | set(UNSUPPORTED_SAMPLING)


@dataclasses.dataclass
class ParsedGenerate:
    items: list[PromptItem]
    as_list: bool  # SGLang answers a batch, or n > 1, with a list (prompt-major)
    stream: bool = False
    return_text_in_logprobs: bool = False


_warned: set[str] = set()


def _unsupported(name: str, what: str, value: Any, strict: bool):
    if strict:
        raise ProtocolError(f"{name}={value!r} is not supported by this server ({what}); "
                            f"leave it unset or at its default")
    if name not in _warned:
        _warned.add(name)
        log.warning("ignoring unsupported %s=%r (%s)", name, value, what)


def _int(value: Any, name: str, minimum: int | None = None, maximum: int = INT32_MAX) -> int:
    """An integer field within ``[minimum, maximum]`` (int32 unless said otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {value!r:.60}")
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ProtocolError(f"{name} must be <= {maximum}, got {value!r:.60}")
    return value


def _float(value: Any, name: str, maximum: float = FLOAT32_MAX) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or abs(value) > maximum):
        raise ProtocolError(f"{name} must be a finite number (|x| <= {maximum:.4g}), got "
                            f"{value!r:.60}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name} must be true or false, got {value!r}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ProtocolError(f"{name} must be a non-empty list of token ids")
    if not all(type(t) is int for t in value):  # not bool, not float
        bad = next(t for t in value if type(t) is not int)
        raise ProtocolError(f"{name} must contain integer token ids, got {bad!r:.40}")
    if vocab_size is not None:
        if 0 <= min(value) and max(value) < vocab_size:
            return value
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                                f"{bad[:5]}")
    return value


def parse_sampling(raw: Any, *, prompt_len: int, max_seq_len: int | None, strict: bool = True,
                   vocab_size: int | None = None, max_sequences: int = INT32_MAX
                   ) -> tuple[SamplingParams, dict[str, Any]]:
    """SGLang ``sampling_params`` → (:class:`SamplingParams`, text options).

    ``null`` values mean "default", as in SGLang; ``max_new_tokens: null`` means "up to the
    engine's ``max_seq_len``". Text options are ``stop`` strings, ``no_stop_trim`` and
    ``skip_special_tokens``. Integers are bounded by what the engine stores them in (int32;
    seeds int64), ``n`` by ``max_sequences``.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProtocolError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_SAMPLING)
    if unknown:
        raise ProtocolError(f"unknown sampling_params field(s) {unknown}; SGLang's fields are "
                            f"e.g. max_new_tokens, temperature, top_p, top_k, min_p, "
                            f"stop_token_ids, ignore_eos, n, sampling_seed")
    for name, off in UNSUPPORTED_SAMPLING.items():
        value = raw.get(name)
        if value is not None and value != off and not _is_default(value):
            _unsupported(f"sampling_params.{name}", "this engine samples from the plain "
                         "temperature/top-k/top-p/min-p distribution", value, strict)
    kw: dict[str, Any] = {}
    value = raw.get("max_new_tokens", 128)
    if value is None:
        if max_seq_len is None:
            raise ProtocolError("max_new_tokens must be given")
        value = max(max_seq_len - prompt_len, 0)
    kw["max_new_tokens"] = _int(value, "max_new_tokens", 0)
    for name in ("temperature", "top_p", "min_p"):
        if raw.get(name) is not None:
            kw[name] = _float(raw[name], name)
    if kw.get("temperature", 1.0) < 0:
        raise ProtocolError(f"temperature must be >= 0, got {kw['temperature']}")
    if kw.get("temperature", 1.0) < GREEDY_TEMPERATURE:
        kw["temperature"] = 0.0
    if raw.get("top_k") is not None:
        kw["top_k"] = _int(raw["top_k"], "top_k", -1)
    if raw.get("n") is not None:
        kw["n"] = _int(raw["n"], "n", 1, maximum=max_sequences)
    if raw.get("ignore_eos") is not None:
        kw["ignore_eos"] = _bool(raw["ignore_eos"], "ignore_eos")
    stops = raw.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list):
            raise ProtocolError(f"stop_token_ids must be a list of token ids, got {stops!r:.80}")
        if stops:
            kw["stop_token_ids"] = tuple(_token_ids(stops, "stop_token_ids", vocab_size))
    seed = raw.get("sampling_seed", raw.get("seed"))
    if seed is not None:
        kw["seed"] = _int(seed, "sampling_seed", INT64[0], INT64[1])
    text = {"stop": (), "no_stop_trim": False, "skip_special_tokens": True}
    stop = raw.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError(f"stop must be a string or a list of strings, got {stop!r:.80}")
        text["stop"] = tuple(s for s in stop if s)
    for name in ("no_stop_trim", "skip_special_tokens"):
        if raw.get(name) is not None:
            text[name] = _bool(raw[name], name)
    try:
        return SamplingParams(**kw), text
    except GeneratorError as e:
        raise ProtocolError(str(e)) from e


def _per_prompt(value: Any, name: str, count: int, batch: bool) -> list[Any]:
    """A field given once for all prompts or as one value per prompt."""
    if batch and isinstance(value, list):
        if len(value) != count:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {count} prompts")
        return value
    return [value] * count


def _sample_count(sampling: Any, count: int, batch: bool, max_sequences: int) -> int:
    """Sequences a request asks for (``n`` summed over its prompts), read before any prompt is
    tokenised; refuses more than ``max_sequences`` whatever ``max_new_tokens`` is."""
    per_prompt = _per_prompt(sampling, "sampling_params", count, batch)
    total = 0
    for i, raw in enumerate(per_prompt):
        n = raw.get("n") if isinstance(raw, dict) else None
        total += 1 if n is None else _int(n, "sampling_params.n", 1, maximum=max_sequences)
    if total > max_sequences:
        raise ProtocolError(f"n x prompts = {total} sequences exceeds this server's queue limit "
                            f"of {max_sequences}")
    return total


def parse_generate(body: Any, *, tokenize: Callable[[str], list[int]] | None,
                   vocab_size: int | None = None, max_seq_len: int | None = None,
                   strict: bool = True, max_sequences: int = INT32_MAX,
                   max_text_chars: int | None = None) -> ParsedGenerate:
    """Validates SGLang's ``GenerateReqInput`` JSON and splits it into per-prompt requests.

    Bounds come first, before anything is tokenised: the number of sequences (``n`` x prompts,
    at most ``max_sequences``) and each text's length (at most ``max_text_chars`` characters).
    Raises :class:`ProtocolError` (HTTP 400) naming the first problem found.
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, what in UNSUPPORTED_FIELDS.items():
        if not _is_default(body.get(name)):
            _unsupported(name, what, body[name], strict)
    unknown = sorted(set(body) - HONOURED_FIELDS - IGNORED_FIELDS - set(UNSUPPORTED_FIELDS))
    if unknown:
        log.debug("ignoring unknown /generate fields %s", unknown[:20])

    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise ProtocolError("give either text or input_ids, not both")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids or a list of "
                                "such lists")
        batch = isinstance(ids[0], list)
        _sample_count(body.get("sampling_params"), len(ids) if batch else 1, batch,
                      max_sequences)
        prompts = [_token_ids(p, f"input_ids[{i}]" if batch else "input_ids", vocab_size)
                   for i, p in enumerate(ids if batch else [ids])]
        texts: list[str | None] = [None] * len(prompts)
    elif text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if batch and not texts:
            raise ProtocolError("text is an empty list")
        if not all(isinstance(t, str) for t in texts):
            raise ProtocolError("text must be a string or a list of strings")
        _sample_count(body.get("sampling_params"), len(texts), batch, max_sequences)
        if max_text_chars is not None:
            for i, t in enumerate(texts):
                if len(t) > max_text_chars:
                    raise ProtocolError(
                        f"{f'text[{i}]' if batch else 'text'} has {len(t)} characters; this "
                        f"server tokenises at most {max_text_chars} (more could not fit its "
                        f"max_seq_len)")
        if tokenize is None:
            raise ProtocolError("this server has no tokenizer (tokenizer.json); send input_ids")
        prompts = []
        for i, t in enumerate(texts):
            try:
                prompts.append(tokenize(t))
            except Exception as e:  # tokenizers raise bare exceptions for untokenizable text
                raise ProtocolError(f"cannot tokenize text[{i}]: {e}") from e
            if not prompts[-1]:
                raise ProtocolError(f"text[{i}] tokenizes to no tokens" if batch else
                                    "text tokenizes to no tokens")
            _token_ids(prompts[-1], "tokenized text", vocab_size)
    else:
        raise ProtocolError("the request needs text or input_ids")

    count = len(prompts)
    sampling = _per_prompt(body.get("sampling_params"), "sampling_params", count, batch)
    rids = body.get("rid")
    if rids is None or isinstance(rids, str):
        base = rids
        rids = ([base] if not batch else [f"{base}_{i}" for i in range(count)]) if base else \
            [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(rids, list) and batch:
        if len(rids) != count or not all(isinstance(r, str) for r in rids):
            raise ProtocolError(f"rid must be a string or a list of {count} strings")
        if len(set(rids)) != len(rids):
            seen: set[str] = set()
            dups = [r for r in rids if r in seen or seen.add(r)]
            raise ProtocolError(f"rid has duplicates: {dups[:5]}")
    else:
        raise ProtocolError(f"rid must be a string (or a list of strings for a batch), "
                            f"got {rids!r}")
    logprob = _per_prompt(body.get("return_logprob"), "return_logprob", count, batch)
    start = _per_prompt(body.get("logprob_start_len"), "logprob_start_len", count, batch)
    top = _per_prompt(body.get("top_logprobs_num"), "top_logprobs_num", count, batch)
    stream, in_text = (False if body.get(name) is None else _bool(body[name], name)
                       for name in ("stream", "return_text_in_logprobs"))

    items = []
    for i, prompt in enumerate(prompts):
        params, text_opts = parse_sampling(sampling[i], prompt_len=len(prompt),
                                           max_seq_len=max_seq_len, strict=strict,
                                           vocab_size=vocab_size, max_sequences=max_sequences)
        want_lp = False if logprob[i] is None else _bool(logprob[i], "return_logprob")
        if start[i] is not None:
            s = _int(start[i], "logprob_start_len", -1)
            if want_lp and 0 <= s < len(prompt):
                _unsupported("logprob_start_len", "input-token log-probs; -1 returns output "
                             "log-probs only", s, strict)
        if top[i] is not None and _int(top[i], "top_logprobs_num", 0) > 0:
            _unsupported("top_logprobs_num", "top log-probs per position", top[i], strict)
        items.append(PromptItem(
            request=GenerateRequest(input_ids=list(prompt), sampling=params, rid=rids[i],
                                    return_logprob=want_lp),
            return_logprob=want_lp, stop_strings=text_opts["stop"],
            no_stop_trim=text_opts["no_stop_trim"],
            skip_special_tokens=text_opts["skip_special_tokens"]))
        if text_opts["stop"] and tokenize is None:
            raise ProtocolError("stop strings need a tokenizer; this server has none "
                                "(use stop_token_ids)")
    as_list = batch or any(it.request.sampling.n > 1 for it in items)
    return ParsedGenerate(items=items, as_list=as_list, stream=stream,
                          return_text_in_logprobs=in_text)


# ---- client side --------------------------------------------------------------------------------

def request_json(request: GenerateRequest, *, return_logprob: bool = True) -> dict[str, Any]:
    """The ``/generate`` body for one :class:`GenerateRequest` (SGLang field names)."""
    sp = request.sampling
    sampling: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
        "top_k": sp.top_k, "min_p": sp.min_p, "ignore_eos": sp.ignore_eos, "n": sp.n}
    if sp.stop_token_ids:
        sampling["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        sampling["sampling_seed"] = sp.seed
    body: dict[str, Any] = {"input_ids": list(request.input_ids), "sampling_params": sampling,
                            "return_logprob": return_logprob}
    if request.rid is not None:
        body["rid"] = request.rid
    return body
