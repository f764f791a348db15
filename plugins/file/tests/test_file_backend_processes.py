"""Several processes on one root: concurrent writers, and live readers that see their pages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hicache_draft import PageResult, PoolKind

CHILD = Path(__file__).with_name("file_backend_child.py")
PAGE = 16 << 10


def _writer(root: Path, tag: int, first: int, count: int, per: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(root), str(tag), str(first), str(count), str(PAGE), str(per)],
        stdout=subprocess.DEVNULL,
    )


def test_two_writer_processes_on_one_root(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    live = open_store(root)  # opened before the writers: must discover their segments
    procs = [_writer(root, 5, 0, 120, 4), _writer(root, 5, 60, 120, 6), _writer(root, 6, 0, 50, 1)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    groups = [kit.group(i, 5) for i in range(180)] + [kit.group(i, 6) for i in range(50)]
    keys = {pool: [f"{g}.{kit.NS[pool]}" for g in groups] for pool in (PoolKind.KV, PoolKind.DRAFT)}
    assert live.page_exists(keys) == {PoolKind.KV: 230, PoolKind.DRAFT: 230}
    for store in (live, open_store(root)):
        got = kit.read_back(store, groups, PAGE)
        for pool in (PoolKind.KV, PoolKind.DRAFT):
            assert all(r is PageResult.OK and eq for r, eq in got[pool]), pool
    use = live.backend.usage()
    assert use["corrupt_pages"] == 0
    assert 2 * 230 <= use["pages"] <= 2 * 290  # the overlap is stored once or twice, as the race went


def test_other_process_removal_is_seen(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    a = open_store(root)
    b = open_store(root, max_bytes=10 * 2 * (PAGE + 64))
    a.page_set(kit.both([kit.group(i, 1) for i in range(8)], PAGE))
    first = [f"{kit.group(i, 1)}.{kit.NS[PoolKind.KV]}" for i in range(8)]
    assert b.page_exists({PoolKind.KV: first}) == {PoolKind.KV: 8}
    for call in range(2, 6):
        b.page_set(kit.both([kit.group(i, call) for i in range(8)], PAGE))
    assert a.page_exists({PoolKind.KV: first}) == {PoolKind.KV: 0}
    got = kit.read_back(a, [kit.group(i, 1) for i in range(8)], PAGE)
    assert [r for r, _ in got[PoolKind.KV]] == [PageResult.MISS] * 8


def test_journal_compaction_is_followed_by_other_instances(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    a = open_store(root, journal_max_records=16)
    b = open_store(root, journal_max_records=16)
    groups = [kit.group(i, 3) for i in range(40)]
    for g in groups:  # one segment (and one journal record) per call: compacted twice on the way
        assert a.page_set(kit.both([g], 1024))[PoolKind.KV] == [PageResult.OK]
    assert (root / "journal").stat().st_size < 17 * 64
    keys = {pool: [f"{g}.{kit.NS[pool]}" for g in groups] for pool in (PoolKind.KV, PoolKind.DRAFT)}
    assert b.page_exists(keys) == {PoolKind.KV: 40, PoolKind.DRAFT: 40}
    assert b.backend.usage()["rescans"] >= 2
