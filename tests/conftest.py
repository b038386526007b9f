"""Test set-up: 8 host CPU devices (must be set before jax is imported anywhere)."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
