"""The pool binding and the open pool model: row geometry, the hit rule, and the controller over any
number of pools (DSA indexers, sliding windows, recurrent state, their drafts) on a real store."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import (
    Attention,
    CacheController,
    Capabilities,
    Component,
    ConfigError,
    HitPolicy,
    HostPool,
    IOPath,
    Layout,
    PageResult,
    PageTransfer,
    PoolCapability,
    PoolKind,
    PoolSpec,
    Store,
    hookimpl,
    load_config,
    plan_binding,
    register_backend,
    unregister_backend,
    usable_hit,
)
from hicache_draft.binding import PoolBinding, SlotPages, Staging, query_hit
from hicache_draft.config import ParallelConfig
from hicache_draft.keys import pool_identities
from hicache_draft.page_format import HEADER_SIZE
from hicache_draft.paths import plan_paths
from hicache_draft.store import attach_headers
from hicache_draft.testing import MemoryBackend
from hicache_draft.transfer import Buffer

PS = 4
ROW_LAYOUTS = [Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT]
EVERY = frozenset(Component)


def every_component(**kw: Any) -> PoolCapability:
    return PoolCapability(attention=frozenset(Attention), zero_copy_layouts=frozenset(Layout), components=EVERY, **kw)


ALL_CAPS = Capabilities(pools={PoolKind.KV: every_component(), PoolKind.DRAFT: every_component()},
                        split_heads=True, persistent=True)


@pytest.fixture
def memory():
    MemoryBackend.reset()
    cls = type("Everything", (MemoryBackend,), {"capabilities": ALL_CAPS})
    register_backend("memory", cls)
    yield cls
    unregister_backend("memory")
    MemoryBackend.reset()


def test_the_classic_pools_keep_the_keys_of_key_format_2():
    """Values computed with the code before open pools (commit cf23ee5): stores written then still hit."""
    common: dict[str, Any] = dict(pp_rank=0, pp_size=1, page_size=4)
    kv = pool_identities(pool=PoolKind.KV, model="m", dtype="bfloat16", attention=Attention.MHA, layers=2,
                         layout=Layout.PAGE_FIRST, kv_heads=4, head_dim=8, latent_dim=None, tp_rank=1, tp_size=2,
                         tp_lcm_size=4, **common)
    draft = pool_identities(pool=PoolKind.DRAFT, model="d", dtype="bfloat16", attention=Attention.MLA, layers=1,
                            layout=Layout.PAGE_FIRST, kv_heads=None, head_dim=None, latent_dim=24, tp_rank=0,
                            tp_size=1, tp_lcm_size=None, target_model="m", **common)
    assert [i.fingerprint() for i in kv] == ["79398c53ecede5468cb1d14f", "99c6d50d65357c46be378f60"]
    assert draft[0].fingerprint() == "4b441d712a29ff85f72a32e8"


# -- row geometry -------------------------------------------------------------------------------------
def row_spec(layout: Layout, rows: tuple[int, ...], name: str = "indexer", layers: int = 3) -> PoolSpec:
    return PoolSpec(kind=name, attention=None, layers=layers, page_size=PS, dtype="uint8", layout=layout, rows=rows)


def manual_page(arrays: list[torch.Tensor], layout: Layout, page: int) -> bytes:
    """A row page's bytes from first principles: array after array, layer after layer."""
    out = b""
    for a in arrays:
        for layer in range(a.shape[0] if layout is Layout.LAYER_FIRST else a.shape[1]):
            row = a[layer, page] if layout is Layout.LAYER_FIRST else a[page, layer, 0]
            out += bytes(row.tolist())
    return out


@pytest.mark.parametrize(("layout", "rows"), list(itertools.product(ROW_LAYOUTS, [(12,), (8, 20, 4)])))
def test_row_pools_store_the_same_bytes_zero_copy_and_staged(layout, rows):
    spec = row_spec(layout, rows)
    pool = HostPool(spec, 5)
    pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8))
    assert spec.page_nbytes == 3 * sum(rows)
    assert spec.buffers_per_page() == len(rows) * (3 if layout is Layout.LAYER_FIRST else 1)
    index = pool.slot_buffers()
    for page in range(5):
        slot = page * PS
        want = manual_page(list(pool.arrays), layout, page)
        zc = b"".join(bytes(b.view()) for b in pool.page_buffers(slot))
        assert zc == want == pool.page_bytes(slot)
        assert index.buffers([slot])[0] == pool.page_buffers(slot)  # one stride per array
    other = HostPool(spec, 5)
    row = torch.empty(spec.page_nbytes, dtype=torch.uint8)
    pool.copy_page_out(8, row)
    other.copy_page_in(12, row)
    assert other.page_bytes(12) == pool.page_bytes(8)


