"""The shared change journal: how processes on one root learn of each other's segments.

An append-only file of fixed 64-byte records, "segment added" or "segment removed", each with
its own checksum; a journal starts with a "generation" record holding random bytes. A writer
appends one record right after it publishes a segment (both under the shared root flock); an
evictor appends "removed" records under the exclusive flock. The directory is the truth; the
journal is a notice board, and whenever a reader cannot trust what it has read it lists the
directory again (a rescan).

Concurrency (what makes a lost or misdirected notice impossible, not unlikely):

* The descriptor belongs to this object and is touched only under its own lock ``_mu``: append,
  poll, records, mark, compact and close all take it, so no thread ever uses a number another
  thread closed. Whenever a descriptor is given up (replaced, failed reopen) ``fd`` becomes -1
  and the next use reopens it lazily; ``close`` never raises.
* Appends happen only under the root flock (shared or exclusive) and compaction only under the
  exclusive one, so before writing, ``append`` compares the journal's current device and inode
  (an ``lstat`` of the name relative to the root descriptor) with its descriptor's: if the
  journal was compacted or replaced since, it reopens the current one and appends there (and
  this reader rescans at its next poll, since it skipped the old journal's tail). A notice is
  therefore always written into the journal every live reader will read.
* A reader remembers the device and inode of its descriptor, its offset, and the last record it
  consumed. Each poll is one ``lstat`` of the name and one ``pread`` from the record before its
  offset: another inode (compacted, replaced), a size below the offset (truncated) or a
  different record at offset - 64 (truncated and regrown past the offset, with any size) means
  rescan; so does a damaged record. A journal that cannot be opened (missing, a directory, a
  link) makes the reader rescan at most once a second until it can.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass
from enum import Enum

import xxhash

from hicache_draft_file.rootfs import NOFOLLOW, ident

RECORD_SIZE = 64
_MAGIC = b"HJ"
_REC = struct.Struct("<2sBB56s")
assert _REC.size + 4 == RECORD_SIZE
# while the journal is unusable, a reader lists the directory at most this often
BLIND_RESCAN_S = 1.0


class JournalUnavailable(OSError):
    """There is no journal file that can be opened (missing and not creatable, a directory, a link)."""


class Op(Enum):
    ADD = ord("A")
    REMOVE = ord("D")
    GENERATION = ord("G")  # the first record of a journal: random bytes, never a segment


_OPS = {op.value: op for op in Op}


@dataclass
class PollResult:
    """What changed since the last poll. ``rescan``: the journal was replaced or damaged, so
    the caller must list the directory again (``records`` is then empty)."""

    rescan: bool
    records: list[tuple[Op, str]]


@dataclass(frozen=True)
class Mark:
    """Where the journal stood just before a directory scan (see :meth:`Journal.mark`)."""

    ident: tuple[int, int] | None
    size: int
    tail: bytes


_NOTHING = PollResult(False, [])


def _pack(op: Op, name: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) > 56:
        raise ValueError(f"segment name {name!r} too long for a journal record")
    body = _REC.pack(_MAGIC, op.value, len(raw), raw)
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


def generation_record() -> bytes:
    return _pack(Op.GENERATION, secrets.token_hex(16))


class Journal:
    """One process's view of the journal ``name`` in the root directory ``dir_fd``."""

    def __init__(self, dir_fd: int, name: str, writable: bool) -> None:
        self.dir_fd = dir_fd
        self.name = name
        self.writable = writable
        self.fd = -1
        self.ident: tuple[int, int] | None = None
        self.offset = 0
        self._tail = b""  # the last record consumed (the one before offset)
        self._stale = False  # a rescan is owed (we switched files in append)
        self._blind_at = 0.0
        self.damaged = False  # a damaged record was seen: compact at the next chance
        self._mu = threading.Lock()
        with self._mu:
            self._reopen()

    def after_fork_in_child(self) -> None:
        """In a forked child: a new lock (one another thread of the parent held at the fork stays
        held). The descriptor is the child's own copy; it stays usable."""
        self._mu = threading.Lock()

    # -- descriptor (all under _mu) -------------------------------------------------------------
    def _drop_fd(self) -> None:
        fd, self.fd, self.ident = self.fd, -1, None
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _reopen(self) -> bool:
        """Open the current journal (creating it when writable and missing); False leaves fd -1."""
        self._drop_fd()
        self.offset, self._tail = 0, b""
        flags = (os.O_RDWR | os.O_APPEND) if self.writable else os.O_RDONLY
        for _attempt in range(3):
            try:
                fd = os.open(self.name, flags | NOFOLLOW, dir_fd=self.dir_fd)
            except FileNotFoundError:
                if not self.writable or not self._create():
                    return False
                continue
            except OSError:
                return False
            try:
                st = os.fstat(fd)
            except OSError:
                os.close(fd)
                return False
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return False
            self.fd, self.ident = fd, ident(st)
            return True
        return False

    def _create(self) -> bool:
        """A new journal (its generation record first), linked in only where none exists."""
        tmp = self._new_file()
        if tmp is None:
            return False
        name, fd = tmp
        os.close(fd)
        try:
            os.link(name, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd, follow_symlinks=False)
        except FileExistsError:
            pass
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dir_fd)
        return True

    def _new_file(self) -> tuple[str, int] | None:
        """``journal.<pid>.<random>.new`` holding one generation record, open for appending."""
        name = f"{self.name}.{os.getpid()}.{secrets.token_hex(4)}.new"
        try:
            fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644,
                         dir_fd=self.dir_fd)
        except OSError:
            return None
        try:
            os.write(fd, generation_record())
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dir_fd)
            return None
        return name, fd

    def _lstat(self) -> os.stat_result | None:
        try:
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def _current(self) -> bool:
        """Make fd the journal the name holds now (reopening if it was replaced); False: none."""
        st = self._lstat()
        if self.fd >= 0 and st is not None and ident(st) == self.ident:
            return True
        self._stale = True  # whatever the old file held past our offset was not read
        return self._reopen()

    # -- the interface -------------------------------------------------------------------------
    def records(self) -> int:
        with self._mu:
            if self.fd < 0:
                return 0
            try:
                return os.fstat(self.fd).st_size // RECORD_SIZE
            except OSError:
                return 0

    def mark(self) -> Mark:
        """The journal's state before a directory scan; :meth:`resume` after it starts reading
        there, so nothing published after the mark is missed."""
        with self._mu:
            self._stale = False
            if not self._current():
                return Mark(None, 0, b"")
            self._stale = False
            try:
                size = os.fstat(self.fd).st_size // RECORD_SIZE * RECORD_SIZE
                tail = os.pread(self.fd, RECORD_SIZE, size - RECORD_SIZE) if size else b""
            except OSError:
                self._drop_fd()
                return Mark(None, 0, b"")
            return Mark(self.ident, size, tail)

    def resume(self, mark: Mark) -> None:
        with self._mu:
            if mark.ident is not None and mark.ident == self.ident and len(mark.tail) == min(mark.size, RECORD_SIZE):
                self.offset, self._tail = mark.size, mark.tail
            else:
                self._stale = True

    def append(self, op: Op, names: list[str]) -> None:
        """Append records in one ``write`` (an O_APPEND write is not interleaved with others) to
        the journal the root holds now. The caller holds the root flock. Raises OSError when there
        is no usable journal (the segment is still published: rescans find it)."""
        if not names:
            return
        data = b"".join(_pack(op, n) for n in names)
        with self._mu:
            if not self._current():
                raise JournalUnavailable(errno.ENOENT, "no usable journal (missing, or not a regular file)", self.name)
            view = memoryview(data)
            try:
                while view:
                    done = os.write(self.fd, view)
                    view = view[done:]
            except OSError:
                self._drop_fd()
                self._stale = True
                raise

    def poll(self) -> PollResult:
        with self._mu:
            if self._stale:
                self._stale = False
                return PollResult(True, [])
            st = self._lstat()
            if st is None or self.fd < 0 or ident(st) != self.ident:
                if self._reopen():
                    return PollResult(True, [])
                now = time.monotonic()
                if now - self._blind_at >= BLIND_RESCAN_S:
                    self._blind_at = now
                    return PollResult(True, [])
                return _NOTHING
            size = st.st_size // RECORD_SIZE * RECORD_SIZE
            off = self.offset
            if size < off:  # truncated
                return PollResult(True, [])
            try:
                if off:  # the record before the offset must still be the one we consumed
                    raw = os.pread(self.fd, size - off + RECORD_SIZE, off - RECORD_SIZE)
                    if raw[:RECORD_SIZE] != self._tail:
                        return PollResult(True, [])
                    raw = raw[RECORD_SIZE:]
                else:
                    raw = os.pread(self.fd, size, 0) if size else b""
            except OSError:
                self._drop_fd()
                return PollResult(True, [])
            raw = raw[: len(raw) // RECORD_SIZE * RECORD_SIZE]
            if not raw:
                return _NOTHING
            out: list[tuple[Op, str]] = []
            for pos in range(0, len(raw), RECORD_SIZE):
                body = raw[pos : pos + _REC.size]
                (csum,) = struct.unpack_from("<I", raw, pos + _REC.size)
                magic, code, n, name = _REC.unpack(body)
                op = _OPS.get(code)
                if magic != _MAGIC or csum != xxhash.xxh32_intdigest(body) or op is None or n > 56:
                    self.damaged = True  # a writable store compacts it away
                    return PollResult(True, [])  # the rescan's mark moves past the damage
                if op is not Op.GENERATION:
                    out.append((op, name[:n].decode("ascii", "replace")))
            self.offset = off + len(raw)
            self._tail = raw[-RECORD_SIZE:]
            return PollResult(False, out)

    def compact(self) -> None:
        """Replace the journal by a new one holding only a generation record. The caller holds the
        exclusive root lock and has just polled, so it has read everything the old one held."""
        with self._mu:
            made = self._new_file()
            if made is None:
                raise OSError(errno.EIO, "cannot create a new journal", self.name)
            name, fd = made
            try:
                os.rename(name, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                st = os.fstat(fd)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
                raise
            self._drop_fd()
            self.fd, self.ident, self.damaged = fd, ident(st), False
            self.offset = RECORD_SIZE
            self._tail = os.pread(fd, RECORD_SIZE, 0)

    def close(self) -> None:
        with self._mu:
            self._drop_fd()


def is_leftover(name: str, journal: str) -> int | None:
    """The pid in a compaction file name ``<journal>.<pid>.<random>.new`` (older releases:
    ``<journal>.<pid>.new``), else None."""
    if not (name.startswith(journal + ".") and name.endswith(".new")):
        return None
    parts = name[len(journal) + 1 : -4].split(".")
    return int(parts[0]) if parts and parts[0].isdigit() else None
