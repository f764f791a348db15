"""Markers and shared fixtures of the real-SGLang cases. This file imports nothing from SGLang at
import time (the parent suite loads it too while collecting ``tests/``, and collects no case from this
folder): the rigs fixture imports the harness when a case asks for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: the cases every covered SGLang release runs")


@pytest.fixture
def memory_backend() -> Iterator[None]:
    """The in-repo memory backend registered as "memory", reset before and after."""
    MemoryBackend.reset()
    register_backend("memory", MemoryBackend)
    yield
    unregister_backend("memory")
    MemoryBackend.reset()


@pytest.fixture
def rigs() -> Iterator[Callable[..., Any]]:
    """Build ``harness.Rig`` objects; every one made is closed after the case."""
    import harness as h

    made: list[Any] = []

    def make(*args: Any, **kw: Any) -> Any:
        rig = h.Rig(*args, **kw)
        made.append(rig)
        return rig

    yield make
    while made:
        made.pop().close()
