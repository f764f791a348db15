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
  verification cost. A variant of its own on the Store's backend (its client, pools and
  reference), with its own turn in the rotation and its own pair of baseline runs, so the two are
  compared in like positions: what runs just before a call moves it more than the core does
  (measured on the VM: 20 ms idle before a shared-memory put of 128 x 64 KiB made it 2.84-2.99 ->
  4.61-5.53 ms), and an earlier bench that ran the hooks within the Store's turn, alternately
  before and after its calls, put the Store's set 17% behind its hooks over TCP at 1 MiB where,
  each after a baseline round, the two differ by 1-2%.

Native rows (no checksum, copy or Python work) measure each layout choice separately: K/V objects
without the existence call, one slot per page (the staged layout), header slot + buffers (the
direct layout; the plugin cannot be faster than the row of its own layout: its *ceiling*), the
same in 16 MiB calls (the batch splitting the plugin did before), and the buffers without the
header slot. In shared-memory mode they run on the plugin's shared-memory client: Mooncake's own
raw client at the same sizes, the ceiling of that mode.

Noise (a shared 2-core machine; measured: Mooncake clients of one process differ in speed by up to
2x depending on what else they were used for, and the machine's load changes within seconds):

* every variant has its own client (TCP mode) that makes only that variant's calls, and its
  reference is the baseline's calls **on that same client**, run right before and right after it
  (B v B; over shared memory the reference is the baseline's own TCP client, since a
  shared-memory client cannot make a plain TCP client's calls); the variant's ratio in a round is
  the mean of the two reference runs over its own time, the order of the variants rotates from
  round to round, and a row's ratio is the median of its per-round ratios (all of them are in the
  JSON report);
* ``baseline, 2nd client`` is the baseline on a client of its own, measured as a variant: its
  ratios (ideally 1.0) show how far two identical clients differ in this run;
* where a batch fits one 16 MiB call, the ``same, 16 MiB calls`` row makes exactly the ceiling's
  calls: the goal line prints it as the ceiling's twin, a second measure of the ceiling whose
  distance from the first is the run's noise on it (one H100 run of 7 rounds put the two at 1.89x
  and 3.36x over shared memory; 31 rounds on the VM at 3.35x and 3.33x);
* fresh keys every run, removed (forced) right after it outside the timed region, so every run
  writes into freshly freed segment memory; the holder's segment is written once before the first
  round (its memory is touched lazily); an unused client is opened first (the first client of a
  process was measured about 25% slower on gets).

``costs`` (ms per batch, medians of per-round differences of times normalised by their paired
baseline): the core's header making (``attach_headers`` timed alone: one xxh3 pass over the
page) and verification (Store get - bare get), what the Store's set costs over the bare hooks
given ready headers (its thread hop plus the part of the on-demand headers that does not hide
behind the transfer), the baseline's existence call, the header slot (direct layout - buffers
only), batch splitting (16 MiB calls - one call), one object vs K/V objects, and the backend's own
work over its layout (bare hooks - native row of the same layout: staging copies, Python). Every
one is a difference of two variants, each over its own baseline pair.