def test_a_row_pool_over_separate_tensors_is_the_same_pool():
    """SGLang's Mamba host pool keeps its temporal and conv states in separate tensors."""
    spec = row_spec(Layout.PAGE_FIRST, (16, 6), name="mamba", layers=2)
    one = HostPool(spec, 4)
    one.raw.copy_(torch.randint(0, 256, one.raw.shape, dtype=torch.uint8))
    arrays = [a.clone() for a in one.arrays]
    wrapped = HostPool.wrap_arrays(spec, arrays)
    assert wrapped.num_pages == 4 and len(wrapped.regions()) == 2
    for slot in (0, 4, 12):
        assert wrapped.page_bytes(slot) == one.page_bytes(slot)
    with pytest.raises(ValueError, match="different numbers of pages"):
        HostPool.wrap_arrays(spec, [arrays[0], arrays[1][:2]])


@pytest.mark.parametrize(("kw", "words"), [
    ({"kind": "lightning", "rows": (8,)}, "not a known pool name: its spec needs a role"),
    ({"rows": (8,), "attention": Attention.MLA}, "attention must be None"),
    ({"rows": ()}, "needs rows"),
    ({"rows": (8,), "layout": Layout.PAGE_HEAD}, "page_head"),
    ({"rows": (8,), "dtype": "bfloat16"}, "row pools are bytes"),
    ({"kind": "Bad-Name", "rows": (8,)}, "must match"),
    ({"kind": "swa", "attention": Attention.MHA, "kv_heads": 2, "head_dim": 8, "dtype": "bfloat16",
      "sharded": False}, "sharded by heads"),
])
def test_pool_specs_name_what_is_wrong(kw, words):
    args: dict[str, Any] = dict(kind="indexer", attention=None, layers=1, page_size=PS, dtype="uint8",
                                layout=Layout.PAGE_FIRST)
    args.update(kw)
    with pytest.raises(ValueError, match=words):
        PoolSpec(**args)


def test_known_pool_names_carry_role_component_and_policy():
    swa = PoolSpec(kind="draft_swa", attention=Attention.MHA, layers=1, page_size=PS, dtype="bfloat16",
                   layout=Layout.PAGE_FIRST, kv_heads=2, head_dim=8)
    assert (swa.role, swa.component, swa.hit_policy, swa.window_pages) == (
        PoolKind.DRAFT, Component.WINDOW, HitPolicy.TRAILING_PAGES, 1)
    mamba = row_spec(Layout.PAGE_FIRST, (8,), name="mamba")
    assert mamba.sharded and not row_spec(Layout.PAGE_FIRST, (8,)).sharded


# -- planning ------------------------------------------------------------------------------------------
def test_a_component_the_backend_does_not_declare_is_disabled_with_the_reason():
    caps = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset(Attention))})
    plan = plan_binding(row_spec(Layout.PAGE_FIRST, (8,)), caps, ParallelConfig(), model="m", target_model="m")
    assert plan.path is IOPath.DISABLED
    assert "does not declare the 'indexer' component for 'kv' pools" in plan.reason


def test_replicated_row_pools_are_written_by_rank_0_and_sharded_ones_by_every_rank():
    par = ParallelConfig(tp_rank=1, tp_size=2)
    idx = plan_binding(row_spec(Layout.PAGE_FIRST, (8,)), ALL_CAPS, par, model="m", target_model="m")
    state = plan_binding(row_spec(Layout.PAGE_FIRST, (8,), name="mamba"), ALL_CAPS, par, model="m", target_model="m")
    idx0 = plan_binding(row_spec(Layout.PAGE_FIRST, (8,)), ALL_CAPS, ParallelConfig(tp_size=2), model="m",
                        target_model="m")
    assert (idx.writer, state.writer) == (False, True)
    assert idx.namespaces == idx0.namespaces  # rank-neutral keys
    state0 = plan_binding(row_spec(Layout.PAGE_FIRST, (8,), name="mamba"), ALL_CAPS, ParallelConfig(tp_size=2),
                          model="m", target_model="m")
    assert state.namespaces != state0.namespaces


def test_pools_of_other_names_or_components_never_share_keys():
    specs = [row_spec(Layout.PAGE_FIRST, (8,), name=n) for n in ("indexer", "draft_indexer", "mamba")]
    specs.append(PoolSpec(kind="custom", attention=None, layers=3, page_size=PS, dtype="uint8",
                          layout=Layout.PAGE_FIRST, rows=(8,), role=PoolKind.KV, component=Component.STATE))
    names = {plan_binding(s, ALL_CAPS, ParallelConfig(), model="m", target_model="m").namespaces for s in specs}
    assert len(names) == len(specs)


# -- the hit rule ---------------------------------------------------------------------------------------
class _Fake:
    """Just what usable_hit reads of a binding."""

    def __init__(self, name: str, role: PoolKind, policy: HitPolicy, window: int = 0) -> None:
        self.name, self.active = name, True
        self.spec = type("S", (), {"role": role, "hit_policy": policy, "window_pages": window})()


