"""The parallel data plane: one call's reads and writes shared by the worker pool.

The thresholds that decide when a call is worth sharing are lowered here, so small pages take the
parallel paths (the tests stay fast); every test checks that more than one thread did the work.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hicache_draft_file import backend as file_backend
from hicache_draft_file import segment_writer

import hicache_draft.store as store_mod
from hicache_draft import (
    BackendContext,
    Buffer,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    Store,
    attach_headers,
)
from hicache_draft.testing import CHILD_OK, in_forked_child

N = 16384  # payload bytes per page
COUNT = 48


@pytest.fixture(autouse=True)
def _share_small_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_backend, "_SHARE_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(file_backend, "_SHARE_MIN_RECORD", 1)
    monkeypatch.setattr(file_backend, "_SHARE_MIN_VERIFIED", 64 << 10)
    monkeypatch.setattr(file_backend, "_SPLIT_MIN", 64 << 10)
    monkeypatch.setattr(file_backend, "_RUN_MAX_BYTES", 64 << 10)  # several runs per share
    monkeypatch.setattr(file_backend, "_FINISH_BYTES", 1)


@pytest.fixture(params=["runs", "shares"])
def core_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a Store's page_get reads: every run handed to the core's ``read_runs`` in one call (its
    compiled threads), or (a Store without it) shares of runs on the backend's own threads, each
    run through ``read_records``."""
    if request.param == "shares":
        monkeypatch.setattr(store_mod._EarlyVerifier, "read_runs", None)
    return request.param


@pytest.fixture(params=["runs", "threads"])
def core_writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a Store's page_set writes: every segment's records handed to the core's ``write_runs``
    in one call (its compiled threads), or (a Store without it) one segment per thread of the
    backend's own, each through ``write_records``."""
    if request.param == "threads":
        monkeypatch.setattr(store_mod._RecordWriter, "write_runs", None)
    return request.param


def _writers(monkeypatch: pytest.MonkeyPatch, core_writes: str) -> Callable[[], bool]:
    """A check, after a page_set, that its segments were written side by side: one call of the
    core's ``write_runs`` with several runs, or ``write_segment`` on several threads."""
    if core_writes == "threads":
        threads = _threads_of(monkeypatch, file_backend, "write_segment")
        return lambda: len(threads) > 1
    calls: list[int] = []
    real = store_mod._RecordWriter.write_runs

    def spy(self: object, runs: list, *args: object) -> list:
        calls.append(len(runs))
        return real(self, runs, *args)

    monkeypatch.setattr(store_mod._RecordWriter, "write_runs", spy)
    return lambda: len(calls) == 1 and calls[0] > 1


