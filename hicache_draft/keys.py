"""Page hashes and the key namespace.

A page hash is a chained SHA-256: ``h_i = SHA256(h_{i-1} || tokens_i as uint32 little-endian)``,
with ``h_{-1}`` empty (or a given prior hash). It is the same in every process and on every
machine (no dependence on ``PYTHONHASHSEED``).

A storage key is ``f"{page_hash}.{namespace}"`` where ``namespace`` is a 96-bit fingerprint of
every dimension that changes the page's bytes: key format version, model identity (target or
draft weights), for a draft pool also the target model's identity (the draft's KV is computed
from the target's hidden states, so one draft head over two target revisions holds different
bytes), pool name, dtype, attention type, page size, layer count, head shape, layout,
pipeline rank, and for sharded (MHA) pools the global head group ``tp_rank * split + part`` out
of ``tp_lcm_size`` groups (``tp_size`` when not split), with its head count: that is what lets
``tp_size = 2`` and ``tp_size = 4`` servers with one ``tp_lcm_size`` share pages head for head.
MLA pools are replicated across TP ranks, so their keys are rank-neutral.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hicache_draft import _native
from hicache_draft.capabilities import Attention, Component, Layout, PoolKind

KEY_FORMAT_VERSION = 2
"""2: draft namespaces carry the target model's identity (stores written by version 1 simply miss)."""
_U32 = struct.Struct("<I")


def page_hashes(token_ids: Sequence[int], page_size: int, prior: str | None = None) -> list[str]:
    """Chained SHA-256 hex digests of the full pages of ``token_ids`` (a trailing partial page
    is ignored). ``prior`` continues a chain from an earlier page's hash."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    digest = bytes.fromhex(prior) if prior else b""
    out: list[str] = []
    full = len(token_ids) - len(token_ids) % page_size
    for start in range(0, full, page_size):
        h = hashlib.sha256(digest)
        page = token_ids[start : start + page_size]
        try:
            h.update(struct.pack(f"<{len(page)}I", *page))
        except struct.error:
            bad = next(t for t in page if not (isinstance(t, int) and 0 <= t < 1 << 32))
            raise ValueError(f"token id {bad!r} is not a uint32") from None
        digest = h.digest()
        out.append(digest.hex())
    return out


@dataclass(frozen=True)
class PoolIdentity:
    """Every dimension of one pool (and one head part) that changes its bytes."""

    pool: str
    model: str
    dtype: str
    attention: Attention | None
    page_size: int
    layers: int
    layout: Layout
    pp_rank: int
    pp_size: int
    head_dim: int = 0  # mha
    heads: int = 0  # mha: heads in this key's shard or head group
    latent_dim: int = 0  # mla
    shard: str = ""  # mha: "hg{group}/{groups}", the global head group; mla: "" (replicated)
    target: str = ""  # draft pools: the target model's identity (its hidden states feed the draft)
    component: Component = Component.KV
    rows: tuple[int, ...] = ()  # row pools: bytes of one page in one layer, per array

    def fingerprint(self) -> str:
        """96-bit hex fingerprint of this identity (stable across processes and machines).

        The component and rows enter only when they are not the classic pools' (``kv``, none),
        so the two classic pools keep the keys of key format 2."""
        doc = {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(self).items()}
        if self.component is Component.KV:
            del doc["component"]
        if not self.rows:
            del doc["rows"]
        else:
            doc["rows"] = list(self.rows)
        doc["v"] = KEY_FORMAT_VERSION
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:24]


def pool_identities(
    *,
    pool: str,
    model: str,
    dtype: str,
    attention: Attention | None,
    page_size: int,
    layers: int,
    layout: Layout,
    kv_heads: int | None,
    head_dim: int | None,
    latent_dim: int | None,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    tp_lcm_size: int | None,
    target_model: str | None = None,
    role: PoolKind | None = None,
    component: Component = Component.KV,
    rows: tuple[int, ...] = (),
    sharded: bool | None = None,
) -> list[PoolIdentity]:
    """The identities of one pool on this rank: one per head part (one part unless split).

    ``role`` defaults to the pool's name for the two classic pools (``kv``, ``draft``).
    ``target_model`` is required for draft-role pools: its identity is part of every draft key.
    Row pools (``attention`` None) are rank-neutral unless ``sharded`` (then per TP rank)."""
    role = PoolKind(role if role is not None else (PoolKind.DRAFT if pool == PoolKind.DRAFT else PoolKind.KV))
    if role is PoolKind.DRAFT and not target_model:
        raise ValueError("draft pool identities need target_model: the draft's KV depends on the target's weights")
    common = dict(
        pool=str(pool), model=model, dtype=dtype, attention=attention, page_size=page_size, layers=layers,
        layout=layout, pp_rank=pp_rank, pp_size=pp_size,
        target=str(target_model) if role is PoolKind.DRAFT else "", component=Component(component),
        rows=tuple(rows),
    )
    if attention is None:
        shard = f"r{tp_rank}/{tp_size}" if sharded else ""
        return [PoolIdentity(**common, shard=shard)]
    if attention is Attention.MLA:
        return [PoolIdentity(**common, latent_dim=int(latent_dim or 0))]
    assert kv_heads is not None and head_dim is not None
    lcm = tp_lcm_size or tp_size
    split = lcm // tp_size
    heads = kv_heads // split
    # One format for every MHA shard: the global head group over tp_lcm_size groups. Without
    # split heads this is just the TP rank; with them, tp_size=2 and tp_size=4 name the same groups.
    return [
        PoolIdentity(**common, head_dim=head_dim, heads=heads, shard=f"hg{tp_rank * split + part}/{lcm}")
        for part in range(split)
    ]


def make_key(page_hash: str, namespace: str) -> str:
    """The storage key of one page of one pool part."""
    return f"{page_hash}.{namespace}"


def hex_names_ok(names: Sequence[object], left_max: int, right_max: int = 0) -> bool:
    """Whether every one of ``names`` is a str of 1 to ``left_max`` lowercase hex digits (page
    groups) or, with ``right_max``, two such runs joined by one dot, the second of 1 to
    ``right_max`` digits (storage keys ``<page hash>.<namespace>``); ``False`` for an empty
    sequence. One pass in compiled code, for backends that check every key of a call: about
    0.05 us a key, where a compiled regex over the joined keys took about 0.4 us."""
    if left_max < 1 or right_max < 0:
        raise ValueError(f"hex_names_ok: left_max must be >= 1 and right_max >= 0, got {left_max}, {right_max}")
    return _native.hex_names(names, left_max, right_max)