def stored_windows(stored_pages):
    """usable_hit's window_stored over a set of stored pages per pool."""
    def window(b, n):
        got = 0
        for page in range(n - 1, max(-1, n - 1 - b.spec.window_pages), -1):
            if page not in stored_pages[b.name]:
                break
            got += 1
        return got
    return window


def hit(pools, prefix, stored_pages, limit, draft_gates=True):
    return usable_hit(pools, prefix, stored_windows(stored_pages), limit=limit, draft_gates=draft_gates)


KV_ = _Fake("kv", PoolKind.KV, HitPolicy.ALL_PAGES)
IDX = _Fake("indexer", PoolKind.KV, HitPolicy.ALL_PAGES)
DRAFT_IDX = _Fake("draft_indexer", PoolKind.DRAFT, HitPolicy.ALL_PAGES)
SWA = _Fake("swa", PoolKind.KV, HitPolicy.TRAILING_PAGES, window=2)


def test_the_hit_is_the_minimum_over_all_pages_pools():
    got = hit([KV_, IDX, DRAFT_IDX], {"kv": 9, "indexer": 6, "draft_indexer": 7}, {}, limit=8)
    assert (got.pages, got.draft_pages) == (6, 6)
    assert got.boundaries == {"kv": 8, "indexer": 6, "draft_indexer": 7}


@settings(max_examples=200, deadline=None)
@given(prefix=st.integers(-3, 40), limit=st.integers(0, 30), gates=st.booleans(), active=st.booleans())
def test_the_target_alone_is_answered_as_with_a_pool_that_holds_everything(prefix, limit, gates, active):
    """The target alone (the usual query, answered without the window machinery) gives the hit and
    boundary the general rule gives when another pool holding every page is asked with it."""
    kv = _Fake("kv", PoolKind.KV, HitPolicy.ALL_PAGES)
    kv.active = active
    full = _Fake("indexer", PoolKind.KV, HitPolicy.ALL_PAGES)
    alone = hit([kv], {"kv": prefix}, {}, limit=limit, draft_gates=gates)
    both = hit([kv, full], {"kv": prefix, "indexer": limit}, {}, limit=limit, draft_gates=gates)
    assert (alone.pages, alone.draft_pages) == (both.pages, both.draft_pages)
    assert alone.boundaries == {k: v for k, v in both.boundaries.items() if k == "kv"}


def test_a_missing_draft_component_shortens_the_hit_or_only_the_draft_prefix():
    shorten = hit([KV_, DRAFT_IDX], {"kv": 8, "draft_indexer": 3}, {}, limit=8)
    target_only = hit([KV_, DRAFT_IDX], {"kv": 8, "draft_indexer": 3}, {}, limit=8, draft_gates=False)
    assert (shorten.pages, shorten.draft_pages) == (3, 3)
    assert (target_only.pages, target_only.draft_pages) == (8, 3)


def test_trailing_pools_are_checked_over_their_window_only():
    # the window holds pages 6, 7 only: the whole prefix of 8 counts though pages 0-5 are absent
    assert hit([KV_, SWA], {"kv": 8}, {"swa": {6, 7}}, limit=8).pages == 8
    # page 7 absent: the window must end before it, at 7 (pages 5, 6) - 5 absent too, so at 5 (3, 4)
    assert hit([KV_, SWA], {"kv": 8}, {"swa": {3, 4, 6}}, limit=8).pages == 5
    # no window anywhere: no hit
    assert hit([KV_, SWA], {"kv": 8}, {"swa": set()}, limit=8).pages == 0


def _brute_hit(pools, prefix, stored_pages, limit):
    """The rule as written: the largest n <= limit that every all_pages pool holds from page 0 and
    every trailing pool over its last min(window, n) pages."""
    def holds(b, n):
        if b.spec.hit_policy is HitPolicy.ALL_PAGES:
            return prefix.get(b.name, 0) >= n
        return all(p in stored_pages[b.name] for p in range(n - min(b.spec.window_pages, n), n))
    return max([n for n in range(max(0, limit) + 1) if all(holds(b, n) for b in pools if b.active)], default=0)


_POOL = st.tuples(st.sampled_from([PoolKind.KV, PoolKind.DRAFT]), st.booleans(), st.integers(1, 4), st.booleans())


@settings(max_examples=300, deadline=None)
@given(pools=st.lists(_POOL, min_size=1, max_size=4), limit=st.integers(0, 12), gates=st.booleans(),
       data=st.data())
