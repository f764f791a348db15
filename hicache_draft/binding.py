"""One pool on one rank, bound to a store: the one place for every pool rule.

The controller, the SGLang adapter, the conformance kit and ``hicache-draft check`` all go through
this module, so they cannot disagree:

* :func:`plan_binding` decides, from the pool's spec, the backend's declared capabilities and the
  rank's place, the **split factor** (one split-heads policy), the **key namespaces** (one per head
  part), the **writer election** and the **I/O path** (zero-copy, generic or disabled, with the
  reason in words a user can act on). It never looks at a backend's name, and needs no torch.
* :class:`PoolBinding` holds one planned pool with its host memory: its **registration**, its
  **keys**, **page building** for host slots or flat pages (zero-copy buffers, or staging copies
  on the generic path), the copy back of staged pages that came back, and the per-page result
  rule (a page is OK only if every head part is).
* :func:`usable_hit` is the **hit rule** over any number of pools (:func:`query_hit` asks a store
  for it), and :func:`blocked_by` / :func:`settle` say **which pool needs which** (every pool the
  target's ``kv``; the target every pool of its own).

Split heads (``tp_lcm_size > tp_size``; SGLang's ``should_split_heads``): an MHA pool whose heads
divide by ``split = tp_lcm_size / tp_size`` stores each head group under its own key, so servers
with different ``tp_size`` and one ``tp_lcm_size`` share pages. That needs a backend declaring
``split_heads``; without it the pool is not split (per-rank keys: pages are shared only with
servers of the same ``tp_size``) and the reason says so. A split pool is zero-copy only in layout
``page_head`` (where a head group of a page is contiguous), and goes through staging otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING, NamedTuple

from hicache_draft import _native
from hicache_draft.buffer_io import copy_regions, threads_for
from hicache_draft.capabilities import Attention, Capabilities, HitPolicy, IOPath, PoolKind
from hicache_draft.config import ParallelConfig
from hicache_draft.errors import BackendSetupError
from hicache_draft.keys import make_key, pool_identities
from hicache_draft.pools import HostPool, PoolSpec, SlotBuffers, check_page_starts, first_slots, import_torch
from hicache_draft.transfer import (
    _BUFFER_FIELDS,
    _PAGE_FIELDS,
    Buffer,
    Page,
    PageResult,
    PageTransfer,
    PendingPages,
    PoolRegistration,
)

if TYPE_CHECKING:
    import torch

    from hicache_draft.store import Store


@dataclass(frozen=True)
class PathChoice:
    """The I/O path of one pool and the reason, in words a user can act on."""

    path: IOPath
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path.value, "reason": self.reason}


def _label(spec: PoolSpec) -> str:
    return f"the {str(spec.kind)!r} pool"


def choose_path(caps: Capabilities, spec: PoolSpec, split: int) -> PathChoice:
    """The path for one pool of shape ``spec`` with ``split`` head parts per page."""
    pool = str(spec.kind)
    role = spec.role.value
    cap = caps.pools.get(spec.role)
    if cap is None:
        what = f"the {pool!r} pool" if pool == role else f"{role!r} pools (so not {_label(spec)})"
        return PathChoice(IOPath.DISABLED, f"the backend does not declare {what}")
    note = f" (backend note: {cap.note})" if cap.note else ""
    if spec.component not in cap.components:
        return PathChoice(
            IOPath.DISABLED,
            f"the backend does not declare the {spec.component.value!r} component for {role!r} pools, "
            f"so not {_label(spec)}{note}",
        )
    if spec.attention is not None and spec.attention not in cap.attention:
        return PathChoice(
            IOPath.DISABLED,
            f"the backend does not declare {spec.attention.value!r} attention for {_label(spec)}{note}",
        )
    layout = spec.layout.value
    nbuf = spec.buffers_per_page()
    why_not: str
    if spec.layout not in cap.zero_copy_layouts:
        why_not = f"layout {layout!r} is not zero-copy for this backend"
    elif not spec.zero_copy_parts(split):
        why_not = f"layout {layout!r} does not keep a page's head groups contiguous (use 'page_head')"
    elif cap.max_buffers_per_page is not None and nbuf > cap.max_buffers_per_page:
        shape = spec.attention.value if spec.attention is not None else spec.component.value
        why_not = (
            f"a {shape} page in layout {layout!r} is {nbuf} buffers and the backend takes at most "
            f"{cap.max_buffers_per_page} per page"
        )
    else:
        parts = f", {split} head parts per page" if split > 1 else ""
        buffers = f"{nbuf} buffer{'s' if nbuf > 1 else ''} per page"
        return PathChoice(IOPath.ZERO_COPY, f"layout {layout!r} is zero-copy for this backend ({buffers}{parts})")
    if cap.generic:
        return PathChoice(IOPath.GENERIC, f"{why_not}; pages are copied through staging buffers{note}")
    return PathChoice(IOPath.DISABLED, f"{why_not}, and the backend has no generic path for {_label(spec)}{note}")


def split_heads(spec: PoolSpec, parallel: ParallelConfig, caps: Capabilities) -> tuple[int, str]:
    """Head parts per page for this pool on this rank, and a note when a requested split is not
    made (the one split-heads policy; see the module docs)."""
    want = parallel.split_factor
    if want == 1 or spec.attention is not Attention.MHA:
        return 1, ""
    if spec.kv_heads % want:
        return 1, f"kv_heads {spec.kv_heads} does not divide by the split factor {want}: head groups not split"
    if not caps.split_heads:
        return 1, (
            f"split heads requested (tp_lcm_size/tp_size = {want}) but the backend does not declare split_heads: "
            "per-rank keys, pages shared only with servers of the same tp_size"
        )
    return want, ""


@dataclass(frozen=True)
class BindingPlan:
    """What :func:`plan_binding` decided for one pool on one rank."""

    spec: PoolSpec
    path: IOPath
    reason: str
    split: int
    namespaces: tuple[str, ...]
    writer: bool

    @property
    def choice(self) -> PathChoice:
        return PathChoice(self.path, self.reason)

    def as_dict(self) -> dict[str, object]:
        s = self.spec
        return {
            "path": self.path.value, "reason": self.reason,
            "role": "draft" if s.role is PoolKind.DRAFT else "target", "component": s.component.value,
            "hit_policy": s.hit_policy.value, "split": self.split, "writer": self.writer,
        }


def plan_binding(
    spec: PoolSpec,
    caps: Capabilities,
    parallel: ParallelConfig,
    *,
    model: str,
    target_model: str,
    has_memory: bool = True,
    kv_active: bool = True,
) -> BindingPlan:
    """Plan one pool on this rank (the single path, split and writer rule).

    ``model``: the identity of the weights whose cache this is (the draft's for draft-role pools);
    ``target_model``: the target's (part of every draft-role key). ``has_memory``: False when the
    pool has no registered host memory (SGLang's flat data pages): a zero-copy choice becomes the
    generic path. ``kv_active``: whether the target ``kv`` pool is offloaded; every other pool
    needs it."""
    split, split_note = split_heads(spec, parallel, caps)
    choice = choose_path(caps, spec, split)
    if choice.path is IOPath.ZERO_COPY and not has_memory:
        cap = caps.pools[spec.role]
        choice = (
            PathChoice(IOPath.GENERIC, "flat pages (no registered host pool memory); copied through staging")
            if cap.generic else
            PathChoice(IOPath.DISABLED, "flat pages need a generic path, and the backend has none")
        )
    if spec.kind != PoolKind.KV and not kv_active and choice.path is not IOPath.DISABLED:
        choice = PathChoice(IOPath.DISABLED, "the target 'kv' pool is disabled, so nothing is offloaded")
    reason = choice.reason + (f"; {split_note}" if split_note and choice.path is not IOPath.DISABLED else "")
    idents = pool_identities(
        pool=spec.kind, model=model, dtype=spec.dtype, attention=spec.attention, page_size=spec.page_size,
        layers=spec.layers, layout=spec.layout, kv_heads=spec.kv_heads or None, head_dim=spec.head_dim or None,
        latent_dim=spec.latent_dim or None, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size,
        pp_rank=parallel.pp_rank, pp_size=parallel.pp_size,
        tp_lcm_size=parallel.tp_size * split if split > 1 else None, target_model=target_model, role=spec.role,
        component=spec.component, rows=spec.rows, sharded=spec.sharded,
    )
    writer = bool(spec.sharded) or parallel.tp_rank == 0
    return BindingPlan(spec, choice.path, reason, split, tuple(i.fingerprint() for i in idents), writer)


def blocked_by(specs: Mapping[str, PoolSpec], active: Mapping[str, bool],
               reasons: Mapping[str, str]) -> dict[str, str]:
    """Pools to disable because a pool they need is disabled, with the reason (the one rule of
    which pool needs which): every pool needs the target's ``kv``, and the target's pages are
    usable only with every target-role pool (KV without its indexer or its sliding window gives
    wrong logits), so a disabled target-role pool disables every pool. A disabled draft-role
    pool only makes restored pages draft-cold (the hit rule). ``active`` and ``reasons`` are each
    pool's own verdict (its plan), not one this function gave."""
    off = sorted((n for n, spec in specs.items() if spec.role is PoolKind.KV and not active.get(n, False)),
                 key=lambda n: (n != PoolKind.KV, str(n)))  # named in one order, whatever the registration order
    if not off:
        return {}
    first = off[0]
    why = (f"the target {str(first)!r} pool is disabled ({reasons.get(first, '')}), so nothing is offloaded"
           if first != PoolKind.KV else "the target 'kv' pool is disabled, so nothing is offloaded")
    return {n: why for n in specs if active.get(n, False)}


def settle(bindings: Mapping[str, PoolBinding]) -> str | None:
    """Apply :func:`blocked_by` to bindings (each pool's own verdict is its :attr:`PoolBinding.plan`):
    disable the pools a disabled pool makes useless; the reason, or None when none is."""
    blocked = blocked_by({n: b.spec for n, b in bindings.items()},
                         {n: b.plan.path is not IOPath.DISABLED for n, b in bindings.items()},
                         {n: b.plan.reason for n, b in bindings.items()})
    for name, why in blocked.items():
        bindings[name].disable(why)
    return next(iter(blocked.values()), None)


_COPY_SHARE = 1 << 20
"""Bytes of flat pages each thread copies into or out of staging, at least (a thread's start costs
about what copying a few hundred KiB does)."""

STAGING_BYTES = 256 << 20
"""The default staging area of one pool: up to this many bytes (16 to 128 pages)."""


def staging_pages(page_nbytes: int, setting: int | None, batch: int = 128) -> int:
    """Pages of one staging area: ``setting``, or as many of a ``batch`` as fit :data:`STAGING_BYTES`
    (at least 16), so a generic call is one backend call."""
    if setting is not None:
        return setting
    return max(1, min(batch, max(16, STAGING_BYTES // max(1, page_nbytes))))


class Staging:
    """Long-lived host memory for the generic path of one pool: ``pages`` pages, one call at a time
    (hold :attr:`lock`). It is registered with the backend with the pool. If a call that used it
    times out (the backend may still touch it), :meth:`replace` gives fresh, unregistered memory."""

    def __init__(self, page_nbytes: int, pages: int) -> None:
        self.page_nbytes = page_nbytes
        self.pages = pages
        self.lock = threading.Lock()
        self.tensor = self._memory()
        self._parts: dict[int, list[tuple[tuple[Buffer], torch.Tensor]]] = {}

    def region(self) -> Buffer:
        return Buffer(self.tensor.data_ptr(), self.tensor.numel(), owner=self.tensor)

    def parts(self, nbytes: int) -> list[tuple[tuple[Buffer], torch.Tensor]]:
        """The area cut into ``nbytes`` pieces, in order: each one's buffer (as a page's buffer
        tuple) and tensor; made once per size and memory."""
        got = self._parts.get(nbytes)
        if got is None:
            t = self.tensor
            got = [((Buffer(t.data_ptr() + at, nbytes, owner=t),), t[at : at + nbytes])
                   for at in range(0, t.numel() - nbytes + 1, nbytes)]
            self._parts[nbytes] = got
        return got

    def _memory(self) -> torch.Tensor:
        torch = import_torch()
        return torch.zeros(self.pages * self.page_nbytes, dtype=torch.uint8)

    def replace(self) -> None:
        """Abandon the current memory to a call that may still use it (its Buffers keep it alive)."""
        self.tensor = self._memory()
        self._parts = {}


class SlotPages(PendingPages):
    """The zero-copy pages of one pool's batch by first host slot, built by one compiled call when
    needed: by the Store with their headers (:func:`hicache_draft.store.attach_headers`), or on first
    access without (:class:`~hicache_draft.transfer.PendingPages`)."""

    __slots__ = ("binding", "groups", "keys", "slots")

    def __init__(self, binding: PoolBinding, keys: Sequence[str], groups: Sequence[str], slots: Sequence[int]) -> None:
        super().__init__()
        if not len(keys) == len(groups) == len(slots):
            raise ValueError(f"{len(keys)} keys, {len(groups)} groups and {len(slots)} slots for one batch")
        self.binding, self.keys, self.groups, self.slots = binding, keys, groups, slots

    def __len__(self) -> int:
        return len(self.slots)

    def build(self, header_base: int = 0, header_owner: object = None) -> list[Page]:
        return self.binding._slot_pages(self.keys, self.groups, self.slots, header_base, header_owner)


@dataclass
class Batch:
    """The pages of one pool in one call, and what is needed to finish a read.

    ``staged[i]`` is the staging row of page part ``i`` (page-major), empty on the zero-copy path;
    ``slots`` / ``flats`` are the pages' destinations."""

    binding: PoolBinding
    transfer: PageTransfer
    staged: list[torch.Tensor] = field(default_factory=list)
    slots: list[int] | None = None
    flats: Sequence[torch.Tensor] | None = None
    flat_ptrs: list[int] | None = None  # the flats' addresses (plain CPU flats, one part a page)

    @property
    def zero_copy_slots(self) -> list[int]:
        """Host slots the backend is handed directly (it may still touch them after a timeout)."""
        return list(self.slots or []) if self.transfer.zero_copy else []


class PoolBinding:
    """One planned pool on this rank with its host memory: registration, keys, pages, results.

    ``host`` is None for a pool known only by shape (SGLang's flat data pages). ``staging`` is a
    long-lived :class:`Staging` (the caller holds its lock around a call); without one, the
    generic path copies through fresh memory per call."""

    def __init__(self, plan: BindingPlan, host: HostPool | None, staging: Staging | None = None) -> None:
        if host is not None and host.spec != plan.spec:
            raise ValueError(f"host pool of {str(plan.spec.kind)!r} does not match the planned shape")
        self.plan = plan
        self.spec = plan.spec
        self.name: str = plan.spec.kind  # asked many times a query: a plain attribute
        self.host = host
        self.path = plan.path
        self.active = plan.path is not IOPath.DISABLED  # asked many times a query: a plain attribute
        self.reason = plan.reason
        self.split = plan.split
        self.namespaces = plan.namespaces
        self.writer = plan.writer
        self.staging = staging
        # make_key(group, ns) is the group followed by a suffix of ns alone
        self._suffixes = tuple(make_key("", ns) for ns in self.namespaces)
        assert all(make_key("0a", ns) == "0a" + s for ns, s in zip(self.namespaces, self._suffixes, strict=True))

    # -- what it is ---------------------------------------------------------------------------------
    @property
    def zero_copy(self) -> bool:
        """Pages move straight from and into the host pool's own memory."""
        return self.path is IOPath.ZERO_COPY and self.host is not None

    @property
    def part_nbytes(self) -> int:
        return self.spec.page_nbytes // self.split

    @property
    def choice(self) -> PathChoice:
        return PathChoice(self.path, self.reason)

    def disable(self, reason: str) -> None:
        """Stop offloading this pool because of another pool (:func:`blocked_by`); :attr:`plan`
        keeps the pool's own verdict."""
        self.path, self.reason, self.active = IOPath.DISABLED, reason, False

    def keys(self, groups: Sequence[str]) -> list[str]:
        """``make_key(group, namespace)`` of every page and head part, page-major."""
        if len(self._suffixes) == 1:
            suf = self._suffixes[0]
            return [g + suf for g in groups]
        return [g + suf for g in groups for suf in self._suffixes]

    # -- registration -------------------------------------------------------------------------------
    def registration(self) -> PoolRegistration:
        s = self.spec
        return PoolRegistration(
            pool=s.kind, attention=s.attention, layout=s.layout, namespace=self.namespaces[0],
            page_nbytes=self.part_nbytes, buffers_per_page=s.buffers_per_page() if self.zero_copy else 1,
            regions=self.host.regions() if (self.zero_copy and self.host is not None) else (),
            staging=(self.staging.region(),) if self.staging is not None else (), role=s.role, component=s.component,
        )

    def register(self, store: Store) -> bool:
        """Announce the pool to the backend (if active); a refusal disables it with the reason."""
        if not self.active:
            return False
        try:
            store.register_pool(self.registration())
        except BackendSetupError as exc:  # the pool's own verdict: its plan says so too
            self.plan = replace(self.plan, path=IOPath.DISABLED, reason=f"the backend refused the pool: {exc}")
            self.disable(self.plan.reason)
            return False
        return True

    # -- pages --------------------------------------------------------------------------------------
    def _page(self, keys: Sequence[str], groups: Sequence[str], bufs: Sequence[tuple[Buffer, ...]]) -> list[Page]:
        """The pages of a batch (compiled: a frozen dataclass's ``__init__`` cost about 1 us a page,
        128 us of a 128-page call through the SGLang adapter)."""
        split = self.split
        if split == 1:
            return _native.make_pages(keys, groups, self.namespaces[0], bufs, Page, _PAGE_FIELDS)  # type: ignore[return-value]
        gs = [g for g in groups for _ in range(split)]
        return _native.make_pages(keys, gs, self.namespaces * len(groups), bufs, Page,  # type: ignore[return-value]
                                  _PAGE_FIELDS)

    def _slot_pages(self, keys: Sequence[str], groups: Sequence[str], slots: Sequence[int],
                    header_base: int = 0, header_owner: object = None) -> list[Page]:
        """The zero-copy pages at host ``slots``: for one part a page (and buffers at a fixed stride
        from page to page) in one compiled call, which checks every slot again before it makes
        anything, so a slot that does not start a page of the pool never becomes an address, and
        which can give each page its header too (:class:`SlotPages`); otherwise from
        :meth:`SlotBuffers.buffers <hicache_draft.pools.SlotBuffers.buffers>`, without headers."""
        assert self.host is not None
        view = self.host.slot_buffers(self.split)
        if self._compiled_slots(view):
            assert view.template is not None
            pages = _native.slot_pages(slots, view.page_size, view.slots, view.template[0], view.pool, view.cache,
                                       view.limit, keys, groups, self.namespaces[0], Page, _PAGE_FIELDS, Buffer,
                                       _BUFFER_FIELDS, header_base, header_owner)
            if pages is not None:
                return pages  # type: ignore[return-value]
            self.check_slots(slots)  # raises, naming the slot
        return self._page(keys, groups, view.buffers(slots))

    def _compiled_slots(self, view: SlotBuffers) -> bool:
        """Whether a batch's pages are built by one compiled call (one part a page, buffers at a
        fixed stride from page to page)."""
        return self.split == 1 and view.template is not None

    def _rows(self, n: int) -> tuple[list[torch.Tensor], list[tuple[Buffer, ...]]]:
        """``n`` staging rows (one per page part) and their buffers."""
        if self.staging is not None:
            parts = self.staging.parts(self.part_nbytes)
            if n > len(parts):
                raise ValueError(f"{n} page parts do not fit the {len(parts)}-part staging area of {self.name!r}")
            return [t for _, t in parts[:n]], [b for b, _ in parts[:n]]
        torch = import_torch()
        stage = torch.empty((n, self.part_nbytes), dtype=torch.uint8)
        rows = list(stage.unbind(0)) if n else []
        return rows, [(Buffer(r.data_ptr(), r.numel(), owner=stage),) for r in rows]

    def page_slots(self, indices: object, pages: int | None = None) -> list[int]:
        """Each page's first host slot from per-token host indices (a tensor of any shape or a
        sequence, as SGLang hands them), every one checked to start a page of the host pool
        (ValueError naming the first that does not). ``pages``: the indices must be exactly that
        many pages' (ValueError otherwise)."""
        assert self.host is not None, f"pool {self.name!r} has no host memory"
        return first_slots(indices, self.spec.page_size, self.host.slots, pages)

    def check_slots(self, slots: Sequence[int]) -> None:
        """ValueError (:func:`~hicache_draft.pools.check_page_starts`) unless every slot starts a
        page of the host pool."""
        assert self.host is not None, f"pool {self.name!r} has no host memory"
        check_page_starts(slots, self.spec.page_size, self.host.slots)

    @property
    def chunk_pages(self) -> int | None:
        """The most pages one generic call can take (the staging area's size), or None."""
        return None if self.staging is None else max(1, self.staging.pages)

    def slot_batch(self, groups: Sequence[str], slots: Sequence[int], *, fill: bool,
                   keys: Sequence[str] | None = None, checked: bool = False) -> Batch:
        """Pages for ``groups`` at host ``slots`` (first slot of each page). ``fill``: copy the pool's
        bytes into staging (a write). ``keys``: the pages' keys when the caller has them. ``checked``:
        the caller already passed ``slots`` through :meth:`check_slots`."""
        assert self.host is not None, f"pool {self.name!r} has no host memory"
        slots = list(slots)
        if not checked:
            self.check_slots(slots)
        if self.zero_copy:
            return Batch(self, self.zero_copy_transfer(groups, slots, keys), slots=slots)
        keys = list(keys) if keys is not None else self.keys(groups)
        rows, bufs = self._rows(len(slots) * self.split)
        if fill:
            for n, row in enumerate(rows):
                self.host.copy_page_out(slots[n // self.split], row, n % self.split, self.split)
        return Batch(self, PageTransfer(self.name, self._page(keys, groups, bufs), False), staged=rows, slots=slots)

    def zero_copy_transfer(self, groups: Sequence[str], slots: Sequence[int],
                           keys: Sequence[str] | None = None) -> PageTransfer:
        """The zero-copy pages for ``groups`` at host ``slots`` as one transfer: what a zero-copy
        :meth:`slot_batch` sends, without the batch (the SGLang adapter's v1 and v2 calls). Where
        one compiled call builds them, they are :class:`SlotPages`, built when the Store hands them
        over, together with their headers (one pass instead of two); otherwise built now. Either
        way every slot is checked again before it becomes an address: a bad one raises ValueError
        (when the pages are built) and builds nothing."""
        assert self.host is not None, f"pool {self.name!r} has no host memory"
        keys = keys if keys is not None else self.keys(groups)
        if self._compiled_slots(self.host.slot_buffers(self.split)):
            return PageTransfer(self.name, SlotPages(self, keys, groups, slots), True)
        return PageTransfer(self.name, self._slot_pages(keys, groups, slots), True)

    def flat_batch(self, groups: Sequence[str], flats: Sequence[torch.Tensor], *, fill: bool,
                   keys: Sequence[str] | None = None) -> Batch:
        """Pages for flat data pages (one tensor per page, SGLang's ``get_data_page(i, flat=True)``
        order), always through staging. ``fill``: copy the flats into staging (a write)."""
        nbytes = self.spec.page_nbytes
        for f in flats:
            if f.nbytes != nbytes:
                raise ValueError(f"flat {self.name} page of {f.nbytes} bytes, expected {nbytes}")
        keys = list(keys) if keys is not None else self.keys(groups)
        rows, bufs = self._rows(len(flats) * self.split)
        ptrs = self._flat_ptrs(flats)
        if fill:
            if ptrs is not None:
                threads = threads_for(len(ptrs) * nbytes, _COPY_SHARE)
                copy_regions([b[0].ptr for b in bufs], ptrs, nbytes, threads=threads)
            else:
                for n, row in enumerate(rows):
                    self._one_page(flats[n // self.split]).copy_page_out(0, row, n % self.split, self.split)
        return Batch(self, PageTransfer(self.name, self._page(keys, groups, bufs), False), staged=rows, flats=flats,
                     flat_ptrs=ptrs)

    def _flat_ptrs(self, flats: Sequence[torch.Tensor]) -> list[int] | None:
        """The flats' addresses when each is a contiguous CPU tensor holding one whole page (one
        part per page): its bytes are then the stored page, copied in one compiled call for the
        batch (one torch copy a page cost a call on top of its bytes); else None."""
        if self.split != 1 or not all(f.is_cpu and f.is_contiguous() for f in flats):
            return None
        return [f.data_ptr() for f in flats]

    def _one_page(self, flat: torch.Tensor) -> HostPool:
        torch = import_torch()
        raw = flat.contiguous().view(-1).view(torch.uint8)
        if self.spec.attention is not None:
            raw = raw.view(self.spec.torch_dtype)
        return HostPool.wrap(self.spec, raw)

    # -- results ------------------------------------------------------------------------------------
    def page_oks(self, results: Sequence[PageResult]) -> list[bool]:
        """Per page: every head part came back OK (a short answer is a failure)."""
        ok = PageResult.OK
        n = len(results) // self.split
        if self.split == 1:
            return list(map(is_, results, repeat(ok)))  # one compiled pass (a 128-page listcomp: 5 us cold)
        return [all(r is ok for r in results[i * self.split : (i + 1) * self.split]) for i in range(n)]

    def prefix(self, results: Sequence[PageResult]) -> int:
        """Leading pages whose every part is OK."""
        n = 0
        for good in self.page_oks(results):
            if not good:
                break
            n += 1
        return n

    def finish_get(self, batch: Batch, results: Sequence[PageResult], upto: int | None = None) -> list[bool]:
        """After a read: copy the staged pages that came back OK (the first ``upto`` pages at
        most) into their destinations; per-page OK (False past ``upto``)."""
        pages = len(batch.transfer.pages) // self.split
        oks = self.page_oks(results) if len(results) == pages * self.split else [False] * pages
        if upto is not None:
            oks = [o and i < upto for i, o in enumerate(oks)]
        if batch.flat_ptrs is not None:  # plain CPU flats: the pages that came back, in one call
            sent, nbytes = batch.transfer.pages, self.part_nbytes
            dsts = [p for p, ok in zip(batch.flat_ptrs, oks, strict=True) if ok]
            srcs = [sent[i].buffers[0].ptr for i, ok in enumerate(oks) if ok]
            copy_regions(dsts, srcs, nbytes, threads=threads_for(len(dsts) * nbytes, _COPY_SHARE))
        elif batch.staged:
            for n, row in enumerate(batch.staged):
                i, part = divmod(n, self.split)
                if not oks[i]:
                    continue
                if batch.slots is not None:
                    assert self.host is not None
                    self.host.copy_page_in(batch.slots[i], row, part, self.split)
                else:
                    assert batch.flats is not None
                    flat = batch.flats[i]
                    whole = flat.contiguous()  # a copy when flat is not contiguous: written back below
                    self._one_page(whole).copy_page_in(0, row, part, self.split)
                    if whole is not flat:
                        flat.copy_(whole)
        return oks


class Hit(NamedTuple):
    """What :func:`usable_hit` found: ``pages`` of the prefix are restorable by every pool that
    gates it; ``draft_pages`` (<= pages) by the draft-role pools too; ``boundaries`` each pool's own."""

    pages: int
    draft_pages: int
    boundaries: dict[str, int]


def usable_hit(
    bindings: Sequence[PoolBinding],
    prefix: Mapping[str, int],
    window_stored: Callable[[PoolBinding, int], int],
    *,
    limit: int,
    draft_gates: bool = True,
    probes: int = 4,
    windows: Mapping[str, int] | None = None,
) -> Hit:
    """The hit rule, for any number of active pools.

    ``prefix[name]``: leading pages stored of each ``all_pages`` pool (from one existence query).
    ``window_stored(binding, n)``: how many of pages ``n-1, n-2, ...`` (backwards, at most the
    pool's window) a ``trailing_pages`` pool has stored. The hit is the largest ``n <= limit`` with
    every ``all_pages`` pool holding pages ``0..n-1`` and every ``trailing_pages`` pool the last
    ``min(window_pages, n)`` of them. Draft-role pools gate it when ``draft_gates`` (a missing
    draft component shortens the hit, so no restored page keeps stale draft state); otherwise they
    only bound ``draft_pages``. A window that fails moves the candidate before the missing page;
    after ``probes`` failed windows the pool gives 0. ``windows[name]``: a trailing pool's window
    for this query instead of its spec's ``window_pages`` (SGLang says it per call: the transfer's keys)."""
    bounds: dict[str, int] = {}
    if draft_gates:
        n, trailing, drafted = _leading(bindings, prefix, limit, limit, bounds)
        if trailing:
            n = _Windows(prefix, window_stored, limit, probes, bindings, windows).settle(trailing, n, bounds)
        pages = n if n > 0 else 0
        return _new_hit(Hit, (pages, pages if drafted else 0, bounds))
    rule = _Windows(prefix, window_stored, limit, probes, bindings, windows)
    active = [b for b in bindings if b.active]
    pages = rule.settle([b for b in active if b.spec.role is not PoolKind.DRAFT], limit, bounds)
    draft = [b for b in active if b.spec.role is PoolKind.DRAFT]
    return Hit(pages, rule.settle(draft, pages, dict(bounds)) if draft else 0, bounds)


def query_hit(
    exists: Callable[[dict[str, Sequence[str]]], Mapping[str, int]],
    bindings: Sequence[PoolBinding],
    hashes: Sequence[str],
    keys_of: Callable[[PoolBinding, Sequence[str]], Sequence[str]],
    *,
    draft_gates: bool = True,
    windows: Mapping[str, int] | None = None,
) -> Hit:
    """:func:`usable_hit` over a store, for the prefix ``hashes``: one existence query (``exists``:
    a :class:`~hicache_draft.store.Store`'s ``page_exists``) for every active ``all_pages`` pool of
    ``bindings``, then, as the rule asks, one per ``trailing_pages`` window (its last page first).

    ``keys_of(binding, hashes)``: the binding's storage keys of those pages (page-major). The prefix
    query hands it ``hashes`` itself, the same object, so a caller may keep what it already knows of
    them; a window query hands it a new list. ``windows``: as :func:`usable_hit` (a trailing pool's
    window for this query; else its spec's ``window_pages``). The controller and the SGLang adapter
    both ask through here."""
    query: dict[str, Sequence[str]] = {}
    trailing = parts = False
    for b in bindings:  # plain loops: SGLang asks per request
        if b.active:
            if b.spec.hit_policy is _ALL_PAGES:
                query[b.name] = keys_of(b, hashes)
                parts = parts or b.split != 1
            else:
                trailing = True
    counts = exists(query) if query else {}
    prefix: Mapping[str, int] = counts  # pages stored, when each page is one stored part
    if parts:
        prefix = {b.name: counts.get(b.name, 0) // b.split for b in bindings if b.name in query}
    limit = len(hashes)
    if not trailing and draft_gates:
        # usable_hit's rule with no window to ask is its leading part alone: taken here, without
        # the general call (SGLang asks this per request, and each layer's few tenths of a
        # microsecond count several times over right after the Store's hop)
        bounds: dict[str, int] = {}
        n, _, drafted = _leading(bindings, prefix, limit, limit, bounds)
        pages = n if n > 0 else 0
        return _new_hit(Hit, (pages, pages if drafted else 0, bounds))
    window_stored = _never_asked
    if trailing:

        def window_stored(b: PoolBinding, end: int) -> int:
            size = windows.get(b.name, b.spec.window_pages) if windows else b.spec.window_pages
            tail = list(hashes[max(0, end - size) : end])[::-1]  # last page first
            return exists({b.name: keys_of(b, tail)}).get(b.name, 0) // b.split

    return usable_hit(bindings, prefix, window_stored, limit=limit, draft_gates=draft_gates, windows=windows)


def _never_asked(binding: PoolBinding, end: int) -> int:
    """:func:`query_hit`'s ``window_stored`` when no ``trailing_pages`` pool is active (the rule
    asks only those)."""
    raise AssertionError(f"the hit rule asked the window of {binding.name!r}, which trails no window")


# a Hit without its generated Python-level __new__ (an existence query makes one per call)
_new_hit = tuple.__new__
# the members the hit rule asks for per pool, as module names (an Enum member looked up on its
# class costs a Python-level attribute hook each time, and an existence query asks many times)
_ALL_PAGES, _TRAILING_PAGES, _DRAFT = HitPolicy.ALL_PAGES, HitPolicy.TRAILING_PAGES, PoolKind.DRAFT


def _leading(
    pools: Sequence[PoolBinding], prefix: Mapping[str, int], limit: int, n: int, bounds: dict[str, int]
) -> tuple[int, list[PoolBinding], bool]:
    """The ``all_pages`` part of the rule over the active ones of ``pools``: ``n`` cut to each such
    pool's stored prefix (at most ``limit``; each one's boundary into ``bounds``); the
    ``trailing_pages`` pools left to ask; whether a draft-role pool is among them. (One plain loop:
    an existence query of SGLang's runs it, and its few microseconds count.)"""
    trailing: list[PoolBinding] = []
    drafted = False
    for b in pools:
        if not b.active:
            continue
        spec = b.spec
        if spec.role is _DRAFT:
            drafted = True
        if spec.hit_policy is _ALL_PAGES:
            got = prefix.get(b.name, 0)
            bounds[b.name] = got = got if got < limit else limit
            if got < n:
                n = got
        elif spec.hit_policy is _TRAILING_PAGES:
            trailing.append(b)
    return n, trailing, drafted


class _Windows:
    """:func:`usable_hit`'s settling of one candidate over some pools (the window table is built
    only when a ``trailing_pages`` pool is asked)."""

    __slots__ = ("_bindings", "_window", "_windows", "limit", "prefix", "probes", "window_stored")

    def __init__(
        self, prefix: Mapping[str, int], window_stored: Callable[[PoolBinding, int], int], limit: int, probes: int,
        bindings: Sequence[PoolBinding], windows: Mapping[str, int] | None,
    ) -> None:
        self.prefix, self.window_stored, self.limit, self.probes = prefix, window_stored, limit, probes
        self._bindings, self._windows = bindings, windows
        self._window: dict[str, int] | None = None

    def window(self, b: PoolBinding) -> int:
        if self._window is None:
            self._window = {x.name: x.spec.window_pages for x in self._bindings} | dict(self._windows or {})
        return self._window[b.name]

    def settle(self, pools: Sequence[PoolBinding], n: int, bounds: dict[str, int]) -> int:
        """The largest candidate <= ``n`` that ``pools`` all hold; their boundaries into ``bounds``."""
        n, trailing, _ = _leading(pools, self.prefix, self.limit, n, bounds)
        if not trailing:
            return max(0, n)
        for _ in range(self.probes):
            before = n
            for b in trailing:
                if n <= 0:
                    break
                got = self.window_stored(b, n)
                if got < min(self.window(b), n):
                    n -= got + 1  # the page before the stored tail is missing: end the window before it
                bounds[b.name] = max(0, n)
            if n == before or n <= 0:
                break
        else:
            n = 0  # the windows did not settle within the probes: no hit rather than a guess
        for b in trailing:
            bounds[b.name] = max(0, min(bounds.get(b.name, n), n))
        return max(0, n)
