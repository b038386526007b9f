"""JAX's persistent compilation cache: a second process loads what the first compiled; the
cache directory must be private to the user."""

import json
import os
import subprocess
import sys

import pytest

from rl_jax import compile_cache

PROGRAM = r"""
import logging, json, sys
import jax, jax.numpy as jnp
hits = []
class Hits(logging.Handler):
    def emit(self, record):
        if "cache hit" in record.getMessage().lower():
            hits.append(record.getMessage())
for name in ("jax._src.compiler", "jax._src.compilation_cache", "jax._src.dispatch"):
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Hits())
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
print(json.dumps({"value": float(f(jnp.ones((8, 8)))), "hits": len(hits)}))
"""


def _run(env):
    out = subprocess.run([sys.executable, "-c", PROGRAM], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    path = compile_cache.resolve(str(tmp_path / "xla"))
    env = compile_cache.environment(path)
    first = _run(env)
    entries = sorted(os.listdir(path))
    assert entries and first["hits"] == 0
    second = _run(env)
    assert second["value"] == first["value"] and second["hits"] >= 1
    assert compile_cache.environment("") == {}


def test_the_cache_directory_is_private_to_the_user(tmp_path):
    path = compile_cache.resolve(str(tmp_path / "new" / "xla"))
    assert os.stat(path).st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(compile_cache.CacheDirError, match="writable by other users"):
        compile_cache.resolve(str(shared))
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, 12345, 12345)
        with pytest.raises(compile_cache.CacheDirError, match="belongs to uid 12345"):
            compile_cache.resolve(str(foreign))
    assert compile_cache.resolve("") == ""
    assert compile_cache.default_dir().endswith(os.path.join("rl_jax", "xla"))
