"""hicache-draft-sqlite: a storage backend that keeps KV-cache pages in one SQLite database file.

Written by an outside author against hicache-draft's public API only (``import hicache_draft``).
"""

from hicache_draft_sqlite.backend import SqliteBackend
from hicache_draft_sqlite.options import SqliteOptions

__all__ = ["SqliteBackend", "SqliteOptions"]
