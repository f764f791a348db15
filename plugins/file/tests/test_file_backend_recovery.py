"""Crashes inside eviction and compaction, dead writers' files, a full filesystem, and a call
never evicted by its own eviction (issue 12, defects 4 and 7)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_draft import PageResult, PoolKind, Store

CHILD = Path(__file__).with_name("file_backend_fault_child.py")
PAGE = 8192


def _child(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, f"the child was not killed at its fault point: {out.stdout}{out.stderr}"
    return out


def _present(store: Store, kit, groups: list[str], pool: PoolKind) -> list[bool]:
    return [store.page_exists({pool: [f"{g}.{kit.NS[pool]}"]})[pool] == 1 for g in groups]


def test_kill_inside_eviction_never_splits_a_group(tmp_path: Path, open_store, kit) -> None:
    """Defect 4: the draft and target pages of groups sit in different segments; the evictor is
    killed right after removing the first of them. Neither a live peer nor a later process may
    see one pool's page without the other's."""
    root = tmp_path / "store"
    peer = open_store(root)
    out = _child("evict-kill", str(root), str(PAGE))
    assert "split stored" in out.stdout
    split = [kit.group(i, 7) for i in range(8)]
    for store in (peer, open_store(root, read_only=True), open_store(root)):
        kv, draft = _present(store, kit, split, PoolKind.KV), _present(store, kit, split, PoolKind.DRAFT)
        assert kv == draft, f"target {kv} but draft {draft}: a killed eviction split groups"
        got = kit.read_back(store, split, PAGE)
        results = [(rk, rd) for (rk, _), (rd, _) in zip(got[PoolKind.KV], got[PoolKind.DRAFT], strict=True)]
        assert all(rk == rd for rk, rd in results), results
    assert not (root / "evict.intent").exists()  # the writable open finished the eviction


def test_kill_inside_compaction_leaves_no_journal_file(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    _child("compact-kill", str(root))
    assert [p.name for p in root.iterdir() if p.name.endswith(".new")], "the fault point was not reached"
    store = open_store(root)
    assert [p.name for p in root.iterdir() if p.name.endswith(".new")] == []
    assert store.page_set(kit.both([kit.group(0, 9)], PAGE))[PoolKind.KV] == [PageResult.OK]


def test_dead_writers_temp_files_are_reclaimed_at_open(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    _child("write-kill", str(root), str(64 << 10))
    assert [p for p in (root / "tmp").iterdir() if p.name.endswith(".tmp")], "the fault point was not reached"
    store = open_store(root)
    assert [p for p in (root / "tmp").iterdir() if p.name.endswith(".tmp")] == []
    assert store.page_set(kit.both([kit.group(0, 9)], PAGE))[PoolKind.KV] == [PageResult.OK]


def test_live_writers_temp_files_are_kept(tmp_path: Path, open_store) -> None:
    """A temp file of a live process (this one) that nobody flocks is not taken at open."""
    root = tmp_path / "store"
    open_store(root).close()
    mine = root / "tmp" / f"0123456789abcdef-00000001.{os.getpid()}.tmp"
    mine.write_bytes(b"x" * 100)
    open_store(root)
    assert mine.exists()


def test_a_call_between_evict_to_and_max_bytes_is_not_evicted_by_its_own_eviction(open_store, kit) -> None:
    cap = 40 * (PAGE + 64) * 2
    store = open_store(max_bytes=cap, evict_to=0.5)
    for c in range(3):
        store.page_set(kit.both([kit.group(i, c) for i in range(4)], PAGE))
    big = [kit.group(i, 50) for i in range(28)]  # about 0.7 x max_bytes: over evict_to, under max_bytes
    res = store.page_set(kit.both(big, PAGE))
    assert res[PoolKind.KV] == [PageResult.OK] * 28
    assert _present(store, kit, big, PoolKind.KV) == [True] * 28, "an acknowledged call was evicted by itself"
    got = kit.read_back(store, big, PAGE)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])
    assert store.backend.usage()["bytes"] <= cap


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB filesystem (tmpfs; the tests run as root), unmounted afterwards."""
    mnt = Path("/tmp") / f"hcd-enospc-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


def test_full_filesystem_is_capacity_pressure_when_eviction_is_on(small_fs: Path, kit) -> None:
    """max_bytes (64 MiB) is above the free space (8 MiB): ENOSPC evicts and the write is retried."""
    page = 256 << 10
    with Store.open("file", {"root": str(small_fs / "store"), "max_bytes": 64 << 20, "recycle_files": 4}) as store:
        for c in range(24):  # 24 x 2 MiB into 8 MiB
            groups = [kit.group(i, 300 + c) for i in range(4)]
            res = store.page_set(kit.both(groups, page))
            assert res[PoolKind.KV] == [PageResult.OK] * 4, f"call {c}: {res}"
        use = store.backend.usage()
        assert use["no_space_evictions"] >= 1 and use["segments_evicted"] >= 1
        newest = [kit.group(i, 323) for i in range(4)]
        got = kit.read_back(store, newest, page)
        assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])


def test_records_the_core_writes_into_a_full_filesystem_fail_alone(small_fs: Path, kit, monkeypatch) -> None:
    """Eviction off: the segments of a call written on the core's threads (``write_runs``) hit a
    real full filesystem; their pages fail, no unfinished file stays, what was stored reads back."""
    import hicache_draft.store as store_mod

    runs: list[int] = []
    real = store_mod._RecordWriter.write_runs

    def spy(self: object, plan: list, *args: object) -> list:
        runs.append(len(plan))
        return real(self, plan, *args)

    monkeypatch.setattr(store_mod._RecordWriter, "write_runs", spy)
    page = 256 << 10
    stored: list[list[str]] = []
    with Store.open("file", {"root": str(small_fs / "store"), "io_threads": 4}) as store:
        for c in range(8):  # 2 MiB a call into 8 MiB: the filesystem fills
            groups = [kit.group(i, 400 + c) for i in range(4)]
            res = store.page_set(kit.both(groups, page))
            if res[PoolKind.KV] != [PageResult.OK] * 4:
                break
            stored.append(groups)
        else:
            pytest.fail("8 MiB never filled up")
        assert runs and stored, "the calls did not go through write_runs, or none fitted"
        assert res[PoolKind.KV] == [PageResult.FAILED] * 4 and store.backend.usage()["write_failures"] >= 1
        assert kit.unfinished(store.backend, small_fs / "store") == []
        assert kit.read_back(store, groups, page)[PoolKind.KV] == [(PageResult.MISS, False)] * 4
        got = kit.read_back(store, [g for call in stored for g in call], page)
        assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])
