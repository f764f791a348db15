"""Spare segment files: files in ``tmp/`` claimed between calls, so that a ``page_set`` does not
wait for file creation.

Creating a file is a metadata change of ``tmp/`` (its directory lock, a journal handle); the
first one after the filesystem's journal committed costs 100-300 us on the development VM and on
the H100 host (0.15-0.28 ms per segment file in the timeline of a 128 x 64 KiB call, where the
records themselves take 1.1-1.2 ms per file), and several writer threads creating at once queue on
the directory. After a call, one of the backend's I/O threads claims as many files as that call
wrote segments (:func:`~hicache_draft_file.segment_writer.claim_file`: a recycled file from
``free/`` or a new one, flocked while held, named after this process), preallocated to the size
of that call's segments when they are small (:data:`PREALLOC_MAX`) and, with ``prefault``, filled
with zeros up to that size when they are few and small enough to be ready before the next call
(:data:`PREFAULT_MAX` in all), and the next call's writers take them.

Filling a spare with zeros there puts its pages in the page cache ahead of the call: the call's
write then only copies into them, where a write into a new or preallocated file also allocates
every page and its block bookkeeping. On the development VM (ext4) a 128 x 64 KiB ``page_set``
behind a Store took 1.19-1.31x less time with prefaulted spares (30 alternating calls each, with
and without a sync before each call).

A spare is an ordinary temp file of this process: a live writer's flock keeps other processes'
stale-file cleaners away from it, and a process that dies leaves it to the next cleaner like an
unfinished write. :meth:`SpareFiles.close` removes the spares; a forked child never uses its
parent's (the backend's fork hook calls :meth:`SpareFiles.after_fork_in_child`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache_draft import write_from
from hicache_draft_file.rootfs import RootDirs, UnsafeEntry
from hicache_draft_file.segment_writer import claim_file
from hicache_draft_file.vectored_io import WRITE_CHUNK, preallocate

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


@dataclass(frozen=True)
class Claimed:
    """A file in ``tmp/`` for segment ``name``: its name there, open read-write and flocked."""

    name: str
    tmp_name: str
    fd: int
    old_size: int
    recycled: bool


def claim(dirs: RootDirs, name: str, size: int = 0, prefault: bool = False) -> Claimed:
    """Claim a file for segment ``name`` now (see :func:`claim_file`), preallocated to at least
    ``size`` bytes where the filesystem allows (its size is then that) and, with ``prefault``,
    its first ``size`` bytes written with zeros (in the page cache when this returns)."""
    tmp, fd, old_size, recycled = claim_file(dirs, name)
    try:
        if old_size < size and preallocate(fd, size):
            old_size = size
        if prefault and size > 0:
            whole, rest = divmod(size, len(_ZEROS))
            write_from(fd, 0, [_ZEROS] * whole + ([_ZEROS[:rest]] if rest else []), chunk=WRITE_CHUNK)
            old_size = max(old_size, size)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirs.tmp)
        raise
    return Claimed(name, tmp, fd, old_size, recycled)


class SpareFiles:
    """Up to ``limit`` claimed files, refilled on an I/O thread (``submit``) after each call
    that used some.

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
        self._fill = False  # whether new spares are prefaulted (to _size)
        self._prealloc = prealloc
        self._prefault = prefault and prealloc  # an in-memory filesystem has no page to fault in
        self._pending = False
        self._closed = False

    def take(self) -> Claimed | None:
        """A spare file, or ``None`` (none left: the caller claims one itself)."""
        with self._mu:
            return self._files.pop() if self._files else None

    def names(self) -> set[str]:
        """The names in ``tmp/`` of the spares held now."""
        with self._mu:
            return {c.tmp_name for c in self._files}

    def refill(self, used: int, size: int = 0) -> None:
        """After a call that wrote ``used`` segments, the largest of ``size`` bytes: keep that many
        spares (at most the limit), claimed on an I/O thread, not in this one; new ones are
        preallocated to ``size`` when it is at most :data:`PREALLOC_MAX`."""
        with self._mu:
            if self._closed:
                return
            self._target = min(self._limit, max(self._target, used))
            self._size = size if self._prealloc and size <= PREALLOC_MAX else 0
            self._fill = self._prefault and self._size * max(1, used) <= PREFAULT_MAX
            if self._pending or len(self._files) >= self._target:
                return
            self._pending = True
        try:
            self._submit(self._run)
        except RuntimeError:  # no I/O thread takes it: the backend is closing
            with self._mu:
                self._pending = False

    def _run(self) -> None:
        with self._busy:
            with self._mu:
                self._pending = False
            while True:
                with self._mu:
                    if self._closed or len(self._files) >= self._target:
                        return
                    size, fill = self._size, self._fill
                try:
                    got = claim(self._dirs, self._new_name(), size, fill)
                except (OSError, UnsafeEntry) as exc:  # the write path claims (and reports) for itself
                    log.debug("file backend: no spare segment file: %s", exc)
                    return
                with self._mu:
                    if not self._closed:
                        self._files.append(got)
                        continue
                self._discard(got)
                return

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
        with contextlib.suppress(OSError):
            os.unlink(c.tmp_name, dir_fd=self._dirs.tmp)
        with contextlib.suppress(OSError):
            os.close(c.fd)

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
