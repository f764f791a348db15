"""The read path: runs of adjacent records, views sliced from registered memory, any request order.

Every page reported OK must hold exactly the bytes stored for its key, whatever the page sizes
(runs are cut at ``_RUN_MAX_BYTES``), the request order (duplicates, gaps, unknown keys), the
number of buffers per page, and whether those buffers lie in registered memory or not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hicache_draft_file import backend as file_backend
from hicache_draft_file.bench import METHODS, RATIO_METHODS, bench_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import (
    Attention,
    Buffer,
    Layout,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    PoolRegistration,
    Store,
)

NS = "a1" * 12


def _key(i: int) -> str:
    return f"{i:064x}.{NS}"


def _content(i: int, n: int) -> bytes:
    return hashlib.shake_256(f"page {i}".encode()).digest(n)


class Arena:
    """A bytearray handed out as page buffers: one or two pieces per page, with gaps between them
    and the second piece far from the first (like the K and V halves of a zero-copy page)."""

    def __init__(self, nbytes: int) -> None:
        self.mem = bytearray(nbytes)
        self.region = Buffer.of(self.mem)
        self.used = 0

    def take(self, n: int) -> Buffer:
        start = self.used
        self.used += n + 40  # a gap, so a page's buffers are never one contiguous block
        assert self.used <= len(self.mem)
        return Buffer(self.region.ptr + start, n, owner=self.mem)

    def page(self, i: int, n: int, split: bool) -> Page:
        parts = (n // 3, n - n // 3) if split and n > 1 else (n,)
        bufs = tuple(self.take(p) for p in parts)
        return Page(_key(i), f"{i:064x}", NS, bufs)


def _bytes(page: Page) -> bytes:
    return b"".join(bytes(b.view()) for b in page.buffers)


def _fill(page: Page, data: bytes) -> None:
    pos = 0
    for b in page.buffers:
        b.view()[:] = data[pos : pos + b.nbytes]
        pos += b.nbytes


def _register(store: Store, arenas: list[Arena]) -> None:
    store.register_pool(PoolRegistration(
        pool=PoolKind.KV, attention=Attention.MHA, layout=Layout.PAGE_FIRST_DIRECT, namespace=NS,
        page_nbytes=0, buffers_per_page=2, regions=tuple(a.region for a in arenas),
    ))


SIZES = st.sampled_from([1, 4096, 65536, 100_000, 300_000])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=12),
    order=st.lists(st.integers(0, 13), min_size=1, max_size=20),
    split=st.booleans(),
    registered=st.booleans(),
)
def test_any_request_returns_exactly_the_stored_bytes(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], order: list[int], split: bool, registered: bool
) -> None:
    store = Store.open("file", {"root": str(tmp_path_factory.mktemp("reads"))})
    try:
        src = Arena(sum(sizes) + 80 * len(sizes))
        pages = [src.page(i, n, split) for i, n in enumerate(sizes)]
        for i, p in enumerate(pages):
            _fill(p, _content(i, p.nbytes))
        res = store.page_set([PageTransfer(PoolKind.KV, pages, zero_copy=split)])
        assert res[PoolKind.KV] == [PageResult.OK] * len(pages)

        # read back in the drawn order (repeats, and indexes past the stored ones are misses)
        want = [(i, sizes[i] if i < len(sizes) else 4096) for i in order]
        dst = Arena(sum(n for _i, n in want) + 80 * len(want))
        if registered:
            _register(store, [dst])
        out = [dst.page(i, n, split) for i, n in want]
        got, _ = store.page_get([PageTransfer(PoolKind.KV, out, zero_copy=split)])
        for (i, n), page, r in zip(want, out, got[PoolKind.KV], strict=True):
            if i < len(sizes):
                assert r is PageResult.OK
                assert _bytes(page) == _content(i, n)
            else:
                assert r is PageResult.MISS
                assert _bytes(page) == bytes(n)  # a miss leaves the buffers alone
    finally:
        store.close()


def test_one_call_reads_many_runs_and_checks_each_page(open_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages far beyond one run, and a payload damaged in a middle run: that page is CORRUPT, every
    page reported OK has its exact bytes."""
    calls: list[int] = []
    real = file_backend._read_by_core

    def counting(runs: list, *rest: object) -> None:
        calls.extend(sum(64 + n for _off, n, *_ in sr.items[a:b]) for sr, a, b in runs)
        return real(runs, *rest)

    monkeypatch.setattr(file_backend, "_read_by_core", counting)
    store = open_store()
    n, count = 65536, 40
    src = Arena(count * (n + 80))
    pages = [src.page(i, n, split=True) for i in range(count)]
    for i, p in enumerate(pages):
        _fill(p, _content(i, n))
    store.page_set([PageTransfer(PoolKind.KV, pages, zero_copy=True)])
    seg, rec = store.backend.catalog.lookup(PoolKind.KV, _key(25))
    with open(seg.path, "r+b") as f:
        f.seek(seg.offset(rec) + 64 + 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    dst = Arena(count * (n + 80))
    _register(store, [dst])
    out = [dst.page(i, n, split=True) for i in range(count)]
    got, _ = store.page_get([PageTransfer(PoolKind.KV, out, zero_copy=True)])
    results = got[PoolKind.KV]
    assert results[25] is PageResult.CORRUPT
    assert all(r is PageResult.OK for j, r in enumerate(results) if j != 25)
    assert all(_bytes(p) == _content(i, n) for i, p in enumerate(out) if i != 25)
    # through a Store every run goes to the core's read_runs in one call, each at most _RUN_MAX_BYTES,
    # or the call's bytes over the workers when that is less (at least _RUN_MIN_BYTES)
    total = count * (n + 64)
    limit = min(file_backend._RUN_MAX_BYTES, max(file_backend._RUN_MIN_BYTES, -(-total // store.backend.workers)))
    per_run = limit // (n + 64)  # adjacent records: runs as full as allowed
    assert per_run >= 2 and len(calls) == -(-count // per_run)
    assert max(calls) <= limit


@pytest.mark.parametrize("threads", [1, 4, 16])
def test_a_small_call_is_cut_so_that_every_worker_reads(open_store, monkeypatch: pytest.MonkeyPatch,
                                                         threads: int) -> None:
    """Through a Store a call of 2.5 MiB goes to read_runs in runs of its bytes over the workers
    (at least _RUN_MIN_BYTES, at most _RUN_MAX_BYTES): with 16 workers 14 runs of at most 256 KiB
    (3 records), not 3 of 1 MiB (15); every page comes back exact."""
    runs: list[list[int]] = []
    real = file_backend._read_by_core

    def counting(rs: list, *rest: object) -> None:
        runs.extend([sum(64 + n for _off, n, *_ in sr.items[a:b]) for sr, a, b in rs] for _ in [0])
        return real(rs, *rest)

    monkeypatch.setattr(file_backend, "_read_by_core", counting)
    store = open_store(io_threads=threads)
    n, count = 65536, 40
    src = Arena(count * (n + 80))
    pages = [src.page(i, n, split=False) for i in range(count)]
    for i, p in enumerate(pages):
        p.buffers[0].view()[:] = _content(i, n)
    assert store.page_set([PageTransfer(PoolKind.KV, pages)])[PoolKind.KV] == [PageResult.OK] * count
    dst = Arena(count * (n + 80))
    out = [dst.page(i, n, split=False) for i in range(count)]
    got, _ = store.page_get([PageTransfer(PoolKind.KV, out)])
    assert got[PoolKind.KV] == [PageResult.OK] * count
    assert all(_bytes(p) == _content(i, n) for i, p in enumerate(out))
    per_run = {1: 15, 4: 10, 16: 3}[threads]  # 1 MiB; 2.5 MiB / 4 = 641 KiB; 256 KiB (the least)
    tail = [count % per_run * (n + 64)] if count % per_run else []
    assert runs == [[per_run * (n + 64)] * (count // per_run) + tail]


def test_the_benchmark_round_runs_on_registered_pools(tmp_path: Path) -> None:
    """One round of the 64 KiB benchmark (no timing asserted): every method stores and loads all
    pages through the registered pools, and ratios come out for both paths."""
    res = bench_size(tmp_path, 64 << 10, 1)
    for op in ("set", "get"):
        assert set(res.gbps[op]) == set(METHODS)
        assert all(v > 0 for v in res.gbps[op].values())
        assert set(res.ratios[op]) == set(RATIO_METHODS)
