"""Benchmark: the plugin against a straightforward client, on one store, same pages, same run.

Baseline (the issue's): direct ``batch_put_from`` / ``batch_get_into`` calls with one object per
buffer (an MHA page_first page is two buffers, K and V: two objects per page), from a plain TCP
client with its own ordinary host memory: the way a straightforward client stores pages. The
same baseline is used for the shared-memory rows, so their ratio is what the shared-memory mode
buys over such a client.

Variants, each through :class:`~hicache_draft.Store` (``page_set`` / ``page_get``: one object
per page, header included, existence check before the put, header and checksum verified on
every get):

* ``tcp`` mode: ``staged`` (one staging buffer per page, one transfer) and ``direct`` (the
  page's own buffers plus a header slot, zero copy); ``auto`` picks one of them by page size.
* ``shm`` mode: host pools from the backend's ``host_memory`` hook (the shared pool), ``direct``.
* ``ceiling``: the native call the plugin's default makes for that mode, with its object layout,
  but no checksum, no copy and no Python work: what the transport allows; the plugin cannot be
  faster than this.

Existence: ``page_exists`` for the target and draft keys of the batch in one call, as the
controller asks it (two keys per page), against ``batch_is_exist`` over the baseline's K and V
keys (two per page); both reported per key. Fresh keys every round; keys are force-removed outside the timed
region; variants are interleaved within each round. Numbers are medians over rounds; ratios
compare medians measured in the same run.
"""

from __future__ import annotations

import ctypes
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    Layout,
    Page,
    PageTransfer,
    PoolKind,
    PoolRegistration,
    Store,
    make_key,
)
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft_mooncake.client import new_client
from hicache_draft_mooncake.options import MooncakeOptions
from hicache_draft_mooncake.service import MooncakeService

# MHA page_first, bfloat16, 4 layers x 8 heads x 64 dims: 8 KiB per token.
_TOKEN_NBYTES = 2 * 4 * 8 * 64 * 2


@dataclass
class Row:
    mode: str
    variant: str
    page_nbytes: int
    pages: int
    set_gbps: float
    get_gbps: float
    base_set_gbps: float
    base_get_gbps: float
    exist_us_per_key: float | None = None
    base_exist_us_per_key: float | None = None

    @property
    def set_ratio(self) -> float:
        return self.set_gbps / self.base_set_gbps

    @property
    def get_ratio(self) -> float:
        return self.get_gbps / self.base_get_gbps

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode, "variant": self.variant, "page_bytes": self.page_nbytes, "pages": self.pages,
            "set_gbps": round(self.set_gbps, 3), "get_gbps": round(self.get_gbps, 3),
            "set_ratio": round(self.set_ratio, 2), "get_ratio": round(self.get_ratio, 2),
        }
        if self.exist_us_per_key is not None:
            out["exist_us_per_key"] = round(self.exist_us_per_key, 2)
        return out


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _host_allocator(store: Store) -> Callable[[int], torch.Tensor] | None:
    """What the controller does with the ``host_memory`` hook."""
    if store.host_memory(PoolKind.KV, 1) is None:
        return None

    def alloc(nbytes: int) -> torch.Tensor:
        buf = store.host_memory(PoolKind.KV, nbytes)
        assert buf is not None
        return torch.frombuffer((ctypes.c_ubyte * buf.nbytes).from_address(buf.ptr), dtype=torch.uint8)

    return alloc


class _Plugin:
    """One plugin Store with its own source/destination host pools."""

    def __init__(self, name: str, opts: dict[str, Any], spec: PoolSpec, pages: int, data: torch.Tensor) -> None:
        self.name = name
        self.store = Store.open("mooncake", opts)
        alloc = _host_allocator(self.store)
        self.spec = spec
        self.src = HostPool(spec, pages, allocator=alloc)
        self.dst = HostPool(spec, pages, allocator=alloc)
        self.src.raw.copy_(data)
        self.dst.raw.fill_(0)
        self.ns = secrets.token_hex(12)
        self.draft_ns = secrets.token_hex(12)
        for pool in (self.src, self.dst):
            self.store.register_pool(PoolRegistration(
                pool=PoolKind.KV, attention=Attention.MHA, layout=Layout.PAGE_FIRST, namespace=self.ns,
                page_nbytes=spec.page_nbytes, buffers_per_page=2, regions=pool.regions(),
            ))

    def pages(self, pool: HostPool, groups: list[str]) -> list[Page]:
        ps = self.spec.page_size
        return [Page(make_key(g, self.ns), g, self.ns, pool.page_buffers(i * ps)) for i, g in enumerate(groups)]

    def round(self, groups: list[str], out: dict[str, list[float]], total: int) -> list[str]:
        w, r = self.pages(self.src, groups), self.pages(self.dst, groups)
        t, res = _timed(lambda: self.store.page_set([PageTransfer(PoolKind.KV, w, True)]))
        assert all(x == 0 for x in res[PoolKind.KV]), (self.name, res)
        out["set"].append(total / t)
        t, res = _timed(lambda: self.store.page_get([PageTransfer(PoolKind.KV, r, True)]))
        assert all(x == 0 for x in res[0][PoolKind.KV]), (self.name, res)
        out["get"].append(total / t)
        # existence as the controller asks it: target and draft keys of the prefix in one call
        # (two keys per page, like the baseline's K and V objects); draft pages stored untimed
        d = [Page(make_key(g, self.draft_ns), g, self.draft_ns, p.buffers) for g, p in zip(groups, w, strict=True)]
        res = self.store.page_set([PageTransfer(PoolKind.DRAFT, d, True)])
        assert all(x == 0 for x in res[PoolKind.DRAFT]), (self.name, res)
        query = {PoolKind.KV: [p.key for p in w], PoolKind.DRAFT: [p.key for p in d]}
        t, n = _timed(lambda: self.store.page_exists(query))
        assert n == {PoolKind.KV: len(w), PoolKind.DRAFT: len(d)}, (self.name, n)
        out["exist"].append(t / (len(w) + len(d)))
        return [self.store.backend.key(p) for p in (*w, *d)]  # type: ignore[attr-defined]


