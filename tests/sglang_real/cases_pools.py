"""Our view of SGLang host pools agrees with SGLang's own pointer and flat-page rules.

The pools are SGLang's own ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (see harness.py), so
``get_page_buffer_meta``, ``get_data_page`` and the shapes are SGLang's, not a copy of them.
"""

from __future__ import annotations

import harness as hr
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import Attention, Capabilities, IOPath, Layout, PoolCapability, PoolKind
from hicache_draft.binding import staging_pages
from hicache_draft.config import ParallelConfig
from hicache_draft.errors import ConfigError
from hicache_draft.integrations.sglang_config import Placement
from hicache_draft.integrations.sglang_pools import host_pool_arrays, host_pool_spec, plan_pool
from hicache_draft.pools import HostPool, SlotBuffers, check_page_starts

ALL = Capabilities(pools={k: PoolCapability(attention=frozenset(Attention)) for k in PoolKind})


def namespaces(spec, placement, caps=ALL):
    return plan_pool(spec, placement, caps).namespaces


def split_factor(spec, placement, caps):
    return plan_pool(spec, placement, caps).split


def pool_path(caps, spec, has_memory):
    return plan_pool(spec, _placement(), caps, has_memory=has_memory)

MHA_LAYOUTS, MLA_LAYOUTS = hr.MHA_LAYOUTS, hr.MLA_LAYOUTS
CASES = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def make_pool(attention: str, layout: str, *, layers: int = 3, page_size: int = 4, num_pages: int = 6,
              dtype: torch.dtype = torch.bfloat16, heads: int = 2, seed: int = 0):
    """SGLang's host pool (about ``num_pages`` pages: host pools round their size up by a page)."""
    shape = hr.Shape(attention, layers, heads=heads, head_dim=8, dtype=dtype)
    device = hr.device_pool(shape, max(page_size, num_pages * page_size // 2), page_size)
    pool = hr.host_pool(device, layout, ratio=2.0)
    hr.fill_random(pool, seed)
    return pool


def ours(pool, kind=PoolKind.KV) -> HostPool:
    return HostPool.wrap(host_pool_spec(pool, kind), pool.kv_buffer)


@pytest.mark.parametrize(("attention", "layout"), CASES)
def test_page_buffers_point_where_sglang_meta_points(attention, layout):
    pool = make_pool(attention, layout)
    view = ours(pool)
    slots = [0, 8, 20]
    indices = torch.cat([torch.arange(s, s + pool.page_size) for s in slots])
    sg_ptrs, sg_sizes = pool.get_page_buffer_meta(indices)
    our_ptrs, our_sizes = view.page_buffer_meta(slots)
    per_page = len(sg_ptrs) // len(slots)
    for n in range(len(slots)):
        sg = list(zip(sg_ptrs[n * per_page:(n + 1) * per_page], sg_sizes[n * per_page:(n + 1) * per_page], strict=True))
        us = list(zip(our_ptrs[n * per_page:(n + 1) * per_page], our_sizes[n * per_page:(n + 1) * per_page],
                      strict=True))
        if attention == "mha" and layout == "layer_first":
            # Same regions; SGLang interleaves K/V per layer, we list K layers then V layers
            # (the order of SGLang's flat data page).
            assert sorted(us) == sorted(sg)
            assert us == sg[0::2] + sg[1::2]
        else:
            assert us == sg


@pytest.mark.parametrize(("attention", "layout"), CASES)
def test_concatenated_page_buffers_are_sglang_flat_page(attention, layout):
    pool = make_pool(attention, layout, seed=3)
    view = ours(pool)
    for slot in (0, 4, 20):
        joined = b"".join(bytes(b.view()) for b in view.page_buffers(slot))
        assert joined == hr.page_bytes(pool, slot)
        assert view.page_bytes(slot) == hr.page_bytes(pool, slot)


def test_split_head_parts_point_where_sglang_split_meta_points():
    pool = make_pool("mha", "page_head", heads=4)
    view = ours(pool)
    indices = torch.arange(8, 16)
    sg_ptrs, sg_sizes = pool.get_split_heads_page_buffer_meta(indices, 2)
    our_ptrs, our_sizes = view.page_buffer_meta([8, 12], split=2)
    assert our_ptrs == sg_ptrs
    assert our_sizes == sg_sizes


@pytest.mark.parametrize(("attention", "layout", "split"),
                         [*[(a, lay, 1) for a, lay in CASES], ("mha", "page_head", 2)])
def test_slot_buffers_are_page_buffers_for_every_page(attention, layout, split):
    """The adapter's buffers (page 0's regions shifted by the page stride, cached) are exactly
    HostPool.page_buffers, head part by head part, for every page of SGLang's pool, twice (cached)."""
    view = ours(make_pool(attention, layout, heads=4, num_pages=7))
    sb = SlotBuffers(view, split)
    assert sb.template is not None  # every layout is one stride per page
    slots = [p * view.spec.page_size for p in range(view.num_pages)]
    want = [view.page_buffers(s, part, split) for s in slots for part in range(split)]
    assert sb.buffers(slots) == want
    assert sb.buffers(slots[::-1]) == [view.page_buffers(s, part, split) for s in slots[::-1] for part in range(split)]


@pytest.mark.parametrize("slot", [1, -4, 10_000])
def test_page_start_check_names_a_slot_that_starts_no_page(slot):
    view = ours(make_pool("mha", "page_first"))
    with pytest.raises(ValueError, match=f"host slot {slot} "):
        check_page_starts([0, slot, 4], view.spec.page_size, view.slots)
    check_page_starts([0, 4, 8], view.spec.page_size, view.slots)


def test_default_staging_holds_sglang_batch_within_its_byte_bound():
    assert staging_pages(64 << 10, None) == 128
    assert staging_pages(1 << 20, None) == 128
    assert staging_pages(8 << 20, None) == 32
    assert staging_pages(64 << 20, None) == 16
    assert staging_pages(8 << 20, 3) == 3


def test_spec_reads_sglang_attributes():
    mha = host_pool_spec(make_pool("mha", "page_first_direct", layers=5, page_size=4, heads=2), PoolKind.DRAFT)
    assert (mha.kind, mha.attention, mha.layers, mha.kv_heads, mha.head_dim, mha.layout) == (
        PoolKind.DRAFT, Attention.MHA, 5, 2, 8, Layout.PAGE_FIRST_DIRECT)
    mla = host_pool_spec(make_pool("mla", "layer_first", layers=2), PoolKind.KV)
    assert (mla.attention, mla.latent_dim, mla.layers, mla.torch_dtype) == (Attention.MLA, 16, 2, torch.bfloat16)


def test_spec_refuses_what_it_cannot_hold():
    pool = make_pool("mha", "page_first")
    pool.layout = "page_unified"
    with pytest.raises(ConfigError, match="page_unified"):
        host_pool_spec(pool, PoolKind.KV)
    pool = make_pool("mha", "page_first")
    pool.v_head_dim = 4
    with pytest.raises(ConfigError, match="v_head_dim"):
        host_pool_spec(pool, PoolKind.KV)
    pool = make_pool("mla", "page_first")
    pool.dcp_size = 2
    with pytest.raises(ConfigError, match="dcp_size"):
        host_pool_spec(pool, PoolKind.KV)


def _placement(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, lcm=None, model="m", draft="m#draft"):
    return Placement(parallel=ParallelConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                             tp_lcm_size=lcm), model=model, draft_model=draft,
                     split_heads=lcm is not None)


POOL_ARGS = st.fixed_dictionaries({
    "attention": st.sampled_from(["mha", "mla"]),
    "layers": st.integers(1, 3),
    "page_size": st.sampled_from([2, 4]),
    "dtype": st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    "heads": st.sampled_from([1, 2]),
    "layout": st.sampled_from(["page_first", "layer_first", "page_first_direct"]),
})


@settings(max_examples=60, deadline=None)
@given(a=POOL_ARGS, b=POOL_ARGS, kind_a=st.sampled_from(PoolKind), kind_b=st.sampled_from(PoolKind),
       rank_a=st.integers(0, 1), rank_b=st.integers(0, 1))
def test_namespaces_differ_whenever_bytes_can_differ(a, b, kind_a, kind_b, rank_a, rank_b):
    """Equal namespaces only for equal (pool, shape, dtype, layout, model, shard)."""
    pa = make_pool(a["attention"], a["layout"], layers=a["layers"], page_size=a["page_size"], dtype=a["dtype"],
                   heads=a["heads"], num_pages=1)
    pb = make_pool(b["attention"], b["layout"], layers=b["layers"], page_size=b["page_size"], dtype=b["dtype"],
                   heads=b["heads"], num_pages=1)
    na = namespaces(host_pool_spec(pa, kind_a), _placement(tp_rank=rank_a, tp_size=2))
    nb = namespaces(host_pool_spec(pb, kind_b), _placement(tp_rank=rank_b, tp_size=2))
    # MLA pools have no heads and are rank-replicated: their keys ignore head count and TP rank.
    def shape(p):
        return {k: v for k, v in p.items() if not (p["attention"] == "mla" and k == "heads")}

    same = shape(a) == shape(b) and kind_a == kind_b and (a["attention"] == "mla" or rank_a == rank_b)
    assert (na == nb) == same


def test_draft_and_target_namespaces_never_collide_and_models_count():
    pool = make_pool("mha", "page_first")
    target = namespaces(host_pool_spec(pool, PoolKind.KV), _placement())
    draft = namespaces(host_pool_spec(pool, PoolKind.DRAFT), _placement())
    other_model = namespaces(host_pool_spec(pool, PoolKind.KV), _placement(model="other"))
    other_pp = namespaces(host_pool_spec(pool, PoolKind.KV), _placement(pp_rank=1, pp_size=2))
    assert len({target, draft, other_model, other_pp}) == 4


def test_split_heads_namespaces_are_shared_across_tp_sizes():
    """tp_size=2 with tp_lcm_size=4 names the same head groups as tp_size=4 ranks."""
    caps = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset(Attention))}, split_heads=True)
    writer = make_pool("mha", "page_head", heads=4)
    wspec = host_pool_spec(writer, PoolKind.KV)
    wplace = _placement(tp_rank=1, tp_size=2, lcm=4)
    split = split_factor(wspec, wplace, caps)
    assert split == 2
    wns = namespaces(wspec, wplace, caps)
    reader = make_pool("mha", "page_head", heads=2)
    rspec = host_pool_spec(reader, PoolKind.KV)
    readers = [namespaces(rspec, _placement(tp_rank=r, tp_size=4, lcm=4), caps)[0] for r in (2, 3)]
    assert list(wns) == readers
    no_caps = caps.model_copy(update={"split_heads": False})
    assert split_factor(wspec, wplace, no_caps) == 1


