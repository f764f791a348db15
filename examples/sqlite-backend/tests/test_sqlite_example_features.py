"""What the sqlite backend adds beyond the conformance kit: options, file safety, corruption
handling, the byte budget with whole-group LRU eviction, deadlines, closing, and two processes."""

from __future__ import annotations

import os
import secrets
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hicache_draft_sqlite import SqliteBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import (
    HEADER_SIZE,
    BackendSetupError,
    Buffer,
    ConfigError,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    Store,
    make_key,
)

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
OK, MISS, CORRUPT, FAILED = PageResult.OK, PageResult.MISS, PageResult.CORRUPT, PageResult.FAILED
NS = {KV: secrets.token_hex(12), DRAFT: secrets.token_hex(12)}


def page(group: str, pool: PoolKind, sizes: list[int], fill: bool = True) -> Page:
    bufs = tuple(Buffer.of(bytearray(os.urandom(n) if fill else bytes(n))) for n in sizes)
    return Page(key=make_key(group, NS[pool]), group=group, namespace=NS[pool], buffers=bufs)


def blank(p: Page) -> Page:
    return Page(p.key, p.group, p.namespace, tuple(Buffer.of(bytearray(b.nbytes)) for b in p.buffers))


def data(p: Page) -> bytes:
    return b"".join(bytes(b.view()) for b in p.buffers)


def open_store(path: Path, **opts) -> Store:
    return Store.open("sqlite", {"path": str(path), **opts})


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "kv.db"


def raw(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, isolation_level=None)


# -- options and files ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("opts", "field", "words"),
    [
        ({"path": ""}, "path", "at least 1 character"),
        ({"path": ":memory:"}, "path", "database file on disk"),
        ({"path": "file:kv.db?mode=memory"}, "path", "database file on disk"),
        ({"path": "kv\x00.db"}, "path", "NUL"),
        ({"path": "kv.db", "max_bytes": 1024}, "max_bytes", "greater than or equal to 65536"),
        ({"path": "kv.db", "busy_timeout_s": 0}, "busy_timeout_s", "greater than 0"),
        ({"path": "kv.db", "synchronous": "sometimes"}, "synchronous", "'off', 'normal' or 'full'"),
        ({"path": "kv.db", "root": "/tmp"}, "root", "Extra inputs are not permitted"),
        ({}, "path", "Field required"),
    ],
)
def test_bad_options_name_the_field(opts, field, words):
    with pytest.raises(ConfigError) as err:
        Store.open("sqlite", opts)
    assert err.value.field == f"backend_options.{field}"
    assert words in str(err.value)


def test_missing_directory_is_a_setup_error_naming_it(tmp_path):
    with pytest.raises(BackendSetupError, match="does not exist"):
        open_store(tmp_path / "nope" / "kv.db")
    with pytest.raises(BackendSetupError, match="is a directory"):
        open_store(tmp_path)


def test_foreign_files_are_refused_untouched(tmp_path):
    other = tmp_path / "other.db"
    with raw(other) as conn:
        conn.execute("CREATE TABLE notes (t TEXT)")
    with pytest.raises(BackendSetupError, match="another application"):
        open_store(other)
    with raw(other) as conn:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("notes",)]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    text = tmp_path / "text.db"
    text.write_bytes(b"this is not a database" * 100)
    with pytest.raises(BackendSetupError, match="cannot open"):
        open_store(text)


def test_a_newer_schema_is_refused(db):
    open_store(db).close()
    with raw(db) as conn:
        conn.execute("PRAGMA user_version = 2")
    with pytest.raises(BackendSetupError, match="schema version 2"):
        open_store(db)


def test_wal_mode_and_synchronous_setting(db):
    with open_store(db, synchronous="full") as store:
        store.page_set([PageTransfer(KV, [page("aa", KV, [64])])])
        assert store.backend.usage() == (1, HEADER_SIZE + 64)
        assert store.backend._conn().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with raw(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 65536


# -- round trips and corruption --------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6), read_split=st.integers(1, 3))
def test_any_buffer_split_round_trips(tmp_path, sizes, read_split):
    """Bytes written from one split of buffers read back into another split of the same length."""
    db = tmp_path / f"{secrets.token_hex(4)}.db"
    with open_store(db) as store:
        src = page(secrets.token_hex(32), DRAFT, sizes)
        assert store.page_set([PageTransfer(DRAFT, [src])]) == {DRAFT: [OK]}
        total = sum(sizes)
        cut = [total // read_split] * (read_split - 1)
        parts = [*cut, total - sum(cut)]
        dst = page(src.group, DRAFT, [n for n in parts if n], fill=False)
        assert store.page_get([PageTransfer(DRAFT, [dst], zero_copy=True)])[0] == {DRAFT: [OK]}
        assert data(dst) == data(src)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, HEADER_SIZE + 300 - 1), flip=st.integers(1, 255))
