"""The device KV pool (L1) of one demo model, paged attention over it, and L1 <-> L2 page copies.

A device pool is a tensor indexed by slot: MHA ``k``/``v`` of shape ``(layers, slots, heads,
head_dim)``, MLA ``c`` of shape ``(layers, slots, latent_dim)``. A sequence owns device pages in
any order (its page table); token ``i`` lives at slot ``table[i // ps] * ps + i % ps``.

A sparse (DSA) model's pool also holds its **indexer cache**: fp8 key bytes ``ik`` of shape
``(layers, slots, index_dim)`` and float32 scales ``iscale`` ``(layers, slots)``. Its pages go to
and from a row host pool as one row of bytes per page and layer: the page's fp8 keys, then its
scales (:meth:`DevicePool.index_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache_draft.capabilities import Attention, Layout
from hicache_draft.demo.models import LayerWeights, TinyLM, dequantize_index_keys, quantize_index_keys
from hicache_draft.pools import HostPool


class DevicePool:
    """The paged device KV pool of one model."""

    def __init__(self, model: TinyLM, num_pages: int, page_size: int, seed: int) -> None:
        s = model.spec
        self.model = model
        self.page_size = page_size
        self.num_pages = num_pages
        slots = num_pages * page_size
        dev = model.device
        if s.attention is Attention.MHA:
            self.k = torch.zeros(s.layers, slots, s.heads, s.head_dim, device=dev)
            self.v = torch.zeros(s.layers, slots, s.heads, s.head_dim, device=dev)
        else:
            self.c = torch.zeros(s.layers, slots, s.latent_dim, device=dev)
        if s.sparse:
            self.ik = torch.zeros(s.layers, slots, s.index_dim, dtype=torch.uint8, device=dev)
            self.iscale = torch.zeros(s.layers, slots, device=dev)
        # Hand pages out in a scrambled order, so page tables are not the identity.
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._free = order

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"device pool exhausted: need {n} pages, {len(self._free)} free")
        pages, self._free = self._free[:n], self._free[n:]
        return pages

    def page_canonical(self, page: int) -> torch.Tensor:
        """The device page as MHA ``(2, L, ps, H, D)`` or MLA ``(L, ps, 1, d)`` (a copy for MHA)."""
        lo, hi = page * self.page_size, (page + 1) * self.page_size
        if self.model.spec.attention is Attention.MHA:
            return torch.stack([self.k[:, lo:hi], self.v[:, lo:hi]])
        return self.c[:, lo:hi].unsqueeze(2)

    def set_page(self, page: int, canonical: torch.Tensor) -> None:
        lo, hi = page * self.page_size, (page + 1) * self.page_size
        src = canonical.to(self.model.device)
        if self.model.spec.attention is Attention.MHA:
            self.k[:, lo:hi] = src[0]
            self.v[:, lo:hi] = src[1]
        else:
            self.c[:, lo:hi] = src.squeeze(2)

    def index_rows(self, page: int) -> torch.Tensor:
        """The device page's indexer cache as ``(layers, row_bytes)`` uint8: per layer the page's
        fp8 keys (token by token), then its float32 scales (a copy)."""
        lo, hi = page * self.page_size, (page + 1) * self.page_size
        L = self.model.spec.layers
        keys = self.ik[:, lo:hi].reshape(L, -1)
        scales = self.iscale[:, lo:hi].contiguous().view(torch.uint8)
        return torch.cat([keys, scales], dim=1)

    def set_index_rows(self, page: int, rows: torch.Tensor) -> None:
        lo, hi = page * self.page_size, (page + 1) * self.page_size
        s = self.model.spec
        src = rows.to(self.model.device).reshape(s.layers, s.index_row_bytes(self.page_size))
        split = self.page_size * s.index_dim
        self.ik[:, lo:hi] = src[:, :split].reshape(s.layers, self.page_size, s.index_dim)
        self.iscale[:, lo:hi] = src[:, split:].contiguous().view(torch.float32)


@dataclass
class SeqKV:
    """One request's pages in one device pool (its page table)."""

    pool: DevicePool
    table: list[int] = field(default_factory=list)

    def reserve(self, tokens: int) -> None:
        ps = self.pool.page_size
        need = -(-tokens // ps) - len(self.table)
        if need > 0:
            self.table.extend(self.pool.allocate(need))

    def slots(self, end: int) -> torch.Tensor:
        ps = self.pool.page_size
        pos = torch.arange(end)
        table = torch.tensor(self.table, dtype=torch.long)
        return (table[pos // ps] * ps + pos % ps).to(self.pool.model.device)


@torch.inference_mode()
def forward(seq: SeqKV, tokens: list[int], prev_tokens: list[int], start: int) -> torch.Tensor:
    """Run ``tokens`` (positions ``start``...) through the model over the sequence's KV.

    Writes their KV at their slots (overwriting what was there: rejected drafts), attends
    causally over positions ``0 .. start + i``, and returns the logits ``(len(tokens), vocab)``.
    """
    model = seq.pool.model
    s = model.spec
    T = len(tokens)
    end = start + T
    seq.reserve(end)
    dev = model.device
    slots = seq.slots(end)
    new = slots[start:]
    x = model.embed_inputs(
        torch.tensor(tokens, device=dev),
        torch.tensor(prev_tokens, device=dev),
        torch.arange(start, end, device=dev),
    )
    q_pos = torch.arange(start, end, device=dev)[:, None]
    k_pos = torch.arange(end, device=dev)[None, :]
    masked = k_pos > q_pos  # (T, end)
    pool = seq.pool
    H, D = s.heads, s.head_dim
    for i, w in enumerate(model.layers):
        q = (x @ w.wq).view(T, H, D)
        if s.attention is Attention.MHA:
            assert w.wk is not None and w.wv is not None
            pool.k[i, new] = (x @ w.wk).view(T, H, D)
            pool.v[i, new] = (x @ w.wv).view(T, H, D)
            k, v = pool.k[i, slots], pool.v[i, slots]
        else:
            assert w.w_dkv is not None and w.w_uk is not None and w.w_uv is not None
            pool.c[i, new] = x @ w.w_dkv
            c = pool.c[i, slots]
            k, v = (c @ w.w_uk).view(end, H, D), (c @ w.w_uv).view(end, H, D)
        hidden = _topk_mask(pool, i, w, x, new, slots, masked) if s.sparse else masked
        scores = torch.einsum("thd,shd->hts", q, k).masked_fill(hidden, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        x = x + torch.einsum("hts,shd->thd", attn, v).reshape(T, H * D) @ w.wo
    return x @ model.unembed


def _topk_mask(
    pool: DevicePool, layer: int, w: LayerWeights, x: torch.Tensor, new: torch.Tensor, slots: torch.Tensor,
    masked: torch.Tensor,
) -> torch.Tensor:
    """DSA: cache the new tokens' indexer keys, score every visible cached position with the
    indexer and return the mask ``(T, end)`` that hides all but each query's ``index_topk`` best.

    The scores read the *cached* keys (dequantized from their stored bytes), never keys recomputed
    from the prefix: a restored prefix is only as good as its restored indexer cache."""
    s = pool.model.spec
    assert w.wiq is not None and w.wik is not None and w.iw is not None
    fp8, scale = quantize_index_keys(x @ w.wik)
    pool.ik[layer, new] = fp8
    pool.iscale[layer, new] = scale
    keys = dequantize_index_keys(pool.ik[layer, slots], pool.iscale[layer, slots])  # (end, dI)
    q = (x @ w.wiq).view(x.shape[0], s.index_heads, s.index_dim)
    score = (torch.relu(torch.einsum("thd,sd->ths", q, keys)) * w.iw.view(1, -1, 1)).sum(dim=1)
    score = score.masked_fill(masked, float("-inf"))
    top = score.topk(min(s.index_topk, score.shape[1]), dim=-1).indices
    keep = torch.zeros_like(masked).scatter_(1, top, True)
    return masked | ~keep


# -- L1 <-> L2 ------------------------------------------------------------------------------
def _host_canonical(host: HostPool, slot: int) -> torch.Tensor:
    """The host page at ``slot`` as a view in the device's canonical dim order."""
    view = host.page_view(slot)
    layout = host.spec.layout
    if host.spec.attention is Attention.MHA:
        if layout is Layout.PAGE_FIRST:  # (2, ps, L, H, D)
            return view.permute(0, 2, 1, 3, 4)
        if layout is Layout.PAGE_HEAD:  # (2, H, ps, L, D)
            return view.permute(0, 3, 2, 1, 4)
        return view  # layer_first / page_first_direct: (2, L, ps, H, D)
    if layout is Layout.PAGE_FIRST:  # (ps, L, 1, d)
        return view.permute(1, 0, 2, 3)
    return view  # (L, ps, 1, d)


def device_to_host(seq: SeqKV, page_index: int, host: HostPool, host_slot: int) -> None:
    """Copy page ``page_index`` of the sequence from the device pool into the host pool."""
    _host_canonical(host, host_slot).copy_(seq.pool.page_canonical(seq.table[page_index]).cpu())


def host_to_device(host: HostPool, host_slot: int, seq: SeqKV, page_index: int) -> None:
    """Copy a host page into page ``page_index`` of the sequence's device pages."""
    seq.reserve((page_index + 1) * seq.pool.page_size)
    seq.pool.set_page(seq.table[page_index], _host_canonical(host, host_slot))


def _host_rows(host: HostPool, host_slot: int) -> torch.Tensor:
    """A row host pool's page at ``host_slot`` as a ``(layers, row_bytes)`` view."""
    return host.page_view(host_slot).view(host.spec.layers, -1)


def index_to_host(seq: SeqKV, page_index: int, host: HostPool, host_slot: int) -> None:
    """Copy page ``page_index``'s indexer cache from the device pool into a row host pool."""
    _host_rows(host, host_slot).copy_(seq.pool.index_rows(seq.table[page_index]).cpu())


def index_to_device(host: HostPool, host_slot: int, seq: SeqKV, page_index: int) -> None:
    """Copy a row host pool's page into page ``page_index``'s indexer cache on the device."""
    seq.reserve((page_index + 1) * seq.pool.page_size)
    seq.pool.set_index_rows(seq.table[page_index], _host_rows(host, host_slot))
