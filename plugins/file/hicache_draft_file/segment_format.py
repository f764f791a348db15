"""The segment file: packed page records, then an index footer and a fixed trailer.

A segment holds the pages of one ``page_set`` call (target and draft of a group together)::

    record 0        64-byte page header (hicache_draft.make_header) + raw payload
    record 1        ...
    footer          offsets  u64[n]   where each record's header starts
                    lengths  u64[n]   payload bytes of each record
                    pools    u8[n]    0 = kv, 1 = draft
                    keys     ascii    n keys joined by "\\n"
                    groups   ascii    n page groups joined by "\\n"
    trailer         64 bytes, layout below

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
from dataclasses import dataclass

import xxhash

from hicache_draft import HEADER_SIZE, PoolKind

SEG_MAGIC = b"HCDSEG\x00\x01"
SEG_VERSION = 1
# magic, version, flags, count, footer_offset, keys_len, groups_len, footer_xxh3, reserved
_TRAILER = struct.Struct("<8sHHIQIIQ20s")
TRAILER_SIZE = _TRAILER.size + 4
assert TRAILER_SIZE == 64
_TAIL_GUESS = 64 * 1024

POOL_CODE = {PoolKind.KV: 0, PoolKind.DRAFT: 1}
CODE_POOL = {v: k for k, v in POOL_CODE.items()}
_POOL_CODES = bytes(sorted(CODE_POOL))



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

    def __len__(self) -> int:
        return len(self.keys)


def build_footer(index: SegmentIndex) -> bytes:
    """Footer and trailer bytes for the records of ``index`` (its ``size`` is not used)."""
    offsets, lengths = index.offsets, index.lengths
    keys = "\n".join(index.keys).encode("ascii")
    groups = "\n".join(index.groups).encode("ascii")
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        offsets, lengths = array("Q", offsets), array("Q", lengths)
        offsets.byteswap()
        lengths.byteswap()
    footer = b"".join((offsets.tobytes(), lengths.tobytes(), bytes(index.pools), keys, groups))
    head = _TRAILER.pack(
        SEG_MAGIC, SEG_VERSION, 0, len(index), index.data_end, len(keys), len(groups),
        xxhash.xxh3_64_intdigest(footer), b"\x00" * 20,
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
    magic, version, _flags, count, footer_off, keys_len, groups_len, footer_sum, _res = _TRAILER.unpack_from(trailer)
    if magic != SEG_MAGIC:
        raise SegmentError("bad trailer magic (not a segment, or truncated)")
    (tsum,) = struct.unpack_from("<I", trailer, _TRAILER.size)
    if tsum != xxhash.xxh32_intdigest(trailer[: _TRAILER.size]):
        raise SegmentError("trailer checksum mismatch")
    if version != SEG_VERSION:
        raise SegmentError(f"unsupported segment version {version}")
    footer_len = 17 * count + keys_len + groups_len
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
    groups_raw = footer[pos + keys_len :]
    try:
        keys = keys_raw.decode("ascii").split("\n") if count else []
        groups = groups_raw.decode("ascii").split("\n") if count else []
    except UnicodeDecodeError:
        raise SegmentError("footer keys are not ascii") from None
    if len(keys) != count or len(groups) != count:
        raise SegmentError("footer key count does not match the trailer")
    if pools.translate(None, _POOL_CODES):  # a byte left over is not a pool code
        raise SegmentError("footer names an unknown pool")
    return SegmentIndex(
        size=size, data_end=footer_off, keys=keys, groups=groups, pools=pools, offsets=offsets, lengths=lengths,
    )


def record_span(payload_len: int) -> int:
    """Bytes one record takes in a segment."""
    return HEADER_SIZE + payload_len
