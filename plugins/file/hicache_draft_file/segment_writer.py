"""Writing one segment: claim a file in ``tmp/`` (a recycled one when there is one), write the
records straight from the page buffers with ``pwritev``, append the footer, optionally fsync.
Publishing (the rename into ``seg/``) is the caller's, under the shared root lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import threading
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from hicache_draft import HEADER_SIZE, Buffer, Page, PoolKind, make_header
from hicache_draft_file.naming import RootLayout
from hicache_draft_file.segment_format import POOL_CODE, Record, SegmentIndex, build_footer
from hicache_draft_file.vectored_io import WRITE_CHUNK, preallocate, pwritev_all

# Segments under 1 MiB, or of records under 256 KiB on average, are written by the calling
# thread alone. A hand-off to the writer thread costs a wake-up (20-100 us on the development VM)
# and, while both threads run Python, GIL hand-overs: for 64 KiB pages that cost more than the
# overlap saved (8 MiB batches: 1.48 GB/s pipelined, 1.67 GB/s in one thread), while 1 MiB pages
# gain (128 MiB batches: 3.2-3.5 GB/s pipelined, 2.7-2.8 GB/s in one thread).
_PIPELINE_MIN = 1 << 20
_PIPELINE_MIN_RECORD = 256 << 10


@dataclass
class WrittenSegment:
    """A complete segment in ``tmp/``, not yet visible; ``fd`` is open read-write."""

    name: str
    tmp_path: Path
    fd: int
    index: SegmentIndex
    recycled: bool


def claim_file(layout: RootLayout, name: str) -> tuple[Path, int, int, bool]:
    """A file for segment ``name`` in ``tmp/``: (path, fd, old size, recycled).

    An evicted file from ``free/`` is taken by rename (atomic: two writers never get the same
    one); otherwise a new file is created. The file is flocked while written, which tells the
    stale-file cleaner that its writer is alive.
    """
    tmp = layout.tmp / f"{name}.tmp"
    try:
        candidates = [e.name for e in os.scandir(layout.free) if e.name.endswith(".free")]
    except FileNotFoundError:
        candidates = []
    for cand in candidates:
        try:
            os.rename(layout.free / cand, tmp)
        except FileNotFoundError:
            continue
        fd = os.open(tmp, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, fd, os.fstat(fd).st_size, True
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return tmp, fd, 0, False


def write_segment(
    layout: RootLayout,
    name: str,
    items: Sequence[tuple[PoolKind, Page]],
    fsync: bool,
    view: Callable[[Buffer], memoryview] = Buffer.view,
    io: Executor | None = None,
    chunk: int = WRITE_CHUNK,
) -> WrittenSegment:
    """Write ``items`` as segment ``name`` into ``tmp/``. On any error the file is removed and
    the error raised (nothing published, nothing already stored touched).

    The layout and the footer depend only on the pages' sizes, so they are computed first and the
    file is preallocated to its final size (where the filesystem supports it). Then each page's
    header (xxh3 of its payload) is made and whole records are written in calls of about
    ``chunk`` bytes (a larger record is cut into ``chunk``-byte calls). With ``io`` (and at least
    ``_PIPELINE_MIN`` bytes) the calls are handed to a thread of ``io`` as they are made, so the
    headers of the next records are computed while the previous ones are copied into the file
    (``pwritev`` and xxh3 both release the GIL). ``view`` gives a buffer's bytes (the backend
    passes slices of its registered regions, cheaper than ``Buffer.view``).
    """
    tmp, fd, old_size, recycled = claim_file(layout, name)
    try:
        records: list[Record] = []
        offset = 0
        for pool, page in items:
            n = page.nbytes
            records.append(Record(page.key, page.group, pool, offset, n))
            offset += HEADER_SIZE + n
        footer = build_footer(records, offset)
        end = offset + len(footer)
        if old_size < end:
            preallocate(fd, end)
        if io is not None and offset >= max(_PIPELINE_MIN, _PIPELINE_MIN_RECORD * len(records)):
            _write_pipelined(fd, items, records, view, chunk, io)
        else:
            _write_records(items, records, view, chunk, lambda iov, at: pwritev_all(fd, iov, at, chunk))
        pwritev_all(fd, [memoryview(footer)], offset)
        if old_size > end:
            os.ftruncate(fd, end)
        if fsync:
            os.fsync(fd)
        index = _index_of(records, offset, end)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return WrittenSegment(name=name, tmp_path=tmp, fd=fd, index=index, recycled=recycled)


_Emit = Callable[[list[memoryview], int], object]


def _write_records(
    items: Sequence[tuple[PoolKind, Page]],
    records: Sequence[Record],
    view: Callable[[Buffer], memoryview],
    chunk: int,
    emit: _Emit,
) -> None:
    """Records (header + payload) from offset 0 as ``emit(views, offset)``: whole records
    up to ``chunk`` bytes per call, a larger record alone (cut into ``chunk``-byte calls by
    :func:`pwritev_all`). Each header is made right before its record is handed on."""
    iov: list[memoryview] = []
    pending = 0  # bytes in iov
    at = 0  # file offset of iov[0]
    for (pool, page), rec in zip(items, records, strict=True):
        bufs = [view(b) for b in page.buffers]
        span = HEADER_SIZE + rec.payload_len
        head = memoryview(make_header(page.key, page.namespace, pool, bufs))
        if pending and pending + span > chunk:
            emit(iov, at)
            at += pending
            iov, pending = [], 0
        if span > chunk:
            emit([head, *bufs], at)
            at += span
        else:
            iov.append(head)
            iov.extend(bufs)
            pending += span
    if pending:
        emit(iov, at)


def _write_pipelined(
    fd: int,
    items: Sequence[tuple[PoolKind, Page]],
    records: Sequence[Record],
    view: Callable[[Buffer], memoryview],
    chunk: int,
    io: Executor,
) -> None:
    """:func:`_write_records` with the writes done by a thread of ``io``, fed through a queue.
    The writer stops at its first error, which is raised here once this thread has stopped
    feeding it; the file descriptor is never closed while the writer may still use it."""
    calls: queue.SimpleQueue[tuple[list[memoryview], int, int] | None] = queue.SimpleQueue()
    failed = threading.Event()

    def drain() -> None:
        try:
            while (call := calls.get()) is not None:
                pwritev_all(fd, *call)
        except BaseException:
            failed.set()
            raise

    def emit(iov: list[memoryview], at: int) -> None:
        if failed.is_set():
            raise _WriterStopped
        calls.put((iov, at, chunk))

    try:
        writer = io.submit(drain)
    except RuntimeError:  # the executor is shut down (the backend is closing): write inline
        _write_records(items, records, view, chunk, lambda iov, at: pwritev_all(fd, iov, at, chunk))
        return
    try:
        _write_records(items, records, view, chunk, emit)
    except _WriterStopped:
        pass
    finally:
        calls.put(None)
        error = writer.exception()  # waits: the writer is done with fd before anyone closes it
    if error is not None:
        raise error


class _WriterStopped(Exception):
    """The writer thread failed; stop making records (its error is raised instead)."""


def _index_of(records: Sequence[Record], data_end: int, size: int) -> SegmentIndex:
    return SegmentIndex(
        size=size,
        data_end=data_end,
        keys=[r.key for r in records],
        groups=[r.group for r in records],
        pools=bytes(POOL_CODE[r.pool] for r in records),
        offsets=array("Q", (r.offset for r in records)),
        lengths=array("Q", (r.payload_len for r in records)),
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
