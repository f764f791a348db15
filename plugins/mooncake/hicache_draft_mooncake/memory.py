"""Memory the backend registers with the Mooncake client: host pools, staging, and its own
arenas (page headers, staging slots).

In TCP mode any host memory works (registration only matters for RDMA, but everything is
registered anyway). In shared-memory mode (``setup_dummy``) the client only accepts memory from
its shared pool (``alloc_from_mem_pool``), registered with exactly the size allocated; this
module allocates such memory, remembers which address ranges are usable, and hands it out as
reusable arenas.

Every known range keeps one ``memoryview`` over its whole extent, so a byte view of any
region inside it (for checksums) is a slice, not a new ctypes object per buffer.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_draft import Buffer

log = logging.getLogger("hicache_draft_mooncake")

_MIN_ARENA = 4096


class SharedMemoryError(MemoryError):
    """The client's shared-memory pool could not provide or register memory."""


def _view_at(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


@dataclass(frozen=True, slots=True)
class Arena:
    """A borrowed block of registered memory: its address, size and a byte view over it."""

    ptr: int
    size: int
    view: memoryview


class Memory:
    """Registered ranges and arena allocation over one Mooncake client."""

    def __init__(self, store: Any, shm: bool) -> None:  # noqa: ANN401 (the native client)
        self._store = store
        self.shm = shm
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._views: list[memoryview] = []
        self._registered: dict[int, int] = {}  # ptr -> nbytes
        self._owned: list[object] = []
        self._free: dict[int, list[Arena]] = {}
        self._arenas: list[Arena] = []
        self.host_bytes = 0  # bytes handed out for host pools (host_memory hook)

    # -- ranges ------------------------------------------------------------------------------
    def _add_range(self, ptr: int, nbytes: int, view: memoryview) -> None:
        i = bisect.bisect(self._starts, ptr)
        self._starts.insert(i, ptr)
        self._ends.insert(i, ptr + nbytes)
        self._views.insert(i, view)

    def _find(self, ptr: int, nbytes: int) -> int:
        i = bisect.bisect(self._starts, ptr) - 1
        return i if i >= 0 and ptr + nbytes <= self._ends[i] else -1

    def contains(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one registered range."""
        with self._lock:
            return self._find(ptr, nbytes) >= 0

    def view(self, ptr: int, nbytes: int) -> memoryview:
        """A writable byte view of ``[ptr, ptr + nbytes)`` (a slice of a known range when it is in one)."""
        with self._lock:
            i = self._find(ptr, nbytes)
            if i >= 0:
                off = ptr - self._starts[i]
                return self._views[i][off : off + nbytes]
        return _view_at(ptr, nbytes) if nbytes else memoryview(bytearray())

    def inside(self, buffers: Sequence[Buffer]) -> bool:
        """Whether every buffer lies inside a registered range (one lock for all of them)."""
        with self._lock:
            return all(self._find(b.ptr, b.nbytes) >= 0 for b in buffers)

    def inside_each(self, pages: Iterable[Sequence[Buffer]]) -> list[bool]:
        """For each page's buffers, whether all lie inside registered ranges (one lock for the
        batch; a page's buffers usually share the range the page before them was found in)."""
        out: list[bool] = []
        with self._lock:
            starts, ends = self._starts, self._ends
            lo, hi = 1, 0  # the range found last (none yet)
            for buffers in pages:
                ok = True
                for b in buffers:
                    ptr, end = b.ptr, b.ptr + b.nbytes
                    if lo <= ptr and end <= hi:
                        continue
                    i = bisect.bisect(starts, ptr) - 1
                    if i < 0 or end > ends[i]:
                        ok = False
                        break
                    lo, hi = starts[i], ends[i]
                out.append(ok)
        return out

    def views(self, buffers: Sequence[Buffer]) -> list[memoryview]:
        """Byte views of ``buffers`` (slices of known ranges; one lock for all of them)."""
        out: list[memoryview] = []
        with self._lock:
            for b in buffers:
                i = self._find(b.ptr, b.nbytes)
                if i < 0:
                    break
                off = b.ptr - self._starts[i]
                out.append(self._views[i][off : off + b.nbytes])
        if len(out) < len(buffers):
            out += [self.view(b.ptr, b.nbytes) for b in buffers[len(out) :]]
        return out

    # -- allocation --------------------------------------------------------------------------
    def allocate_host(self, nbytes: int) -> tuple[int, ctypes.Array[ctypes.c_ubyte]]:
        """Registered memory for a host pool (counted in :attr:`host_bytes`)."""
        out = self.allocate(nbytes)
        with self._lock:
            self.host_bytes += nbytes
        return out

    def allocate(self, nbytes: int) -> tuple[int, ctypes.Array[ctypes.c_ubyte]]:
        """``nbytes`` of registered memory (from the shared pool in shm mode)."""
        if nbytes < 1:
            raise ValueError("allocation size must be >= 1")
        if self.shm:
            ptr = int(self._store.alloc_from_mem_pool(nbytes))
            if ptr == 0:
                raise SharedMemoryError(
                    f"the mooncake shared-memory pool could not allocate {nbytes} bytes (raise shm_pool_size)"
                )
            arr = (ctypes.c_ubyte * nbytes).from_address(ptr)
        else:
            arr = (ctypes.c_ubyte * nbytes)()
            ptr = ctypes.addressof(arr)
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0 and self.shm:
            raise SharedMemoryError(f"register_buffer of {nbytes} shared-memory bytes returned {rc}")
        with self._lock:
            self._owned.append(arr)
            self._add_range(ptr, nbytes, memoryview(arr).cast("B"))
            if rc == 0:
                self._registered[ptr] = nbytes
        return ptr, arr

    def register_external(self, ptr: int, nbytes: int) -> bool:
        """Register memory this module did not allocate (TCP/RDMA mode); whether it is now usable.

        In shm mode only ranges inside the shared pool are usable; those are registered already.
        """
        if nbytes < 1 or self.contains(ptr, nbytes):
            return True
        if self.shm:
            return False
        rc = self._store.register_buffer(ptr, nbytes)
        with self._lock:
            self._add_range(ptr, nbytes, _view_at(ptr, nbytes))
            if rc == 0:
                self._registered[ptr] = nbytes
        if rc != 0:
            log.debug("mooncake register_buffer(%#x, %d) returned %d (fine over TCP)", ptr, nbytes, rc)
        return True

    def borrow(self, nbytes: int) -> Arena:
        """A registered arena of at least ``nbytes`` bytes; :meth:`give_back` it when done.

        Arenas are allocated (and registered) once per size class and reused across calls.
        """
        size = max(_MIN_ARENA, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            arena = free.pop() if free else None
        if arena is None:
            ptr, arr = self.allocate(size)
            arena = Arena(ptr, size, memoryview(arr).cast("B"))
            with self._lock:
                self._arenas.append(arena)
        return arena

    def give_back(self, arena: Arena) -> None:
        with self._lock:
            self._free.setdefault(arena.size, []).append(arena)

    @contextlib.contextmanager
    def arena(self, nbytes: int) -> Iterator[Arena]:
        """``with memory.arena(n) as a:`` borrow an arena for the block."""
        a = self.borrow(nbytes)
        try:
            yield a
        finally:
            self.give_back(a)

    def release(self) -> int:
        """Unregister everything this module registered (before the client closes); how many
        ``unregister_buffer`` calls failed. The memory itself stays mapped: host pools built on
        it may still be in use."""
        with self._lock:
            ptrs, self._registered = list(self._registered), {}
            self._free.clear()
            self._starts.clear()
            self._ends.clear()
            self._views.clear()
        failed = 0
        for ptr in ptrs:
            try:
                rc = self._store.unregister_buffer(ptr)
            except Exception:  # noqa: BLE001 (closing: count it, carry on)
                rc = -1
            if rc != 0:
                failed += 1
                log.debug("mooncake unregister_buffer(%#x) returned %s", ptr, rc)
        return failed

    def registered(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every buffer registered with the client now."""
        with self._lock:
            return list(self._registered.items())

    def discard_arenas(self) -> int:
        """Give the pages of this module's own shared-memory arenas back to the system (after a
        holder restart made them useless: Mooncake offers no way to free or re-register them).
        The mappings stay valid (they read as zeros); host pool memory is never touched.
        Returns the bytes given back."""
        if not self.shm:
            return 0
        with self._lock:
            arenas, self._arenas = self._arenas, []
            self._free.clear()
        madvise = getattr(_libc(), "madvise", None)
        done = 0
        for a in arenas:
            if madvise is not None and madvise(ctypes.c_void_p(a.ptr), ctypes.c_size_t(a.size), _MADV_REMOVE) == 0:
                done += a.size
        return done


_MADV_REMOVE = 9


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
