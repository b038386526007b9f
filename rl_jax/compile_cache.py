"""JAX's persistent compilation cache, shared by a run's processes and by later runs.

Every process of a run (the trainer, each generator server) compiles the same programs as the
previous run of the same recipe: with the cache, a second run loads them instead of compiling
(on a CPU core a generator server's warm-up is most of a tiny run's start). The cache holds
executable code, so its directory must be trusted: it is created private to the user (0700)
and refused when another user owns it or can write to it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rl_jax.errors import UserError


class CacheDirError(UserError, ValueError):
    """A compilation cache directory that cannot be used safely."""


def default_dir() -> str:
    """``$XDG_CACHE_HOME/rl_jax/xla`` (``~/.cache/rl_jax/xla`` without the variable)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rl_jax", "xla")


def resolve(setting: str) -> str:
    """A recipe's ``compilation_cache_dir``: ``""`` (off), ``"auto"`` (:func:`default_dir`) or a
    path; returns the absolute directory, created private to this user, or ``""``."""
    if not setting:
        return ""
    path = Path(default_dir() if setting == "auto" else setting).expanduser().absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise CacheDirError(f"compilation cache {path} belongs to uid {info.st_uid}, not to "
                            f"this user ({os.getuid()}): its programs would run here")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(f"compilation cache {path} is writable by other users "
                            f"(mode {stat.filemode(info.st_mode)}): chmod go-w it or pick another")
    return str(path)


def environment(path: str) -> dict[str, str]:
    """Environment variables that give a JAX process started with them the cache at ``path``
    (every program cached, however fast it compiled); empty when ``path`` is empty."""
    if not path:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": path,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def enable(path: str) -> None:
    """Turns the cache on in this process (before its first compilation); no-op for ``""``."""
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
