"""``write_records``: the core writes a backend's records (the page format: each page's 64-byte
header, then its payload, back to back in a file), making each header from the bytes as they go.

What it must keep: the file holds exactly the records the core would have made before the call
(whatever the page sizes, buffer split, offset or chunk), each page's ``header`` buffer gets its
header, write calls end on chunk multiples, nothing is read or written past the deadline, and once
a call has returned or was abandoned a late backend writes nothing at all."""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_draft.store as store_mod
from hicache_draft import (
    Buffer,
    Capabilities,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    Store,
    attach_headers,
    hookimpl,
    make_header,
)
from hicache_draft.testing import MemoryBackend

KV = PoolKind.KV
NS = "cd" * 12
BIG = 1 << 20  # pages above this are hashed and written piece by piece (WRITE_GROUP_BYTES)
pytestmark = pytest.mark.usefixtures("reset_memory_backend")


def _pages(sizes: Sequence[int], split: bool, pool: str = KV) -> tuple[list[Page], list[bytes], list[bytearray]]:
    payloads = [os.urandom(n) for n in sizes]
    keep: list[bytearray] = []
    pages = []
    for i, data in enumerate(payloads):
        parts = [bytearray(data[: len(data) // 3]), bytearray(data[len(data) // 3 :])] if split else [bytearray(data)]
        keep.extend(parts)
        key = f"{i:064x}"
        pages.append(Page(f"{key}.{NS}", key, NS, tuple(Buffer.of(p) if p else Buffer(0, 0) for p in parts)))
    return attach_headers([PageTransfer(pool, pages)], made=False)[0].pages, payloads, keep


def _write_calls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 100, 4096, 65536, 300_000, BIG, BIG + 1, 3 * BIG // 2]), min_size=1,
                   max_size=5),
    split=st.booleans(),
    chunk=st.sampled_from([4096, 65536, 256 << 10]),
    start=st.integers(0, 5000),
    pool=st.sampled_from([KV, PoolKind.DRAFT, "indexer"]),
)
def test_the_file_holds_exactly_the_records_the_core_makes(sizes, split, chunk, start, pool) -> None:
    pages, payloads, _keep = _pages(sizes, split, pool)
    writer = store_mod._RecordWriter([PageTransfer(pool, pages)], time.monotonic() + 60)
    with tempfile.TemporaryFile() as f:
        got = writer.write_records(f.fileno(), start, [(pool, i) for i in range(len(pages))], chunk)
        f.seek(start)
        blob = f.read()
    want = b"".join(make_header(p.key, NS, pool, [d]) + d for p, d in zip(pages, payloads, strict=True))
    assert got == len(want) and blob == want
    for p, d in zip(pages, payloads, strict=True):
        assert bytes(p.header.view()) == make_header(p.key, NS, pool, [d])


@pytest.mark.parametrize(
    "sizes", [[65536] * 9, [65536] * 40, [5000] * 300, [3 * BIG] * 2, [BIG + 7, 5000, 3 * BIG], [70_000, 2 * BIG + 3]]
)
def test_write_calls_end_on_chunk_multiples(sizes: list[int]) -> None:
    # one call per chunk of the file the records touch (so every call but the last ends on a chunk
    # multiple, across groups of small pages too), and one more per large page whose header place
    # was written before its header was made (the kernel's own count of write calls)
    chunk = 256 << 10
    pages, _payloads, _keep = _pages(sizes, split=False)
    writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
    total = sum(64 + n for n in sizes)
    expect = (total - 1) // chunk + 1
    at = 0
    for n in sizes:
        if n > BIG and (at + 64 + n) // chunk * chunk > at:
            expect += 1
        at += 64 + n
    with tempfile.TemporaryFile() as f:
        before = _write_calls()
        writer.write_records(f.fileno(), 0, [(KV, i) for i in range(len(pages))], chunk)
        assert _write_calls() - before == expect


def _read_from_disk() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


@pytest.mark.parametrize("sizes", [[65536] * 64, [65536] * 63 + [1000], [300_000] * 10 + [3 * BIG]])
def test_writing_over_stored_blocks_that_left_the_cache_reads_nothing_back(tmp_path, sizes: list[int]) -> None:
    """A recycled or prefaulted segment file whose pages were reclaimed: its blocks hold data that is
    not cached. A write call that ended inside a page would make the kernel read that page from the
    disk before the call could copy into it (ended at every group of small pages before: about one
    read per MiB, 0.86x on the VM for 8 MiB). write_records reads at most the page where the records
    end, when they end inside one (its rest is not theirs)."""
    chunk = 256 << 10
    pages, payloads, _keep = _pages(sizes, split=False)
    total = sum(64 + n for n in sizes)
    path = tmp_path / "recycled"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, os.urandom(total + 8192))  # old data on the disk, as in a recycled file
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        # the control: on this filesystem a write inside a page of such a file does read it back
        # (on one that never reads, tmpfs, this test could not fail)
        before = _read_from_disk()
        os.pwrite(fd, b"x", total + 100)
        assert _read_from_disk() > before, "the test file's filesystem never reads a page back"
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = _read_from_disk()
        writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
        assert writer.write_records(fd, 0, [(KV, i) for i in range(len(pages))], chunk) == total
        assert _read_from_disk() - before <= (mmap.PAGESIZE if total % mmap.PAGESIZE else 0)
        want = b"".join(make_header(p.key, NS, KV, [d]) + d for p, d in zip(pages, payloads, strict=True))
        assert os.pread(fd, total, 0) == want
    finally:
        os.close(fd)


