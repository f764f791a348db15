"""Spare segment files (spares.py): claimed after a call, prefaulted, written by the next one, removed at
close, reclaimed when their process dies, never used by a forked child, never created after close."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hicache_draft_file import backend as file_backend
from hicache_draft_file import bench, segment_writer, spares
from hicache_draft_file.root_setup import prepare_root

from hicache_draft import PageResult, PoolKind, Store
from hicache_draft.testing import CHILD_OK, in_forked_child

N = 65536
GROUPS = 64  # two pools of 64 x 64 KiB: 8 MiB, two segments with 4 I/O threads


@pytest.fixture(autouse=True)
def _two_segments_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_backend, "_SPLIT_MIN", 4 << 20)
    monkeypatch.setattr(file_backend, "_SPLIT_CORES", 4)


def _one_call_stored(open_store, kit, **options: object) -> tuple[Store, set[str]]:
    """A store with 4 I/O threads after one call of GROUPS groups, its spare refill settled: the
    store and the names of the spares it holds."""
    store = open_store(io_threads=4, **options)
    first = [kit.group(i, 1) for i in range(GROUPS)]
    assert store.page_set(kit.both(first, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
    assert store.backend.spares.settle(10.0)
    return store, store.backend.spares.names()


def _stores(store: Store, kit, groups: list[str]) -> None:
    """Store both pools' pages of ``groups`` in one call: every page answered OK."""
    assert store.page_set(kit.both(groups, N))[PoolKind.KV] == [PageResult.OK] * len(groups)


def _reads_back_exactly(store: Store, kit, groups: list[str]) -> None:
    """Every page of ``groups``, both pools, reads back OK and equal to what was stored."""
    got = kit.read_back(store, groups, N)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])


