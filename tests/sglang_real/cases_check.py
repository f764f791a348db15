"""``hicache-draft check --sglang-extra-config`` and the running adapter agree, on SGLang's own rigs.

For each deployment the other cases cover (dense MHA/MLA pairs in every layout, split heads on a
tp=2 rank, legacy flat draft pages, the DSA model with MTP, the hybrid SWA model), the adapter is
attached by SGLang's controller to SGLang's host pools; a config describing the same pools is then
planned by ``check`` with the same extra-config, and every pool's path, reason, split, writer and key
namespaces must be the ones the adapter holds.
"""

from __future__ import annotations

from typing import Any

import harness as h
import pytest

from hicache_draft import Attention, Capabilities, Component, PoolCapability, PoolKind
from hicache_draft.cli import sglang_check_report
from hicache_draft.config import Config
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend
from hicache_draft.testing.memory import all_layouts

pytestmark = pytest.mark.usefixtures("memory_backend")


def _shape(spec: Any) -> dict[str, Any]:
    if spec.attention is None:
        return {"row_bytes": list(spec.rows)}
    if spec.attention is Attention.MHA:
        return {"attention": "mha", "kv_heads": spec.kv_heads, "head_dim": spec.head_dim}
    return {"attention": "mla", "latent_dim": spec.latent_dim}


def config_of(adapter: Any, page_size: int) -> Config:
    """A config that describes the pools the adapter holds (shapes read from SGLang's host pools)."""
    specs = {name: b.spec for name, b in adapter.bindings.items()}
    kv = specs.pop(PoolKind.KV)
    par = adapter.placement.parallel
    data: dict[str, Any] = {
        "namespace": {"model": h.MODEL, "draft_model": "unused-by-the-adapter", "kv_dtype": kv.dtype,
                      "page_size": page_size},
        "parallel": {"tp_rank": par.tp_rank, "tp_size": par.tp_size, "pp_rank": par.pp_rank, "pp_size": par.pp_size,
                     "tp_lcm_size": adapter.storage_config.tp_lcm_size},
        "target": {"layers": kv.layers, "layout": kv.layout.value, **_shape(kv)},
        "draft": {"enabled": False},
        "pools": [],
    }
    draft = specs.pop(PoolKind.DRAFT, None)
    if draft is None:  # draft-role pools without a DRAFT pool (the SWA rig): the config still needs a draft shape
        draft = next((s for s in specs.values() if s.role is PoolKind.DRAFT and s.attention is not None), None)
    if draft is not None:
        data["draft"] = {"enabled": True, "layers": draft.layers, "layout": draft.layout.value,
                         "kv_dtype": draft.dtype, **_shape(draft)}
    for name, s in specs.items():
        pool: dict[str, Any] = {"name": str(name), "layers": s.layers, "layout": s.layout.value,
                                "hit_policy": s.hit_policy.value, "sharded": s.sharded, **_shape(s)}
        if s.attention is not None:
            pool["kv_dtype"] = s.dtype
        if s.hit_policy.value == "trailing_pages":
            pool["window_pages"] = s.window_pages
        data["pools"].append(pool)
    return Config.model_validate(data)


def assert_agree(rig: h.Rig) -> None:
    adapter = rig.adapter
    report = sglang_check_report(config_of(adapter, rig.page_size), rig.extra)
    held = {str(name): b for name, b in adapter.bindings.items()}
    if PoolKind.DRAFT not in held:  # the config's stand-in draft (see config_of) is not a pool SGLang registered
        report["pools"].pop("draft", None)
    assert set(report["pools"]) == set(held)
    for name, b in held.items():
        got = report["pools"][name]
        assert (got["path"], got["reason"]) == (b.path.value, b.reason), name
        assert (got["split"], got["writer"]) == (b.split, b.writer), name
        assert tuple(got["namespaces"]) == b.namespaces, name
    assert report["model"] == adapter.placement.model and report["draft_model"] == adapter.placement.draft_model


MHA_T, MHA_D = h.Shape("mha", 3, heads=4), h.Shape("mha", 1, heads=4)
MLA_T, MLA_D = h.Shape("mla", 3), h.Shape("mla", 1)
DENSE = [(t, d, lay) for t, d in [(MHA_T, MHA_D), (MLA_T, MLA_D), (MLA_T, MHA_D)]
         for lay in (h.MHA_LAYOUTS if t.attention == "mha" else h.MLA_LAYOUTS)]


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize(("target", "draft", "layout"), DENSE, ids=[f"{t.attention}-{d.attention}-{lay}"
                                                                    for t, d, lay in DENSE])
