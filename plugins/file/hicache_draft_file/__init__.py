"""hicache-draft-file: the embedded default storage backend of hicache-draft.

Pages of one ``page_set`` call are packed into one immutable segment file (records of a 64-byte
checksummed header plus raw bytes, an index footer, a trailer), published by rename under a
fan-out directory tree; an in-memory index, rebuilt from the footers at start-up and kept current
through a shared journal, answers existence queries.
"""

from hicache_draft_file.backend import FileBackend, FileStats
from hicache_draft_file.options import FileOptions

__all__ = ["FileBackend", "FileOptions", "FileStats"]