def _native_pair(client: Any, areas: list[int], pools: tuple[HostPool, HostPool], pages: int, staged: bool,  # noqa: ANN401
                 cfg: Any) -> tuple[Callable[[list[str]], list[int]], Callable[[list[str]], list[int]]]:  # noqa: ANN401
    """The plugin's native calls with its object layout, without checksums, copies or Python work.

    ``areas``: two registered regions of ``pages * (page + HEADER_SIZE)`` bytes (the staging
    slots, or the header slots); ``pools``: the source and destination host pools (their K and
    V buffers are what the direct layout moves, as the plugin does)."""
    page = pools[0].spec.page_nbytes
    slot = page + HEADER_SIZE
    if staged:
        ptrs = [areas[0] + i * slot for i in range(pages)]
        gptrs = [areas[1] + i * slot for i in range(pages)]
        return (lambda keys: client.batch_put_from(keys, ptrs, [slot] * pages, cfg),
                lambda keys: client.batch_get_into(keys, gptrs, [slot] * pages))
    ps = pools[0].spec.page_size
    layouts = []
    for area, pool in zip(areas, pools, strict=True):
        ptrs_sizes = [pool.page_buffer_meta([i * ps]) for i in range(pages)]
        layouts.append(([[area + i * HEADER_SIZE, *p] for i, (p, _) in enumerate(ptrs_sizes)],
                        [[HEADER_SIZE, *n] for _, n in ptrs_sizes]))
    (mptrs, sizes), (mgptrs, _) = layouts
    return (lambda keys: client.batch_put_from_multi_buffers(keys, mptrs, sizes, cfg),
            lambda keys: client.batch_get_into_multi_buffers(keys, mgptrs, sizes))


