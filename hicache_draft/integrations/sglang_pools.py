"""SGLang host pools seen through hicache-draft: spec, zero-copy view, key namespaces, I/O path.

An SGLang ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` is read by attribute (``kv_buffer``,
``layout``, ``page_size``, ``layer_num``, ``dtype``, and ``head_num``/``head_dim`` or
``kv_cache_dim``), never by class, and wrapped without a copy with :meth:`HostPool.wrap`. Its
``kv_buffer`` shapes are the ones :mod:`hicache_draft.pools` uses, so our page buffers point into
SGLang's memory exactly where ``get_page_buffer_meta`` points (for MHA ``layer_first`` we list a
page's per-layer regions K-first then V, the order of ``get_data_page(flat=True)``, where SGLang
interleaves K and V per layer; the regions are the same). A page's stored bytes are therefore the
same on the zero-copy path, the staging path and SGLang's flat-page calls.

Which path a pool takes is decided from the backend's declared capabilities only.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hicache_draft.capabilities import Attention, Capabilities, IOPath, Layout, PoolKind
from hicache_draft.errors import ConfigError
from hicache_draft.integrations.sglang_config import LegacyDraftPool, Placement
from hicache_draft.keys import make_key, pool_identities
from hicache_draft.paths import PathChoice, choose_path
from hicache_draft.pools import HostPool, PoolSpec, SlotBuffers, dtype_name
from hicache_draft.transfer import Buffer


def host_pool_spec(host_pool: object, kind: PoolKind) -> PoolSpec:
    """The :class:`PoolSpec` of an SGLang host pool; :class:`ConfigError` for what we cannot hold."""
    label = f"SGLang {kind.value} host pool"
    try:
        layout = Layout(str(host_pool.layout))  # type: ignore[attr-defined]
    except ValueError:
        valid = ", ".join(v.value for v in Layout)
        raise ConfigError(
            f"{label}: layout {host_pool.layout!r} is not supported (use one of: {valid})",  # type: ignore[attr-defined]
            field="layout",
        ) from None
    except AttributeError:
        raise ConfigError(f"{label}: object {type(host_pool).__name__} has no 'layout'", field="layout") from None
    if int(getattr(host_pool, "dcp_size", 1)) != 1:
        raise ConfigError(f"{label}: decode context parallelism (dcp_size > 1) is not supported", field="dcp_size")
    buf = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
        raise ConfigError(f"{label}: 'kv_buffer' must be a CPU torch tensor", field="kv_buffer")
    common = {
        "kind": kind,
        "layers": int(host_pool.layer_num),  # type: ignore[attr-defined]
        "page_size": int(host_pool.page_size),  # type: ignore[attr-defined]
        "dtype": host_pool.dtype,  # type: ignore[attr-defined]
        "layout": layout,
    }
    try:
        if hasattr(host_pool, "kv_cache_dim"):
            return PoolSpec(attention=Attention.MLA, latent_dim=int(host_pool.kv_cache_dim), **common)
        head_dim = int(host_pool.head_dim)  # type: ignore[attr-defined]
        v_head_dim = int(getattr(host_pool, "v_head_dim", head_dim))
        if v_head_dim != head_dim:
            raise ConfigError(f"{label}: head_dim {head_dim} != v_head_dim {v_head_dim} is not supported",
                              field="v_head_dim")
        return PoolSpec(attention=Attention.MHA, kv_heads=int(host_pool.head_num), head_dim=head_dim, **common)  # type: ignore[attr-defined]
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"{label}: {exc}") from None


def legacy_draft_spec(shape: LegacyDraftPool, target: PoolSpec) -> PoolSpec:
    """The draft pool's spec from the extra-config, for flat ``{hash}.draft`` pages only."""
    layout = shape.layout or target.layout
    if shape.attention is Attention.MLA and layout is Layout.PAGE_HEAD:
        layout = Layout.PAGE_FIRST_DIRECT
    dtype = shape.kv_dtype or target.dtype
    return PoolSpec(
        kind=PoolKind.DRAFT, attention=shape.attention, layers=shape.layers, page_size=target.page_size,
        dtype=dtype, layout=layout, kv_heads=shape.kv_heads or 0, head_dim=shape.head_dim or 0,
        latent_dim=shape.latent_dim or 0,
    )


def pool_path(caps: Capabilities, spec: PoolSpec, split: int, has_memory: bool) -> PathChoice:
    """The I/O path for one pool, from the declaration alone (the core's rule,
    :func:`hicache_draft.paths.choose_path`). Without registered pool memory (flat SGLang pages
    only) a zero-copy choice becomes the generic path."""
    choice = choose_path(caps, spec, split)
    if choice.path is IOPath.ZERO_COPY and not has_memory:
        cap = caps.pools[spec.kind]
        if cap.generic:
            return PathChoice(IOPath.GENERIC, "flat SGLang pages (no registered host pool); copied through staging")
        return PathChoice(IOPath.DISABLED, "flat SGLang pages need a generic path, and the backend has none")
    return choice


