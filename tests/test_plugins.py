"""Discovery, validation and selection of backend plugins."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from typing import ClassVar

import pytest

import hicache_draft.plugins as plugins_mod
from hicache_draft import (
    Attention,
    Buffer,
    Capabilities,
    Page,
    PageResult,
    PageTransfer,
    PluginError,
    PoolCapability,
    PoolKind,
    StorageBackend,
    Store,
    UnknownBackendError,
    discover_backends,
    get_backend,
    hookimpl,
    register_backend,
    unregister_backend,
)
from hicache_draft.metrics import CallTimer
from hicache_draft.testing import MemoryBackend

CAPS = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset({Attention.MHA}))})


class Throwaway(StorageBackend):
    api_version = 2
    capabilities: ClassVar[Capabilities] = CAPS

    @hookimpl
    def page_set(self, transfers):
        return {t.pool: [True] * len(t.pages) for t in transfers}

    @hookimpl
    def page_get(self, transfers):
        return {t.pool: [1] * len(t.pages) for t in transfers}  # MISS as an int

    @hookimpl
    def page_exists(self, queries):
        return {p: 0 for p in queries}


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the entry points of the backends group with the given ones, and refresh discovery."""
    installed: list[EntryPoint] = []

    def fake(group=None, **kw):
        assert group == plugins_mod.ENTRY_POINT_GROUP
        return list(installed)

    monkeypatch.setattr(plugins_mod, "entry_points", fake)
    yield installed
    monkeypatch.undo()
    discover_backends(refresh=True)


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=plugins_mod.ENTRY_POINT_GROUP)


def test_throwaway_plugin_registered_then_removed():
    register_backend("throwaway", Throwaway)
    try:
        info = get_backend("throwaway")
        assert info.ok and info.capabilities == CAPS
        with Store.open("throwaway") as store:
            assert store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
    finally:
        unregister_backend("throwaway")
    with pytest.raises(UnknownBackendError):
        get_backend("throwaway")


def test_misspelt_argument_is_refused_by_name():
    class Misspelt(Throwaway):
        @hookimpl
        def page_set(self, transfer):  # should be "transfers"
            return {}

    with pytest.raises(PluginError, match=r"(?s)misspelt.*transfer"):
        register_backend("misspelt", Misspelt)


def test_unknown_hook_is_refused():
    class UnknownHook(Throwaway):
        @hookimpl
        def page_sett(self, transfers):
            return {}

    with pytest.raises(PluginError, match="page_sett"):
        register_backend("unknownhook", UnknownHook)


def test_incompatible_api_version_refused_with_reason():
    class Future(Throwaway):
        api_version = 99

    with pytest.raises(PluginError, match=r"'future'.*version 99"):
        register_backend("future", Future)


def test_invalid_capabilities_refused():
    class NoKv(Throwaway):
        capabilities = {"pools": {"draft": {"attention": ["mha"]}}}  # type: ignore[assignment]

    with pytest.raises(PluginError, match="kv"):
        register_backend("nokv", NoKv)


def test_missing_required_hook_refused():
    class NoExists(StorageBackend):
        api_version = 2
        capabilities = CAPS

        @hookimpl
        def page_set(self, transfers):
            return {}

        @hookimpl
        def page_get(self, transfers):
            return {}

    with pytest.raises(PluginError, match="page_exists"):
        register_backend("noexists", NoExists)


def test_broken_plugin_is_reported_and_others_still_load(fake_entry_points):
    fake_entry_points += [
        _ep("good", "hicache_draft.testing.memory:MemoryBackend"),
        _ep("broken", "hicache_draft_does_not_exist.module:Backend"),
        _ep("notaclass", "hicache_draft.testing.memory:all_layouts"),
    ]
    found = discover_backends(refresh=True)
    assert found["good"].ok
    assert "import of" in (found["broken"].error or "")
    assert "must name a class" in (found["notaclass"].error or "")
    with pytest.raises(PluginError, match="broken"):
        get_backend("broken")


def test_unknown_backend_lists_installed(fake_entry_points):
    fake_entry_points.append(_ep("good", "hicache_draft.testing.memory:MemoryBackend"))
    discover_backends(refresh=True)
    with pytest.raises(UnknownBackendError, match=r"'nope'.*installed backends: good") as err:
        get_backend("nope")
    assert err.value.field == "backend"


def test_allow_and_block_lists(fake_entry_points, monkeypatch):
    fake_entry_points += [
        _ep("a", "hicache_draft.testing.memory:MemoryBackend"),
        _ep("b", "hicache_draft.testing.memory:MemoryBackend"),
    ]
    monkeypatch.setenv("HICACHE_DRAFT_LOAD_PLUGINS", "a")
    assert set(discover_backends(refresh=True)) == {"a"}
    monkeypatch.delenv("HICACHE_DRAFT_LOAD_PLUGINS")
    monkeypatch.setenv("HICACHE_DRAFT_DISABLE_PLUGINS", "b")
    found = discover_backends(refresh=True)
    assert found["a"].ok and not found["b"].ok
    assert "HICACHE_DRAFT_DISABLE_PLUGINS" in (found["b"].error or "")


def test_discovery_is_idempotent(fake_entry_points):
    fake_entry_points.append(_ep("a", "hicache_draft.testing.memory:MemoryBackend"))
    first = discover_backends(refresh=True)
    second = discover_backends()
    assert first.keys() == second.keys()
    assert first["a"] is second["a"]
    assert json.dumps([i.as_dict() for i in second.values()])


def test_observer_wrapper_sees_calls_without_backend_knowing():
    timer = CallTimer()
    MemoryBackend.reset()
    store = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": "obs"}, observers=[timer])
    try:
        store.page_exists({PoolKind.KV: ["x.y", "z.w"]})
        store.page_set([])
    finally:
        store.close()
        MemoryBackend.reset()
    assert timer.calls == {"page_exists": 1}
    assert timer.pages["page_exists"] == 2


def test_backend_exceptions_and_bad_results_become_failures():
    class Raising(Throwaway):
        @hookimpl
        def page_exists(self, queries):
            raise OSError("disk on fire")

        @hookimpl
        def page_set(self, transfers):
            return {t.pool: [] for t in transfers}  # wrong length

    register_backend("raising", Raising)
    try:
        with Store.open("raising") as store:
            assert store.page_exists({PoolKind.KV: ["a.b"]}) == {PoolKind.KV: 0}
            buf = bytearray(8)
            page = Page(key="a.b", group="a", namespace="b", buffers=(Buffer.of(buf),))
            assert store.page_set([PageTransfer(PoolKind.KV, [page])]) == {PoolKind.KV: [PageResult.FAILED]}
    finally:
        unregister_backend("raising")
