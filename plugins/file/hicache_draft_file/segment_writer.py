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
from hicache_draft_file.rootfs import RootDirs, UnsafeEntry, ident
from hicache_draft_file.segment_format import SegmentIndex, build_footer, pool_table
from hicache_draft_file.vectored_io import WRITE_CHUNK, preallocate


@dataclass
class WrittenSegment:
    """A complete segment in ``tmp/``, not yet visible; ``fd`` is open read-write."""

    name: str
    tmp_name: str  # in tmp/ (the backend renames it relative to the directory's descriptor)
    tmp_dir: Path  # ROOT/tmp: the path is made only when a message or a test needs it
    fd: int
    index: SegmentIndex
    recycled: bool
    ident: tuple[int, int]  # (st_dev, st_ino): the catalog's check that a name still holds this file

    @property
    def tmp_path(self) -> Path:
        return self.tmp_dir / self.tmp_name


@dataclass
class SegmentFile:
    """A file claimed in ``tmp/`` for segment ``name``, open read-write and flocked: ``old_size``
    is its size when claimed (or preallocated); ``ident`` its (st_dev, st_ino), which a rename
    keeps; ``index`` is set once its footer is written (:func:`write_footer`)."""

    name: str
    tmp_name: str
    fd: int
    old_size: int
    recycled: bool
    ident: tuple[int, int]
    index: SegmentIndex | None = None


def claim_file(dirs: RootDirs, name: str) -> SegmentFile:
    """A file for segment ``name`` in ``tmp/``.

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
        return SegmentFile(name, tmp, fd, st.st_size, True, ident(st))
    fd, st = dirs.open_file(dirs.tmp, tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, single=True)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return SegmentFile(name, tmp, fd, 0, False, ident(st))


def tmp_name(segment: str) -> str:
    """The name in ``tmp/`` of a segment this process writes."""
    return f"{segment}.{os.getpid()}.tmp"


def open_segment_file(
    dirs: RootDirs, name: str, size: int, prealloc: bool = True, claimed: SegmentFile | None = None,
) -> SegmentFile:
    """The file to write segment ``name`` into: ``claimed`` (a spare claimed before the call) or
    one claimed now (:func:`claim_file`), preallocated to ``size`` bytes where the filesystem
    supports it (``old_size`` is then that; a spare claimed after a call of the same shape
    already is; ``prealloc=False``, an in-memory filesystem: never). On an error the file is
    removed and the error raised."""
    f = claimed if claimed is not None else claim_file(dirs, name)
    try:
        if prealloc and f.old_size < size and preallocate(f.fd, size):
            f.old_size = size
    except BaseException:
        discard_file(dirs, f)
        raise
    return f


def write_footer(f: SegmentFile, items: Sequence[tuple[str, Page]]) -> None:
    """Make the index of ``items`` (stored in this order from offset 0) and write its footer
    where their records end, in any order with the records (it depends only on the pages' keys
    and sizes); sets ``f.index``."""
    index = _index_of(items)
    footer = build_footer(index)
    index.size = index.data_end + len(footer)
    write_from(f.fd, index.data_end, [footer])
    f.index = index


def seal_segment(dirs: RootDirs, f: SegmentFile, wrote: int | None, fsync: bool) -> WrittenSegment:
    """``f`` once its records (``wrote`` bytes, when the core counted them) and footer are
    written: cut back to its end (a recycled file was larger), optionally fsynced. OSError (the
    caller discards the file) when the core wrote other than the index's bytes."""
    index = f.index
    assert index is not None, "seal_segment before write_footer"
    if wrote is not None and wrote != index.data_end:
        raise OSError(errno.EIO, f"the core wrote {wrote} bytes of records, the index says {index.data_end}")
    if f.old_size > index.size:
        os.ftruncate(f.fd, index.size)
    if fsync:
        os.fsync(f.fd)
    return WrittenSegment(name=f.name, tmp_name=f.tmp_name, tmp_dir=dirs.layout.tmp, fd=f.fd,
                          index=index, recycled=f.recycled, ident=f.ident)


def discard_file(dirs: RootDirs, f: SegmentFile | WrittenSegment) -> None:
    """Remove an unpublished segment file of this process and close it (removed first: its flock
    keeps other processes' stale-file cleaners away until its name is gone)."""
    with contextlib.suppress(OSError):
        os.unlink(f.tmp_name, dir_fd=dirs.tmp)
    with contextlib.suppress(OSError):
        os.close(f.fd)


def write_segment(
    dirs: RootDirs,
    name: str,
    items: Sequence[tuple[str, Page]],
    fsync: bool,
    chunk: int = WRITE_CHUNK,
    deadline: float = float("inf"),
    records: Callable[[int, int], int] | None = None,
    prealloc: bool = True,
    claimed: SegmentFile | None = None,
    data_end: int | None = None,
) -> WrittenSegment:
    """Write ``items`` as segment ``name`` into ``tmp/`` in the calling thread. On any error the
    file is removed and the error raised (nothing published, nothing already stored touched).

    The file (:func:`open_segment_file`) gets the records (header, payload, back to back from
    offset 0) in one :func:`write_from` call whose system calls end on multiples of ``chunk`` in
    the file: on the development VM (ext4, Linux 6.18) 128 records of 64 KiB written on aligned
    calls went in 1.3x faster than in calls cut at record boundaries (64 header bytes off every
    alignment) and read back 1.8x faster, as the kernel caches the file in large folios. A page
    that carries the core's header (made before the call from the bytes handed over) is stored
    with it as is; pages without one (direct hook calls) get theirs made here. Then the footer
    (:func:`write_footer`), made after the records so that writers working side by side do not
    start one after the other (on the H100 host, making it first held the GIL for 70-120 us per
    32-page segment ahead of each writer's records). Past ``deadline`` no further call is made:
    the write fails with :class:`TimeoutError` and the page buffers are not read any more.
    ``records(fd, chunk)``: the core's ``write_records`` for these pages (their headers zeroed,
    made by it as it writes them from offset 0; it returns the bytes written), used instead of
    writing the records here. ``claimed``, ``prealloc``: see :func:`open_segment_file`.
    ``data_end``: the records' bytes (every page's header and payload), when the caller has
    counted them already.
    """
    if data_end is None:
        data_end = 0
        for _pool, page in items:
            data_end += HEADER_SIZE + page.nbytes
    f = open_segment_file(dirs, name, data_end, prealloc, claimed)
    try:
        wrote = None
        if records is not None:
            wrote = records(f.fd, chunk)
        else:
            write_from(f.fd, 0, _record_buffers(items), chunk=chunk, deadline=deadline)
        write_footer(f, items)
        return seal_segment(dirs, f, wrote, fsync)
    except BaseException:
        discard_file(dirs, f)
        raise


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
