"""SGLang's ``/generate`` answers: written by the server (:func:`output_json`), read by the
client (:func:`outputs_from_json`), side by side so that both ends of a field change together.

The engine stops on token ids only, so ``stop`` strings are applied to the finished completion
(:func:`apply_stop_strings`) and trimmed from its text (:func:`output_text`), as each prompt's
:class:`PromptItem` asks. Errors are JSON ``{"error": {"message", "type", "code"}}``
(:func:`error_json`). The requests are :mod:`rl_jax.generator.protocol`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from rl_jax.generator.types import GenerateOutput, GenerateRequest, GeneratorError


@dataclasses.dataclass
class PromptItem:
    """One prompt of a ``/generate`` call, ready for the engine, and how to answer it
    (``protocol.parse_generate`` makes them)."""

    request: GenerateRequest
    return_logprob: bool = False
    stop_strings: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True


def apply_stop_strings(out: GenerateOutput, stops: Sequence[str],
                       decode: Callable[[list[int]], str]) -> GenerateOutput:
    """Cuts ``out`` after the first token whose text completes one of ``stops`` (the engine stops
    on token ids only, so stop strings are applied to the finished completion)."""
    if not stops or not out.output_ids:
        return out
    ids = out.output_ids

    def hit(k):
        text = decode(ids[:k])
        return min(((text.find(s), s) for s in stops if s in text), default=None)

    if hit(len(ids)) is None:
        return out
    lo, hi = 1, len(ids)  # smallest prefix whose text contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    _, matched = hit(lo)
    return dataclasses.replace(
        out, output_ids=ids[:lo], output_logprobs=out.output_logprobs[:lo],
        output_unfiltered_logprobs=None if out.output_unfiltered_logprobs is None
        else out.output_unfiltered_logprobs[:lo],
        output_versions=out.output_versions[:lo],
        finish_reason={"type": "stop", "matched": matched})


def output_text(out: GenerateOutput, item: PromptItem,
                decode: Callable[[list[int], bool], str]) -> str:
    """The completion's text, trimmed of what matched a stop condition unless ``no_stop_trim``
    (as SGLang's detokenizer does)."""
    ids = out.output_ids
    matched = out.finish_reason.get("matched")
    if not item.no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = decode(ids, item.skip_special_tokens)
    if not item.no_stop_trim and isinstance(matched, str) and matched in text:
        text = text[:text.find(matched)]
    return text


def output_json(out: GenerateOutput, item: PromptItem, *, weight_version: int,
                decode: Callable[[list[int], bool], str] | None = None,
                token_text: Callable[[int], str] | None = None,
                return_text_in_logprobs: bool = False) -> dict[str, Any]:
    """One completion as SGLang returns it, with ``meta_info.weight_version`` (the version that
    produced the last token) and ``meta_info.weight_versions`` (SGLang's spans of tokens per
    version, :func:`version_spans`), plus ``meta_info.output_token_weight_versions`` (one per
    token) and,
    when top-k/top-p/min-p filtered the sampling, ``meta_info.output_token_unfiltered_logprobs``
    (``output_token_logprobs`` are under the filtered distribution the tokens were drawn
    from)."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": out.e2e_latency,
        "weight_version": out.output_versions[-1] if out.output_versions else weight_version,
        "weight_versions": version_spans(out.output_versions),
        "output_token_weight_versions": list(out.output_versions),
    }
    if item.return_logprob:
        name = token_text if return_text_in_logprobs and token_text else (lambda _: None)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [
            [lp, tok, name(tok)] for lp, tok in zip(out.output_logprobs, out.output_ids)]
        if out.output_unfiltered_logprobs is not None:
            meta["output_token_unfiltered_logprobs"] = list(out.output_unfiltered_logprobs)
    result: dict[str, Any] = {}
    if decode is not None:
        result["text"] = output_text(out, item, decode)
    result["output_ids"] = list(out.output_ids)
    result["meta_info"] = meta
    return result


def error_json(message: str, kind: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def version_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's ``meta_info.weight_versions``: ``[{"version", "start",
    "end"}]``, one span per run of tokens produced by one version (``end`` exclusive, versions
    as strings)."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


# ---- client side --------------------------------------------------------------------------------

def _version(value: Any) -> int:
    """SGLang reports weight versions as strings ("default" before any update)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _span_versions(spans: Any, n_tokens: int) -> list[int]:
    """Per-token versions from SGLang's ``meta_info.weight_versions`` spans, which must cover
    ``0 .. n_tokens`` in order without gaps or overlaps (anything else is refused: a wrong version
    would be a wrong staleness and a wrong importance weight)."""
    if not isinstance(spans, list) or (not spans and n_tokens):
        raise GeneratorError(f"meta_info.weight_versions must be a list of spans, got "
                             f"{spans!r:.200}")
    versions: list[int] = []
    for span in spans:
        try:
            start, end, version = int(span["start"]), int(span["end"]), span["version"]
        except (KeyError, TypeError, ValueError):
            raise GeneratorError(f"malformed weight version span {span!r:.120}") from None
        if start != len(versions) or end < start or end > n_tokens:
            raise GeneratorError(f"weight version spans {spans!r:.300} do not cover the "
                                 f"{n_tokens} output tokens in order")
        versions += [_version(version)] * (end - start)
    if len(versions) != n_tokens:
        raise GeneratorError(f"weight version spans {spans!r:.300} cover {len(versions)} of "
                             f"{n_tokens} output tokens")
    return versions


# A sampled token's log-probability is at most 0; a server's float rounding may add a little.
MAX_LOGPROB = 1e-3


def outputs_from_json(data: Any, request: GenerateRequest,
                      vocab_size: int | None = None) -> list[GenerateOutput]:
    """A ``/generate`` answer for one request (a dict, or a list of ``n``) → its outputs.

    Each token's weight version comes from ``meta_info.output_token_weight_versions`` (this
    project's servers), else from SGLang's ``meta_info.weight_versions`` spans, else from
    ``meta_info.weight_version`` for every token (a server that reports no spans); -1 where a
    version is not an integer.
    """
    items = data if isinstance(data, list) else [data]
    if len(items) != request.sampling.n:
        raise GeneratorError(f"expected {request.sampling.n} completions, got {len(items)}")
    outputs = []
    for item in items:
        try:
            meta = item["meta_info"]
            ids = [int(t) for t in item["output_ids"]]
        except (KeyError, TypeError, ValueError) as e:
            raise GeneratorError(f"malformed /generate answer ({e}): {item!r:.200}") from e
        triples = meta.get("output_token_logprobs") or []
        if len(triples) != len(ids):
            raise GeneratorError(f"server returned {len(triples)} log-probs for {len(ids)} "
                                 f"tokens (was return_logprob set?)")
        try:
            differ = any(int(t[1]) != tok for t, tok in zip(triples, ids))
        except (TypeError, ValueError, IndexError):
            raise GeneratorError("output_token_logprobs holds an entry that is not "
                                 "[log-prob, token id, ...]") from None
        if differ:
            raise GeneratorError("output_token_logprobs token ids differ from output_ids")
        limit = vocab_size or 2**31
        if any(not 0 <= t < limit for t in ids):
            raise GeneratorError(f"output_ids outside the vocabulary [0, {limit}): "
                                 f"{[t for t in ids if not 0 <= t < limit][:5]}")
        try:
            logprobs = [float(t[0]) for t in triples]
        except (TypeError, ValueError, IndexError):
            raise GeneratorError("output_token_logprobs holds an entry that is not "
                                 "[log-prob, token id, ...]") from None
        if not all(-math.inf < lp <= MAX_LOGPROB for lp in logprobs):
            raise GeneratorError("output_token_logprobs holds a value that is not a log-"
                                 f"probability: {[x for x in logprobs if not x <= 0][:5]}")
        versions = meta.get("output_token_weight_versions")
        if versions is None and meta.get("weight_versions") is not None:
            versions = _span_versions(meta["weight_versions"], len(ids))
        if versions is None:
            versions = [_version(meta.get("weight_version"))] * len(ids)
        if not isinstance(versions, list) or len(versions) != len(ids):
            raise GeneratorError(f"server returned weight versions {versions!r:.120} for "
                                 f"{len(ids)} tokens")
        unfiltered = meta.get("output_token_unfiltered_logprobs")
        if unfiltered is not None:
            if not isinstance(unfiltered, list) or len(unfiltered) != len(ids):
                raise GeneratorError("output_token_unfiltered_logprobs must be a list of one "
                                     f"log-prob per output token ({len(ids)})")
            try:
                unfiltered = [float(x) for x in unfiltered]
            except (TypeError, ValueError):
                raise GeneratorError("output_token_unfiltered_logprobs holds a value that is "
                                     "not a number") from None
        outputs.append(GenerateOutput(
            rid=str(meta.get("id", request.rid)), input_ids=list(request.input_ids),
            output_ids=ids, output_logprobs=logprobs,
            output_unfiltered_logprobs=unfiltered,
            output_versions=[_version(v) for v in versions],
            finish_reason=meta.get("finish_reason") or {"type": "unknown"},
            cached_tokens=int(meta.get("cached_tokens") or 0),
            e2e_latency=float(meta.get("e2e_latency") or 0.0)))
    return outputs
