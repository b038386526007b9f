"""Test set-up: 8 host CPU devices (must be set before jax is imported anywhere), and one JAX
persistent compilation cache for the session."""

import os
import shutil
import tempfile
from pathlib import Path

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


# Test functions that took over ~1 s on 2 CPU cores (tools/slow_tests.py writes the list from a
# --durations=0 log): marked `slow` here beside those marked in their files, so that
# `pytest -m "not slow"` is the quick loop.
SLOW_TESTS = frozenset(Path(__file__).with_name("slow_tests.txt").read_text().split())


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: over ~1 s on 2 CPU cores (tests/slow_tests.txt) "
                            "or an end-to-end run")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks the listed tests `slow`; gives `slow` tests the longer time limit, unless they set
    their own."""
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
