"""Corrupt and foreign data: never returned, counted, logged, quarantined; a miss afterwards."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_draft import HEADER_SIZE, PageResult, PoolKind, Store, make_header

PAGE = 4096


def _locate(store: Store, kit, group: str, pool: PoolKind = PoolKind.KV) -> tuple[Path, int]:
    entry = store.backend.catalog.lookup(pool, f"{group}.{kit.NS[pool]}")
    assert entry is not None
    seg, i = entry
    return seg.path, seg.offset(i)


def _eventually(store: Store, done: Callable[[dict], bool], timeout: float = 10.0) -> dict:
    """The backend's usage once ``done`` holds for it (bounded wait), else the last one seen."""
    end = time.monotonic() + timeout
    while True:
        use = store.backend.usage()
        if done(use) or time.monotonic() > end:
            return use
        time.sleep(0.01)


def _poke(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def _foreign_header(kit, group: str) -> bytes:
    other_ns = "ee" * 12
    return make_header(f"{group}.{other_ns}", other_ns, PoolKind.KV, [kit.payload(f"{group}.{other_ns}", PAGE)])


TAMPER: dict[str, Callable[..., None]] = {
    "payload checksum": lambda path, off, kit, g: _flip(path, off + HEADER_SIZE + 100),
    "bad magic": lambda path, off, kit, g: _poke(path, off, b"XXXXXXXX"),
    "wrong version": lambda path, off, kit, g: _poke(path, off + 8, struct.pack("<H", 99)),
    "header checksum": lambda path, off, kit, g: _flip(path, off + 40),
    "foreign namespace": lambda path, off, kit, g: _poke(path, off, _foreign_header(kit, g)),
    "truncated": lambda path, off, kit, g: os.truncate(path, off + HEADER_SIZE + 10),
}


@pytest.mark.parametrize("how", sorted(TAMPER))
def test_tampered_page_is_corrupt_then_a_miss(open_store, kit, how: str) -> None:
    store = open_store()
    groups = [kit.group(i) for i in range(4)]
    assert all(r == [PageResult.OK] * 4 for r in store.page_set(kit.both(groups, PAGE)).values())
    path, off = _locate(store, kit, groups[2])
    TAMPER[how](path, off, kit, groups[2])
    got = kit.read_back(store, groups, PAGE)
    bad = got[PoolKind.KV][2]
    assert bad[0] is PageResult.CORRUPT, f"{how}: {bad}"
    for r, equal in got[PoolKind.KV] + got[PoolKind.DRAFT]:
        assert r is not PageResult.OK or equal, f"{how}: a page reported OK has wrong bytes"
    # a bad payload passes the backend's header checks: the core rejects it and tells the backend
    # (page_rejected, on a store thread after the call), which then quarantines the segment
    use = _eventually(store, lambda u: u["segments_quarantined"] == 1)
    assert use["corrupt_pages"] >= 1 and use["segments_quarantined"] == 1
    assert not path.exists() and any((path.parents[2] / "quarantine").iterdir())
    again = kit.read_back(store, groups, PAGE)
    assert [r for r, _ in again[PoolKind.KV] + again[PoolKind.DRAFT]] == [PageResult.MISS] * 8
    assert store.page_exists({PoolKind.KV: [f"{g}.{kit.NS[PoolKind.KV]}" for g in groups]}) == {PoolKind.KV: 0}
    other = open_store()  # a fresh process view agrees: nothing of the quarantined segment is visible
    assert other.page_exists({PoolKind.DRAFT: [f"{groups[0]}.{kit.NS[PoolKind.DRAFT]}"]}) == {PoolKind.DRAFT: 0}


def test_corrupt_segment_found_at_restart_is_quarantined(open_store, kit, tmp_path: Path) -> None:
    store = open_store()
    good = [kit.group(i, 1) for i in range(3)]
    doomed = [kit.group(i, 2) for i in range(3)]
    store.page_set(kit.both(good, PAGE))
    store.page_set(kit.both(doomed, PAGE))
    path, _ = _locate(store, kit, doomed[0])
    store.close()
    os.truncate(path, path.stat().st_size - 7)  # the trailer is damaged
    garbage = path.parent / ("0123456789abcdef-00000001.seg")
    garbage.write_bytes(b"\x00" * 300)
    stray = path.parent / "notes.txt"
    stray.write_text("not a segment")
    fresh = open_store()
    got = kit.read_back(fresh, good + doomed, PAGE)
    results = [r for r, _ in got[PoolKind.KV]]
    assert results[:3] == [PageResult.OK] * 3 and results[3:] == [PageResult.MISS] * 3
    assert all(eq for r, eq in got[PoolKind.KV][:3])
    use = fresh.backend.usage()
    assert use["segments_quarantined"] == 2 and use["foreign_files"] == 1
    assert not path.exists() and not garbage.exists() and not stray.exists()
    assert len(list((tmp_path / "store" / "quarantine").iterdir())) == 3


_WRITE_TARGET = """
import sys
sys.path.insert(0, sys.argv[2])
from conftest import pages
from hicache_draft import PageResult, PageTransfer, PoolKind, Store
store = Store.open("file", {"root": sys.argv[1]})
res = store.page_set([PageTransfer(PoolKind.KV, pages(PoolKind.KV, sys.argv[3:], 4096))])
store.close()
sys.exit(0 if res[PoolKind.KV] == [PageResult.OK] * len(sys.argv[3:]) else 3)
"""


def test_a_quarantine_takes_the_group_pages_another_process_wrote_since(open_store, kit, tmp_path: Path) -> None:
    """A rejected draft page quarantines its segment with every segment sharing a group with it,
    including the target segment of those groups that another process wrote after this one last
    looked: the closure is taken on a caught-up catalog, so no group is split on disk."""
    import subprocess
    import sys

    root = tmp_path / "store"
    store = open_store(root)
    groups = [kit.group(i, 7) for i in range(2)]
    assert store.page_set([kit.both(groups, PAGE)[1]]) == {PoolKind.DRAFT: [PageResult.OK] * 2}  # draft only
    subprocess.run([sys.executable, "-c", _WRITE_TARGET, str(root), str(Path(__file__).parent), *groups],
                   check=True, timeout=60)
    # the core found a draft page bad; this store has not looked at the root since the other wrote
    store.backend.page_rejected({PoolKind.DRAFT: [f"{groups[0]}.{kit.NS[PoolKind.DRAFT]}"]})
    fresh = open_store(root)
    for pool in (PoolKind.KV, PoolKind.DRAFT):
        for g in groups:
            assert fresh.page_exists({pool: [f"{g}.{kit.NS[pool]}"]}) == {pool: 0}, f"{pool.value} of {g} kept"
    assert fresh.backend.usage()["segments_quarantined"] == 0 and store.backend.usage()["segments_quarantined"] == 1
