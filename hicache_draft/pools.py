"""Host KV pools (L2): MHA and MLA, four layouts, page views, copies and zero-copy metadata.

Shapes (``L`` layers, ``S`` slots, ``P = S / ps`` pages, ``H`` heads, ``D`` head dim, ``d`` latent dim):

=====================  ==========================  =======================
layout                 MHA ``buffer``               MLA ``buffer``
=====================  ==========================  =======================
``layer_first``        ``(2, L, S, H, D)``          ``(L, S, 1, d)``
``page_first``         ``(2, S, L, H, D)``          ``(S, L, 1, d)``
``page_first_direct``  ``(2, P, L, ps, H, D)``      ``(P, L, ps, 1, d)``
``page_head``          ``(2, P, H, ps, L, D)``      (MHA only)
=====================  ==========================  =======================

Buffers per page on the zero-copy path (:meth:`HostPool.page_buffers`):

* MHA ``layer_first``: ``2 * L`` (K of each layer, then V of each layer), each ``ps*H*D`` items;
* MHA ``page_first`` / ``page_first_direct`` / ``page_head``: 2 (the K page, then the V page);
* MHA ``page_head`` with split heads: 2 per head group (its K heads, then its V heads);
* MLA ``layer_first``: ``L`` (one per layer); MLA ``page_first`` / ``page_first_direct``: 1.

A page's stored bytes are always the concatenation of those buffers, so the zero-copy path and
the generic path (:meth:`HostPool.copy_page_out` / :meth:`HostPool.copy_page_in`) store identical
bytes. The layout is part of the key namespace.

Pages are addressed by host **slot** (token index) of their first token, which must be a multiple
of ``page_size``; the draft pool is indexed by the target pool's slots.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

from hicache_draft.capabilities import Attention, Layout, PoolKind
from hicache_draft.config import KV_DTYPE_SIZES
from hicache_draft.transfer import Buffer

if TYPE_CHECKING:
    import torch

Allocator = Callable[[int], "torch.Tensor"]
"""Returns a 1-D ``uint8`` CPU tensor of at least the given number of bytes (e.g. shared memory)."""


def import_torch() -> ModuleType:
    """``import torch``, without the warning torch prints when NumPy is absent (hicache-draft never
    uses NumPy). The filter is scoped to this import; call it where tensors are about to be made."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return loaded
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch

    return torch


