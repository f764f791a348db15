"""The in-memory catalog against a plain model: after any sequence of segments added and removed,
each key maps to its newest live copy, each group to the live segments holding it, and the byte
and page counts add up."""

from __future__ import annotations

from array import array
from pathlib import Path

from hicache_draft_file.catalog import Catalog, Segment
from hicache_draft_file.segment_format import SegmentIndex, pool_table
from hypothesis import given, settings
from hypothesis import strategies as st

POOLS = ["kv", "draft", "indexer", "draft_indexer", "mamba"]
_page = st.tuples(st.integers(0, 5), st.sampled_from(POOLS))  # (group number, pool)
_op = st.one_of(
    st.tuples(st.just("add"), st.lists(_page, max_size=6)),
    st.tuples(st.just("remove"), st.integers(0, 30)),
)


def _segment(n: int, pages: list[tuple[int, str]]) -> Segment:
    groups = [f"{g:04x}" for g, _pool in pages]
    names, codes = pool_table(pool for _g, pool in pages)
    idx = SegmentIndex(
        size=100 + n, data_end=50, keys=[f"{g}.{pool}" for g, (_, pool) in zip(groups, pages, strict=True)],
        groups=groups, pools=codes, offsets=array("Q", range(len(pages))), lengths=array("Q", [7] * len(pages)),
        names=names,
    )
    return Segment(name=f"{n:016x}-00000001", seg_dir=Path("/nowhere"), index=idx)


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=25))
def test_the_catalog_matches_a_plain_model(ops: list[tuple[str, object]]) -> None:
    cat = Catalog()
    live: list[Segment] = []  # in the order added
    made: list[Segment] = []
    for kind, arg in ops:
        if kind == "add":
            seg = _segment(len(made), arg)  # type: ignore[arg-type]
            made.append(seg)
            cat.add(seg)
            live.append(seg)
        elif made:
            seg = made[arg % len(made)]  # type: ignore[operator]
            assert (cat.remove(seg.name) is seg) == (seg in live)
            if seg in live:
                live.remove(seg)
                assert not seg.live
    for pool in POOLS:
        want: dict[str, tuple[Segment, int]] = {}
        for seg in live:  # newest copy wins
            for i, (key, code) in enumerate(zip(seg.index.keys, seg.index.pools, strict=True)):
                if seg.index.names[code] == pool:
                    want[key] = (seg, i)
        got = {k: cat.lookup(pool, k) for k in cat.keys.get(pool, {})}
        # a key whose newest copy was removed is gone (not resurrected from an older segment)
        assert set(got) <= set(want)
        for key, entry in got.items():
            assert entry == want[key]
        newest_alive = {
            k for k, (seg, _i) in want.items()
            if not any(k in later.index.keys for later in made[made.index(seg) + 1:] if later not in live)
        }
        assert newest_alive <= set(got)
    for g in {grp for seg in made for grp in seg.index.groups}:
        assert cat.group_segments(g) == {seg.name for seg in live if g in seg.index.groups}
    assert cat.pages == sum(len(seg.index) for seg in live)
    assert cat.bytes == sum(seg.size for seg in live)