def test_path_is_chosen_from_capabilities_only():
    spec = host_pool_spec(make_pool("mha", "layer_first", layers=3), PoolKind.DRAFT)

    def caps(**draft):
        pools = {PoolKind.KV: PoolCapability(attention=frozenset(Attention))}
        if draft:
            pools[PoolKind.DRAFT] = PoolCapability(**draft)
        return Capabilities(pools=pools)

    mha = frozenset({Attention.MHA})
    assert pool_path(caps(), spec, True).path is IOPath.DISABLED
    assert pool_path(caps(attention=frozenset({Attention.MLA})), spec, True).path is IOPath.DISABLED
    zc = caps(attention=mha, zero_copy_layouts=frozenset({Layout.LAYER_FIRST}))
    assert pool_path(zc, spec, True).path is IOPath.ZERO_COPY
    assert pool_path(zc, spec, False).path is IOPath.GENERIC
    few = caps(attention=mha, zero_copy_layouts=frozenset({Layout.LAYER_FIRST}), max_buffers_per_page=2)
    assert pool_path(few, spec, True).path is IOPath.GENERIC  # 2 * 3 layers buffers > 2
    only_zc = caps(attention=mha, zero_copy_layouts=frozenset({Layout.PAGE_FIRST}), generic=False)
    assert pool_path(only_zc, spec, True).path is IOPath.DISABLED
    only_zc_lf = caps(attention=mha, zero_copy_layouts=frozenset({Layout.LAYER_FIRST}), generic=False)
    assert pool_path(only_zc_lf, spec, True).path is IOPath.ZERO_COPY
    assert pool_path(only_zc_lf, spec, False).path is IOPath.DISABLED  # flat pages only


