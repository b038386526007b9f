"""Native code compiled on first use: the C and C++ kernels of this package.

A kernel's source ships with the package and is compiled, the first time a process needs it,
by this machine's compiler (``$CC``/``$CXX``, else ``cc``/``gcc`` or ``g++``/``c++``) for this
CPU (``-march=native``). The built library is cached under ``$RL_JAX_KERNEL_CACHE`` (default
``~/.cache/rl_jax/kernels``), keyed by the source, the flags, the compiler's version, the CPU's
feature flags and whatever else the caller names (e.g. the jaxlib whose headers it includes), so
processes share it and a change of any of them builds anew. Concurrent builds of the same
library take turns on a file lock; a library appears whole or not at all. Callers keep a
fallback for machines without a compiler.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path


def compiler(language: str = "c++") -> str | None:
    """The path of the C (``language="c"``) or C++ compiler to use, or None."""
    names = (os.environ.get("CC"), "cc", "gcc") if language == "c" else \
        (os.environ.get("CXX"), "g++", "c++")
    for name in names:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_signature() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("RL_JAX_KERNEL_CACHE",
                               Path.home() / ".cache" / "rl_jax" / "kernels"))


def build(source: Path, name: str, compiler_path: str, flags: Sequence[str], *,
          include_dirs: Sequence[str] = (), key_parts: Sequence[str] = ()) -> Path:
    """The shared library built from ``source`` (compiled now unless a matching one is
    cached), named ``{name}-{key}.so``. Raises RuntimeError with the compiler's output when
    the build fails."""
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), " ".join(flags).encode(), "".join(version).encode(),
        cpu_signature().encode(), *(p.encode() for p in key_parts)])).hexdigest()[:20]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}-{key}.so"
    if library.exists():
        return library
    with open(directory / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same one
        if library.exists():
            return library
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler_path, *flags, *(f"-I{d}" for d in include_dirs), str(source),
                   "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(partial, library)  # whole or not at all, for the processes waiting
    return library