def test_check_agrees_with_the_adapter_on_dense_pairs(tmp_path, target, draft, layout, v1):
    extra = h.extra_config("", backend="memory", options={"space": tmp_path.name}, interface_v1=v1)
    rig = h.Rig(target, draft, layout, extra)
    try:
        assert_agree(rig)
    finally:
        rig.close()


def test_check_agrees_with_the_adapter_on_split_heads(tmp_path):
    """tp=2 with tp_lcm_size=4 in page_head: SGLang's should_split_heads, two head groups per page."""
    extra = h.extra_config("", backend="memory", options={"space": tmp_path.name})
    extra["tp_lcm_size"] = 4  # SGLang pops it and sets should_split_heads
    rig = h.Rig(MHA_T, MHA_D, "page_head", extra, tp_rank=1, tp_size=2)
    try:
        assert rig.adapter.bindings[PoolKind.KV].split == 2
        assert_agree(rig)
    finally:
        rig.close()


def _legacy_flat_draft_pages(tmp_path):
    extra = h.extra_config("", backend="memory", options={"space": tmp_path.name},
                           legacy_draft=h.legacy_draft_shape(MHA_D))
    rig = h.Rig(MLA_T, MHA_D, "page_first", extra, mode="legacy")
    try:
        assert rig.adapter.bindings[PoolKind.DRAFT].host is None
        assert_agree(rig)
    finally:
        rig.close()


if h.HAS_LEGACY_DRAFT:  # legacy flat draft pages exist up to 0.5.18 only (collected only there)
    test_check_agrees_with_the_adapter_on_legacy_flat_draft_pages = _legacy_flat_draft_pages


@pytest.mark.parametrize("model", ["dsa", "swa"])
def test_check_agrees_with_the_adapter_on_dsa_and_swa_models(tmp_path, model):
    extra = h.extra_config("", backend="memory", options={"space": tmp_path.name})
    if model == "dsa":
        rig = h.Rig(h.Shape("mla", 2), h.Shape("mla", 1), "page_first", extra, model="dsa",
                    page_size=h.DSA_PAGE_SIZE, device_tokens=4 * h.DSA_PAGE_SIZE)
        want = {"kv", "indexer", "draft", "draft_indexer"}
    else:
        rig = h.Rig(h.Shape("mha", 1), h.Shape("mha", 1), "page_first", extra, model="swa")
        want = {"kv", "swa", "draft_swa"}
    try:
        assert {str(n) for n in rig.adapter.bindings} == want
        assert_agree(rig)
    finally:
        rig.close()


def _declaring(kv: set[Component], draft: set[Component]) -> type[MemoryBackend]:
    def cap(components: set[Component]) -> PoolCapability:
        return PoolCapability(attention=frozenset(Attention), zero_copy_layouts=all_layouts(),
                              components=frozenset(components))

    caps = Capabilities(pools={PoolKind.KV: cap(kv), PoolKind.DRAFT: cap(draft)}, split_heads=True, persistent=True)
    return type("Declaring", (MemoryBackend,), {"capabilities": caps})


@pytest.mark.parametrize(("kv", "draft", "active"), [
    ({Component.KV}, set(Component), set()),  # no target indexer: KV alone is unusable, nothing is offloaded
    (set(Component), {Component.KV}, {"kv", "indexer", "draft"}),  # no draft indexer: that pool only
], ids=["no-target-indexer", "no-draft-indexer"])
def test_check_agrees_with_the_adapter_when_the_backend_lacks_a_component(tmp_path, kv, draft, active):
    register_backend("partial", _declaring(kv, draft))
    try:
        extra = h.extra_config("", backend="partial", options={"space": tmp_path.name})
        rig = h.Rig(h.Shape("mla", 2), h.Shape("mla", 1), "page_first", extra, model="dsa",
                    page_size=h.DSA_PAGE_SIZE, device_tokens=4 * h.DSA_PAGE_SIZE)
        try:
            assert {str(n) for n, b in rig.adapter.bindings.items() if b.active} == active
            assert_agree(rig)
        finally:
            rig.close()
    finally:
        unregister_backend("partial")
