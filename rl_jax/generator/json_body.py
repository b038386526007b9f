"""The bounds every request body meets before its fields are read (:func:`parse_json_body`).

A body must be a JSON object nested at most :data:`MAX_JSON_DEPTH` levels, holding no ``NaN``,
``Infinity`` or number that overflows, and no integer outside int64; a body that breaks one gets
a :class:`ProtocolError` (HTTP 400) naming the field, whatever endpoint it was sent to. What each
field may hold is :mod:`rl_jax.generator.protocol`'s.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rl_jax.generator.types import GeneratorError

# Request bodies nest at most this deep (SGLang's deepest field, a per-prompt list of sampling
# params with their stop-token lists, is 4 levels down).
MAX_JSON_DEPTH = 32
# Integers anywhere in a request body lie in int64; fields check their own, narrower ranges.
INT64 = (-(1 << 63), (1 << 63) - 1)


class ProtocolError(GeneratorError):
    """A malformed or unservable request (HTTP 400)."""


class _HugeInt:
    """An integer literal too long for Python's int conversion (over 4300 digits), kept as a
    marker so that the field holding it can be named."""

    def __init__(self, digits: str):
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _field(path: tuple) -> str:
    """``("sampling_params", 0, "top_k")`` → ``sampling_params[0].top_k``."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "the request body"


def _check_json_values(value: Any, max_depth: int):
    """Refuses nesting deeper than ``max_depth``, non-finite numbers (``NaN``, ``Infinity``,
    ``1e999``) and integers outside int64 anywhere in a parsed body, naming the field.
    Iterative (a stack), so a deep body cannot exhaust Python's recursion."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            items = node.items()
        elif isinstance(node, list):
            if all(type(x) is int for x in node):  # token ids: the common, large case
                if node and (min(node) < INT64[0] or max(node) > INT64[1]):
                    i = next(i for i, x in enumerate(node) if not INT64[0] <= x <= INT64[1])
                    raise ProtocolError(f"{_field(path + (i,))} is an integer outside int64")
                continue
            items = enumerate(node)
        else:
            items = ()
        if items and depth > max_depth:
            raise ProtocolError(f"{_field(path)} nests deeper than {max_depth} levels")
        for key, x in items:
            if isinstance(x, (dict, list)):
                stack.append((x, path + (key,), depth + 1))
            elif isinstance(x, float) and not math.isfinite(x):
                raise ProtocolError(f"{_field(path + (key,))} is not a finite number ({x!r})")
            elif isinstance(x, _HugeInt) or (type(x) is int and not INT64[0] <= x <= INT64[1]):
                raise ProtocolError(f"{_field(path + (key,))} is an integer outside int64 "
                                    f"({x!r:.40})")


def parse_json_body(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body → its JSON object, refusing (:class:`ProtocolError`, naming the field)
    invalid JSON, non-objects, nesting deeper than ``max_depth``, ``NaN``/``Infinity`` and
    numbers that overflow, and integers outside int64 (including literals of thousands of
    digits, which Python's ``int`` would refuse with a bare ``ValueError``)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError(f"the request body nests deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # an integer literal beyond Python's digit limit: find its field
        body = json.loads(raw, parse_int=lambda s: int(s) if len(s) <= 40 else _HugeInt(s))
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_json_values(body, max_depth)
    return body
