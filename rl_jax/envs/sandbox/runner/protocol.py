"""The test protocol's codec and the program's side of it (untrusted; stdlib only).

This whole file is the ``-c`` source of the program's process when a run has tests (the runner
appends ``_serve_program(path)``), so it imports nothing beyond ``marshal``, ``os``, ``sys`` and
``_json``. The program's process starts here. Requests come from the trusted harness
(:mod:`harness`) as length-prefixed marshal data; answers go back as JSON lines (written without
the json module, whose import of re would add to every run's start-up), which the harness parses
without evaluating anything. The harness uses the same codec (:func:`_encode`, :func:`_decode`).
"""

import marshal
import os
import sys

try:
    from _json import encode_basestring_ascii as _json_string
except ImportError:  # an interpreter without the C accelerator
    from json import dumps as _json_string

_MAX_DEPTH = 100
_ERROR_CHARS = 1000
_PROGRAM_FDS = (3, 4)  # the program's ends: requests in, answers out
_SMALL_INT = 2**53


def _encode(value, ref_of, depth=0):
    """JSON-ready form of ``value``: plain data by value, anything else through
    ``ref_of(value)`` as ``["r", handle, type name]``.

    Plain data is what the builtin types hold: an instance of a subclass (``Counter``, a
    namedtuple, ``numpy.float64``, an ``int`` with its own ``__eq__``) crosses as the builtin
    value it holds, and so does ``range``; an object with ``__index__`` (``numpy.int64``) as its
    integer. Whatever these conversions run, they run here: the other side receives only data.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        value = int.__index__(value)
        return value if -_SMALL_INT < value < _SMALL_INT else ["i", hex(value)]
    if isinstance(value, float):
        return ["f", float.hex(value)]
    if isinstance(value, complex):
        return ["c", float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]
    if isinstance(value, (bytes, bytearray)):
        return ["b", bytes(value).hex()]
    if isinstance(value, dict):
        return ["d", [[_encode(k, ref_of, depth + 1), _encode(v, ref_of, depth + 1)]
                      for k, v in dict.items(value)]]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z")):
        if isinstance(value, base):
            return [tag, [_encode(item, ref_of, depth + 1) for item in base.__iter__(value)]]
    if isinstance(value, range):
        return ["g", [_encode(x, ref_of, depth + 1) for x in (value.start, value.stop,
                                                              value.step)]]
    if hasattr(type(value), "__index__"):
        return _encode(type(value).__index__(value), ref_of, depth + 1)
    return ["r", ref_of(value), type(value).__name__[:100]]


def _decode(data, from_ref, depth=0):
    """The value :func:`_encode` made; ``from_ref(handle, type name)`` stands for a reference.

    Raises:
      ValueError: for anything :func:`_encode` cannot have produced.
    """
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) in (bool, str, int):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"malformed value {str(data)[:100]!r}")
    tag, rest = data[0], data[1:]
    if tag in ("i", "f", "b") and len(rest) == 1 and type(rest[0]) is str:
        return {"i": lambda h: int(h, 16), "f": float.fromhex, "b": bytes.fromhex}[tag](rest[0])
    if tag == "c" and len(rest) == 2 and all(type(x) is str for x in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "r" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
        return from_ref(rest[0], rest[1])
    if len(rest) == 1 and type(rest[0]) is list:
        items = rest[0]
        if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
            return {_decode(k, from_ref, depth + 1): _decode(v, from_ref, depth + 1)
                    for k, v in items}
        if tag == "g" and len(items) == 3:
            return range(*(_decode(x, from_ref, depth + 1) for x in items))
        make = {"l": list, "t": tuple, "s": set, "z": frozenset}.get(tag)
        if make is not None:
            return make(_decode(item, from_ref, depth + 1) for item in items)
    raise ValueError(f"malformed value {str(data)[:100]!r}")


def _json_text(value):
    """JSON text of an answer: dicts, lists, strings, small ints, booleans and None."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return _json_string(value)
    if type(value) is dict:
        return "{" + ",".join(f"{_json_string(k)}:{_json_text(v)}"
                              for k, v in value.items()) + "}"
    return "[" + ",".join(map(_json_text, value)) + "]"


def _read_request(requests):
    """The next request from the harness, or None at its end."""
    size = requests.read(4)
    if len(size) < 4:
        return None
    return marshal.loads(requests.read(int.from_bytes(size, "little")))


def _serve_program(path):
    """The program's process: runs the program as ``__main__``, then answers the harness.

    Runs under the program's own interpreter, uid and limits; nothing here is trusted.
    """
    import types
    requests = os.fdopen(_PROGRAM_FDS[0], "rb")
    answers = os.fdopen(_PROGRAM_FDS[1], "wb")
    module = types.ModuleType("__main__")
    module.__file__ = path
    sys.modules["__main__"] = module
    sys.argv = [path]
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)
    refs = []

    def ref_of(value):
        refs.append(value)
        return len(refs) - 1

    def from_ref(handle, _):
        return refs[handle]

    while (request := _read_request(requests)) is not None:
        try:
            op = request["op"]
            if op == "get":
                if request["name"] not in module.__dict__:
                    answers.write(b'{"missing": true}\n')
                    answers.flush()
                    continue
                value = module.__dict__[request["name"]]
            else:
                target = refs[request["ref"]]
                if op == "call":
                    value = target(*_decode(request["args"], from_ref),
                                   **_decode(request["kwargs"], from_ref))
                elif op == "getattr":
                    value = getattr(target, request["name"])
                else:
                    value = target[_decode(request["key"], from_ref)]
            answer = {"value": _encode(value, ref_of)}
        except BaseException as e:  # noqa: BLE001 - the harness decides what a failure means
            answer = {"error": [type(e).__name__, str(e)[:_ERROR_CHARS]]}
        answers.write(_json_text(answer).encode() + b"\n")
        answers.flush()
