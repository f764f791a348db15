"""Shared pytest setup of the core tests."""

import pytest

from hicache_draft.testing import MemoryBackend

# The Mooncake store fixtures are opt-in; tests/test_controller_backends.py uses mooncake_options.
pytest_plugins = ["hicache_draft_mooncake.pytest_plugin"]


@pytest.fixture
def reset_memory_backend():
    """The in-memory test backend with no faults and no stored pages, before and after a test."""
    MemoryBackend.reset()
    yield
    MemoryBackend.reset()
