"""The write path: a segment's bytes do not depend on how it was written.

Whatever the page sizes, buffer splits and write-call size, and whether the file is new,
preallocated or a recycled file larger or smaller than the segment, the file holds exactly: each
page's header (``make_header``) and payload, in order, then the footer. A failing write removes
the temp file and raises, and the backend reports the pages FAILED and keeps what it had.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from array import array
from pathlib import Path

import pytest
from hicache_draft_file import segment_writer
from hicache_draft_file.root_setup import prepare_root
from hicache_draft_file.rootfs import RootDirs
from hicache_draft_file.segment_format import SegmentIndex, build_footer, pool_table, read_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import HEADER_SIZE, Buffer, Page, PageResult, PageTransfer, PoolKind, make_header

NS = "c3" * 12


def _pages(sizes: list[int], split: bool) -> tuple[list[tuple[str, Page]], list[bytearray]]:
    keep: list[bytearray] = []
    items: list[tuple[str, Page]] = []
    for i, n in enumerate(sizes):
        data = hashlib.shake_256(f"w{i}".encode()).digest(n)
        cut = [0, n // 3, n] if split and n > 1 else [0, n]
        bufs = []
        for a, b in zip(cut, cut[1:], strict=False):
            mem = bytearray(data[a:b])
            keep.append(mem)
            bufs.append(Buffer.of(mem))
        group = f"{i:064x}"
        pool = (PoolKind.KV, "indexer", PoolKind.DRAFT)[i % 3]  # one page: version 1; more: an open pool too
        items.append((pool, Page(f"{group}.{NS}", group, NS, tuple(bufs))))
    return items, keep


def _expected(items: list[tuple[str, Page]]) -> bytes:
    out = bytearray()
    offsets = []
    for pool, page in items:
        views = [b.view() for b in page.buffers]
        offsets.append(len(out))
        out += make_header(page.key, page.namespace, pool, views)
        for v in views:
            out += v
    names, codes = pool_table(pool for pool, _p in items)
    index = SegmentIndex(
        size=0, data_end=len(out), keys=[p.key for _pool, p in items], groups=[p.group for _pool, p in items],
        pools=codes, offsets=array("Q", offsets), lengths=array("Q", [p.nbytes for _pool, p in items]), names=names,
    )
    return bytes(out + build_footer(index))


def _layout(root: Path) -> RootDirs:
    return prepare_root(root, create=True, read_only=False)


def _write(layout: RootDirs, name: str, items: list[tuple[str, Page]], chunk: int) -> segment_writer.WrittenSegment:
    return segment_writer.write_segment(layout, name, items, False, chunk)


SIZES = st.sampled_from([0, 1, 63, 4096, 5000, 65536, 200_000])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(SIZES, min_size=1, max_size=10),
    split=st.booleans(),
    chunk=st.sampled_from([4096, 70_000, 256 << 10]),
    recycled=st.sampled_from([None, 100, 5 << 20]),
    prealloc=st.booleans(),
)
def test_a_segment_holds_exactly_headers_payloads_and_footer(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    split: bool,
    chunk: int,
    recycled: int | None,
    prealloc: bool,
) -> None:
    layout = _layout(tmp_path_factory.mktemp("seg"))
    if recycled is not None:  # an evicted file of another size waits in free/
        (layout.layout.free / "0000000000000000-00000001.free").write_bytes(b"\xee" * recycled)
    if not prealloc:
        monkeypatch.setattr(segment_writer, "preallocate", lambda fd, size: False)
    items, _keep = _pages(sizes, split)
    ws = _write(layout, "00000000000000aa-00000001", items, chunk)
    try:
        want = _expected(items)
        assert ws.recycled is (recycled is not None)
        assert ws.tmp_path.read_bytes() == want
        assert ws.index.size == len(want) and ws.index.keys == [p.key for _pool, p in items]
        idx = read_index(ws.fd)
        assert list(idx.offsets) == list(ws.index.offsets) and list(idx.lengths) == sizes
        assert [idx.names[c] for c in idx.pools] == [str(pool) for pool, _p in items]
    finally:
        os.close(ws.fd)


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_failed_write_removes_the_temp_file_and_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """The records' write (0) or the footer's (1) fails: nothing is left, no descriptor leaks."""
    layout = _layout(tmp_path / "root")
    calls: list[int] = []
    real = segment_writer.write_from

    def flaky(fd: int, offset: int, bufs: list[object], **kw: object) -> int:
        calls.append(offset)
        if len(calls) > fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, bufs, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(segment_writer, "write_from", flaky)
    items, _keep = _pages([65536] * 8, split=True)
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as err:
        _write(layout, "00000000000000bb-00000001", items, 65536)
    assert err.value.errno == errno.ENOSPC
    assert len(calls) == fail_at + 1, "writes went on after the first failure"
    assert list(layout.layout.tmp.iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_backend_write_failure_fails_pages_and_keeps_stored(
    open_store, kit, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = open_store(io_threads=2)
    kept = [kit.group(i, 1) for i in range(3)]
    assert store.page_set(kit.both(kept, 300_000))[PoolKind.KV] == [PageResult.OK] * 3

    def no_space(*_a: object, **_kw: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_writer, "write_from", no_space)
    lost = [kit.group(i, 2) for i in range(3)]
    res = store.page_set(kit.both(lost, 300_000))
    assert res == {PoolKind.KV: [PageResult.FAILED] * 3, PoolKind.DRAFT: [PageResult.FAILED] * 3}
    assert kit.unfinished(store.backend, tmp_path / "store") == []
    monkeypatch.undo()
    got = kit.read_back(store, kept + lost, 300_000)
    assert [r for r, _ in got[PoolKind.KV]] == [PageResult.OK] * 3 + [PageResult.MISS] * 3
    assert all(eq for _, eq in got[PoolKind.KV][:3]) and all(eq for _, eq in got[PoolKind.DRAFT][:3])


@pytest.mark.parametrize("io_threads", [1, 2])
def test_large_pages_round_trip_through_either_write_path(open_store, kit, io_threads: int) -> None:
    """1 MiB pages (the writer thread's case with io_threads > 1), target and draft, byte-exact."""
    store = open_store(io_threads=io_threads)
    groups = [kit.group(i, 3) for i in range(6)]
    res = store.page_set(kit.both(groups, 1 << 20))
    assert res == {PoolKind.KV: [PageResult.OK] * 6, PoolKind.DRAFT: [PageResult.OK] * 6}
    got = kit.read_back(store, groups, 1 << 20)
    assert all(r is PageResult.OK and eq for pairs in got.values() for r, eq in pairs)
    seg, _rec = store.backend.catalog.lookup(PoolKind.KV, f"{groups[0]}.{kit.NS[PoolKind.KV]}")
    assert seg.index.data_end == 12 * (HEADER_SIZE + (1 << 20))  # one segment, records back to back
    assert seg.path.stat().st_size == seg.index.size


def _write_calls() -> int:
    """Write system calls this process has made so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


@pytest.mark.parametrize("sizes", [[65536] * 9, [1 << 20] * 3, [100, 300_000, 5, 65536, 70_000]])
def test_record_writes_are_whole_aligned_chunks(tmp_path: Path, sizes: list[int]) -> None:
    # Every write of records covers [k * chunk, (k + 1) * chunk) (the last may be shorter): calls
    # cut at record boundaries sit 64 header bytes off alignment, which costs the kernel its
    # large page-cache folios (1.3-1.4x slower writes, 1.8x slower reads of 64 KiB pages here).
    # The kernel's count of write calls tells: one per chunk of records, one for the footer.
    layout = _layout(tmp_path / "root")
    chunk = 256 << 10
    items, _keep = _pages(sizes, split=True)
    before = _write_calls()
    ws = _write(layout, "00000000000000cc-00000001", items, chunk)
    made = _write_calls() - before
    os.close(ws.fd)
    assert made == -(-ws.index.data_end // chunk) + 1
    assert ws.tmp_path.read_bytes() == _expected(items)


def test_a_store_has_the_core_write_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a Store (the backend declares ``writes_records``) the headers arrive zeroed and the
    core writes the records, making each header as it goes: one pass over the pages' memory. The
    segment still holds exactly the records ``make_header`` describes, and they read back."""
    import hicache_draft.store as store_mod
    from hicache_draft import PageTransfer, Store

    calls: list[int] = []
    real = store_mod._native.write_records

    def spy(fd, offset, pages, *rest):  # noqa: ANN001, ANN002
        calls.append(len(pages))
        assert all(not any(p.header.view()) for p in pages)
        return real(fd, offset, pages, *rest)

    real_runs = store_mod._native.write_runs

    def spy_runs(runs, *rest):  # noqa: ANN001, ANN002
        for _fd, _offset, pages, _codes in runs:
            calls.append(len(pages))
            assert all(not any(p.header.view()) for p in pages)
        return real_runs(runs, *rest)

    monkeypatch.setattr(store_mod._native, "write_records", spy)
    monkeypatch.setattr(store_mod._native, "write_runs", spy_runs)
    store = Store.open("file", {"root": str(tmp_path / "root"), "io_threads": 1})
    try:
        assert store.capabilities.writes_records
        items, _keep = _pages([5000, (1 << 20) + 5, 70_000], split=True)
        items = [(PoolKind.KV, p) for _pool, p in items]
        res = store.page_set([PageTransfer(PoolKind.KV, [p for _pool, p in items])])
        assert res[PoolKind.KV] == [PageResult.OK] * 3 and calls == [3]
        seg = next(p for p in (tmp_path / "root").rglob("*") if p.is_file() and p.suffix == ".seg")
        fd = os.open(seg, os.O_RDONLY)
        try:
            index = read_index(fd)
        finally:
            os.close(fd)
        assert seg.read_bytes()[: index.data_end] == _expected(items)[: index.data_end]
        out = [Page(p.key, p.group, p.namespace, (Buffer.of(bytearray(p.nbytes)),)) for _pool, p in items]
        got, _ = store.page_get([PageTransfer(PoolKind.KV, out)])
        assert got[PoolKind.KV] == [PageResult.OK] * 3
        assert [bytes(o.buffers[0].view()) for o in out] == [b"".join(bytes(b.view()) for b in p.buffers)
                                                             for _pool, p in items]
    finally:
        store.close()


def test_segments_in_memory_are_not_preallocated(open_store, kit, tmp_path: Path, monkeypatch) -> None:
    """On tmpfs (``/dev/shm``) fallocate only allocates and zeroes pages that the write then
    overwrites (page_set 1.05-1.11x faster without it for 8 MiB pages on the H200 host): the backend
    tells the filesystem of its root and preallocates only on disk filesystems; both store the
    same bytes."""
    import tempfile

    calls: list[int] = []
    real = segment_writer.preallocate

    def counted(fd: int, size: int) -> bool:
        # the write's own, not the spare refill's after it (on the backend's I/O threads)
        if not threading.current_thread().name.startswith("hcd-file-io"):
            calls.append(size)
        return real(fd, size)

    monkeypatch.setattr(segment_writer, "preallocate", counted)
    groups = [kit.group(i, 5) for i in range(4)]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        in_memory = open_store(Path(shm) / "store")
        assert in_memory.backend.memory_fs == "tmpfs"
        assert in_memory.page_set(kit.both(groups, 4096)) == {p: [PageResult.OK] * 4 for p in (PoolKind.KV,
                                                                                              PoolKind.DRAFT)}
        assert calls == []
        got = kit.read_back(in_memory, groups, 4096)
        assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])
        in_memory.close()
    on_disk = open_store(tmp_path / "disk")  # preallocated exactly when not in memory
    on_disk.page_set(kit.both(groups, 4096))
    assert on_disk.backend.spares.settle(10.0)  # the refill after the call preallocates its spares too
    assert len(calls) == (on_disk.backend.memory_fs is None)