def test_any_flipped_byte_is_corrupt_never_data(tmp_path, position, flip):
    db = tmp_path / f"{secrets.token_hex(4)}.db"
    with open_store(db) as store:
        src = page(secrets.token_hex(32), KV, [100, 200])
        store.page_set([PageTransfer(KV, [src])])
        with raw(db) as conn:
            (blob,) = conn.execute("SELECT data FROM pages WHERE key = ?", (src.key,)).fetchone()
            bad = bytearray(blob)
            bad[position] ^= flip
            conn.execute("UPDATE pages SET data = ? WHERE key = ?", (bytes(bad), src.key))
        assert store.page_get([PageTransfer(KV, [blank(src)])])[0] == {KV: [CORRUPT]}
        assert store.backend.usage() == (0, 0), "a corrupt page is dropped"
        assert store.page_set([PageTransfer(KV, [src])]) == {KV: [OK]}  # and a later backup restores it
        dst = blank(src)
        assert store.page_get([PageTransfer(KV, [dst])])[0] == {KV: [OK]}
        assert data(dst) == data(src)


def test_truncated_and_foreign_rows_are_corrupt(db):
    with open_store(db) as store:
        a, b, c = (page(secrets.token_hex(32), KV, [128]) for _ in range(3))
        store.page_set([PageTransfer(KV, [a, b, c])])
        with raw(db) as conn:
            conn.execute("UPDATE pages SET data = substr(data, 1, 100) WHERE key = ?", (a.key,))
            conn.execute("UPDATE pages SET data = zeroblob(10) WHERE key = ?", (b.key,))
            (cblob,) = conn.execute("SELECT data FROM pages WHERE key = ?", (c.key,)).fetchone()
            d = page(secrets.token_hex(32), KV, [128])
            conn.execute("INSERT INTO pages(key, grp, pool, nbytes, data) VALUES (?, ?, 'kv', ?, ?)",
                         (d.key, d.group, len(cblob), cblob))  # c's bytes under d's key
        res, _ = store.page_get([PageTransfer(KV, [blank(a), blank(b), blank(c), blank(d)])])
        assert res == {KV: [CORRUPT, CORRUPT, OK, CORRUPT]}


def test_draft_and_target_pages_of_one_group_are_kept_apart(db):
    with open_store(db) as store:
        g = secrets.token_hex(32)
        kv, dr = page(g, KV, [96, 96]), page(g, DRAFT, [40])
        assert store.page_set([PageTransfer(KV, [kv]), PageTransfer(DRAFT, [dr])]) == {KV: [OK], DRAFT: [OK]}
        got_kv, got_dr = blank(kv), blank(dr)
        assert store.page_get([PageTransfer(DRAFT, [got_dr]), PageTransfer(KV, [got_kv])])[0] == {DRAFT: [OK], KV: [OK]}
        assert (data(got_kv), data(got_dr)) == (data(kv), data(dr))
        # the draft's key read as a target page (same key, other pool) is refused by the header
        crossed = Page(dr.key, g, dr.namespace, (Buffer.of(bytearray(40)),))
        assert store.page_get([PageTransfer(KV, [crossed])])[0] == {KV: [CORRUPT]}


