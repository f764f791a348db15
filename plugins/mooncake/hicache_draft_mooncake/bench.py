"""Benchmark: the plugin against a straightforward client, on one store, same pages, same run.

Baseline: direct ``batch_put_from`` / ``batch_get_into`` calls with one object per buffer (an MHA
page_first page is two buffers, K and V: two objects per page), from a plain TCP client.
Plugin: ``page_set`` / ``page_get`` through :class:`~hicache_draft.Store` (one object per page,
header included, existence check before the put, header and checksum verified on the get), in
TCP mode and, with a local holder, in shared-memory mode (host pool from the shared pool).
Existence: ``page_exists`` (one key per page) against ``batch_is_exist`` over the baseline's keys.

Fresh keys every round; keys are force-removed outside the timed region. Results are medians
over rounds; ratios compare numbers measured in the same run.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from hicache_draft import Attention, Layout, Page, PageTransfer, PoolKind, PoolRegistration, Store, make_key
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft_mooncake.client import connect
from hicache_draft_mooncake.options import MooncakeOptions
from hicache_draft_mooncake.service import MooncakeService

# MHA page_first, bfloat16, 4 layers x 8 heads x 64 dims: 8 KiB per token.
_TOKEN_NBYTES = 2 * 4 * 8 * 64 * 2


@dataclass
class Row:
    mode: str
    page_nbytes: int
    pages: int
    base_set: float
    base_get: float
    plug_set: float
    plug_get: float
    base_exist_us: float
    plug_exist_us: float

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "page_bytes": self.page_nbytes, "pages": self.pages,
            "baseline_set_gbps": round(self.base_set, 3), "baseline_get_gbps": round(self.base_get, 3),
            "plugin_set_gbps": round(self.plug_set, 3), "plugin_get_gbps": round(self.plug_get, 3),
            "set_ratio": round(self.plug_set / self.base_set, 2), "get_ratio": round(self.plug_get / self.base_get, 2),
            "baseline_exist_us_per_page": round(self.base_exist_us, 2),
            "plugin_exist_us_per_page": round(self.plug_exist_us, 2),
        }


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_case(svc: MooncakeService, mode: str, page_nbytes: int, pages: int, rounds: int) -> Row:
    """One (mode, page size) row; raises AssertionError if any call fails."""
    page_size = max(1, page_nbytes // _TOKEN_NBYTES)
    spec = PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=4, page_size=page_size,
                    dtype=torch.bfloat16, layout=Layout.PAGE_FIRST, kv_heads=8, head_dim=64)
    opts = svc.backend_options(shm=mode == "shm")
    if mode == "shm":
        opts["shm_pool_size"] = 3 * pages * spec.page_nbytes + (64 << 20)
    store = Store.open("mooncake", opts)
    base = connect(MooncakeOptions.model_validate(svc.backend_options()))
    try:
        alloc = store.backend.host_allocator()
        src = HostPool(spec, pages, allocator=alloc)
        dst = HostPool(spec, pages, allocator=alloc)
        src.raw.copy_(torch.randint(0, 256, src.raw.shape, dtype=torch.uint8))
        ns = "b" * 24
        for pool in (src, dst):
            store.register_pool(PoolRegistration(
                pool=PoolKind.KV, attention=Attention.MHA, layout=Layout.PAGE_FIRST, namespace=ns,
                page_nbytes=spec.page_nbytes, buffers_per_page=2, regions=pool.regions(),
            ))
        src_ptrs, sizes = src.page_buffer_meta([i * page_size for i in range(pages)])
        dst_ptrs, _ = dst.page_buffer_meta([i * page_size for i in range(pages)])
        for region in (*src.regions(), *dst.regions()):
            base.register_buffer(region.ptr, region.nbytes)
        results: dict[str, list[float]] = {k: [] for k in ("bs", "bg", "ps", "pg", "be", "pe")}
        total = pages * spec.page_nbytes
        for _ in range(rounds):
            groups = [secrets.token_hex(32) for _ in range(pages)]
            bkeys = [f"base-{g}-{part}" for g in groups for part in ("k", "v")]
            t, rc = _timed(partial(base.batch_put_from, bkeys, src_ptrs, sizes))
            assert all(r == 0 for r in rc), rc  # type: ignore[union-attr]
            results["bs"].append(total / t)
            t, rc = _timed(partial(base.batch_get_into, bkeys, dst_ptrs, sizes))
            assert all(r >= 0 for r in rc), rc  # type: ignore[union-attr]
            results["bg"].append(total / t)
            t, rc = _timed(partial(base.batch_is_exist, bkeys))
            results["be"].append(t / pages)

            wpages = [Page(make_key(g, ns), g, ns, src.page_buffers(i * page_size)) for i, g in enumerate(groups)]
            rpages = [Page(make_key(g, ns), g, ns, dst.page_buffers(i * page_size)) for i, g in enumerate(groups)]
            t, res = _timed(partial(store.page_set, [PageTransfer(PoolKind.KV, wpages, True)]))
            assert all(r == 0 for r in res[PoolKind.KV]), res  # type: ignore[index]
            results["ps"].append(total / t)
            t, res = _timed(partial(store.page_get, [PageTransfer(PoolKind.KV, rpages, True)]))
            assert all(r == 0 for r in res[0][PoolKind.KV]), res  # type: ignore[index]
            results["pg"].append(total / t)
            t, n = _timed(partial(store.page_exists, {PoolKind.KV: [p.key for p in wpages]}))
            assert n == {PoolKind.KV: pages}, n
            results["pe"].append(t / pages)
            base.batch_remove(bkeys, True)
            base.batch_remove([store.backend.key(p) for p in wpages], True)
        med = {k: statistics.median(v) for k, v in results.items()}
        return Row(mode, spec.page_nbytes, pages, med["bs"] / 1e9, med["bg"] / 1e9, med["ps"] / 1e9,
                   med["pg"] / 1e9, med["be"] * 1e6, med["pe"] * 1e6)
    finally:
        store.close()
        base.close()


def run(modes: list[str], page_sizes: list[int], pages: int, rounds: int,
        echo: Callable[[str], None] = print) -> list[Row]:
    """Start a store, run every (mode, page size) row, stop the store."""
    segment = max(1 << 30, 8 * pages * max(page_sizes))
    rows: list[Row] = []
    with MooncakeService.start(segment_size=segment) as svc:
        for mode in modes:
            for size in page_sizes:
                row = run_case(svc, mode, size, pages, rounds)
                echo(format_row(row))
                rows.append(row)
    return rows


HEADER = (f"{'mode':<5} {'page':>8} {'batch':>5} | {'base set':>8} {'base get':>8} | {'plug set':>8} "
          f"{'plug get':>8} | {'set x':>5} {'get x':>5} | {'exist us/page base':>18} {'plugin':>7}")


def format_row(r: Row) -> str:
    page = f"{r.page_nbytes >> 10} KiB"
    return (f"{r.mode:<5} {page:>8} {r.pages:>5} | {r.base_set:>8.2f} {r.base_get:>8.2f} | {r.plug_set:>8.2f} "
            f"{r.plug_get:>8.2f} | {r.plug_set / r.base_set:>5.2f} {r.plug_get / r.base_get:>5.2f} | "
            f"{r.base_exist_us:>18.2f} {r.plug_exist_us:>7.2f}")
