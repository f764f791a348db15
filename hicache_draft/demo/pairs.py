"""The model pairs of the demo, their prompts, and the config each pair runs with."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from hicache_draft.capabilities import Attention
from hicache_draft.config import Config, load_config
from hicache_draft.demo.models import ModelSpec

VOCAB = 256


class PairName(StrEnum):
    """The demo's pairs. ``mha`` and ``mla`` are also the :class:`Attention` values, so
    ``PairName(Attention.MLA)`` is the MLA pair."""

    MHA = "mha"
    MLA = "mla"
    DSA = "dsa"


INDEXER_POOLS = ("indexer", "draft_indexer")
"""The DSA pair's extra pools (SGLang's names): the target's and the draft's indexer caches."""


@dataclass(frozen=True)
class Pair:
    """A target and its draft."""

    name: PairName
    target: ModelSpec
    draft: ModelSpec

    @property
    def attention(self) -> Attention:
        return self.target.attention

    @property
    def sparse(self) -> bool:
        """DSA: both models read only the top-k positions their indexers pick."""
        return self.target.sparse

    @property
    def label(self) -> str:
        return {
            PairName.MHA: "MHA target + EAGLE-like MHA draft",
            PairName.MLA: "MLA target + MTP-like MLA draft",
            PairName.DSA: "DSA target (MLA, top-k by indexer) + MTP-like draft with its own indexer",
        }[self.name]


def make_pair(name: PairName | str, seed: int) -> Pair:
    """The pair called ``name`` (an :class:`Attention` names the dense pairs), built from ``seed``."""
    name = PairName(name)
    base = 1000 * seed + {PairName.MHA: 0, PairName.MLA: 500, PairName.DSA: 700}[name]
    if name is PairName.MHA:
        target = ModelSpec(
            name="demo-mha-target", attention=Attention.MHA, layers=3, heads=2, head_dim=64, vocab=VOCAB,
            token_dim=64, pos_dim=64, noise=0.05, seed=base + 1,
        )
        draft = ModelSpec(
            name="demo-mha-draft", attention=Attention.MHA, layers=1, heads=2, head_dim=32, vocab=VOCAB,
            token_dim=32, pos_dim=0, noise=0.7, seed=base + 2, score_scale=9.0,
        )
    elif name is PairName.MLA:
        target = ModelSpec(
            name="demo-mla-target", attention=Attention.MLA, layers=3, heads=4, head_dim=64, vocab=VOCAB,
            token_dim=64, pos_dim=64, noise=0.05, seed=base + 1,
        )
        draft = ModelSpec(
            name="demo-mla-draft", attention=Attention.MLA, layers=1, heads=2, head_dim=32, vocab=VOCAB,
            token_dim=32, pos_dim=0, noise=0.55, seed=base + 2, score_scale=9.0,
        )
    else:  # DSA: the MLA pair's shapes, each layer's attention restricted to its indexer's top 32
        target = ModelSpec(
            name="demo-dsa-target", attention=Attention.MLA, layers=3, heads=4, head_dim=64, vocab=VOCAB,
            token_dim=64, pos_dim=64, noise=0.05, seed=base + 1, index_heads=2, index_dim=64, index_topk=32,
        )
        draft = ModelSpec(
            name="demo-dsa-draft", attention=Attention.MLA, layers=1, heads=2, head_dim=32, vocab=VOCAB,
            token_dim=32, pos_dim=0, noise=0.55, seed=base + 2, score_scale=9.0, index_heads=2, index_dim=32,
            index_topk=32,
        )
    return Pair(name, target, draft)


def identity(spec: ModelSpec) -> str:
    """The model identity that goes into storage keys: name plus a digest of its construction."""
    doc = {k: (v.value if isinstance(v, Attention) else v) for k, v in asdict(spec).items()}
    if not spec.sparse:  # a dense model's identity is what it was before sparse models existed
        doc = {k: v for k, v in doc.items() if not k.startswith("index_")}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]
    return f"{spec.name}@{digest}"


def make_prompt(length: int, period: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """``length`` tokens repeating one random sequence of ``period`` distinct tokens."""
    if not 2 <= period <= vocab:
        raise ValueError(f"period must be in [2, {vocab}], got {period}")
    if length < 2 * period:
        raise ValueError(f"prompt length {length} must hold at least two periods of {period}")
    g = torch.Generator().manual_seed(seed)
    motif = torch.randperm(vocab, generator=g)[:period].tolist()
    return [motif[i % period] for i in range(length)]


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _shape(spec: ModelSpec) -> dict[str, Any]:
    shape: dict[str, Any] = {"attention": spec.attention.value, "layers": spec.layers}
    if spec.attention is Attention.MHA:
        shape.update(kv_heads=spec.heads, head_dim=spec.head_dim, latent_dim=None)
    else:
        shape.update(latent_dim=spec.latent_dim, kv_heads=None, head_dim=None)
    return shape


def index_pools(pair: Pair, page_size: int, names: Sequence[str] = INDEXER_POOLS) -> list[dict[str, Any]]:
    """The config's ``[[pools]]`` entries for a sparse pair's indexer caches called ``names``: row
    pools of one row per page and layer (:meth:`ModelSpec.index_row_bytes`)."""
    models = {"indexer": pair.target, "draft_indexer": pair.draft}
    return [
        {"name": n, "layers": models[n].layers, "row_bytes": [models[n].index_row_bytes(page_size)]} for n in names
    ]


def pair_config(
    base: dict[str, Any], pair: Pair, page_size: int, draft_offload: bool,
    pools: Sequence[str] | None = None,
) -> Config:
    """The config one run of ``pair`` uses: the user's (backend, options, timeouts, layouts,
    parallel place) with the pair's model identities and pool shapes laid over it.

    A sparse pair also declares its indexer pools (``pools``: which of :data:`INDEXER_POOLS`,
    default both); a dense pair declares none. A ``page_head`` layout asked for an MLA pool becomes
    ``page_first_direct``. The KV dtype is float32, the dtype the demo models compute in, so
    restored KV is exactly the computed KV.
    """
    user_target = base.get("target") if isinstance(base.get("target"), dict) else {}
    user_draft = base.get("draft") if isinstance(base.get("draft"), dict) else {}
    target = _shape(pair.target)
    draft = {**_shape(pair.draft), "enabled": draft_offload, "kv_dtype": None, "on_miss": "shorten"}
    for shape, user in ((target, user_target), (draft, user_draft)):
        if "layout" in user:
            shape["layout"] = user["layout"]
        if shape["attention"] == Attention.MLA.value and shape.get("layout") == "page_head":
            shape["layout"] = "page_first_direct"  # page_head is MHA-only; the MLA pair uses its nearest
    over = {
        "namespace": {
            "model": identity(pair.target),
            "draft_model": identity(pair.draft),
            "kv_dtype": "float32",
            "page_size": page_size,
        },
        "target": target,
        "draft": draft,
    }
    if pair.sparse:
        over["pools"] = index_pools(pair, page_size, INDEXER_POOLS if pools is None else pools)
    merged = _deep_merge({k: v for k, v in base.items() if k not in ("target", "draft", "pools")}, over)
    return load_config(data=merged, environ={})
