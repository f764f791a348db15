"""The pages the Store hands a backend: the caller's pages, each with its own header buffer.

They are built by compiled code (``_native.with_headers``) without running ``Page.__init__``, so
this checks that what comes out is an ordinary ``Page`` in every respect a backend or caller can
observe, and that objects which only look like pages still get the same result."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    Buffer,
    Capabilities,
    HostPool,
    Layout,
    Page,
    PageTransfer,
    PoolBinding,
    PoolCapability,
    PoolKind,
    PoolSpec,
    attach_headers,
    plan_binding,
)
from hicache_draft.binding import SlotPages
from hicache_draft.config import ParallelConfig

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


@settings(max_examples=25, deadline=None)
@given(pages=st.lists(st.integers(0, 5), max_size=8), lead=st.integers(0, 3), made=st.booleans())
def test_pages_named_by_slot_are_built_with_their_headers_as_ready_pages_get_them(pages, lead, made) -> None:
    """A zero-copy batch named by host slots (``SlotPages``: its pages built only when the Store
    hands them over, together with their headers) gets exactly what its pages built beforehand
    get: the same pages, header for header in one block after the transfers before it, and, for a
    ``page_set``, the same header bytes."""
    import torch

    ps = 4
    spec = PoolSpec(kind=PoolKind.KV, layers=2, page_size=ps, dtype="bfloat16", attention=Attention.MHA,
                    layout=Layout.PAGE_FIRST, kv_heads=2, head_dim=8)
    pool = HostPool(spec, 6)
    assert pool.raw is not None
    raw = pool.raw.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    caps = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset(Attention),
                                                           zero_copy_layouts=frozenset(Layout))})
    b = PoolBinding(plan_binding(spec, caps, ParallelConfig(), model="m", target_model="m"), pool)
    assert b.zero_copy
    groups = [f"{p:x}{i:x}" for i, p in enumerate(pages)]
    slots = [p * ps for p in pages]
    region = bytearray(range(256)) * 64
    before = PageTransfer(PoolKind.DRAFT, _pages(lead, 1, region), True)  # a transfer ahead of it
    named = b.zero_copy_transfer(groups, slots)
    assert isinstance(named.pages, SlotPages)
    ready = PageTransfer(named.pool, list(SlotPages(b, b.keys(groups), groups, slots)), True)
    got, want = attach_headers([before, named], made=made), attach_headers([before, ready], made=made)
    for g, w in zip(got, want, strict=True):
        assert [dataclasses.replace(p, header=None) for p in g.pages] == [
            dataclasses.replace(p, header=None) for p in w.pages]
        assert [bytes(p.header.view()) for p in g.pages] == [bytes(p.header.view()) for p in w.pages]
    heads = [p.header.ptr for t in got for p in t.pages]
    assert heads == [heads[0] + HEADER_SIZE * i for i in range(len(heads))] if heads else True
    assert all(any(p.header.view()) is made for t in got for p in t.pages)


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


def test_a_large_call_makes_its_headers_on_the_cores_threads(monkeypatch) -> None:
    """A large call's headers are made by the calling thread and the core's compiled helpers at
    once (Python threads sharing it started one after another), and are the same as made in one
    thread; a small call stays in the calling thread."""
    import os

    import hicache_draft.store as store_mod
    from hicache_draft import _native

    monkeypatch.setattr(store_mod, "_VERIFY_WORKERS", 4)
    monkeypatch.setattr(store_mod, "_VERIFY_CHUNK_BYTES", 64 << 10)
    region = bytearray(os.urandom(64 * (256 << 10)))
    pages = _pages(64, 1, region)  # 16 MiB: four threads' worth
    one = attach_headers([PageTransfer(PoolKind.KV, pages, True)], made=True)
    for _attempt in range(20):  # a helper that wakes after the caller made every header takes none
        before = _native.team_helped()
        many = attach_headers([PageTransfer(PoolKind.KV, pages, True)], made=True, parallel=True)
        assert [p.header.view().tobytes() for p in many[0].pages] == [p.header.view().tobytes() for p in one[0].pages]
        if _native.team_helped() > before:
            break
    else:
        pytest.fail("no helper thread made a header in 20 calls of 16 MiB")
    before = _native.team_helped()
    attach_headers([PageTransfer(PoolKind.KV, pages[:1], True)], made=True, parallel=True)
    assert _native.team_helped() == before


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=24), threads=st.integers(1, 6),
       flips=st.lists(st.integers(0, 10 ** 6), max_size=4), pools=st.lists(st.sampled_from(["kv", "draft", "x"]),
                                                                             min_size=1, max_size=3))
def test_a_check_shared_by_threads_finds_exactly_what_one_thread_finds(sizes, threads, flips, pools) -> None:
    import os

    import hicache_draft.store as store_mod

    todo = []
    keep = []
    for i, n in enumerate(sizes):
        body = bytearray(os.urandom(n))
        keep.append(body)
        page = Page(f"{i:064x}.{NS}", f"{i:064x}", NS, (Buffer.of(body) if n else Buffer(0, 0),))
        todo.append((pools[i % len(pools)], i, page))
    made = attach_headers([PageTransfer(pool, [p for q, _i, p in todo if q == pool]) for pool in dict.fromkeys(pools)
                           if any(q == pool for q, _i, _p in todo)], made=True)
    by_key = {p.key: p for t in made for p in t.pages}
    todo = [(pool, i, by_key[p.key]) for pool, i, p in todo]
    stored = [bytes(b) for b in keep]
    for f in flips:  # rot in some payloads
        body = keep[f % len(keep)]
        if body:
            body[f % len(body)] ^= 1
    one = store_mod._problems(todo, 1)
    many = store_mod._problems(todo, threads)
    assert [(pool, i) for pool, i, _p, _e in many] == [(pool, i) for pool, i, _p, _e in one]
    assert {i for _pool, i, _p, _e in one} == {i for i, b in enumerate(keep) if bytes(b) != stored[i]}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), nbuf=st.integers(0, 3), per_page_ns=st.booleans())
def test_compiled_pages_are_the_pages_init_makes(n, nbuf, per_page_ns) -> None:
    """``_native.make_pages`` (how a pool binding builds every batch: controller, SGLang adapter,
    kit) gives exactly the ``Page`` that ``Page(key, group, namespace, buffers)`` gives, frozen,
    hashable and equal, its header None; one namespace for all pages or one per page."""
    from hicache_draft import _native
    from hicache_draft.transfer import _PAGE_FIELDS

    region = bytearray(4096)
    ref = _pages(n, nbuf, region)
    nss = [f"{i:024x}" for i in range(n)] if per_page_ns else NS
    want = [dataclasses.replace(p, namespace=nss[i]) for i, p in enumerate(ref)] if per_page_ns else ref
    got = _native.make_pages([p.key for p in ref], (p.group for p in ref), nss, [p.buffers for p in ref], Page,
                             _PAGE_FIELDS)
    assert type(got) is list and len(got) == n
    for p, q in zip(want, got, strict=True):
        assert type(q) is Page and q == p and hash(q) == hash(p) and q.header is None and repr(q) == repr(p)
        with pytest.raises(dataclasses.FrozenInstanceError):
            q.group = "x"  # type: ignore[misc]


def test_compiled_slot_pages_refuse_bad_arguments_and_leak_nothing() -> None:
    """``_native.slot_pages`` (the zero-copy pages of host slots, binding.slot_batch): arguments
    it cannot use are refused by name; a slot that starts no page makes nothing and answers None;
    repeated calls keep no reference to the namespace, the owner or the cache's buffers."""
    from hicache_draft import _native
    from hicache_draft.transfer import _BUFFER_FIELDS, _PAGE_FIELDS

    owner = bytearray(64)
    tmpl = ((1000, 16, 64), (2000, 16, 64))

    def call(slots, ps=4, limit=32, template=tmpl, cache=None, keys=("a.b", "c.d"), groups=("a", "c"), ns=NS,
             heads=()):
        return _native.slot_pages(slots, ps, limit, template, owner, {} if cache is None else cache, 1 << 10,
                                  list(keys), list(groups), ns, Page, _PAGE_FIELDS, Buffer, _BUFFER_FIELDS, *heads)

    got = call([8, 0])
    assert [p.buffers for p in got] == [(Buffer(1128, 16, owner), Buffer(2128, 16, owner)),
                                         (Buffer(1000, 16, owner), Buffer(2000, 16, owner))]
    for bad in ([1, 0], [0, 32], [0, -4]):
        cache: dict[int, object] = {}
        assert call(bad, cache=cache) is None and cache == {}
    with pytest.raises(ValueError, match="differ in length"):
        call([0])
    with pytest.raises(ValueError, match="template of 0 buffers"):
        call([0, 4], template=())
    with pytest.raises(TypeError, match=r"\(ptr, nbytes, stride\)"):
        call([0, 4], template=((1, 2),))
    with pytest.raises(ValueError, match="bad arguments"):
        call([0, 4], ps=0)
    with pytest.raises(TypeError):
        call(["0", 4])
    with pytest.raises(ValueError, match="headers need a base address"):
        call([0, 4], heads=(0, owner))
    block = bytearray(128)
    got = call([8, 0], heads=(5000, block))  # page i's header: 64 bytes at base + 64 i, owned by the block
    assert [p.header for p in got] == [Buffer(5000, HEADER_SIZE, block), Buffer(5064, HEADER_SIZE, block)]
    assert all(p.header.owner is block for p in got) and call([8, 0], heads=(5000, None))[0].header is None
    refs = sys.getrefcount(NS), sys.getrefcount(owner), sys.getrefcount(block)
    cache = {}
    for _ in range(100):
        call([0, 4], cache=cache)
        call([12, 16], heads=(5000, block))
    gc.collect()
    assert len(cache) == 2 and sys.getrefcount(NS) <= refs[0] + 1
    assert sys.getrefcount(owner) <= refs[1] + 4  # the cached slots' buffers hold it, nothing else
    assert sys.getrefcount(block) <= refs[2] + 1