Checks (the CI test asserts them, never a timing): every call of every variant answered OK, every
get returned the bytes that were put (compared outside the timing), existence found every page,
the core found no corrupt page.
"""

from __future__ import annotations

import ctypes
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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

GOALS = {"tcp": 1.0, "shm": 2.0}
"""Issue 15: set and get against the baseline, per mode."""

Times = dict[str, list[float]]
"""Per measure (``set``, ``get``, ``exist``, ...): seconds, one entry per run."""

MEASURES = ("set", "get", "exist")


@dataclass
class Row:
    mode: str
    variant: str
    page_nbytes: int
    pages: int
    set_gbps: float
    get_gbps: float
    set_ratio: float
    get_ratio: float
    set_ratios: list[float] = field(default_factory=list)
    get_ratios: list[float] = field(default_factory=list)
    exist_us_per_key: float | None = None
    costs_ms: dict[str, float] | None = None

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode, "variant": self.variant, "page_bytes": self.page_nbytes, "pages": self.pages,
            "set_gbps": round(self.set_gbps, 3), "get_gbps": round(self.get_gbps, 3),
            "set_ratio": round(self.set_ratio, 3), "get_ratio": round(self.get_ratio, 3),
            "set_ratios": [round(x, 3) for x in self.set_ratios], "get_ratios": [round(x, 3) for x in self.get_ratios],
        }
        if self.exist_us_per_key is not None:
            out["exist_us_per_key"] = round(self.exist_us_per_key, 2)
        if self.costs_ms is not None:
            out["costs_ms"] = {k: round(v, 3) for k, v in self.costs_ms.items()}
        return out


@dataclass
class Goal:
    """One goal line: the plugin row's ratio against the goal, with the ceiling of the same run."""

    mode: str
    page_nbytes: int
    op: str
    variant: str
    ratio: float
    ratios: list[float]
    goal: float
    ceiling_variant: str
    ceiling: float
    raw_variant: str
    raw: float
    control: float
    bare: float
    core_ms: float
    plugin_ms: float
    twin: float | None = None
    """The ceiling's twin: the ``16 MiB calls`` row where its calls are the ceiling's own (the batch
    fits one call), a second measure of the ceiling in the same run (how far apart the two are is
    the run's noise on that ceiling); else None."""
    with_core: float | None = None
    """The ceiling with the core's own work added, not overlapped: the ceiling's time plus the core's
    header (set) or verification (get) of the same pages made alone in the same run. What any plugin
    that makes that mandatory work beside the native calls, without hiding it behind them, can reach;
    None where the run lacks either time."""

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "page_bytes": self.page_nbytes, "op": self.op, "variant": self.variant,
                "ratio": round(self.ratio, 3), "ratios": [round(x, 3) for x in self.ratios], "goal": self.goal,
                "met": self.met, "ceiling_variant": self.ceiling_variant, "ceiling": round(self.ceiling, 3),
                "raw_variant": self.raw_variant, "raw": round(self.raw, 3), "control": round(self.control, 3),
                "bare": round(self.bare, 3), "core_ms": round(self.core_ms, 2), "plugin_ms": round(self.plugin_ms, 2),
                "ceiling_twin": None if self.twin is None else round(self.twin, 3),
                "ceiling_with_core": None if self.with_core is None else round(self.with_core, 3)}


@dataclass
class Report:
    rows: list[Row]
    goals: list[Goal]
    checks: dict[str, bool]

    def as_dict(self) -> dict[str, object]:
        return {"rows": [r.as_dict() for r in self.rows], "goals": [g.as_dict() for g in self.goals],
                "checks": dict(self.checks)}


class Checks:
    """What must hold in every run (the CI test asserts it): counts of runs that broke each rule."""

    NAMES = ("every call OK", "every get byte-exact", "existence found every page", "no corrupt page")

    def __init__(self) -> None:
        self.broken: dict[str, list[str]] = {n: [] for n in self.NAMES}

    def expect(self, name: str, ok: bool, who: str) -> bool:
        if not ok:
            self.broken[name].append(who)
        return ok

    def result(self) -> dict[str, bool]:
        return {n: not v for n, v in self.broken.items()}


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


def _same(a: HostPool, b: HostPool) -> bool:
    assert a.raw is not None and b.raw is not None
    return torch.equal(a.raw, b.raw)


