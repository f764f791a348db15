"""The segment file: packed page records, then an index footer and a fixed trailer.

A segment holds the pages of one ``page_set`` call (every pool of a group together)::

    record 0        64-byte page header (hicache_draft.make_header) + raw payload
    record 1        ...
    footer          offsets  u64[n]   where each record's header starts
                    lengths  u64[n]   payload bytes of each record
                    pools    u8[n]    the record's pool: an index into the pool names
                    keys     ascii    n keys joined by "\\n"
                    groups   ascii    n page groups joined by "\\n"
                    names    ascii    version 2: the pool names joined by "\\n" (kv, draft, then others)
    trailer         64 bytes, layout below

Version 1 (every segment of the classic pools, and every segment written before open pools) has
no ``names``: its pool codes are 0 = ``kv``, 1 = ``draft``. A segment holding a page of any other
pool (``indexer``, ``swa``, ``mamba``, ...) is version 2: its names start with ``kv`` and
``draft`` too, and the trailer's first reserved word is their length. Older versions of this
backend refuse (quarantine) a version-2 segment as an unsupported version; this one reads both.

The file is written under ``tmp/`` and renamed into ``seg/`` only when complete, so a published
segment is never torn by a crashed writer. Every record keeps the core's header (its own xxh32,
and the xxh3_64 of the payload, which the core checks after every read through a ``Store``; the
backend checks the rest of the header), and the footer has an xxh3_64 checksum in the trailer,
so a segment truncated or damaged later is detected, never read as data.
 Loading an index reads
only the tail of the file: a restart reads one footer per segment, not one header per page.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from hicache_draft import HEADER_SIZE, PoolKind

SEG_MAGIC = b"HCDSEG\x00\x01"
SEG_VERSION = 2
"""The newest segment version (version 1 is still written when only the classic pools are in it)."""
# magic, version, flags, count, footer_offset, keys_len, groups_len, footer_xxh3, names_len, reserved
_TRAILER = struct.Struct("<8sHHIQIIQI16s")
TRAILER_SIZE = _TRAILER.size + 4
assert TRAILER_SIZE == 64
_TAIL_GUESS = 64 * 1024

CLASSIC_POOLS: tuple[str, ...] = (PoolKind.KV.value, PoolKind.DRAFT.value)
"""The pool names of version 1 (codes 0 and 1), and the first names of every version-2 table."""
POOL_CODE = {PoolKind.KV: 0, PoolKind.DRAFT: 1}
MAX_POOLS = 256  # a record's pool code is one byte


class SegmentError(ValueError):
    """A segment file whose trailer or footer is not valid (truncated, foreign, damaged)."""


@dataclass
class SegmentIndex:
    """The parsed footer of one segment."""

    size: int
    data_end: int
    keys: list[str]
    groups: list[str]
    pools: bytes
    offsets: array
    lengths: array
    names: tuple[str, ...] = CLASSIC_POOLS  # pool code -> pool name

    def __len__(self) -> int:
        return len(self.keys)


def storable_pool(name: object) -> bool:
    """Whether a segment footer can name this pool (ascii, one line, at most 255 bytes)."""
    return isinstance(name, str) and 0 < len(name) < 256 and name.isascii() and name.isprintable()


def pool_table(pools: Iterable[str]) -> tuple[tuple[str, ...], bytes]:
    """The pool names of a segment's records (the classic pools first, then the others in order
    of appearance) and each record's code; ValueError for a name the footer cannot hold."""
    names = list(CLASSIC_POOLS)
    code_of = {n: i for i, n in enumerate(names)}
    codes = bytearray()
    for pool in pools:
        code = code_of.get(pool)
        if code is None:
            name = str(pool)
            if not storable_pool(name):
                raise ValueError(f"pool name {name!r} cannot be stored in a segment footer")
            code = code_of[name] = len(names)
            if code >= MAX_POOLS:
                raise ValueError(f"more than {MAX_POOLS} pools in one segment")
            names.append(name)
        codes.append(code)
    return tuple(names), bytes(codes)


