"""``make_headers``: a backend that declares ``headers_on_demand`` asks the core for the headers of
the pages it is about to send, a piece of the batch at a time.

What it must keep: the headers are exactly the ones the core makes before a call (whatever the
pages, pieces and order asked), a page sent without asking keeps a zero header and is never served,
a page not in the call is refused by name, and once the call has returned or was abandoned nothing
more is made: a backend that sleeps past its deadline and then asks gets an error, not a header."""

from __future__ import annotations

import os
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
)
from hicache_draft.testing import MemoryBackend

KV = PoolKind.KV
NS = "ef" * 12
pytestmark = pytest.mark.usefixtures("reset_memory_backend")


def _pages(sizes: Sequence[int], pool: str = KV) -> tuple[list[Page], list[bytearray]]:
    keep = [bytearray(os.urandom(n)) for n in sizes]
    pages = [Page(f"{i:064x}.{NS}", f"{i:064x}", NS, (Buffer.of(b),)) for i, b in enumerate(keep)]
    return pages, keep


class OnDemand(MemoryBackend):
    """A backend that sends its pages in pieces and asks the core for each piece's headers first
    (after sleeping when told; ``skip``: indices it sends without asking)."""

    capabilities: ClassVar[Capabilities] = MemoryBackend.capabilities.model_copy(update={"headers_on_demand": True})
    piece: ClassVar[int] = 2
    sleep_s: ClassVar[float] = 0.0
    skip: ClassVar[set[int]] = set()
    outcome: ClassVar[list[object]] = []

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], make_headers) -> dict[str, list[PageResult]]:  # noqa: ANN001
        cls = type(self)
        out = {}
        for t in transfers:
            assert all(not any(p.header.view()) for p in t.pages)  # zeroed: made when asked
            res = [PageResult.FAILED] * len(t.pages)
            time.sleep(cls.sleep_s)
            for a in range(0, len(t.pages), cls.piece):
                ask = [i for i in range(a, min(a + cls.piece, len(t.pages))) if i not in cls.skip]
                try:
                    make_headers(t.pool, ask)
                except Exception as exc:  # noqa: BLE001 - what the core answered is the point
                    cls.outcome.append(exc)
                    break
                for i in range(a, min(a + cls.piece, len(t.pages))):
                    p = t.pages[i]
                    self.data[p.key] = p.header.view().tobytes() + b"".join(b.view().tobytes() for b in p.buffers)
                    res[i] = PageResult.OK
            out[t.pool] = res
        return out


def _reset(**kw: object) -> None:
    OnDemand.piece, OnDemand.sleep_s, OnDemand.skip, OnDemand.outcome = 2, 0.0, set(), []
    for k, v in kw.items():
        setattr(OnDemand, k, v)


def _store() -> Store:
    return Store("ondemand", OnDemand, OnDemand.capabilities, {"space": os.urandom(4).hex()})


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=6), order=st.randoms(use_true_random=False),
       shared=st.booleans())
def test_the_headers_made_on_demand_are_the_ones_made_before_a_call(sizes, order, shared) -> None:
    """Any pages, asked in any order and grouping, in the asking thread or shared with the core's
    compiled threads, get the headers the core makes before a call."""
    pages, _keep = _pages(sizes)
    before = attach_headers([PageTransfer(KV, pages)], made=True)[0].pages
    zeroed = attach_headers([PageTransfer(KV, pages)], made=False)
    maker = store_mod._HeaderMaker(zeroed, time.monotonic() + 60)
    idx = list(range(len(pages)))
    order.shuffle(idx)
    chunk = store_mod._VERIFY_CHUNK_BYTES
    store_mod._VERIFY_CHUNK_BYTES = 4096 if shared else chunk  # shared: any request of 8 KiB or more
    try:
        while idx:
            n = order.randint(1, len(idx))
            maker.make_headers(KV, idx[:n])
            idx = idx[n:]
    finally:
        store_mod._VERIFY_CHUNK_BYTES = chunk
    maker.close()
    assert [p.header.view().tobytes() for p in zeroed[0].pages] == [p.header.view().tobytes() for p in before]


