"""The demo models copy from context, deterministically, and refuse impossible shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft.capabilities import Attention
from hicache_draft.demo.models import ModelSpec, TinyLM
from hicache_draft.demo.paged import DevicePool, SeqKV, forward
from hicache_draft.demo.pairs import make_pair, make_prompt

CPU = torch.device("cpu")


def _greedy_next(model: TinyLM, prompt: list[int]) -> list[int]:
    seq = SeqKV(DevicePool(model, -(-len(prompt) // 16) + 1, 16, seed=0))
    prev = [model.spec.vocab] + prompt[:-1]
    return forward(seq, prompt, prev, 0).argmax(dim=-1).tolist()


@settings(max_examples=6, deadline=None)
@given(
    attention=st.sampled_from(list(Attention)),
    seed=st.integers(0, 10_000),
    period=st.integers(16, 48),
    role=st.sampled_from(["target", "draft"]),
)
def test_models_predict_the_token_that_followed_the_last_occurrence(attention, seed, period, role):
    pair = make_pair(attention, seed)
    model = TinyLM(getattr(pair, role), CPU)
    prompt = make_prompt(4 * period, period, seed)
    predicted = _greedy_next(model, prompt)
    # From the second period on, the next token is determined by the context (the very first
    # token has no previous token, so the seam at position `period` is left out).
    positions = range(period + 1, len(prompt) - 1)
    right = sum(predicted[i] == prompt[i + 1] for i in positions)
    # The draft is the noisier copy of the mechanism: right most of the time, not always.
    assert right / len(positions) >= (0.95 if role == "target" else 0.6)


def test_models_need_the_context():
    """Without the repeated context, predictions are not the sequence's continuation."""
    pair = make_pair(Attention.MHA, 3)
    model = TinyLM(pair.target, CPU)
    prompt = make_prompt(128, 64, 3)
    shuffled = prompt[:64] + prompt[64:][::-1]
    predicted = _greedy_next(model, shuffled)
    right = sum(predicted[i] == prompt[i + 1] for i in range(64, 127))
    assert right <= 6


def test_models_are_rebuilt_bit_for_bit_from_the_seed():
    spec = make_pair(Attention.MLA, 5).target
    a, b = TinyLM(spec, CPU), TinyLM(spec, CPU)
    other = TinyLM(dataclasses.replace(spec, seed=spec.seed + 1), CPU)
    for la, lb, lo in zip(a.layers, b.layers, other.layers, strict=True):
        for name, value in vars(la).items():
            if value is None:
                continue
            assert torch.equal(value, getattr(lb, name))
            assert not torch.equal(value, getattr(lo, name))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": 0}, "must be positive"),
        ({"head_dim": 16}, "head_dim must be >= token_dim"),
        ({"pos_dim": 63, "head_dim": 64}, "pos_dim must be even"),
        ({"pos_dim": 0, "layers": 2}, "has one layer"),
    ],
)
def test_bad_model_specs_are_refused_by_name(change, message):
    base = make_pair(Attention.MHA, 1).target
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **change)


def test_mla_latent_holds_key_and_value_inputs():
    pair = make_pair(Attention.MLA, 1)
    t, d = pair.target, pair.draft
    assert t.latent_dim == max(t.pos_dim, t.token_dim) + t.token_dim
    assert d.latent_dim == 2 * d.token_dim
    spec = ModelSpec(name="x", attention=Attention.MLA, layers=1, heads=1, head_dim=8, vocab=16, token_dim=8,
                     pos_dim=0, noise=0.0, seed=0)
    assert spec.d_model == 24
