"""The in-memory index of one process: which segment holds each key, and each group's segments.

Built at start-up from the segment footers, kept current from this process's own writes and
the shared journal. A key maps to ``(segment, record number)``; when a key is stored more than
once the newest copy wins. Groups map to the segments holding any of their pages, which is what
eviction needs to remove the target and draft pages of a group together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hicache_draft import HEADER_SIZE, PoolKind
from hicache_draft_file.segment_format import CODE_POOL, SegmentIndex


@dataclass(eq=False)
class Segment:
    """A published segment this process knows of."""

    name: str
    path: Path
    index: SegmentIndex
    live: bool = field(default=True)

    @property
    def size(self) -> int:
        return self.index.size

    def offset(self, i: int) -> int:
        return self.index.offsets[i]

    def payload_len(self, i: int) -> int:
        return self.index.lengths[i]


Entry = tuple[Segment, int]


class Catalog:
    """Keys, segments and groups; not thread-safe by itself (the backend holds its lock)."""

    def __init__(self) -> None:
        self.segments: dict[str, Segment] = {}
        self.keys: dict[PoolKind, dict[str, Entry]] = {p: {} for p in PoolKind}
        self._groups: dict[str, str | set[str]] = {}
        self.bytes = 0
        self.pages = 0

    def __contains__(self, name: str) -> bool:
        return name in self.segments

    def lookup(self, pool: PoolKind, key: str) -> Entry | None:
        return self.keys[pool].get(key)

    def add(self, seg: Segment) -> None:
        if seg.name in self.segments:
            return
        self.segments[seg.name] = seg
        self.bytes += seg.size
        self.pages += len(seg.index)
        idx = seg.index
        maps = [self.keys[CODE_POOL[c]] for c in sorted(CODE_POOL)]
        groups = self._groups
        name = seg.name
        for i, (key, group, code) in enumerate(zip(idx.keys, idx.groups, idx.pools, strict=True)):
            maps[code][key] = (seg, i)
            have = groups.get(group)
            if have is None:
                groups[group] = name
            elif isinstance(have, str):
                if have != name:
                    groups[group] = {have, name}
            else:
                have.add(name)

    def remove(self, name: str) -> Segment | None:
        seg = self.segments.pop(name, None)
        if seg is None:
            return None
        seg.live = False
        self.bytes -= seg.size
        self.pages -= len(seg.index)
        idx = seg.index
        maps = [self.keys[CODE_POOL[c]] for c in sorted(CODE_POOL)]
        groups = self._groups
        for key, group, code in zip(idx.keys, idx.groups, idx.pools, strict=True):
            m = maps[code]
            entry = m.get(key)
            if entry is not None and entry[0] is seg:
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

    def group_segments(self, group: str) -> set[str]:
        have = self._groups.get(group)
        if have is None:
            return set()
        return {have} if isinstance(have, str) else set(have)


def record_end(seg: Segment, i: int) -> int:
    return seg.offset(i) + HEADER_SIZE + seg.payload_len(i)
