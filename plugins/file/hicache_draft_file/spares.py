"""Spare segment files: files in ``tmp/`` claimed between calls, so that a ``page_set`` does not
wait for file creation.

Creating a file is a metadata change of ``tmp/`` (its directory lock, a journal handle); the
first one after the filesystem's journal committed costs 100-300 us on the development VM and on
the H100 host (0.15-0.28 ms per segment file in the timeline of a 128 x 64 KiB call, where the
records themselves take 1.1-1.2 ms per file), and several writer threads creating at once queue on
the directory. After a call, one of the backend's I/O threads claims as many files as that call
wrote segments (:func:`~hicache_draft_file.segment_writer.claim_file`: a recycled file from
``free/`` or a new one, flocked while held, named after this process), preallocated to the size
of that call's segments when they are small (:data:`PREALLOC_MAX`), and the next call's writers
take them. With ``prefault`` (when they hold :data:`PREFAULT_MAX` at most in all), once every spare
is claimed and can be taken, the same thread fills them with zeros one at a time, each out of the
list while it is written, and a call takes a filled one first.

Filling a spare with zeros there puts its pages in the page cache ahead of the call: the call's
write then only copies into them, where a write into a new or preallocated file also allocates
every page and its block bookkeeping. On the development VM (ext4), 128 x 64 KiB ``page_set``
calls behind a Store against a store without prefaulting, paired per round: 1.14-1.24x with a sync
before each call, 1.08-1.20x with the two stores' calls alternating back to back, 0.92-1.29x in
bursts on one store (a call may find its spares still being filled), and 0.98-0.99x when the
spares' pages had been dropped from the cache before the call (0.83-0.88x while the core's
``write_records`` still ended write calls inside pages: each such page of written blocks was read
from the disk first). On an H100 host ``file bench`` gave 0.94x (64 KiB) and 1.00x (1 MiB). It is
off by default (``prefault_spares``): a spare whose zeros reach the disk before a call overwrites
them is written to the disk twice.

A spare is an ordinary temp file of this process: a live writer's flock keeps other processes'
stale-file cleaners away from it, and a process that dies leaves it to the next cleaner like an
unfinished write. :meth:`SpareFiles.close` removes the spares; a forked child never uses its
parent's (the backend's fork hook calls :meth:`SpareFiles.after_fork_in_child`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache_draft import write_from
from hicache_draft_file.rootfs import RootDirs, UnsafeEntry
from hicache_draft_file.segment_writer import SegmentFile, discard_file, open_segment_file
from hicache_draft_file.vectored_io import WRITE_CHUNK

log = logging.getLogger("hicache_draft_file")

# A spare is preallocated to the size of the last call's segments when they were at most this big
# (the next call of the same shape then neither allocates nor truncates: on the H100 host fallocate
# took 0.04-0.16 ms per 4 MiB segment inside the call). Larger segments are left empty: their
# allocation is small beside their write, and a spare holds no disk space it may never use.
PREALLOC_MAX = 16 << 20
# Zeros a call's spares may hold in all (its segments' count times their size), or none is: a
# refill runs on one thread, and zero-filling the spares of a 128 x 1 MiB call on a 16-thread host
# (16 x 8 MiB) would take tens of milliseconds, longer than such a call, so most would not be ready
# for the next one while they share its memory bandwidth. A bound by design, not measured.
PREFAULT_MAX = 16 << 20
_ZEROS = memoryview(bytes(WRITE_CHUNK))  # one cached source for every prefault write
# A spare is prefaulted in whole pages up to where the last call's records ended, never further:
# once its zeros were written back and its pages dropped from the cache (memory pressure, or the
# benchmark's drop between rounds), a write that covers part of a page of written blocks must
# first read that page from the disk, where a part-page write into a preallocated (unwritten)
# block reads nothing. The records start at a page and are written in whole pages except where
# they end (the core's write calls end on chunk multiples); the footer ends mid-page.
PAGE = mmap.PAGESIZE


@dataclass
class Claimed(SegmentFile):
    """A spare: a file claimed in ``tmp/`` for segment ``name`` before a call needs it;
    ``prefaulted`` once its first ``old_size`` bytes were written with zeros (in the page cache)."""

    prefaulted: bool = False


def claim(dirs: RootDirs, name: str, size: int = 0) -> Claimed:
    """Claim a file for segment ``name`` now (see :func:`claim_file`), preallocated to at least
    ``size`` bytes where the filesystem allows (its size is then that)."""
    f = open_segment_file(dirs, name, size)
    return Claimed(f.name, f.tmp_name, f.fd, f.old_size, f.recycled, f.ident)


def prefault(c: Claimed, size: int) -> Claimed:
    """``c`` with its first ``size`` bytes written with zeros (in the page cache when this
    returns); raises the write's OSError (the caller discards the file)."""
    if not size:
        return dataclasses.replace(c, prefaulted=True)
    whole, rest = divmod(size, len(_ZEROS))
    write_from(c.fd, 0, [_ZEROS] * whole + ([_ZEROS[:rest]] if rest else []), chunk=WRITE_CHUNK)
    return dataclasses.replace(c, old_size=max(c.old_size, size), prefaulted=True)