def test_the_hit_is_the_largest_prefix_every_pool_holds(pools, limit, gates, data):
    """Any mix of all_pages and trailing pools, target and draft role, active or not: the hit (and
    the draft prefix) is the largest the rule allows, found by trying every length."""
    fakes, prefix, stored = [], {}, {}
    for i, (role, trailing, window, active) in enumerate(pools):
        f = _Fake(f"p{i}", role, HitPolicy.TRAILING_PAGES if trailing else HitPolicy.ALL_PAGES, window)
        f.active = active
        fakes.append(f)
        prefix[f.name] = data.draw(st.integers(0, 14))
        stored[f.name] = set(data.draw(st.lists(st.integers(0, 13), max_size=10)))

    got = usable_hit(fakes, prefix, stored_windows(stored), limit=limit, draft_gates=gates, probes=limit + 2)
    drafts = [f for f in fakes if f.spec.role is PoolKind.DRAFT]
    if gates:
        want = _brute_hit(fakes, prefix, stored, limit)
        assert (got.pages, got.draft_pages) == (want, want if any(f.active for f in drafts) else 0)
    else:
        want = _brute_hit([f for f in fakes if f.spec.role is not PoolKind.DRAFT], prefix, stored, limit)
        assert got.pages == want
        if any(f.active for f in drafts):
            assert got.draft_pages == _brute_hit(drafts, prefix, stored, want)
    for f in fakes:
        if f.active and (gates or f.spec.role is not PoolKind.DRAFT) and f.spec.hit_policy is HitPolicy.ALL_PAGES:
            assert got.boundaries[f.name] == min(limit, prefix[f.name])


class _KeyedFake(_Fake):
    """A fake binding with keys: each page stored as ``split`` head parts."""

    def __init__(self, name: str, role: PoolKind, policy: HitPolicy, window: int, split: int) -> None:
        super().__init__(name, role, policy, window)
        self.split = split

    def keys(self, hashes):
        return [f"{h}.{self.name}.{part}" for h in hashes for part in range(self.split)]


@settings(max_examples=300, deadline=None)
@given(pools=st.lists(st.tuples(_POOL, st.integers(1, 3)), min_size=1, max_size=4), n=st.integers(0, 12),
       gates=st.booleans(), data=st.data())
def test_query_hit_asks_the_store_what_the_hit_rule_needs(pools, n, gates, data):
    """query_hit over a store holding any pages (a page counts only with every head part) gives what
    usable_hit gives over those pages, asks the store only for active pools, and hands the prefix
    query the caller's hashes object itself (the SGLang adapter keeps remembered keys on it)."""
    fakes, stored_keys, full = [], set(), {}
    for i, ((role, trailing, window, active), split) in enumerate(pools):
        f = _KeyedFake(f"p{i}", role, HitPolicy.TRAILING_PAGES if trailing else HitPolicy.ALL_PAGES, window, split)
        f.active = active
        fakes.append(f)
        parts = data.draw(st.sets(st.tuples(st.integers(0, 13), st.integers(0, split - 1)), max_size=3 * split * 5))
        stored_keys |= {f"h{page}.{f.name}.{part}" for page, part in parts}
        full[f.name] = {p for p in range(14) if all((p, q) in parts for q in range(split))}
    windows = {f.name: data.draw(st.integers(1, 5)) for f in fakes if f.spec.hit_policy is HitPolicy.TRAILING_PAGES
               and data.draw(st.booleans())}
    hashes = [f"h{i}" for i in range(n)]
    asked: list[str] = []
    handed: list[bool] = []

    def exists(query):
        asked.extend(query)
        return {name: next((i for i, k in enumerate(keys) if k not in stored_keys), len(keys))
                for name, keys in query.items()}

    def keys_of(b, hs):
        handed.append(hs is hashes)
        return b.keys(hs)

    got = query_hit(exists, fakes, hashes, keys_of, draft_gates=gates, windows=windows or None)
    prefix = {f.name: next((p for p in range(n) if p not in full[f.name]), n)
              for f in fakes if f.active and f.spec.hit_policy is HitPolicy.ALL_PAGES}

    def window_stored(b, end):
        size = windows.get(b.name, b.spec.window_pages)
        return next((j for j, p in enumerate(range(end - 1, max(-1, end - 1 - size), -1)) if p not in full[b.name]),
                    min(size, end))

    want = usable_hit(fakes, prefix, window_stored, limit=n, draft_gates=gates, windows=windows or None)
    assert got == want
    assert set(asked) <= {f.name for f in fakes if f.active}
    prefix_queries = sum(f.active and f.spec.hit_policy is HitPolicy.ALL_PAGES for f in fakes)
    assert handed[:prefix_queries] == [True] * prefix_queries


