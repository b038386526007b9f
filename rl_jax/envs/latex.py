"""Math answers in LaTeX-ish text → sympy objects, without ``eval``.

LaTeX commands, braces and ``^`` are rewritten into Python-ish text (:func:`latex_to_python`),
tokenized with implicit multiplication made explicit (``2x`` → ``2*x``, ``\\sin x`` →
``sin(x)``), parsed with :mod:`ast`, and the tree is walked with a whitelist to build sympy
objects: integer literals (decimals become exact rationals), single-letter variables,
``pi e i oo``, ``+ - * / **``, a few functions (sqrt, root, trigonometric, log, exp, abs) and
tuples. Sizes are bounded (characters, tree nodes, integer digits, exponents) so that no answer
can make sympy compute a huge number.
"""

from __future__ import annotations

import ast
import re

import sympy

_MAX_ANSWER_CHARS = 400
_MAX_NODES = 300
_MAX_INT_DIGITS = 100
_MAX_EXPONENT = 1000
_MAX_LIST = 8


class ParseError(ValueError):
    """An answer outside the supported syntax."""


# Commands whose argument is kept as plain text.
TEXT_COMMANDS = ("text", "textbf", "textit", "mbox", "mathrm", "mathbf", "operatorname")
# Function names (LaTeX or plain) → sympy function names; constant names → sympy constants.
FUNCTIONS = {"sqrt": "sqrt", "root": "root", "sin": "sin", "cos": "cos", "tan": "tan",
              "sec": "sec", "csc": "csc", "cot": "cot", "arcsin": "asin", "arccos": "acos",
              "arctan": "atan", "asin": "asin", "acos": "acos", "atan": "atan", "sinh": "sinh",
              "cosh": "cosh", "tanh": "tanh", "log": "log", "ln": "log", "exp": "exp",
              "abs": "Abs"}
CONSTANTS = {"pi": "pi", "infty": "oo", "infinity": "oo", "inf": "oo", "oo": "oo"}
_LATEX_OPS = {"cdot": "*", "times": "*", "ast": "*", "div": "/"}
_LATEX_IGNORED = {"left", "right", "displaystyle", "quad", "qquad", "limits"}


def _read_arg(s: str, i: int) -> tuple[str, int]:
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ParseError("a LaTeX command is missing its argument")
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1:j], j + 1
        raise ParseError("unbalanced braces")
    if s[i] == "\\":
        j = i + 1
        while j < len(s) and s[j].isalpha():
            j += 1
        return s[i:j], j
    return s[i], i + 1