class _Baseline:
    """MooncakeStore's calls on a client of its own: existence, then K/V objects."""

    def __init__(self, name: str, client: Any, pools: tuple[HostPool, HostPool], cfg: Any,  # noqa: ANN401
                 checks: Checks, held: list[tuple[Any, int, Any]]) -> None:  # noqa: ANN401
        """``pools``: source (holding the pages' bytes) and destination, registered here with
        ``client`` (and put on ``held``, to unregister before the client closes)."""
        self.name, self.client, self.cfg, self.checks = name, client, cfg, checks
        self.src, self.dst = pools
        for pool in pools:
            assert pool.raw is not None
            client.register_buffer(pool.raw.data_ptr(), pool.raw.numel())
            held.append((client, pool.raw.data_ptr(), None))
        slots = [i * self.src.spec.page_size for i in range(self.src.num_pages)]
        (self.src_ptrs, self.sizes), (self.dst_ptrs, _) = (p.page_buffer_meta(slots) for p in pools)

    def round(self, groups: list[str], out: Times, turn: int = 0) -> list[str]:  # turn: the round (unused)
        c, tag = self.client, secrets.token_hex(4)
        keys = [f"{tag}-{g}-{part}" for g in groups for part in range(2)]
        t0 = time.perf_counter()
        there = c.batch_is_exist(keys)
        t1 = time.perf_counter()
        todo = [i for i, e in enumerate(there) if e != 1]
        rc = c.batch_put_from([keys[i] for i in todo], [self.src_ptrs[i] for i in todo],
                              [self.sizes[i] for i in todo], self.cfg)
        t2 = time.perf_counter()
        self.checks.expect("every call OK", len(todo) == len(keys) and all(r == 0 for r in rc), self.name)
        out["set"].append(t2 - t0)
        out["base exist"].append(t1 - t0)
        assert self.dst.raw is not None
        self.dst.raw.fill_(0)
        t, rc = _timed(lambda: c.batch_get_into(keys, self.dst_ptrs, self.sizes))
        self.checks.expect("every call OK", all(r >= 0 for r in rc), self.name)
        out["get"].append(t)
        self.checks.expect("every get byte-exact", _same(self.src, self.dst), self.name)
        t, there = _timed(lambda: c.batch_is_exist(keys))
        self.checks.expect("existence found every page", all(e == 1 for e in there), self.name)
        out["exist"].append(t / len(keys))
        return keys


class _Plugin:
    """One plugin Store with its own source/destination host pools."""

    def __init__(self, name: str, opts: dict[str, Any], spec: PoolSpec, pages: int, data: torch.Tensor,
                 checks: Checks) -> None:
        self.name, self.checks = name, checks
        self.store = Store.open("mooncake", opts)
        alloc = _host_allocator(self.store)
        self.spec = spec
        self.src = HostPool(spec, pages, allocator=alloc)
        self.dst = HostPool(spec, pages, allocator=alloc)
        assert self.src.raw is not None and self.dst.raw is not None
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

    def ok(self, res: dict[str, list[Any]], pool: str) -> None:
        self.checks.expect("every call OK", all(x == 0 for x in res[pool]), self.name)

    def read_back(self) -> None:
        self.checks.expect("every get byte-exact", _same(self.src, self.dst), self.name)
        self.checks.expect("no corrupt page", self.store.corrupt_pages == 0, self.name)
        assert self.dst.raw is not None
        self.dst.raw.fill_(0)

    def round(self, groups: list[str], out: Times, turn: int = 0) -> list[str]:  # turn: the round (unused)
        """One timed run; the Mooncake keys it stored (for removal)."""
        w, r = self.pages(self.src, groups), self.pages(self.dst, groups)
        t, res = _timed(lambda: self.store.page_set([PageTransfer(PoolKind.KV, w, True)]))
        self.ok(res, PoolKind.KV)
        out["set"].append(t)
        t, res = _timed(lambda: self.store.page_get([PageTransfer(PoolKind.KV, r, True)]))
        self.ok(res[0], PoolKind.KV)
        out["get"].append(t)
        self.read_back()
        # existence as the controller asks it: target and draft keys of the prefix in one call
        # (two keys per page, like the baseline's K and V objects); draft pages stored untimed
        d = self.pages(self.src, groups, self.draft_ns)
        self.ok(self.store.page_set([PageTransfer(PoolKind.DRAFT, d, True)]), PoolKind.DRAFT)
        query = {PoolKind.KV: [p.key for p in w], PoolKind.DRAFT: [p.key for p in d]}
        t, n = _timed(lambda: self.store.page_exists(query))
        self.checks.expect("existence found every page", n == {PoolKind.KV: len(w), PoolKind.DRAFT: len(d)},
                           self.name)
        out["exist"].append(t / (len(w) + len(d)))
        return [self.backend.key(p) for p in (*w, *d)]