def split_factor(spec: PoolSpec, placement: Placement, caps: Capabilities) -> int:
    """Head groups per page on this rank: >1 only for split-head MHA ``page_head`` pools on a
    backend that declares ``split_heads``."""
    par = placement.parallel
    split = par.split_factor
    if (
        split > 1
        and placement.split_heads
        and caps.split_heads
        and spec.attention is Attention.MHA
        and spec.layout is Layout.PAGE_HEAD
        and spec.kv_heads % split == 0
    ):
        return split
    return 1


def namespaces(spec: PoolSpec, placement: Placement, split: int) -> tuple[str, ...]:
    """One key namespace per head part of this rank's pages (every dimension that changes bytes)."""
    par = placement.parallel
    ids = pool_identities(
        pool=spec.kind,
        model=placement.draft_model if spec.kind is PoolKind.DRAFT else placement.model,
        dtype=dtype_name(spec.dtype),
        attention=spec.attention,
        page_size=spec.page_size,
        layers=spec.layers,
        layout=spec.layout,
        kv_heads=spec.kv_heads if spec.attention is Attention.MHA else None,
        head_dim=spec.head_dim if spec.attention is Attention.MHA else None,
        latent_dim=spec.latent_dim if spec.attention is Attention.MLA else None,
        tp_rank=par.tp_rank,
        tp_size=par.tp_size,
        pp_rank=par.pp_rank,
        pp_size=par.pp_size,
        tp_lcm_size=par.tp_size * split if split > 1 else None,
        target_model=placement.model,
    )
    return tuple(i.fingerprint() for i in ids)


STAGING_BYTES = 256 << 20
"""The default staging area of one pool: up to this many bytes (16 to 128 pages)."""


def staging_pages(page_nbytes: int, setting: int | None, batch: int = 128) -> int:
    """Pages of one staging area: ``setting``, or as many of SGLang's batch (``STORAGE_BATCH_SIZE``)
    as fit :data:`STAGING_BYTES` (at least 16), so a generic call is one backend call."""
    if setting is not None:
        return setting
    return max(1, min(batch, max(16, STAGING_BYTES // max(1, page_nbytes))))


class Staging:
    """Host memory for the generic path of one pool: ``pages`` pages, one call at a time.

    It is registered with the backend once when the pool is registered. If a call that used it times
    out (the backend may still touch it), it is replaced by fresh, unregistered memory.
    """

    def __init__(self, page_nbytes: int, pages: int) -> None:
        self.page_nbytes = page_nbytes
        self.pages = pages
        self.lock = threading.Lock()
        self.tensor = torch.zeros(pages * page_nbytes, dtype=torch.uint8)
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

    def replace(self) -> None:
        """Abandon the current memory to a call that may still use it (its Buffers keep it alive)."""
        self.tensor = torch.zeros(self.pages * self.page_nbytes, dtype=torch.uint8)
        self._parts = {}


@dataclass
class PoolView:
    """One pool as the adapter drives it."""

    spec: PoolSpec
    pool: HostPool | None  # None: no registered memory (legacy flat draft pages only)
    namespaces: tuple[str, ...]
    path: IOPath
    reason: str
    staging: Staging | None = None
    source: object = field(default=None, repr=False)  # the SGLang host pool
    _suffixes: tuple[str, ...] = field(default=(), init=False, repr=False)
    key_cache: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # SGLang hash -> key

    def __post_init__(self) -> None:
        # make_key(group, ns) is the group followed by a suffix of ns alone: keys are built as
        # group + suffix (one concatenation per page instead of a call and a format)
        self._suffixes = tuple(make_key("", ns) for ns in self.namespaces)
        assert all(make_key("0a", ns) == "0a" + suf for ns, suf in zip(self.namespaces, self._suffixes, strict=True))

    @property
    def kind(self) -> PoolKind:
        return self.spec.kind

    @property
    def split(self) -> int:
        return len(self.namespaces)

    @property
    def part_nbytes(self) -> int:
        return self.spec.page_nbytes // self.split

    def keys(self, groups: Sequence[str]) -> list[str]:
        """``make_key(group, namespace)`` of every page and head part, page-major."""
        if len(self._suffixes) == 1:
            suf = self._suffixes[0]
            return [g + suf for g in groups]
        return [g + suf for g in groups for suf in self._suffixes]

    @property
    def slot_buffers(self) -> SlotBuffers:
        """The zero-copy buffers of the registered pool (:meth:`HostPool.slot_buffers`)."""
        assert self.pool is not None
        return self.pool.slot_buffers(self.split)

    def one_page(self, flat: torch.Tensor) -> HostPool:
        """A one-page pool over a flat SGLang data page (``get_data_page(i, flat=True)`` order)."""
        if flat.numel() * flat.element_size() != self.spec.page_nbytes:
            raise ValueError(
                f"flat {self.kind.value} page of {flat.numel() * flat.element_size()} bytes, "
                f"expected {self.spec.page_nbytes}"
            )
        raw = flat.contiguous().view(-1).view(torch.uint8).view(self.spec.torch_dtype)
        return HostPool.wrap(self.spec, raw)
