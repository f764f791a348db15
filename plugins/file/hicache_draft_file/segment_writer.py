"""Writing one segment: claim a file in ``tmp/`` (a recycled one when there is one), write the
records straight from the page buffers with ``pwritev``, append the footer, optionally fsync.
Publishing (the rename into ``seg/``) is the caller's, under the shared root lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache_draft import HEADER_SIZE, Page, PoolKind, make_header
from hicache_draft_file.naming import RootLayout
from hicache_draft_file.segment_format import POOL_CODE, Record, SegmentIndex, build_footer
from hicache_draft_file.vectored_io import pwritev_all


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
    layout: RootLayout, name: str, items: Sequence[tuple[PoolKind, Page]], fsync: bool
) -> WrittenSegment:
    """Write ``items`` as segment ``name`` into ``tmp/``. On any error the file is removed and
    the error raised (nothing published, nothing already stored touched)."""
    tmp, fd, old_size, recycled = claim_file(layout, name)
    try:
        views: list[memoryview] = []
        records: list[Record] = []
        offset = 0
        for pool, page in items:
            bufs = [b.view() for b in page.buffers]
            views.append(memoryview(make_header(page.key, page.namespace, pool, bufs)))
            views.extend(bufs)
            nbytes = sum(v.nbytes for v in bufs)
            records.append(Record(page.key, page.group, pool, offset, nbytes))
            offset += HEADER_SIZE + nbytes
        views.append(memoryview(build_footer(records, offset)))
        end = pwritev_all(fd, views, 0)
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
