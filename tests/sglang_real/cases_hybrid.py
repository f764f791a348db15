"""Issue 14 on SGLang's own controller: a DSA model with MTP and a hybrid SWA model round-trip every
pool SGLang registers, byte-exact, after a restart (see harness.py for how the rigs are built).

The DSA rig is what the bug report behind this project runs (GLM-5 / DeepSeek-V3.2 with MTP, SGLang
#24956): KV (MLA latent) + INDEXER (lightning-indexer keys and scales) for the target, DRAFT +
DRAFT_INDEXER for the MTP draft, all on the target's host slots, ALL_PAGES. The SWA rig: full
attention KV + SWA (its own host slots, the trailing window), and a DRAFT_SWA sidecar on SWA's slots.
"""

from __future__ import annotations

import harness as h
import pytest

from hicache_draft import Attention, Capabilities, Component, PoolCapability, PoolKind
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend, memory
from hicache_draft.testing.memory import all_layouts

DSA_T, DSA_D = h.Shape("mla", 2), h.Shape("mla", 1)
SWA_T, SWA_D = h.Shape("mha", 1), h.Shape("mha", 1)
DSA_LAYOUTS = ("page_first", "layer_first", "page_first_direct")


def _caps(kv: frozenset[Component], draft: frozenset[Component]) -> Capabilities:
    def cap(components: frozenset[Component]) -> PoolCapability:
        return PoolCapability(attention=frozenset(Attention), zero_copy_layouts=all_layouts(), components=components)

    return Capabilities(pools={PoolKind.KV: cap(kv), PoolKind.DRAFT: cap(draft)}, split_heads=True, persistent=True)


class EveryPool(MemoryBackend):
    """The in-repo memory backend declaring every component for both roles."""

    capabilities = _caps(frozenset(Component), frozenset(Component))


class NoDraftIndexer(MemoryBackend):
    """Holds the target's KV and indexer and the draft's KV, not the draft's indexer (#28895's gap)."""

    capabilities = _caps(frozenset(Component), frozenset({Component.KV}))


@pytest.fixture(autouse=True)
def _memory_backend():
    MemoryBackend.reset()
    backends = {"memory": MemoryBackend, "every-pool": EveryPool, "no-draft-indexer": NoDraftIndexer}
    for name, cls in backends.items():
        register_backend(name, cls)
    yield
    for name in backends:
        unregister_backend(name)
    MemoryBackend.reset()


def extra_for(backend: str, tmp_path, **kw):
    if backend != "file":
        return h.extra_config("", backend=backend, options={"space": tmp_path.name}, **kw)
    return h.extra_config(str(tmp_path / "kv"), **kw)


# Issue 14: on the adapter before pool bindings (cf23ee5) both tests fail on 0.5.18 and 0.5.23: an INDEXER
# pool (ALL_PAGES) made the whole DSA hit 0 ((0, 0) == (192, 192)) and SWA got nothing ((0, 0) == (20, 20)).
@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("layout", DSA_LAYOUTS)
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_dsa_with_mtp_round_trips_every_pool_after_restart(tmp_path, rigs, backend, layout, v1):
    pages = 3
    extra = extra_for(backend, tmp_path, interface_v1=v1)
    hit, done, before, after, reader = h.round_trip(rigs, DSA_T, DSA_D, layout, extra, model="dsa", pages=pages,
                                                  page_size=h.DSA_PAGE_SIZE, device_tokens=4 * h.DSA_PAGE_SIZE)
    assert set(before) == {"kv", "indexer", "draft", "draft_indexer"}
    full = pages * h.DSA_PAGE_SIZE
    assert (hit, done) == (full, full)
    assert after == before  # KV, INDEXER, DRAFT and DRAFT_INDEXER, every page byte-exact