def run_case(svc: MooncakeService, mode: str, page_nbytes: int, pages: int, rounds: int) -> list[Row]:
    """The rows of one (mode, page size); raises AssertionError if any call fails."""
    from mooncake.store import ReplicateConfig

    page_size = max(1, page_nbytes // _TOKEN_NBYTES)
    spec = PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=4, page_size=page_size,
                    dtype=torch.bfloat16, layout=Layout.PAGE_FIRST, kv_heads=8, head_dim=64)
    page = spec.page_nbytes
    total = pages * page
    data = torch.randint(0, 256, (pages * page,), dtype=torch.uint8)
    cfg = ReplicateConfig()
    base = new_client(MooncakeOptions.model_validate(svc.backend_options()))
    plugins: list[_Plugin] = []
    held: list[tuple[Any, int, Any]] = []  # (client, ptr, keep-alive) registered for the native ceiling
    try:
        bsrc, bdst = HostPool(spec, pages), HostPool(spec, pages)
        bsrc.raw.copy_(data)
        for pool in (bsrc, bdst):
            base.register_buffer(pool.raw.data_ptr(), pool.raw.numel())
        src_ptrs, sizes = bsrc.page_buffer_meta([i * page_size for i in range(pages)])
        dst_ptrs, _ = bdst.page_buffer_meta([i * page_size for i in range(pages)])
        if mode == "tcp":
            opts = svc.backend_options()
            plugins = [_Plugin(f"plugin {m}", {**opts, "io_mode": m}, spec, pages, data) for m in ("staged", "direct")]
            ceiling_client, staged = base, MooncakeOptions.model_validate(opts).staged_max_page_bytes >= page
            ceiling_pools = (bsrc, bdst)
        else:
            opts = {**svc.backend_options(shm=True), "shm_pool_size": 4 * pages * (page + HEADER_SIZE) + (64 << 20)}
            plugins = [_Plugin("plugin", opts, spec, pages, data)]
            ceiling_client, staged = plugins[0].store.backend.native, False  # type: ignore[attr-defined]
            ceiling_pools = (plugins[0].src, plugins[0].dst)
        mem = plugins[0].store.backend._sess.mem  # type: ignore[attr-defined]
        areas = []
        for _ in range(2):
            if ceiling_client is base:
                t = torch.zeros(pages * (page + HEADER_SIZE), dtype=torch.uint8)
                base.register_buffer(t.data_ptr(), t.numel())
                held.append((base, t.data_ptr(), t))
                areas.append(t.data_ptr())
            else:
                ptr, arr = mem.allocate(pages * (page + HEADER_SIZE))
                held.append((None, ptr, arr))
                areas.append(ptr)
        cput, cget = _native_pair(ceiling_client, areas, ceiling_pools, pages, staged, cfg)
        res: dict[str, dict[str, list[float]]] = {
            k: {"set": [], "get": [], "exist": []} for k in ("baseline", "ceiling", *(p.name for p in plugins))
        }
        for _ in range(rounds):
            groups = [secrets.token_hex(32) for _ in range(pages)]
            bkeys = [f"base-{g}-{part}" for g in groups for part in ("k", "v")]
            t, rc = _timed(lambda: base.batch_put_from(bkeys, src_ptrs, sizes, cfg))  # noqa: B023
            assert all(r == 0 for r in rc), rc
            res["baseline"]["set"].append(total / t)
            t, rc = _timed(lambda: base.batch_get_into(bkeys, dst_ptrs, sizes))  # noqa: B023
            assert all(r >= 0 for r in rc), rc
            res["baseline"]["get"].append(total / t)
            t, _ = _timed(lambda: base.batch_is_exist(bkeys))  # noqa: B023
            res["baseline"]["exist"].append(t / len(bkeys))
            ckeys = [f"ceil-{g}" for g in groups]
            t, rc = _timed(lambda: cput(ckeys))  # noqa: B023
            assert all(r == 0 for r in rc), rc
            res["ceiling"]["set"].append(total / t)
            t, rc = _timed(lambda: cget(ckeys))  # noqa: B023
            assert all(r >= 0 for r in rc), rc
            res["ceiling"]["get"].append(total / t)
            gone = bkeys + ckeys
            for p in plugins:
                gone += p.round(groups, res[p.name], total)
            base.batch_remove(gone, True)
        med = {k: {m: statistics.median(v) if v else 0.0 for m, v in d.items()} for k, d in res.items()}
        b = med["baseline"]
        rows = [Row(mode, "baseline", page, pages, b["set"] / 1e9, b["get"] / 1e9, b["set"] / 1e9, b["get"] / 1e9,
                    b["exist"] * 1e6, b["exist"] * 1e6)]
        for name in (*(p.name for p in plugins), "ceiling"):
            m = med[name]
            label = f"ceiling ({'staged' if staged else 'direct'} layout)" if name == "ceiling" else name
            rows.append(Row(mode, label, page, pages, m["set"] / 1e9, m["get"] / 1e9, b["set"] / 1e9,
                            b["get"] / 1e9, m["exist"] * 1e6 if m["exist"] else None, b["exist"] * 1e6))
        return rows
    finally:
        for p in plugins:
            p.store.close()
        for client, ptr, _ in held:
            if client is not None:
                client.unregister_buffer(ptr)
        base.close()


def run(modes: list[str], page_sizes: list[int], pages: int, rounds: int,
        echo: Callable[[str], None] = print) -> list[Row]:
    """Start a store, run every (mode, page size) case, stop the store."""
    segment = max(1 << 30, 12 * pages * (max(page_sizes) + HEADER_SIZE))
    rows: list[Row] = []
    with MooncakeService.start(segment_size=segment) as svc:
        for mode in modes:
            for size in page_sizes:
                for row in run_case(svc, mode, size, pages, rounds):
                    echo(format_row(row))
                    rows.append(row)
    return rows


HEADER = (f"{'mode':<4} {'page':>8} {'batch':>5}  {'variant':<24} | {'set GB/s':>8} {'get GB/s':>8} | "
          f"{'set x':>5} {'get x':>5} | {'exist us/key':>12}")


def format_row(r: Row) -> str:
    page = f"{r.page_nbytes >> 10} KiB"
    exist = f"{r.exist_us_per_key:>12.2f}" if r.exist_us_per_key is not None else f"{'':>12}"
    return (f"{r.mode:<4} {page:>8} {r.pages:>5}  {r.variant:<24} | {r.set_gbps:>8.2f} {r.get_gbps:>8.2f} | "
            f"{r.set_ratio:>5.2f} {r.get_ratio:>5.2f} | {exist}")