def test_pages_sent_with_their_headers_come_back_and_one_sent_without_never_does() -> None:
    _reset(skip={1})
    store = _store()
    try:
        pages, keep = _pages([70_000, 4096, 3 << 20])
        assert store.page_set([PageTransfer(KV, pages)])[KV] == [PageResult.OK] * 3
        out = [bytearray(len(b)) for b in keep]
        back = [Page(p.key, p.group, p.namespace, (Buffer.of(o),)) for p, o in zip(pages, out, strict=True)]
        got, _ = store.page_get([PageTransfer(KV, back)])
        assert got[KV] == [PageResult.OK, PageResult.CORRUPT, PageResult.OK]  # its header stayed zero
        assert out[0] == keep[0] and out[2] == keep[2]
    finally:
        store.close()


def test_a_page_not_in_the_call_is_refused_by_name() -> None:
    pages, _keep = _pages([100, 100])
    maker = store_mod._HeaderMaker(attach_headers([PageTransfer(KV, pages)], made=False), time.monotonic() + 60)
    for pool, bad in ((KV, 2), (KV, -1), (KV, True), (KV, "0"), (PoolKind.DRAFT, 0)):
        with pytest.raises(ValueError, match=f"no page {bad!r} of pool {pool!r}"):
            maker.make_headers(pool, [0, bad])


def test_a_backend_that_sleeps_past_its_deadline_then_asks_is_refused() -> None:
    _reset(sleep_s=0.4)
    store = _store()
    try:
        pages, _keep = _pages([65536, 2 << 20])
        rep = store.call("page_set", [PageTransfer(KV, pages)], timeout_s=0.05)
        assert rep.outcome == "timeout" and rep.results[KV] == [PageResult.FAILED] * 2
        rep.released.result(timeout=30)
        assert len(OnDemand.outcome) == 1 and isinstance(OnDemand.outcome[0], RuntimeError)
        assert not store.backend.data  # nothing sent: no header was made for it
    finally:
        store.close()


def test_the_store_hands_zeroed_headers_only_to_a_backend_that_declares_it() -> None:
    """Decided from the declaration: the same backend without ``headers_on_demand`` gets headers
    made before the call and ``make_headers=None``."""
    seen: list[object] = []

    class Declares(OnDemand):
        pass

    class DoesNot(MemoryBackend):
        @hookimpl
        def page_set(self, transfers, make_headers):  # noqa: ANN001, ANN202
            seen.append(make_headers)
            assert all(any(p.header.view()) for t in transfers for p in t.pages)  # made before the call
            return {t.pool: [PageResult.OK] * len(t.pages) for t in transfers}

    _reset()
    for cls in (Declares, DoesNot):
        store = Store(cls.__name__.lower(), cls, cls.capabilities, {"space": os.urandom(4).hex()})
        try:
            pages, _keep = _pages([1000, 2000])
            assert store.page_set([PageTransfer(KV, pages)])[KV] == [PageResult.OK] * 2
        finally:
            store.close()
    assert seen == [None]


def test_once_the_call_ended_no_header_is_made() -> None:
    """The stop flag ``close`` sets is read before every page: a request under way stops at its next
    page, and once ``close`` returned nothing writes a header any more."""
    from hicache_draft import _native
    from hicache_draft.page_format import namespace_bytes, pool_code

    pages, _keep = _pages([1 << 20] * 8)
    zeroed = attach_headers([PageTransfer(KV, pages)], made=False)[0].pages
    with pytest.raises(TimeoutError):  # the flag already set: not one header made, on any thread
        _native.pack_headers(None, zeroed, pool_code(KV), namespace_bytes, 4, float("inf"), bytearray(b"\x01"))
    with pytest.raises(TimeoutError):  # the deadline passed
        _native.pack_headers(None, zeroed, pool_code(KV), namespace_bytes, 4, time.monotonic() - 1, None)
    assert not any(any(p.header.view()) for p in zeroed)
    maker = store_mod._HeaderMaker([PageTransfer(KV, zeroed)], time.monotonic() + 60)
    maker.close()
    with pytest.raises(RuntimeError, match="ended or was abandoned"):
        maker.make_headers(KV, [0])
    assert not any(any(p.header.view()) for p in zeroed)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 600_000), min_size=1, max_size=6), parts=st.integers(1, 3),
       order=st.randoms(use_true_random=False), shared=st.booleans(), slack=st.integers(0, 100))
