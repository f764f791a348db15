"""The shared change journal: how processes on one root learn of each other's segments.

An append-only file of fixed 64-byte records, "segment added" or "segment removed", each with
its own checksum. A writer appends one record right after it publishes a segment (both under a
shared flock); an evictor appends "removed" records (under the exclusive flock). A reader keeps
its offset and, at the start of each call, runs one ``fstat``: nothing new costs about a
microsecond; new records name exactly which segment footers to load or drop.

The directory is the truth; the journal is a notice board. When it is compacted (replaced by
rename under the exclusive lock), every reader sees ``st_nlink == 0`` on its descriptor and
rescans the directory once. A record that fails its checksum also triggers a rescan.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import xxhash

RECORD_SIZE = 64
_MAGIC = b"HJ"
_REC = struct.Struct("<2sBB56s")
assert _REC.size + 4 == RECORD_SIZE


class Op(Enum):
    ADD = ord("A")
    REMOVE = ord("D")


@dataclass
class PollResult:
    """What changed since the last poll. ``rescan``: the journal was replaced or damaged, so
    the caller must list the directory again (``records`` is then empty)."""

    rescan: bool
    records: list[tuple[Op, str]]


def _pack(op: Op, name: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) > 56:
        raise ValueError(f"segment name {name!r} too long for a journal record")
    body = _REC.pack(_MAGIC, op.value, len(raw), raw)
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


class Journal:
    """One process's view of the journal file at ``path``."""

    def __init__(self, path: Path, writable: bool) -> None:
        self.path = path
        self.writable = writable
        self.fd = -1
        self.offset = 0
        self._open()

    def _open(self) -> None:
        if self.writable:
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        else:
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                self.fd = -1
        self.offset = 0

    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def records(self) -> int:
        return self.size() // RECORD_SIZE

    def skip_to_end(self, size: int) -> None:
        """Start reading at ``size`` (taken before a directory scan, so nothing is missed)."""
        self.offset = size

    def append(self, op: Op, names: list[str]) -> None:
        """Append records in one ``write`` (an O_APPEND write is not interleaved with others)."""
        if not names:
            return
        data = b"".join(_pack(op, n) for n in names)
        view = memoryview(data)
        while view:
            done = os.write(self.fd, view)
            view = view[done:]

    def poll(self) -> PollResult:
        if self.fd < 0:
            if not self.path.exists():
                return PollResult(False, [])
            self._open()
            return PollResult(True, [])
        st = os.fstat(self.fd)
        if st.st_nlink == 0:  # compacted: replaced by rename
            os.close(self.fd)
            self._open()
            return PollResult(True, [])
        if st.st_size < self.offset:
            self.offset = 0
            return PollResult(True, [])
        whole = (st.st_size - self.offset) // RECORD_SIZE * RECORD_SIZE
        if not whole:
            return PollResult(False, [])
        raw = os.pread(self.fd, whole, self.offset)
        out: list[tuple[Op, str]] = []
        for pos in range(0, len(raw) - RECORD_SIZE + 1, RECORD_SIZE):
            body = raw[pos : pos + _REC.size]
            (csum,) = struct.unpack_from("<I", raw, pos + _REC.size)
            magic, op, n, name = _REC.unpack(body)
            if magic != _MAGIC or csum != xxhash.xxh32_intdigest(body) or op not in (65, 68) or n > 56:
                self.offset = st.st_size
                return PollResult(True, [])
            out.append((Op(op), name[:n].decode("ascii", "replace")))
        self.offset += len(raw) - len(raw) % RECORD_SIZE
        return PollResult(False, out)

    def compact(self) -> None:
        """Replace the journal by an empty one (caller holds the exclusive root lock and rescans)."""
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.close(fd)
        os.rename(tmp, self.path)
        os.close(self.fd)
        self._open()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
