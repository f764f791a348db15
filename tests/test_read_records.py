"""``read_records``: the core reads a backend's stored records (the page format: each page's 64-byte
header, then its payload, back to back in a file) into the pages and verifies each as it lands.

What it must keep: every page it passes is byte-exact, every flipped byte or short record is caught
(whatever the read size, buffer split or offset), a backend that lies about the result still gets
nothing wrong reported restored, and once a call has been abandoned it writes nothing at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_draft.store as store_mod
from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store, hookimpl, make_header
from hicache_draft.testing import MemoryBackend
from tests.helpers import make_config, make_pair, slots, tokens

KV = PoolKind.KV
NS = "ab" * 12
pytestmark = pytest.mark.usefixtures("reset_memory_backend")


def _store() -> Store:
    return Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": os.urandom(4).hex()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    split=st.booleans(),
    chunk=st.sampled_from([1, 7, 64, 100, 4096, 256 << 10]),
    start=st.integers(0, 300),
    flips=st.lists(st.integers(0, 20000), max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 20000)),
    pool=st.sampled_from([KV, PoolKind.DRAFT, "indexer"]),
)
def test_records_are_read_and_verified_as_they_land(
    tmp_path, monkeypatch, sizes, split, chunk, start, flips, cut, pool
) -> None:
    monkeypatch.setattr(store_mod, "_RECORD_CHUNK", chunk)
    payloads = [os.urandom(n) for n in sizes]
    keys = [f"{i:064x}.{NS}" for i in range(len(sizes))]
    blob = bytearray(b"\x00" * start)
    spans = []
    for key, data in zip(keys, payloads, strict=True):
        spans.append((len(blob), len(blob) + 64 + len(data)))
        blob += make_header(key, NS, pool, [data]) + data
    for f in flips:
        if start <= f < len(blob):
            blob[f] ^= 0x5A
    if cut is not None:
        del blob[start + cut :]
    path = tmp_path / "records"
    path.write_bytes(bytes(blob))
    keep, pages = [], []
    for i, n in enumerate(sizes):
        parts = [bytearray(n // 3), bytearray(n - n // 3)] if split else [bytearray(n)]
        keep.append(parts)
        pages.append(Page(keys[i], keys[i][:64], NS, tuple(Buffer.of(p) if p else Buffer(0, 0) for p in parts)))
    store = _store()
    try:
        transfers = store.attach_headers([PageTransfer(pool, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers)
        fd = os.open(path, os.O_RDONLY)
        try:
            got = early.read_records(fd, start, [(pool, i) for i in range(len(pages))])
        finally:
            os.close(fd)
        assert got == max(0, min(len(blob), spans[-1][1]) - start)
        out = {pool: [PageResult.OK] * len(pages)}
        early.settle(out)
    finally:
        store.close()
    for i, (a, b) in enumerate(spans):
        damaged = any(a <= f < b for f in flips) or b > len(blob)
        if damaged and not (b <= len(blob) and bytes(blob[a:b]) == make_header(keys[i], NS, pool, [payloads[i]])
                            + payloads[i]):  # a flip can only leave a record intact by flipping nothing
            assert out[pool][i] is PageResult.CORRUPT, f"page {i} damaged but passed"
        else:
            assert out[pool][i] is PageResult.OK, f"page {i} intact but rejected"
            assert b"".join(keep[i]) == payloads[i]


class FromFiles(MemoryBackend):
    """A backend that keeps pages as records in a file and lets the core read them: ``page_get``
    writes the stored records it has into a scratch file, back to back, and hands them to
    ``read_records`` in one run (sleeping first, or rotting a byte of the file, when told)."""

    sleep_s: ClassVar[float] = 0.0
    rot_page: ClassVar[int | None] = None
    lie: ClassVar[bool] = False
    outcome: ClassVar[list[object]] = []

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], read_records) -> dict[str, list[PageResult]]:  # noqa: ANN001
        out = {}
        for t in transfers:
            res = [PageResult.MISS] * len(t.pages)
            blob, want = bytearray(), []
            for i, p in enumerate(t.pages):
                stored = self.data.get(p.key)
                if stored is not None:
                    if i == type(self).rot_page:
                        stored = stored[:-1] + bytes([stored[-1] ^ 1])
                    blob += stored
                    want.append(i)
            with tempfile.TemporaryFile() as f:
                f.write(blob)
                f.flush()
                time.sleep(type(self).sleep_s)
                try:
                    got = read_records(f.fileno(), 0, [(t.pool, i) for i in want])
                except Exception as exc:  # noqa: BLE001 - what the core answered is the point
                    type(self).outcome.append(exc)
                    continue
                type(self).outcome.append(got)
            for i in want:
                res[i] = PageResult.OK
            if type(self).lie:  # claims even the pages it never had
                res = [PageResult.OK] * len(t.pages)
            out[t.pool] = res
        return out


def _reset(**kw: object) -> None:
    FromFiles.sleep_s, FromFiles.rot_page, FromFiles.lie, FromFiles.outcome = 0.0, None, False, []
    for k, v in kw.items():
        setattr(FromFiles, k, v)


def test_pages_read_by_the_core_are_restored_exactly_and_rot_is_caught():
    _reset()
    writer, reader = make_pair(make_config(draft=None, batch_pages=8), FromFiles)
    toks = tokens(4)
    writer.backup(toks, slots(range(4)))
    res = reader.prefetch(toks, slots(range(8, 12)))
    assert res.pages == 4 and FromFiles.outcome == [4 * (64 + writer.target_pool.spec.page_nbytes)]
    for w, r in zip(slots(range(4)), slots(range(8, 12)), strict=True):
        wrote, read = writer.target_pool.page_view(w), reader.target_pool.page_view(r)
        assert torch.equal(wrote.view(torch.int16), read.view(torch.int16))
    _reset(rot_page=2)
    res = reader.prefetch(toks, slots(range(8, 12)))
    assert res.pages == 2 and reader.metrics.snapshot()["kv"]["corrupt"] == 1


def test_a_backend_that_claims_pages_the_core_did_not_read_gets_nothing_wrong():
    _reset()
    writer, reader = make_pair(make_config(draft=None, batch_pages=8), FromFiles)
    toks = tokens(4)
    writer.backup(toks[:8], slots(range(2)))  # pages 2, 3 never stored
    _reset(lie=True)
    res = reader.prefetch(toks, slots(range(8, 12)))
    assert res.pages == 2  # the two it never had are checked after the call: zeroed headers fail


def test_after_the_call_was_abandoned_the_core_reads_nothing_into_its_memory():
    """The backend sleeps past its deadline, then asks the core to read: refused, memory untouched."""
    _reset()
    writer, reader = make_pair(make_config(draft=None, batch_pages=8, timeout_s=0.25), FromFiles)
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    reader.target_pool.raw.zero_()
    _reset(sleep_s=0.5)
    res = reader.prefetch(toks, slots(range(8, 11)))
    assert res.pages == 0
    deadline = time.monotonic() + 5
    while not FromFiles.outcome and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(FromFiles.outcome) == 1 and isinstance(FromFiles.outcome[0], RuntimeError)
    assert not reader.target_pool.raw.any(), "the core read records into slots of an abandoned call"


def test_a_page_can_be_read_once():
    store = _store()
    try:
        mem = bytearray(64)
        page = Page(f"{0:064x}.{NS}", f"{0:064x}", NS, (Buffer.of(mem),))
        transfers = store.attach_headers([PageTransfer(KV, [page])], made=False)
        early = store_mod._EarlyVerifier(store, transfers)
        with tempfile.TemporaryFile() as f:
            f.write(make_header(page.key, NS, KV, [bytes(64)]) + bytes(64))
            f.flush()
            assert early.read_records(f.fileno(), 0, [(KV, 0)]) == 128
            with pytest.raises(ValueError, match="already"):
                early.read_records(f.fileno(), 0, [(KV, 0)])
            with pytest.raises(ValueError, match="no page"):
                early.read_records(f.fileno(), 0, [(KV, 5)])
    finally:
        store.close()


@pytest.mark.parametrize("bad", [(KV, 2), (KV, -1), (KV, True), (KV, 1.0), (KV, "1"), (KV, None), ("nope", 0)])
def test_read_records_refuses_a_page_not_in_the_call_and_unmarks_the_run(bad):
    """A run naming a page the call does not have (out of range, negative, not an int, another pool)
    is refused with the page named; the pages of the run marked before it are free again."""
    store = _store()
    try:
        mem = [bytearray(64), bytearray(64)]
        pages = [Page(f"{i:064x}.{NS}", f"{i:064x}", NS, (Buffer.of(m),)) for i, m in enumerate(mem)]
        transfers = store.attach_headers([PageTransfer(KV, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers)
        with tempfile.TemporaryFile() as f:
            for p in pages:
                f.write(make_header(p.key, NS, KV, [bytes(64)]) + bytes(64))
            f.flush()
            with pytest.raises(ValueError, match=f"no page {bad[1]!r} of pool {bad[0]!r}"):
                early.read_records(f.fileno(), 0, [(KV, 0), bad])
            assert early.read_records(f.fileno(), 0, [(KV, 0), (KV, 1)]) == 256
            out = {KV: [PageResult.OK, PageResult.OK]}
            early.settle(out)
            assert out[KV] == [PageResult.OK, PageResult.OK]
    finally:
        store.close()


def test_a_read_that_fails_after_the_backend_returned_still_leaves_its_pages_checked(monkeypatch):
    """A backend that returns OK while one of its threads is still inside ``read_records``, which then
    fails: those pages were marked as being checked when the call ended, so they are checked after
    it (zeroed headers fail), never counted restored unverified."""
    import threading

    inside, release = threading.Event(), threading.Event()

    def slow_failing_read(*args: object) -> tuple[int, list[int]]:
        inside.set()
        release.wait(10)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store_mod._native, "read_check", slow_failing_read)

    class Early(MemoryBackend):
        @hookimpl
        def page_get(self, transfers: Sequence[PageTransfer], read_records) -> dict[str, list[PageResult]]:  # noqa: ANN001
            t = transfers[0]
            worker = threading.Thread(target=lambda: _swallow(read_records, [(t.pool, i) for i in range(len(t.pages))]))
            worker.start()
            inside.wait(10)
            threading.Timer(0.3, release.set).start()  # fails once the Store is settling the call
            return {t.pool: [PageResult.OK] * len(t.pages)}

    def _swallow(read_records, pages) -> None:  # noqa: ANN001
        with contextlib.suppress(OSError):
            read_records(-1, 0, pages)

    store = Store("early", Early, Early.capabilities, {"space": os.urandom(4).hex()})
    try:
        mem = [bytearray(256) for _ in range(3)]
        pages = [Page(f"{i:064x}.{NS}", f"{i:064x}", NS, (Buffer.of(m),)) for i, m in enumerate(mem)]
        got, _ = store.page_get([PageTransfer(KV, pages)])
        assert got[KV] == [PageResult.CORRUPT] * 3
    finally:
        release.set()
        store.close()
