"""Keys never name paths: path-escape attempts are refused per page and nothing leaves the root."""

from __future__ import annotations

import os
from pathlib import Path

from hicache_draft_file.naming import (
    all_names_ok,
    fanout_dir,
    group_problem,
    is_segment_name,
    key_problem,
    page_names_ok,
    segment_name,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind

EVIL = [
    "../../../etc/passwd", "/etc/passwd", "..", ".", "", "a/b.c", "ab.cd/../..", "ab\x00.cd", "AB.CD",
    "a.b.c", "ab.cd\n", "~/x.y", "ab." + "c" * 300, "\\..\\..\\x.y", "ab .cd",
]


def _snapshot(base: Path) -> set[str]:
    return {str(p.relative_to(base)) for p in base.rglob("*")}


def test_path_escape_keys_fail_per_page_and_touch_nothing_outside(open_store, kit, tmp_path: Path) -> None:
    outside_before = _snapshot(tmp_path) - {p for p in _snapshot(tmp_path) if p.startswith("store")}
    store = open_store()
    good = kit.group(7)
    ns = kit.NS[PoolKind.KV]
    pages = [Page(key=k, group=good, namespace=ns, buffers=(Buffer.of(bytearray(64)),)) for k in EVIL]
    pages.append(kit.pages(PoolKind.KV, [good], 64)[0])
    res = store.page_set([PageTransfer(PoolKind.KV, pages)])[PoolKind.KV]
    assert res[:-1] == [PageResult.FAILED] * len(EVIL)
    assert res[-1] is PageResult.OK
    evil_group = [Page(key=f"{good}.{ns}", group="../x", namespace=ns, buffers=(Buffer.of(bytearray(64)),))]
    assert store.page_set([PageTransfer(PoolKind.KV, evil_group)])[PoolKind.KV] == [PageResult.FAILED]
    got, _ = store.page_get([PageTransfer(PoolKind.KV, [Page(k, good, ns, (Buffer.of(bytearray(64)),)) for k in EVIL])])
    assert got[PoolKind.KV] == [PageResult.FAILED] * len(EVIL)
    assert store.page_exists({PoolKind.KV: EVIL}) == {PoolKind.KV: 0}
    outside_after = {p for p in _snapshot(tmp_path) if not p.startswith("store")}
    assert outside_after == outside_before
    for p in (tmp_path / "store").rglob("*"):  # every name under the root is the backend's own
        assert os.path.realpath(p).startswith(str((tmp_path / "store").resolve()))


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_any_accepted_key_is_plain_hex_and_dot(key: str) -> None:
    if key_problem(key) is None:
        head, _, tail = key.partition(".")
        assert head and tail and "/" not in key and ".." not in key and not os.path.isabs(key)
        assert set(head + tail) <= set("0123456789abcdef") and len(key) <= 255


_names = st.one_of(st.text(max_size=300), st.text("0123456789abcdef.", max_size=300), st.integers(), st.none())


@given(_names, _names)
@settings(max_examples=300, deadline=None)
def test_the_fast_name_check_agrees_with_the_explained_one(key: object, group: object) -> None:
    assert page_names_ok(key, group) is (key_problem(key) is None and group_problem(group) is None)


_hexish = st.text("0123456789abcdef.\n", min_size=1, max_size=140)
_valid_key = st.builds(lambda a, b: f"{a}.{b}", st.text("0123456789abcdef", min_size=1, max_size=128),
                       st.text("0123456789abcdef", min_size=1, max_size=126))
_joined = st.lists(_valid_key, min_size=2, max_size=3).map("\n".join)  # reads as several valid keys
_batch_name = st.one_of(_valid_key, _joined, _hexish, _names)


_group = st.text("0123456789abcdef", min_size=1, max_size=128)


@given(st.lists(st.tuples(_batch_name, st.one_of(_group, _group.map(lambda g: f"{g}\n{g}"), _hexish, _names)),
                max_size=6))
@settings(max_examples=400, deadline=None)
def test_the_whole_batch_name_check_never_passes_a_bad_name(pairs: list[tuple[object, object]]) -> None:
    """A batch passes the one-pass check only when every key and group passes one by one: a name
    holding a newline (joined, it would read as two valid ones) or a non-str one fails it."""
    keys, groups = [k for k, _ in pairs], [g for _, g in pairs]
    each = bool(pairs) and all(page_names_ok(k, g) for k, g in pairs)
    assert all_names_ok(keys, groups) is each  # type: ignore[arg-type]


def test_a_key_with_a_newline_fails_the_batch_check() -> None:
    assert all_names_ok(["aa.bb", "cc.dd"], ["aa", "cc"])
    assert not all_names_ok(["aa.bb\ncc.dd"], ["aa"])
    assert not all_names_ok(["aa.bb"], ["aa\ncc"])


@given(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16), st.integers(0, 2**40))
def test_segment_names_are_plain_and_fanned_out(writer: str, seq: int) -> None:
    name = segment_name(writer, seq)
    assert is_segment_name(name) and "/" not in name
    assert len(fanout_dir(name)) == 2 and int(fanout_dir(name), 16) < 256


def test_a_batch_of_bad_keys_warns_once(open_store, kit, caplog) -> None:
    store = open_store()
    ns = kit.NS[PoolKind.KV]
    bad = [Page(f"x{i:03d}.{ns}", kit.group(i), ns, (Buffer.of(bytearray(64)),)) for i in range(50)]
    with caplog.at_level("WARNING", logger="hicache_draft_file"):
        res = store.page_set([PageTransfer(PoolKind.KV, bad)])[PoolKind.KV]
    assert res == [PageResult.FAILED] * 50
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "refused" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "x000" in warned[0].getMessage()  # the first bad key is named