def test_a_call_writes_into_the_files_claimed_after_the_one_before(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, held = _one_call_stored(open_store, kit)
    be = store.backend
    assert len(held) == 2  # as many as the call wrote segments
    tmp = tmp_path / "store" / "tmp"
    assert all(kit.flocked(tmp / name) for name in held)  # a live writer's files: cleaners keep away
    before = set(be.catalog.segments)
    claimed_in_call: list[str] = []
    real = segment_writer.claim_file

    def counted(dirs: object, name: str) -> segment_writer.SegmentFile:
        claimed_in_call.append(name)
        return real(dirs, name)  # type: ignore[arg-type]

    monkeypatch.setattr(segment_writer, "claim_file", counted)
    second = [kit.group(i, 2) for i in range(GROUPS)]
    assert store.page_set(kit.both(second, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
    new = set(be.catalog.segments) - before
    assert be.spares.settle(10.0)
    # no file created or recycled inside the call: only the refill after it claims
    assert {f"{n}.{os.getpid()}.tmp" for n in claimed_in_call} <= be.spares.names()
    assert {f"{n}.{os.getpid()}.tmp" for n in new} == held  # the spares became the segments
    got = kit.read_back(store, [kit.group(i, 1) for i in range(GROUPS)] + second, N)  # the first call's too
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])


def test_spares_are_preallocated_so_a_call_of_the_same_shape_neither_allocates_nor_truncates(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(io_threads=4)
    be = store.backend
    assert be._prealloc  # ext4 or another block filesystem under tmp_path (not tmpfs)
    assert store.page_set(kit.both([kit.group(i, 1) for i in range(GROUPS)], N))[PoolKind.KV][0] is PageResult.OK
    sizes = {seg.size for seg in be.catalog.segments.values()}
    assert len(sizes) == 1 and be.spares.settle(10.0)
    tmp = tmp_path / "store" / "tmp"
    assert {(tmp / n).stat().st_size for n in be.spares.names()} == sizes
    (size,) = sizes
    assert all((tmp / n).stat().st_blocks * 512 >= size for n in be.spares.names())  # allocated
    calls: list[str] = []
    real_pre, real_trunc = segment_writer.preallocate, os.ftruncate

    def seen(what: str, real: Callable[[int, int], object]) -> Callable[[int, int], object]:
        def call(fd: int, n: int) -> object:
            # the call's own, not the refill's after it (it claims new spares on the I/O threads)
            if not threading.current_thread().name.startswith("hcd-file-io"):
                calls.append(what)
            return real(fd, n)

        return call

    monkeypatch.setattr(segment_writer, "preallocate", seen("fallocate", real_pre))
    monkeypatch.setattr(segment_writer.os, "ftruncate", seen("ftruncate", real_trunc))
    assert store.page_set(kit.both([kit.group(i, 2) for i in range(GROUPS)], N))[PoolKind.KV][0] is PageResult.OK
    assert be.spares.settle(10.0)
    assert calls == []
    monkeypatch.undo()
    # a call of another shape still stores exact segments (extended or cut to their size)
    for count, tag in ((GROUPS // 4, 3), (GROUPS * 2, 4)):
        assert be.spares.settle(10.0)
        groups = [kit.group(i, tag) for i in range(count)]
        _stores(store, kit, groups)
        _reads_back_exactly(store, kit, groups)
    for seg in be.catalog.segments.values():
        fan = tmp_path / "store" / "seg"
        (path,) = fan.glob(f"*/{seg.name}.seg")
        assert path.stat().st_size == seg.size


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def _resident(path: Path, start: int = 0, end: int | None = None) -> list[bool]:
    """Per page of bytes ``start`` to ``end`` (the file's end) of ``path``: whether it is in the
    page cache (``mincore`` over a shared mapping of the file; mapping it faults nothing in)."""
    size = path.stat().st_size
    end = size if end is None else end
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the export ends with the temporary
        vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        assert _LIBC.mincore(base, size, vec) == 0, os.strerror(ctypes.get_errno())
        return [bool(v & 1) for v in vec[start // mmap.PAGESIZE : -(-end // mmap.PAGESIZE)]]
    finally:
        m.close()


@pytest.mark.parametrize("prefault", [True, False])
def test_spares_are_prefaulted_into_the_page_cache_when_asked(
    open_store, kit, tmp_path: Path, prefault: bool
) -> None:
    """With ``prefault_spares`` (off by default) a spare's pages are in the page cache, up to where the
    last call's records ended, before the next call writes over them; without, the spare is only
    preallocated (nothing cached)."""
    store = open_store(io_threads=4, **({"prefault_spares": True} if prefault else {}))
    assert store.backend._prealloc  # a block filesystem under tmp_path: tmpfs never prefaults
    assert store.page_set(kit.both([kit.group(i, 1) for i in range(GROUPS)], N))[PoolKind.KV][0] is PageResult.OK
    assert store.backend.spares.settle(10.0)
    tmp = tmp_path / "store" / "tmp"
    held = store.backend.spares.names()
    assert len(held) == 2
    records_end = min(seg.index.data_end for seg in store.backend.catalog.segments.values())
    for n in held:
        assert set(_resident(tmp / n, 0, records_end)) == {prefault}
        # never past where the records ended: a footer written there later never reads a page back
        assert not any(_resident(tmp / n, records_end))
    groups = [kit.group(i, 2) for i in range(GROUPS)]  # written over the zeros: read back exactly
    _stores(store, kit, groups)
    _reads_back_exactly(store, kit, groups)


def test_the_file_bench_drops_a_rounds_pages_from_the_cache_but_keeps_the_prefaulted_spares(
    open_store, kit, tmp_path: Path
) -> None:
    """``file bench`` drops every measured file from the page cache after a round, but not the spares a
    backend prepared for its next call: the A/B of ``prefault_spares`` measures prefaulted spares."""
    store = open_store(io_threads=4, prefault_spares=True)
    _stores(store, kit, [kit.group(i, 1) for i in range(GROUPS)])
    keep = bench._spare_files(store)  # waits for the refill
    tmp = tmp_path / "store" / "tmp"
    assert {Path(p).name for p in keep} == store.backend.spares.names() and len(keep) == 2
    segs = list((tmp_path / "store" / "seg").rglob("*.seg"))
    assert segs and all(any(_resident(p)) for p in segs)
    bench._drop_cache(tmp_path, keep)
    assert not any(r for p in segs for r in _resident(p))  # the round's pages: dropped
    records_end = min(seg.index.data_end for seg in store.backend.catalog.segments.values())
    assert all(all(_resident(tmp / Path(p).name, 0, records_end)) for p in keep)  # the spares: kept


def test_spares_of_calls_too_large_to_prefault_in_time_are_only_preallocated(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``PREFAULT_MAX`` of zeros for one call's spares (here two 4 MiB segments against a 4 MiB
    bound) the refill prefaults none, as a refill that long would not be ready for the next call."""
    monkeypatch.setattr(spares, "PREFAULT_MAX", 4 << 20)
    store, held = _one_call_stored(open_store, kit, prefault_spares=True)
    tmp = tmp_path / "store" / "tmp"
    assert len(held) == 2 and all((tmp / n).stat().st_blocks * 512 >= (tmp / n).stat().st_size for n in held)
    assert not any(any(_resident(tmp / n)) for n in held)


def test_a_prefault_that_fails_removes_that_spare_and_the_call_still_stores(
    open_store, kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full filesystem while zero-filling a spare: that spare is removed (no file left behind in
    ``tmp/``), the others stay preallocated, and the next call stores everything."""
    def full(fd: int, offset: int, buffers: object, chunk: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spares, "write_from", full)
    store, held = _one_call_stored(open_store, kit, prefault_spares=True)
    assert len(held) == 1  # of two: the one being filled was dropped
    assert {p.name for p in (store.backend.root / "tmp").iterdir()} == held
    assert not any(c.prefaulted for c in store.backend.spares._files)
    groups = [kit.group(i, 2) for i in range(GROUPS)]
    _stores(store, kit, groups)
    _reads_back_exactly(store, kit, groups)


def test_a_call_during_the_prefault_takes_a_preallocated_spare_never_the_one_being_filled(
    open_store, kit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refill first makes every spare takeable (claimed, preallocated), then fills them one at
    a time: a call that comes meanwhile takes the others, never the file being written with zeros,
    and its pages read back exactly."""
    gate, entered = threading.Event(), threading.Event()
    real = spares.write_from

    def held_up(fd: int, offset: int, buffers: object, chunk: int) -> int:
        entered.set()
        assert gate.wait(10.0)
        return real(fd, offset, buffers, chunk=chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(spares, "write_from", held_up)
    store = open_store(io_threads=4, prefault_spares=True)
    be = store.backend
    assert store.page_set(kit.both([kit.group(i, 1) for i in range(GROUPS)], N))[PoolKind.KV][0] is PageResult.OK
    assert entered.wait(10.0)
    waiting = be.spares.names()
    assert len(waiting) == 1  # of two: the other is being filled, out of the list
    groups = [kit.group(i, 2) for i in range(GROUPS)]
    try:
        _stores(store, kit, groups)
    finally:
        gate.set()
    assert be.spares.settle(10.0)
    _reads_back_exactly(store, kit, groups)
    assert not waiting & be.spares.names()  # the call took the preallocated one


def test_close_removes_the_spares(open_store, kit, tmp_path: Path) -> None:
    store = open_store(io_threads=4)
    assert store.page_set(kit.both([kit.group(i) for i in range(GROUPS)], N))[PoolKind.KV][0] is PageResult.OK
    assert store.backend.spares.settle(10.0) and store.backend.spares.names()
    store.close()
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def test_spares_of_a_process_that_died_are_reclaimed_by_the_next_one(open_store, kit, tmp_path: Path) -> None:
    root = tmp_path / "store"
    child = f"""
import os, sys
sys.path[:0] = {sys.path!r}
from hicache_draft import Store, PoolKind, PageResult
from hicache_draft_file import backend as fb
fb._SPLIT_MIN, fb._SPLIT_CORES = 4 << 20, 4
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import both, group
s = Store.open("file", {{"root": {str(root)!r}, "io_threads": 4}})
assert s.page_set(both([group(i, 7) for i in range({GROUPS})], {N}))[PoolKind.KV] == [PageResult.OK] * {GROUPS}
assert s.backend.spares.settle(10.0) and len(s.backend.spares.names()) == 2
os._exit(0)  # no close: the spares stay behind
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    left = [p.name for p in (root / "tmp").iterdir()]
    assert len(left) == 2 and all(n.endswith(".tmp") for n in left)
    store = open_store(root)
    assert list((root / "tmp").iterdir()) == []  # its writer is dead and they are not flocked
    got = kit.read_back(store, [kit.group(i, 7) for i in range(GROUPS)], N)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV])


def _spare_files(tmp_path: Path, timeout_s: float = 5.0) -> tuple[spares.SpareFiles, ThreadPoolExecutor, object]:
    dirs = prepare_root(tmp_path / "root", create=True, read_only=False)
    pool = ThreadPoolExecutor(1)
    seq = iter(range(1, 1000))
    sf = spares.SpareFiles(dirs, lambda: f"00000000000000aa-{next(seq):08x}", pool.submit, 4, timeout_s)
    return sf, pool, dirs


def test_a_forked_child_never_uses_or_removes_the_parents_spares(tmp_path: Path) -> None:
    sf, pool, dirs = _spare_files(tmp_path)
    sf.refill(3)
    assert sf.settle(10.0) and len(sf.names()) == 3
    held = sf.names()
    fds = [c.fd for c in sf._files]
    sf.after_fork_in_child()  # what the backend's fork hook runs in a child (a real fork: the test below)
    assert sf.take() is None
    sf.refill(3)
    assert sf.close() is True
    tmp = tmp_path / "root" / "tmp"
    assert {p.name for p in tmp.iterdir()} == held  # the parent's files are untouched
    for fd in fds:  # only the child's own descriptors were closed
        with pytest.raises(OSError):
            os.fstat(fd)
    pool.shutdown()
    dirs.close()  # type: ignore[attr-defined]


def test_close_waits_for_a_running_claim_and_nothing_is_created_after(tmp_path: Path, monkeypatch) -> None:
    sf, pool, dirs = _spare_files(tmp_path, timeout_s=0.2)
    gate, entered = threading.Event(), threading.Event()
    real = spares.claim

    def slow(d: object, name: str, size: int = 0) -> spares.Claimed:
        entered.set()
        assert gate.wait(10.0)
        return real(d, name, size)  # type: ignore[arg-type]

    monkeypatch.setattr(spares, "claim", slow)
    sf.refill(2)
    assert entered.wait(10.0)
    t0 = time.monotonic()
    assert sf.close() is False  # the claim still runs: the caller must keep tmp/ open
    assert time.monotonic() - t0 < 5.0
    gate.set()
    assert sf.settle(10.0)
    assert sf.close() is True
    assert list((tmp_path / "root" / "tmp").iterdir()) == []  # the late file was removed, no more made
    pool.shutdown()
    dirs.close()  # type: ignore[attr-defined]


def test_a_real_forked_child_stores_without_the_parents_spares_and_leaves_them(open_store, kit, tmp_path: Path) -> None:
    store, held = _one_call_stored(open_store, kit)
    be = store.backend
    assert held
    tmp = tmp_path / "store" / "tmp"

    def child() -> bool:
        mine = [kit.group(i, 2) for i in range(GROUPS)]
        ok = store.page_set(kit.both(mine, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
        return ok and be.spares.take() is None and held <= {p.name for p in tmp.iterdir()}

    assert in_forked_child(child) == CHILD_OK
    assert be.spares.names() == held and all(kit.flocked(tmp / name) for name in held)  # still the parent's
    third = [kit.group(i, 3) for i in range(GROUPS)]
    assert store.page_set(kit.both(third, N))[PoolKind.KV] == [PageResult.OK] * GROUPS