def test_compiled_pages_refuse_sequences_of_different_lengths() -> None:
    from hicache_draft import _native
    from hicache_draft.transfer import _PAGE_FIELDS

    bufs = [(Buffer(0, 0),)] * 2
    for args in ((["a.b"], ["a", "b"], NS, bufs), (["a.b", "c.d"], ["a", "c"], [NS], bufs),
                 (["a.b", "c.d"], ["a", "c"], NS, bufs[:1])):
        with pytest.raises(ValueError, match="differ in length"):
            _native.make_pages(*args, Page, _PAGE_FIELDS)
    before = sys.getrefcount(NS)
    for _ in range(100):
        _native.make_pages(["a.b", "c.d"], ["a", "c"], NS, bufs, Page, _PAGE_FIELDS)
    gc.collect()
    assert sys.getrefcount(NS) <= before + 1  # no reference leaked per page


def test_store_check_pages_finds_what_a_get_would_reject(tmp_path: Path) -> None:
    """``Store.check_pages`` is the core's verification of filled pages made alone (benchmarks time
    it apart from the backend's call): pages whose headers were made from their bytes pass; a page
    whose payload changed after, or whose header is another page's, is named with its problem."""
    from hicache_draft import HeaderProblem, Store

    region = bytearray(range(256)) * 64
    pages = [PageTransfer(PoolKind.KV, _pages(4, 2, region), True)]
    store = Store.open("file", {"root": str(tmp_path / "root")})
    try:
        made = store.attach_headers(pages, made=True)
        assert store.check_pages(made) == []
        first = made[0].pages[0].buffers[1]
        region[first.ptr - Buffer.of(region).ptr] ^= 0xFF  # one payload byte of page 0 changes
        other = made[0].pages[3].header
        head = made[0].pages[2].header
        assert other is not None and head is not None
        ctypes.memmove(head.ptr, other.ptr, HEADER_SIZE)  # page 2 carries page 3's header
        got = store.check_pages(made)
        assert [(pool, i) for pool, i, _ in got] == [(PoolKind.KV, 0), (PoolKind.KV, 2)]
        assert got[0][2].problem is HeaderProblem.PAYLOAD_CHECKSUM
        assert got[1][2].problem is not None
    finally:
        store.close()
