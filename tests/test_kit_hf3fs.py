"""The conformance kit against a backend declaring exactly what hf3fs declares (the in-memory
backend with the hf3fs declaration): only the paths 3FS's slots allow are run (indexer pages
zero-copy in page_first, draft state pages of several arrays through the generic path, ...), and
the pools it does not hold (target swa and mamba, MHA drafts) are refused at registration."""

import secrets

import pytest
from hicache_draft_hf3fs import HF3FS_CAPABILITIES

from hicache_draft import IOPath, Store
from hicache_draft.testing import ConformanceSuite, MemoryBackend, declared_cases
from hicache_draft.testing.suite import kit_plan


class Hf3fsShaped(MemoryBackend):
    capabilities = HF3FS_CAPABILITIES


class TestHf3fsShapedConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self):
        space = secrets.token_hex(4)
        MemoryBackend.reset()
        yield lambda: Store("hf3fs-shaped", Hf3fsShaped, HF3FS_CAPABILITIES, {"space": space})
        MemoryBackend.reset()


def test_the_kit_runs_what_the_slots_allow_and_nothing_else():
    cases = {c.id for c in declared_cases(HF3FS_CAPABILITIES)}
    assert {"indexer-rows36-page_first-zc", "draft_indexer-rows36-layer_first-generic",
            "draft_swa-mla-page_first-zc", "draft_mamba-rows40x8x24-page_first-generic"} <= cases
    assert not any(c.startswith(("swa-", "mamba-", "draft_swa-mha", "draft-mha")) for c in cases), cases
    for c in declared_cases(HF3FS_CAPABILITIES):
        if c.zero_copy:
            assert kit_plan(c.spec, HF3FS_CAPABILITIES).path is IOPath.ZERO_COPY
            assert c.spec.buffers_per_page() <= (2 if c.name == "kv" else 1)
