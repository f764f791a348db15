import secrets

import pytest

from hicache_draft import Store, hookimpl
from hicache_draft.testing import ConformanceSuite, MemoryBackend
from hicache_draft.testing.memory import Faults


class TestMemoryBackendConformance(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self):
        space = secrets.token_hex(4)
        MemoryBackend.reset()
        yield lambda: Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": space})
        MemoryBackend.reset()


def test_kit_catches_a_backend_that_forgets_pages():
    """The suite is not vacuous: a backend that loses everything after a write fails it."""
    suite = TestMemoryBackendConformance()
    space = secrets.token_hex(4)
    MemoryBackend.reset()
    MemoryBackend.faults = Faults(fail_get_keys=set())

    class Forgetful(MemoryBackend):
        @hookimpl
        def page_exists(self, queries):
            return {p: 0 for p in queries}

    store = Store("forgetful", Forgetful, Forgetful.capabilities, {"space": space})
    with pytest.raises(AssertionError):
        suite.test_exists_counts_leading_stored_pages(store)
    store.close()
    MemoryBackend.reset()
