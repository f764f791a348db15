"""The stored page format: header fields, checksums, and every way a page can be bad."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_draft import (
    HEADER_SIZE,
    HeaderProblem,
    PageFormatError,
    PoolKind,
    make_header,
    make_headers,
    parse_header,
)
from hicache_draft.page_format import verify_payload

KEY = "ab" * 32 + "." + "cd" * 12
NS = "cd" * 12


def _page(payload: bytes, key: str = KEY, ns: str = NS, pool: PoolKind = PoolKind.KV) -> bytes:
    return make_header(key, ns, pool, [payload]) + payload


def _check(blob: bytes, expected_len: int, key: str = KEY, ns: str = NS, pool: PoolKind = PoolKind.KV) -> None:
    h = parse_header(blob, key, ns, pool)
    verify_payload(h, [blob[HEADER_SIZE:]], expected_len)


@given(st.binary(max_size=2048))
def test_round_trip(payload):
    blob = _page(payload)
    assert len(blob) == HEADER_SIZE + len(payload)
    _check(blob, len(payload))


def test_header_bytes_are_frozen():
    # The on-disk format of every stored page: a change here makes earlier stores unreadable.
    head = make_header(KEY, NS, PoolKind.DRAFT, [b"x" * 100, b"y" * 50])
    assert head.hex() == (
        "484344504147450001000100400000009600000000000000e8cdf76b56f71462"
        "cdcdcdcdcdcdcdcdcdcdcdcd2568c787e244783c73df6645adc4116e17dbc3b2"
    )


_hex = st.text("0123456789abcdef", min_size=1, max_size=40)


@given(st.lists(
    st.tuples(
        _hex, st.one_of(_hex, st.text(max_size=30)), st.sampled_from(list(PoolKind)),
        st.lists(st.binary(max_size=300), max_size=3),
        st.sampled_from(["bytes", "bytearray", "view", "wide_view"]),
    ),
    max_size=12,
))
def test_batched_headers_equal_one_by_one(pages):
    def as_kind(part: bytes, kind: str) -> object:
        if kind == "bytearray":
            return bytearray(part)
        if kind == "view":
            return memoryview(part)
        if kind == "wide_view" and len(part) % 4 == 0:
            return memoryview(part).cast("I")  # nbytes != len: the length must be in bytes
        return part

    items = [(f"{g}.{g}", ns, pool, [as_kind(p, kind) for p in parts]) for g, ns, pool, parts, kind in pages]
    batched = make_headers(items)
    assert bytes(batched) == b"".join(make_header(*item) for item in items)
    for i, (key, ns, pool, parts) in enumerate(items):
        blob = bytes(batched[i * HEADER_SIZE : (i + 1) * HEADER_SIZE])
        payload = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        verify_payload(parse_header(blob, key, ns, pool), [payload], len(payload))


def test_split_payload_buffers_hash_like_one():
    a, b = b"x" * 100, b"y" * 50
    assert make_header(KEY, NS, PoolKind.DRAFT, [a, b]) == make_header(KEY, NS, PoolKind.DRAFT, [a + b])


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda b: b[:10], HeaderProblem.SHORT),
        (lambda b: b"XXXXXXXX" + b[8:], HeaderProblem.MAGIC),
        (lambda b: b[:8] + b"\x09\x00" + b[10:], HeaderProblem.VERSION),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], HeaderProblem.HEADER_CHECKSUM),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), HeaderProblem.PAYLOAD_CHECKSUM),
        (lambda b: b[:-5], HeaderProblem.LENGTH),
    ],
)
def test_bad_pages_are_rejected(mutate, problem):
    payload = bytes(range(256)) * 4
    with pytest.raises(PageFormatError) as err:
        blob = mutate(_page(payload))
        h = parse_header(blob, KEY, NS, PoolKind.KV)
        verify_payload(h, [blob[HEADER_SIZE:]], len(blob) - HEADER_SIZE)
    assert err.value.problem is problem


def test_foreign_key_namespace_pool_and_length():
    blob = _page(b"abc" * 10)
    with pytest.raises(PageFormatError) as e1:
        parse_header(blob, "ef" * 32 + "." + NS, NS, PoolKind.KV)
    assert e1.value.problem is HeaderProblem.FOREIGN
    with pytest.raises(PageFormatError) as e2:
        parse_header(blob, KEY, "ee" * 12, PoolKind.KV)
    assert e2.value.problem is HeaderProblem.FOREIGN
    with pytest.raises(PageFormatError) as e3:
        parse_header(blob, KEY, NS, PoolKind.DRAFT)
    assert e3.value.problem is HeaderProblem.POOL
    h = parse_header(blob, KEY, NS, PoolKind.KV)
    with pytest.raises(PageFormatError) as e4:
        verify_payload(h, [blob[HEADER_SIZE:]], 31)
    assert e4.value.problem is HeaderProblem.LENGTH


def _verdict(fn, *args) -> str | None:  # noqa: ANN001
    try:
        fn(*args)
    except PageFormatError as exc:
        return exc.problem.value
    return None


@given(
    payload=st.binary(min_size=1, max_size=300),
    flips=st.lists(st.tuples(st.integers(0, HEADER_SIZE + 299), st.integers(1, 255)), max_size=3),
    expected_delta=st.sampled_from([0, 0, 0, -1, 1]),
    pool=st.sampled_from(list(PoolKind)),
    other_pool=st.booleans(),
)
def test_the_cores_one_pass_check_agrees_with_the_parser(payload, flips, expected_delta, pool, other_pool):
    """check_page (the core's fast check of every restored page) accepts exactly what
    parse_header + verify_payload accept, and names the same problem."""
    from hicache_draft.page_format import check_page

    blob = bytearray(_page(payload, pool=pool))
    for at, x in flips:
        if at < len(blob):
            blob[at] ^= x
    want_pool = next(p for p in PoolKind if p is not pool) if other_pool else pool
    n = len(payload) + expected_delta
    old = _verdict(_check, bytes(blob), n, KEY, NS, want_pool)
    new = _verdict(check_page, blob[:HEADER_SIZE], KEY, NS, want_pool, [memoryview(blob)[HEADER_SIZE:]], n)
    assert new == old


def _pages_with_headers(payloads: list[list[bytes]], pool: str, keys: list[str], namespaces: list[str]):
    """Pages as the Store builds them: buffers and a 64-byte header in memory it owns."""
    from hicache_draft import Buffer, Page
    from hicache_draft.page_format import pack_page_headers

    keep = []
    pages = []
    for parts, key, ns in zip(payloads, keys, namespaces, strict=True):
        bufs = []
        for p in parts:
            mem = bytearray(p)
            keep.append(mem)
            bufs.append(Buffer.of(mem) if mem else Buffer(0, 0))
        pages.append(Page(key, key.split(".")[0], ns, tuple(bufs)))
    block = bytearray(HEADER_SIZE * len(pages))
    pack_page_headers(block, pages, pool)
    whole = Buffer.of(block)
    out = [Page(p.key, p.group, p.namespace, p.buffers, Buffer(whole.ptr + HEADER_SIZE * i, HEADER_SIZE, whole))
           for i, p in enumerate(pages)]
    return out, block, keep


@given(
    payloads=st.lists(st.lists(st.binary(max_size=400), min_size=1, max_size=3), min_size=1, max_size=6),
    namespaces=st.lists(st.one_of(st.just(NS), st.text(max_size=30), _hex), min_size=6, max_size=6),
    pool=st.sampled_from([*PoolKind, "indexer", "swa", "an open pool"]),
)
def test_compiled_page_headers_equal_make_header(payloads, namespaces, pool):
    """The Store's headers (one compiled call over Page objects) are make_header's, byte for byte,
    whatever the namespace (hex fingerprint or anything else), key characters, pool and buffers."""
    keys = [f"{i:02x}é{i}.{ns[:4]}" for i, ns in enumerate(namespaces[: len(payloads)])]
    pages, block, _keep = _pages_with_headers(payloads, pool, keys, namespaces[: len(payloads)])
    for i, (parts, key, ns) in enumerate(zip(payloads, keys, namespaces, strict=False)):
        assert bytes(block[HEADER_SIZE * i : HEADER_SIZE * (i + 1)]) == make_header(key, ns, pool, parts)


@given(
    payloads=st.lists(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=3), min_size=1, max_size=5),
    flips=st.lists(st.tuples(st.integers(0, 4), st.integers(0, HEADER_SIZE + 899), st.integers(1, 255)), max_size=3),
    pool=st.sampled_from([*PoolKind, "indexer"]),
    asked=st.sampled_from([None, *PoolKind, "indexer"]),
)
def test_compiled_verification_flags_exactly_what_check_page_rejects(payloads, flips, pool, asked):
    """corrupt_pages (the Store's check of every restored page) flags exactly the pages check_page
    rejects: a flipped byte anywhere in a header or payload, or a page checked as another pool."""
    from hicache_draft.page_format import check_page, corrupt_pages

    keys = [f"{i:064x}.{NS}" for i in range(len(payloads))]
    pages, block, keep = _pages_with_headers(payloads, pool, keys, [NS] * len(payloads))
    sizes = [sum(len(p) for p in parts) for parts in payloads]
    for which, at, x in flips:
        if which >= len(pages):
            continue
        if at < HEADER_SIZE:
            block[HEADER_SIZE * which + at] ^= x
        elif at - HEADER_SIZE < sizes[which]:
            off = at - HEADER_SIZE
            bufs = [b for b in keep[sum(len(p) for p in payloads[:which]):][: len(payloads[which])]]
            for mem in bufs:
                if off < len(mem):
                    mem[off] ^= x
                    break
                off -= len(mem)
    checked = asked or pool
    expected = [
        i for i, p in enumerate(pages)
        if _verdict(check_page, p.header.view(), p.key, p.namespace, checked, [b.view() for b in p.buffers],
                    p.nbytes) is not None
    ]
    assert corrupt_pages(pages, checked) == expected
