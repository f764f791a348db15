"""The core conformance kit against a real Mooncake store (started by the session fixture)."""

import pytest

from hicache_draft import Store
from hicache_draft.testing import ConformanceSuite


class TestMooncakeTcpConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self, mooncake_service):
        opts = mooncake_service.backend_options()
        return lambda: Store.open("mooncake", opts)


class TestMooncakeShmConformance(ConformanceSuite):
    """Shared-memory client mode; the kit's host pools are plain memory, so this also covers the
    bounce path for buffers outside the shared pool."""

    @pytest.fixture
    def backend_factory(self, mooncake_service):
        opts = {**mooncake_service.backend_options(shm=True), "shm_pool_size": 64 << 20}
        return lambda: Store.open("mooncake", opts)