def build_footer(index: SegmentIndex) -> bytes:
    """Footer and trailer bytes for the records of ``index`` (its ``size`` is not used)."""
    offsets, lengths = index.offsets, index.lengths
    keys = "\n".join(index.keys).encode("ascii")
    groups = "\n".join(index.groups).encode("ascii")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        offsets, lengths = array("Q", offsets), array("Q", lengths)
        offsets.byteswap()
        lengths.byteswap()
    names = b"" if index.names == CLASSIC_POOLS else "\n".join(index.names).encode("ascii")
    footer = b"".join((offsets.tobytes(), lengths.tobytes(), bytes(index.pools), keys, groups, names))
    head = _TRAILER.pack(
        SEG_MAGIC, 2 if names else 1, 0, len(index), index.data_end, len(keys), len(groups),
        xxhash.xxh3_64_intdigest(footer), len(names), b"\x00" * 16,
    )
    return footer + head + struct.pack("<I", xxhash.xxh32_intdigest(head))


def read_index(fd: int, size: int | None = None) -> SegmentIndex:
    """Parse the footer of the segment open at ``fd``; raise :class:`SegmentError`."""
    if size is None:
        size = os.fstat(fd).st_size
    if size < TRAILER_SIZE:
        raise SegmentError(f"truncated: {size} bytes, no trailer")
    want = min(size, _TAIL_GUESS)
    tail = os.pread(fd, want, size - want)
    if len(tail) != want:
        raise SegmentError("short read of the trailer")
    trailer = tail[-TRAILER_SIZE:]
    magic, version, _flags, count, footer_off, keys_len, groups_len, footer_sum, names_len, _res = (
        _TRAILER.unpack_from(trailer))
    if magic != SEG_MAGIC:
        raise SegmentError("bad trailer magic (not a segment, or truncated)")
    (tsum,) = struct.unpack_from("<I", trailer, _TRAILER.size)
    if tsum != xxhash.xxh32_intdigest(trailer[: _TRAILER.size]):
        raise SegmentError("trailer checksum mismatch")
    if version not in (1, 2) or (version == 1) != (names_len == 0):
        raise SegmentError(f"unsupported segment version {version}")
    footer_len = 17 * count + keys_len + groups_len + names_len
    if footer_off + footer_len + TRAILER_SIZE != size:
        raise SegmentError(f"size {size} does not match the trailer (footer at {footer_off}, {footer_len} bytes)")
    if footer_len + TRAILER_SIZE <= want:
        footer = tail[want - TRAILER_SIZE - footer_len : want - TRAILER_SIZE]
    else:
        footer = os.pread(fd, footer_len, footer_off)
        if len(footer) != footer_len:
            raise SegmentError("short read of the footer")
    if xxhash.xxh3_64_intdigest(footer) != footer_sum:
        raise SegmentError("footer checksum mismatch")
    offsets = array("Q")
    offsets.frombytes(footer[: 8 * count])
    lengths = array("Q")
    lengths.frombytes(footer[8 * count : 16 * count])
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        offsets.byteswap()
        lengths.byteswap()
    pools = footer[16 * count : 17 * count]
    pos = 17 * count
    keys_raw = footer[pos : pos + keys_len]
    groups_raw = footer[pos + keys_len : pos + keys_len + groups_len]
    names_raw = footer[pos + keys_len + groups_len :]
    try:
        keys = keys_raw.decode("ascii").split("\n") if count else []
        groups = groups_raw.decode("ascii").split("\n") if count else []
        names = tuple(names_raw.decode("ascii").split("\n")) if names_len else CLASSIC_POOLS
    except UnicodeDecodeError:
        raise SegmentError("footer keys or pool names are not ascii") from None
    if len(keys) != count or len(groups) != count:
        raise SegmentError("footer key count does not match the trailer")
    if names[: len(CLASSIC_POOLS)] != CLASSIC_POOLS or len(set(names)) != len(names) or not all(names):
        raise SegmentError("footer pool names are not a valid table")
    if pools and max(pools) >= len(names):  # a code past the table is not a pool
        raise SegmentError("footer names an unknown pool")
    return SegmentIndex(
        size=size, data_end=footer_off, keys=keys, groups=groups, pools=pools, offsets=offsets, lengths=lengths,
        names=names,
    )


def record_span(payload_len: int) -> int:
    """Bytes one record takes in a segment."""
    return HEADER_SIZE + payload_len