def test_nothing_is_read_or_written_past_the_deadline_or_after_the_call() -> None:
    pages, _payloads, _keep = _pages([BIG * 2, 100], split=False)
    late = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() - 1)
    with tempfile.TemporaryFile() as f:
        with pytest.raises(TimeoutError):
            late.write_records(f.fileno(), 0, [(KV, 0), (KV, 1)], 65536)
        assert os.fstat(f.fileno()).st_size == 0 and not any(any(p.header.view()) for p in pages)
        done = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
        done.close()
        with pytest.raises(RuntimeError, match="ended or was abandoned"):
            done.write_records(f.fileno(), 0, [(KV, 0)], 65536)
        with pytest.raises(ValueError, match="no page 5"):
            store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60).write_records(
                f.fileno(), 0, [(KV, 5)], 65536)
        assert os.fstat(f.fileno()).st_size == 0


class ToFiles(MemoryBackend):
    """A backend that keeps pages as records the core writes: ``page_set`` hands its pages to
    ``write_records`` (into a scratch file, after sleeping when told) and keeps each record."""

    capabilities: ClassVar[Capabilities] = MemoryBackend.capabilities.model_copy(update={"writes_records": True})
    sleep_s: ClassVar[float] = 0.0
    outcome: ClassVar[list[object]] = []
    sizes: ClassVar[list[int]] = []

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], write_records) -> dict[str, list[PageResult]]:  # noqa: ANN001
        out = {}
        for t in transfers:
            assert all(not any(p.header.view()) for p in t.pages)  # zeroed: the core makes them as it writes
            with tempfile.TemporaryFile() as f:
                time.sleep(type(self).sleep_s)
                try:
                    got = write_records(f.fileno(), 0, [(t.pool, i) for i in range(len(t.pages))], 4096)
                except Exception as exc:  # noqa: BLE001 - what the core answered is the point
                    type(self).outcome.append(exc)
                    out[t.pool] = [PageResult.FAILED] * len(t.pages)
                    continue
                type(self).outcome.append(got)
                type(self).sizes.append(os.fstat(f.fileno()).st_size)
                f.seek(0)
                blob = f.read()
            at = 0
            for p in t.pages:
                self.data[p.key] = blob[at : at + 64 + p.nbytes]  # header and payload, as the core wrote them
                at += 64 + p.nbytes
            out[t.pool] = [PageResult.OK] * len(t.pages)
        return out


def _reset(**kw: object) -> None:
    ToFiles.sleep_s, ToFiles.outcome, ToFiles.sizes = 0.0, [], []
    for k, v in kw.items():
        setattr(ToFiles, k, v)


def test_pages_written_by_the_core_come_back_exactly() -> None:
    _reset()
    store = Store("tofiles", ToFiles, ToFiles.capabilities, {"space": os.urandom(4).hex()})
    try:
        pages, payloads, _keep = _pages([5000, BIG + 3, 70_000], split=True)
        res = store.page_set([PageTransfer(KV, [Page(p.key, p.group, p.namespace, p.buffers) for p in pages])])
        assert res[KV] == [PageResult.OK] * 3 and ToFiles.outcome == [sum(64 + len(d) for d in payloads)]
        for p, d in zip(pages, payloads, strict=True):
            assert store.backend.data[p.key] == make_header(p.key, NS, KV, [d]) + d
    finally:
        store.close()


def test_a_backend_that_sleeps_past_its_deadline_then_writes_is_refused() -> None:
    _reset(sleep_s=0.4)
    store = Store("tofiles", ToFiles, ToFiles.capabilities, {"space": os.urandom(4).hex()})
    try:
        pages, _payloads, keep = _pages([65536, 3 * BIG], split=False)
        rep = store.call("page_set", [PageTransfer(KV, [Page(p.key, p.group, p.namespace, p.buffers) for p in pages])],
                         timeout_s=0.05)
        assert rep.outcome == "timeout" and rep.results[KV] == [PageResult.FAILED] * 2
        for b in keep:  # the caller reuses its memory once the call is abandoned
            b[:] = bytes(len(b))
        rep.released.result(timeout=30)
        assert len(ToFiles.outcome) == 1 and isinstance(ToFiles.outcome[0], RuntimeError)
        assert ToFiles.sizes == [] and not store.backend.data  # not a byte written, nothing kept
    finally:
        store.close()
