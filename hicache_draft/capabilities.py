"""What a storage backend declares it can do, as data.

The controller, ``hicache-draft check`` and the conformance kit decide everything from a
:class:`Capabilities` object; nothing in hicache-draft ever looks at a backend's name.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PoolKind(StrEnum):
    """A pool's role: ``kv`` is the target model's, ``draft`` the draft model's.

    They are also the names of the two classic pools (the target's and the draft's attention KV).
    Other pools have names of their own (``"indexer"``, ``"draft_indexer"``, ``"swa"``, ...;
    :data:`hicache_draft.pools.KNOWN_POOLS`) and one of these two roles."""

    KV = "kv"
    DRAFT = "draft"


class Component(StrEnum):
    """What a pool holds.

    ``kv``: attention KV of the whole context (MHA K and V heads, or the MLA latent).
    ``indexer``: a sparse-attention indexer's keys and scales (DSA), one row of bytes per page and layer.
    ``window``: sliding-window attention KV (SWA): MHA/MLA geometry, only the trailing pages matter.
    ``state``: recurrent state (Mamba, linear attention): rows of bytes per state slot and layer.
    """

    KV = "kv"
    INDEXER = "indexer"
    WINDOW = "window"
    STATE = "state"

    @property
    def has_attention(self) -> bool:
        """Whether pools of this component have MHA/MLA geometry (else: row geometry)."""
        return self in (Component.KV, Component.WINDOW)


class HitPolicy(StrEnum):
    """Which pages of a prefix a pool must restore for the prefix to count.

    ``all_pages``: every page (target and draft KV, indexers). ``trailing_pages``: only the last
    ``window_pages`` pages of the hit (sliding-window KV, recurrent state), as SGLang's
    ``PoolHitPolicy`` says."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


class Attention(StrEnum):
    """``mha``: separate K and V per head. ``mla``: one latent vector per token and layer."""

    MHA = "mha"
    MLA = "mla"


class Layout(StrEnum):
    """Host pool layouts (the same names and shapes as SGLang's host pools).

    ``layer_first``: ``(2, L, slots, H, D)`` (MHA) / ``(L, slots, 1, d)`` (MLA).
    ``page_first``: ``(2, slots, L, H, D)`` / ``(slots, L, 1, d)``.
    ``page_first_direct``: ``(2, pages, L, ps, H, D)`` / ``(pages, L, ps, 1, d)``.
    ``page_head``: ``(2, pages, H, ps, L, D)``, MHA only; a head group of a page is contiguous.
    """

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"


class IOPath(StrEnum):
    """How the controller moves one pool's pages to and from a backend."""

    ZERO_COPY = "zero_copy"
    GENERIC = "generic"
    DISABLED = "disabled"


class PoolCapability(BaseModel):
    """What a backend supports for the pools of one role (target ``kv`` or ``draft``).

    ``components``: the components it holds for that role (``kv`` alone unless declared: a backend
    that stores any bytes under any key can hold them all; one with fixed-size slots may not).
    ``attention``: the attention types it holds for the ``kv`` and ``window`` components.

    ``zero_copy_layouts``: layouts for which the backend accepts page buffers that point straight
    into the registered host pool (one or more buffers per page; see :mod:`hicache_draft.pools`).
    ``generic``: the backend accepts pages that the controller copied into one contiguous buffer.
    ``max_buffers_per_page``: the most buffers one page may be made of on the zero-copy path
    (``None``: no limit). A backend whose storage slots hold one buffer (3FS) says 1 here.
    ``note``: why the support is limited, in the backend's words; ``check`` prints it with any
    path that is not ``zero_copy``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    attention: frozenset[Attention] = Field(min_length=1)
    components: frozenset[Component] = frozenset({Component.KV})
    zero_copy_layouts: frozenset[Layout] = frozenset()
    generic: bool = True
    max_buffers_per_page: int | None = Field(default=None, ge=1)
    note: str = ""


class Capabilities(BaseModel):
    """A backend's declaration. Validated when the backend is registered.

    ``pools``: per role (``kv``: the target's pools, ``draft``: the draft's), what it can hold, as a
    :class:`PoolCapability`.
    ``split_heads``: it stores the head groups of an MHA page under their own keys, so that servers
    with different ``tp_size`` and one ``tp_lcm_size`` share pages.
    ``persistent``: its data survives a restart of the serving process.
    ``shared``: several processes (TP ranks, servers) may use one store at once. Off unless
    declared: claiming it is the backend's promise, not a default.
    ``writes_records``: it stores pages as the core's records in files (each page's 64-byte header,
    then its payload) and writes every page of a ``page_set`` through the core's ``write_records``,
    which makes each header from the bytes as it writes them (one pass over the memory). The
    ``Store`` then hands it zeroed headers instead of making them before the call; a page reported
    ``OK`` that was not written that way keeps a zero header, which never verifies.
    ``headers_on_demand``: it asks the core for the headers of the pages it is about to send
    (``page_set``'s ``make_headers``), a piece of the batch at a time, so that the core hashes one
    piece while the backend moves the one before. The ``Store`` then hands it zeroed headers; a
    page sent without asking keeps a zero header, which never verifies.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: dict[PoolKind, PoolCapability] = Field(min_length=1)
    split_heads: bool = False
    persistent: bool = False
    shared: bool = False
    writes_records: bool = False
    headers_on_demand: bool = False

    @field_validator("pools")
    @classmethod
    def _kv_required(cls, v: dict[PoolKind, PoolCapability]) -> dict[PoolKind, PoolCapability]:
        if PoolKind.KV not in v:
            raise ValueError("a backend must hold the target 'kv' pool")
        for kind, cap in v.items():
            if not cap.generic and not cap.zero_copy_layouts:
                raise ValueError(f"pool {kind.value!r} declares neither zero-copy layouts nor a generic path")
            if Component.KV not in cap.components:
                raise ValueError(f"pool {kind.value!r} must hold the 'kv' component")
        return v

    def holds(self, role: PoolKind, component: Component) -> bool:
        """Whether the backend declares ``component`` for pools of ``role``."""
        cap = self.pools.get(role)
        return cap is not None and component in cap.components

    def summary(self) -> dict[str, object]:
        """A plain, JSON-ready view of the declaration."""
        return {
            "pools": {
                k.value: {
                    "attention": sorted(a.value for a in c.attention),
                    "components": sorted(x.value for x in c.components),
                    "zero_copy_layouts": sorted(layout.value for layout in c.zero_copy_layouts),
                    "generic": c.generic,
                    "max_buffers_per_page": c.max_buffers_per_page,
                    "note": c.note,
                }
                for k, c in sorted(self.pools.items())
            },
            "split_heads": self.split_heads,
            "persistent": self.persistent,
            "shared": self.shared,
            "writes_records": self.writes_records,
            "headers_on_demand": self.headers_on_demand,
        }
