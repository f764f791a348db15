"""Capacity: LRU eviction by whole groups (target and draft together), usage, file reuse."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hicache_draft import PageResult, PoolKind

PAGE = 8192
SEG = 8 * 2 * (PAGE + 64)  # 8 groups x 2 pools per call, plus the footer


def _present(store, kit, groups: list[str]) -> list[tuple[bool, bool]]:
    got = store.page_exists  # existence per single key: (kv stored, draft stored)
    return [
        (got({PoolKind.KV: [f"{g}.{kit.NS[PoolKind.KV]}"]})[PoolKind.KV] == 1,
         got({PoolKind.DRAFT: [f"{g}.{kit.NS[PoolKind.DRAFT]}"]})[PoolKind.DRAFT] == 1)
        for g in groups
    ]


def test_eviction_keeps_groups_whole_and_respects_max_bytes(open_store, kit) -> None:
    cap = 5 * SEG
    store = open_store(max_bytes=cap, recycle_files=4)
    written: list[str] = []
    for call in range(20):
        groups = [kit.group(i, call) for i in range(8)]
        res = store.page_set(kit.both(groups, PAGE))
        assert all(r == [PageResult.OK] * 8 for r in res.values())
        written += groups
        use = store.backend.usage()
        assert use["bytes"] <= cap, use
    flags = _present(store, kit, written)
    assert all(kv == dr for kv, dr in flags), "a group kept one pool's page without the other"
    assert any(kv for kv, _ in flags) and not all(kv for kv, _ in flags)
    assert all(kv for kv, _ in flags[-8:]), "the newest call was evicted"
    got = kit.read_back(store, written, PAGE)
    for (rk, ek), (rd, ed) in zip(got[PoolKind.KV], got[PoolKind.DRAFT], strict=True):
        assert rk == rd and rk in (PageResult.OK, PageResult.MISS)
        assert rk is not PageResult.OK or (ek and ed)
    use = store.backend.usage()
    assert use["segments_evicted"] > 0 and use["pages_evicted"] == 16 * use["segments_evicted"]
    assert use["segments_recycled"] > 0 and use["free_files"] <= 4


def test_pools_of_one_group_written_apart_are_evicted_together(open_store, kit) -> None:
    store = open_store(max_bytes=4 * SEG)
    split = [kit.group(i, 99) for i in range(8)]
    kv_only = [t for t in kit.both(split, PAGE) if t.pool is PoolKind.KV]
    draft_only = [t for t in kit.both(split, PAGE) if t.pool is PoolKind.DRAFT]
    store.page_set(kv_only)  # the target pages in one segment ...
    filler = [kit.group(i, 1) for i in range(8)]
    store.page_set(kit.both(filler, PAGE))
    store.page_set(draft_only)  # ... the draft pages of the same groups in a later one
    assert all(kv and dr for kv, dr in _present(store, kit, split))
    for call in range(2, 8):
        store.page_set(kit.both([kit.group(i, call) for i in range(8)], PAGE))
    flags = _present(store, kit, split)
    assert flags == [(False, False)] * 8, flags


def test_least_recently_read_is_evicted_first(open_store, kit) -> None:
    store = open_store(max_bytes=int(3.5 * SEG), evict_to=1.0)
    calls = [[kit.group(i, c) for i in range(8)] for c in range(4)]
    for c in range(3):
        store.page_set(kit.both(calls[c], PAGE))
        time.sleep(0.05)  # distinct modification times (ordering only; nothing is timed)
    assert [r for r, _ in kit.read_back(store, calls[0], PAGE)[PoolKind.KV]] == [PageResult.OK] * 8
    time.sleep(0.05)
    store.page_set(kit.both(calls[3], PAGE))  # over capacity: the oldest unread call (1) goes
    alive = [all(kv for kv, _ in _present(store, kit, calls[c])) for c in range(4)]
    assert alive == [True, False, True, True], alive


def test_usage_is_shared_across_instances(open_store, kit, tmp_path: Path) -> None:
    a = open_store()
    b = open_store()
    a.page_set(kit.both([kit.group(i) for i in range(4)], PAGE))
    use = b.backend.usage()
    assert use["pages"] == 8 and use["segments"] == 1 and use["bytes"] > 8 * PAGE
    out = subprocess.run(
        [sys.executable, "-m", "hicache_draft_file", "stats", str(tmp_path / "store"), "--json"],
        capture_output=True, text=True, check=True,
    )
    assert '"pages": 8' in out.stdout


def test_two_processes_stay_under_one_capacity(tmp_path: Path, open_store, kit) -> None:
    child = Path(__file__).with_name("file_backend_child.py")
    cap = 6 * SEG
    procs = [
        subprocess.Popen([sys.executable, str(child), str(tmp_path / "store"), str(tag), "0", "96", str(PAGE), "8",
                          str(cap)], stdout=subprocess.DEVNULL)
        for tag in (1, 2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    store = open_store()
    use = store.backend.usage()
    assert 0 < use["bytes"] <= cap, use
    groups = [kit.group(i, t) for t in (1, 2) for i in range(96)]
    flags = _present(store, kit, groups)
    assert all(kv == dr for kv, dr in flags)
    assert sum(kv for kv, _ in flags) * 2 == use["pages"]


def test_a_group_whose_other_call_is_on_its_way_is_evicted_last(open_store, kit) -> None:
    """SGLang writes a prefix's draft pages and its target pages in separate calls. When the
    store fills between them (other writers), the draft pages alone are a young half group: LRU
    takes the older whole groups first, so the target call does not find its group split."""
    store = open_store(max_bytes=4 * SEG)
    pending = [kit.group(i, 98) for i in range(8)]
    ts = kit.both(pending, PAGE)
    assert store.page_set([ts[1]]) == {PoolKind.DRAFT: [PageResult.OK] * 8}  # the draft call: the oldest segment
    older = []
    for call in range(4):  # whole groups from other writers fill the store past its capacity
        groups = [kit.group(i, call) for i in range(8)]
        store.page_set(kit.both(groups, PAGE))
        older += groups
        assert store.backend.usage()["bytes"] <= 4 * SEG
    assert store.page_set([ts[0]]) == {PoolKind.KV: [PageResult.OK] * 8}  # the target call
    assert _present(store, kit, pending) == [(True, True)] * 8
    flags = _present(store, kit, older)
    assert all(kv == dr for kv, dr in flags) and not all(kv for kv, _ in flags), "nothing older was evicted"


def test_half_groups_still_go_when_nothing_else_can(open_store, kit) -> None:
    """Deferred, not protected: a store of nothing but young half groups keeps within capacity."""
    cap = 4 * SEG
    store = open_store(max_bytes=cap)
    for call in range(12):
        pool = PoolKind.KV if call % 2 else PoolKind.DRAFT
        ts = kit.both([kit.group(i, 200 + call) for i in range(8)], PAGE)
        store.page_set([t for t in ts if t.pool is pool])
        assert store.backend.usage()["bytes"] <= cap
    assert store.backend.usage()["segments_evicted"] > 0
