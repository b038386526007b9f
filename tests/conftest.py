"""Test set-up: 8 host CPU devices (must be set before jax is imported anywhere), and one JAX
persistent compilation cache for the session."""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tests build the same small models again and again, in this process and in the servers and
# trainers they start: a session-wide compilation cache (a fresh private directory, removed at
# the end) compiles each program once. Tests of the cache itself give their processes
# directories of their own. (rl_jax.compile_cache does not import jax.)
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    from rl_jax import compile_cache

    _SESSION_CACHE = tempfile.mkdtemp(prefix="rl_jax-tests-xla-")
    os.environ.update(compile_cache.environment(_SESSION_CACHE))


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


# Per-test time limit of tests marked `slow` (end-to-end runs that launch several training
# processes, each with its own 300-600 s subprocess timeout); others get pytest.ini's `timeout`.
SLOW_TEST_TIMEOUT_S = 2400


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~30 s on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    """Gives tests marked `slow` the longer time limit, unless they set their own."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
