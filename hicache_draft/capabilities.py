"""What a storage backend declares it can do, as data.

The controller, ``hicache-draft check`` and the conformance kit decide everything from a
:class:`Capabilities` object; nothing in hicache-draft ever looks at a backend's name.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PoolKind(StrEnum):
    """The host pools a backend may hold. ``kv`` is the target model's KV, ``draft`` the draft model's."""

    KV = "kv"
    DRAFT = "draft"


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
    """What a backend supports for one pool.

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
    zero_copy_layouts: frozenset[Layout] = frozenset()
    generic: bool = True
    max_buffers_per_page: int | None = Field(default=None, ge=1)
    note: str = ""


class Capabilities(BaseModel):
    """A backend's declaration. Validated when the backend is registered.

    ``pools``: the pools it can hold, each with its :class:`PoolCapability`.
    ``split_heads``: it stores the head groups of an MHA page under their own keys, so that servers
    with different ``tp_size`` and one ``tp_lcm_size`` share pages.
    ``persistent``: its data survives a restart of the serving process.
    ``shared``: several processes (TP ranks, servers) may use one store at once. Off unless
    declared: claiming it is the backend's promise, not a default.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: dict[PoolKind, PoolCapability] = Field(min_length=1)
    split_heads: bool = False
    persistent: bool = False
    shared: bool = False

    @field_validator("pools")
    @classmethod
    def _kv_required(cls, v: dict[PoolKind, PoolCapability]) -> dict[PoolKind, PoolCapability]:
        if PoolKind.KV not in v:
            raise ValueError("a backend must hold the target 'kv' pool")
        for kind, cap in v.items():
            if not cap.generic and not cap.zero_copy_layouts:
                raise ValueError(f"pool {kind.value!r} declares neither zero-copy layouts nor a generic path")
        return v

    def summary(self) -> dict[str, object]:
        """A plain, JSON-ready view of the declaration."""
        return {
            "pools": {
                k.value: {
                    "attention": sorted(a.value for a in c.attention),
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
        }