# -- DSA indexer pools (row geometry) -----------------------------------------------------------------


def make_indexer(layout: str, *, layers: int = 2, seed: int = 0):
    """SGLang's ``DSAIndexerPoolHost`` laid out on its MLA anchor (64-token pages, as DSA demands)."""
    with hr.parallel():
        device = hr.dsa_device_pool(hr.Shape("mla", layers), 4 * hr.DSA_PAGE_SIZE, hr.DSA_PAGE_SIZE)
        pool = hr.indexer_host_pool(device, hr.host_pool(device, layout))
    hr.fill_random(pool, seed)
    return pool


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
@pytest.mark.parametrize("pool_name", ["indexer", "draft_indexer"])
def test_indexer_spec_is_rows_of_sglangs_page_stride_and_pages_are_its_flat_pages(layout, pool_name):
    pool = make_indexer(layout, seed=5)
    spec = host_pool_spec(pool, pool_name)
    assert (spec.attention, spec.rows, spec.layers, spec.page_size, spec.dtype, spec.layout.value) == (
        None, (pool.indexer_page_stride_size,), pool.layer_num, pool.page_size, "uint8", layout)
    assert spec.role is (PoolKind.KV if pool_name == "indexer" else PoolKind.DRAFT)
    view = HostPool.wrap_arrays(spec, host_pool_arrays(pool, spec))
    ps = pool.page_size
    for slot in (0, ps, 2 * ps):
        assert view.page_bytes(slot) == hr.page_bytes(pool, slot)
        assert b"".join(bytes(b.view()) for b in view.page_buffers(slot)) == hr.page_bytes(pool, slot)
    if layout != "layer_first":  # SGLang has zero-copy metadata for page_first* only
        slots = [0, 2 * ps]
        ptrs, sizes = pool.get_page_buffer_meta(torch.cat([torch.arange(s, s + ps) for s in slots]))
        assert view.page_buffer_meta(slots) == (ptrs, sizes)


def test_pools_whose_shape_we_cannot_read_are_refused_by_name():
    with pytest.raises(ConfigError, match="does not know"):
        host_pool_spec(make_pool("mha", "page_first"), "deepseek_v4_c4")
    with pytest.raises(ConfigError, match="'state' pools is not supported"):
        host_pool_spec(make_pool("mha", "page_first"), "mamba")
    indexer = make_indexer("page_first")
    indexer.index_k_with_scale_buffer = None
    with pytest.raises(ConfigError, match="index_k_with_scale_buffer"):
        host_pool_spec(indexer, "indexer")
