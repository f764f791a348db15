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
from collections.abc import Iterator, Sequence
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
        self._registered: list[int] = []
        self._owned: list[object] = []
        self._free: dict[int, list[Arena]] = {}

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
                self._registered.append(ptr)
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
                self._registered.append(ptr)
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

    def release(self) -> None:
        """Unregister everything (before the client closes)."""
        with self._lock:
            ptrs, self._registered = self._registered, []
            self._free.clear()
            self._starts.clear()
            self._ends.clear()
            self._views.clear()
        for ptr in ptrs:
            with contextlib.suppress(Exception):
                self._store.unregister_buffer(ptr)
