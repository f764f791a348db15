"""hicache-draft's conformance kit, run against the sqlite backend, with and without a byte budget."""

from __future__ import annotations

import pytest

from hicache_draft import Store
from hicache_draft.testing import ConformanceSuite


class TestSqliteConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self, tmp_path):
        return lambda: Store.open("sqlite", {"path": str(tmp_path / "kv.db")})


class TestSqliteConformanceWithBudget(ConformanceSuite):
    """A budget far above what the kit writes: eviction bookkeeping runs on every call, nothing is evicted."""

    @pytest.fixture
    def backend_factory(self, tmp_path):
        return lambda: Store.open("sqlite", {"path": str(tmp_path / "kv.db"), "max_bytes": 1 << 30})
