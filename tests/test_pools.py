"""Host pools: shapes, zero-copy buffers, copies, and agreement between the two paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import Attention, HostPool, Layout, PoolKind, PoolSpec

LAYOUTS = [(a, lay) for a in Attention for lay in Layout if not (a is Attention.MLA and lay is Layout.PAGE_HEAD)]


def _pool(att, lay, layers=3, heads=4, ps=4, pages=6, dtype=torch.bfloat16):
    spec = PoolSpec(kind=PoolKind.KV, attention=att, layers=layers, page_size=ps, dtype=dtype, layout=lay,
                    kv_heads=heads, head_dim=8, latent_dim=20)
    p = HostPool(spec, pages)
    p.raw.copy_(torch.randint(0, 256, p.raw.shape, dtype=torch.uint8))
    return p


@pytest.mark.parametrize(("att", "lay"), LAYOUTS)
def test_buffers_concatenate_to_the_generic_copy(att, lay):
    p = _pool(att, lay)
    for slot in (0, 8, 20):
        bufs = p.page_buffers(slot)
        assert len(bufs) == p.spec.buffers_per_page()
        assert sum(b.nbytes for b in bufs) == p.spec.page_nbytes
        assert b"".join(bytes(b.view()) for b in bufs) == p.page_bytes(slot)
        for b in bufs:  # every region lies inside the pool's memory
            assert p.raw.data_ptr() <= b.ptr and b.ptr + b.nbytes <= p.raw.data_ptr() + p.raw.numel()


@pytest.mark.parametrize(("att", "lay"), LAYOUTS)
def test_copy_in_restores_exactly_one_page(att, lay):
    src, dst = _pool(att, lay), _pool(att, lay)
    before = dst.raw.clone()
    out = torch.empty(src.part_nbytes(), dtype=torch.uint8)
    src.copy_page_out(8, out)
    dst.copy_page_in(12, out)
    assert dst.page_bytes(12) == src.page_bytes(8)
    changed = (dst.raw != before).nonzero().flatten()
    region = {b.ptr - dst.raw.data_ptr() + i for b in dst.page_buffers(12) for i in range(b.nbytes)}
    assert set(changed.tolist()) <= region


def test_buffer_counts_match_sglang_rules():
    assert len(_pool(Attention.MHA, Layout.LAYER_FIRST).page_buffers(0)) == 2 * 3
    assert len(_pool(Attention.MHA, Layout.PAGE_FIRST).page_buffers(0)) == 2
    assert len(_pool(Attention.MLA, Layout.LAYER_FIRST).page_buffers(0)) == 3
    assert len(_pool(Attention.MLA, Layout.PAGE_FIRST_DIRECT).page_buffers(0)) == 1
    p = _pool(Attention.MHA, Layout.PAGE_FIRST)
    ptrs, sizes = p.page_buffer_meta([0, 4])
    k_page = 3 * 4 * 8 * 2 * 4  # layers * heads * dim * itemsize * page_size
    assert sizes == [k_page] * 4
    assert ptrs[2] - ptrs[0] == 4 * 3 * 4 * 8 * 2  # next page starts page_size slots later
    assert ptrs[1] - ptrs[0] == p.slots * 3 * 4 * 8 * 2  # V half follows all K slots


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(0, 5))
def test_page_head_parts_are_contiguous_head_groups(split, page):
    p = _pool(Attention.MHA, Layout.PAGE_HEAD)
    slot = page * 4
    parts = [b"".join(bytes(b.view()) for b in p.page_buffers(slot, k, split)) for k in range(split)]
    assert all(len(x) == p.part_nbytes(split) for x in parts)
    for k in range(split):
        out = torch.empty(p.part_nbytes(split), dtype=torch.uint8)
        p.copy_page_out(slot, out, k, split)
        assert bytes(out.tolist()) == parts[k]
    view = p.page_view(slot)  # (2, H, ps, L, D): head group k is heads [k*h, (k+1)*h)
    h = 4 // split
    for k in range(split):
        assert torch.equal(p.part_view(slot, k, split).view(torch.int16), view[:, k * h:(k + 1) * h].view(torch.int16))


def test_non_page_head_layouts_have_no_contiguous_parts():
    p = _pool(Attention.MHA, Layout.PAGE_FIRST)
    with pytest.raises(ValueError, match="no contiguous head parts"):
        p.page_buffers(0, 1, 2)
    out = torch.empty(p.part_nbytes(2), dtype=torch.uint8)
    p.copy_page_out(0, out, 1, 2)  # the generic path still works


def test_unaligned_or_out_of_range_slot_is_rejected():
    p = _pool(Attention.MLA, Layout.PAGE_FIRST)
    with pytest.raises(ValueError, match="not the first slot of a page"):
        p.page_view(3)
    with pytest.raises(ValueError, match="not the first slot of a page"):
        p.page_view(p.slots)


def test_wrap_and_allocator():
    spec = PoolSpec(kind=PoolKind.DRAFT, attention=Attention.MLA, layers=2, page_size=4, dtype=torch.float16,
                    layout=Layout.PAGE_FIRST_DIRECT, latent_dim=8)
    t = torch.randn(3, 2, 4, 1, 8).to(torch.float16)
    p = HostPool.wrap(spec, t)
    assert p.num_pages == 3 and p.page_view(4).data_ptr() == t[1].data_ptr()
    mem = torch.zeros(10_000, dtype=torch.uint8)
    q = HostPool(spec, 3, allocator=lambda n: mem)
    assert q.raw.data_ptr() == mem.data_ptr()
    with pytest.raises(ValueError, match="unusable"):
        HostPool(spec, 3, allocator=lambda n: torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="MHA-only"):
        PoolSpec(kind=PoolKind.KV, attention=Attention.MLA, layers=1, page_size=4, dtype=torch.float16,
                 layout=Layout.PAGE_HEAD, latent_dim=8)


def test_not_pinned_without_cuda():
    p = _pool(Attention.MHA, Layout.PAGE_FIRST)
    assert p.raw.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize(("att", "lay"), LAYOUTS)
def test_regions_copy_between_pools_of_one_geometry(att, lay):
    src = _pool(att, lay)
    dst = HostPool.wrap(src.spec, torch.zeros_like(src.buffer))
    for host, other in zip(src.page_regions(8), dst.page_regions(8), strict=True):
        assert host.is_contiguous() and other.is_contiguous()
        other.copy_(host)
    assert dst.page_bytes(8) == src.page_bytes(8)
    assert dst.page_bytes(0) == bytes(src.spec.page_nbytes)


def test_device_pools_have_geometry_but_no_buffers():
    spec = PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=2, page_size=4, dtype=torch.float16,
                    layout=Layout.PAGE_FIRST_DIRECT, kv_heads=2, head_dim=8)
    dev = HostPool.wrap(spec, torch.empty(2, 3, 2, 4, 2, 8, dtype=torch.float16, device="meta"))
    assert [tuple(r.shape) for r in dev.page_regions(4)] == [(2, 4, 2, 8), (2, 4, 2, 8)]
    with pytest.raises(ValueError, match="host"):
        dev.page_buffers(4)


@settings(max_examples=60, deadline=None)
@given(
    pages=st.integers(0, 40), ps=st.integers(1, 9), dtype=st.sampled_from([torch.int64, torch.int32, torch.int16]),
    shape=st.sampled_from(["flat", "2d", "strided", "list"]), data=st.data(),
)
def test_first_slots_is_every_page_size_th_index(pages, ps, dtype, shape, data):
    """Each page's first slot, whatever SGLang hands: a flat or 2-D index tensor read from its
    memory, a non-contiguous one or one of another type sliced, or a list."""
    from hicache_draft.pools import first_slots

    values = data.draw(st.lists(st.integers(-(2**15), 2**15 - 1), min_size=pages * ps, max_size=pages * ps))
    want = values[::ps]
    flat = torch.tensor(values, dtype=dtype)
    if shape == "flat":
        got = first_slots(flat, ps)
    elif shape == "2d":
        got = first_slots(flat.reshape(pages, ps) if pages else flat.reshape(0, ps), ps)
    elif shape == "strided":  # every other element of a twice-as-long tensor: not contiguous
        wide = torch.zeros(2 * len(values), dtype=dtype)
        wide[::2] = flat
        assert not wide[::2].is_contiguous() or len(values) < 2  # torch calls 0 or 1 element contiguous
        got = first_slots(wide[::2], ps)
    else:
        got = first_slots(values, ps)
    assert got == want
    assert all(type(s) is int for s in got)
    handed = values if shape == "list" else flat
    assert first_slots(handed, ps, pages=pages) == want  # the count the caller expects
    for wrong in (pages + 1, pages - 1) if pages else (1,):
        with pytest.raises(ValueError, match=f"^{len(values)} host indices for {wrong} pages of {ps} tokens$"):
            first_slots(handed, ps, pages=wrong)


def test_strided_ints_refuses_bad_arguments():
    from hicache_draft import _native

    t = torch.arange(8, dtype=torch.int64)
    assert _native.strided_ints(t.data_ptr(), 8, 3, 8) == [0, 3, 6]
    assert _native.strided_ints(t.data_ptr(), 0, 3, 8) == []
    for args in ((t.data_ptr(), 8, 0, 8), (t.data_ptr(), 8, 1, 2), (t.data_ptr(), -1, 1, 8), (0, 4, 1, 8)):
        with pytest.raises(ValueError, match="strided_ints: bad arguments"):
            _native.strided_ints(*args)
    # with a limit: None unless every value starts a page (a multiple of step in [0, limit))
    assert _native.strided_ints(t.data_ptr(), 8, 2, 8, 8) == [0, 2, 4, 6]
    assert _native.strided_ints(t.data_ptr(), 8, 2, 8, 6) is None
    odd, negative = t + 1, t - 2  # held: the call reads their memory
    assert _native.strided_ints(odd.data_ptr(), 8, 2, 8, 100) is None
    assert _native.strided_ints(negative.data_ptr(), 8, 2, 8, 100) is None