def _in_the_core(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the core's ``read_runs``: the number of runs of every call."""
    calls: list[int] = []
    real = store_mod._EarlyVerifier.read_runs

    def spy(self: object, runs: list, threads: int) -> list:
        calls.append(len(runs))
        return real(self, runs, threads)

    monkeypatch.setattr(store_mod._EarlyVerifier, "read_runs", spy)
    return calls


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open("file", {"root": str(tmp_path / "store"), "io_threads": 4})
    yield s
    s.close()


def _groups(tag: int) -> list[str]:
    return [f"{tag:08x}{i:056x}" for i in range(COUNT)]


def _pages(kit, pool: PoolKind, groups: list[str], fill: bool) -> list[Page]:
    return kit.pages(pool, groups, N, fill)


def _stored(kit, store: Store, tag: int = 1) -> list[str]:
    groups = _groups(tag)
    res = store.page_set([PageTransfer(p, _pages(kit, p, groups, True)) for p in (PoolKind.KV, PoolKind.DRAFT)])
    assert all(r == [PageResult.OK] * COUNT for r in res.values())
    return groups


def _threads_of(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> set[int]:
    """Record which threads call ``module.name``."""
    seen: set[int] = set()
    real = getattr(module, name)

    def spy(*args: object, **kw: object) -> object:
        seen.add(threading.get_ident())
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_shared_writes_and_reads_give_every_page_its_result_in_order(
    kit, store: Store, monkeypatch, core_reads: str, core_writes: str
) -> None:
    side_by_side = _writers(monkeypatch, core_writes)
    groups = _stored(kit, store)
    assert side_by_side() and store.backend.usage()["segments"] > 1  # one call, several files
    readers = _threads_of(monkeypatch, file_backend, "_read_run")
    in_core = _in_the_core(monkeypatch) if core_reads == "runs" else []
    # shuffled, with misses and a repeat interleaved, over both pools
    order = [*groups, *(f"{9:08x}{i:056x}" for i in range(6)), groups[3]]
    random.Random(7).shuffle(order)
    ts = [PageTransfer(p, _pages(kit, p, order, False)) for p in (PoolKind.KV, PoolKind.DRAFT)]
    got, _ = store.page_get(ts)
    if core_reads == "runs":  # one call of many runs (their threads are the core's: tests/test_read_runs.py)
        assert len(in_core) == 1 and in_core[0] > 1 and not readers
    else:
        assert len(readers) > 1
    for t in ts:
        for g, page, r in zip(order, t.pages, got[t.pool], strict=True):
            if g in groups:
                assert r is PageResult.OK and bytes(page.buffers[0].view()) == kit.payload(page.key, N)
            else:
                assert r is PageResult.MISS and bytes(page.buffers[0].view()) == bytes(N)


def test_an_io_error_in_one_share_fails_only_its_pages(kit, store: Store, monkeypatch) -> None:
    monkeypatch.setattr(store_mod._EarlyVerifier, "read_runs", None)  # the backend's own shares
    groups = _stored(kit, store)
    real = file_backend._read_run
    failed_at: list[int] = []
    lock = threading.Lock()

    def flaky(fd: int, run: list, *rest: object) -> int:
        offset = run[0][0]
        with lock:
            first = not failed_at and offset > 0
            if first:
                failed_at.append(offset)
        if first:
            raise OSError(errno.EIO, "injected")
        return real(fd, run, *rest)

    monkeypatch.setattr(file_backend, "_read_run", flaky)
    readers = _threads_of(monkeypatch, file_backend, "_read_run")
    ts = [PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))]
    got, _ = store.page_get(ts)
    assert len(readers) > 1 and failed_at
    res = got[PoolKind.KV]
    bad = [i for i, r in enumerate(res) if r is not PageResult.OK]
    assert bad and all(res[i] is PageResult.FAILED for i in bad)
    # one run of adjacent records failed: the pages read after it (also in the same share) are fine
    assert len(bad) <= (64 << 10) // (N + 64) + 1 and max(bad) < COUNT - 1
    for i, page in enumerate(ts[0].pages):
        if i not in bad:
            assert bytes(page.buffers[0].view()) == kit.payload(page.key, N)
    assert store.backend.usage()["read_failures"] == 1


def test_an_io_error_in_one_run_read_by_the_core_fails_only_its_pages(
    kit, store: Store, monkeypatch, tmp_path: Path
) -> None:
    """A real failing read (the kernel's EISDIR for one run's descriptor) in the core's read_runs:
    that run's pages fail, every other page is read and exact, the failure is counted once."""
    groups = _stored(kit, store)
    real = store_mod._EarlyVerifier.read_runs
    hit: list[list] = []
    bad_fd = os.open(tmp_path, os.O_RDONLY)

    def one_bad(self: object, runs: list, threads: int) -> list:
        runs = list(runs)
        assert len(runs) > 2
        hit.append(runs[1][2])
        runs[1] = (bad_fd, runs[1][1], runs[1][2])
        return real(self, runs, threads)

    monkeypatch.setattr(store_mod._EarlyVerifier, "read_runs", one_bad)
    try:
        ts = [PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))]
        got, _ = store.page_get(ts)
    finally:
        os.close(bad_fd)
    res = got[PoolKind.KV]
    failed = {i for _pool, i in hit[0]}
    assert failed and [i for i, r in enumerate(res) if r is not PageResult.OK] == sorted(failed)
    assert all(res[i] is PageResult.FAILED for i in failed)
    for i, page in enumerate(ts[0].pages):
        if i not in failed:
            assert bytes(page.buffers[0].view()) == kit.payload(page.key, N)
    assert store.backend.usage()["read_failures"] == 1 and store.corrupt_pages == 0


def _slow(monkeypatch: pytest.MonkeyPatch, module: object, name: str, delay: float) -> list[tuple[float, float]]:
    """Make ``module.name`` take ``delay`` s; record (start, end) of every call."""
    spans: list[tuple[float, float]] = []
    real = getattr(module, name)

    def slow(*args: object, **kw: object) -> object:
        t0 = time.monotonic()
        time.sleep(delay)
        try:
            return real(*args, **kw)
        finally:
            spans.append((t0, time.monotonic()))

    monkeypatch.setattr(module, name, slow)
    return spans


