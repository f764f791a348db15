"""SGLang host pools read as hicache-draft pool specs: the SGLang half of a pool binding.

Everything else about a pool (split factor, key namespaces, I/O path, registration, page building,
staging, the per-page result and hit rules) is :mod:`hicache_draft.binding`'s, shared with the
controller and ``hicache-draft check``; this module only says what an SGLang host pool *is*.

SGLang's host pools are read by attribute, never by class:

* ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (``kv_buffer``, ``layout``, ``page_size``,
  ``layer_num``, ``dtype``, and ``head_num``/``head_dim`` or ``kv_cache_dim``): the attention
  geometry of the ``kv`` component (KV, DRAFT) or the ``window`` component (SWA, DRAFT_SWA). Their
  ``kv_buffer`` shapes are the ones :mod:`hicache_draft.pools` uses, so our page buffers point into
  SGLang's memory exactly where ``get_page_buffer_meta`` points (for MHA ``layer_first`` we list a
  page's per-layer regions K-first then V, the order of ``get_data_page(flat=True)``).
* ``DSAIndexerPoolHost`` (``index_k_with_scale_buffer``, ``indexer_page_stride_size``): the
  ``indexer`` component, row geometry ``rows=(indexer_page_stride_size,)`` bytes per page and layer,
  ``(L, P, R)`` in ``layer_first`` and ``(P, L, 1, R)`` in ``page_first*`` (INDEXER, DRAFT_INDEXER).

A page's stored bytes are therefore the same on the zero-copy path, the staging path and SGLang's
flat-page calls. A pool whose shape this module cannot read (DeepSeek-V4 compressed pools, Mamba
state, anything else) raises :class:`ConfigError` saying why; the adapter then does not hold it.
"""

from __future__ import annotations

import torch

from hicache_draft.binding import BindingPlan, plan_binding
from hicache_draft.capabilities import Attention, Capabilities, Component, Layout, PoolKind
from hicache_draft.errors import ConfigError
from hicache_draft.integrations.sglang_config import LegacyDraftPool, Placement
from hicache_draft.pools import KNOWN_POOLS, PoolSpec

INDEXER_BUFFER = "index_k_with_scale_buffer"


def _layout(host_pool: object, label: str) -> Layout:
    try:
        return Layout(str(host_pool.layout))  # type: ignore[attr-defined]
    except ValueError:
        valid = ", ".join(v.value for v in Layout)
        raise ConfigError(
            f"{label}: layout {host_pool.layout!r} is not supported (use one of: {valid})",  # type: ignore[attr-defined]
            field="layout",
        ) from None
    except AttributeError:
        raise ConfigError(f"{label}: object {type(host_pool).__name__} has no 'layout'", field="layout") from None


def _cpu_tensor(host_pool: object, attr: str, label: str) -> torch.Tensor:
    buf = getattr(host_pool, attr, None)
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
        raise ConfigError(f"{label}: {attr!r} must be a CPU torch tensor", field=attr)
    return buf


def host_pool_spec(host_pool: object, name: str) -> PoolSpec:
    """The :class:`PoolSpec` of SGLang's host pool registered as ``name`` (SGLang's ``PoolName``
    value); :class:`ConfigError` for a pool we cannot read or hold."""
    name = str(name)
    label = f"SGLang {name} host pool"
    known = KNOWN_POOLS.get(name)
    if known is None:
        raise ConfigError(f"{label}: hicache-draft does not know what SGLang's {name!r} pool holds", field=name)
    layout = _layout(host_pool, label)
    if int(getattr(host_pool, "dcp_size", 1)) != 1:
        raise ConfigError(f"{label}: decode context parallelism (dcp_size > 1) is not supported", field="dcp_size")
    try:
        layers = int(host_pool.layer_num)  # type: ignore[attr-defined]
        page_size = int(host_pool.page_size)  # type: ignore[attr-defined]
        if known.component is Component.INDEXER:
            _cpu_tensor(host_pool, INDEXER_BUFFER, label)
            rows = (int(host_pool.indexer_page_stride_size),)  # type: ignore[attr-defined]
            return PoolSpec(kind=name, attention=None, layers=layers, page_size=page_size, dtype="uint8",
                            layout=layout, rows=rows)
        if not known.component.has_attention:
            raise ConfigError(f"{label}: reading SGLang's {known.component.value!r} pools is not supported",
                              field=name)
        _cpu_tensor(host_pool, "kv_buffer", label)
        common = {"kind": name, "layers": layers, "page_size": page_size, "dtype": host_pool.dtype,  # type: ignore[attr-defined]
                  "layout": layout}
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


def host_pool_arrays(host_pool: object, spec: PoolSpec) -> list[torch.Tensor]:
    """The SGLang host pool's memory, one tensor per array of ``spec`` (for ``HostPool.wrap_arrays``)."""
    if spec.component is Component.INDEXER:
        return [getattr(host_pool, INDEXER_BUFFER)]
    return [host_pool.kv_buffer]  # type: ignore[attr-defined]


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


def plan_pool(
    spec: PoolSpec, placement: Placement, caps: Capabilities, *, has_memory: bool = True, kv_active: bool = True
) -> BindingPlan:
    """:func:`hicache_draft.binding.plan_binding` for one pool of this SGLang process: the draft
    model's identity for draft-role pools, the target's for the others (the one planning call of
    the adapter and of ``hicache-draft check`` for an SGLang deployment)."""
    model = placement.draft_model if spec.role is PoolKind.DRAFT else placement.model
    return plan_binding(spec, caps, placement.parallel, model=model, target_model=placement.model,
                        has_memory=has_memory, kv_active=kv_active)
