"""The stored page format: header fields, checksums, and every way a page can be bad."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_draft import HEADER_SIZE, HeaderProblem, PageFormatError, PoolKind, make_header, parse_header
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
