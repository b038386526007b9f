"""Tools a policy calls during an episode, behind one interface (:mod:`rl_jax.envs.tools.base`),
by name (``rl_jax.envs.tools.get(name, **kwargs)``):

==============  ===================================================================
``calculator``  one arithmetic expression, exact integers (:class:`.calculator.Calculator`)
``python``      a Python program in the sandbox (:class:`.python.PythonInterpreter`)
==============  ===================================================================

Calls are written in the Hermes format Qwen2.5 / Qwen3 use and parsed by
:mod:`rl_jax.envs.tools.calls`; :mod:`rl_jax.envs.tool_use` runs them in episodes.
:func:`register` adds user tools.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rl_jax.envs.base import EnvError
from rl_jax.envs.tools.base import Tool

_BUILTIN = {
    "calculator": "rl_jax.envs.tools.calculator:Calculator",
    "python": "rl_jax.envs.tools.python:PythonInterpreter",
}
_REGISTRY: dict[str, str | Callable[..., Tool]] = dict(_BUILTIN)


def register(name: str, factory: Callable[..., Tool], *, overwrite: bool = False) -> None:
    """Makes ``get(name, **kwargs)`` return ``factory(**kwargs)`` (a :class:`Tool` whose
    ``name`` is ``name``)."""
    if name in _REGISTRY and not overwrite:
        raise EnvError(f"tool {name!r} is already registered; pass overwrite=True")
    _REGISTRY[name] = factory


def names() -> list[str]:
    """Registered tool names."""
    return sorted(_REGISTRY)


def get(name: str, **kwargs) -> Tool:
    """A new tool ``name`` configured by ``kwargs``.

    Raises:
      EnvError: for an unknown name, or a factory whose tool has another name.
    """
    if name not in _REGISTRY:
        raise EnvError(f"unknown tool {name!r}; registered: {', '.join(names())}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    tool = factory(**kwargs)
    if not isinstance(tool, Tool) or tool.name != name:
        raise EnvError(f"the factory registered as tool {name!r} made "
                       f"{getattr(tool, 'name', type(tool).__name__)!r}")
    return tool
