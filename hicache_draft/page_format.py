"""The stored page format: a fixed 64-byte header with checksums, then the raw page bytes.

Never pickle, never ``torch.load``: a page is bytes, and the header says whose bytes they are.

Header (little-endian)::

    0   8s  magic            b"HCDPAGE\\x00"
    8   H   format version   1
    10  B   pool             0 = kv, 1 = draft
    11  B   flags            0
    12  I   header length    64
    16  Q   payload length   bytes after the header
    24  Q   payload checksum xxh3_64 of the payload
    32  12s namespace        the key's 96-bit namespace fingerprint
    44  16s key digest       blake2b-128 of the full key
    60  I   header checksum  xxh32 of bytes 0..59

Checksum choice: xxh3_64 (the reference C code: the ``xxhash`` package binds it, and the core's
compiled module ``hicache_draft._native`` inlines it for batches) runs at memory speed (tens of
GB/s on one core), so validating every read costs little next to the I/O; it detects corruption
and truncation, not tampering (that is not its job here).

Headers of batches are made and checked by ``hicache_draft._native`` (:func:`make_headers`,
:func:`pack_page_headers`, :func:`corrupt_pages`), one call per batch with the GIL released; the
Python parser (:func:`parse_header`, :func:`check_page`) says why a page failed.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import xxhash

from hicache_draft import _native
from hicache_draft.capabilities import PoolKind
from hicache_draft.transfer import Buffer, Page

MAGIC = b"HCDPAGE\x00"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEAD = struct.Struct("<8sHBBIQQ12s16s")
_HEAD_FULL = struct.Struct("<8sHBBIQQ12s16sI")  # the same, with the trailing header checksum
_HEADER_SUM = struct.Struct("<I")
assert _HEAD.size + 4 == HEADER_SIZE


@functools.lru_cache(maxsize=256)
def pool_code(pool: str) -> int:
    """The header's one-byte pool code: 0 for ``kv``, 1 for ``draft`` (format 1 as it was), and
    2..255 from a hash of any other pool's name (whose name is also in the namespace)."""
    if pool == PoolKind.KV:
        return 0
    if pool == PoolKind.DRAFT:
        return 1
    return 2 + xxhash.xxh32_intdigest(str(pool).encode()) % 254


class HeaderProblem(StrEnum):
    """Why a stored page is not acceptable (each is a miss, never data)."""

    SHORT = "truncated header"
    MAGIC = "bad magic"
    VERSION = "unsupported format version"
    HEADER_CHECKSUM = "header checksum mismatch"
    FOREIGN = "header of another key or namespace"
    POOL = "header of another pool"
    LENGTH = "payload length mismatch"
    PAYLOAD_CHECKSUM = "payload checksum mismatch"


class PageFormatError(ValueError):
    """A stored page failed validation; ``problem`` says how."""

    def __init__(self, problem: HeaderProblem, detail: str = "") -> None:
        super().__init__(f"{problem.value}{': ' + detail if detail else ''}")
        self.problem = problem


def checksum(buffers: Iterable[memoryview | bytes | bytearray]) -> int:
    """xxh3_64 of the concatenation of ``buffers``."""
    parts = buffers if isinstance(buffers, (list, tuple)) else list(buffers)
    if len(parts) == 1:  # the one-shot digest equals the streamed one, and is cheaper
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for b in parts:
        h.update(b)
    return h.intdigest()


def key_digest(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode())


@dataclass(frozen=True)
class PageHeader:
    pool: str
    payload_len: int
    payload_checksum: int
    namespace: bytes
    key_digest: bytes


@functools.lru_cache(maxsize=1024)
def namespace_bytes(namespace: str) -> bytes:
    """The 12 raw bytes of a 24-hex-digit namespace fingerprint (other strings are hashed)."""
    try:
        raw = bytes.fromhex(namespace)
    except ValueError:
        raw = b""
    return raw if len(raw) == 12 else xxhash.xxh3_128_digest(namespace.encode())[:12]


def make_header(
    key: str, namespace: str, pool: str, payload: Iterable[memoryview | bytes | bytearray]
) -> bytes:
    """The 64-byte header for a page whose payload is the concatenation of ``payload``."""
    return bytes(make_headers(((key, namespace, pool, payload),)))