def test_records_packed_into_destinations_are_header_and_bytes(sizes, parts, order, shared, slack) -> None:
    """``make_headers(pool, indices, into)``: each destination gets the page's record (the header the
    core makes before a call, then the payload of all its buffers), the page's own header is set too,
    whatever the sizes (whole pages and ones copied piece by piece), buffers per page, order and
    sharing; bytes past the record are left alone."""
    keep = [[bytearray(os.urandom(n // parts + (k < n % parts))) for k in range(parts)] for n in sizes]
    pages = [Page(f"{i:064x}.{NS}", f"{i:064x}", NS, tuple(Buffer.of(b) for b in bufs)) for i, bufs in enumerate(keep)]
    before = attach_headers([PageTransfer(KV, pages)], made=True)[0].pages
    zeroed = attach_headers([PageTransfer(KV, pages)], made=False)
    maker = store_mod._HeaderMaker(zeroed, time.monotonic() + 60)
    idx = list(range(len(pages)))
    order.shuffle(idx)
    dsts = {i: bytearray(b"\xa5" * (64 + sizes[i] + slack)) for i in idx}
    chunk = store_mod._VERIFY_CHUNK_BYTES
    store_mod._VERIFY_CHUNK_BYTES = 4096 if shared else chunk
    try:
        while idx:
            n = order.randint(1, len(idx))
            maker.make_headers(KV, idx[:n], [memoryview(dsts[i]) for i in idx[:n]])
            idx = idx[n:]
    finally:
        store_mod._VERIFY_CHUNK_BYTES = chunk
    maker.close()
    for i, p in enumerate(before):
        record = p.header.view().tobytes() + b"".join(bytes(b) for b in keep[i])
        assert bytes(dsts[i]) == record + b"\xa5" * slack
        assert zeroed[0].pages[i].header.view().tobytes() == p.header.view().tobytes()


def test_records_refuse_bad_destinations_and_write_nothing() -> None:
    """A destination too small, one too few, or a page given twice is refused by name before any
    byte is written; once the call ended nothing is written either."""
    pages, _keep = _pages([1000, 70_000])
    zeroed = attach_headers([PageTransfer(KV, pages)], made=False)
    maker = store_mod._HeaderMaker(zeroed, time.monotonic() + 60)
    small = [bytearray(64 + 1000), bytearray(64 + 69_999)]
    with pytest.raises(ValueError, match="destination 1 holds 70063 bytes, its record needs 70064"):
        maker.make_headers(KV, [0, 1], small)
    with pytest.raises(ValueError, match=f"2 pages of pool {KV!r} but 1 destinations"):
        maker.make_headers(KV, [0, 1], small[:1])
    with pytest.raises(ValueError, match="given twice"):
        maker.make_headers(KV, [0, 0], [bytearray(2000), bytearray(2000)])
    with pytest.raises(ValueError, match="is not writable memory"):
        maker.make_headers(KV, [0], [bytes(2000)])
    assert not any(any(b) for b in small) and not any(any(p.header.view()) for p in zeroed[0].pages)
    maker.close()
    late = [bytearray(64 + 1000)]
    with pytest.raises(RuntimeError, match="ended or was abandoned"):
        maker.make_headers(KV, [0], late)
    assert not any(late[0]) and not any(any(p.header.view()) for p in zeroed[0].pages)


def test_records_stop_at_the_stop_flag_and_the_deadline() -> None:
    from hicache_draft import _native
    from hicache_draft.page_format import namespace_bytes, pool_code

    pages, _keep = _pages([1 << 20] * 8)
    zeroed = attach_headers([PageTransfer(KV, pages)], made=False)[0].pages
    dsts = [bytearray(64 + (1 << 20)) for _ in zeroed]
    with pytest.raises(TimeoutError):
        _native.pack_records(zeroed, dsts, pool_code(KV), namespace_bytes, 4, float("inf"), bytearray(b"\x01"))
    with pytest.raises(TimeoutError):
        _native.pack_records(zeroed, dsts, pool_code(KV), namespace_bytes, 4, time.monotonic() - 1, None)
    assert not any(any(d) for d in dsts) and not any(any(p.header.view()) for p in zeroed)
