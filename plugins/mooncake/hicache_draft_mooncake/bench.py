"""Benchmark: the plugin against a straightforward client, on one store, same pages, same run.

Baseline (the issue's): a client with SGLang MooncakeStore's object layout and calls: one object
per buffer (an MHA page_first page is two buffers, K and V: two objects per page), a
``batch_is_exist`` before the put (MooncakeStore's ``batch_set`` skips stored keys that way),
``batch_put_from`` / ``batch_get_into``, from a plain TCP client with its own ordinary host
memory. The same baseline is used for the shared-memory rows, so their ratio is what the
shared-memory mode buys over such a client.

Plugin rows go through :class:`~hicache_draft.Store` (``page_set`` / ``page_get`` as the controller
calls them: the core makes every page's header before the put and verifies every page after the
get; the backend stores one object per page, header included, and checks existence first):

* ``tcp`` mode: ``staged`` (one staging slot per page, one transfer) and ``direct`` (the page's
  own buffers plus a header slot, zero copy); ``auto`` picks one of them by page size.
* ``shm`` mode: host pools from the backend's ``host_memory`` hook (the shared pool), ``direct``.
* ``bare hooks``: the backend's own hooks for the variant ``auto`` picks, headers made outside the
  timing, no verification: the Store row minus this row is what the core's header and
  verification cost.

Native rows (no checksum, copy or Python work; the client the plugin's mode uses) measure each
layout choice separately: K/V objects without the existence call, one slot per page (the staged
layout), header slot + buffers (the direct layout; the plugin cannot be faster than the row of
its own layout: its *ceiling*), the same in 16 MiB calls (the batch splitting the plugin did
before), and the buffers without the header slot.

``costs`` (ms per batch, medians of per-round differences): the core's header making
(``attach_headers`` timed alone) and verification (Store get - bare get), the Store's thread hop
(Store set - bare set - header making), the baseline's existence call, the header slot (direct
layout - buffers only), batch splitting (16 MiB calls - one call), and the backend's own work
over its layout (bare hooks - native row of the same layout: staging copies, Python).

Existence: ``page_exists`` for the target and draft keys of the batch in one call, as the
controller asks it (two keys per page), against ``batch_is_exist`` over the baseline's K and V
keys (two per page); both reported per key. Fresh keys every round; keys are force-removed outside
the timed region; the order of the variants rotates from round to round (the first writer into
freshly freed segment memory is faster) and the holder's segment is written once before the first
round (its memory is touched lazily), and an unused client is opened first (the first client of
a process was measured about 25% slower on gets). Numbers are medians over rounds; ratios compare medians
measured in the same run.
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
    HostPool,
    Layout,
    Page,
    PageTransfer,
    PoolKind,
    PoolRegistration,
    PoolSpec,
    Store,
    make_key,
)
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
    costs_ms: dict[str, float] | None = None

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
        if self.costs_ms is not None:
            out["costs_ms"] = {k: round(v, 2) for k, v in self.costs_ms.items()}
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


Times = dict[str, list[float]]
"""Per variant and measure (``set``, ``get``, ``exist``, ...): seconds, one entry per round."""


class _Plugin:
    """One plugin Store with its own source/destination host pools."""

    def __init__(self, name: str, opts: dict[str, Any], spec: PoolSpec, pages: int, data: torch.Tensor,
                 bare: bool = False) -> None:
        self.name = name
        self.bare = bare  # also time the backend's own hooks (no core header or verification)
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

    @property
    def backend(self) -> Any:  # noqa: ANN401 (the MooncakeBackend)
        return self.store.backend

    def pages(self, pool: HostPool, groups: list[str], ns: str | None = None) -> list[Page]:
        ps, ns = self.spec.page_size, ns or self.ns
        return [Page(make_key(g, ns), g, ns, pool.page_buffers(i * ps)) for i, g in enumerate(groups)]

    def round(self, groups: list[str], out: Times) -> list[str]:
        """One timed round; the Mooncake keys it stored (for removal)."""
        w, r = self.pages(self.src, groups), self.pages(self.dst, groups)
        t, res = _timed(lambda: self.store.page_set([PageTransfer(PoolKind.KV, w, True)]))
        assert all(x == 0 for x in res[PoolKind.KV]), (self.name, res)
        out["set"].append(t)
        t, res = _timed(lambda: self.store.page_get([PageTransfer(PoolKind.KV, r, True)]))
        assert all(x == 0 for x in res[0][PoolKind.KV]), (self.name, res)
        out["get"].append(t)
        # existence as the controller asks it: target and draft keys of the prefix in one call
        # (two keys per page, like the baseline's K and V objects); draft pages stored untimed
        d = self.pages(self.src, groups, self.draft_ns)
        res = self.store.page_set([PageTransfer(PoolKind.DRAFT, d, True)])
        assert all(x == 0 for x in res[PoolKind.DRAFT]), (self.name, res)
        query = {PoolKind.KV: [p.key for p in w], PoolKind.DRAFT: [p.key for p in d]}
        t, n = _timed(lambda: self.store.page_exists(query))
        assert n == {PoolKind.KV: len(w), PoolKind.DRAFT: len(d)}, (self.name, n)
        out["exist"].append(t / (len(w) + len(d)))
        keys = [self.backend.key(p) for p in (*w, *d)]
        if self.bare:
            keys += self._bare_round(groups, out)
        return keys

    def _bare_round(self, groups: list[str], out: Times) -> list[str]:
        """The backend's hooks alone, as the Store hands them pages (headers made, timed apart)."""
        ns = secrets.token_hex(12)  # fresh keys: the Store round's pages exist already
        t, w = _timed(lambda: self.store.attach_headers(
            [PageTransfer(PoolKind.KV, self.pages(self.src, groups, ns), True)], made=True))
        out["header"].append(t)
        r = self.store.attach_headers([PageTransfer(PoolKind.KV, self.pages(self.dst, groups, ns), True)], made=False)
        deadline = time.monotonic() + self.store.timeout_s
        t, res = _timed(lambda: self.backend.page_set(w, deadline))
        assert all(x == 0 for x in res[PoolKind.KV]), (self.name, res)
        out["bare set"].append(t)
        t, res = _timed(lambda: self.backend.page_get(r, deadline))
        assert all(x == 0 for x in res[PoolKind.KV]), (self.name, res)
        out["bare get"].append(t)
        return [self.backend.key(p) for p in w[0].pages]


