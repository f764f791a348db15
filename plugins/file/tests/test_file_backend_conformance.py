"""The core conformance kit, run against the file backend (default and small-segment settings)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_draft import Store
from hicache_draft.testing import ConformanceSuite


class TestFileConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[[], Store]:
        return lambda: Store.open("file", {"root": str(tmp_path / "store")})


class TestFileConformanceSmallSegments(ConformanceSuite):
    """Every page in its own segment, no dedup, fsync on: the multi-segment paths."""

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[[], Store]:
        opts = {"root": str(tmp_path / "store"), "segment_max_bytes": 4096, "dedup": False, "fsync": True}
        return lambda: Store.open("file", opts)