class _BareHooks:
    """The backend's own hooks of a plugin's Store (same backend, client and pools), handed pages
    as the Store hands them: headers made and timed apart (``header``), and the pages a get filled
    verified apart (``verify``, the Store's own check). A variant of its own, so that its calls, like
    the Store's, follow a baseline run of their own."""

    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin
        self.name = f"{plugin.name}, bare hooks"

    @property
    def backend(self) -> Any:  # noqa: ANN401 (the MooncakeBackend)
        return self.plugin.backend

    def round(self, groups: list[str], out: Times, turn: int = 0) -> list[str]:  # turn: the round (unused)
        p = self.plugin
        store, backend = p.store, p.backend
        ns = secrets.token_hex(12)  # fresh keys, as every run's
        src = [PageTransfer(PoolKind.KV, p.pages(p.src, groups, ns), True)]  # made untimed, as the Store's
        t, w = _timed(lambda: store.attach_headers(src, made=True))
        out["header"].append(t)
        r = store.attach_headers([PageTransfer(PoolKind.KV, p.pages(p.dst, groups, ns), True)], made=False)
        deadline = time.monotonic() + store.timeout_s
        t, res = _timed(lambda: backend.page_set(w, deadline))
        p.ok(res, PoolKind.KV)
        out["set"].append(t)
        t, res = _timed(lambda: backend.page_get(r, deadline))
        p.ok(res, PoolKind.KV)
        out["get"].append(t)
        t, problems = _timed(lambda: store.check_pages(r))
        p.checks.expect("no corrupt page", not problems, self.name)
        out["verify"].append(t)
        p.read_back()
        return [backend.key(page) for page in w[0].pages]


_SPLIT_BYTES = 16 << 20
"""The call size of the ``same, 16 MiB calls`` row (the batch splitting the plugin did before)."""
TWIN = "native: same, 16 MiB calls"


def _split_step(slot_nbytes: int) -> int:
    """Pages per native call of the :data:`TWIN` row, for pages of ``slot_nbytes`` (header included)."""
    return max(1, _SPLIT_BYTES // slot_nbytes)

NATIVE = {  # row label: Mooncake objects per page
    "native: K/V objects, no exist": 2,
    "native: one slot per page": 1,
    "native: header slot + buffers": 1,
    TWIN: 1,
    "native: buffers, no header slot": 1,
}


class _Native:
    """The native calls of one layout (a row of :data:`NATIVE`) on one client, over shared
    source/destination pools: no checksum, no copy (staging slots are not filled), no Python work
    per page."""

    def __init__(self, label: str, client: Any, areas: list[int], pools: tuple[HostPool, HostPool],  # noqa: ANN401
                 pages: int, cfg: Any, checks: Checks) -> None:  # noqa: ANN401
        """``areas``: two regions of ``pages * (page + HEADER_SIZE)`` bytes (staging slots or
        header slots) registered with ``client``, one to write from, one to read into."""
        self.name, self.client, self.cfg, self.checks, self.pools = label, client, cfg, checks, pools
        spec = pools[0].spec
        slots = [spec.page_size * i for i in range(pages)]
        self.kv = [pool.page_buffer_meta(slots) for pool in pools]  # flat K, V pointers and sizes
        per_page = [[pool.page_buffer_meta([s]) for s in slots] for pool in pools]
        self.multi = [([[a + i * HEADER_SIZE, *p] for i, (p, _) in enumerate(pp)], [[HEADER_SIZE, *n] for _, n in pp])
                      for a, pp in zip(areas, per_page, strict=True)]
        self.plain = [([p for p, _ in pp], [n for _, n in pp]) for pp in per_page]
        self.slot = spec.page_nbytes + HEADER_SIZE
        self.slots = [[a + i * self.slot for i in range(pages)] for a in areas]
        self.put, self.get = self._calls()

    def _calls(self) -> tuple[Callable[[list[str]], list[int]], Callable[[list[str]], list[int]]]:
        c, cfg, label = self.client, self.cfg, self.name
        if label == "native: K/V objects, no exist":
            (sp, ss), (dp, _) = self.kv
            return (lambda keys: c.batch_put_from(keys, sp, ss, cfg), lambda keys: c.batch_get_into(keys, dp, ss))
        if label == "native: one slot per page":
            (wp, rp), sizes = self.slots, [self.slot] * len(self.slots[0])
            return (lambda keys: c.batch_put_from(keys, wp, sizes, cfg), lambda keys: c.batch_get_into(keys, rp, sizes))
        (wp, sizes), (rp, _) = self.plain if label == "native: buffers, no header slot" else self.multi
        step = _split_step(self.slot) if label == TWIN else len(wp)

        def put(keys: list[str]) -> list[int]:
            return [rc for a in range(0, len(keys), step)
                    for rc in c.batch_put_from_multi_buffers(keys[a : a + step], wp[a : a + step],
                                                             sizes[a : a + step], cfg)]

        def get(keys: list[str]) -> list[int]:
            return [rc for a in range(0, len(keys), step)
                    for rc in c.batch_get_into_multi_buffers(keys[a : a + step], rp[a : a + step],
                                                             sizes[a : a + step])]

        return put, get

    def round(self, groups: list[str], out: Times, turn: int = 0) -> list[str]:  # turn: the round (unused)
        tag = secrets.token_hex(4)
        keys = [f"{tag}-{g}-{part}" for g in groups for part in range(NATIVE[self.name])]
        t, rc = _timed(lambda: self.put(keys))
        self.checks.expect("every call OK", all(r == 0 for r in rc), self.name)
        out["set"].append(t)
        into_pool = self.name != "native: one slot per page"  # that row reads into its slots
        dst = self.pools[1]
        assert dst.raw is not None
        if into_pool:
            dst.raw.fill_(0)
        t, rc = _timed(lambda: self.get(keys))
        self.checks.expect("every call OK", all(r >= 0 for r in rc), self.name)
        out["get"].append(t)
        if into_pool:
            self.checks.expect("every get byte-exact", _same(self.pools[0], dst), self.name)
        return keys


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


@dataclass
class _Result:
    """One variant's runs in one case: raw times, and per round its times over its paired baseline."""

    times: Times = field(default_factory=lambda: {m: [] for m in (*MEASURES, "base exist", "header", "verify")})
    rel: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})


