"""Reward environments behind one async interface (see :mod:`rl_jax.envs.base`).

Built in, by name (``rl_jax.envs.get(name, **kwargs)``):

=================  ==================================================================
``arithmetic``     multi-digit addition (:class:`rl_jax.envs.arithmetic.ArithmeticEnv`)
``scratchpad``     long addition with written work (:class:`rl_jax.envs.scratchpad.ScratchpadEnv`)
``countdown``      reach a target with + − × ÷ (:class:`rl_jax.envs.countdown.CountdownEnv`)
``sorting``        sort a list of integers (:class:`rl_jax.envs.sorting.SortingEnv`)
``math``           final-answer checking (:class:`rl_jax.envs.math.MathEnv`)
``code``           programs run against tests in a sandbox (:class:`rl_jax.envs.code.CodeEnv`)
``long_addition``  long numbers, plainly (:class:`rl_jax.envs.long_addition.LongAdditionEnv`)
``tool_use``       a task over tool-calling turns (:class:`rl_jax.envs.tool_use.ToolUseEnv`)
``delayed``        a task whose scoring stalls on request (:class:`rl_jax.envs.delayed.DelayedEnv`)
=================  ==================================================================

Modules are imported when their environment is first requested, so asking for ``arithmetic``
does not import sympy. :func:`register` adds user environments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rl_jax.envs.base import EnvError, Environment

_BUILTIN = {
    "arithmetic": "rl_jax.envs.arithmetic:ArithmeticEnv",
    "scratchpad": "rl_jax.envs.scratchpad:ScratchpadEnv",
    "countdown": "rl_jax.envs.countdown:CountdownEnv",
    "sorting": "rl_jax.envs.sorting:SortingEnv",
    "math": "rl_jax.envs.math:MathEnv",
    "code": "rl_jax.envs.code:CodeEnv",
    "long_addition": "rl_jax.envs.long_addition:LongAdditionEnv",
    "tool_use": "rl_jax.envs.tool_use:ToolUseEnv",
    "delayed": "rl_jax.envs.delayed:DelayedEnv",
}
_REGISTRY: dict[str, str | Callable[..., Environment]] = dict(_BUILTIN)


def register(name: str, factory: Callable[..., Environment], *, overwrite: bool = False) -> None:
    """Makes ``get(name, **kwargs)`` return ``factory(**kwargs)``."""
    if name in _REGISTRY and not overwrite:
        raise EnvError(f"environment {name!r} is already registered; pass overwrite=True")
    _REGISTRY[name] = factory


def names() -> list[str]:
    """Registered environment names."""
    return sorted(_REGISTRY)


def get(name: str, **kwargs) -> Environment:
    """A new environment ``name`` configured by ``kwargs``.

    Raises:
      EnvError: for an unknown name.
    """
    if name not in _REGISTRY:
        raise EnvError(f"unknown environment {name!r}; registered: {', '.join(names())}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    if isinstance(kwargs.get("task"), str):  # a wrapper (tool_use, delayed): its task by name
        kwargs = dict(kwargs)
        task = kwargs.pop("task")
        kwargs["task"] = get(task, **dict(kwargs.pop("task_kwargs", None) or {}))
    return factory(**kwargs)


