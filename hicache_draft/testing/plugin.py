"""pytest plugin for backend authors, opt-in like pytest's ``pytester``: load it with
``pytest_plugins = ["hicache_draft.testing.plugin"]`` in your ``conftest.py`` or with
``pytest -p hicache_draft.testing.plugin``. It is not registered through ``pytest11``, so the
pytest runs of other projects in the same environment never load it.

``hicache_memory_store``: a :class:`~hicache_draft.Store` over the in-memory test backend, with
its fault injector reset before and after the test.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.store import Store
from hicache_draft.testing.memory import MemoryBackend


@pytest.fixture
def hicache_memory_store() -> Iterator[Store]:
    space = secrets.token_hex(4)
    MemoryBackend.reset()
    register_backend("memory", MemoryBackend, distribution="hicache-draft (testing)")
    store = Store.open("memory", {"space": space})
    try:
        yield store
    finally:
        store.close()
        unregister_backend("memory")
        MemoryBackend.reset()