def run_case(
    svc: MooncakeService, mode: str, page_nbytes: int, pages: int, rounds: int, checks: Checks, warm: bool = True
) -> list[Row]:
    """The rows of one (mode, page size). ``warm``: write the holder's segment once first (see
    :func:`_warm`)."""
    from mooncake.store import ReplicateConfig

    page_size = max(1, page_nbytes // _TOKEN_NBYTES)
    spec = PoolSpec(kind=PoolKind.KV, attention=Attention.MHA, layers=4, page_size=page_size,
                    dtype=torch.bfloat16, layout=Layout.PAGE_FIRST, kv_heads=8, head_dim=64)
    page = spec.page_nbytes
    data = torch.randint(0, 256, (pages * page,), dtype=torch.uint8)
    cfg = ReplicateConfig()
    tcp_opts = MooncakeOptions.model_validate(svc.backend_options())
    clients: list[Any] = []  # the bench's own TCP clients, closed last

    def client() -> Any:  # noqa: ANN401
        clients.append(new_client(tcp_opts))
        return clients[-1]

    plugins: list[_Plugin] = []
    held: list[tuple[Any, int, Any]] = []  # (client, ptr, keep-alive): unregistered before the clients close

    def pools() -> tuple[HostPool, HostPool]:
        src, dst = HostPool(spec, pages), HostPool(spec, pages)
        assert src.raw is not None
        src.raw.copy_(data)
        return src, dst

    try:
        bpools = pools()  # one pair for every baseline (runs never overlap)
        base = _Baseline("baseline", client(), bpools, cfg, checks, held)
        control = _Baseline("baseline, 2nd client", client(), bpools, cfg, checks, held)
        if mode == "tcp":
            opts = svc.backend_options()
            staged = tcp_opts.staged_max_page_bytes >= page  # what auto picks
            plugins = [_Plugin(f"plugin {m}", {**opts, "io_mode": m}, spec, pages, data, checks)
                       for m in ("staged", "direct")]
            native_pools = pools()
            native_clients = [client() for _ in NATIVE]
        else:
            opts = {**svc.backend_options(shm=True), "shm_pool_size": 5 * pages * (page + HEADER_SIZE) + (64 << 20)}
            plugins = [_Plugin("plugin", opts, spec, pages, data, checks)]
            staged = False
            native_pools = (plugins[0].src, plugins[0].dst)
            native_clients = [plugins[0].backend.native] * len(NATIVE)  # one shm client per process and holder
        mem = plugins[0].backend._sess.mem
        areas = []
        for _ in range(2):
            if mode == "tcp":
                t = torch.zeros(pages * (page + HEADER_SIZE), dtype=torch.uint8)
                held.append((None, t.data_ptr(), t))
                areas.append(t.data_ptr())
            else:
                ptr, arr = mem.allocate(pages * (page + HEADER_SIZE))
                held.append((None, ptr, arr))
                areas.append(ptr)
        if mode == "tcp":
            for c in native_clients:
                for pool in native_pools:
                    assert pool.raw is not None
                    c.register_buffer(pool.raw.data_ptr(), pool.raw.numel())
                    held.append((c, pool.raw.data_ptr(), None))
                for a in areas:
                    c.register_buffer(a, pages * (page + HEADER_SIZE))
                    held.append((c, a, None))
        natives = [_Native(label, c, areas, native_pools, pages, cfg, checks)
                   for label, c in zip(NATIVE, native_clients, strict=True)]
        if warm:
            _warm(base.client, svc.segment_size, cfg)
        # each variant's reference: over TCP the baseline's calls on the variant's own client (the
        # speed of a Mooncake client of this process depends on its history: measured up to 1.45x
        # between two clients making the same calls); a shared-memory client cannot make the
        # baseline's calls, so there it is the baseline's own TCP client. The control's reference
        # is the main baseline (another client): how far the clients differ.
        ref: dict[str, _Baseline] = {control.name: base}
        for v in [*plugins, *natives]:
            ref[v.name] = base if mode == "shm" else _Baseline(
                "baseline", v.backend.native if isinstance(v, _Plugin) else v.client, bpools, cfg, checks, held)
        auto = plugins[1] if mode == "tcp" and not staged else plugins[0]
        bare = _BareHooks(auto)  # right after the variant auto picks; on its client, with its reference
        ref[bare.name] = ref[auto.name]
        variants: list[Any] = [control, *(x for p in plugins for x in ((p, bare) if p is auto else (p,))), *natives]
        res: dict[str, _Result] = {v.name: _Result() for v in (base, *variants)}
        for n in range(rounds):
            groups = [secrets.token_hex(32) for _ in range(pages)]
            for v in variants[n % len(variants) :] + variants[: n % len(variants)]:
                r, pair = res[v.name], []
                for step in ("before", "variant", "after"):  # B v B on the variant's reference
                    if step == "variant":
                        base.client.batch_remove(v.round(groups, r.times, n), True)
                        continue
                    out: Times = {m: [] for m in r.times}
                    base.client.batch_remove(ref[v.name].round(groups, out), True)
                    for m, x in out.items():
                        res["baseline"].times[m] += x
                    pair.append(out)
                for m in MEASURES:
                    if len(r.times[m]) == n + 1:
                        r.rel[m].append(r.times[m][-1] / ((pair[0][m][0] + pair[1][m][0]) / 2))
        return _rows(mode, page, pages, res, auto.name, staged)
    finally:
        for c, ptr, _ in held:
            if c is not None:
                c.unregister_buffer(ptr)
        for p in plugins:
            p.store.close()
        for c in clients:
            c.close()


def _rows(mode: str, page: int, pages: int, res: dict[str, _Result], auto: str, staged: bool) -> list[Row]:
    """Rows (GB/s from median seconds, ratios as medians of per-round ratios) and the cost
    breakdown on the row of the variant ``auto`` picks (ms per batch; its bare hooks are the
    variant named ``f"{auto}, bare hooks"``)."""
    total = pages * page
    b = res["baseline"].times
    base_ms = {m: 1e3 * _med(b[m]) for m in MEASURES}

    def row(name: str, set_s: float, get_s: float, rel: dict[str, list[float]] | None,
            exist: float | None = None, costs: dict[str, float] | None = None) -> Row:
        sr = [1 / x for x in rel["set"]] if rel else [1.0]
        gr = [1 / x for x in rel["get"]] if rel else [1.0]
        return Row(mode, name, page, pages, total / set_s / 1e9, total / get_s / 1e9, _med(sr), _med(gr), sr, gr,
                   exist * 1e6 if exist else None, costs)

    def cost(a: str, b_: str, m: str) -> float:
        """ms per batch that variant ``a`` spends over ``b_`` on ``m`` (paired, normalised)."""
        return base_ms[m] * _med([x - y for x, y in zip(res[a].rel[m], res[b_].rel[m], strict=True)])

    rows = [row("baseline", _med(b["set"]), _med(b["get"]), None, _med(b["exist"]))]
    bare = f"{auto}, bare hooks"
    for name in (n for n in res if n != "baseline"):
        r = res[name]
        t = r.times
        costs = None
        if name == auto:
            own = "native: one slot per page" if staged else "native: header slot + buffers"
            hb, kv = "native: header slot + buffers", "native: K/V objects, no exist"
            costs = {
                "core header": 1e3 * _med(res[bare].times["header"]),
                # the Store's set over the bare hooks given ready headers: its hop, plus whatever of the
                # headers it makes on demand (headers_on_demand) does not hide behind the transfer
                "store over bare set": cost(name, bare, "set"),
                "core verify": cost(name, bare, "get"),
                "core verify alone": 1e3 * _med(res[bare].times["verify"]),
                "exist": 1e3 * _med(b["base exist"]),
                "one object vs K/V set": cost(hb, kv, "set"),
                "one object vs K/V get": cost(hb, kv, "get"),
                "header slot set": cost(hb, "native: buffers, no header slot", "set"),
                "header slot get": cost(hb, "native: buffers, no header slot", "get"),
                "16 MiB calls set": cost(TWIN, hb, "set"),
                "16 MiB calls get": cost(TWIN, hb, "get"),
                "backend set": cost(bare, own, "set"),
                "backend get": cost(bare, own, "get"),
                "baseline set": base_ms["set"],
                "baseline get": base_ms["get"],
            }
        exist = _med(t["exist"]) if t["exist"] else None
        rows.append(row(name, _med(t["set"]), _med(t["get"]), r.rel, exist, costs))
    return rows


def goals(rows: list[Row], staged_max_page_bytes: int) -> list[Goal]:
    """The issue's goals at every (mode, page size) run: the plugin's variant that ``auto`` picks,
    its ratio and per-round ratios, the ceiling of its layout (the native row), Mooncake's raw
    client with MooncakeStore's layout, and the two-baseline control of the same run."""
    out: list[Goal] = []
    cases = list(dict.fromkeys((r.mode, r.page_nbytes) for r in rows))  # in the order they ran
    for mode, page in cases:
        by = {r.variant: r for r in rows if r.mode == mode and r.page_nbytes == page}
        if mode == "tcp":
            staged = page <= staged_max_page_bytes
            name = "plugin staged" if staged else "plugin direct"
        else:
            staged, name = False, "plugin"
        ceiling = "native: one slot per page" if staged else "native: header slot + buffers"
        raw = "native: K/V objects, no exist"
        p, bare = by[name], by[f"{name}, bare hooks"]
        core = p.costs_ms or {}
        # the 16 MiB-calls row makes the ceiling's very calls when the batch fits one of them
        twin = by[TWIN] if not staged and _split_step(page + HEADER_SIZE) >= p.pages else None
        for op in ("set", "get"):
            gbps = getattr(p, f"{op}_gbps")
            top = getattr(by[ceiling], f"{op}_ratio")
            # the core's own work on these pages, each timed alone in this run
            alone, base_ms = core.get("core header" if op == "set" else "core verify alone"), core.get(f"baseline {op}")
            with_core = 1 / (1 / top + alone / base_ms) if alone is not None and base_ms and top > 0 else None
            out.append(Goal(mode, page, op, name, getattr(p, f"{op}_ratio"), getattr(p, f"{op}_ratios"), GOALS[mode],
                            ceiling, top, raw, getattr(by[raw], f"{op}_ratio"),
                            getattr(by["baseline, 2nd client"], f"{op}_ratio"), getattr(bare, f"{op}_ratio"),
                            alone if alone is not None else 0.0,
                            1e3 * p.pages * p.page_nbytes / gbps / 1e9 if gbps else 0.0,
                            getattr(twin, f"{op}_ratio") if twin is not None else None, with_core))
    return out


def run(modes: list[str], page_sizes: list[int], pages: int, rounds: int,
        echo: Callable[[str], None] = print) -> Report:
    """Start a store, run every (mode, page size) case, stop the store."""
    segment = max(1 << 30, 8 * pages * (max(page_sizes) + HEADER_SIZE))
    rows: list[Row] = []
    checks = Checks()
    with MooncakeService.start(segment_size=segment) as svc:
        # measured: the first Mooncake client of a process gets about 25% slower than later ones
        # (same native call, same layout, same run), so an unused client comes first and no
        # measured client (baseline or plugin) is the first
        anchor = new_client(MooncakeOptions.model_validate(svc.backend_options()))
        try:
            for n, (mode, size) in enumerate((m, s) for m in modes for s in page_sizes):
                for row in run_case(svc, mode, size, pages, rounds, checks, warm=n == 0):
                    echo(format_row(row))
                    rows.append(row)
        finally:
            anchor.close()
    report = Report(rows, goals(rows, MooncakeOptions.model_fields["staged_max_page_bytes"].default), checks.result())
    for g in report.goals:
        echo(format_goal(g))
    for name, ok in report.checks.items():
        echo(f"check {name}: {'holds' if ok else 'BROKEN in ' + ', '.join(sorted(set(checks.broken[name])))}")
    return report


HEADER = (f"{'mode':<4} {'page':>8} {'batch':>5}  {'variant':<32} | {'set GB/s':>8} {'get GB/s':>8} | "
          f"{'set x':>5} {'get x':>5} | {'exist us/key':>12}")


def _page(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB"


def format_row(r: Row) -> str:
    exist = f"{r.exist_us_per_key:>12.2f}" if r.exist_us_per_key is not None else f"{'':>12}"
    line = (f"{r.mode:<4} {_page(r.page_nbytes):>8} {r.pages:>5}  {r.variant:<32} | {r.set_gbps:>8.2f} "
            f"{r.get_gbps:>8.2f} | {r.set_ratio:>5.2f} {r.get_ratio:>5.2f} | {exist}")
    if r.costs_ms:
        line += "\n      costs, ms per batch: " + ", ".join(f"{k} {v:.2f}" for k, v in r.costs_ms.items())
    return line


def format_goal(g: Goal) -> str:
    spread = f"{min(g.ratios):.2f}-{max(g.ratios):.2f}" if g.ratios else "-"
    twin = f" (its twin, the same calls: {g.twin:.2f}x)" if g.twin is not None else ""
    work = "header" if g.op == "set" else "verification"
    with_core = f", the ceiling plus the core's {work} made alone {g.with_core:.2f}x" if g.with_core is not None else ""
    return (f"goal {g.mode} {_page(g.page_nbytes)} {g.op}: {g.variant} {g.ratio:.2f}x (rounds {spread}) "
            f">= {g.goal:.1f}x: {'met' if g.met else 'NOT MET'}; same run: ceiling ({g.ceiling_variant}) "
            f"{g.ceiling:.2f}x{twin}{with_core}, Mooncake raw ({g.raw_variant}) {g.raw:.2f}x, the backend's hooks "
            f"without the core's {work} {g.bare:.2f}x (the core's {work}: {g.core_ms:.1f} of {g.plugin_ms:.1f} ms), "
            f"control (baseline, 2nd client) {g.control:.2f}x")
