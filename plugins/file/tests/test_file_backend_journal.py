"""The shared journal under concurrency: one lock for its descriptor, no closed descriptor kept,
appends that follow a compaction, readers that notice truncation (issue 12, defects 1-3 and 6).

Timings are forced through fault points (a wrapped ``os`` seen by the journal module, a hook
before a segment is published), never by sleeping and hoping."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hicache_draft_file.backend as backend_mod
import hicache_draft_file.journal as journal_mod
import pytest

from hicache_draft import PageResult, PoolKind

PAGE = 4096


class _OsProxy:
    def __init__(self, **wrapped: Callable[..., Any]) -> None:
        self._wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        return self._wrapped.get(name) or getattr(os, name)


def _keys(kit, groups: list[str], pool: PoolKind = PoolKind.KV) -> dict[PoolKind, list[str]]:
    return {pool: [f"{g}.{kit.NS[pool]}" for g in groups]}


def _compact(store) -> None:
    """Compact ``store``'s journal the way its eviction does (exclusive root lock, caught up)."""
    b = store.backend
    with b._root_lock(exclusive=True):
        b._poll()
        with b._lock:
            b._journal.compact()


def test_poll_never_closes_the_descriptor_an_append_is_using(tmp_path: Path, open_store, kit, monkeypatch) -> None:
    """Defect 1: an append in one thread and a poll (which reopens a replaced journal) in another.
    The append is held inside its write; the journal is replaced; the poll runs; an unrelated file
    opened just before the poll's reopen takes the lowest free descriptor number. Sharing the
    descriptor without a lock, the held write then lands in that unrelated file."""
    root = tmp_path / "store"
    peer = open_store(root)
    b = open_store(root)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 256)
    in_write, release, grabbed = threading.Event(), threading.Event(), threading.Event()
    grab: list[int] = []
    held: list[int] = []  # the thread inside the append (the store calls the backend in its own threads)
    real_write, real_open = os.write, os.open

    def write(fd: int, data: Any) -> int:
        if not held:
            held.append(threading.get_ident())
            in_write.set()
            release.wait(30)
        return real_write(fd, data)

    def open_(*a: Any, **kw: Any) -> int:
        if held and threading.get_ident() != held[0] and not grab:
            grab.append(real_open(victim, os.O_RDWR))  # takes the number the poll just closed
            grabbed.set()
        return real_open(*a, **kw)

    monkeypatch.setattr(journal_mod, "os", _OsProxy(write=write, open=open_))
    groups = [kit.group(i, 1) for i in range(2)]
    results: dict[str, Any] = {}
    appender = threading.Thread(target=lambda: results.setdefault("set", b.page_set(kit.both(groups, PAGE))))
    appender.start()
    assert in_write.wait(30), "the append never started"
    journal = root / "journal"
    os.unlink(journal)  # replaced under the appender (as a compaction elsewhere would)
    journal.write_bytes(b"")
    poller = threading.Thread(target=lambda: results.setdefault("exists", b.page_exists(_keys(kit, groups))))
    poller.start()
    grabbed.wait(1.5)  # a poll sharing the descriptor gets here at once; a locked one waits for the append
    release.set()
    appender.join(30)
    poller.join(30)
    try:
        assert victim.read_bytes() == b"v" * 256, "a journal record was written into an unrelated file"
        assert results["set"][PoolKind.KV] == [PageResult.OK] * 2
        assert b.page_exists(_keys(kit, groups)) == {PoolKind.KV: 2}
        assert peer.page_exists(_keys(kit, groups)) == {PoolKind.KV: 2}
    finally:
        for fd in grab:
            os.close(fd)


def test_failed_reopen_keeps_no_closed_descriptor(tmp_path: Path, open_store, kit) -> None:
    """Defect 2: the journal path is briefly a directory. The reopen fails; the store must not keep
    the closed number (every later call failing with EBADF, close() raising, or journal records
    written into whatever file gets that number next)."""
    root = tmp_path / "store"
    peer = open_store(root)
    b = open_store(root)
    b.page_set(kit.both([kit.group(0, 2)], PAGE))
    journal = root / "journal"
    os.unlink(journal)
    journal.mkdir()
    during = [kit.group(1, 2)]
    assert b.page_set(kit.both(during, PAGE))[PoolKind.KV] == [PageResult.OK]  # stored; found by listing
    journal.rmdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 256)
    fd = os.open(victim, os.O_RDWR)  # takes the lowest free number: the closed journal's, if it was kept
    try:
        after = [kit.group(i, 3) for i in range(3)]
        res = b.page_set(kit.both(after, PAGE))
        assert res[PoolKind.KV] == [PageResult.OK] * 3, res
        assert os.pread(fd, 256, 0) == b"v" * 256, "journal records were written into an unrelated file"
        assert b.page_exists(_keys(kit, after)) == {PoolKind.KV: 3}
        assert peer.page_exists(_keys(kit, during + after)) == {PoolKind.KV: 4}
    finally:
        os.close(fd)
    b.backend.close()  # must not raise
    assert journal.is_file()


def test_publisher_follows_a_compaction_between_its_poll_and_its_append(tmp_path: Path, open_store, kit,
                                                                         monkeypatch) -> None:
    """Defect 3: B polls, A compacts, B publishes. B's record must land in the new journal, or A
    (live) never sees B's pages."""
    root = tmp_path / "store"
    a = open_store(root, journal_max_records=16)
    b = open_store(root, journal_max_records=16)
    a.page_set(kit.both([kit.group(0, 4)], PAGE))
    assert b.page_exists(_keys(kit, [kit.group(0, 4)])) == {PoolKind.KV: 1}
    real = backend_mod.FileBackend._publish
    fired: list[bool] = []

    def publish(*args: Any, **kw: Any) -> Any:
        if not fired:  # B has polled and written; A compacts before B publishes
            fired.append(True)
            _compact(a)
        return real(*args, **kw)

    monkeypatch.setattr(backend_mod.FileBackend, "_publish", publish)
    groups = [kit.group(i, 5) for i in range(4)]
    assert b.page_set(kit.both(groups, PAGE))[PoolKind.KV] == [PageResult.OK] * 4
    monkeypatch.undo()
    assert fired
    assert a.page_exists(_keys(kit, groups)) == {PoolKind.KV: 4}, "acknowledged pages invisible to a live peer"
    got = kit.read_back(a, groups, PAGE)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])


@pytest.mark.parametrize("keep", [0, 2], ids=["to-empty", "to-two-records"])
def test_truncated_and_regrown_journal_is_noticed(tmp_path: Path, open_store, kit, keep: int) -> None:
    """Defect 6: the journal is truncated in place and regrows past (or exactly to) a live
    reader's offset before the reader looks again."""
    root = tmp_path / "store"
    writer = open_store(root)
    reader = open_store(root)
    first = [kit.group(i, 6) for i in range(5)]
    for g in first:  # one segment, one record per call
        writer.page_set(kit.both([g], PAGE))
    assert reader.page_exists(_keys(kit, first)) == {PoolKind.KV: 5}
    journal = root / "journal"
    size = journal.stat().st_size
    os.truncate(journal, keep * 64)
    more = [kit.group(i, 7) for i in range(7)]
    for g in more:
        writer.page_set(kit.both([g], PAGE))
    assert journal.stat().st_size >= size - 64  # regrown to (about) where the reader stood, or past it
    assert reader.page_exists(_keys(kit, more)) == {PoolKind.KV: 7}, "a live reader missed new segments"
    assert reader.page_exists(_keys(kit, first)) == {PoolKind.KV: 5}
