"""The trusted test harness: runs test sources against the program's process (stdlib only).

Forked from the runner under a uid of its own, never in the program's process. The program runs
as usual, then serves the harness's requests (look up a global, call it, get an attribute or
item) over two pipes (:mod:`protocol`); plain data (numbers, strings, bytes, ranges and
containers of them; instances of subclasses as the builtin values they hold) crosses by value,
and every other object (generators included) stays in the program as an opaque handle
(:class:`_Remote`) that the tests may call but not compare, iterate, hash or convert. Names the
tests use resolve to builtins first, then to the program's globals. The harness alone holds the
pipe on which it reports which tests ran and passed.
"""

import builtins
import json
import marshal
import os

from confinement import _confine
from protocol import _ERROR_CHARS, _decode, _encode

_MESSAGE_BYTES = 16 * 2**20
# Exceptions of the program that tests may catch by their builtin type.
_PASSED_EXCEPTIONS = tuple(
    value for value in vars(builtins).values()
    if isinstance(value, type) and issubclass(value, Exception)
    and not issubclass(value, (StopIteration, StopAsyncIteration)))


def _harness_child(job, requests_fd, answers_fd, report_w):
    """In the forked harness: confine (its own uid, no files), run the tests, report. Never
    returns."""
    try:
        keep = {requests_fd, answers_fd, report_w}
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for name in os.listdir("/proc/self/fd"):
            if int(name) > 2 and int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
        os.chdir("/")
        _confine(job, job.get("harness_uid"), 1, 1)
        report = {"results": _run_tests(job["tests"], requests_fd, answers_fd)}
    except BaseException as e:  # noqa: BLE001 - the runner reports a set-up failure
        report = {"setup_error": f"{type(e).__name__}: {e}"[:1000]}
    try:
        data = memoryview(json.dumps(report).encode())
        while data:
            data = data[os.write(report_w, data):]
    finally:
        os._exit(0)


class ProgramExited(Exception):
    """The program's process ended (or broke the protocol) before answering."""


class ProgramError(Exception):
    """The program raised an exception that is not a builtin ``Exception`` type."""


class _Remote:
    """An object that stays in the program: it can be called, and its attributes and items read;
    comparing, hashing or converting it is refused, since the program would decide the result."""

    __slots__ = ("_client", "_handle", "_type")

    def __init__(self, client, handle, type_name):
        self._client, self._handle, self._type = client, handle, type_name

    def __call__(self, *args, **kwargs):
        return self._client.request({"op": "call", "ref": self._handle,
                                     "args": self._client.encode(list(args)),
                                     "kwargs": self._client.encode(dict(kwargs))})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._client.request({"op": "getattr", "ref": self._handle, "name": name})

    def __getitem__(self, key):
        return self._client.request({"op": "getitem", "ref": self._handle,
                                     "key": self._client.encode(key)})

    def __repr__(self):
        return f"<{self._type} object of the program>"

    def _refuse(self, *args):
        raise TypeError(f"the test compared or converted a {self._type} object of the program; "
                        "tests see plain data (numbers, strings, bytes, lists, tuples, sets, "
                        "dicts) returned by the program, not its own objects")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = __iter__ = _refuse
    __contains__ = __hash__ = __int__ = __float__ = __index__ = _refuse


class _Client:
    """The harness's end of the two pipes to the program."""

    def __init__(self, requests_fd, answers_fd):
        self._out = os.fdopen(requests_fd, "wb")
        self._in = os.fdopen(answers_fd, "rb")

    def encode(self, value):
        def ref_of(obj):
            if isinstance(obj, _Remote):
                return obj._handle
            raise TypeError(f"a test passed a {type(obj).__name__} to the program; only plain "
                            "data and the program's own objects can be passed")
        return _encode(value, ref_of)

    def request(self, message):
        try:
            data = marshal.dumps(message)
            self._out.write(len(data).to_bytes(4, "little") + data)
            self._out.flush()
        except OSError as e:
            raise ProgramExited(f"the program exited before answering ({e.strerror})") from None
        line = self._in.readline(_MESSAGE_BYTES + 1)
        if not line.endswith(b"\n"):
            raise ProgramExited("the program exited before answering" if len(line) <= _MESSAGE_BYTES
                                else f"the program's answer exceeded {_MESSAGE_BYTES} bytes")
        try:
            answer = json.loads(line)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
            if answer.get("missing") is True and message["op"] == "get":
                error = KeyError(message["name"])
            elif "error" in answer:
                name, text = (str(x)[:_ERROR_CHARS] for x in answer["error"])
                error = self._exception(name, text)
            else:
                return _decode(answer["value"], lambda h, t: _Remote(self, h, t))
        except (ValueError, TypeError, RecursionError, IndexError, KeyError) as e:
            raise ProgramExited(f"the program broke the test protocol: {e!r}"[:_ERROR_CHARS]) \
                from None
        raise error

    @staticmethod
    def _exception(name, text):
        for kind in _PASSED_EXCEPTIONS:
            if kind.__name__ == name:
                try:
                    return kind(text)
                except Exception:  # noqa: BLE001 - a type that needs other arguments
                    break
        return ProgramError(f"{name}: {text}")


class _TestGlobals(dict):
    """A test's globals: its own names, then builtins, then the program's globals."""

    def __init__(self, client):
        super().__init__(__name__="__test__", __builtins__=builtins)
        self._client = client
        self._builtins = builtins

    def __missing__(self, name):
        if hasattr(self._builtins, name):
            raise KeyError(name)
        value = self._client.request({"op": "get", "name": name})
        self[name] = value
        return value


def _describe_failure(error, source):
    """``"AssertionError at line 2: assert solve(3, 4) == 7"`` for an exception from a test."""
    line = None
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<test>":
            line = frame.tb_lineno
        frame = frame.tb_next
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if line is not None:
        lines = source.splitlines()
        code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        text += f" (test line {line}: {code})"
    return text[:_ERROR_CHARS]


def _run_tests(tests, requests_fd, answers_fd):
    """The harness: runs each test source against the program; returns one result per test."""
    client = _Client(requests_fd, answers_fd)
    results = []
    for source in tests:
        try:
            exec(compile(source, "<test>", "exec"), _TestGlobals(client))
        except ProgramExited as e:
            results.append({"passed": False, "kind": "program_exited",
                            "error": _describe_failure(e, source)})
        except AssertionError as e:
            results.append({"passed": False, "kind": "assertion",
                            "error": _describe_failure(e, source)})
        except BaseException as e:  # noqa: BLE001 - any other failure of a test
            results.append({"passed": False, "kind": "error",
                            "error": _describe_failure(e, source)})
        else:
            results.append({"passed": True})
    return results