def dtype_name(dtype: object) -> str:
    """Our name of a dtype, given a name or a ``torch.dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolSpec:
    """The shape of one host pool.

    ``dtype`` is a dtype name (``"bfloat16"``, ...): the spec is data, usable without torch. A
    ``torch.dtype`` is accepted and stored by its name; :attr:`torch_dtype` gives the torch dtype.
    """

    kind: PoolKind
    attention: Attention
    layers: int
    page_size: int
    dtype: str
    layout: Layout
    kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.attention is Attention.MHA and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError("an MHA pool needs kv_heads >= 1 and head_dim >= 1")
        if self.attention is Attention.MLA:
            if self.latent_dim < 1:
                raise ValueError("an MLA pool needs latent_dim >= 1")
            if self.layout is Layout.PAGE_HEAD:
                raise ValueError("layout 'page_head' is MHA-only")

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` called :attr:`dtype` (imports torch)."""
        dtype = getattr(import_torch(), self.dtype, None)
        if dtype is None or not hasattr(dtype, "itemsize"):
            raise ValueError(f"{self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def itemsize(self) -> int:
        size = KV_DTYPE_SIZES.get(self.dtype)
        return size if size is not None else self.torch_dtype.itemsize

    @property
    def token_nbytes(self) -> int:
        """Bytes one token occupies across all layers (K and V for MHA)."""
        if self.attention is Attention.MHA:
            return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize
        return self.layers * self.latent_dim * self.itemsize

    @property
    def page_nbytes(self) -> int:
        return self.token_nbytes * self.page_size

    def buffers_per_page(self) -> int:
        """Buffers one page (or one head part of it) has on the zero-copy path."""
        if self.attention is Attention.MLA:
            return self.layers if self.layout is Layout.LAYER_FIRST else 1
        return 2 * self.layers if self.layout is Layout.LAYER_FIRST else 2

    def zero_copy_parts(self, split: int) -> bool:
        """Whether each of ``split`` head parts of a page is a set of contiguous buffers."""
        return split == 1 or (self.attention is Attention.MHA and self.layout is Layout.PAGE_HEAD)


class HostPool:
    """A host KV pool of ``num_pages`` pages. Pinned when CUDA is available, plain otherwise.

    ``allocator`` lets a backend supply the memory (e.g. a shared-memory segment); it must
    return a ``uint8`` CPU tensor of at least the requested size.
    """

    def __init__(
        self, spec: PoolSpec, num_pages: int, allocator: Allocator | None = None, pin: bool | None = None
    ) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.spec = spec
        self.num_pages = num_pages
        self.slots = num_pages * spec.page_size
        nbytes = self.slots * spec.token_nbytes
        torch = import_torch()
        if allocator is not None:
            raw = allocator(nbytes)
            if raw.dtype != torch.uint8 or raw.device.type != "cpu" or raw.numel() < nbytes:
                raise ValueError(f"allocator returned an unusable tensor for {nbytes} bytes")
            raw = raw[:nbytes]
        else:
            want_pin = torch.cuda.is_available() if pin is None else pin
            raw = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=bool(want_pin and torch.cuda.is_available()))
        self.raw = raw
        self.buffer = raw.view(spec.torch_dtype).view(self._shape())
        self._slot_buffers: dict[int, SlotBuffers] = {}

    @classmethod
    def wrap(cls, spec: PoolSpec, buffer: torch.Tensor) -> HostPool:
        """A pool over existing memory (e.g. an SGLang host pool's ``kv_buffer``).

        ``buffer`` must be contiguous, of ``spec.dtype``, and shaped as the layout table says. It may
        live on a GPU: such a pool has the same page geometry (for region-by-region copies between
        device and host pools) but no :meth:`page_buffers`.
        """
        torch = import_torch()
        if not buffer.is_contiguous() or buffer.dtype != spec.torch_dtype:
            raise ValueError("wrapped buffer must be a contiguous tensor of the spec's dtype")
        per_page = spec.page_nbytes
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes % per_page:
            raise ValueError(f"buffer of {nbytes} bytes is not a whole number of {per_page}-byte pages")
        self = cls.__new__(cls)
        self.spec = spec
        self.num_pages = nbytes // per_page
        self.slots = self.num_pages * spec.page_size
        self.raw = buffer.view(-1).view(torch.uint8)
        self.buffer = buffer.view(self._shape())
        self._slot_buffers = {}
        return self

    # -- geometry -------------------------------------------------------------------------
    def _shape(self) -> tuple[int, ...]:
        s = self.spec
        L, S, P, ps = s.layers, self.slots, self.num_pages, s.page_size
        if s.attention is Attention.MHA:
            H, D = s.kv_heads, s.head_dim
            return {
                Layout.LAYER_FIRST: (2, L, S, H, D),
                Layout.PAGE_FIRST: (2, S, L, H, D),
                Layout.PAGE_FIRST_DIRECT: (2, P, L, ps, H, D),
                Layout.PAGE_HEAD: (2, P, H, ps, L, D),
            }[s.layout]
        d = s.latent_dim
        return {
            Layout.LAYER_FIRST: (L, S, 1, d),
            Layout.PAGE_FIRST: (S, L, 1, d),
            Layout.PAGE_FIRST_DIRECT: (P, L, ps, 1, d),
        }[s.layout]

    def page_index(self, slot: int) -> int:
        """The page whose first slot is ``slot``; ValueError if unaligned or out of range."""
        ps = self.spec.page_size
        if slot % ps or not 0 <= slot < self.slots:
            raise ValueError(f"host slot {slot} is not the first slot of a page (page_size {ps}, {self.slots} slots)")
        return slot // ps

    def page_view(self, slot: int) -> torch.Tensor:
        """A (possibly strided) view of the page starting at ``slot``, in the layout's dim order."""
        p = self.page_index(slot)
        s = self.spec
        lo, hi = p * s.page_size, (p + 1) * s.page_size
        b = self.buffer
        if s.attention is Attention.MHA:
            if s.layout is Layout.LAYER_FIRST:
                return b[:, :, lo:hi]
            if s.layout is Layout.PAGE_FIRST:
                return b[:, lo:hi]
            return b[:, p]
        if s.layout is Layout.LAYER_FIRST:
            return b[:, lo:hi]
        if s.layout is Layout.PAGE_FIRST:
            return b[lo:hi]
        return b[p]

    def _head_axis(self) -> int:
        return 1 if self.spec.layout is Layout.PAGE_HEAD else 3

    def part_view(self, slot: int, part: int = 0, split: int = 1) -> torch.Tensor:
        """The view of head part ``part`` of ``split`` (the whole page when ``split == 1``)."""
        view = self.page_view(slot)
        if split == 1:
            return view
        if self.spec.attention is not Attention.MHA:
            raise ValueError("split heads apply to MHA pools only")
        h = self.spec.kv_heads // split
        return view.narrow(self._head_axis(), part * h, h)

    def part_nbytes(self, split: int = 1) -> int:
        return self.spec.page_nbytes // split

    # -- zero-copy ------------------------------------------------------------------------
    def page_regions(self, slot: int, part: int = 0, split: int = 1) -> list[torch.Tensor]:
        """The contiguous tensor regions that make up the page (or head part), in order.

        Use them for bulk copies (one ``copy_`` per region between two pools of the same geometry,
        e.g. a device pool made with :meth:`wrap` and this host pool) and for zero-copy I/O.
        """
        view = self.part_view(slot, part, split)
        if not self.spec.zero_copy_parts(split):
            raise ValueError(f"layout {self.spec.layout.value} has no contiguous head parts")
        s = self.spec
        if s.attention is Attention.MHA:
            if s.layout is Layout.LAYER_FIRST:
                return [view[kv, layer] for kv in (0, 1) for layer in range(s.layers)]
            return [view[0], view[1]]
        return [view[layer] for layer in range(s.layers)] if s.layout is Layout.LAYER_FIRST else [view]

    def page_buffers(self, slot: int, part: int = 0, split: int = 1) -> tuple[Buffer, ...]:
        """The page's (part's) regions as :class:`Buffer` objects for a backend (host memory only)."""
        if self.raw.device.type != "cpu":
            raise ValueError("page buffers exist only for host (CPU) pools")
        out = []
        for r in self.page_regions(slot, part, split):
            assert r.is_contiguous(), "page region must be contiguous"
            out.append(Buffer(r.data_ptr(), r.numel() * r.element_size(), owner=self))
        return tuple(out)

    def slot_buffers(self, split: int = 1) -> SlotBuffers:
        """The zero-copy buffers of many pages at once, by first slot (what :meth:`page_buffers`
        gives, computed from one page's regions and the page stride, cached)."""
        got = self._slot_buffers.get(split)
        if got is None:
            got = self._slot_buffers[split] = SlotBuffers(self, split)
        return got

    def page_buffer_meta(self, slots: Sequence[int], split: int = 1) -> tuple[list[int], list[int]]:
        """Pointer and size lists for ``slots`` (all parts of each page, page after page)."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for slot in slots:
            for part in range(split):
                for b in self.page_buffers(slot, part, split):
                    ptrs.append(b.ptr)
                    sizes.append(b.nbytes)
        return ptrs, sizes

    def regions(self) -> tuple[Buffer, ...]:
        """The pool's whole memory, for one-time registration with a transport."""
        return (Buffer(self.raw.data_ptr(), self.raw.numel(), owner=self),)

    # -- generic copies ---------------------------------------------------------------------
    def copy_page_out(self, slot: int, out: torch.Tensor, part: int = 0, split: int = 1) -> None:
        """Copy the page (part) into ``out``, a 1-D uint8 tensor of ``part_nbytes(split)``."""
        view = self.part_view(slot, part, split)
        out.view(self.spec.torch_dtype).view(view.shape).copy_(view)

    def copy_page_in(self, slot: int, src: torch.Tensor, part: int = 0, split: int = 1) -> None:
        """Copy ``src`` (1-D uint8, as produced by :meth:`copy_page_out`) into the page (part)."""
        view = self.part_view(slot, part, split)
        view.copy_(src.view(self.spec.torch_dtype).view(view.shape))

    def page_bytes(self, slot: int, part: int = 0, split: int = 1) -> bytes:
        """The page's (part's) stored bytes, as a new ``bytes`` (tests and debugging)."""
        torch = import_torch()
        out = torch.empty(self.part_nbytes(split), dtype=torch.uint8)
        self.copy_page_out(slot, out, part, split)
        return bytes(Buffer(out.data_ptr(), out.numel(), owner=out).view())


