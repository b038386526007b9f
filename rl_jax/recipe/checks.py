"""Reading a recipe into its typed schema, checked once (see :mod:`rl_jax.recipe`): unknown
fields, wrong types, each field's range, relations between fields and registered names; and
the recipe files' own helpers (loading one, applying ``key=value`` overrides)."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_jax.recipe.schema import (GROUP_ADVANTAGES, Auth, RLConfigError, RLRecipe, to_dict)


def load_recipe_file(path: str | Path):
    """``get_config()`` of a recipe file (another recipe deriving from it, or the planner)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()

def parse(config: Any, *, registries: bool = True) -> RLRecipe:
    """The typed recipe of ``config`` (a ConfigDict, a mapping or an :class:`RLRecipe`),
    checked once: raises :class:`RLConfigError` naming the first bad field."""
    if isinstance(config, RLRecipe):
        recipe = config
    else:
        recipe = _build(RLRecipe, _plain(config), "")
    _check_relations(recipe)
    if registries:
        _check_registries(recipe)
    return recipe


def replace_fields(recipe: RLRecipe, changes: Mapping[str, Any]) -> RLRecipe:
    """A copy of ``recipe`` with fields changed by dotted name (``{"cpus.trainer": ""}``),
    checked again (not against the registries)."""
    tree = to_dict(recipe)
    for name, value in changes.items():
        *sections, leaf = name.split(".")
        node = tree
        for s in sections:
            node = node[s]
        if leaf not in node:
            raise RLConfigError(f"unknown recipe field {name!r}")
        node[leaf] = value
    return parse(tree, registries=False)


def _plain(node: Any) -> Any:
    if hasattr(node, "to_dict"):
        return node.to_dict()
    return node