def test_query_hit_asks_a_window_last_page_first():
    """A window whose older pages are stored but whose last page is not ends before that page."""
    kv = _KeyedFake("kv", PoolKind.KV, HitPolicy.ALL_PAGES, 0, 1)
    swa = _KeyedFake("swa", PoolKind.KV, HitPolicy.TRAILING_PAGES, 2, 1)
    stored = {f"h{p}.kv.0" for p in range(7)} | {"h4.swa.0", "h5.swa.0"}

    def exists(query):
        return {name: next((i for i, k in enumerate(keys) if k not in stored), len(keys))
                for name, keys in query.items()}

    got = query_hit(exists, [kv, swa], [f"h{i}" for i in range(7)], _KeyedFake.keys)
    assert got.pages == 6  # page 6 has no window page; pages 5, 4 close the window of a 6-page hit


# -- the controller over every pool, on a store ------------------------------------------------------
def config(extra: list[dict[str, Any]], on_miss: str = "shorten", space: str = "b") -> Any:
    return load_config(data={
        "backend": "memory", "backend_options": {"space": space},
        "namespace": {"model": "dsa-target", "draft_model": "dsa-draft", "page_size": PS},
        "target": {"attention": "mla", "layers": 2, "latent_dim": 24, "layout": "page_first"},
        "draft": {"enabled": True, "attention": "mla", "layers": 1, "latent_dim": 16, "on_miss": on_miss},
        "pools": extra,
    })


INDEXER = {"name": "indexer", "layers": 2, "row_bytes": [PS * 10]}
DRAFT_INDEXER = {"name": "draft_indexer", "layers": 1, "row_bytes": [PS * 10]}
WINDOW = {"name": "swa", "attention": "mha", "kv_heads": 2, "head_dim": 8, "layers": 1, "window_pages": 2}
STATE = {"name": "mamba", "layers": 2, "row_bytes": [24, 8]}
ALL_EXTRA = [INDEXER, DRAFT_INDEXER, WINDOW, STATE]
PAGES = 6
TOKENS = list(range(100, 100 + PAGES * PS))
SLOTS = [i * PS for i in range(PAGES)]


def controller(cfg: Any) -> CacheController:
    return CacheController(cfg, Store.open("memory", dict(cfg.backend_options)), num_pages=8)