@pytest.mark.parametrize("backend", ["file", "memory"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_hybrid_swa_round_trips_every_pool_after_restart(tmp_path, rigs, backend, layout, v1):
    pages, window = 5, 2
    extra = extra_for(backend, tmp_path, interface_v1=v1)
    hit, done, before, after, reader = h.round_trip(rigs, SWA_T, SWA_D, layout, extra, model="swa", pages=pages,
                                                  window_pages=window)
    assert set(before) == {"kv", "swa", "draft_swa"}
    assert [len(v) for v in before.values()] == [pages, window, window]
    assert (hit, done) == (pages * 4, pages * 4)
    assert after == before  # KV every page; SWA and DRAFT_SWA the trailing window, byte-exact


# -- a backend that holds every component: the adapter holds every pool ------------------------------


DSA_KW = {"page_size": h.DSA_PAGE_SIZE, "device_tokens": 4 * h.DSA_PAGE_SIZE}


@pytest.mark.parametrize("layout", DSA_LAYOUTS)
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_dsa_with_mtp_every_pool_held_round_trips_after_restart(tmp_path, rigs, layout, v1):
    extra = extra_for("every-pool", tmp_path, interface_v1=v1)
    hit, done, before, after, reader = h.round_trip(rigs, DSA_T, DSA_D, layout, extra, model="dsa", pages=3, **DSA_KW)
    assert (hit, done) == (192, 192)
    assert set(before) == {"kv", "indexer", "draft", "draft_indexer"} and after == before
    assert {n: b.active for n, b in reader.adapter.bindings.items()} == dict.fromkeys(before, True)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_hybrid_swa_every_pool_held_round_trips_after_restart(tmp_path, rigs, layout, v1):
    extra = extra_for("every-pool", tmp_path, interface_v1=v1)
    hit, done, before, after, _ = h.round_trip(rigs, SWA_T, SWA_D, layout, extra, model="swa", pages=5, window_pages=2)
    assert (hit, done) == (20, 20)
    assert [len(v) for v in before.values()] == [5, 2, 2] and after == before


def test_a_missing_draft_indexer_gives_no_hit_rather_than_stale_draft_state(tmp_path, rigs, caplog):
    """#28895: restoring the draft KV without the draft indexer drops MTP acceptance. A backend that
    does not hold the draft's indexer gets the draft_indexer pool refused (logged) and no hit, so
    no prefix is restored with a stale draft indexer."""
    extra = extra_for("no-draft-indexer", tmp_path)
    writer = rigs(DSA_T, DSA_D, "page_first", extra, model="dsa", **DSA_KW)
    assert not writer.adapter.bindings["draft_indexer"].active
    assert "draft_indexer" in caplog.text and "'indexer' component for 'draft' pools" in caplog.text
    for n, pool in enumerate(writer.pools):
        h.fill_random(pool.host, 40 + n)
    toks = h.tokens(2, h.DSA_PAGE_SIZE, salt=40)
    writer.backup(toks, writer.alloc(2))
    writer.close()
    reader = rigs(DSA_T, DSA_D, "page_first", extra, model="dsa", **DSA_KW)
    assert reader.prefetch(toks)[0] == 0


def test_a_missing_swa_window_page_gives_no_hit(tmp_path, rigs):
    """TRAILING_PAGES over the transfer's keys: the stored SWA window's last page lost -> no hit."""
    extra = extra_for("every-pool", tmp_path)
    writer = rigs(SWA_T, SWA_D, "page_first", extra, model="swa", window_pages=2)
    for n, pool in enumerate(writer.pools):
        h.fill_random(pool.host, 50 + n)
    toks = h.tokens(4, salt=50)
    assert writer.backup(toks, writer.alloc(4)) == 16
    keys = h.page_hashes(toks, 4)
    adapter = writer.adapter
    b = adapter.bindings["swa"]
    swa = h.PoolTransfer(name=h.PoolName.SWA, keys=keys[-2:], hit_policy=h.PoolHitPolicy.TRAILING_PAGES)
    assert adapter.batch_exists_v2(keys, [swa]).kv_hit_pages == 4
    del memory._SPACES[tmp_path.name][b.keys(keys[-1:])[0]]  # the window's last SWA page is lost
    assert adapter.batch_exists_v2(keys, [swa]).kv_hit_pages == 0


# -- the harness itself: SGLang's own file backend round-trips these rigs ----------------------------


@pytest.mark.parametrize("model", ["dsa", "swa"])
def test_sglangs_own_file_backend_round_trips_every_pool_of_the_rig(tmp_path, rigs, monkeypatch, model):
    """The rigs are right: SGLang's ``HiCacheFile`` (which holds every pool it is given) restores every
    pool byte-exact through the same controller calls, so a failure above is the adapter's."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "sglang"))
    if model == "dsa":
        kw = {"page_size": h.DSA_PAGE_SIZE, "device_tokens": 4 * h.DSA_PAGE_SIZE}
        hit, done, before, after, _ = h.round_trip(rigs, DSA_T, DSA_D, "page_first", {}, model="dsa", pages=3,
                                                 storage_backend="file", **kw)
        assert (hit, done, set(before)) == (192, 192, {"kv", "indexer", "draft", "draft_indexer"})
    else:
        hit, done, before, after, _ = h.round_trip(rigs, SWA_T, SWA_D, "page_first", {}, model="swa", pages=5,
                                                 storage_backend="file")
        assert (hit, done, set(before)) == (20, 20, {"kv", "swa", "draft_swa"})
    assert after == before