def _build(cls: type, values: Any, prefix: str) -> Any:
    if not isinstance(values, Mapping):
        raise RLConfigError(f"{prefix.rstrip('.') or 'the recipe'} must be a section "
                            f"(mapping), got {values!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = prefix.rstrip(".") or "the recipe"
        hint = ("; keys come from files or the environment (RL_JAX_API_KEY, "
                "RL_JAX_ADMIN_API_KEY), never from the config" if cls is Auth else "")
        raise RLConfigError(f"{where} has unknown settings {unknown} (known: "
                            f"{sorted(names)}){hint}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        name, hint, value = prefix + f.name, hints[f.name], values[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, _plain(value), name + ".")
            continue
        try:
            value = _coerce(name, hint, _plain(value))
        except RLConfigError:
            if not f.metadata.get("kind"):
                raise
            raise RLConfigError(f"{name} must be {f.metadata['kind']}, got {value!r}") from None
        check = f.metadata.get("check")
        complaint = check(value) if check is not None else None
        if complaint:
            raise RLConfigError(f"{name} {complaint}")
        kwargs[f.name] = value
    return cls(**kwargs)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """``value`` as the field's type (lists become tuples, integers floats), or an error
    naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _coerce(name, option, value)
            except RLConfigError:
                pass
        raise RLConfigError(f"{name} must be {' or '.join(_word(a) for a in args)}, "
                            f"got {value!r}")
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise RLConfigError(f"{name} must be a tuple, got {value!r}")
        element = args[0]
        return tuple(_coerce(f"{name}[{i}]", element, v) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise RLConfigError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is Any:
        return value
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise RLConfigError(f"{name} must be {_word(hint)}, got {value!r}")
    return value


def _word(hint: Any) -> str:
    if typing.get_origin(hint) is dict:
        return "a mapping"
    if typing.get_origin(hint) is tuple:
        return "a tuple"
    return _TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def _check_relations(r: RLRecipe) -> None:
    """Checks between fields (each field's own range is checked as it is read)."""
    ro, t, g = r.rollout, r.trainer, r.generator
    if ro.lengths.sigma and (ro.lengths.median <= 0 or ro.lengths.max < 1):
        raise RLConfigError("rollout.lengths needs sigma >= 0 and, when sigma > 0, median > 0 "
                            f"and max >= 1; got {to_dict(ro.lengths)}")
    if ro.advantage in GROUP_ADVANTAGES and ro.group_size < 2:
        raise RLConfigError(f"rollout.advantage={ro.advantage!r} compares samples of one prompt: "
                            f"rollout.group_size must be >= 2, got {ro.group_size}")
    if t.micro_batch_rows and t.num_microbatches != 1:
        raise RLConfigError("trainer.micro_batch_rows (fixed-shape micro-batches) and "
                            "trainer.num_microbatches > 1 exclude each other; set one")
    if t.micro_batch_rows and ro.rows_per_batch % t.micro_batch_rows:
        raise RLConfigError(f"rollout.rows_per_batch={ro.rows_per_batch} is not divisible by "
                            f"trainer.micro_batch_rows={t.micro_batch_rows}")
    least = 0 if g.router_url else 1  # a router's workers may be all the servers
    if not g.urls and (isinstance(g.num_servers, bool) or g.num_servers < least):
        raise RLConfigError(f"generator.num_servers must be an integer >= {least}, got "
                            f"{g.num_servers!r}")
    if g.sglang_weights == "sidecar" and (g.kind != "sglang" or g.urls or g.router_url
                                          or not g.num_servers):
        raise RLConfigError(
            "generator.sglang_weights='sidecar' starts a weight sidecar beside each SGLang "
            "server this run starts: it needs generator.kind='sglang', generator.num_servers "
            ">= 1 and no generator.urls or router_url (servers started elsewhere need their "
            "sidecars started there: python -m rl_jax.transfer.sglang.sidecar)")
    if g.max_slots % g.data_parallel:
        raise RLConfigError(f"generator.max_slots={g.max_slots} does not split evenly over "
                            f"generator.data_parallel={g.data_parallel} replicas")
    if not 0 <= r.distributed.process_id < r.distributed.num_processes:
        raise RLConfigError(f"distributed.process_id={r.distributed.process_id} is outside "
                            f"[0, distributed.num_processes={r.distributed.num_processes})")


def _check_registries(r: RLRecipe) -> None:
    """Names that must be registered somewhere (imports those packages)."""
    from rl_jax import envs
    from rl_jax.generator.launcher.pool import LaunchError, check_nice
    from rl_jax.losses import make_config, names
    from rl_jax.losses.advantages import ADVANTAGE_ESTIMATORS
    from rl_jax.losses.configs import LossConfigError
    from rl_jax.models.config import DTYPES
    from rl_jax.trainer.state import SCHEDULE_CLOCKS
    from rl_jax.transfer import transports

    for name in ("model.dtype", "model.param_dtype", "export.dtype"):
        section, field = name.split(".")
        value = getattr(getattr(r, section), field)
        if value not in DTYPES:
            raise RLConfigError(f"{name}: unknown dtype {value!r}; use one of {sorted(DTYPES)}")
    if r.optimizer.schedule_on not in SCHEDULE_CLOCKS:
        raise RLConfigError(f"optimizer.schedule_on must be one of {SCHEDULE_CLOCKS}, got "
                            f"{r.optimizer.schedule_on!r}")
    try:
        check_nice(r.cpus.generators_nice, "cpus.generators_nice")
    except LaunchError as e:
        raise RLConfigError(str(e)) from None
    if r.loss.name not in names():
        raise RLConfigError(f"loss.name must be one of {names()}, got {r.loss.name!r}")
    try:
        make_config(r.loss.name, **r.loss.options)
    except (LossConfigError, TypeError) as e:
        raise RLConfigError(f"loss.options: {e}") from None
    if r.rollout.advantage not in ADVANTAGE_ESTIMATORS:
        raise RLConfigError(f"rollout.advantage must be one of "
                            f"{sorted(ADVANTAGE_ESTIMATORS)}, got {r.rollout.advantage!r}")
    if r.env.name not in envs.names():
        raise RLConfigError(f"env.name must be one of {envs.names()}, got {r.env.name!r}")
    known = transports.names()
    if not r.transfer.transports or any(t not in known for t in r.transfer.transports):
        raise RLConfigError(f"transfer.transports must name one or more of {list(known)}, got "
                            f"{list(r.transfer.transports)!r}")
    if r.transfer.transport != "auto" and r.transfer.transport not in known:
        raise RLConfigError(f"transfer.transport must be 'auto' or one of {list(known)}, got "
                            f"{r.transfer.transport!r}")
    if r.transfer.transport not in ("auto", *r.transfer.transports):
        raise RLConfigError(f"transfer.transport={r.transfer.transport!r} is not offered: the "
                            f"publisher prepares transfer.transports="
                            f"{list(r.transfer.transports)}")


def apply_overrides(config: Any, overrides: tuple[str, ...] | list[str], *, what: str) -> None:
    """Sets ``"a.b=value"`` overrides on a ConfigDict the way absl's ``--config.a.b=value``
    does (the value parsed as the field's type); ``what`` names the setting they come from."""
    import ast
    for item in overrides:
        key, sep, text = str(item).partition("=")
        *sections, leaf = key.split(".")
        node = config
        try:
            for s in sections:
                node = node[s]
            current = node[leaf]
        except (KeyError, AttributeError, TypeError):
            raise RLConfigError(f"{what}: {key!r} is not a field of the recipe") from None
        if not sep:
            raise RLConfigError(f"{what}: {item!r} is not of the form key=value")
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise RLConfigError(f"{what}: {key} must be true or false, got {text!r}")
            value: Any = text.lower() in ("true", "1")
        elif isinstance(current, str):
            value = text
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise RLConfigError(f"{what}: {key}={text!r} is not a "
                                    f"{type(current).__name__}") from None
            if isinstance(current, float) and isinstance(value, int):
                value = float(value)
        try:
            node[leaf] = value
        except TypeError as e:
            raise RLConfigError(f"{what}: {key}: {e}") from None
