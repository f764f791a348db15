"""Pools of any name: segments name them (version 2 footers), a restart keeps them apart, and
version-1 segments (every store written before open pools) are still read."""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import xxhash
from hicache_draft_file.segment_format import (
    CLASSIC_POOLS,
    SEG_MAGIC,
    SegmentIndex,
    build_footer,
    pool_table,
    read_index,
)

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind

OK, MISS = PageResult.OK, PageResult.MISS
POOLS = [PoolKind.KV, PoolKind.DRAFT, "indexer", "draft_indexer", "swa", "mamba", "v4_compressed"]
NS = {str(p): f"{i + 1:02x}" * 12 for i, p in enumerate(POOLS)}


def _pages(kit, pool: str, groups: list[str], n: int, fill: bool = True) -> list[Page]:
    out = []
    for g in groups:
        key = f"{g}.{NS[str(pool)]}"
        buf = bytearray(kit.payload(key, n)) if fill else bytearray(n)
        out.append(Page(key=key, group=g, namespace=NS[str(pool)], buffers=(Buffer.of(buf),)))
    return out


def _footer_file(tmp_path: Path, index: SegmentIndex) -> int:
    path = tmp_path / "seg"
    path.write_bytes(b"\x00" * index.data_end + build_footer(index))
    return os.open(path, os.O_RDONLY)


def _index(pools: list[str]) -> SegmentIndex:
    names, codes = pool_table(pools)
    n = len(pools)
    return SegmentIndex(
        size=0, data_end=10, keys=[f"{i:04x}.{p}" for i, p in enumerate(pools)],
        groups=[f"{i:04x}" for i in range(n)], pools=codes, offsets=array("Q", [0] * n),
        lengths=array("Q", [1] * n), names=names,
    )


def test_a_footer_names_every_pool_of_its_records(tmp_path: Path) -> None:
    pools = ["kv", "indexer", "draft", "mamba", "indexer", "v4_compressed"]
    fd = _footer_file(tmp_path, _index(pools))
    try:
        idx = read_index(fd)
    finally:
        os.close(fd)
    assert idx.names[:2] == CLASSIC_POOLS
    assert [idx.names[c] for c in idx.pools] == pools
    version = struct.unpack_from("<H", (tmp_path / "seg").read_bytes()[-64:], 8)[0]
    assert version == 2


def test_classic_pools_keep_the_version_1_segment_bytes(tmp_path: Path) -> None:
    """A segment of kv and draft pages only is written exactly as before open pools: version 1,
    pool codes 0 and 1, no name table (older versions of the backend read it)."""
    index = _index(["kv", "draft", "kv"])
    raw = build_footer(index)
    footer = b"".join((
        array("Q", [0, 0, 0]).tobytes(), array("Q", [1, 1, 1]).tobytes(), bytes([0, 1, 0]),
        "\n".join(index.keys).encode(), "\n".join(index.groups).encode(),
    ))
    head = struct.pack("<8sHHIQIIQ20s", SEG_MAGIC, 1, 0, 3, 10, len("\n".join(index.keys)),
                       len("\n".join(index.groups)), xxhash.xxh3_64_intdigest(footer), b"\x00" * 20)
    assert raw == footer + head + struct.pack("<I", xxhash.xxh32_intdigest(head))


def test_a_version_1_segment_is_read_as_kv_and_draft(tmp_path: Path) -> None:
    index = _index(["draft", "kv"])
    fd = _footer_file(tmp_path, index)
    try:
        idx = read_index(fd)
    finally:
        os.close(fd)
    assert idx.names == CLASSIC_POOLS and list(idx.pools) == [1, 0]


def test_every_pool_of_a_prefix_survives_a_restart_apart(open_store, kit) -> None:
    """One page_set of seven pools (one segment, a version-2 footer); a fresh instance on the same
    root finds each pool's pages under that pool only, byte for byte."""
    groups = [kit.group(i, 7) for i in range(3)]
    first = open_store()
    res = first.page_set([PageTransfer(p, _pages(kit, p, groups, 300)) for p in POOLS])
    assert all(res[p] == [OK] * 3 for p in POOLS), res
    first.close()
    fresh = open_store()
    assert fresh.page_exists({p: [pg.key for pg in _pages(kit, p, groups, 1)] for p in POOLS}) == {p: 3 for p in POOLS}
    # another pool's keys asked for under a pool: not its pages
    assert fresh.page_exists({"indexer": [pg.key for pg in _pages(kit, PoolKind.KV, groups, 1)]}) == {"indexer": 0}
    assert fresh.page_exists({PoolKind.KV: [pg.key for pg in _pages(kit, "mamba", groups, 1)]}) == {PoolKind.KV: 0}
    reads = [PageTransfer(p, _pages(kit, p, groups, 300, fill=False)) for p in POOLS]
    got, _ = fresh.page_get(reads)
    for t in reads:
        assert got[t.pool] == [OK] * 3, (t.pool, got[t.pool])
        assert all(bytes(pg.buffers[0].view()) == kit.payload(pg.key, 300) for pg in t.pages), t.pool


def test_a_rejected_page_of_an_open_pool_quarantines_its_segment(open_store, kit) -> None:
    groups = [kit.group(i, 8) for i in range(2)]
    store = open_store()
    assert store.page_set([PageTransfer("indexer", _pages(kit, "indexer", groups, 100))])["indexer"] == [OK, OK]
    store.backend.page_rejected({"indexer": [f"{groups[0]}.{NS['indexer']}"]})
    assert store.backend.stats.segments_quarantined == 1
    got, _ = open_store().page_get([PageTransfer("indexer", _pages(kit, "indexer", groups, 100, fill=False))])
    assert got["indexer"] == [MISS, MISS]


def test_a_pool_name_a_footer_cannot_hold_fails_its_pages(open_store, kit) -> None:
    store = open_store()
    res = store.page_set([PageTransfer("bad\nname", _pages(kit, "indexer", [kit.group(0, 9)], 10)),
                          PageTransfer("indexer", _pages(kit, "indexer", [kit.group(1, 9)], 10))])
    assert res == {"bad\nname": [PageResult.FAILED], "indexer": [OK]}