def latex_to_python(s: str) -> str:
    """Rewrites LaTeX commands, braces and ``^`` into Python-ish expression text."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            j = i + 1
            while j < len(s) and s[j].isalpha():
                j += 1
            cmd = s[i + 1:j]
            if not cmd:
                escaped = s[j] if j < len(s) else ""
                out.append({"{": "(", "}": ")"}.get(escaped, " "))
                i = j + 1
                continue
            i = j
            if cmd == "frac":
                num, i = _read_arg(s, i)
                den, i = _read_arg(s, i)
                out.append(f"(({latex_to_python(num)})/({latex_to_python(den)}))")
            elif cmd == "sqrt":
                index = None
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise ParseError("unbalanced [ in \\sqrt")
                    index, i = s[i + 1:close], close + 1
                arg, i = _read_arg(s, i)
                arg = latex_to_python(arg)
                out.append(f" sqrt({arg}) " if index is None else
                           f" root({arg},{latex_to_python(index)}) ")
            elif cmd in _LATEX_OPS:
                out.append(_LATEX_OPS[cmd])
            elif cmd in FUNCTIONS or cmd in CONSTANTS:
                out.append(f" {cmd} ")
            elif cmd in TEXT_COMMANDS:
                arg, i = _read_arg(s, i)
                out.append(f" {latex_to_python(arg)} ")
            elif cmd in _LATEX_IGNORED:
                continue
            else:
                raise ParseError(f"unsupported LaTeX command \\{cmd}")
            continue
        out.append({"{": "(", "}": ")", "^": "**"}.get(c, c))
        i += 1
    return "".join(out)


_TOKEN_RE = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|([A-Za-z]+)|(\*\*|[-+*/(),\[\]]))")


def _tokens(text: str) -> list[tuple[str, str]]:
    """``(kind, text)`` tokens; kinds: num, name, func, op. Multi-letter unknown names split."""
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise ParseError(f"unexpected character {text[pos:].strip()[:1]!r}")
        pos = m.end()
        num, name, op = m.groups()
        if num is not None:
            if "." in num:
                whole, frac = num.split(".")
                num = f"({int(whole or '0') * 10**len(frac) + int(frac or '0')}/{10**len(frac)})"
            out.append(("num", num))
        elif op is not None:
            out.append(("op", op))
        elif name in FUNCTIONS:
            out.append(("func", FUNCTIONS[name]))
        elif name in CONSTANTS:
            out.append(("name", CONSTANTS[name]))
        else:
            out.extend(("name", {"e": "E", "i": "I"}.get(ch, ch)) for ch in name)
    return out


def _python_source(tokens: list[tuple[str, str]]) -> str:
    """Joins tokens, inserting implicit multiplication and parens for ``sin x``-style calls."""
    out, pending_close = [], []
    prev = None
    for k, (kind, text) in enumerate(tokens):
        atom_start = kind in ("num", "name", "func") or text in ("(", "[")
        after_atom = prev is not None and (prev[0] in ("num", "name") or prev[1] in (")", "]"))
        if atom_start and after_atom:
            if prev[0] == "num" and kind == "num":
                raise ParseError("two numbers in a row")
            out.append("*")
        out.append(text)
        if kind == "func" and (k + 1 == len(tokens) or tokens[k + 1][1] != "("):
            out.append("(")
            pending_close.append(True)
            prev = ("op", "(")
            continue
        if pending_close and kind in ("num", "name"):
            out.append(")")
            pending_close.pop()
            kind, text = "op", ")"
        prev = (kind, text)
    if pending_close:
        raise ParseError("a function is missing its argument")
    return " ".join(out)


_SYMPY_FUNCS = {"sqrt": sympy.sqrt, "root": sympy.root, "sin": sympy.sin, "cos": sympy.cos,
                "tan": sympy.tan, "sec": sympy.sec, "csc": sympy.csc, "cot": sympy.cot,
                "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan, "sinh": sympy.sinh,
                "cosh": sympy.cosh, "tanh": sympy.tanh, "log": sympy.log, "exp": sympy.exp,
                "Abs": sympy.Abs}
_SYMPY_CONSTS = {"pi": sympy.pi, "oo": sympy.oo, "E": sympy.E, "I": sympy.I}


class _Builder:
    def __init__(self):
        self.nodes = 0

    def build(self, node: ast.AST):
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise ParseError(f"expression has more than {_MAX_NODES} nodes")
        if isinstance(node, ast.Expression):
            return self.build(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if len(str(node.value)) > _MAX_INT_DIGITS:
                raise ParseError(f"integer with more than {_MAX_INT_DIGITS} digits")
            return sympy.Integer(node.value)
        if isinstance(node, ast.Name):
            if node.id in _SYMPY_CONSTS:
                return _SYMPY_CONSTS[node.id]
            if len(node.id) == 1 and node.id.isalpha():
                return sympy.Symbol(node.id)
            raise ParseError(f"unknown name {node.id!r}")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.build(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            a, b = self.build(node.left), self.build(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                return a / b
            if isinstance(node.op, ast.Pow):
                _check_power(a, b)
                return a ** b
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _SYMPY_FUNCS and not node.keywords
                and len(node.args) == (2 if node.func.id == "root" else 1)):
            args = [self.build(a) for a in node.args]
            if node.func.id == "root":
                _check_power(args[0], 1 / args[1] if args[1] != 0 else sympy.zoo)
            return _SYMPY_FUNCS[node.func.id](*args)
        if isinstance(node, (ast.Tuple, ast.List)):
            if len(node.elts) > _MAX_LIST:
                raise ParseError(f"list of more than {_MAX_LIST} items")
            return tuple(self.build(e) for e in node.elts)
        raise ParseError(f"unsupported syntax {type(node).__name__}")


def _check_power(base, exponent) -> None:
    if isinstance(base, tuple) or isinstance(exponent, tuple):
        raise ParseError("power of a list")
    if exponent.is_number:
        magnitude = abs(complex(sympy.N(exponent, 15))) if exponent.is_finite else float("inf")
        if magnitude > _MAX_EXPONENT:
            raise ParseError(f"exponent above {_MAX_EXPONENT}")
        if base.is_number and base.is_finite:
            digits = float(sympy.log(abs(base) + 2, 10).evalf(15)) * magnitude
            if digits > 10 * _MAX_INT_DIGITS:
                raise ParseError("power too large")


def parse_math(text: str):
    """A sympy expression (or a tuple of them) for a normalized answer.

    Raises:
      ParseError: for anything outside the supported syntax or size bounds.
    """
    if len(text) > _MAX_ANSWER_CHARS:
        raise ParseError(f"answer longer than {_MAX_ANSWER_CHARS} characters")
    source = _python_source(_tokens(latex_to_python(text)))
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise ParseError(f"syntax error: {e.msg}") from None
    try:
        return _Builder().build(tree)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        if isinstance(e, ParseError):
            raise
        raise ParseError(f"cannot build expression: {e}") from None
