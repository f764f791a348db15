"""The in-memory index of one process: which segment holds each key, and each group's segments.

Built at start-up from the segment footers, kept current from this process's own writes and
the shared journal. A key maps to ``(segment, record number)``; when a key is stored more than
once the newest copy wins. Groups map to the segments holding any of their pages, which is what
eviction needs to remove every pool's pages of a group (target, draft, indexer, ...) together.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path

from hicache_draft import HEADER_SIZE
from hicache_draft_file.naming import SEGMENT_SUFFIX, fanout_dir
from hicache_draft_file.segment_format import CLASSIC_POOLS, SegmentIndex


@dataclass(eq=False)
class Segment:
    """A published segment this process knows of."""

    name: str
    seg_dir: Path  # ROOT/seg: the path is made only when a message or a test needs it
    index: SegmentIndex
    ident: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file loaded: a replaced name is not it
    live: bool = field(default=True)
    sid: int = field(default=-1)  # the catalog's number for it, set by Catalog.add

    @property
    def path(self) -> Path:
        return self.seg_dir / fanout_dir(self.name) / (self.name + SEGMENT_SUFFIX)

    @property
    def size(self) -> int:
        return self.index.size

    def offset(self, i: int) -> int:
        return self.index.offsets[i]

    def payload_len(self, i: int) -> int:
        return self.index.lengths[i]


Entry = tuple[Segment, int]
_REC_BITS = 32  # a key's value in Catalog.keys: (segment number << _REC_BITS) | record number
_REC_MASK = (1 << _REC_BITS) - 1



@functools.lru_cache(maxsize=256)
def _mask(code: int) -> bytes:
    """A translation table turning a footer's pool codes into 1 where they equal ``code``, else 0."""
    return bytes(int(c == code) for c in range(256))


class Catalog:
    """Keys, segments and groups; not thread-safe by itself (the backend holds its lock)."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        # pool name -> key -> (segment number << 32) | record number. Plain ints rather than
        # (segment, record) tuples: a tuple holding an object stays tracked by Python's garbage
        # collector, and millions of them made every collection walk the whole index (indexing
        # 100k pages at a restart spent two thirds of its time in the collector).
        self.keys: dict[str, dict[str, int]] = {p: {} for p in CLASSIC_POOLS}  # other pools as they come
        self.by_sid: dict[int, Segment] = {}
        self._next_sid = 0
        self._groups: dict[str, str | set[str]] = {}
        self.bytes = 0
        self.pages = 0

    def __contains__(self, name: str) -> bool:
        return name in self.segments

    def lookup(self, pool: str, key: str) -> Entry | None:
        value = self.keys.get(pool, {}).get(key)
        return None if value is None else self.entry(value)

    def entry(self, value: int) -> Entry:
        """``(segment, record number)`` of a value of :attr:`keys`."""
        return self.by_sid[value >> _REC_BITS], value & _REC_MASK

    def add(self, seg: Segment) -> None:
        if seg.name in self.segments:
            return
        self.segments[seg.name] = seg
        seg.sid = self._next_sid
        self._next_sid += 1
        self.by_sid[seg.sid] = seg
        self.bytes += seg.size
        self.pages += len(seg.index)
        # Bulk dictionary operations in C: a restart adds every stored page through here.
        idx = seg.index
        base = seg.sid << _REC_BITS
        values = range(base, base + len(idx))
        pools = bytes(idx.pools)
        for code, pool in enumerate(idx.names):
            have = pools.count(code)
            if have == len(pools):
                self.keys.setdefault(pool, {}).update(zip(idx.keys, values, strict=True))
            elif have:
                self.keys.setdefault(pool, {}).update(
                    compress(zip(idx.keys, values, strict=True), pools.translate(_mask(code))))
        name = seg.name
        groups = self._groups
        if groups.keys().isdisjoint(idx.groups):  # the usual case: probes only, no set made
            groups.update(dict.fromkeys(idx.groups, name))
            return
        new = dict.fromkeys(idx.groups, name)
        for group in new.keys() & groups.keys():  # groups already stored elsewhere (rare)
            del new[group]
            have_g = groups[group]
            if isinstance(have_g, str):
                if have_g != name:
                    groups[group] = {have_g, name}
            else:
                have_g.add(name)
        groups.update(new)

    def remove(self, name: str) -> Segment | None:
        seg = self.segments.pop(name, None)
        if seg is None:
            return None
        seg.live = False
        del self.by_sid[seg.sid]
        self.bytes -= seg.size
        self.pages -= len(seg.index)
        idx = seg.index
        maps = [self.keys.get(name, {}) for name in idx.names]
        groups = self._groups
        for key, group, code in zip(idx.keys, idx.groups, idx.pools, strict=True):
            m = maps[code]
            value = m.get(key)
            if value is not None and value >> _REC_BITS == seg.sid:
                del m[key]
            have = groups.get(group)
            if have == name:
                del groups[group]
            elif isinstance(have, set):
                have.discard(name)
                if len(have) == 1:
                    groups[group] = next(iter(have))
        return seg

    def closure(self, names: Iterable[str]) -> set[str]:
        """``names`` plus every segment sharing a group with them, transitively: evicting that
        set never leaves a draft page without its target page or the reverse."""
        out: set[str] = set()
        todo = [n for n in names if n in self.segments]
        while todo:
            name = todo.pop()
            if name in out:
                continue
            out.add(name)
            for group in set(self.segments[name].index.groups):
                have = self._groups.get(group)
                if isinstance(have, set):
                    todo.extend(n for n in have if n not in out)
        return out

    def half_groups(self, seg: Segment) -> bool:
        """``seg`` holds pages of one pool only, its groups are stored nowhere else, and another
        pool has pages stored: its groups wait for their other pools' pages (a draft call whose
        target call has not come yet)."""
        if len(set(seg.index.pools)) != 1 or sum(1 for m in self.keys.values() if m) < 2:
            return False
        groups = self._groups
        return all(groups.get(g) == seg.name for g in set(seg.index.groups))

    def group_segments(self, group: str) -> set[str]:
        have = self._groups.get(group)
        if have is None:
            return set()
        return {have} if isinstance(have, str) else set(have)


def record_end(seg: Segment, i: int) -> int:
    return seg.offset(i) + HEADER_SIZE + seg.payload_len(i)