def make_headers(
    pages: Sequence[tuple[str, str, str, Iterable[memoryview | bytes | bytearray | Buffer]]],
) -> bytearray:
    """The headers of many pages in one buffer: ``pages[i]`` is ``(key, namespace, pool,
    payload parts)`` and its header is bytes ``64*i .. 64*i+64``, equal to :func:`make_header`'s.

    One compiled call for the batch (``hicache_draft._native``): the hashes run without the GIL."""
    out = bytearray(HEADER_SIZE * len(pages))
    items = [(key, namespace, parts) for key, namespace, _pool, parts in pages]
    codes = bytes(pool_code(pool) for _key, _namespace, pool, _parts in pages)
    _native.pack_headers(out, items, codes, namespace_bytes)
    return out


def pack_page_headers(out: bytearray | memoryview, pages: Sequence[Page], pool: str) -> None:
    """Write the header of each of ``pages`` (of pool ``pool``: key, namespace and the bytes of its
    buffers) into ``out`` at ``64*i``: the core's headers for a ``page_set``, made from the bytes it
    hands over. The hashes run without the GIL, so threads that split a batch run in parallel."""
    _native.pack_headers(out, pages, pool_code(pool), namespace_bytes)


def corrupt_pages(pages: Sequence[Page], pool: str) -> list[int]:
    """The indices of ``pages`` (of pool ``pool``, each with its ``header``) whose header is not
    exactly the one the core makes for its key, namespace, pool and the bytes now in its buffers:
    the verification of every restored page, in one compiled call without the GIL. Equal headers
    mean every check of :func:`check_page` passes; :func:`check_page` names what failed."""
    return _native.mismatches(pages, pool_code(pool), namespace_bytes)


def parse_header(raw: bytes | memoryview, key: str, namespace: str, pool: str) -> PageHeader:
    """Validate a header against the expected key, namespace and pool; raise :class:`PageFormatError`."""
    raw = bytes(raw[:HEADER_SIZE])
    if len(raw) < HEADER_SIZE:
        raise PageFormatError(HeaderProblem.SHORT, f"{len(raw)} bytes")
    magic, version, code, _flags, hlen, plen, csum, ns, kd, hsum = _HEAD_FULL.unpack_from(raw)
    if magic != MAGIC:
        raise PageFormatError(HeaderProblem.MAGIC)
    if version != FORMAT_VERSION or hlen != HEADER_SIZE:
        raise PageFormatError(HeaderProblem.VERSION, f"version {version}")
    if hsum != xxhash.xxh32_intdigest(raw[: _HEAD.size]):
        raise PageFormatError(HeaderProblem.HEADER_CHECKSUM)
    if ns != namespace_bytes(namespace) or kd != key_digest(key):
        raise PageFormatError(HeaderProblem.FOREIGN)
    if code != pool_code(pool):
        raise PageFormatError(HeaderProblem.POOL)
    return PageHeader(pool, plen, csum, ns, kd)


_PREFIX = struct.Struct("<8sHBBIQ")  # magic .. payload length: the first 24 bytes


@functools.lru_cache(maxsize=256)
def _prefix(pool: str, payload_len: int) -> bytes:
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, pool_code(pool), 0, HEADER_SIZE, payload_len)


_CSUM = struct.Struct("<Q")


def check_page(
    header: bytes | bytearray | memoryview, key: str, namespace: str, pool: str,
    payload: Sequence[memoryview | bytes | bytearray], payload_len: int,
) -> None:
    """:func:`parse_header` and :func:`verify_payload` in one pass, for the core's check of every
    restored page: the header must be exactly the one the core makes for ``key`` and a payload of
    ``payload_len`` bytes, and the payload's checksum the one it holds. Raises
    :class:`PageFormatError` naming the first problem (found by the full parser)."""
    raw = bytes(header[:HEADER_SIZE])
    if (
        raw[:24] != _prefix(pool, payload_len)
        or raw[32:60] != namespace_bytes(namespace) + key_digest(key)
        or raw[60:64] != _HEADER_SUM.pack(xxhash.xxh32_intdigest(raw[:60]))
    ):
        verify_payload(parse_header(raw, key, namespace, pool), payload, payload_len)
        raise PageFormatError(HeaderProblem.VERSION, "unknown flags")  # all the parser does not check
    if checksum(payload) != _CSUM.unpack_from(raw, 24)[0]:
        raise PageFormatError(HeaderProblem.PAYLOAD_CHECKSUM)


def verify_payload(header: PageHeader, payload: Iterable[memoryview | bytes | bytearray], expected_len: int) -> None:
    """Check length and checksum of a payload just read; raise :class:`PageFormatError`."""
    if header.payload_len != expected_len:
        raise PageFormatError(HeaderProblem.LENGTH, f"stored {header.payload_len}, expected {expected_len}")
    if checksum(payload) != header.payload_checksum:
        raise PageFormatError(HeaderProblem.PAYLOAD_CHECKSUM)
