"""The file backend's write tuning and preallocation; the vectored I/O itself is the core's
(:func:`hicache_draft.read_into`, :func:`hicache_draft.write_from`: ``IOV_MAX`` chunks and partial
transfers, without the GIL).

Writes are issued in calls of at most ``WRITE_CHUNK`` bytes, each ending on a multiple of it in
the file. On the development VM (Linux 6.18, ext4, page cache dropped between batches as the
benchmark does) one 8 MiB ``pwritev`` into a new file runs at about 0.4 GB/s, and 1 MiB calls
sometimes do too once a file passes tens of MiB (the kernel allocates page-cache folios as large
as the call, which is slow there), while 64-512 KiB calls run at 3.5-5 GB/s. Within that range
larger calls are faster: in the benchmark's 128 MiB batches of 1 MiB pages, 256 KiB calls wrote
3.9-4.0 GB/s where 64 KiB calls wrote 2.7 GB/s, and 8 MiB batches of 64 KiB pages went from 1.35
to 1.6 GB/s. 256 KiB is the default; calls on aligned offsets let the kernel use large folios
(see ``segment_writer.write_segment``).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

WRITE_CHUNK = 256 << 10


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """``fallocate(2)`` from the C library (Linux), or ``None``. Not ``os.posix_fallocate``: where
    the filesystem lacks fallocate, glibc emulates it by writing every block, which costs more
    than the preallocation saves."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def preallocate(fd: int, size: int) -> bool:
    """Reserve the blocks of ``fd`` up to ``size`` bytes (the file's size becomes at least
    ``size``); best effort, ``False`` where the filesystem cannot (or is full: the write that
    follows then fails with the real error). Writing into preallocated blocks skips the per-page
    delayed-allocation work of extending a file: on the development VM 8 MiB in 64 KiB calls went
    from 4.6 to 5.2 GB/s, and the benchmark's 64 KiB-page sets about 5% faster."""
    if _FALLOCATE is None or size <= 0:
        return False
    return _FALLOCATE(fd, 0, 0, size) == 0


# filesystems that keep files in memory: there fallocate allocates and zeroes every page, which
# the write that follows overwrites, and there is no block layout to gain. Same-process A/B on the
# H200 host (new files, alternating): /dev/shm page_set 1.01-1.05x faster without it for 128 x 64
# KiB, 1.05-1.11x for 16 x 8 MiB; ext4 0.93x without it at 64 KiB (kept there), 0.95-1.02x at 8 MiB
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def _load_fstatfs() -> Callable[[int, ctypes.Array[ctypes.c_char]], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


_FSTATFS = _load_fstatfs()


def memory_filesystem(fd: int) -> str | None:
    """The name of the in-memory filesystem ``fd`` lives on (``tmpfs``, ``ramfs``), or ``None``
    (another filesystem, or one that cannot be told): where preallocating only costs."""
    if _FSTATFS is None:
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs: f_type, a long, comes first
    if _FSTATFS(fd, buf) != 0:
        return None
    return _MEMORY_FS.get(int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder))
