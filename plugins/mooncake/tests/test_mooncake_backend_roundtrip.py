"""Target and draft round trips (MHA and MLA, every layout, TCP and shared-memory modes), the stored
format (one object per page: core header then raw bytes), corruption, and the skip of stored keys."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import HEADER_SIZE, Attention, Layout, PageResult, PoolKind, parse_header, verify_payload

from .conftest import make_rig

OK = PageResult.OK
CASES = [
    (Attention.MHA, layout) for layout in Layout
] + [(Attention.MLA, layout) for layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)]


def _ids(case):
    return f"{case[0].value}-{case[1].value}"


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_target_and_draft_round_trip_all_layouts(open_store, new_groups, shm):
    store = open_store(shm=shm)
    alloc = store.backend.host_allocator()
    assert (alloc is not None) == shm
    for attention, layout in CASES:
        writers = [make_rig(kind, attention, layout, allocator=alloc, model=f"m-{kind}") for kind in PoolKind]
        readers = [make_rig(kind, attention, layout, allocator=alloc, model=f"m-{kind}") for kind in PoolKind]
        for r in writers + readers:
            store.register_pool(r.registration())
        for w in writers:
            w.fill_random()
        g = new_groups(3)
        res = store.page_set([w.transfer(w.pages(g, [0, 2, 5])) for w in writers])
        assert res == {k: [OK] * 3 for k in PoolKind}, (attention, layout)
        got, _ = store.page_get([r.transfer(r.pages(g, [1, 3, 7])) for r in readers])
        assert got == {k: [OK] * 3 for k in PoolKind}, (attention, layout)
        for w, r in zip(writers, readers, strict=True):
            for src, dst in ((0, 1), (2, 3), (5, 7)):
                assert r.page_bytes(dst) == w.page_bytes(src), (w.kind, attention, layout)
    # with pools from the backend's allocator, shared-memory mode moves pages without a bounce copy
    assert store.backend.stats["bounced_pages"] == 0


def test_shm_mode_bounces_buffers_outside_the_shared_pool(open_store, new_groups):
    store = open_store(shm=True)
    w, r = make_rig(), make_rig()  # plain host memory
    w.fill_random()
    g = new_groups(2)
    assert store.page_set([w.transfer(w.pages(g, [0, 1]))])[PoolKind.KV] == [OK, OK]
    assert store.page_get([r.transfer(r.pages(g, [4, 5]))])[0][PoolKind.KV] == [OK, OK]
    assert [r.page_bytes(4), r.page_bytes(5)] == [w.page_bytes(0), w.page_bytes(1)]
    assert store.backend.stats["bounced_pages"] == 4


def test_one_object_per_page_with_core_header(open_store, new_groups):
    store = open_store()
    w = make_rig(layout=Layout.LAYER_FIRST, layers=3)  # 6 buffers per page
    w.fill_random()
    g = new_groups(2)
    pages = w.pages(g, [0, 1])
    assert store.page_set([w.transfer(pages)])[PoolKind.KV] == [OK, OK]
    native, backend = store.backend.native, store.backend
    for p, idx in zip(pages, [0, 1], strict=True):
        assert native.get_size(backend.key(p)) == HEADER_SIZE + p.nbytes
        raw = native.get(backend.key(p))
        head = parse_header(raw[:HEADER_SIZE], p.key, p.namespace, PoolKind.KV)
        verify_payload(head, [raw[HEADER_SIZE:]], p.nbytes)
        assert raw[HEADER_SIZE:] == w.page_bytes(idx)
    assert store.page_exists({PoolKind.KV: [p.key for p in pages]}) == {PoolKind.KV: 2}


def test_stored_keys_are_not_put_again(open_store, new_groups):
    store = open_store()
    w = make_rig()
    w.fill_random()
    g = new_groups(3)
    assert store.page_set([w.transfer(w.pages(g[:2], [0, 1]))])[PoolKind.KV] == [OK, OK]
    before = dict(store.backend.stats)
    assert store.page_set([w.transfer(w.pages(g, [0, 1, 2]))])[PoolKind.KV] == [OK, OK, OK]
    assert store.backend.stats["put_skipped"] - before.get("put_skipped", 0) == 2
    assert store.backend.stats["put"] - before.get("put", 0) == 1


@pytest.mark.parametrize("damage", ["payload", "namespace", "pool"])
def test_corrupt_or_foreign_object_is_corrupt_not_data(open_store, new_groups, damage):
    store = open_store()
    w, r = make_rig(), make_rig()
    w.fill_random()
    page = w.pages(new_groups(1), [0])[0]
    from hicache_draft import make_header

    payload = bytearray(w.page_bytes(0))
    ns = page.namespace
    pool = PoolKind.KV
    if damage == "namespace":
        ns = "f" * 24
    if damage == "pool":
        pool = PoolKind.DRAFT
    header = make_header(page.key, ns, pool, [bytes(payload)])
    if damage == "payload":
        payload[7] ^= 0xFF
    assert store.backend.native.put(store.backend.key(page), header + bytes(payload)) == 0
    dst = r.pages([page.group], [3])
    got, _ = store.page_get([r.transfer(dst)])
    assert got[PoolKind.KV] == [PageResult.CORRUPT]
    assert store.backend.stats["corrupt"] == 1


def test_passed_deadline_fails_without_calling_the_store(open_store, new_groups):
    store = open_store()
    w = make_rig()
    w.fill_random()
    res = store.backend.page_set([w.transfer(w.pages(new_groups(2), [0, 1]))], deadline=0.0)
    assert res[PoolKind.KV] == [PageResult.FAILED] * 2
    assert store.backend.stats["put"] == 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    written=st.lists(st.booleans(), min_size=1, max_size=8),
    attention=st.sampled_from([Attention.MHA, Attention.MLA]),
)
def test_reads_return_exactly_what_was_written(tcp_store, new_groups, written, attention):
    """Property: any mix of stored and never-stored pages reads back as OK with the written bytes,
    or MISS; the existence count is the length of the leading stored run."""
    g = new_groups(len(written))  # fresh keys per example (replayed examples must not see old pages)
    store = tcp_store
    w = make_rig(attention=attention, num_pages=8)
    r = make_rig(attention=attention, num_pages=8)
    w.fill_random()
    idx = list(range(len(written)))
    stored = [i for i, s in enumerate(written) if s]
    if stored:
        res = store.page_set([w.transfer(w.pages([g[i] for i in stored], stored))])
        assert res[PoolKind.KV] == [OK] * len(stored)
    lead = next((i for i, s in enumerate(written) if not s), len(written))
    assert store.page_exists({PoolKind.KV: [p.key for p in r.pages(g, idx)]}) == {PoolKind.KV: lead}
    got, _ = store.page_get([r.transfer(r.pages(g, idx))])
    for i, s in enumerate(written):
        assert got[PoolKind.KV][i] == (OK if s else PageResult.MISS)
        if s:
            assert r.page_bytes(i) == w.page_bytes(i)
