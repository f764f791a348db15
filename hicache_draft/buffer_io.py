"""Positional vectored I/O between a file and page buffers, without the GIL.

For backends that keep pages in files (the file backend's segments, a local cache tier, ...):
one call moves a whole list of buffers (a run of records: each page's ``header`` and its
``buffers``) with as many ``preadv``/``pwritev`` system calls as ``IOV_MAX`` and partial
transfers need, all with the GIL released, so several threads that split a batch move bytes in
parallel. A buffer is a :class:`~hicache_draft.Buffer` (its ``ptr``/``nbytes`` are used as they
are, no view is made) or any object with the buffer protocol (``bytes``, ``bytearray``,
``memoryview``; writable ones for reads).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from hicache_draft import _native
from hicache_draft.transfer import Buffer

IOV_MAX: int = _native.IOV_MAX
_NO_CHUNK = 1 << 62

CORE_THREADS = max(1, min(16, os.cpu_count() or 1))
"""The most threads one call of the core's compiled helpers uses: the calling thread and helpers."""


def threads_for(nbytes: int, share: int, most: int = CORE_THREADS) -> int:
    """Threads for a call that moves or hashes ``nbytes``: one per ``share`` bytes, at least one and
    at most ``most``."""
    return min(most, max(1, nbytes // share))


def copy_regions(dsts: Sequence[int], srcs: Sequence[int], nbytes: int, *, threads: int = 1) -> None:
    """Copy ``nbytes`` from each address ``srcs[i]`` to ``dsts[i]`` (regions that do not overlap,
    kept alive by the caller), with the GIL released, shared by the calling thread and up to
    ``threads - 1`` of the core's compiled helper threads."""
    _native.copy_regions(dsts, srcs, nbytes, threads)


def read_into(fd: int, offset: int, buffers: Sequence[Buffer | bytearray | memoryview]) -> int:
    """Fill ``buffers``, in order, from ``fd`` at ``offset``; return the bytes read, fewer than
    asked only at end of file. An I/O error raises :class:`OSError` (the buffers may be partly
    filled)."""
    return _native.read_into(fd, offset, buffers)


def write_from(
    fd: int,
    offset: int,
    buffers: Sequence[Buffer | bytes | bytearray | memoryview],
    *,
    chunk: int | None = None,
    deadline: float = math.inf,
) -> int:
    """Write the concatenation of ``buffers`` to ``fd`` at ``offset``; return the bytes written
    (all of them). With ``chunk``, every system call ends on a multiple of ``chunk`` in the file
    (so the kernel can cache it in large folios, and no call copies more than ``chunk``). Before
    each call the monotonic clock is checked against ``deadline`` (``time.monotonic()`` seconds):
    past it nothing more is written and :class:`TimeoutError` is raised, so a late writer stops
    reading the buffers. An I/O error raises :class:`OSError`."""
    return _native.write_from(fd, offset, buffers, chunk or _NO_CHUNK, deadline)