class SpareFiles:
    """Up to ``limit`` claimed files, refilled on an I/O thread (``submit``) after each call
    that used some: first every missing one is claimed and preallocated (a call right after can
    take it), then, with ``prefault``, they are filled with zeros one at a time, each out of the
    list while it is written; :meth:`take` gives a filled one first.

    ``new_name`` gives the next segment name (the backend's writer id and sequence). All methods
    are thread-safe; a refill runs on one thread at a time, and :meth:`close` waits for it (at
    most ``timeout_s``) before it removes the spares, so no file is created once it returned."""

    def __init__(self, dirs: RootDirs, new_name: Callable[[], str], submit: Callable[[Callable[[], None]], object],
                 limit: int, timeout_s: float, prealloc: bool = True, prefault: bool = False) -> None:
        self._dirs = dirs
        self._new_name = new_name
        self._submit = submit
        self._limit = max(1, limit)
        self._timeout_s = timeout_s
        self._mu = threading.Lock()  # the list, the target, the flags
        self._busy = threading.Lock()  # held by the one running refill
        self._files: list[Claimed] = []
        self._target = 0
        self._size = 0  # bytes to preallocate each new spare to
        self._fill = False  # whether held spares are prefaulted (to _fill_to)
        self._fill_to = 0
        self._prealloc = prealloc
        self._prefault = prefault and prealloc  # an in-memory filesystem has no page to fault in
        self._pending = False
        self._closed = False

    def take(self) -> Claimed | None:
        """A spare file, or ``None`` (none left: the caller claims one itself)."""
        with self._mu:
            files = self._files
            for j in range(len(files) - 1, -1, -1):
                if files[j].prefaulted:
                    return files.pop(j)
            return files.pop() if files else None

    def names(self) -> set[str]:
        """The names in ``tmp/`` of the spares held now."""
        with self._mu:
            return {c.tmp_name for c in self._files}

    def refill(self, used: int, size: int = 0, records_end: int = 0) -> None:
        """After a call that wrote ``used`` segments, the largest of ``size`` bytes, the shortest
        of whose records ended at ``records_end``: keep that many spares (at most the limit),
        claimed on an I/O thread, not in this one; new ones are preallocated to ``size`` when it
        is at most :data:`PREALLOC_MAX`, and prefaulted (see :data:`PAGE`) when they hold
        :data:`PREFAULT_MAX` at most in all."""
        with self._mu:
            if self._closed:
                return
            self._target = min(self._limit, max(self._target, used))
            self._size = size if self._prealloc and size <= PREALLOC_MAX else 0
            self._fill = self._prefault and 0 < self._size * max(1, used) <= PREFAULT_MAX
            self._fill_to = min(records_end, self._size) // PAGE * PAGE
            if self._pending or (len(self._files) >= self._target and not self._cold()):
                return
            self._pending = True
        try:
            self._submit(self._run)
        except RuntimeError:  # no I/O thread takes it: the backend is closing
            with self._mu:
                self._pending = False

    def _cold(self) -> Claimed | None:
        """A held spare still to be prefaulted (holds _mu)."""
        if self._fill:
            for c in self._files:
                if not c.prefaulted:
                    return c
        return None

    def _run(self) -> None:
        with self._busy:
            with self._mu:
                self._pending = False
            while True:  # every missing spare claimed and preallocated: a call can take it at once
                with self._mu:
                    if self._closed:
                        return
                    if len(self._files) >= self._target:
                        break
                    size = self._size
                try:
                    got = claim(self._dirs, self._new_name(), size)
                except (OSError, UnsafeEntry) as exc:  # the write path claims (and reports) for itself
                    log.debug("file backend: no spare segment file: %s", exc)
                    return
                if not self._keep(got):
                    return
            while True:  # then filled one at a time, out of the list while written (no call takes it)
                with self._mu:
                    c = None if self._closed else self._cold()
                    if c is None:
                        return
                    self._files.remove(c)
                    size = self._fill_to
                try:
                    c = prefault(c, size)
                except OSError as exc:
                    log.debug("file backend: a spare segment file was not prefaulted: %s", exc)
                    self._discard(c)
                    return
                if not self._keep(c):
                    return

    def _keep(self, c: Claimed) -> bool:
        """Hold ``c`` as a spare; after :meth:`close` it is removed instead (``False``)."""
        with self._mu:
            if not self._closed:
                self._files.append(c)
                return True
        self._discard(c)
        return False

    def settle(self, timeout_s: float) -> bool:
        """Wait until no refill is queued or running (tests and tools); ``False`` at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._mu:
                pending = self._pending
            if not pending and self._busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
                self._busy.release()
                with self._mu:
                    if not self._pending:
                        return True
            if time.monotonic() >= deadline:
                return False

    def close(self) -> bool:
        """Remove every spare; ``False`` when a refill still ran after the timeout (then its
        directory descriptors must stay open: it may still be creating a file)."""
        with self._mu:
            self._closed = True
        if not self._busy.acquire(timeout=self._timeout_s):
            log.warning("file backend: a spare-file claim did not finish in %.0f s at close", self._timeout_s)
            return False
        try:
            with self._mu:
                files, self._files = self._files, []
            for c in files:
                self._discard(c)
        finally:
            self._busy.release()
        return True

    def _discard(self, c: Claimed) -> None:
        discard_file(self._dirs, c)

    def after_fork_in_child(self) -> None:
        """In a forked child: the spares are the parent's files, so close only this process's
        copies of their descriptors (the parent's flocks stay), never use them, and claim no more.
        The locks are new: one the parent's refill held while forking stays held in the child."""
        self._mu, self._busy = threading.Lock(), threading.Lock()
        files, self._files = self._files, []
        self._closed, self._pending = True, False
        for c in files:
            with contextlib.suppress(OSError):
                os.close(c.fd)
