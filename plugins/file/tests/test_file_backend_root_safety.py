"""The root is a trust boundary (issue 12, defect 5): links placed inside the root by someone else
never make the backend read, write, move or delete anything outside it. Every test keeps real
files outside the root and asserts their bytes and existence unchanged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hicache_draft import PageResult, PoolKind, Store

PAGE = 4096
SEG = 4 * 2 * (PAGE + 64) + 4096  # 4 groups x 2 pools per call, plus the footer (generously)


def _outside(tmp_path: Path, n: int = 1) -> dict[Path, bytes]:
    """Sentinel files outside the root (some named like segments), with their bytes."""
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    files = {}
    for i in range(n):
        p = d / (f"{i:016x}-00000001.seg" if i % 2 else f"precious-{i}.txt")
        data = f"outside file {i} ".encode() * 100
        p.write_bytes(data)
        files[p] = data
    return files


def _unchanged(files: dict[Path, bytes]) -> None:
    for p, data in files.items():
        assert p.exists(), f"{p} outside the root was deleted or moved"
        assert p.read_bytes() == data, f"{p} outside the root was written"


def _fill(store: Store, kit, tag: int, calls: int) -> None:
    for c in range(calls):
        res = store.page_set(kit.both([kit.group(i, tag * 100 + c) for i in range(4)], PAGE))
        assert all(r == [PageResult.OK] * 4 for r in res.values()), res


def test_free_entry_linked_outside_is_never_written(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    files = _outside(tmp_path, 2)
    (sym_target, _), (hard_target, _) = files.items()
    os.symlink(sym_target, root / "free" / "0000000000000001-00000001.free")
    os.link(hard_target, root / "free" / "0000000000000002-00000001.free")
    store = open_store(root)
    _fill(store, kit, 1, 3)  # each write claims a free/ file first
    _unchanged(files)
    got = kit.read_back(store, [kit.group(i, 100) for i in range(4)], PAGE)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])
    assert store.backend.usage()["unsafe_entries"] >= 2


def test_fanout_directory_linked_outside_is_not_scanned(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    files = _outside(tmp_path, 20)
    for name in ("00", "01"):
        shutil.rmtree(root / "seg" / name, ignore_errors=True)
        os.symlink(tmp_path / "outside", root / "seg" / name)
    store = open_store(root)  # a full scan: must not move outside files into quarantine
    _fill(store, kit, 2, 40)  # many segments: some hash into 00/01; quarantine is pruned on the way
    _unchanged(files)
    assert not (root / "seg" / "00").is_symlink() and (root / "seg" / "00").is_dir()
    other = open_store(root)
    assert other.page_exists({PoolKind.KV: [f"{kit.group(i, 200)}.{kit.NS[PoolKind.KV]}" for i in range(4)]}) == {
        PoolKind.KV: 4}


def test_quarantine_linked_outside_is_never_pruned_through(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    files = _outside(tmp_path, 20)
    shutil.rmtree(root / "quarantine")
    os.symlink(tmp_path / "outside", root / "quarantine")
    for i in range(20):  # foreign files to quarantine (and so to prune)
        (root / "seg" / f"{i:02x}").mkdir(exist_ok=True)
        (root / "seg" / f"{i:02x}" / f"junk-{i}.txt").write_text("junk")
    store = open_store(root)
    _fill(store, kit, 3, 2)
    _unchanged(files)
    assert store.backend.usage()["foreign_files"] == 20


def test_segment_linked_to_an_outside_copy_is_never_served_or_overwritten(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    store = open_store(root, max_bytes=4 * SEG, recycle_files=8)
    linked = {}
    for how in ("symlink", "hardlink"):
        groups = [kit.group(i, 40 if how == "symlink" else 41) for i in range(4)]
        store.page_set(kit.both(groups, PAGE))
        seg, _ = store.backend.catalog.lookup(PoolKind.KV, f"{groups[0]}.{kit.NS[PoolKind.KV]}")
        copy = tmp_path / f"outside-{how}.seg"
        shutil.copyfile(seg.path, copy)
        os.unlink(seg.path)
        (os.symlink if how == "symlink" else os.link)(copy, seg.path)
        linked[how] = (groups, copy, copy.read_bytes())
    store.close()
    fresh = open_store(root, max_bytes=4 * SEG, recycle_files=8)
    for how, (groups, _copy, _data) in linked.items():
        got = kit.read_back(fresh, groups, PAGE)
        assert [r for r, _ in got[PoolKind.KV]] == [PageResult.MISS] * 4, f"{how}: an outside file was served"
    _fill(fresh, kit, 5, 12)  # evict and recycle a lot
    for how, (_groups, copy, data) in linked.items():
        assert copy.exists() and copy.read_bytes() == data, f"{how}: the outside copy was touched"


def test_journal_linked_outside_is_never_appended_to(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    open_store(root).close()
    files = _outside(tmp_path, 1)
    (target, _), = files.items()
    os.unlink(root / "journal")
    os.symlink(target, root / "journal")
    a = open_store(root)
    b = open_store(root)
    _fill(a, kit, 6, 2)
    _unchanged(files)
    groups = [kit.group(i, 600 + c) for c in range(2) for i in range(4)]
    assert b.page_exists({PoolKind.KV: [f"{g}.{kit.NS[PoolKind.KV]}" for g in groups]}) == {PoolKind.KV: 8}
    assert (root / "journal").is_file() and not (root / "journal").is_symlink()


def test_directory_swapped_for_a_link_while_open_is_not_followed(tmp_path: Path, open_store, kit) -> None:
    """``free/`` renamed away and replaced by a link to an outside directory of ``*.free`` files
    while the store is open: eviction and recycling keep to the root."""
    root = tmp_path / "store"
    store = open_store(root, max_bytes=4 * SEG, recycle_files=8)
    _fill(store, kit, 7, 2)
    out = tmp_path / "outside"
    out.mkdir()
    files = {}
    for i in range(4):
        p = out / f"{i:016x}-00000001.free"
        p.write_bytes(b"outside free file" * 50)
        files[p] = p.read_bytes()
    os.rename(root / "free", root / "free.old")
    os.symlink(out, root / "free")
    _fill(store, kit, 8, 10)  # evicts (to free/) and claims free files
    open_store(root)  # a rescan: the link is quarantined, a real free/ made
    _fill(store, kit, 9, 6)
    _unchanged(files)
    assert not (root / "free").is_symlink()