# -- the byte budget ------------------------------------------------------------------------------
def test_budget_evicts_least_recently_used_groups_whole(db):
    budget = 1 << 16
    size = 4000  # one group = a kv page and a draft page: 2 * (64 + 4000) bytes
    fit = budget // (2 * (HEADER_SIZE + size))
    groups = [secrets.token_hex(32) for _ in range(3 * fit)]

    def present(g: str) -> tuple[int, int]:
        kv = store.page_exists({KV: [make_key(g, NS[KV])]})[KV]
        return kv, store.page_exists({DRAFT: [make_key(g, NS[DRAFT])]})[DRAFT]

    with open_store(db, max_bytes=budget) as store:
        for i, g in enumerate(groups):
            both = [PageTransfer(KV, [page(g, KV, [size])]), PageTransfer(DRAFT, [page(g, DRAFT, [size])])]
            res = store.page_set(both)
            assert res == {KV: [OK], DRAFT: [OK]}
            pages, total = store.backend.usage()
            assert total <= budget
            assert pages == 2 * min(i + 1, fit)
            assert all(present(x) in {(0, 0), (1, 1)} for x in groups[: i + 1]), "groups are evicted whole"
            if i == fit - 1:  # full: read the oldest group, so that it becomes the most recently used
                assert store.page_get([PageTransfer(KV, [page(groups[0], KV, [size], fill=False)])])[0] == {KV: [OK]}
            if i == fit:
                assert present(groups[0]) == (1, 1), "a group read recently outlives older unread ones"
                assert present(groups[1]) == (0, 0)
        assert [present(g) for g in groups[-fit:]] == [(1, 1)] * fit
        assert sum(present(g)[0] for g in groups) == fit


def test_a_page_larger_than_the_budget_fails_alone(db):
    with open_store(db, max_bytes=1 << 16) as store:
        small, big = page("aa", KV, [100]), page("bb", KV, [1 << 16])
        assert store.page_set([PageTransfer(KV, [small, big])]) == {KV: [OK, FAILED]}
        assert store.page_exists({KV: [small.key]}) == {KV: 1}
        assert store.page_exists({KV: [big.key]}) == {KV: 0}


def test_unbounded_store_never_evicts(db):
    with open_store(db) as store:
        for _ in range(30):
            store.page_set([PageTransfer(KV, [page(secrets.token_hex(32), KV, [4096])])])
        assert store.backend.usage() == (30, 30 * (HEADER_SIZE + 4096))


# -- bounds and lifecycle ---------------------------------------------------------------------------
def test_a_passed_deadline_stores_and_reads_nothing(db):
    with open_store(db) as store:
        backend: SqliteBackend = store.backend
        p = page("cc", KV, [256])
        past = time.monotonic() - 1
        assert backend.page_set([PageTransfer(KV, [p])], deadline=past) == {KV: [FAILED]}
        assert backend.usage() == (0, 0)
        store.page_set([PageTransfer(KV, [p])])
        assert backend.page_get([PageTransfer(KV, [blank(p)])], deadline=past) == {KV: [FAILED]}


def test_a_locked_database_fails_within_the_deadline(db):
    with open_store(db, busy_timeout_s=30) as store:
        holder = raw(db)
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        try:
            res = store.backend.page_set([PageTransfer(KV, [page("dd", KV, [64])])], deadline=time.monotonic() + 0.2)
            assert res == {KV: [FAILED]}
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert store.page_set([PageTransfer(KV, [page("dd", KV, [64])])]) == {KV: [OK]}


def test_calls_after_close_fail_without_raising(db):
    store = open_store(db)
    p = page("ee", KV, [64])
    store.page_set([PageTransfer(KV, [p])])
    backend = store.backend
    store.close()
    assert backend.page_set([PageTransfer(KV, [p])], deadline=time.monotonic() + 5) == {KV: [FAILED]}
    assert backend.page_exists({KV: [p.key]}, deadline=time.monotonic() + 5) == {KV: 0}
    with open_store(db) as again:  # and the data is still there for the next process
        assert again.page_exists({KV: [p.key]}) == {KV: 1}


def test_two_processes_share_one_store(db):
    """A second process writes while this one has the store open; this one then reads its pages."""
    with open_store(db) as store:
        mine = page(secrets.token_hex(32), KV, [512])
        assert store.page_set([PageTransfer(KV, [mine])]) == {KV: [OK]}
        group = secrets.token_hex(32)
        script = textwrap.dedent(f"""
            from hicache_draft import Buffer, Page, PageTransfer, PoolKind, Store, make_key
            ns = {NS[DRAFT]!r}
            page = Page(make_key({group!r}, ns), {group!r}, ns, (Buffer.of(bytearray(range(256)) * 2),))
            with Store.open("sqlite", {{"path": {str(db)!r}}}) as s:
                print(s.page_set([PageTransfer(PoolKind.DRAFT, [page])])[PoolKind.DRAFT][0].name)
                print(s.page_exists({{PoolKind.KV: [{mine.key!r}]}})[PoolKind.KV])
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["OK", "1"]
        dst = page(group, DRAFT, [512], fill=False)
        assert store.page_get([PageTransfer(DRAFT, [dst])])[0] == {DRAFT: [OK]}
        assert data(dst) == bytes(range(256)) * 2
