"""A calculator: one arithmetic expression in, its value out, exactly for integers.

The expression is parsed with :mod:`ast` and evaluated by walking the tree (no ``eval``): numbers,
``+ - * / // % **``, unary signs, parentheses and a few functions (``abs``, ``min``, ``max``,
``round``, ``sqrt``). Work is bounded before it is done: the expression's length and nesting,
the exponent of ``**`` and the digits of every intermediate result, so that ``9**9**9`` is an
error, not a hung episode.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rl_jax.envs.tools.base import Tool, ToolError

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 2000  # of any intermediate integer
MAX_DEPTH = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "min": min, "max": max, "round": round, "sqrt": math.sqrt}


class CalculationError(ValueError):
    """The expression is not one this calculator evaluates (the message says why)."""


def _digits(value: int) -> int:
    return max(1, math.ceil(abs(value).bit_length() * 0.30103)) if value else 1


def _check(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculationError(f"not a number: {value!r}")
    if isinstance(value, int) and _digits(value) > MAX_DIGITS:
        raise CalculationError(f"a result has more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("a result is not finite")
    return value


def _pow(base, exponent):
    if isinstance(exponent, int) and isinstance(base, int) and exponent > 0:
        if abs(base) > 1 and _digits(base) * exponent > MAX_DIGITS + _digits(base):
            raise CalculationError(f"the power has more than {MAX_DIGITS} digits")
    elif abs(exponent) > 10000:
        raise CalculationError("the exponent is too large")
    return base ** exponent


def _eval(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CalculationError("the expression is nested too deeply")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        try:
            value = _pow(left, right) if isinstance(node.op, ast.Pow) else \
                _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("a result is too large") from None
        if isinstance(value, complex):
            raise CalculationError("a result is not a real number")
        return _check(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in _FUNCTIONS and not node.keywords and 1 <= len(node.args) <= 8:
        args = [_eval(a, depth + 1) for a in node.args]
        try:
            return _check(_FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise CalculationError(f"{node.func.id}: {e}") from None
    raise CalculationError(f"unsupported syntax: {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (integers exactly, floats as Python prints them)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculationError(f"not an expression: {getattr(e, 'msg', e)}") from None
    return str(_eval(tree))


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluates one arithmetic expression (+, -, *, /, //, %, **, parentheses, abs, "
                   "min, max, round, sqrt) and returns its value; integers are exact.")
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "minLength": 1,
                                                "maxLength": MAX_EXPRESSION_CHARS}},
                  "required": ["expression"], "additionalProperties": False}

    async def run(self, arguments: dict[str, Any], session: dict[str, Any]) -> str:
        try:
            return calculate(arguments["expression"])
        except CalculationError as e:
            raise ToolError(str(e)) from None
