"""The pages the Store hands a backend: the caller's pages, each with its own header buffer.

They are built by compiled code (``_native.with_headers``) without running ``Page.__init__``, so
this checks that what comes out is an ordinary ``Page`` in every respect a backend or caller can
observe, and that objects which only look like pages still get the same result."""

from __future__ import annotations

import dataclasses
import gc
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import HEADER_SIZE, Buffer, Page, PageTransfer, PoolKind, attach_headers

NS = "ab" * 12


def _pages(n: int, nbuf: int, region: bytearray) -> list[Page]:
    whole = Buffer.of(region)
    size = len(region) // max(1, n * nbuf)
    return [
        Page(f"{i:064x}.{NS}", f"{i:064x}", NS,
             tuple(Buffer(whole.ptr + (i * nbuf + j) * size, size, whole) for j in range(nbuf)))
        for i in range(n)
    ]


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=3), nbuf=st.integers(1, 3), made=st.booleans())
def test_pages_with_headers_are_the_callers_pages_plus_their_own_header(counts, nbuf, made) -> None:
    region = bytearray(range(256)) * 64
    transfers = [PageTransfer(pool, _pages(n, nbuf, region), True)
                 for pool, n in zip((PoolKind.KV, PoolKind.DRAFT, "indexer"), counts, strict=False)]
    out = attach_headers(transfers, made=made)
    heads = []
    for t, o in zip(transfers, out, strict=True):
        assert (o.pool, o.zero_copy, len(o.pages)) == (t.pool, t.zero_copy, len(t.pages))
        for p, q in zip(t.pages, o.pages, strict=True):
            assert type(q) is Page and q.header is not None and type(q.header) is Buffer
            same = dataclasses.replace(p, header=q.header)
            assert q == same and hash(q) == hash(same)
            assert (q.key, q.group, q.namespace, q.buffers, q.nbytes) == (p.key, p.group, p.namespace, p.buffers,
                                                                           p.nbytes)
            assert q.header.nbytes == HEADER_SIZE and q.header.owner is not None and repr(q)
            with pytest.raises(dataclasses.FrozenInstanceError):
                q.key = "x"  # type: ignore[misc]
            heads.append(q.header.ptr)
    # one block, one header after another, in call order; zeroed for page_get, made for page_set
    assert heads == [heads[0] + HEADER_SIZE * i for i in range(len(heads))] if heads else True
    for o in out:
        for q in o.pages:
            assert any(q.header.view()) is made


def test_objects_that_only_look_like_pages_get_the_same_pages() -> None:
    @dataclasses.dataclass(frozen=True)
    class Lookalike:
        key: str
        group: str
        namespace: str
        buffers: tuple[Buffer, ...]
        header: Buffer | None = None

        @property
        def nbytes(self) -> int:
            return sum(b.nbytes for b in self.buffers)

    region = bytearray(4096)
    real = _pages(3, 1, region)
    fake = [Lookalike(p.key, p.group, p.namespace, p.buffers) for p in real]
    a = attach_headers([PageTransfer(PoolKind.KV, real)], made=True)[0].pages
    b = attach_headers([PageTransfer(PoolKind.KV, fake)], made=True)[0].pages  # type: ignore[arg-type]
    assert [type(p) for p in b] == [Page] * 3
    def seen(pages: list[Page]) -> list[tuple[str, tuple[Buffer, ...], bytes]]:
        return [(p.key, p.buffers, bytes(p.header.view())) for p in pages]

    assert seen(a) == seen(b)


def test_building_pages_keeps_every_reference_count_right() -> None:
    region = bytearray(1 << 16)
    pages = _pages(64, 2, region)
    key, bufs = pages[0].key, pages[0].buffers
    before = (sys.getrefcount(key), sys.getrefcount(bufs))
    out = attach_headers([PageTransfer(PoolKind.KV, pages)], made=False)
    owner = out[0].pages[0].header.owner
    assert sys.getrefcount(key) == before[0] + 1 and sys.getrefcount(bufs) == before[1] + 1
    assert sys.getrefcount(owner) == 2 + 64  # the local name, getrefcount's argument, every header
    del out
    gc.collect()
    assert (sys.getrefcount(key), sys.getrefcount(bufs)) == before and sys.getrefcount(owner) == 2


def test_a_large_call_makes_its_headers_on_every_share_at_once(monkeypatch) -> None:
    """The shares of a large call are made side by side: the caller's own share while the
    executor's run (it waited for the executor's shares before starting its own, so a call took
    the sum of its shares, not the longest). Every share meets at a barrier, which only all of
    them running at once can pass; the headers are the same as made in one thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import hicache_draft.store as store_mod

    monkeypatch.setattr(store_mod, "_VERIFY_WORKERS", 2)
    monkeypatch.setattr(store_mod, "_VERIFY_CHUNK_BYTES", 1024)
    region = bytearray(range(256)) * 64
    pages = _pages(8, 1, region)  # 16 KiB: two shares of 8 KiB
    one = attach_headers([PageTransfer(PoolKind.KV, pages, True)], made=True)
    barrier = threading.Barrier(2, timeout=10)
    real = store_mod.pack_page_headers

    def pack(view, share, pool):  # noqa: ANN001, ANN202
        barrier.wait()  # BrokenBarrierError (fails the call) unless both shares are here at once
        return real(view, share, pool)

    monkeypatch.setattr(store_mod, "pack_page_headers", pack)
    with ThreadPoolExecutor(2) as ex:
        two = attach_headers([PageTransfer(PoolKind.KV, pages, True)], made=True, executor=ex)
    assert [p.header.view().tobytes() for p in two[0].pages] == [p.header.view().tobytes() for p in one[0].pages]
