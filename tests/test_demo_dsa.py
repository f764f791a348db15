"""The DSA pair's models: attention reads only the indexer's top-k cached positions, the indexer
cache decides which, and it survives a row host pool byte for byte."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hicache_draft.capabilities import Attention, Layout
from hicache_draft.demo.models import ModelSpec, TinyLM, dequantize_index_keys, quantize_index_keys
from hicache_draft.demo.paged import (
    DevicePool,
    SeqKV,
    device_to_host,
    forward,
    host_to_device,
    index_to_device,
    index_to_host,
)
from hicache_draft.demo.pairs import PairName, identity, index_pools, make_pair, make_prompt, pair_config
from hicache_draft.demo.spec_decode import SpecEngine
from hicache_draft.pools import HostPool, PoolSpec

CPU = torch.device("cpu")
PS = 16


@pytest.fixture(autouse=True)
def _one_thread():
    """Many tiny forwards: one thread is far faster than a pool contending for 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(role: str, seed: int = 1, **change: int) -> TinyLM:
    spec = getattr(make_pair(PairName.DSA, seed), role)
    return TinyLM(dataclasses.replace(spec, **change), CPU)


def _prefilled(model: TinyLM, prompt: list[int], room: int = 0) -> SeqKV:
    """A sequence with ``prompt`` prefilled, and device pages for ``room`` more tokens."""
    seq = SeqKV(DevicePool(model, -(-(len(prompt) + room) // PS) + 1, PS, seed=0))
    forward(seq, prompt, [model.spec.vocab] + prompt[:-1], 0)
    return seq


def _positions_read(model: TinyLM, prompt: list[int]) -> int:
    """How many earlier positions' cached latents the last token's logits depend on: the prefix
    is cached once, then each position's latent (every layer) is perturbed in turn and the last
    token run again over the cache."""
    seq = _prefilled(model, prompt[:-1])
    last = len(prompt) - 1

    def logits() -> torch.Tensor:
        return forward(seq, [prompt[-1]], [prompt[-2]], last)

    ref = logits()
    read = 0
    for j in range(last):
        slot = int(seq.slots(j + 1)[j])
        saved = seq.pool.c[:, slot].clone()
        seq.pool.c[:, slot] += 0.5
        read += not torch.equal(logits(), ref)
        seq.pool.c[:, slot] = saved
    assert torch.equal(logits(), ref)
    return read


@pytest.mark.parametrize("role", ["target", "draft"])
def test_attention_reads_only_the_top_k_positions(role):
    prompt = make_prompt(240, 60, 2)
    sparse = _model(role)
    k, layers = sparse.spec.index_topk, sparse.spec.layers
    read = _positions_read(sparse, prompt)
    assert 0 < read <= k * layers < len(prompt) // 2
    # The same weights with a top-k larger than the context: dense attention, every position read.
    dense = _model(role, index_topk=10_000)
    assert _positions_read(dense, prompt) == len(prompt) - 1


def _continuation_right(model: TinyLM, seq: SeqKV, prompt: list[int], start: int) -> float:
    """Share of ``prompt[start:]`` predicted right, run over the cached prefix ``prompt[:start]``."""
    logits = forward(seq, prompt[start:], prompt[start - 1 : -1], start)
    got = logits.argmax(dim=-1).tolist()
    return sum(g == t for g, t in zip(got[:-1], prompt[start + 1 :], strict=True)) / (len(got) - 1)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_the_cached_indexer_keys_decide_what_attention_reads(role):
    """The KV of the prefix is intact; only the prefix's indexer cache is wiped (a restart that
    restored the KV but not the indexer). The sparse model then loses the context; a dense model
    with the same weights does not care."""
    prompt = make_prompt(256, 64, 3)
    start = 192
    for topk, expect_lost in ((None, True), (10_000, False)):
        model = _model(role) if topk is None else _model(role, index_topk=topk)
        seq = _prefilled(model, prompt[:start], room=len(prompt) - start)
        intact = _continuation_right(model, _prefilled(model, prompt[:start], len(prompt) - start), prompt, start)
        seq.pool.ik.zero_()
        seq.pool.iscale.zero_()
        wiped = _continuation_right(model, seq, prompt, start)
        assert intact >= (0.9 if role == "target" else 0.6)
        if expect_lost:
            assert wiped <= 0.5 * intact, (intact, wiped)
        else:
            assert wiped == intact


def test_a_draft_with_kv_but_no_indexer_cache_is_rejected():
    """SGLang #28895: the draft's KV came back, its indexer cache did not: acceptance drops."""
    pair = make_pair(PairName.DSA, 4)
    target, draft = TinyLM(pair.target, CPU), TinyLM(pair.draft, CPU)
    prompt = make_prompt(320, 64, 4)
    warm = SpecEngine(target, draft, PS, 360, 4)
    warm.prefill(prompt)
    stale = SpecEngine(target, draft, PS, 360, 4)
    stale.prefill(prompt)
    stale.draft.pool.ik.zero_()  # every cached draft indexer key lost, the draft KV kept
    stale.draft.pool.iscale.zero_()
    w, s = warm.decode(32, 4), stale.decode(32, 4)
    assert w.accept_length >= 2.5
    assert s.accept_length <= 0.5 * w.accept_length
    assert w.tokens[:32] == s.tokens[:32]  # greedy speculative decoding: the output never changes


def test_index_keys_are_stored_as_fp8_with_a_scale_per_token():
    keys = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    fp8, scale = quantize_index_keys(keys)
    assert fp8.dtype == torch.uint8 and fp8.shape == (16, 64) and scale.shape == (16,)
    back = dequantize_index_keys(fp8, scale)
    assert torch.allclose(back, keys, rtol=0.07, atol=1e-6)
    assert torch.equal(quantize_index_keys(back)[0], fp8)  # a stored key re-stores to the same bytes
    spec = make_pair(PairName.DSA, 1).target
    assert spec.index_row_bytes(PS) == PS * (spec.index_dim + 4)  # DeepSeek's 128 + 4, at index_dim


def test_index_rows_are_keys_then_scales():
    model = _model("draft")
    seq = _prefilled(model, make_prompt(64, 16, 1))
    page = seq.table[1]
    rows = seq.pool.index_rows(page)
    s = model.spec
    assert rows.shape == (s.layers, s.index_row_bytes(PS)) and rows.dtype == torch.uint8
    lo = page * PS
    assert torch.equal(rows[0, : PS * s.index_dim], seq.pool.ik[0, lo : lo + PS].reshape(-1))
    assert torch.equal(rows[0, PS * s.index_dim :].view(torch.float32), seq.pool.iscale[0, lo : lo + PS])


def _row_pool(model: TinyLM, name: str, layout: Layout, pages: int) -> HostPool:
    s = model.spec
    spec = PoolSpec(kind=name, attention=None, rows=(s.index_row_bytes(PS),), layers=s.layers, page_size=PS,
                    dtype="uint8", layout=layout)
    return HostPool(spec, pages)


def _kv_pool(model: TinyLM, name: str, pages: int) -> HostPool:
    s = model.spec
    spec = PoolSpec(kind=name, attention=Attention.MLA, layers=s.layers, page_size=PS, dtype=torch.float32,
                    layout=Layout.PAGE_FIRST_DIRECT, latent_dim=s.latent_dim)
    return HostPool(spec, pages)


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
def test_kv_and_indexer_pages_through_host_pools_give_bit_identical_logits(layout):
    pair = make_pair(PairName.DSA, 6)
    target, draft = TinyLM(pair.target, CPU), TinyLM(pair.draft, CPU)
    prompt = make_prompt(120, 40, 6)
    pages = (len(prompt) - 1) // PS
    first = SpecEngine(target, draft, PS, 140, 6)
    t_ref, d_ref = first.prefill(prompt)
    hosts = {"kv": _kv_pool(target, "kv", pages + 2), "draft": _kv_pool(draft, "draft", pages + 2),
             "indexer": _row_pool(target, "indexer", layout, pages + 2),
             "draft_indexer": _row_pool(draft, "draft_indexer", layout, pages + 2)}
    slots = [(pages + 1 - i) * PS for i in range(pages)]  # host slots in another order than device pages
    for i, slot in enumerate(slots):
        device_to_host(first.target, i, hosts["kv"], slot)
        device_to_host(first.draft, i, hosts["draft"], slot)
        index_to_host(first.target, i, hosts["indexer"], slot)
        index_to_host(first.draft, i, hosts["draft_indexer"], slot)
    again = SpecEngine(target, draft, PS, 140, 7)  # another device page order
    for i, slot in enumerate(slots):
        host_to_device(hosts["kv"], slot, again.target, i)
        host_to_device(hosts["draft"], slot, again.draft, i)
        index_to_device(hosts["indexer"], slot, again.target, i)
        index_to_device(hosts["draft_indexer"], slot, again.draft, i)
    t_got, d_got = again.prefill(prompt, cached=pages * PS)
    assert torch.equal(t_got, t_ref) and torch.equal(d_got, d_ref)
    for i in range(pages):
        assert torch.equal(again.target.pool.index_rows(again.target.table[i]),
                           first.target.pool.index_rows(first.target.table[i]))
    # The bytes in the host pool are the device rows (keys then scales), nothing else.
    assert torch.equal(hosts["indexer"].page_view(slots[0]).reshape(target.spec.layers, -1),
                       first.target.pool.index_rows(first.target.table[0]))


def test_sparse_specs_are_checked_and_named():
    base = make_pair(PairName.DSA, 1).target
    with pytest.raises(ValueError, match="index_heads, index_dim and index_topk"):
        dataclasses.replace(base, index_heads=0)
    with pytest.raises(ValueError, match="built on MLA"):
        dataclasses.replace(base, attention=Attention.MHA)
    with pytest.raises(ValueError, match="index_dim must be"):
        dataclasses.replace(base, index_dim=8)
    dense = ModelSpec(name="x", attention=Attention.MLA, layers=1, heads=1, head_dim=8, vocab=16, token_dim=8,
                      pos_dim=0, noise=0.0, seed=0)
    assert not dense.sparse and base.sparse


def test_dsa_config_declares_both_indexer_pools_and_the_controls_drop_one():
    pair = make_pair(PairName.DSA, 2)
    assert identity(pair.target) != identity(make_pair(PairName.MLA, 2).target)
    pools = index_pools(pair, PS)
    assert [p["name"] for p in pools] == ["indexer", "draft_indexer"]
    assert pools[0]["layers"] == pair.target.layers and pools[1]["layers"] == pair.draft.layers
    assert pools[0]["row_bytes"] == [pair.target.index_row_bytes(PS)]
    full = pair_config({"backend": "file"}, pair, PS, draft_offload=True)
    assert [p.name for p in full.pools] == ["indexer", "draft_indexer"]
    no_draft_indexer = pair_config({"backend": "file"}, pair, PS, draft_offload=True, pools=["indexer"])
    assert [p.name for p in no_draft_indexer.pools] == ["indexer"]
    dense = pair_config({"backend": "file", "pools": [{"name": "junk"}]}, make_pair(PairName.MLA, 2), PS, True)
    assert not dense.pools