def test_every_read_share_stops_at_the_deadline_and_ends_before_the_call(kit, store: Store, monkeypatch) -> None:
    groups = _stored(kit, store)
    spans = _slow(monkeypatch, file_backend, "_read_run", 0.05)
    readers = _threads_of(monkeypatch, file_backend, "_read_run")
    ts = attach_headers([PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))], made=False)
    deadline = time.monotonic() + 0.12
    got = store.backend.page_get(ts, deadline)
    returned = time.monotonic()
    res = got[PoolKind.KV]
    assert len(readers) > 1
    assert returned < deadline + 3.0
    assert all(t0 <= deadline for t0, _t1 in spans)  # no run started after the deadline, in any share
    assert all(t1 <= returned for _t0, t1 in spans)  # every share ended before the call returned
    assert PageResult.FAILED in res and PageResult.OK in res and PageResult.MISS not in res
    for page, r in zip(ts[0].pages, res, strict=True):
        if r is PageResult.OK:
            assert bytes(page.buffers[0].view()) == kit.payload(page.key, N)


def test_every_write_share_stops_at_the_deadline_and_ends_before_the_call(
    kit, store: Store, monkeypatch, tmp_path: Path
) -> None:
    # every segment's write reaches the kernel only after the deadline: the write itself refuses
    spans = _slow(monkeypatch, segment_writer, "write_from", 0.08)
    writers = _threads_of(monkeypatch, file_backend, "write_segment")
    groups = _groups(2)
    n = 65536  # four segments of 12 pages: each written in several 256 KiB calls
    ts = attach_headers([PageTransfer(PoolKind.KV, kit.pages(PoolKind.KV, groups, n))], made=True)
    deadline = time.monotonic() + 0.05
    got = store.backend.page_set(ts, deadline)
    returned = time.monotonic()
    assert len(writers) > 1 and returned < deadline + 3.0
    assert all(t0 <= deadline for t0, _t1 in spans)  # no write call started after the deadline
    assert all(t1 <= returned for _t0, t1 in spans)  # no thread reads the pages after the return
    assert got[PoolKind.KV] == [PageResult.FAILED] * COUNT
    assert kit.unfinished(store.backend, tmp_path / "store") == []  # the unfinished segments are gone
    assert store.backend.usage()["segments"] == 0


def test_finished_names_each_ok_page_once_with_its_final_bytes(kit, store: Store, monkeypatch) -> None:
    groups = _stored(kit, store)
    order = [*groups[:20], f"{9:08x}{0:056x}", *groups[20:]]
    ts = attach_headers([PageTransfer(PoolKind.DRAFT, _pages(kit, PoolKind.DRAFT, order, False))], made=False)
    pages = ts[0].pages
    told: list[int] = []
    wrong: list[int] = []
    threads: set[int] = set()

    def finished(pool: PoolKind, indices: list[int]) -> None:
        assert pool is PoolKind.DRAFT
        threads.add(threading.get_ident())
        for i in indices:
            told.append(i)
            p = pages[i]
            if bytes(p.buffers[0].view()) != kit.payload(p.key, N) or not any(p.header.view()):
                wrong.append(i)

    got = store.backend.page_get(ts, time.monotonic() + 30, finished)
    ok = [i for i, r in enumerate(got[PoolKind.DRAFT]) if r is PageResult.OK]
    assert sorted(told) == ok and len(ok) == COUNT and not wrong and len(threads) > 1


def test_rejected_pages_quarantine_their_segment(kit, tmp_path: Path) -> None:
    store = Store.open("file", {"root": str(tmp_path / "s"), "io_threads": 1})
    try:
        groups = _stored(kit, store)
        backend = store.backend
        key = f"{groups[5]}.{kit.NS[PoolKind.KV]}"
        seg, _rec = backend.catalog.lookup(PoolKind.KV, key)
        backend.page_rejected({PoolKind.KV: [key]})
        use = backend.usage()
        assert use["segments_quarantined"] == 1 and use["corrupt_pages"] == 1 and not seg.path.exists()
        got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))])
        assert got[PoolKind.KV] == [PageResult.MISS] * COUNT
    finally:
        store.close()


def test_close_shuts_the_worker_pool_down(tmp_path: Path) -> None:
    store = Store.open("file", {"root": str(tmp_path / "s"), "io_threads": 3})
    backend = store.backend
    buf = Buffer.of(bytearray(4096))
    store.page_set([PageTransfer(PoolKind.KV, [Page(f"{1:064x}.{'a1' * 12}", f"{1:064x}", "a1" * 12, (buf,))])])
    pool = backend._pool
    assert pool is not None and backend.workers == 3
    pool.submit(lambda: None).result(timeout=10)  # the pool has started its threads
    threads = list(pool._threads)
    store.close()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
    for t in threads:
        t.join(timeout=10)
        assert not t.is_alive()


