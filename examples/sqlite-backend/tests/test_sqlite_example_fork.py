"""A forked child of a process with the sqlite store open. SQLite keeps its file locks per process
and its record of them in process memory that ``fork`` copies: a connection carried into the child
(or a new one opened there on the same file, which shares that copied record) holds none of the
locks SQLite believes it holds. So the child must never use or close the parent's connections, nor
open the same file again while they are alive in its memory; every call there fails at once, saying
why. A lock a parent thread held at the fork stays held in the child: nothing there may wait for it.
After the child, the parent reads back everything it stored and goes on storing."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from hicache_draft_sqlite import SqliteBackend

from hicache_draft import (
    BackendContext,
    BackendSetupError,
    Buffer,
    Page,
    PageResult,
    PageTransfer,
    PoolKind,
    Store,
    make_key,
)
from hicache_draft.testing import CHILD_OK, in_forked_child

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
OK, FAILED = PageResult.OK, PageResult.FAILED
NS = {KV: secrets.token_hex(12), DRAFT: secrets.token_hex(12)}
FAST_S = 2.0  # a child's calls fail at once: all of them together well inside this


def page(pool: PoolKind, size: int = 3000) -> Page:
    group = secrets.token_hex(32)
    buf = Buffer.of(bytearray(os.urandom(size)))
    return Page(key=make_key(group, NS[pool]), group=group, namespace=NS[pool], buffers=(buf,))


def blank(p: Page) -> Page:
    return Page(p.key, p.group, p.namespace, tuple(Buffer.of(bytearray(b.nbytes)) for b in p.buffers))


def data(p: Page) -> bytes:
    return b"".join(bytes(b.view()) for b in p.buffers)


def open_store(path: Path) -> Store:
    return Store.open("sqlite", {"path": str(path)}, BackendContext(timeout_s=5.0))


def stored(store: Store, n: int = 4) -> list[Page]:
    """``n`` target pages and ``n`` draft pages, stored."""
    kv, dr = [page(KV) for _ in range(n)], [page(DRAFT) for _ in range(n)]
    assert store.page_set([PageTransfer(KV, kv), PageTransfer(DRAFT, dr)]) == {KV: [OK] * n, DRAFT: [OK] * n}
    return kv + dr


def reads_back(store: Store, pages: list[Page]) -> bool:
    """Every page is there with its bytes."""
    for p in pages:
        pool = KV if p.namespace == NS[KV] else DRAFT
        dst = blank(p)
        if store.page_get([PageTransfer(pool, [dst])])[0] != {pool: [OK]} or data(dst) != data(p):
            return False
    return True


def parent_goes_on(path: Path, store: Store, pages: list[Page]) -> None:
    """The parent reads back what it stored, stores more, and the file is sound."""
    assert reads_back(store, pages), "the parent lost pages it had stored"
    assert reads_back(store, stored(store, 2))
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fails_fast_saying_why(store: Store, kept: list[Page]) -> bool:
    """In the child: every call through the inherited store fails at once, says it is a fork and
    what to use instead, and closing it neither waits nor touches the parent's connections."""
    records = _Records()
    logging.getLogger("hicache_draft_sqlite").addHandler(records)
    t0 = time.monotonic()
    new = page(KV)
    set_res = store.page_set([PageTransfer(KV, [new])])
    get_res, _ = store.page_get([PageTransfer(KV, [blank(p) for p in kept[:2]])])
    found = store.page_exists({KV: [kept[0].key]})
    try:
        store.backend.usage()
        told = "usage() answered"
    except Exception as exc:  # whatever it raises must say why
        told = str(exc)
    fast = time.monotonic() - t0 < FAST_S
    store.backend.close()  # directly, unbounded: a lock that stayed held would hang the child here
    logged = " ".join(records.lines)
    return (
        fast and set_res == {KV: [FAILED]} and get_res == {KV: [FAILED, FAILED]} and found == {KV: 0}
        and "fork" in told and "spawn" in told and "fork" in logged and "spawn" in logged
    )


# -- the inherited store --------------------------------------------------------------------------
def test_a_forked_child_never_uses_the_parents_connection(tmp_path: Path) -> None:
    db = tmp_path / "kv.db"
    store = open_store(db)
    kept = stored(store)
    verdict = in_forked_child(lambda: fails_fast_saying_why(store, kept), timeout_s=30)
    assert verdict == CHILD_OK, f"the child used the parent's connection, or failed slowly or silently (code {verdict})"
    parent_goes_on(db, store, kept)
    store.close()


def _the_backend_lock(be: SqliteBackend, held: threading.Event, let_go: threading.Event) -> None:
    """Taken as the parent thread opens its own connection."""
    with be._lock:
        held.set()
        let_go.wait(120.0)


def _a_write_transaction(be: SqliteBackend, held: threading.Event, let_go: threading.Event) -> None:
    """SQLite's record in the child says this process holds the write lock; no thread there ends it."""
    conn = be._conn()
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO meta(k, v) VALUES ('fork-test', 1)")
    held.set()
    let_go.wait(120.0)
    conn.execute("COMMIT")