def test_a_new_root_has_every_fan_out_directory_so_no_write_makes_one(tmp_path, monkeypatch):
    """A new store's fan-out directories are made with it; writing segments then makes none (a
    ``mkdir`` costs a write a few hundred microseconds on some filesystems)."""
    from hicache_draft_file.naming import FANOUT, fanout_dir

    dirs = prepare_root(tmp_path / "s", create=True, read_only=False)
    try:
        assert sorted(p.name for p in (tmp_path / "s" / "seg").iterdir()) == [f"{i:02x}" for i in range(FANOUT)]
        made: list[str] = []
        real = os.mkdir
        monkeypatch.setattr(os, "mkdir", lambda *a, **k: made.append(str(a[0])) or real(*a, **k))
        items, _keep = _pages([64, 80, 96], split=False)
        for n in range(40):  # segments spread over the fan-out by name
            name = f"{n:016x}-{n:08x}"
            ws = segment_writer.write_segment(dirs, name, items, fsync=False)
            with dirs.fan(fanout_dir(name)) as d:
                os.rename(ws.tmp_name, name, src_dir_fd=dirs.tmp, dst_dir_fd=d)
            os.close(ws.fd)
        assert made == []
    finally:
        dirs.close()


def test_dedup_skips_only_groups_stored_whole(open_store, kit) -> None:
    """A group whose every page of the call is stored already is answered OK without a write; a
    group with one page missing (here its draft page) is written again, whole."""
    store = open_store()
    old = [kit.group(i, 7) for i in range(4)]
    store.page_set(kit.both(old, 512))
    store.page_set([PageTransfer(PoolKind.KV, kit.pages(PoolKind.KV, [kit.group(9, 7)], 512))])  # target only
    before = store.backend.usage()
    again = [*old, kit.group(9, 7)]
    res = store.page_set(kit.both(again, 512))
    after = store.backend.usage()
    assert all(r is PageResult.OK for rs in res.values() for r in rs)
    assert after["segments_written"] == before["segments_written"] + 1  # group 9 only
    assert after["pages"] == before["pages"] + 2  # its target page again and its draft page
    assert all(ok for rs in kit.read_back(store, again, 512).values() for _r, ok in rs)
    res = store.page_set(kit.both(old, 512))
    assert all(r is PageResult.OK for rs in res.values() for r in rs)
    assert store.backend.usage()["segments_written"] == after["segments_written"]  # nothing written
