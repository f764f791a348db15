"""A deployment's pools and their plans, from a :class:`Config` and a backend's declaration.

:func:`pool_specs` turns the config into pool shapes (target, draft, and every ``[[pools]]``
entry); :func:`plan_pools` plans each with :func:`hicache_draft.binding.plan_binding`, the rule the
controller and the SGLang adapter use, so ``hicache-draft check`` and a running server can never
disagree. Nothing here looks at a backend's name or needs torch.
"""

from __future__ import annotations

from dataclasses import replace

from hicache_draft.binding import BindingPlan, PathChoice, blocked_by, choose_path, plan_binding
from hicache_draft.capabilities import Attention, Capabilities, IOPath, Layout, PoolKind
from hicache_draft.config import Config, ExtraPoolConfig, Role
from hicache_draft.pools import PoolSpec

__all__ = ["PathChoice", "choose_path", "plan_paths", "plan_pools", "pool_specs"]


def _extra_spec(config: Config, pool: ExtraPoolConfig) -> PoolSpec:
    role = pool.effective_role
    comp = pool.effective_component
    layout = pool.layout or config.target.layout
    if layout is Layout.PAGE_HEAD and (not comp.has_attention or pool.attention is Attention.MLA):
        layout = Layout.PAGE_FIRST_DIRECT
    if comp.has_attention:
        dtype = pool.kv_dtype or (config.draft_dtype if role is Role.DRAFT else config.namespace.kv_dtype)
    else:
        dtype = "uint8"
    return PoolSpec(
        kind=pool.name, attention=pool.attention if comp.has_attention else None, layers=pool.layers,
        page_size=config.namespace.page_size, dtype=dtype, layout=layout, kv_heads=pool.kv_heads or 0,
        head_dim=pool.head_dim or 0, latent_dim=pool.latent_dim or 0, rows=tuple(pool.row_bytes or ()),
        role=role.kind, component=comp, hit_policy=pool.hit_policy, window_pages=pool.window_pages or 0,
        sharded=pool.sharded,
    )


def pool_specs(config: Config) -> dict[str, PoolSpec]:
    """Host pool shapes: the target's ``kv``, the draft's (when enabled), then the ``[[pools]]``
    entries (draft-role ones only when the draft is enabled)."""
    ns, t = config.namespace, config.target
    specs: dict[str, PoolSpec] = {
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
    for pool in config.pools:
        if pool.effective_role is Role.DRAFT and not d.enabled:
            continue
        specs[pool.name] = _extra_spec(config, pool)
    return specs


def models(config: Config, spec: PoolSpec) -> tuple[str, str]:
    """``(model, target_model)`` identities for a pool of this config."""
    ns = config.namespace
    model = str(ns.draft_model) if spec.role is PoolKind.DRAFT else ns.model
    return model, ns.model


def plan_pools(config: Config, caps: Capabilities, *, settle: bool = True) -> dict[str, BindingPlan]:
    """Every pool's plan on this rank (target first), with :func:`~hicache_draft.binding.blocked_by`
    applied unless ``settle`` is False (each pool's own verdict): a target pool that cannot be
    offloaded disables every pool."""
    plans: dict[str, BindingPlan] = {}
    for name, spec in pool_specs(config).items():
        model, target = models(config, spec)
        plans[name] = plan_binding(spec, caps, config.parallel, model=model, target_model=target)
    if not settle:
        return plans
    blocked = blocked_by({n: p.spec for n, p in plans.items()},
                         {n: p.path is not IOPath.DISABLED for n, p in plans.items()},
                         {n: p.reason for n, p in plans.items()})
    return {n: replace(p, path=IOPath.DISABLED, reason=blocked[n]) if n in blocked else p for n, p in plans.items()}


def plan_paths(config: Config, caps: Capabilities) -> dict[str, PathChoice]:
    """The path of every pool for this config and backend declaration (the draft's is listed,
    as disabled, when draft offload is off)."""
    out = {name: plan.choice for name, plan in plan_pools(config, caps).items()}
    if PoolKind.DRAFT not in out:
        out[PoolKind.DRAFT] = PathChoice(IOPath.DISABLED, "draft offload is off in the config (draft.enabled = false)")
    for pool in config.pools:
        if pool.name not in out:
            out[pool.name] = PathChoice(IOPath.DISABLED, "a draft pool, and draft offload is off (draft.enabled false)")
    return out
