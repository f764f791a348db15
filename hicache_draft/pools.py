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

Row pools (``indexer`` and ``state`` components) hold, per array ``i``, ``R_i = rows[i]`` bytes for
each page and layer: ``layer_first`` ``(L, P, R_i)``, ``page_first`` / ``page_first_direct``
``(P, L, 1, R_i)`` (the shapes of SGLang's DSA indexer and Mamba host pools). Their zero-copy
buffers are, array after array, ``L`` rows of ``R_i`` bytes (``layer_first``) or one buffer of
``L * R_i`` bytes.

Pages are addressed by host **slot** (token index) of their first token, which must be a multiple
of ``page_size``; the draft pool is indexed by the target pool's slots.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING

from hicache_draft import _native
from hicache_draft.capabilities import Attention, Component, HitPolicy, Layout, PoolKind
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
class KnownPool:
    """The defaults a pool name carries: its role, its component and its hit policy."""

    role: PoolKind
    component: Component
    hit_policy: HitPolicy


KNOWN_POOLS: dict[str, KnownPool] = {
    "kv": KnownPool(PoolKind.KV, Component.KV, HitPolicy.ALL_PAGES),
    "draft": KnownPool(PoolKind.DRAFT, Component.KV, HitPolicy.ALL_PAGES),
    "indexer": KnownPool(PoolKind.KV, Component.INDEXER, HitPolicy.ALL_PAGES),
    "draft_indexer": KnownPool(PoolKind.DRAFT, Component.INDEXER, HitPolicy.ALL_PAGES),
    "swa": KnownPool(PoolKind.KV, Component.WINDOW, HitPolicy.TRAILING_PAGES),
    "draft_swa": KnownPool(PoolKind.DRAFT, Component.WINDOW, HitPolicy.TRAILING_PAGES),
    "mamba": KnownPool(PoolKind.KV, Component.STATE, HitPolicy.TRAILING_PAGES),
}
"""SGLang's pool names (``PoolName``) and what each one is. Any other name is allowed when its
spec says its role and component."""

POOL_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
"""What a pool name may be: it goes into keys' namespaces and backends' file names."""


def pool_name(name: str) -> str:
    """``name`` as a pool name (``PoolKind`` for the two classic pools); ValueError if malformed."""
    text = str(name)
    if not POOL_NAME.fullmatch(text):
        raise ValueError(f"pool name {text!r} must match {POOL_NAME.pattern}")
    return PoolKind(text) if text in PoolKind._value2member_map_ else text


@dataclass(frozen=True)
class PoolSpec:
    """The shape of one host pool, and what it is.

    ``kind`` is the pool's name (:data:`KNOWN_POOLS`, or any :data:`POOL_NAME`); ``role`` and
    ``component`` default from the known names and must be given otherwise; ``hit_policy``
    defaults from the name, else from the component (``trailing_pages`` for windows and states).
    ``kv`` and ``window`` pools have MHA/MLA geometry (``attention``, heads, dims); ``indexer`` and
    ``state`` pools have row geometry: ``rows`` holds, for each of the pool's arrays, the bytes of
    one page in one layer, and ``attention`` is None (see the module docs for the shapes).
    ``window_pages``: for ``trailing_pages`` pools, how many trailing pages a hit needs (default 1).
    ``sharded``: whether each TP rank holds different bytes (MHA pools and ``state`` pools by
    default) or all ranks the same (MLA and indexer pools, written by rank 0 only).

    ``dtype`` is a dtype name (``"bfloat16"``, ...): the spec is data, usable without torch. A
    ``torch.dtype`` is accepted and stored by its name; :attr:`torch_dtype` gives the torch dtype.
    """

    kind: str
    attention: Attention | None
    layers: int
    page_size: int
    dtype: str
    layout: Layout
    kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    rows: tuple[int, ...] = ()
    role: PoolKind | None = None
    component: Component | None = None
    hit_policy: HitPolicy | None = None
    window_pages: int = 0
    sharded: bool | None = None

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        put("kind", pool_name(self.kind))
        put("dtype", dtype_name(self.dtype))
        put("rows", tuple(int(r) for r in self.rows))
        known = KNOWN_POOLS.get(str(self.kind))
        for name in ("role", "component"):
            if getattr(self, name) is None:
                if known is None:
                    raise ValueError(f"pool {self.kind!r} is not a known pool name: its spec needs a {name}")
                put(name, getattr(known, name))
        if self.hit_policy is None:  # a known name's, else the component's: windows and states trail
            trails = Component(self.component) in (Component.WINDOW, Component.STATE)
            default = HitPolicy.TRAILING_PAGES if trails else HitPolicy.ALL_PAGES
            put("hit_policy", known.hit_policy if known else default)
        put("role", PoolKind(self.role))
        put("component", Component(self.component))
        put("hit_policy", HitPolicy(self.hit_policy))
        if self.layers < 1 or self.page_size < 1:
            raise ValueError(f"pool {self.kind!r}: layers and page_size must be >= 1")
        if self.hit_policy is HitPolicy.TRAILING_PAGES:
            put("window_pages", max(1, int(self.window_pages)))
        elif self.window_pages:
            raise ValueError(f"pool {self.kind!r}: window_pages applies to trailing_pages pools only")
        if self.component.has_attention:
            self._check_attention()
        else:
            self._check_rows()
        if self.sharded is None:
            put("sharded", self.attention is Attention.MHA or self.component is Component.STATE)
        elif not self.sharded and self.attention is Attention.MHA:
            raise ValueError(f"pool {self.kind!r}: an MHA pool is sharded by heads (each rank holds its own)")

    def _check_attention(self) -> None:
        label = f"{self.component.value} pool {self.kind!r}"
        if self.attention is None:
            raise ValueError(f"{label} needs an attention type (mha or mla)")
        object.__setattr__(self, "attention", Attention(self.attention))
        if self.rows:
            raise ValueError(f"{label}: rows are for indexer and state pools")
        if self.attention is Attention.MHA and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError("an MHA pool needs kv_heads >= 1 and head_dim >= 1")
        if self.attention is Attention.MLA:
            if self.latent_dim < 1:
                raise ValueError("an MLA pool needs latent_dim >= 1")
            if self.layout is Layout.PAGE_HEAD:
                raise ValueError("layout 'page_head' is MHA-only")

    def _check_rows(self) -> None:
        label = f"{self.component.value} pool {self.kind!r}"
        if self.attention is not None:
            raise ValueError(f"{label} has row geometry: attention must be None")
        if not self.rows or any(r < 1 for r in self.rows):
            raise ValueError(f"{label} needs rows: the bytes of one page in one layer, per array (each >= 1)")
        if self.layout is Layout.PAGE_HEAD:
            raise ValueError(f"{label}: layout 'page_head' is for MHA pools only")
        if self.dtype != "uint8":
            raise ValueError(f"{label}: row pools are bytes (dtype 'uint8'), not {self.dtype!r}")

    @property
    def name(self) -> str:
        """The pool's name (the same as :attr:`kind`)."""
        return self.kind

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
        """Bytes one token occupies across all layers (K and V for MHA; a page's share for rows)."""
        if self.attention is Attention.MHA:
            return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize
        if self.attention is Attention.MLA:
            return self.layers * self.latent_dim * self.itemsize
        return self.page_nbytes // self.page_size

    @property
    def page_nbytes(self) -> int:
        if self.attention is None:
            return self.layers * sum(self.rows)
        return self.token_nbytes * self.page_size

    def buffers_per_page(self) -> int:
        """Buffers one page (or one head part of it) has on the zero-copy path."""
        if self.attention is None:
            return len(self.rows) * (self.layers if self.layout is Layout.LAYER_FIRST else 1)
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
        nbytes = num_pages * spec.page_nbytes
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
        self._slot_buffers: dict[int, SlotBuffers] = {}
        if spec.attention is None:
            at, arrays = 0, []
            for r in spec.rows:
                n = num_pages * spec.layers * r
                arrays.append(raw[at : at + n].view(self._row_shape(r)))
                at += n
            self.arrays: tuple[torch.Tensor, ...] = tuple(arrays)
            self.buffer = arrays[0]
        else:
            self.buffer = raw.view(spec.torch_dtype).view(self._shape())
            self.arrays = (self.buffer,)

    @classmethod
    def wrap(cls, spec: PoolSpec, buffer: torch.Tensor) -> HostPool:
        """A pool over existing memory (e.g. an SGLang host pool's ``kv_buffer``).

        ``buffer`` must be contiguous, of ``spec.dtype``, and shaped as the layout table says. It may
        live on a GPU: such a pool has the same page geometry (for region-by-region copies between
        device and host pools) but no :meth:`page_buffers`. A row pool of several arrays is
        wrapped with :meth:`wrap_arrays`.
        """
        return cls.wrap_arrays(spec, [buffer])

    @classmethod
    def wrap_arrays(cls, spec: PoolSpec, arrays: Sequence[torch.Tensor]) -> HostPool:
        """A pool over existing memory, one tensor per array (a row pool: one per entry of
        ``spec.rows``, e.g. SGLang's Mamba temporal and conv buffers; any other pool: one)."""
        torch = import_torch()
        want = len(spec.rows) if spec.attention is None else 1
        if len(arrays) != want:
            raise ValueError(f"pool {spec.kind!r} has {want} array(s), got {len(arrays)} tensors")
        self = cls.__new__(cls)
        self.spec = spec
        self._slot_buffers = {}
        pages: set[int] = set()
        views = []
        for i, t in enumerate(arrays):
            dtype = torch.uint8 if spec.attention is None else spec.torch_dtype
            nbytes = t.numel() * t.element_size()
            per_page = spec.layers * spec.rows[i] if spec.attention is None else spec.page_nbytes
            if not t.is_contiguous() or (spec.attention is not None and t.dtype != dtype):
                raise ValueError("wrapped buffer must be a contiguous tensor of the spec's dtype")
            if nbytes % per_page:
                raise ValueError(f"buffer of {nbytes} bytes is not a whole number of {per_page}-byte pages")
            pages.add(nbytes // per_page)
            views.append(t.view(-1).view(torch.uint8) if spec.attention is None else t)
        if len(pages) != 1:
            raise ValueError(f"pool {spec.kind!r}: its arrays hold different numbers of pages ({sorted(pages)})")
        self.num_pages = pages.pop()
        self.slots = self.num_pages * spec.page_size
        if spec.attention is None:
            self.arrays = tuple(v.view(self._row_shape(r)) for v, r in zip(views, spec.rows, strict=True))
            self.buffer = self.arrays[0]
            self.raw = views[0] if len(views) == 1 else None
        else:
            self.raw = views[0].view(-1).view(torch.uint8)
            self.buffer = views[0].view(self._shape())
            self.arrays = (self.buffer,)
        return self

    def _row_shape(self, row: int) -> tuple[int, ...]:
        L, P = self.spec.layers, self.num_pages
        return (L, P, row) if self.spec.layout is Layout.LAYER_FIRST else (P, L, 1, row)

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
            raise not_a_page_start(slot, ps, self.slots)
        return slot // ps

    def row_views(self, slot: int) -> list[torch.Tensor]:
        """A row pool's page at ``slot``: one ``(L, R_i)`` (or ``(L, 1, R_i)``) view per array."""
        p = self.page_index(slot)
        if self.spec.layout is Layout.LAYER_FIRST:
            return [a[:, p] for a in self.arrays]
        return [a[p] for a in self.arrays]

    def page_view(self, slot: int) -> torch.Tensor:
        """A (possibly strided) view of the page starting at ``slot``, in the layout's dim order
        (a row pool of one array: its ``row_views``; of several: use :meth:`row_views`)."""
        if self.spec.attention is None:
            views = self.row_views(slot)
            if len(views) != 1:
                raise ValueError(f"pool {self.spec.kind!r} has {len(views)} arrays: use row_views")
            return views[0]
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
        s = self.spec
        if s.attention is None:
            if split != 1:
                raise ValueError("split heads apply to MHA pools only")
            if s.layout is Layout.LAYER_FIRST:
                return [v[layer] for v in self.row_views(slot) for layer in range(s.layers)]
            return self.row_views(slot)
        view = self.part_view(slot, part, split)
        if not self.spec.zero_copy_parts(split):
            raise ValueError(f"layout {self.spec.layout.value} has no contiguous head parts")
        if s.attention is Attention.MHA:
            if s.layout is Layout.LAYER_FIRST:
                return [view[kv, layer] for kv in (0, 1) for layer in range(s.layers)]
            return [view[0], view[1]]
        return [view[layer] for layer in range(s.layers)] if s.layout is Layout.LAYER_FIRST else [view]

    def page_buffers(self, slot: int, part: int = 0, split: int = 1) -> tuple[Buffer, ...]:
        """The page's (part's) regions as :class:`Buffer` objects for a backend (host memory only)."""
        if self.arrays[0].device.type != "cpu":
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
        """The pool's whole memory, for one-time registration with a transport (one region per
        array when the arrays are separate tensors)."""
        if self.raw is not None:
            return (Buffer(self.raw.data_ptr(), self.raw.numel(), owner=self),)
        return tuple(Buffer(a.data_ptr(), a.numel() * a.element_size(), owner=self) for a in self.arrays)

    # -- generic copies ---------------------------------------------------------------------
    def copy_page_out(self, slot: int, out: torch.Tensor, part: int = 0, split: int = 1) -> None:
        """Copy the page (part) into ``out``, a 1-D uint8 tensor of ``part_nbytes(split)``."""
        if self.spec.attention is None:
            at = 0
            for v in self.row_views(slot):
                n = v.numel()
                out[at : at + n].view(v.shape).copy_(v)
                at += n
            return
        view = self.part_view(slot, part, split)
        out.view(self.spec.torch_dtype).view(view.shape).copy_(view)

    def copy_page_in(self, slot: int, src: torch.Tensor, part: int = 0, split: int = 1) -> None:
        """Copy ``src`` (1-D uint8, as produced by :meth:`copy_page_out`) into the page (part)."""
        if self.spec.attention is None:
            at = 0
            for v in self.row_views(slot):
                n = v.numel()
                v.copy_(src[at : at + n].view(v.shape))
                at += n
            return
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

    Every layout places page ``p``'s buffer ``j`` at page 0's plus ``p`` times a stride of its own; that
    is checked against :meth:`HostPool.page_buffers` for page 1 and the last page when the view is
    made (otherwise every page asks ``page_buffers``). Pages are kept up to :data:`_CACHED_BUFFERS`
    buffers."""

    def __init__(self, pool: HostPool, split: int) -> None:
        self.pool, self.split = pool, split
        self.page_size = pool.spec.page_size
        self.slots = pool.slots
        self.cache: dict[int, tuple[tuple[Buffer, ...], ...]] = {}
        self.limit = _CACHED_BUFFERS // max(1, pool.spec.buffers_per_page() * split)
        first = self._exact(0)
        # page p's buffer j sits at page 0's plus p * stride_j (one stride per array)
        self.template: tuple[tuple[tuple[int, int, int], ...], ...] | None = tuple(
            tuple((b.ptr, b.nbytes, 0) for b in part) for part in first)
        if pool.num_pages > 1:
            second = self._exact(self.page_size)
            self.template = tuple(tuple((b.ptr, b.nbytes, c.ptr - b.ptr) for b, c in zip(pa, pb, strict=True))
                                  for pa, pb in zip(first, second, strict=True))
            for p in (1, pool.num_pages - 1):
                if self._shifted(p) != self._exact(p * self.page_size):
                    self.template = None
                    break

    def _exact(self, slot: int) -> tuple[tuple[Buffer, ...], ...]:
        return tuple(self.pool.page_buffers(slot, part, self.split) for part in range(self.split))

    def _shifted(self, page: int) -> tuple[tuple[Buffer, ...], ...]:
        assert self.template is not None
        owner = self.pool
        return tuple(tuple([Buffer(at + page * stride, n, owner) for at, n, stride in part])
                     for part in self.template)

    def _fill(self, slot: int) -> tuple[tuple[Buffer, ...], ...]:
        parts = self._exact(slot) if self.template is None else self._shifted(self.pool.page_index(slot))
        if len(self.cache) < self.limit:
            self.cache[slot] = parts
        return parts

    def buffers(self, slots: Sequence[int]) -> list[tuple[Buffer, ...]]:
        """Each page's (head part's) buffers, page-major, for slots that passed :func:`check_page_starts`."""
        get, fill = self.cache.get, self._fill
        if self.split == 1:
            return [(get(s) or fill(s))[0] for s in slots]
        return [part for s in slots for part in (get(s) or fill(s))]


def not_a_page_start(slot: int, page_size: int, slots: int) -> ValueError:
    """The error for a host slot that does not start a page of a pool of ``slots`` slots."""
    return ValueError(f"host slot {slot} is not the first slot of a page (page_size {page_size}, {slots} slots)")


def check_page_starts(slots: Iterable[int], page_size: int, limit: int) -> None:
    """ValueError naming the first of ``slots`` that does not start a page of a pool of ``limit``
    slots (a multiple of ``page_size`` in ``[0, limit)``)."""
    bad = next((s for s in slots if s % page_size or not 0 <= s < limit), None)
    if bad is not None:
        raise not_a_page_start(bad, page_size, limit)


_INT_SIZES: dict[object, int] = {}
"""torch's int64 and int32 dtypes -> their sizes (filled once torch is imported)."""


def first_slots(indices: object, page_size: int, limit: int | None = None, pages: int | None = None) -> list[int]:
    """Each page's first host slot, ``indices[i * page_size]``, from per-token host slots (a tensor
    of any shape, read in order, or a sequence). A contiguous CPU tensor of 32- or 64-bit integers
    (what SGLang hands) is read from its memory in one compiled pass: slicing it and converting the
    slice cost 40 us for 128 pages when the interpreter's caches are cold, as they are after a
    storage call. With ``limit`` (the pool's slots), every slot is checked to start a page, in the
    same pass (ValueError naming the first that does not, as :meth:`HostPool.page_index` does).
    With ``pages``, there must be exactly ``pages * page_size`` indices (ValueError otherwise)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(indices, torch.Tensor):
        count = indices.numel()
        if pages is not None and count != pages * page_size:
            raise ValueError(f"{count} host indices for {pages} pages of {page_size} tokens")
        if not _INT_SIZES:
            _INT_SIZES.update({torch.int64: 8, torch.int32: 4})
        size = _INT_SIZES.get(indices.dtype)
        if size is not None and indices.is_cpu and indices.is_contiguous():
            got = _native.strided_ints(indices.data_ptr(), count, page_size, size, -1 if limit is None else limit)
            if got is not None:
                return got
        slots = indices.reshape(-1)[::page_size].tolist()
    else:
        values = list(indices)  # type: ignore[call-overload]
        if pages is not None and len(values) != pages * page_size:
            raise ValueError(f"{len(values)} host indices for {pages} pages of {page_size} tokens")
        slots = [int(s) for s in values[::page_size]]
    if limit is not None:
        check_page_starts(slots, page_size, limit)
    return slots
