"""Memory the backend registers with the Mooncake client: host pools, staging, and its own
arenas (page headers, shared-memory bounce buffers).

In TCP mode any host memory works (registration only matters for RDMA, but everything is
registered anyway). In shared-memory mode (``setup_dummy``) the client only accepts memory from
its shared pool (``alloc_from_mem_pool``), registered with exactly the size allocated; this
module allocates such memory, remembers which address ranges are usable, and hands it out as
reusable arenas.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("hicache_draft_mooncake")

_MIN_ARENA = 4096


class SharedMemoryError(MemoryError):
    """The client's shared-memory pool could not provide or register memory."""


class Memory:
    """Registered ranges and arena allocation over one Mooncake client."""

    def __init__(self, store: Any, shm: bool) -> None:
        self._store = store
        self.shm = shm
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._registered: list[int] = []
        self._owned: list[object] = []
        self._free: dict[int, list[int]] = {}

    # -- ranges ------------------------------------------------------------------------------
    def _add_range(self, ptr: int, nbytes: int) -> None:
        i = bisect.bisect(self._starts, ptr)
        self._starts.insert(i, ptr)
        self._ends.insert(i, ptr + nbytes)

    def contains(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one registered range."""
        with self._lock:
            i = bisect.bisect(self._starts, ptr) - 1
            return i >= 0 and ptr + nbytes <= self._ends[i]

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
            self._add_range(ptr, nbytes)
            if rc == 0:
                self._registered.append(ptr)
        return ptr, arr

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` tensor over freshly allocated registered memory (a host-pool allocator)."""
        _, arr = self.allocate(nbytes)
        return torch.frombuffer(arr, dtype=torch.uint8)

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
            self._add_range(ptr, nbytes)
            if rc == 0:
                self._registered.append(ptr)
        if rc != 0:
            log.debug("mooncake register_buffer(%#x, %d) returned %d (fine over TCP)", ptr, nbytes, rc)
        return True

    @contextlib.contextmanager
    def arena(self, nbytes: int) -> Iterator[int]:
        """Borrow a registered arena of at least ``nbytes`` bytes (reused across calls)."""
        size = max(_MIN_ARENA, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            ptr = free.pop() if free else None
        if ptr is None:
            ptr, _ = self.allocate(size)
        try:
            yield ptr
        finally:
            with self._lock:
                self._free.setdefault(size, []).append(ptr)

    def release(self) -> None:
        """Unregister everything (before the client closes)."""
        with self._lock:
            ptrs, self._registered = self._registered, []
            self._free.clear()
            self._starts.clear()
            self._ends.clear()
        for ptr in ptrs:
            with contextlib.suppress(Exception):
                self._store.unregister_buffer(ptr)