def _a_running_statement(be: SqliteBackend, held: threading.Event, let_go: threading.Event) -> None:
    """Inside SQLite: the connection's mutex is held, and stays held in the child."""
    conn = be._conn()
    conn.create_function("hold", 0, lambda: int(held.set() or let_go.wait(120.0)))
    conn.execute("SELECT hold()").fetchone()


@pytest.mark.parametrize("hold", [_the_backend_lock, _a_write_transaction, _a_running_statement])
def test_a_forked_child_is_not_stopped_by_what_a_parent_thread_held(tmp_path: Path, hold) -> None:
    """A parent thread holds something at the fork: the child's calls, and its close, neither
    wait for it nor touch it; the parent thread then finishes as if nothing happened."""
    db = tmp_path / "kv.db"
    store = open_store(db)
    kept = stored(store)
    held, let_go = threading.Event(), threading.Event()
    t = threading.Thread(target=hold, args=(store.backend, held, let_go))
    t.start()
    try:
        assert held.wait(10.0)
        verdict = in_forked_child(lambda: fails_fast_saying_why(store, kept), timeout_s=30)
    finally:
        let_go.set()
        t.join()
    assert verdict == CHILD_OK, f"the child waited for what a parent thread held, or used it (code {verdict})"
    parent_goes_on(db, store, kept)
    if hold is _a_write_transaction:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("SELECT v FROM meta WHERE k = 'fork-test'").fetchone() == (1,)
    store.close()


# -- nothing the child is told is stored may be lost ------------------------------------------------
@pytest.mark.parametrize("which", ["inherited", "reopened"])
def test_no_page_a_forked_child_was_told_is_stored_is_lost(tmp_path: Path, which: str) -> None:
    """The child stores a page; the parent closes its store and another reader of the file (a
    backup tool, a second server) opens and closes it; the child stores another page. A child whose
    connection shared the parent's record of SQLite's locks held none of them, so that reader took
    itself for the last one: it checkpointed and deleted the WAL under the child, and the child's
    next page, reported OK, went into a deleted file."""
    db = tmp_path / "kv.db"
    store = open_store(db)
    kept = stored(store)
    first, second = page(KV), page(KV)
    report = tmp_path / "child.json"
    ask_r, ask_w = os.pipe()
    done_r, done_w = os.pipe()

    def close_when_asked() -> None:
        if os.read(ask_r, 1):
            store.close()
            with contextlib.closing(sqlite3.connect(db)) as reader:
                reader.execute("SELECT count(*) FROM pages").fetchone()
        os.write(done_w, b"1")

    closer = threading.Thread(target=close_when_asked)
    closer.start()

    def child() -> bool:
        try:
            mine = store if which == "inherited" else open_store(db)
        except BackendSetupError as exc:
            os.write(ask_w, b"1")
            os.read(done_r, 1)
            report.write_text(json.dumps({"refused": str(exc)}))
            return True
        a = mine.page_set([PageTransfer(KV, [first])])[KV][0]
        os.write(ask_w, b"1")
        os.read(done_r, 1)  # the parent has closed its store
        b = mine.page_set([PageTransfer(KV, [second])])[KV][0]
        report.write_text(json.dumps({first.key: a.name, second.key: b.name}))
        return True

    try:
        verdict = in_forked_child(child, timeout_s=60)
    finally:
        os.close(ask_w)  # a child that never asked: the closer reads the end of the pipe
        closer.join(10.0)
        for fd in (ask_r, done_r, done_w):
            os.close(fd)
    store.close()
    assert verdict == CHILD_OK, f"code {verdict}"
    told = json.loads(report.read_text())
    if "refused" in told:
        assert "fork" in told["refused"] and "spawn" in told["refused"], told["refused"]
    with open_store(db) as again:
        lost = [k for k, v in told.items() if v == "OK" and again.page_exists({KV: [k]}) != {KV: 1}]
        assert lost == [], f"the child was told OK for {len(lost)} of {len(told)} pages that are not stored: {told}"
        assert reads_back(again, kept)


# -- what a forked child may still do -------------------------------------------------------------
def test_a_forked_child_may_open_another_file_or_one_closed_before_the_fork(tmp_path: Path) -> None:
    db, other, earlier = tmp_path / "kv.db", tmp_path / "other.db", tmp_path / "earlier.db"
    store = open_store(db)
    kept = stored(store)
    with open_store(earlier) as closed_before:
        kept_earlier = stored(closed_before)

    def child() -> bool:
        ok = True
        for path in (other, earlier):
            with open_store(path) as own:
                ok = ok and reads_back(own, stored(own))
        with open_store(earlier) as own:
            ok = ok and reads_back(own, kept_earlier)
        return ok

    verdict = in_forked_child(child, timeout_s=60)
    assert verdict == CHILD_OK, f"code {verdict}"
    parent_goes_on(db, store, kept)
    store.close()
