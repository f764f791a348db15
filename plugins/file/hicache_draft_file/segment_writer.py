"""Writing one segment: claim a file in ``tmp/`` (a recycled one when there is one), write the
records straight from the page buffers (one :func:`hicache_draft.write_from` call: ``pwritev``
without the GIL), append the footer, optionally fsync. Publishing (the rename into ``seg/``) is
the caller's, under the shared root lock."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache_draft import HEADER_SIZE, Buffer, Page, make_headers, write_from
from hicache_draft_file.rootfs import RootDirs, UnsafeEntry
from hicache_draft_file.segment_format import SegmentIndex, build_footer, pool_table
from hicache_draft_file.vectored_io import WRITE_CHUNK, preallocate


@dataclass
class WrittenSegment:
    """A complete segment in ``tmp/``, not yet visible; ``fd`` is open read-write."""

    name: str
    tmp_name: str  # in tmp/ (the backend renames it relative to the directory's descriptor)
    tmp_path: Path  # for messages
    fd: int
    index: SegmentIndex
    recycled: bool


def claim_file(dirs: RootDirs, name: str) -> tuple[str, int, int, bool]:
    """A file for segment ``name`` in ``tmp/``: (name in tmp/, fd, old size, recycled).

    An evicted file from ``free/`` is taken by rename (atomic: two writers never get the same
    one) and used only when it is a regular file with a single link (a link placed there by
    someone else is quarantined, never written through); otherwise a new file is created. The
    file is named after this process (``<segment>.<pid>.tmp``) and flocked while written, which
    tells the stale-file cleaner that its writer is alive.
    """
    tmp = tmp_name(name)
    try:
        with os.scandir(dirs.free) as it:
            candidates = [e.name for e in it if e.name.endswith(".free")]
    except OSError:
        candidates = []
    for cand in candidates:
        try:
            os.rename(cand, tmp, src_dir_fd=dirs.free, dst_dir_fd=dirs.tmp)
        except FileNotFoundError:
            continue
        try:
            fd, st = dirs.open_file(dirs.tmp, tmp, os.O_RDWR, single=True)
        except UnsafeEntry as exc:
            dirs.unsafe_entry(dirs.tmp, tmp, dirs.layout.free / cand, exc)
            continue
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, fd, st.st_size, True
    fd, _st = dirs.open_file(dirs.tmp, tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, single=True)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return tmp, fd, 0, False


def tmp_name(segment: str) -> str:
    """The name in ``tmp/`` of a segment this process writes."""
    return f"{segment}.{os.getpid()}.tmp"


def write_segment(
    dirs: RootDirs,
    name: str,
    items: Sequence[tuple[str, Page]],
    fsync: bool,
    chunk: int = WRITE_CHUNK,
    deadline: float = float("inf"),
    records: Callable[[int, int], int] | None = None,
    prealloc: bool = True,
    claimed: tuple[str, int, int, bool] | None = None,
    data_end: int | None = None,
) -> WrittenSegment:
    """Write ``items`` as segment ``name`` into ``tmp/``. On any error the file is removed and
    the error raised (nothing published, nothing already stored touched).

    The file is preallocated to the records' bytes (where the filesystem supports it; a spare
    claimed after a call of the same shape already is, footer included). Then the records
    (header, payload, back to back from offset 0) go out in one :func:`write_from` call whose
    system calls end on multiples of ``chunk`` in the file: on the development VM (ext4, Linux
    6.18) 128 records of 64 KiB written on aligned calls went in 1.3x faster than in calls cut at
    record boundaries (64 header bytes off every alignment) and read back 1.8x faster, as the
    kernel caches the file in large folios. A page that carries the core's header (made before the
    call from the bytes handed over) is stored with it as is; pages without one (direct hook
    calls) get theirs made here. The index and the footer (they depend only on the pages' keys and
    sizes) are made after the records, so that writers working side by side do not start one after
    the other: on the H100 host, making them first held the GIL for 70-120 us per 32-page segment
    ahead of each writer's records. Past ``deadline`` no further call is made: the write fails with
    :class:`TimeoutError` and the page buffers are not read any more. ``records(fd, chunk)``: the
    core's ``write_records`` for these pages (their headers zeroed, made by it as it writes them
    from offset 0; it returns the bytes written), used instead of writing the records here.
    ``prealloc=False`` (an in-memory filesystem) skips the preallocation. ``claimed``: the file to
    write, as :func:`claim_file` returned it for ``name`` (a spare claimed before the call);
    otherwise one is claimed here. ``data_end``: the records' bytes (every page's header and
    payload), when the caller has counted them already.
    """
    tmp, fd, old_size, recycled = claimed if claimed is not None else claim_file(dirs, name)
    try:
        if data_end is None:
            data_end = 0
            for _pool, page in items:
                data_end += HEADER_SIZE + page.nbytes
        if prealloc and old_size < data_end:
            preallocate(fd, data_end)
        wrote = None
        if records is not None:
            wrote = records(fd, chunk)
        else:
            write_from(fd, 0, _record_buffers(items), chunk=chunk, deadline=deadline)
        # made while the other writers' records go out (their calls release the GIL): made before
        # them, each writer's index held the GIL and delayed the next writer's start
        index = _index_of(items)
        if wrote is not None and wrote != index.data_end:
            raise OSError(errno.EIO, f"the core wrote {wrote} bytes of records, the index says {index.data_end}")
        footer = build_footer(index)
        end = index.data_end + len(footer)
        index.size = end
        write_from(fd, index.data_end, [footer])
        if old_size > end:
            os.ftruncate(fd, end)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirs.tmp)
        raise
    return WrittenSegment(
        name=name, tmp_name=tmp, tmp_path=dirs.layout.tmp / tmp, fd=fd, index=index, recycled=recycled
    )


def _record_buffers(items: Sequence[tuple[str, Page]]) -> list[Buffer | memoryview]:
    """Every record's header then its payload buffers, in segment order."""
    missing = [(page.key, page.namespace, pool, page.buffers) for pool, page in items if page.header is None]
    made = memoryview(make_headers(missing)) if missing else None
    out: list[Buffer | memoryview] = []
    j = 0
    for _pool, page in items:
        head = page.header
        if head is None:
            assert made is not None
            out.append(made[j * HEADER_SIZE : (j + 1) * HEADER_SIZE])
            j += 1
        else:
            out.append(head)
        out.extend(page.buffers)
    return out


def _index_of(items: Sequence[tuple[str, Page]]) -> SegmentIndex:
    """The index of a segment holding ``items`` in order from offset 0 (``size`` is set once the
    footer is made)."""
    lengths = array("Q", [page.nbytes for _pool, page in items])
    ends = list(itertools.accumulate(lengths, lambda at, n: at + HEADER_SIZE + n, initial=0))
    at = ends.pop()
    offsets = array("Q", ends)
    names, codes = pool_table(pool for pool, _page in items)
    return SegmentIndex(
        size=0,
        data_end=at,
        keys=[page.key for _pool, page in items],
        groups=[page.group for _pool, page in items],
        pools=codes,
        offsets=offsets,
        lengths=lengths,
        names=names,
    )
