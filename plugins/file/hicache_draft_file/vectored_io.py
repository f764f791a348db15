"""Vectored positional I/O that finishes the job: ``IOV_MAX`` chunks and partial transfers.

Writes are issued in calls of at most ``chunk`` bytes. On the development VM (Linux 6.18, ext4)
one 8 MiB ``pwritev`` into a new file runs at about 0.4 GB/s while the same bytes in 64 KiB calls
run at about 4 GB/s (the big call makes the kernel allocate large page-cache folios, which is
slow there); 64 KiB calls are never worse elsewhere, so that is the default.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))
WRITE_CHUNK = 64 << 10


def _calls(views: Sequence[memoryview], chunk: int) -> list[list[memoryview]]:
    """Split ``views`` into lists of at most ``chunk`` bytes and ``IOV_MAX`` entries."""
    calls: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = chunk
    for v in views:
        while v.nbytes:
            if room == 0 or len(cur) == IOV_MAX:
                calls.append(cur)
                cur, room = [], chunk
            part = v[:room] if v.nbytes > room else v
            cur.append(part)
            room -= part.nbytes
            v = v[part.nbytes :]
    if cur:
        calls.append(cur)
    return calls


def pwritev_all(fd: int, views: Sequence[memoryview], offset: int, chunk: int = WRITE_CHUNK) -> int:
    """Write the concatenation of ``views`` at ``offset``; return the offset after it."""
    for call in _calls(views, chunk):
        pending = call
        while pending:
            done = os.pwritev(fd, pending, offset)
            if done <= 0:
                raise OSError(errno.EIO, "pwritev made no progress")
            offset += done
            while done:
                n = pending[0].nbytes
                if done >= n:
                    done -= n
                    pending = pending[1:]
                else:
                    pending = [pending[0][done:], *pending[1:]]
                    done = 0
    return offset


def preadv_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` from ``offset``; return the bytes read (less than asked only at end of file)."""
    pending = [v for v in views if v.nbytes]
    total = 0
    i = 0
    while i < len(pending):
        got = os.preadv(fd, pending[i : i + IOV_MAX], offset)
        if got <= 0:
            break
        offset += got
        total += got
        while got:
            n = pending[i].nbytes
            if got >= n:
                got -= n
                i += 1
            else:
                pending[i] = pending[i][got:]
                got = 0
    return total
