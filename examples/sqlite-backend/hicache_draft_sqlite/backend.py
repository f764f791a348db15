"""The sqlite backend: pages as BLOBs in one WAL-mode SQLite file.

* ``page_set`` writes each page's header and then its buffers straight into a preallocated BLOB
  (no joined copy); one ``BEGIN IMMEDIATE`` transaction per call, one savepoint per page, so a
  page that fails leaves nothing behind and the others still land.
* ``page_get`` reads under one read snapshot: header first (validated with ``parse_header``),
  then each destination buffer in turn, then the payload checksum over the filled buffers
  (``verify_payload``). A page that fails validation is ``CORRUPT`` and its row is dropped, so a
  later backup rewrites it.
* ``max_bytes``: after each write the least recently used *groups* (target and draft pages of one
  prefix page together) are evicted until the store fits; reads refresh a group's use.
* Every call is bounded: SQLite's busy timeout is capped by the call's deadline, and a progress
  handler interrupts a statement that runs past it.
* A forked child never uses or closes the parent's connections and does not open the file again:
  every call there fails at once, saying why (see ``_after_fork_in_child``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    BackendContext,
    BackendSetupError,
    Capabilities,
    Component,
    HeaderProblem,
    Layout,
    Page,
    PageFormatError,
    PageResult,
    PageTransfer,
    PoolCapability,
    PoolKind,
    StorageBackend,
    hookimpl,
    make_header,
    parse_header,
    verify_payload,
)
from hicache_draft_sqlite.options import SqliteOptions
from hicache_draft_sqlite.schema import SchemaError, prepare

log = logging.getLogger("hicache_draft_sqlite")

# a row is any bytes under its key (the pool's name in its own column): every component of any pool
_EVERY_POOL = PoolCapability(
    attention=frozenset(Attention), components=frozenset(Component), zero_copy_layouts=frozenset(Layout), generic=True
)
_IN_CHUNK = 256  # keys per "IN (...)" query (below every SQLite build's variable limit)
_PROGRESS_STEPS = 2000  # SQLite VM steps between deadline checks
_FORKED = (
    "this process is a fork of the one that opened {path!r}: SQLite connections must not cross fork(), and "
    "a new one here would share the parent's record of its file locks (what it writes could be lost), so "
    "the store is unusable here; use it from a process started with the 'spawn' or 'forkserver' method"
)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class SqliteBackend(StorageBackend):
    """KV-cache pages in one SQLite file (see the module docs)."""

    api_version: ClassVar[int] = 2

    capabilities: ClassVar[Capabilities] = Capabilities(
        pools={PoolKind.KV: _EVERY_POOL, PoolKind.DRAFT: _EVERY_POOL},
        split_heads=True,  # head parts arrive under their own keys; storing them needs nothing more
        persistent=True,
        shared=True,  # processes of one host (WAL); not over a network file system
    )
    Options: ClassVar[type[BaseModel]] = SqliteOptions

    def __init__(self, options: BaseModel, context: BackendContext) -> None:
        super().__init__(options, context)
        if not isinstance(options, SqliteOptions):
            raise BackendSetupError(f"backend 'sqlite': options must be SqliteOptions, got {type(options).__name__}")
        self.opts = options
        self.path = os.path.abspath(os.path.expanduser(options.path))
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            raise BackendSetupError(f"backend 'sqlite': directory {folder!r} of path {self.path!r} does not exist")
        if os.path.isdir(self.path):
            raise BackendSetupError(f"backend 'sqlite': path {self.path!r} is a directory; name a database file")
        if _file_id(self.path) in _INHERITED:
            raise BackendSetupError("backend 'sqlite': " + _FORKED.format(path=self.path))
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._closed = False
        self._forked = False
        _LIVE.add(self)  # before the first connection: a fork from here on must be seen
        try:
            conn = self._conn()
            conn.execute("PRAGMA page_size = 65536")  # takes effect in a new file only: big pages suit big BLOBs
            prepare(conn, self.path)  # refuses a foreign file before anything is changed in it
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise BackendSetupError(f"backend 'sqlite': {self.path!r} cannot use WAL mode (got {mode!r})")
        except SchemaError as exc:
            self.close()
            raise BackendSetupError(f"backend 'sqlite': {exc}") from None
        except BackendSetupError:
            self.close()
            raise
        except sqlite3.Error as exc:
            self.close()
            raise BackendSetupError(f"backend 'sqlite': cannot open {self.path!r}: {exc}") from None

    # -- connections ---------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (the store calls hooks from a small worker pool)."""
        if self._forked:
            raise sqlite3.ProgrammingError(_FORKED.format(path=self.path))
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        with self._lock:
            if self._closed:
                raise sqlite3.ProgrammingError("the sqlite store is closed")
            conn = sqlite3.connect(
                self.path, timeout=self.opts.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._conns.append(conn)
        conn.execute(f"PRAGMA synchronous = {self.opts.synchronous.upper()}")
        self._local.conn = conn
        return conn

    def _after_fork_in_child(self) -> None:
        """In a forked child. SQLite keeps its file locks per process, and its record of them in
        process memory that the fork copied: the parent's connections here hold none of the locks
        SQLite believes they hold, and a new connection to the same file would share that record
        (it takes no lock of its own, so a process that then closes the file last deletes the WAL
        under it). So nothing here uses the file: every call fails at once (``_conn``), and a new
        store on the file is refused. The parent's connections are kept, never closed: one that a
        parent thread was using at the fork holds SQLite's mutex for good, and closing one could
        roll back that thread's transaction in the WAL index the parent shares. A fresh lock: one
        a parent thread held at the fork stays held."""
        self._forked = True
        self._lock = threading.Lock()
        _PARENTS_CONNECTIONS.extend(self._conns)
        self._conns = []
        file = _file_id(self.path)
        if file is not None and not self._closed:
            _INHERITED.add(file)

    @contextlib.contextmanager
    def _bounded(self, conn: sqlite3.Connection, deadline: float) -> Iterator[None]:
        """Cap lock waits and statements at ``deadline`` for the duration of one call."""
        left = max(0.001, min(self.opts.busy_timeout_s, deadline - time.monotonic()))
        conn.execute(f"PRAGMA busy_timeout = {max(1, int(left * 1000))}")
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), _PROGRESS_STEPS)
        try:
            yield
        finally:
            conn.set_progress_handler(None, 0)

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    # -- writing -------------------------------------------------------------------------------
    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[str, list[PageResult]]:
        out = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        try:
            conn = self._conn()
            with self._bounded(conn, deadline):
                conn.execute("BEGIN IMMEDIATE")
                try:
                    groups: set[str] = set()
                    for t in transfers:
                        for i, page in enumerate(t.pages):
                            if time.monotonic() > deadline:
                                raise TimeoutError("page_set passed its deadline")
                            out[t.pool][i] = self._put(conn, t.pool, page)
                            if out[t.pool][i] == PageResult.OK:
                                groups.add(page.group)
                    self._touch(conn, groups)
                    if self.opts.max_bytes is not None:
                        self._evict(conn, self.opts.max_bytes)
                    conn.execute("COMMIT")
                except BaseException:
                    self._rollback(conn)
                    raise
        except (sqlite3.Error, TimeoutError) as exc:
            log.warning("sqlite %s: page_set failed: %s", self.path, exc)
            return {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        return out

    def _put(self, conn: sqlite3.Connection, pool: str, page: Page) -> PageResult:
        size = HEADER_SIZE + page.nbytes
        if self.opts.max_bytes is not None and size > self.opts.max_bytes:
            log.warning("sqlite %s: page of %d bytes exceeds max_bytes %d", self.path, size, self.opts.max_bytes)
            return PageResult.FAILED
        conn.execute("SAVEPOINT page")
        try:
            cur = conn.execute(
                "INSERT INTO pages(key, grp, pool, nbytes, data) VALUES (?, ?, ?, ?, zeroblob(?)) "
                "ON CONFLICT(key) DO NOTHING",
                (page.key, page.group, str(pool), size, size),
            )
            if cur.rowcount == 1:  # new; an existing key holds the same bytes, so it stays as is
                views = [b.view() for b in page.buffers]
                # the core's header (made before the call, from the bytes handed over): stored as is
                header = page.header.view() if page.header is not None else make_header(
                    page.key, page.namespace, pool, views
                )
                assert cur.lastrowid is not None
                with conn.blobopen("pages", "data", cur.lastrowid) as blob:
                    blob.write(header)
                    for view in views:
                        blob.write(view)
            conn.execute("RELEASE page")
            return PageResult.OK
        except sqlite3.Error as exc:
            if not conn.in_transaction:
                raise
            conn.execute("ROLLBACK TO page")
            conn.execute("RELEASE page")
            if isinstance(exc, sqlite3.OperationalError) and "interrupt" in str(exc):
                raise
            log.warning("sqlite %s: page %s not stored: %s", self.path, page.key, exc)
            return PageResult.FAILED

    def _touch(self, conn: sqlite3.Connection, groups: set[str]) -> None:
        """Mark groups as just used (eviction takes the least recently used first)."""
        now = time.time_ns()
        conn.executemany("UPDATE groups SET used = ? WHERE grp = ?", [(now, g) for g in groups])

    def _evict(self, conn: sqlite3.Connection, budget: int) -> None:
        total = conn.execute("SELECT v FROM meta WHERE k = 'total_bytes'").fetchone()[0]
        while total > budget:
            rows = conn.execute("SELECT grp, nbytes FROM groups ORDER BY used LIMIT ?", (_IN_CHUNK,)).fetchall()
            if not rows:
                return
            victims = []
            for grp, nbytes in rows:
                victims.append((grp,))
                total -= nbytes
                if total <= budget:
                    break
            conn.executemany("DELETE FROM pages WHERE grp = ?", victims)
            total = conn.execute("SELECT v FROM meta WHERE k = 'total_bytes'").fetchone()[0]

    # -- reading -------------------------------------------------------------------------------
    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[str, list[PageResult]]:
        out = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        corrupt: list[str] = []
        hits: set[str] = set()
        try:
            conn = self._conn()
            with self._bounded(conn, deadline):
                conn.execute("BEGIN")  # one read snapshot: no row changes under an open blob
                try:
                    for t in transfers:
                        for i, page in enumerate(t.pages):
                            if time.monotonic() > deadline:
                                raise TimeoutError("page_get passed its deadline")
                            out[t.pool][i] = self._read(conn, t.pool, page, corrupt)
                            if out[t.pool][i] == PageResult.OK:
                                hits.add(page.group)
                finally:
                    self._rollback(conn)  # ends the read transaction
                if corrupt or (hits and self.opts.max_bytes is not None):
                    self._after_read(conn, corrupt, hits)
        except (sqlite3.Error, TimeoutError) as exc:
            log.warning("sqlite %s: page_get stopped: %s", self.path, exc)
        return out  # pages read before a failure were fully read and verified; the rest stay FAILED

    def _read(self, conn: sqlite3.Connection, pool: str, page: Page, corrupt: list[str]) -> PageResult:
        row = conn.execute("SELECT id, length(data) FROM pages WHERE key = ?", (page.key,)).fetchone()
        if row is None:
            return PageResult.MISS
        rowid, length = row
        with conn.blobopen("pages", "data", rowid, readonly=True) as blob:
            try:
                raw = blob.read(HEADER_SIZE)
                header = parse_header(raw, page.key, page.namespace, pool)
                if length != HEADER_SIZE + header.payload_len:
                    raise PageFormatError(HeaderProblem.LENGTH, f"blob of {length} bytes")
            except PageFormatError as exc:
                log.warning("sqlite %s: page %s is corrupt (%s); dropped", self.path, page.key, exc)
                corrupt.append(page.key)
                return PageResult.CORRUPT
            if header.payload_len != page.nbytes:
                log.warning(
                    "sqlite %s: page %s holds %d bytes but the destination has %d",
                    self.path, page.key, header.payload_len, page.nbytes,
                )
                return PageResult.FAILED
            views = [b.view() for b in page.buffers]
            for view in views:
                view[:] = blob.read(len(view))
        if page.header is not None:
            page.header.view()[:] = raw  # the core checks it again against the bytes it got
        try:
            verify_payload(header, views, page.nbytes)
        except PageFormatError as exc:
            log.warning("sqlite %s: page %s is corrupt (%s); dropped", self.path, page.key, exc)
            corrupt.append(page.key)
            return PageResult.CORRUPT
        return PageResult.OK

    def _after_read(self, conn: sqlite3.Connection, corrupt: list[str], hits: set[str]) -> None:
        """Drop corrupt rows and refresh the use of hit groups (best effort: a busy store skips it)."""
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("DELETE FROM pages WHERE key = ?", [(k,) for k in corrupt])
                if self.opts.max_bytes is not None:
                    self._touch(conn, hits)
                conn.execute("COMMIT")
            except BaseException:
                self._rollback(conn)
                raise
        except sqlite3.Error as exc:
            log.info("sqlite %s: post-read upkeep skipped: %s", self.path, exc)

    # -- existence -----------------------------------------------------------------------------
    @hookimpl
    def page_exists(self, queries: Mapping[str, Sequence[str]], deadline: float) -> dict[str, int]:
        out = {pool: 0 for pool in queries}
        try:
            conn = self._conn()
            with self._bounded(conn, deadline):
                for pool, keys in queries.items():
                    out[pool] = self._prefix(conn, keys)
        except sqlite3.Error as exc:
            log.warning("sqlite %s: page_exists failed: %s", self.path, exc)
        return out

    @staticmethod
    def _prefix(conn: sqlite3.Connection, keys: Sequence[str]) -> int:
        n = 0
        for start in range(0, len(keys), _IN_CHUNK):
            chunk = list(keys[start : start + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            found = {r[0] for r in conn.execute(f"SELECT key FROM pages WHERE key IN ({marks})", chunk)}
            for key in chunk:
                if key not in found:
                    return n
                n += 1
        return n

    # -- upkeep --------------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """(stored pages, stored bytes including headers)."""
        conn = self._conn()
        pages = conn.execute("SELECT count(*) FROM pages").fetchone()[0]
        total = conn.execute("SELECT v FROM meta WHERE k = 'total_bytes'").fetchone()[0]
        return int(pages), int(total)

    @hookimpl
    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, []
        _LIVE.discard(self)
        for conn in conns:
            conn.interrupt()
            with contextlib.suppress(sqlite3.Error):
                conn.close()


_LIVE: weakref.WeakSet[SqliteBackend] = weakref.WeakSet()  # stores not closed, for the at-fork hook
_INHERITED: set[tuple[int, int]] = set()  # (device, inode) of files the parent process had open
_PARENTS_CONNECTIONS: list[sqlite3.Connection] = []  # in a forked child: never used, never closed


def _after_fork_in_child() -> None:
    for backend in list(_LIVE):
        backend._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