class _Native:
    """The native calls of each layout on one client, over the source/destination pools: no
    checksum, no copy (staging slots are not filled), no Python work per page."""

    def __init__(self, client: Any, areas: list[int], pools: tuple[HostPool, HostPool], pages: int,  # noqa: ANN401
                 cfg: Any) -> None:  # noqa: ANN401
        """``areas``: two registered regions of ``pages * (page + HEADER_SIZE)`` bytes (staging
        slots or header slots), one to write from, one to read into."""
        self.client, self.cfg = client, cfg
        spec = pools[0].spec
        self.page = spec.page_nbytes
        slots = [spec.page_size * i for i in range(pages)]
        self.kv = [pool.page_buffer_meta(slots) for pool in pools]  # flat K, V pointers and sizes
        per_page = [[pool.page_buffer_meta([s]) for s in slots] for pool in pools]
        self.multi = [([[a + i * HEADER_SIZE, *p] for i, (p, _) in enumerate(pp)], [[HEADER_SIZE, *n] for _, n in pp])
                      for a, pp in zip(areas, per_page, strict=True)]
        self.plain = [([p for p, _ in pp], [n for _, n in pp]) for pp in per_page]
        self.slot = self.page + HEADER_SIZE
        self.slots = [[a + i * self.slot for i in range(pages)] for a in areas]

    def calls(self, label: str) -> tuple[Callable[[list[str]], list[int]], Callable[[list[str]], list[int]]]:
        """(put, get) of the row ``label`` (see :data:`NATIVE`)."""
        c, cfg = self.client, self.cfg
        if label == "native: K/V objects, no exist":
            (sp, ss), (dp, _) = self.kv
            return (lambda keys: c.batch_put_from(keys, sp, ss, cfg), lambda keys: c.batch_get_into(keys, dp, ss))
        if label == "native: one slot per page":
            (wp, rp), sizes = self.slots, [self.slot] * len(self.slots[0])
            return (lambda keys: c.batch_put_from(keys, wp, sizes, cfg), lambda keys: c.batch_get_into(keys, rp, sizes))
        (wp, sizes), (rp, _) = self.plain if label == "native: buffers, no header slot" else self.multi
        step = max(1, (16 << 20) // self.slot) if label == "native: same, 16 MiB calls" else len(wp)

        def put(keys: list[str]) -> list[int]:
            return [rc for a in range(0, len(keys), step)
                    for rc in c.batch_put_from_multi_buffers(keys[a : a + step], wp[a : a + step],
                                                             sizes[a : a + step], cfg)]

        def get(keys: list[str]) -> list[int]:
            return [rc for a in range(0, len(keys), step)
                    for rc in c.batch_get_into_multi_buffers(keys[a : a + step], rp[a : a + step],
                                                             sizes[a : a + step])]

        return put, get


NATIVE = {  # row label: Mooncake objects per page
    "native: K/V objects, no exist": 2,
    "native: one slot per page": 1,
    "native: header slot + buffers": 1,
    "native: same, 16 MiB calls": 1,
    "native: buffers, no header slot": 1,
}


def _warm(client: Any, segment: int, cfg: Any) -> None:  # noqa: ANN401
    """Write the holder's segment once (its memory is touched lazily; the first writer into
    untouched memory pays the page faults), then remove what was written."""
    blk = torch.zeros(16 << 20, dtype=torch.uint8)
    client.register_buffer(blk.data_ptr(), blk.numel())
    keys = [f"warm-{secrets.token_hex(8)}-{i}" for i in range(int(segment * 0.8) // blk.numel())]
    try:
        for a in range(0, len(keys), 8):
            part = keys[a : a + 8]
            client.batch_put_from(part, [blk.data_ptr()] * len(part), [blk.numel()] * len(part), cfg)
    finally:
        client.batch_remove(keys, True)
        client.unregister_buffer(blk.data_ptr())


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _diff(a: list[float], b: list[float]) -> float:
    """Median of per-round differences, in ms."""
    return 1e3 * statistics.median([x - y for x, y in zip(a, b, strict=True)]) if a and b else 0.0


def run_case(
    svc: MooncakeService, mode: str, page_nbytes: int, pages: int, rounds: int, warm: bool = True
) -> list[Row]:
    """The rows of one (mode, page size); raises AssertionError if any call fails. ``warm``: write
    the holder's segment once first (see :func:`_warm`)."""
    from mooncake.store import ReplicateConfig

    page_size = max(1, page_nbytes // _TOKEN_NBYTES)
    spec = PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=4, page_size=page_size,
                    dtype=torch.bfloat16, layout=Layout.PAGE_FIRST, kv_heads=8, head_dim=64)
    page = spec.page_nbytes
    data = torch.randint(0, 256, (pages * page,), dtype=torch.uint8)
    cfg = ReplicateConfig()
    base = new_client(MooncakeOptions.model_validate(svc.backend_options()))
    plugins: list[_Plugin] = []
    held: list[tuple[Any, int, Any]] = []  # (client, ptr, keep-alive) registered for the native rows
    try:
        bsrc, bdst = HostPool(spec, pages), HostPool(spec, pages)
        bsrc.raw.copy_(data)
        for pool in (bsrc, bdst):
            base.register_buffer(pool.raw.data_ptr(), pool.raw.numel())
        src_ptrs, sizes = bsrc.page_buffer_meta([i * page_size for i in range(pages)])
        dst_ptrs, _ = bdst.page_buffer_meta([i * page_size for i in range(pages)])
        if mode == "tcp":
            opts = svc.backend_options()
            staged = MooncakeOptions.model_validate(opts).staged_max_page_bytes >= page  # what auto picks
            plugins = [_Plugin(f"plugin {m}", {**opts, "io_mode": m}, spec, pages, data, bare=(m == "staged") == staged)
                       for m in ("staged", "direct")]
            native_client, native_pools = base, (bsrc, bdst)
        else:
            opts = {**svc.backend_options(shm=True), "shm_pool_size": 5 * pages * (page + HEADER_SIZE) + (64 << 20)}
            plugins = [_Plugin("plugin", opts, spec, pages, data, bare=True)]
            native_client, staged = plugins[0].backend.native, False
            native_pools = (plugins[0].src, plugins[0].dst)
        mem = plugins[0].backend._sess.mem
        areas = []
        for _ in range(2):
            if native_client is base:
                t = torch.zeros(pages * (page + HEADER_SIZE), dtype=torch.uint8)
                base.register_buffer(t.data_ptr(), t.numel())
                held.append((base, t.data_ptr(), t))
                areas.append(t.data_ptr())
            else:
                ptr, arr = mem.allocate(pages * (page + HEADER_SIZE))
                held.append((None, ptr, arr))
                areas.append(ptr)
        native = _Native(native_client, areas, native_pools, pages, cfg)
        calls = {label: native.calls(label) for label in NATIVE}
        if warm:
            _warm(base, svc.segment_size, cfg)
        names = ["baseline", *(p.name for p in plugins), *NATIVE]
        res: dict[str, Times] = {k: {m: [] for m in ("set", "get", "exist", "base exist", "header", "bare set",
                                                      "bare get")} for k in names}
        by_name = {p.name: p for p in plugins}
        for n in range(rounds):
            groups = [secrets.token_hex(32) for _ in range(pages)]
            gone: list[str] = []
            for name in names[n % len(names) :] + names[: n % len(names)]:
                out = res[name]
                if name in by_name:
                    gone += by_name[name].round(groups, out)
                    continue
                per_page = 2 if name == "baseline" else NATIVE[name]
                tag = secrets.token_hex(4)
                keys = [f"{tag}-{g}-{part}" for g in groups for part in range(per_page)]
                gone += keys
                if name == "baseline":  # MooncakeStore's batch_set: existence first, then the put
                    t0 = time.perf_counter()
                    there = base.batch_is_exist(keys)
                    t1 = time.perf_counter()
                    todo = [i for i, e in enumerate(there) if e != 1]
                    rc = base.batch_put_from([keys[i] for i in todo], [src_ptrs[i] for i in todo],
                                             [sizes[i] for i in todo], cfg)
                    t2 = time.perf_counter()
                    assert len(todo) == len(keys) and all(r == 0 for r in rc), rc
                    out["set"].append(t2 - t0)
                    out["base exist"].append(t1 - t0)
                    t, rc = _timed(lambda: base.batch_get_into(keys, dst_ptrs, sizes))  # noqa: B023
                    assert all(r >= 0 for r in rc), rc
                    out["get"].append(t)
                    t, _ = _timed(lambda: base.batch_is_exist(keys))  # noqa: B023
                    out["exist"].append(t / len(keys))
                    continue
                put, get = calls[name]
                t, rc = _timed(lambda: put(keys))  # noqa: B023
                assert all(r == 0 for r in rc), (name, rc)
                out["set"].append(t)
                t, rc = _timed(lambda: get(keys))  # noqa: B023
                assert all(r >= 0 for r in rc), (name, rc)
                out["get"].append(t)
            base.batch_remove(gone, True)
        return _rows(mode, page, pages, res, plugins, staged)
    finally:
        for p in plugins:
            p.store.close()
        for client, ptr, _ in held:
            if client is not None:
                client.unregister_buffer(ptr)
        base.close()


def _rows(mode: str, page: int, pages: int, res: dict[str, Times], plugins: list[_Plugin], staged: bool) -> list[Row]:
    """Rows (GB/s from median seconds) and the cost breakdown on the row of the variant ``auto``
    picks (ms per batch)."""
    total = pages * page
    med = {k: {m: _med(v) for m, v in d.items()} for k, d in res.items()}
    b = med["baseline"]

    def row(name: str, set_s: float, get_s: float, exist: float | None = None,
            costs: dict[str, float] | None = None) -> Row:
        return Row(mode, name, page, pages, total / set_s / 1e9, total / get_s / 1e9, total / b["set"] / 1e9,
                   total / b["get"] / 1e9, exist * 1e6 if exist else None, b["exist"] * 1e6, costs)

    rows = [row("baseline", b["set"], b["get"], b["exist"])]
    for p in plugins:
        m, r = med[p.name], res[p.name]
        costs = None
        if p.bare:
            own = "native: one slot per page" if staged else "native: header slot + buffers"
            hb, sp = "native: header slot + buffers", "native: same, 16 MiB calls"
            costs = {
                "core header": 1e3 * _med(r["header"]),
                "store hop": _diff(r["set"], [h + s for h, s in zip(r["header"], r["bare set"], strict=True)]),
                "core verify": _diff(r["get"], r["bare get"]),
                "exist": 1e3 * b["base exist"],
                "header slot set": _diff(res[hb]["set"], res["native: buffers, no header slot"]["set"]),
                "header slot get": _diff(res[hb]["get"], res["native: buffers, no header slot"]["get"]),
                "16 MiB calls set": _diff(res[sp]["set"], res[hb]["set"]),
                "16 MiB calls get": _diff(res[sp]["get"], res[hb]["get"]),
                "backend set": _diff(r["bare set"], res[own]["set"]),
                "backend get": _diff(r["bare get"], res[own]["get"]),
            }
        rows.append(row(p.name, m["set"], m["get"], m["exist"], costs))
        if p.bare:
            rows.append(row(f"{p.name}, bare hooks", m["bare set"], m["bare get"]))
    for name in NATIVE:
        rows.append(row(name, med[name]["set"], med[name]["get"]))
    return rows


def run(modes: list[str], page_sizes: list[int], pages: int, rounds: int,
        echo: Callable[[str], None] = print) -> list[Row]:
    """Start a store, run every (mode, page size) case, stop the store."""
    segment = max(1 << 30, 20 * pages * (max(page_sizes) + HEADER_SIZE))
    rows: list[Row] = []
    with MooncakeService.start(segment_size=segment) as svc:
        # measured: the first Mooncake client of a process gets about 25% slower than later ones
        # (same native call, same layout, same run), so an unused client comes first and no
        # measured client (baseline or plugin) is the first
        anchor = new_client(MooncakeOptions.model_validate(svc.backend_options()))
        try:
            for n, (mode, size) in enumerate((m, s) for m in modes for s in page_sizes):
                for row in run_case(svc, mode, size, pages, rounds, warm=n == 0):
                    echo(format_row(row))
                    rows.append(row)
        finally:
            anchor.close()
    return rows


HEADER = (f"{'mode':<4} {'page':>8} {'batch':>5}  {'variant':<32} | {'set GB/s':>8} {'get GB/s':>8} | "
          f"{'set x':>5} {'get x':>5} | {'exist us/key':>12}")


def format_row(r: Row) -> str:
    page = f"{r.page_nbytes >> 10} KiB"
    exist = f"{r.exist_us_per_key:>12.2f}" if r.exist_us_per_key is not None else f"{'':>12}"
    line = (f"{r.mode:<4} {page:>8} {r.pages:>5}  {r.variant:<32} | {r.set_gbps:>8.2f} {r.get_gbps:>8.2f} | "
            f"{r.set_ratio:>5.2f} {r.get_ratio:>5.2f} | {exist}")
    if r.costs_ms:
        line += "\n      costs, ms per batch: " + ", ".join(f"{k} {v:.2f}" for k, v in r.costs_ms.items())
    return line
