"""The values that cross the storage contract: buffers, pages, transfers and per-page results.

A backend never sees a torch tensor. It sees :class:`Page` objects, each a key plus one or more
:class:`Buffer` regions of host memory (pointer and size, viewable as a writable ``memoryview``).
On the zero-copy path those regions are the host pool's own memory at the page's slots; on the
generic path they are one contiguous staging buffer the controller copied the page into (or will
copy it out of). A backend handles both the same way: write the buffers' bytes on ``page_set``,
fill them on ``page_get``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

from hicache_draft.capabilities import Attention, Component, Layout, PoolKind


@functools.lru_cache(maxsize=512)
def _bytes_type(n: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    return ctypes.c_ubyte * n  # made once per size: creating an array type costs more than the view


@dataclass(frozen=True, slots=True)
class Buffer:
    """``nbytes`` bytes of host memory at address ``ptr``.

    ``owner`` keeps the memory alive (a tensor, bytearray, ...); backends can ignore it.
    Native clients (Mooncake, io_uring, ...) use ``ptr``/``nbytes``; Python code uses :meth:`view`.
    """

    ptr: int
    nbytes: int
    owner: object = field(default=None, repr=False, compare=False)

    def view(self) -> memoryview:
        """A writable byte view of the region (no copy)."""
        if self.nbytes == 0:
            return memoryview(bytearray())
        return memoryview(_bytes_type(self.nbytes).from_address(self.ptr)).cast("B")

    @classmethod
    def of(cls, obj: bytearray | memoryview) -> Buffer:
        """A buffer over a writable Python object (for tests and simple backends)."""
        mv = memoryview(obj).cast("B")
        if mv.readonly:
            raise ValueError("Buffer.of needs writable memory")
        arr = (ctypes.c_ubyte * mv.nbytes).from_buffer(mv)
        return cls(ctypes.addressof(arr), mv.nbytes, owner=(obj, arr))


@dataclass(frozen=True, slots=True)
class Page:
    """One page of one pool, as the backend sees it.

    ``key``: the storage key, ``f"{group}.{namespace}"``, made of lowercase hex and one dot; it
    carries every dimension that changes the bytes, so equal keys always mean equal bytes.
    ``group``: the chained page hash; the target and draft pages of one prefix page share it
    (a backend that evicts should evict a group together).
    ``namespace``: the fingerprint of (model, dtype, attention, page size, shape, layout, ranks,
    pool, head part); backends that write a header put it there.
    ``buffers``: the page's bytes are the concatenation of these regions, in order.
    ``header``: the page's 64-byte header (:mod:`hicache_draft.page_format`), in memory the core
    owns. On ``page_set`` it holds the header the core made from the bytes it hands over: store it
    verbatim with the page. On ``page_get`` it is zeroed: write the stored header into it. The core
    then checks it against the key and the bytes in ``buffers`` before anything counts as restored.
    The :class:`~hicache_draft.Store` fills it; code that builds pages leaves it ``None``.
    """

    key: str
    group: str
    namespace: str
    buffers: tuple[Buffer, ...]
    header: Buffer | None = None

    @property
    def nbytes(self) -> int:
        n = 0
        for b in self.buffers:  # a plain loop: asked per page per call, 2.7x a generator's speed
            n += b.nbytes
        return n


# The fields of Page (key, group, namespace, buffers, header) and Buffer (ptr, nbytes, owner), as
# the compiled builders (_native.make_pages, with_headers) set them on new instances.
_PAGE_FIELDS = tuple(vars(Page)[f.name] for f in fields(Page))
_BUFFER_FIELDS = tuple(vars(Buffer)[f.name] for f in fields(Buffer))
assert [f.name for f in fields(Page)] == ["key", "group", "namespace", "buffers", "header"]
assert [f.name for f in fields(Buffer)] == ["ptr", "nbytes", "owner"]


class PendingPages(Sequence["Page"]):
    """A transfer's pages, not built yet (a zero-copy batch named by host slots: see
    :meth:`hicache_draft.PoolBinding.zero_copy_transfer`). The Store builds them together with the
    headers it hands the backend, in one pass (:meth:`build` with a header block), instead of
    building them and then copying each to attach its header; any other reader gets them built once,
    on first access, without headers."""

    __slots__ = ("_built",)

    def __init__(self) -> None:
        self._built: list[Page] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def build(self, header_base: int = 0, header_owner: object = None) -> list[Page]:
        """The pages; with ``header_owner``, page ``i``'s header is the 64 bytes at ``header_base + 64
        * i`` (kept alive by ``header_owner``), else None. ValueError when they cannot be built."""
        raise NotImplementedError

    def _pages(self) -> list[Page]:
        if self._built is None:
            self._built = self.build()
        return self._built

    def __getitem__(self, index: int | slice) -> Any:  # noqa: ANN401  (a Page, or a list of them)
        return self._pages()[index]

    def __iter__(self) -> Iterator[Page]:
        return iter(self._pages())


@dataclass(frozen=True, slots=True)
class PageTransfer:
    """The pages of one pool in one batched call. ``pool`` is the pool's name (``"kv"``,
    ``"draft"``, ``"indexer"``, ...: the name it was registered under). ``zero_copy`` tells whether
    the buffers are the registered pool's own memory (True) or controller staging memory (False).
    ``pages`` may be :class:`PendingPages` (built by the Store, with their headers, when it hands
    them over): a Store always hands its backend lists of pages."""

    pool: str
    pages: Sequence[Page]
    zero_copy: bool = False


@dataclass(frozen=True, slots=True)
class PoolRegistration:
    """A host pool announced to the backend once, before any page I/O.

    ``regions``: the pool's whole memory (register it with an RDMA / shared-memory engine here).
    ``staging``: the controller's staging memory used on the generic path (register it too).
    ``page_nbytes`` and ``buffers_per_page`` describe one page as the backend will receive it.
    ``pool`` is the pool's name; ``role`` (target ``kv`` or ``draft``) and ``component`` say what it
    is; ``attention`` is None for row pools (``indexer``, ``state``).
    """

    pool: str
    attention: Attention | None
    layout: Layout
    namespace: str
    page_nbytes: int
    buffers_per_page: int
    regions: tuple[Buffer, ...]
    staging: tuple[Buffer, ...] = ()
    role: PoolKind | None = None
    component: Component = Component.KV

    def __post_init__(self) -> None:
        if self.role is None:  # the classic pools: "draft" is the draft's, "kv" the target's
            object.__setattr__(self, "role", PoolKind.DRAFT if self.pool == PoolKind.DRAFT else PoolKind.KV)


class PageResult(IntEnum):
    """The outcome of one page in a batched call."""

    OK = 0
    MISS = 1  # not stored (never written, evicted, lost)
    CORRUPT = 2  # stored bytes failed validation; never returned as data
    FAILED = 3  # I/O, transport or timeout failure

