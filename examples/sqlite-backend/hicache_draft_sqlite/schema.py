"""The database layout, and opening a file safely (ours, new, or refused with a reason).

``pages`` holds one row per stored page: the key, its group (the chained page hash shared by the
target and draft pages of one prefix page), the pool, the blob length and the blob (hicache-draft's
64-byte page header, then the raw page bytes). ``groups`` tracks bytes and last use per group, so
eviction removes whole groups; triggers keep it and the byte total in ``meta`` exact.
"""

from __future__ import annotations

import sqlite3

APPLICATION_ID = 0x48434453  # "HCDS"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE pages (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    grp TEXT NOT NULL,
    pool TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX pages_grp ON pages(grp);
CREATE TABLE groups (
    grp TEXT PRIMARY KEY,
    used INTEGER NOT NULL,
    nbytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX groups_used ON groups(used);
CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO meta VALUES ('total_bytes', 0);
CREATE TRIGGER pages_ins AFTER INSERT ON pages BEGIN
    INSERT INTO groups(grp, used, nbytes) VALUES (NEW.grp, 0, NEW.nbytes)
        ON CONFLICT(grp) DO UPDATE SET nbytes = nbytes + excluded.nbytes;
    UPDATE meta SET v = v + NEW.nbytes WHERE k = 'total_bytes';
END;
CREATE TRIGGER pages_del AFTER DELETE ON pages BEGIN
    UPDATE groups SET nbytes = nbytes - OLD.nbytes WHERE grp = OLD.grp;
    DELETE FROM groups WHERE grp = OLD.grp AND nbytes <= 0;
    UPDATE meta SET v = v - OLD.nbytes WHERE k = 'total_bytes';
END;
"""


class SchemaError(Exception):
    """The file is not a store this plugin can use; the message says why."""


def _pragma(conn: sqlite3.Connection, name: str) -> int:
    return int(conn.execute(f"PRAGMA {name}").fetchone()[0])


def prepare(conn: sqlite3.Connection, path: str) -> None:
    """Create the schema in an empty database, accept ours, refuse anything else.

    Runs in one ``BEGIN IMMEDIATE`` transaction, so processes opening a new file at once agree.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        app, version = _pragma(conn, "application_id"), _pragma(conn, "user_version")
        if app == APPLICATION_ID:
            if version != SCHEMA_VERSION:
                raise SchemaError(
                    f"{path!r} was written with store schema version {version}; this hicache-draft-sqlite "
                    f"reads version {SCHEMA_VERSION} (use a matching plugin version or a new file)"
                )
        else:
            tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app != 0 or version != 0 or tables:
                raise SchemaError(
                    f"{path!r} is an SQLite database of another application, not a hicache-draft-sqlite "
                    "store; point 'path' at a new file"
                )
            for statement in _statements(SCHEMA):
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _statements(script: str) -> list[str]:
    """Split the schema into statements (``executescript`` would commit our transaction)."""
    out: list[str] = []
    current = ""
    for line in script.strip().splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            out.append(current.strip())
            current = ""
    return out
