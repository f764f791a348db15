"""Choosing each pool's I/O path from the backend's declared capabilities.

The one function here, :func:`plan_paths`, is what the controller uses and what
``hicache-draft check`` prints, so the two can never disagree. It never looks at a backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_draft.capabilities import Attention, Capabilities, IOPath, PoolKind
from hicache_draft.config import Config
from hicache_draft.pools import PoolSpec


@dataclass(frozen=True)
class PathChoice:
    """The I/O path of one pool and the reason, in words a user can act on."""

    path: IOPath
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path.value, "reason": self.reason}


def pool_specs(config: Config) -> dict[PoolKind, PoolSpec]:
    """Host pool shapes for the target and (when enabled) the draft."""
    ns, t = config.namespace, config.target
    specs = {
        PoolKind.KV: PoolSpec(
            kind=PoolKind.KV, attention=t.attention, layers=t.layers, page_size=ns.page_size,
            dtype=ns.kv_dtype, layout=t.layout, kv_heads=t.kv_heads or 0, head_dim=t.head_dim or 0,
            latent_dim=t.latent_dim or 0,
        )
    }
    d = config.draft
    if d.enabled:
        specs[PoolKind.DRAFT] = PoolSpec(
            kind=PoolKind.DRAFT, attention=d.attention, layers=d.layers, page_size=ns.page_size,
            dtype=config.draft_dtype, layout=config.draft_layout, kv_heads=d.kv_heads or 0,
            head_dim=d.head_dim or 0, latent_dim=d.latent_dim or 0,
        )
    return specs


def choose_path(caps: Capabilities, spec: PoolSpec, split: int) -> PathChoice:
    """The path for one pool of shape ``spec`` with ``split`` head parts per page."""
    pool = spec.kind.value
    cap = caps.pools.get(spec.kind)
    if cap is None:
        return PathChoice(IOPath.DISABLED, f"the backend does not declare the {pool!r} pool")
    note = f" (backend note: {cap.note})" if cap.note else ""
    if spec.attention not in cap.attention:
        return PathChoice(
            IOPath.DISABLED,
            f"the backend does not declare {spec.attention.value!r} attention for the {pool!r} pool{note}",
        )
    split = split if spec.attention is Attention.MHA else 1
    if split > 1 and not caps.split_heads:
        return PathChoice(
            IOPath.DISABLED,
            f"split heads are on (tp_lcm_size/tp_size = {split}) and the backend does not declare split_heads",
        )
    layout = spec.layout.value
    nbuf = spec.buffers_per_page()
    why_not: str
    if spec.layout not in cap.zero_copy_layouts:
        why_not = f"layout {layout!r} is not zero-copy for this backend"
    elif not spec.zero_copy_parts(split):
        why_not = f"layout {layout!r} does not keep a page's head groups contiguous (use 'page_head')"
    elif cap.max_buffers_per_page is not None and nbuf > cap.max_buffers_per_page:
        why_not = (
            f"a {spec.attention.value} page in layout {layout!r} is {nbuf} buffers and the backend takes at most "
            f"{cap.max_buffers_per_page} per page"
        )
    else:
        parts = f", {split} head parts per page" if split > 1 else ""
        buffers = f"{nbuf} buffer{'s' if nbuf > 1 else ''} per page"
        return PathChoice(IOPath.ZERO_COPY, f"layout {layout!r} is zero-copy for this backend ({buffers}{parts})")
    if cap.generic:
        return PathChoice(IOPath.GENERIC, f"{why_not}; pages are copied through staging buffers{note}")
    return PathChoice(IOPath.DISABLED, f"{why_not}, and the backend has no generic path for the {pool!r} pool{note}")


def plan_paths(config: Config, caps: Capabilities) -> dict[PoolKind, PathChoice]:
    """The path of every pool for this config and backend declaration."""
    specs = pool_specs(config)
    split = config.parallel.split_factor
    plan = {PoolKind.KV: choose_path(caps, specs[PoolKind.KV], split)}
    if PoolKind.DRAFT not in specs:
        plan[PoolKind.DRAFT] = PathChoice(IOPath.DISABLED, "draft offload is off in the config (draft.enabled = false)")
    elif plan[PoolKind.KV].path is IOPath.DISABLED:
        plan[PoolKind.DRAFT] = PathChoice(IOPath.DISABLED, "the target 'kv' pool is disabled, so nothing is offloaded")
    else:
        plan[PoolKind.DRAFT] = choose_path(caps, specs[PoolKind.DRAFT], split)
    return plan