def test_io_threads_default_follows_the_machine(tmp_path: Path) -> None:
    from hicache_draft_file.backend import FileBackend
    from hicache_draft_file.options import FileOptions

    b = FileBackend(FileOptions(root=tmp_path / "s"), BackendContext())
    try:
        assert b.workers == max(1, min(32, os.cpu_count() or 1))
    finally:
        b.close()
    one = FileBackend(FileOptions(root=tmp_path / "t", io_threads=1), BackendContext())
    try:
        assert one.workers == 1 and one._pool is None
    finally:
        one.close()



def test_a_segment_recycled_while_read_is_a_miss_never_corrupt(
    kit, store: Store, monkeypatch, core_reads: str
) -> None:
    """Another process evicts the segment (renames it out of seg/) and reuses its file while this
    one reads through its descriptor: the headers read may still pass, the payloads are someone
    else's. The pages are gone: a miss, never OK, never counted corrupt by the core."""
    groups = _stored(kit, store, tag=3)
    where = "_read_by_core" if core_reads == "runs" else "_read_run"
    real = getattr(file_backend, where)
    moved: list[Path] = []
    lock = threading.Lock()

    def evict_then_read(fd: object, *rest: object) -> object:
        with lock:
            if not moved:
                for seg in list(store.backend.catalog.segments.values()):
                    dst = seg.path.with_name(seg.name + ".recycled")
                    os.rename(seg.path, dst)
                    moved.append(dst)
                    with open(dst, "r+b") as f:  # a new writer overwrites the payloads, headers kept
                        for k in range(len(seg.index)):
                            f.seek(seg.offset(k) + 64)
                            f.write(b"\x5a" * N)
        return real(fd, *rest)

    monkeypatch.setattr(file_backend, where, evict_then_read)
    got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))])
    assert moved and got[PoolKind.KV] == [PageResult.MISS] * COUNT
    assert store.corrupt_pages == 0 and store.backend.usage()["corrupt_pages"] == 0


def test_small_records_read_through_the_core_are_shared_by_threads(kit, store: Store, monkeypatch) -> None:
    """Records far below ``_SHARE_MIN_RECORD`` are read by one thread when the backend parses their
    headers itself (per-page Python holds the GIL), but shared by the pool when the core reads and
    verifies each run (``read_records``: one call per run, no GIL held): every page correct. (With
    ``read_runs`` the core's own threads read them: tests/test_read_runs.py.)"""
    monkeypatch.setattr(file_backend, "_SHARE_MIN_RECORD", 256 << 10)  # the shipped value: 16 KiB is small
    monkeypatch.setattr(file_backend, "_SHARE_MIN_VERIFIED", 64 << 10)
    monkeypatch.setattr(store_mod._EarlyVerifier, "read_runs", None)  # a Store without read_runs
    groups = _stored(kit, store)
    readers = _threads_of(monkeypatch, file_backend, "_read_run")
    pages = _pages(kit, PoolKind.KV, groups, False)
    got, _ = store.page_get([PageTransfer(PoolKind.KV, pages)])
    assert got[PoolKind.KV] == [PageResult.OK] * COUNT
    assert all(bytes(p.buffers[0].view()) == kit.payload(p.key, N) for p in pages)
    assert len(readers) > 1
    readers.clear()
    plain = attach_headers([PageTransfer(PoolKind.KV, _pages(kit, PoolKind.KV, groups, False))], made=False)
    got = store.backend.page_get(plain, time.monotonic() + 30)
    assert list(got[PoolKind.KV]) == [PageResult.OK] * COUNT and len(readers) == 1


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_few_threads_write_a_mid_sized_call_as_one_file(tmp_path: Path, kit, threads: int) -> None:
    """Each segment writer's Python work and the Store's hand-over need a core beside the ones
    writing: with fewer than _SPLIT_CORES I/O threads a call is split only into files of
    _SPLIT_MIN_FEW bytes (here none), with more into one file per thread (here _SPLIT_MIN is
    64 KiB: 24 of them in the call)."""
    store = Store.open("file", {"root": str(tmp_path / "s"), "io_threads": threads})
    try:
        _stored(kit, store)  # 96 pages of 16 KiB
        want = threads if threads >= file_backend._SPLIT_CORES else 1
        assert store.backend.usage()["segments"] == want
    finally:
        store.close()


def _stores_and_reads(store: Store, kit, tag: int, also: list[str]) -> Callable[[], bool]:
    def body() -> bool:
        mine = [kit.group(i, tag) for i in range(64)]
        if store.page_set(kit.both(mine, 65536))[PoolKind.KV] != [PageResult.OK] * 64:
            return False
        got = kit.read_back(store, mine + also, 65536)
        return all(pair == (PageResult.OK, True) for rows in got.values() for pair in rows)

    return body


