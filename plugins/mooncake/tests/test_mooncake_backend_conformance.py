"""The core conformance kit against a real Mooncake store (started by the session fixture).

Each class shares one Store across its tests (a Mooncake client's close takes about 1 s); the
kit's tests use fresh random page groups and namespaces, and ``backend_factory`` still builds a
new instance on the same store for the persistence test.
"""

import pytest

from hicache_draft import Store
from hicache_draft.testing import ConformanceSuite


class _Shared(ConformanceSuite):
    OPTIONS: dict = {}
    SHM = False

    @pytest.fixture(scope="class")
    @classmethod
    def options(cls, mooncake_service):
        return {**mooncake_service.backend_options(shm=cls.SHM), **cls.OPTIONS}

    @pytest.fixture
    def backend_factory(self, options):
        return lambda: Store.open("mooncake", options)

    @pytest.fixture(scope="class")
    @classmethod
    def shared_store(cls, options):
        s = Store.open("mooncake", options)
        yield s
        s.close()

    @pytest.fixture
    def store(self, shared_store):
        return shared_store


class TestMooncakeTcpConformance(_Shared):
    """TCP mode, default ``io_mode`` (the kit's small pages are staged)."""


class TestMooncakeTcpDirectConformance(_Shared):
    """TCP mode with every page moved in place (multi-buffer, zero copy)."""

    OPTIONS = {"io_mode": "direct"}


class TestMooncakeShmConformance(_Shared):
    """Shared-memory client mode; the kit's host pools are plain memory, so this also covers the
    staging path for buffers outside the shared pool."""

    SHM = True
    OPTIONS = {"shm_pool_size": 64 << 20}