def fill(ctrl: CacheController, seed: int) -> dict[str, list[bytes]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, b in ctrl.bindings.items():
        b.host.raw.copy_(torch.randint(0, 256, b.host.raw.shape, dtype=torch.uint8, generator=gen))
        out[name] = [b.host.page_bytes(s) for s in SLOTS]
    return out


def restore(cfg: Any, dst: list[int]) -> tuple[Any, CacheController]:
    reader = controller(cfg)
    return reader.prefetch(TOKENS, dst), reader


def test_every_pool_comes_back_byte_exact_after_a_restart(memory):
    cfg = config(ALL_EXTRA)
    writer = controller(cfg)
    assert all(b.active for b in writer.bindings.values()), {n: b.reason for n, b in writer.bindings.items()}
    before = fill(writer, 1)
    res = writer.backup(TOKENS, SLOTS)
    assert res.pages_written == {name: PAGES for name in writer.bindings}
    writer.close()
    dst = [s + PS for s in SLOTS]  # other slots than the writer's
    got, reader = restore(cfg, dst)
    try:
        assert (got.pages, got.draft_cold) == (PAGES, [])
        assert got.restored == {"kv": 6, "draft": 6, "indexer": 6, "draft_indexer": 6, "swa": 2, "mamba": 1}
        for name, b in reader.bindings.items():
            pages = range(PAGES) if b.spec.hit_policy is HitPolicy.ALL_PAGES else range(
                PAGES - b.spec.window_pages, PAGES)
            assert [b.host.page_bytes(dst[i]) for i in pages] == [before[name][i] for i in pages], name
    finally:
        reader.close()


class CallLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    @hookimpl
    def call_done(self, backend, hook, outcome, seconds, transfers, results):
        self.calls.append((hook, [str(t.pool) for t in transfers or ()]))


class HandedLog:
    def __init__(self) -> None:
        self.seen: list[PageTransfer] = []

    @hookimpl
    def call_done(self, backend, hook, outcome, seconds, transfers, results):
        self.seen.extend(transfers)


def test_observers_see_the_pages_the_backend_was_handed_not_a_second_build(memory):
    """A zero-copy batch named by slot is built once, by the Store, with its headers: ``call_done``
    gets those pages (lists, headers set), not the pending ones, which it would build again."""
    spec = PoolSpec(kind="kv", layers=2, page_size=PS, dtype="bfloat16", **ZERO_COPY_SPECS["mha page_first"])
    b = PoolBinding(plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m"), HostPool(spec, 6))
    log = HandedLog()
    store = Store.open("memory", {}, observers=[log])
    try:
        for hook in ("page_set", "page_get"):
            batch = b.slot_batch(["0a", "0b"], [0, 2 * PS], fill=hook == "page_set")
            assert isinstance(batch.transfer.pages, SlotPages)
            got = store.page_set([batch.transfer]) if hook == "page_set" else store.page_get([batch.transfer])[0]
            assert got[PoolKind.KV] == [PageResult.OK] * 2
            (handed,) = log.seen
            log.seen.clear()
            assert type(handed.pages) is list and [p.key for p in handed.pages] == b.keys(["0a", "0b"])
            assert all(p.header is not None for p in handed.pages)
            assert batch.transfer.pages._built is None  # never built without headers
    finally:
        store.close()


def test_all_pools_of_a_batch_go_in_one_call(memory):
    cfg = config(ALL_EXTRA)
    log = CallLog()
    ctrl = CacheController(cfg, Store.open("memory", dict(cfg.backend_options), observers=[log]), num_pages=8)
    fill(ctrl, 2)
    ctrl.backup(TOKENS, SLOTS)
    ctrl.prefetch(TOKENS, [s + PS for s in SLOTS])
    sets = [pools for hook, pools in log.calls if hook == "page_set"]
    gets = [pools for hook, pools in log.calls if hook == "page_get"]
    assert len(sets) == 1 and sorted(sets[0]) == sorted(ctrl.bindings)
    # the prefix's pools in one call, then the trailing windows in one call
    assert [sorted(g) for g in gets] == [["draft", "draft_indexer", "indexer", "kv"], ["mamba", "swa"]]
    ctrl.close()


def test_without_the_target_indexer_stored_there_is_no_hit(memory):
    """An all-pages pool that is missing makes the whole hit 0: KV without its indexer is useless."""
    writer = controller(config([DRAFT_INDEXER]))
    fill(writer, 3)
    writer.backup(TOKENS, SLOTS)
    writer.close()
    got, reader = restore(config([INDEXER, DRAFT_INDEXER]), [s + PS for s in SLOTS])
    assert (got.pages, got.hit["indexer"], got.hit["kv"]) == (0, 0, PAGES)
    reader.close()


@pytest.mark.parametrize("on_miss", ["shorten", "target_only"])
def test_a_missing_draft_indexer_never_leaves_stale_draft_state(memory, on_miss):
    """The #28895 failure: draft KV stored, its indexer not. shorten: no hit; target_only: all draft-cold."""
    writer = controller(config([INDEXER]))
    fill(writer, 4)
    writer.backup(TOKENS, SLOTS)
    writer.close()
    got, reader = restore(config([INDEXER, DRAFT_INDEXER], on_miss=on_miss), [s + PS for s in SLOTS])
    try:
        if on_miss == "shorten":
            assert (got.pages, got.draft_cold) == (0, [])
        else:
            assert got.pages == PAGES and got.draft_cold == list(range(PAGES))
            assert got.restored["draft_indexer"] == 0 and got.restored["draft"] == 0
    finally:
        reader.close()


def test_a_window_missing_at_the_end_moves_the_hit_before_it(memory):
    writer = controller(config([WINDOW]))
    fill(writer, 5)
    writer.backup(TOKENS[: 4 * PS], SLOTS[:4])  # every pool, pages 0-3
    writer.close()
    short = controller(config([]))
    fill(short, 5)
    short.backup(TOKENS, SLOTS)  # kv and draft only, pages 0-5
    short.close()
    got, reader = restore(config([WINDOW]), [s + PS for s in SLOTS])
    assert (got.pages, got.restored["swa"], got.hit["swa"]) == (4, 2, 4)
    reader.close()


def test_extra_pools_in_the_config_are_validated_with_clear_errors():
    cases = [
        ({"name": "lightning", "row_bytes": [8]}, "not a known pool name: give its role and component"),
        ({"name": "indexer"}, "needs row_bytes"),
        ({"name": "swa", "attention": "mha", "kv_heads": 2}, "needs kv_heads and head_dim"),
        ({"name": "indexer", "row_bytes": [8], "attention": "mla"}, "holds bytes"),
        ({"name": "kv", "row_bytes": [8]}, "configured by [target]"),
        ({"name": "Index", "row_bytes": [8]}, "pools.0.name"),
        ({**WINDOW, "sharded": False}, "sharded by heads"),
    ]
    for pool, words in cases:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            config([pool])
    with pytest.raises(ConfigError, match="configured twice"):
        config([INDEXER, INDEXER])


def test_draft_role_pools_are_off_with_the_draft_and_check_says_so():
    cfg = load_config(data={
        "namespace": {"model": "m", "page_size": PS}, "target": {"attention": "mla", "latent_dim": 8},
        "pools": [INDEXER, DRAFT_INDEXER],
    })
    plan = plan_paths(cfg, ALL_CAPS)
    assert plan["indexer"].path is IOPath.ZERO_COPY
    assert plan["draft_indexer"].path is IOPath.DISABLED and "draft offload is off" in plan["draft_indexer"].reason


def test_a_binding_refuses_a_host_pool_of_another_shape():
    spec = row_spec(Layout.PAGE_FIRST, (8,))
    plan = plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m")
    with pytest.raises(ValueError, match="does not match"):
        PoolBinding(plan, HostPool(row_spec(Layout.PAGE_FIRST, (9,)), 2))


def test_a_target_pool_the_backend_cannot_hold_disables_every_pool(memory):
    """KV restored without its indexer gives wrong logits: a backend that does not hold the target's
    indexer offloads nothing for this model (the reason names the pool); check says the same."""
    kv_only = Capabilities(pools={PoolKind.KV: PoolCapability(attention=frozenset(Attention),
                                                                zero_copy_layouts=frozenset(Layout)),
                                  PoolKind.DRAFT: every_component()}, persistent=True)
    register_backend("memory", type("KvOnly", (MemoryBackend,), {"capabilities": kv_only}))
    cfg = config([INDEXER, DRAFT_INDEXER])
    ctrl = controller(cfg)
    try:
        assert not any(b.active for b in ctrl.bindings.values())
        assert all("the target 'indexer' pool is disabled" in b.reason for n, b in ctrl.bindings.items()
                   if n != "indexer")
        fill(ctrl, 6)
        assert ctrl.backup(TOKENS, SLOTS).pages_written == {}
        got = ctrl.prefetch(TOKENS, [s + PS for s in SLOTS])
        assert (got.pages, got.tokens) == (0, 0)
        plan = plan_paths(cfg, kv_only)
        assert {n: c.path for n, c in plan.items()} == {n: IOPath.DISABLED for n in plan}
        assert "does not declare the 'indexer' component" in plan["indexer"].reason
    finally:
        ctrl.close()


@pytest.mark.parametrize("shape", ["1-D", "2-D", "mixed types", "strided"])
def test_flat_pages_go_through_staging_byte_exact_whatever_their_shape(shape: str) -> None:
    """SGLang's generic path: flat pages copied into staging on a write and back out after a read.
    Contiguous CPU flats, whatever their shape and type, are copied in and out in one compiled call
    for the batch; others (here every other element of a wider tensor) take the per-page path.
    Both move exactly the pages' bytes, and a page whose read failed is left untouched."""
    spec = PoolSpec(kind="kv", attention=Attention.MHA, layers=2, page_size=PS, dtype="bfloat16",
                    layout=Layout.PAGE_FIRST, kv_heads=2, head_dim=8)
    plan = plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m")
    b = PoolBinding(plan, None, Staging(spec.page_nbytes, 4))
    numel = spec.page_nbytes // 2
    flats = [torch.randn(numel).to(torch.bfloat16) for _ in range(3)]
    if shape == "2-D":
        flats = [f.view(2, numel // 2) for f in flats]
    elif shape == "mixed types":
        flats = [flats[0], flats[1].view(torch.int16), flats[2]]
    elif shape == "strided":
        flats = [torch.stack([f, torch.zeros_like(f)], 1)[:, 0] for f in flats]
        assert not any(f.is_contiguous() for f in flats)
    want = [bytes(f.contiguous().view(-1).view(torch.uint8).tolist()) for f in flats]
    wrote = b.flat_batch(["a", "b", "c"], flats, fill=True)
    assert (wrote.flat_ptrs is not None) is (shape != "strided")
    staged = [bytes(r.tolist()) for r in wrote.staged]
    assert staged == want
    outs = [torch.zeros_like(f) for f in flats]
    if shape == "strided":
        outs = [torch.zeros(f.numel(), 2, dtype=f.dtype)[:, 0] for f in flats]
    read = b.flat_batch(["a", "b", "c"], outs, fill=False)
    assert (read.flat_ptrs is not None) is (shape != "strided")
    assert b.finish_get(read, [PageResult.OK, PageResult.FAILED, PageResult.OK]) == [True, False, True]
    got = [bytes(f.contiguous().view(-1).view(torch.uint8).tolist()) for f in outs]
    assert got == [want[0], bytes(len(want[1])), want[2]]


ZERO_COPY_SPECS = {
    "mha page_first": dict(attention=Attention.MHA, layout=Layout.PAGE_FIRST, kv_heads=2, head_dim=8),
    "mha layer_first": dict(attention=Attention.MHA, layout=Layout.LAYER_FIRST, kv_heads=2, head_dim=8),
    "mha page_head": dict(attention=Attention.MHA, layout=Layout.PAGE_HEAD, kv_heads=2, head_dim=8),
    "mla page_first": dict(attention=Attention.MLA, layout=Layout.PAGE_FIRST, latent_dim=16),
}


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(ZERO_COPY_SPECS)), data=st.data())
def test_zero_copy_pages_are_the_pools_own_buffers_from_a_cold_or_warm_cache(name: str, data: Any) -> None:
    """``slot_batch`` on the zero-copy path builds each page in one compiled call from the pool's
    stride template (or its slot cache): the same key, group, namespace and buffers as a page built
    from ``HostPool.page_buffers`` one by one, for any slots in any order, repeated or not."""
    from hicache_draft.transfer import Page

    spec = PoolSpec(kind="kv", layers=2, page_size=PS, dtype="bfloat16", **ZERO_COPY_SPECS[name])
    pool = HostPool(spec, 6)
    plan = plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m")
    b = PoolBinding(plan, pool)
    assert b.zero_copy
    pages = data.draw(st.lists(st.integers(0, 5), max_size=12))
    slots = [p * PS for p in pages]
    groups = [f"{p:x}{i:x}" for i, p in enumerate(pages)]
    for _ in range(2):  # the slot cache empty, then holding these slots
        batch = b.slot_batch(groups, slots, fill=False)
        assert isinstance(batch.transfer.pages, SlotPages) and len(batch.transfer.pages) == len(slots)
        want = [Page(k, g, b.namespaces[0], pool.page_buffers(s))
                for k, g, s in zip(b.keys(groups), groups, slots, strict=True)]
        assert list(batch.transfer.pages) == want and batch.transfer.zero_copy and batch.slots == slots
        assert all(type(p) is Page and p.header is None for p in batch.transfer.pages)
        assert all(buf.owner is pool for p in batch.transfer.pages for buf in p.buffers)
        # as the Store builds them: the same pages, each with its header in the block, in order
        block = bytearray(HEADER_SIZE * len(slots))
        whole = Buffer.of(block)
        (handed,) = attach_headers([batch.transfer], made=False)
        assert [replace(p, header=None) for p in handed.pages] == want
        assert [(p.header.ptr, p.header.nbytes) for p in handed.pages] == [
            (handed.pages[0].header.ptr + HEADER_SIZE * i, HEADER_SIZE) for i in range(len(slots))]
        if slots:
            built = batch.transfer.pages.build(whole.ptr, whole)
            assert [replace(p, header=None) for p in built] == want
            assert [p.header for p in built] == [Buffer(whole.ptr + HEADER_SIZE * i, HEADER_SIZE, whole)
                                                 for i in range(len(slots))]
            assert all(p.header.owner is whole for p in built)
    assert set(pool.slot_buffers().cache) == set(slots)


@pytest.mark.parametrize("bad", [1, -PS, 6 * PS, 6 * PS + 1])
def test_zero_copy_pages_refuse_a_slot_that_starts_no_page_before_making_any(bad: int) -> None:
    spec = PoolSpec(kind="kv", layers=2, page_size=PS, dtype="bfloat16", **ZERO_COPY_SPECS["mha page_first"])
    pool = HostPool(spec, 6)
    b = PoolBinding(plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m"), pool)
    with pytest.raises(ValueError, match=f"host slot {bad} is not the first slot of a page"):
        b.slot_batch(["a", "b"], [0, bad], fill=False)
    # the compiled builder checks again what the caller says it checked, when the pages are built:
    # read, or handed to a backend by the Store
    batch = b.slot_batch(["a", "b"], [0, bad], fill=False, checked=True)
    with pytest.raises(ValueError, match=f"host slot {bad} is not the first slot of a page"):
        list(batch.transfer.pages)
    with pytest.raises(ValueError, match=f"host slot {bad} is not the first slot of a page"):
        attach_headers([batch.transfer], made=False)
    assert pool.slot_buffers().cache == {}


@pytest.mark.parametrize("form", ["int64", "int32", "2-D", "strided", "list"])
def test_page_slots_are_each_pages_first_slot_checked_in_the_same_pass(form: str) -> None:
    spec = PoolSpec(kind="kv", layers=2, page_size=PS, dtype="bfloat16", **ZERO_COPY_SPECS["mha page_first"])
    b = PoolBinding(plan_binding(spec, ALL_CAPS, ParallelConfig(), model="m", target_model="m"), HostPool(spec, 6))

    def indices(first: list[int]) -> Any:
        flat = [s + t for s in first for t in range(PS)]
        if form == "list":
            return flat
        t = torch.tensor(flat, dtype=torch.int32 if form == "int32" else torch.int64)
        if form == "2-D":
            return t.view(-1, PS)
        if form == "strided":
            return torch.stack([t, torch.zeros_like(t)], 1)[:, 0]
        return t

    assert b.page_slots(indices([20, 0, 8])) == [20, 0, 8]
    assert b.page_slots(indices([])) == []
    for bad in (2, 24, -4):
        with pytest.raises(ValueError, match=f"host slot {bad} is not the first slot of a page"):
            b.page_slots(indices([0, bad, 4]))
