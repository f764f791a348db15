"""Speculative decoding is exact, its accept length means what it says, and KV survives the host pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft.capabilities import Attention, Layout, PoolKind
from hicache_draft.demo.models import TinyLM
from hicache_draft.demo.paged import DevicePool, SeqKV, device_to_host, forward, host_to_device
from hicache_draft.demo.pairs import make_pair, make_prompt
from hicache_draft.demo.spec_decode import SpecEngine
from hicache_draft.pools import HostPool, PoolSpec

CPU = torch.device("cpu")
PS = 16


def _models(attention: Attention, seed: int) -> tuple[TinyLM, TinyLM]:
    pair = make_pair(attention, seed)
    return TinyLM(pair.target, CPU), TinyLM(pair.draft, CPU)


def _plain_greedy(target: TinyLM, prompt: list[int], n: int) -> list[int]:
    seq = SeqKV(DevicePool(target, -(-(len(prompt) + n) // PS) + 1, PS, seed=3))
    tokens = list(prompt)
    logits = forward(seq, tokens, [target.spec.vocab] + tokens[:-1], 0)
    out = []
    for _ in range(n):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        tokens.append(nxt)
        logits = forward(seq, [nxt], [tokens[-2]], len(tokens) - 1)
    return out


@settings(max_examples=6, deadline=None)
@given(attention=st.sampled_from(list(Attention)), seed=st.integers(0, 500), k=st.integers(1, 5),
       n=st.integers(2, 24), cold=st.booleans())
def test_speculative_decoding_emits_exactly_the_targets_greedy_tokens(attention, seed, k, n, cold):
    target, draft = _models(attention, seed)
    prompt = make_prompt(96, 32, seed)
    engine = SpecEngine(target, draft, PS, 96 + n + k + 2, seed)
    engine.prefill(prompt, draft_cached=64 if cold else 0)
    stats = engine.decode(n, k)
    assert stats.tokens[:n] == _plain_greedy(target, prompt, n)
    assert 1.0 <= stats.accept_length <= k + 1
    assert stats.emitted == len(stats.tokens) - 1  # every token but the prefill's came from a verify step


@pytest.mark.parametrize("attention", list(Attention))
def test_a_draft_without_its_prompt_kv_is_rejected_far_more_often(attention):
    target, draft = _models(attention, 7)
    prompt = make_prompt(256, 64, 7)
    warm = SpecEngine(target, draft, PS, 300, 7)
    warm.prefill(prompt)
    cold = SpecEngine(target, draft, PS, 300, 7)
    cold.prefill(prompt, draft_cached=240)  # the draft's KV for 15 pages was never computed
    w, c = warm.decode(32, 4), cold.decode(32, 4)
    assert w.accept_length >= 2.5
    assert c.accept_length <= 0.5 * w.accept_length
    assert w.tokens[:32] == c.tokens[:32]


def test_prefill_refuses_a_partial_page_prefix_and_decode_needs_a_prefill():
    target, draft = _models(Attention.MHA, 1)
    engine = SpecEngine(target, draft, PS, 200, 1)
    with pytest.raises(RuntimeError, match="prefill first"):
        engine.decode(4, 2)
    with pytest.raises(ValueError, match="not a whole number of pages"):
        engine.prefill(make_prompt(128, 32, 1), cached=5)


def _host_pool(model: TinyLM, kind: PoolKind, layout: Layout, pages: int) -> HostPool:
    s = model.spec
    spec = PoolSpec(kind=kind, attention=s.attention, layers=s.layers, page_size=PS, dtype=torch.float32,
                    layout=layout, kv_heads=s.heads if s.attention is Attention.MHA else 0,
                    head_dim=s.head_dim if s.attention is Attention.MHA else 0,
                    latent_dim=s.latent_dim if s.attention is Attention.MLA else 0)
    return HostPool(spec, pages)


@settings(max_examples=8, deadline=None)
@given(attention=st.sampled_from(list(Attention)), layout=st.sampled_from(list(Layout)), seed=st.integers(0, 99))
def test_pages_through_the_host_pool_give_bit_identical_logits(attention, layout, seed):
    if attention is Attention.MLA and layout is Layout.PAGE_HEAD:
        layout = Layout.PAGE_FIRST_DIRECT
    target, draft = _models(attention, seed)
    prompt = make_prompt(100, 40, seed)
    pages = (len(prompt) - 1) // PS
    first = SpecEngine(target, draft, PS, 120, seed)
    t_ref, d_ref = first.prefill(prompt)
    hosts = {PoolKind.KV: _host_pool(target, PoolKind.KV, layout, pages + 2),
             PoolKind.DRAFT: _host_pool(draft, PoolKind.DRAFT, layout, pages + 2)}
    # Host slots in another order than the device pages, as a real host pool would give them.
    slots = [(pages + 1 - i) * PS for i in range(pages)]
    for i, slot in enumerate(slots):
        device_to_host(first.target, i, hosts[PoolKind.KV], slot)
        device_to_host(first.draft, i, hosts[PoolKind.DRAFT], slot)
    again = SpecEngine(target, draft, PS, 120, seed + 1)  # other device page order
    for i, slot in enumerate(slots):
        host_to_device(hosts[PoolKind.KV], slot, again.target, i)
        host_to_device(hosts[PoolKind.DRAFT], slot, again.draft, i)
    t_got, d_got = again.prefill(prompt, cached=pages * PS)
    assert torch.equal(t_got, t_ref)
    assert torch.equal(d_got, d_ref)
    for i in range(pages):
        assert torch.equal(again.target.pool.page_canonical(again.target.table[i]),
                           first.target.pool.page_canonical(first.target.table[i]))