_CACHED_BUFFERS = 1 << 18
"""Zero-copy buffers a pool keeps per split (about 20 MB); pages past that are computed per call."""


class SlotBuffers:
    """The zero-copy buffers of a host pool's pages by first host slot, page after page with
    their head parts (what :meth:`HostPool.page_buffers` gives, without its per-page tensor views).

    Every layout places page ``p``'s regions at page 0's regions plus ``p`` times one stride; that
    is checked against :meth:`HostPool.page_buffers` for page 1 and the last page when the view is
    made (otherwise every page asks ``page_buffers``). Pages are kept up to :data:`_CACHED_BUFFERS`
    buffers."""

    def __init__(self, pool: HostPool, split: int) -> None:
        self.pool, self.split = pool, split
        self.page_size = pool.spec.page_size
        self.slots = pool.slots
        self.cache: dict[int, tuple[tuple[Buffer, ...], ...]] = {}
        self.limit = _CACHED_BUFFERS // max(1, pool.spec.buffers_per_page() * split)
        base = pool.raw.data_ptr()
        first = self._exact(0)
        self.template: list[list[tuple[int, int]]] | None = [[(b.ptr - base, b.nbytes) for b in part]
                                                            for part in first]
        self.stride = 0
        if pool.num_pages > 1:
            self.stride = self._exact(self.page_size)[0][0].ptr - first[0][0].ptr
            for p in (1, pool.num_pages - 1):
                if self._shifted(p) != self._exact(p * self.page_size):
                    self.template = None
                    break

    def _exact(self, slot: int) -> tuple[tuple[Buffer, ...], ...]:
        return tuple(self.pool.page_buffers(slot, part, self.split) for part in range(self.split))

    def _shifted(self, page: int) -> tuple[tuple[Buffer, ...], ...]:
        assert self.template is not None
        at, owner = self.pool.raw.data_ptr() + page * self.stride, self.pool
        return tuple(tuple([Buffer(at + off, n, owner) for off, n in part]) for part in self.template)

    def check(self, slots: Sequence[int]) -> None:
        """ValueError (from :meth:`HostPool.page_index`) for the first slot that does not start a page."""
        ps, n = self.page_size, self.slots
        bad = next((s for s in slots if s % ps or not 0 <= s < n), None)
        if bad is not None:
            self.pool.page_index(bad)

    def _fill(self, slot: int) -> tuple[tuple[Buffer, ...], ...]:
        parts = self._exact(slot) if self.template is None else self._shifted(self.pool.page_index(slot))
        if len(self.cache) < self.limit:
            self.cache[slot] = parts
        return parts

    def buffers(self, slots: Sequence[int]) -> list[tuple[Buffer, ...]]:
        """Each page's (head part's) buffers, page-major, for slots that passed :meth:`check`."""
        get, fill = self.cache.get, self._fill
        if self.split == 1:
            return [(get(s) or fill(s))[0] for s in slots]
        return [part for s in slots for part in (get(s) or fill(s))]
