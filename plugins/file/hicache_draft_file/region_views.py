"""Byte views of page buffers that lie in registered memory: slices of one view per region.

``Buffer.view()`` builds a ctypes array and two memoryviews on every call, and a ``page_get`` of
128 two-buffer pages asks for 256 of them. The pools a controller registers (``register_pool``:
the pool's regions and its staging memory) are viewed once here, and a buffer inside one of them
becomes a slice of that view: one object, about a third of the time, less garbage-collector work.
A buffer outside every registered region gets ``Buffer.view()``, so the result never depends on
what was registered, only the cost does.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

from hicache_draft import Buffer


class RegionViews:
    """An immutable table of registered regions; build a new one when the registrations change."""

    def __init__(self, regions: Iterable[Buffer] = ()) -> None:
        spans = sorted((b for b in regions if b.nbytes > 0), key=lambda b: (b.ptr, -b.nbytes))
        self._starts = [b.ptr for b in spans]
        # the Buffer is kept with its view: its owner keeps the memory alive as long as the table
        self._spans = [(b.ptr, b.ptr + b.nbytes, b.view(), b) for b in spans]

    def __len__(self) -> int:
        return len(self._spans)

    def view(self, buf: Buffer) -> memoryview:
        """A writable byte view of ``buf`` (no copy), a slice of its region's view when one holds it."""
        ptr = buf.ptr
        j = bisect_right(self._starts, ptr) - 1
        if j >= 0:
            start, end, whole, _buf = self._spans[j]
            if ptr + buf.nbytes <= end:
                return whole[ptr - start : ptr - start + buf.nbytes]
        return buf.view()


class SliceViews:
    """Views of buffers that lie inside their ``owner`` when it is itself a :class:`Buffer` (the
    core's page headers: one block per call, handed out as 64-byte buffers owning the block):
    the owner is viewed once, each buffer is a slice of it. Anything else gets ``Buffer.view()``.
    One instance per call; it keeps the owners it viewed alive while it lives."""

    __slots__ = ("_owners",)

    def __init__(self) -> None:
        self._owners: dict[int, tuple[int, int, memoryview, Buffer]] = {}

    def view(self, buf: Buffer) -> memoryview:
        owner = buf.owner
        if type(owner) is Buffer:
            got = self._owners.get(id(owner))
            if got is None:
                got = self._owners[id(owner)] = (owner.ptr, owner.ptr + owner.nbytes, owner.view(), owner)
            start, end, whole, _keep = got
            ptr = buf.ptr
            if start <= ptr and ptr + buf.nbytes <= end:
                return whole[ptr - start : ptr - start + buf.nbytes]
        return buf.view()
