"""Target and draft round trips (MHA and MLA, every layout, TCP and shared-memory modes), the stored
format (one object per page: core header then raw bytes), corruption, and the skip of stored keys."""

import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    Buffer,
    Layout,
    PageResult,
    PoolKind,
    attach_headers,
    make_header,
    parse_header,
    verify_payload,
)

from .conftest import host_allocator, make_rig, stat_delta

OK = PageResult.OK
CASES = [
    (Attention.MHA, layout) for layout in Layout
] + [(Attention.MLA, layout) for layout in (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)]


def _ids(case):
    return f"{case[0].value}-{case[1].value}"


MODES = {  # id: (shm, io_mode)
    "tcp-auto": (False, "auto"),
    "tcp-staged": (False, "staged"),
    "tcp-direct": (False, "direct"),
    "shm": (True, "auto"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_target_and_draft_round_trip_all_layouts(open_store, new_groups, mode):
    shm, io_mode = MODES[mode]
    store = open_store(shm=shm, io_mode=io_mode)
    alloc = host_allocator(store)
    assert (alloc is not None) == shm
    before = dict(store.backend.stats)
    moved = 0
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
        moved += 2 * 2 * 3  # two pools, set and get, three pages
    delta = stat_delta(store, before)
    assert delta["put"] == delta["get"] == moved // 2
    # how the bytes moved: the test pages are small, so 'auto' stages them over TCP; with pools
    # from the backend's host_memory hook, shared-memory mode moves them in place (no bounce copy)
    staged = {"tcp-auto": moved, "tcp-staged": moved, "tcp-direct": 0, "shm": 0}[mode]
    assert delta.get("staged_pages", 0) == staged
    assert delta.get("bounced_pages", 0) == 0


def test_auto_mode_stages_small_pages_and_moves_large_ones_directly(open_store, new_groups):
    store = open_store(staged_max_page_bytes=1024)
    small, large = make_rig(layers=1), make_rig(layers=8)  # 512 and 4096 bytes per page
    for r in (small, large):
        r.fill_random()
        store.register_pool(r.registration())
    before = dict(store.backend.stats)
    g = new_groups(2)
    for r in (small, large):
        assert store.page_set([r.transfer(r.pages(g, [0, 1]))])[PoolKind.KV] == [OK, OK]
    delta = stat_delta(store, before)
    assert delta["put"] == 4 and delta["staged_pages"] == 2


def test_shm_mode_stages_buffers_outside_the_shared_pool(open_store, new_groups):
    store = open_store(shm=True)
    w, r = make_rig(), make_rig()  # plain host memory
    w.fill_random()
    g = new_groups(2)
    before = dict(store.backend.stats)
    assert store.page_set([w.transfer(w.pages(g, [0, 1]))])[PoolKind.KV] == [OK, OK]
    assert store.page_get([r.transfer(r.pages(g, [4, 5]))])[0][PoolKind.KV] == [OK, OK]
    assert [r.page_bytes(4), r.page_bytes(5)] == [w.page_bytes(0), w.page_bytes(1)]
    assert stat_delta(store, before)["bounced_pages"] == 4


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
def test_pipelined_batches_keep_every_page_in_its_place(open_store, new_groups, io_mode):
    """With one native call per page (staged: pipeline sub-batches of one page; direct: chunks of
    one page, as direct calls are never split below a chunk), a batch mixing stored, missing and
    corrupt pages still returns each page's own result and bytes, and nothing else is written."""
    store = open_store(io_mode=io_mode, pipeline_bytes=1) if io_mode == "staged" else open_store(
        io_mode=io_mode, max_batch_pages=1)
    w, r = make_rig(num_pages=8), make_rig(num_pages=8)
    w.fill_random()
    r.pool.raw.fill_(7)
    g = new_groups(6)
    stored = [0, 1, 3, 5]
    assert store.page_set([w.transfer(w.pages([g[i] for i in stored], stored))])[PoolKind.KV] == [OK] * 4
    bad = w.pages([g[5]], [5])[0]
    payload = bytearray(w.page_bytes(5))
    header = make_header(bad.key, bad.namespace, PoolKind.KV, [bytes(payload)])
    payload[0] ^= 1
    assert store.backend.native.upsert(store.backend.key(bad), header + bytes(payload)) == 0
    before, corrupt = dict(store.backend.stats), store.corrupt_pages
    got, done = store.page_get([r.transfer(r.pages(g, list(range(6))))])
    assert done.done()
    assert got[PoolKind.KV] == [OK, OK, PageResult.MISS, OK, PageResult.MISS, PageResult.CORRUPT]
    for i in (0, 1, 3):
        assert r.page_bytes(i) == w.page_bytes(i)
    assert r.page_bytes(7) == bytes([7]) * len(r.page_bytes(7))  # a slot nobody asked for is untouched
    delta = stat_delta(store, before)
    # the backend hands the corrupt page over with its stored header; the core's check rejects it
    assert delta["get_batches"] == 6 and delta["get"] == 4 and delta["miss"] == 2
    assert store.corrupt_pages - corrupt == 1


def test_a_failure_while_preparing_a_sub_batch_fails_pages_without_raising(open_store, new_groups, monkeypatch):
    store = open_store(io_mode="staged", pipeline_bytes=1)
    backend = store.backend
    w, r = make_rig(), make_rig()
    w.fill_random()
    g = new_groups(4)
    assert store.page_set([w.transfer(w.pages(g, [0, 1, 2, 3]))])[PoolKind.KV] == [OK] * 4
    real = backend._prepare_staged_get
    calls = []

    def flaky(sess, jobs):
        calls.append(len(jobs))
        if len(calls) == 3:
            raise MemoryError("no staging memory")
        return real(sess, jobs)

    monkeypatch.setattr(backend, "_prepare_staged_get", flaky)
    got, done = store.page_get([r.transfer(r.pages(g, [0, 1, 2, 3]))])
    assert done.done() and got[PoolKind.KV] == [PageResult.FAILED] * 4
    assert backend.stats["get:MemoryError"] >= 1
    monkeypatch.setattr(backend, "_prepare_staged_get", real)
    got, _ = store.page_get([r.transfer(r.pages(g, [0, 1, 2, 3]))])
    assert got[PoolKind.KV] == [OK] * 4 and r.page_bytes(2) == w.page_bytes(2)


def test_one_object_per_page_with_core_header(open_store, new_groups):
    store = open_store(io_mode="direct")
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


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
def test_stored_keys_are_not_put_again(open_store, new_groups, io_mode):
    store = open_store(io_mode=io_mode)
    w = make_rig()
    w.fill_random()
    g = new_groups(3)
    assert store.page_set([w.transfer(w.pages(g[:2], [0, 1]))])[PoolKind.KV] == [OK, OK]
    before = dict(store.backend.stats)
    assert store.page_set([w.transfer(w.pages(g, [0, 1, 2]))])[PoolKind.KV] == [OK, OK, OK]
    assert store.backend.stats["put_skipped"] - before.get("put_skipped", 0) == 2
    assert store.backend.stats["put"] - before.get("put", 0) == 1


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
@pytest.mark.parametrize("damage", ["payload", "namespace", "pool", "length"])
def test_corrupt_or_foreign_object_is_corrupt_not_data(open_store, new_groups, damage, io_mode):
    store = open_store(io_mode=io_mode)
    w, r = make_rig(), make_rig()
    w.fill_random()
    page = w.pages(new_groups(1), [0])[0]
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
    if damage == "length":  # a stored object shorter than the page
        payload = payload[:-1]
    assert store.backend.native.put(store.backend.key(page), header + bytes(payload)) == 0
    dst = r.pages([page.group], [3])
    before, corrupt = dict(store.backend.stats), store.corrupt_pages
    got, _ = store.page_get([r.transfer(dst)])
    if damage == "length" and io_mode == "direct":
        # Mooncake itself refuses to scatter a short object into the page's buffers (TRANSFER_FAIL)
        assert got[PoolKind.KV] == [PageResult.FAILED]
        return
    assert got[PoolKind.KV] == [PageResult.CORRUPT]
    # a short object is caught by the backend (length), anything else by the core's verification of
    # the header the backend returned
    assert store.corrupt_pages - corrupt + stat_delta(store, before).get("corrupt", 0) == 1


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_rejected_copy_is_removed_so_a_backup_can_store_the_page_again(open_store, new_groups, shm):
    store = open_store(shm=shm)
    w, r = make_rig(), make_rig()
    w.fill_random()
    page = w.pages(new_groups(1), [0])[0]
    payload = bytearray(w.page_bytes(0))
    header = make_header(page.key, page.namespace, PoolKind.KV, [bytes(payload)])
    payload[5] ^= 1  # a rotten copy under the page's key
    assert store.backend.native.upsert(store.backend.key(page), header + bytes(payload)) == 0
    reads = r.pages([page.group], [1])
    assert store.page_get([r.transfer(reads)])[0][PoolKind.KV] == [PageResult.CORRUPT]
    deadline = time.monotonic() + 10.0  # page_rejected runs on a store worker, unawaited
    while store.backend.native.is_exist(store.backend.key(page)) == 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.page_get([r.transfer(reads)])[0][PoolKind.KV] == [PageResult.MISS]
    assert store.page_set([w.transfer([page])])[PoolKind.KV] == [OK]  # stored again, not skipped
    assert store.page_get([r.transfer(reads)])[0][PoolKind.KV] == [OK] and r.page_bytes(1) == w.page_bytes(0)


def test_backend_still_checks_pages_read_without_the_store(open_store, new_groups):
    """Called directly (no Store, so no core header to return and nobody verifying after it), the
    backend checks the stored header and checksum itself."""
    store = open_store(io_mode="staged")
    w, r = make_rig(), make_rig()
    w.fill_random()
    page = w.pages(new_groups(1), [0])[0]
    payload = bytearray(w.page_bytes(0))
    header = make_header(page.key, page.namespace, PoolKind.KV, [bytes(payload)])
    payload[3] ^= 1
    assert store.backend.native.put(store.backend.key(page), header + bytes(payload)) == 0
    res = store.backend.page_get([r.transfer(r.pages([page.group], [2]))], deadline=time.monotonic() + 10)
    assert res[PoolKind.KV] == [PageResult.CORRUPT]


def test_passed_deadline_fails_without_calling_the_store(open_store, new_groups):
    store = open_store()
    w = make_rig()
    w.fill_random()
    before = dict(store.backend.stats)
    res = store.backend.page_set([w.transfer(w.pages(new_groups(2), [0, 1]))], deadline=0.0)
    assert res[PoolKind.KV] == [PageResult.FAILED] * 2
    assert stat_delta(store, before) == {}


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


def test_a_direct_put_is_one_native_call_per_chunk(open_store, new_groups):
    """Direct puts are not cut into pipeline sub-batches (the core made the headers before the
    call: nothing to overlap; each extra call cost 10-30% of a 1 MiB batch over TCP)."""
    store = open_store(io_mode="direct", pipeline_bytes=1)
    w, r = make_rig(num_pages=8), make_rig(num_pages=8)
    w.fill_random()
    g = new_groups(6)
    before = dict(store.backend.stats)
    assert store.page_set([w.transfer(w.pages(g, list(range(6))))])[PoolKind.KV] == [OK] * 6
    assert stat_delta(store, before)["put_batches"] == 1
    got, _ = store.page_get([r.transfer(r.pages(g, list(range(6))))])
    assert got[PoolKind.KV] == [OK] * 6 and [r.page_bytes(i) for i in range(6)] == [w.page_bytes(i) for i in range(6)]
    assert stat_delta(store, before)["get_batches"] == 1


@pytest.mark.parametrize("mode", ["staged", "direct", "shm"])
def test_finished_names_each_ok_page_once_with_its_final_bytes(open_store, new_groups, mode):
    """page_get tells the core (``finished``) which pages landed, native call by native call, so
    the core verifies them while the rest moves: every OK page exactly once, with its final header
    and bytes at that moment, never a missing page, and before the call returns."""
    shm = mode == "shm"
    store = (open_store(shm=True) if shm else open_store(io_mode=mode, pipeline_bytes=1, max_batch_pages=2))
    alloc = host_allocator(store)
    w, r = make_rig(num_pages=8, allocator=alloc), make_rig(num_pages=8, allocator=alloc)
    w.fill_random()
    r.pool.raw.fill_(7)
    g = new_groups(6)
    stored = [0, 1, 3, 4, 5]
    assert store.page_set([w.transfer(w.pages([g[i] for i in stored], stored))])[PoolKind.KV] == [OK] * 5
    transfers = attach_headers([r.transfer(r.pages(g, list(range(6))))], made=False)
    pages = transfers[0].pages
    seen: list[int] = []
    calls = []

    def finished(pool, indices):
        indices = list(indices)
        calls.append(indices)
        for i in indices:
            assert pool is PoolKind.KV
            assert r.page_bytes(i) == w.page_bytes(i)  # final bytes when announced
            head = parse_header(pages[i].header.view(), pages[i].key, pages[i].namespace, PoolKind.KV)
            verify_payload(head, [b.view() for b in pages[i].buffers], pages[i].nbytes)
        seen.extend(indices)

    got = store.backend.page_get(transfers, time.monotonic() + 10, finished)
    assert got[PoolKind.KV] == [OK, OK, PageResult.MISS, OK, OK, OK]
    assert sorted(seen) == stored and len(seen) == len(set(seen))
    if not shm:  # one announcement per native call (staged: sub-batches of one page; direct: chunks of
        # two pages), not one at the end; the call of the missing page announces nothing
        assert calls == ([[0], [1], [3], [4], [5]] if mode == "staged" else [[0, 1], [3], [4, 5]])


@pytest.mark.parametrize("io_mode", ["staged", "direct"])
def test_a_store_put_asks_the_core_for_each_sub_batchs_headers(open_store, new_groups, monkeypatch, io_mode):
    """Through a Store the backend gets zeroed headers and asks ``make_headers`` for each sub-batch
    right before preparing it (staged with a ``pipeline_bytes`` below a page: one sub-batch a page;
    direct: one for the chunk);
    what it stored comes back byte-exact and verified."""
    import hicache_draft.store as store_mod

    asked: list[tuple[str, list[int]]] = []
    packed: list[bytes] = []  # staged: what the core wrote into each slot
    real = store_mod._HeaderMaker.make_headers

    def spy(self, pool, indices, into=None):
        asked.append((pool, list(indices)))
        real(self, pool, indices, into)
        packed.extend(bytes(d) for d in into or ())

    monkeypatch.setattr(store_mod._HeaderMaker, "make_headers", spy)
    store = open_store(io_mode=io_mode, pipeline_bytes=1)
    assert store.capabilities.headers_on_demand
    w, r = make_rig(), make_rig()
    for rig in (w, r):
        store.register_pool(rig.registration())
    w.fill_random()
    g = new_groups(6)
    assert store.page_set([w.transfer(w.pages(g, list(range(6))))])[PoolKind.KV] == [OK] * 6
    assert sorted(i for _pool, idx in asked for i in idx) == list(range(6))
    assert len(asked) == (1 if io_mode == "direct" else 6)
    # staged: the core copied every record (header made from the copy) into the staging slots
    w_pages = w.pages(g, list(range(6)))
    assert packed == ([] if io_mode == "direct" else
                      [make_header(p.key, p.namespace, PoolKind.KV, [w.page_bytes(i)]) + w.page_bytes(i)
                       for i, p in enumerate(w_pages)])
    got, _ = store.page_get([r.transfer(r.pages(g, list(range(6))))])
    assert got[PoolKind.KV] == [OK] * 6
    assert [r.page_bytes(i) for i in range(6)] == [w.page_bytes(i) for i in range(6)]


@pytest.mark.parametrize("order", ["block", "reversed", "own", "mixed"])
@pytest.mark.parametrize("shm", [False, True])
def test_direct_puts_store_each_pages_own_header_wherever_the_headers_lie(open_store, new_groups, order, shm):
    """A direct put copies the core's headers into its header slots: in one copy when they lie one
    after another in the order of the pages (the core's batch), page by page otherwise (reversed
    block, one allocation each), and made by the backend for a page handed without one; every page
    then reads back through the Store, which verifies it against its stored header."""
    store = open_store(shm=shm, io_mode="direct")
    alloc = host_allocator(store)
    w, r = make_rig(allocator=alloc), make_rig(allocator=alloc)
    for rig in (w, r):
        store.register_pool(rig.registration())
    w.fill_random()
    g = new_groups(6)
    [sent] = attach_headers([w.transfer(w.pages(g, range(6)))], made=True)
    pages = list(sent.pages)
    if order == "reversed":
        pages.reverse()
    elif order in ("own", "mixed"):
        own = [bytearray(p.header.view()) for p in pages]
        pages = [replace(p, header=None if order == "mixed" and i % 2 else Buffer.of(h))
                 for i, (p, h) in enumerate(zip(pages, own, strict=True))]
    before = dict(store.backend.stats)
    res = store.backend.page_set([w.transfer(pages)], time.monotonic() + 10)
    assert res == {PoolKind.KV: [OK] * 6}
    assert stat_delta(store, before).get("staged_pages", 0) == 0
    got, _ = store.page_get([r.transfer(r.pages(g, range(6)))])
    assert got == {PoolKind.KV: [OK] * 6}
    assert [r.page_bytes(i) for i in range(6)] == [w.page_bytes(i) for i in range(6)]