@pytest.fixture
def _four_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_backend, "_SPLIT_MIN", 1 << 20)
    monkeypatch.setattr(file_backend, "_SPLIT_CORES", 4)


@pytest.mark.usefixtures("_four_shares")
def test_a_forked_child_stores_and_reads_on_threads_of_its_own(open_store, kit) -> None:
    """The I/O threads do not survive ``fork``: a child whose calls were handed to the parent's
    executor waited for shares no thread ran (its calls failed at the timeout, or hung)."""
    store = open_store(io_threads=4)
    warm = [kit.group(i, 7) for i in range(64)]  # 8 MiB: four shares, on I/O threads
    assert store.page_set(kit.both(warm, 65536))[PoolKind.KV] == [PageResult.OK] * 64
    assert any(t.name.startswith("hcd-file-io") for t in threading.enumerate())  # threads a fork loses
    verdict = in_forked_child(_stores_and_reads(store, kit, 8, warm))
    assert verdict == CHILD_OK, f"the forked child's calls failed or hung (code {verdict})"
    assert kit.read_back(store, warm, 65536)[PoolKind.KV] == [(PageResult.OK, True)] * 64  # the parent goes on


@pytest.mark.usefixtures("_four_shares")
def test_a_forked_child_is_not_stopped_by_a_lock_another_thread_held_at_the_fork(open_store, kit) -> None:
    store = open_store(io_threads=4)
    be = store.backend
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with be._lock, be._fs_lock, be._journal._mu:  # a writer of the parent publishing as the process forks
            held.set()
            let_go.wait(30.0)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10.0)
        verdict = in_forked_child(_stores_and_reads(store, kit, 9, []))
    finally:
        let_go.set()
        t.join()
    assert verdict == CHILD_OK, f"the forked child's calls failed or hung (code {verdict})"


def test_a_forked_child_never_releases_the_parents_root_lock(tmp_path: Path, kit) -> None:
    """The child's copy of ROOT/lock's descriptor shared the parent's flock: the child's publish
    (a shared lock, then an unlock) turned the parent's exclusive lock shared and then released it,
    in the middle of the parent's eviction."""
    store = Store.open("file", {"root": str(tmp_path / "s")}, BackendContext(timeout_s=1.0))
    be = store.backend
    lock_file = tmp_path / "s" / "lock"
    held, let_go = threading.Event(), threading.Event()

    def evict() -> None:
        with be._root_lock(exclusive=True):  # the parent evicting as the process forks
            held.set()
            let_go.wait(60.0)

    t = threading.Thread(target=evict)
    t.start()
    try:
        assert held.wait(10.0) and kit.flocked(lock_file)

        def child() -> bool:  # waits for the parent's lock (its own call fails at its timeout)
            res = store.page_set(kit.both([kit.group(1, 3)], 4096))
            return res[PoolKind.KV] == [PageResult.FAILED]

        verdict = in_forked_child(child, timeout_s=60)
        assert kit.flocked(lock_file), "the child released the parent's root lock"
        assert verdict == CHILD_OK, f"the child published while the parent held the root lock (code {verdict})"
    finally:
        let_go.set()
        t.join()
        store.close()


def test_a_forked_child_and_its_parent_never_write_the_same_segment_name(tmp_path: Path, open_store, kit) -> None:
    """Segment names are <writer>-<seq>: a child that kept its parent's writer id named its next
    segment as the parent then named its own, and the parent's publish renamed over the child's."""
    store = open_store(tmp_path / "s")
    first = [kit.group(i, 1) for i in range(4)]
    assert store.page_set(kit.both(first, 4096))[PoolKind.KV] == [PageResult.OK] * 4
    child_groups = [kit.group(i, 2) for i in range(4)]

    def child() -> bool:
        return store.page_set(kit.both(child_groups, 4096))[PoolKind.KV] == [PageResult.OK] * 4

    assert in_forked_child(child) == CHILD_OK
    parent_groups = [kit.group(i, 3 + k) for k in range(4) for i in range(4)]
    for k in range(4):  # the parent's names go on past the ones the child used (spare files in between)
        part = parent_groups[4 * k : 4 * k + 4]
        assert store.page_set(kit.both(part, 4096))[PoolKind.KV] == [PageResult.OK] * 4
    got = kit.read_back(open_store(tmp_path / "s"), first + child_groups + parent_groups, 4096)
    assert all(pair == (PageResult.OK, True) for rows in got.values() for pair in rows), got
