"""Names on disk: the root's layout, segment file names, and key validation.

Keys never become file names. A page lives inside a segment file whose name the backend makes
itself (``<writer>-<seq>.seg``, hex only), under one of 256 fan-out directories chosen by a hash
of that name. A key is only ever data inside a segment's index, and it is validated before it is
stored, so no key (``..``, ``/``, an absolute path, a NUL byte, anything) can name a path.

Root layout::

    ROOT/FORMAT          "hicache-draft-file 1" (refuses roots of another format)
    ROOT/lock            flock: shared to publish, exclusive to evict or compact the journal
    ROOT/journal         append-only change notices (segment added / removed), see journal.py
    ROOT/evict.intent    the segments an eviction in progress removes (replayed if it died), see backend.py
    ROOT/seg/00 .. ff/   published segments (immutable once renamed here)
    ROOT/tmp/            segments being written (invisible to readers), <segment>.<pid>.tmp
    ROOT/free/           evicted segment files kept for reuse
    ROOT/quarantine/     segments that failed validation, kept for inspection
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import xxhash

from hicache_draft import hex_names_ok

FORMAT_LINE = "hicache-draft-file 1\n"
FANOUT = 256
SEGMENT_SUFFIX = ".seg"
JOURNAL_FILE = "journal"
INTENT_FILE = "evict.intent"
LOCK_FILE = "lock"
MAX_KEY_LEN = 255
MAX_GROUP_LEN = 128
_NS_MAX = 126  # the part of a key after its dot

_SEG_RE = re.compile(r"[0-9a-f]{16}-[0-9a-f]{8}")


def key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid storage key (``None`` when it is)."""
    if not isinstance(key, str):
        return f"key must be a str, got {type(key).__name__}"
    if len(key) > MAX_KEY_LEN:
        return f"key is {len(key)} characters long (at most {MAX_KEY_LEN})"
    if not hex_names_ok([key], MAX_GROUP_LEN, _NS_MAX):
        return f"key {key[:80]!r} is not '<hex>.<hex>' (lowercase hex and one dot)"
    return None


def group_problem(group: object) -> str | None:
    """Why ``group`` is not a valid page group (``None`` when it is)."""
    if not isinstance(group, str):
        return f"group must be a str, got {type(group).__name__}"
    if not hex_names_ok([group], MAX_GROUP_LEN):
        return f"group {group[:80]!r} is not lowercase hex of at most {MAX_GROUP_LEN} digits"
    return None


def page_names_ok(key: object, group: object) -> bool:
    """Whether both ``key`` and ``group`` are valid (the fast check; the ``*_problem`` functions
    say why not)."""
    return all_names_ok([key], [group])  # type: ignore[list-item]


def all_names_ok(keys: list[str], groups: list[str]) -> bool:
    """Whether every key and group is valid (:func:`page_names_ok` of each), in one compiled pass
    over each list; False for an empty list or any that is not a str: check those one by one."""
    return hex_names_ok(keys, MAX_GROUP_LEN, _NS_MAX) and hex_names_ok(groups, MAX_GROUP_LEN)


def is_segment_name(name: str) -> bool:
    """Whether ``name`` (without suffix) is a segment name this backend makes."""
    return _SEG_RE.fullmatch(name) is not None


def new_writer_id() -> str:
    """A random 64-bit writer id, unique per backend instance (so per process and per store)."""
    return secrets.token_hex(8)


def segment_name(writer: str, seq: int) -> str:
    return f"{writer}-{seq & 0xFFFFFFFF:08x}"


def fanout_dir(name: str) -> str:
    """The fan-out directory of a segment: a hash of its name, so every writer spreads evenly."""
    return f"{xxhash.xxh32_intdigest(name.encode()) % FANOUT:02x}"


@dataclass(frozen=True)
class RootLayout:
    """The paths under one store root."""

    root: Path

    @property
    def format_file(self) -> Path:
        return self.root / "FORMAT"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def seg(self) -> Path:
        return self.root / "seg"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def free(self) -> Path:
        return self.root / "free"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def segment_path(self, name: str) -> Path:
        return self.seg / fanout_dir(name) / (name + SEGMENT_SUFFIX)

    def fanout_dirs(self) -> list[Path]:
        return [self.seg / f"{i:02x}" for i in range(FANOUT)]

    def all_dirs(self) -> list[Path]:
        return [self.seg, self.tmp, self.free, self.quarantine, *self.fanout_dirs()]
