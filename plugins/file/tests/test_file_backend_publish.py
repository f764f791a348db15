"""Publishing a call's segments: all of them under one hold of the root lock and one journal
append; a failed rename drops only its segment, a failed append the whole call (nothing a peer
could find), and a full filesystem at the append makes room and publishes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hicache_draft_file import backend as file_backend
from hicache_draft_file.journal import Journal

from hicache_draft import PageResult, PoolKind

N = 65536
GROUPS = 32  # two pools of 32 x 64 KiB: 4 MiB, four segments of 1 MiB with 4 I/O threads
SEGMENTS = 4


@pytest.fixture(autouse=True)
def _four_segments_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_backend, "_SPLIT_MIN", 1 << 20)
    monkeypatch.setattr(file_backend, "_SPLIT_CORES", 4)


def _published(root: Path) -> set[str]:
    return {p.name for p in (root / "seg").glob("*/*") if p.is_file()}


def test_a_call_publishes_its_segments_under_one_root_lock_and_one_journal_append(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4)
    peer = open_store()  # another instance on the root: it learns of segments from the journal
    appends: list[list[str]] = []
    locks: list[bool] = []
    real_append, real_lock = Journal.append, file_backend.FileBackend._root_lock

    def append(self: Journal, op: object, names: list[str]) -> None:
        appends.append(list(names))
        real_append(self, op, names)

    def root_lock(self: file_backend.FileBackend, exclusive: bool) -> object:
        locks.append(exclusive)
        return real_lock(self, exclusive)

    monkeypatch.setattr(Journal, "append", append)
    monkeypatch.setattr(file_backend.FileBackend, "_root_lock", root_lock)
    groups = [kit.group(i, 1) for i in range(GROUPS)]
    assert store.page_set(kit.both(groups, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
    assert len(store.backend.catalog.segments) == SEGMENTS
    assert len(appends) == 1 and sorted(appends[0]) == sorted(store.backend.catalog.segments)  # one append: all
    assert locks == [False]  # one shared hold of the root lock for the call
    got = kit.read_back(peer, groups, N)
    assert all(pair == (PageResult.OK, True) for rows in got.values() for pair in rows)


def test_a_failed_journal_append_fails_the_call_and_publishes_nothing(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4)
    kept = [kit.group(i, 1) for i in range(GROUPS)]
    assert store.page_set(kit.both(kept, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
    before = _published(tmp_path / "store")

    def broken(self: Journal, op: object, names: list[str]) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Journal, "append", broken)
    lost = [kit.group(i, 2) for i in range(GROUPS)]
    res = store.page_set(kit.both(lost, N))
    assert res == {PoolKind.KV: [PageResult.FAILED] * GROUPS, PoolKind.DRAFT: [PageResult.FAILED] * GROUPS}
    assert _published(tmp_path / "store") == before  # no file a peer's directory listing could find
    assert kit.unfinished(store.backend, tmp_path / "store") == []  # and none left behind in tmp/
    assert store.backend.usage()["write_failures"] == SEGMENTS
    monkeypatch.undo()
    peer = open_store()
    got = kit.read_back(peer, kept + lost, N)
    assert [r for r, _ in got[PoolKind.KV]] == [PageResult.OK] * GROUPS + [PageResult.MISS] * GROUPS
    assert store.page_set(kit.both(lost, N))[PoolKind.KV] == [PageResult.OK] * GROUPS


def test_a_full_filesystem_at_the_journal_append_makes_room_and_publishes(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4, max_bytes=1 << 30)
    real_append = Journal.append
    failed: list[int] = []
    rooms: list[int] = []
    real_room = file_backend.FileBackend._make_room

    def full_once(self: Journal, op: object, names: list[str]) -> None:
        if not failed:
            failed.append(len(names))
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(self, op, names)

    def make_room(self: file_backend.FileBackend, need: int, protect: set[str]) -> None:
        rooms.append(need)
        real_room(self, need, protect)

    monkeypatch.setattr(Journal, "append", full_once)
    monkeypatch.setattr(file_backend.FileBackend, "_make_room", make_room)
    groups = [kit.group(i, 3) for i in range(GROUPS)]
    assert store.page_set(kit.both(groups, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
    assert failed == [SEGMENTS] and len(rooms) == 1 and rooms[0] >= 2 * GROUPS * N
    assert kit.unfinished(store.backend, tmp_path / "store") == []
    got = kit.read_back(open_store(), groups, N)
    assert all(pair == (PageResult.OK, True) for rows in got.values() for pair in rows)


def test_a_failed_rename_fails_only_its_segments_pages(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4)
    real_rename = os.rename
    refused: list[str] = []

    def rename(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        if not refused and str(dst).endswith(file_backend.SEGMENT_SUFFIX):
            refused.append(str(dst))
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(file_backend.os, "rename", rename)
    groups = [kit.group(i, 4) for i in range(GROUPS)]
    res = store.page_set(kit.both(groups, N))
    monkeypatch.undo()
    per_segment = GROUPS // SEGMENTS
    for pool in (PoolKind.KV, PoolKind.DRAFT):
        failed = [i for i, r in enumerate(res[pool]) if r is not PageResult.OK]
        assert len(failed) == per_segment and failed == list(range(failed[0], failed[0] + per_segment))
    assert len(refused) == 1 and len(_published(tmp_path / "store")) == SEGMENTS - 1
    assert kit.unfinished(store.backend, tmp_path / "store") == []
    got = kit.read_back(open_store(), groups, N)
    ok = [i for i, (r, eq) in enumerate(got[PoolKind.KV]) if r is PageResult.OK and eq]
    assert ok == [i for i, r in enumerate(res[PoolKind.KV]) if r is PageResult.OK]


@pytest.mark.parametrize("append_error", [errno.ENOSPC, errno.EIO])
def test_a_segment_dropped_at_its_rename_is_never_discarded_twice(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, append_error: int
) -> None:
    """A failed rename closes its segment's descriptor; a failing append after it (retried after
    making room, or given up) must not close that number again: by then it may be another file's."""
    store = open_store(io_threads=4, max_bytes=1 << 30)
    real_rename, real_append = os.rename, Journal.append
    refused: list[str] = []
    appends: list[int] = []
    discarded: list[str] = []
    real_discard = file_backend.FileBackend._discard

    def rename(src: str, dst: str, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        if not refused and str(dst).endswith(file_backend.SEGMENT_SUFFIX):
            refused.append(str(dst))
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def append(self: Journal, op: object, names: list[str]) -> None:
        appends.append(len(names))
        if len(appends) == 1:
            raise OSError(append_error, os.strerror(append_error))
        real_append(self, op, names)

    def discard(self: file_backend.FileBackend, ws: object) -> None:
        discarded.append(ws.name)  # type: ignore[attr-defined]
        real_discard(self, ws)  # type: ignore[arg-type]

    monkeypatch.setattr(file_backend.os, "rename", rename)
    monkeypatch.setattr(Journal, "append", append)
    monkeypatch.setattr(file_backend.FileBackend, "_discard", discard)
    groups = [kit.group(i, 5) for i in range(GROUPS)]
    res = store.page_set(kit.both(groups, N))
    monkeypatch.undo()
    assert len(discarded) == len(set(discarded)), f"a segment was discarded twice: {discarded}"
    ok = sum(r is PageResult.OK for r in res[PoolKind.KV])
    if append_error == errno.ENOSPC:  # room made, published once more: all but the refused segment
        assert appends == [SEGMENTS - 1, SEGMENTS - 1] and ok == GROUPS - GROUPS // SEGMENTS
    else:
        assert appends == [SEGMENTS - 1] and ok == 0 and len(discarded) == SEGMENTS
    assert kit.unfinished(store.backend, tmp_path / "store") == []
