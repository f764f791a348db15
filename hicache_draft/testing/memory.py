"""An in-memory backend for tests, with failure injection.

It stores pages as header + payload bytes (the real page format) and can be told to fail, drop,
corrupt, delay or raise for chosen keys, pools or page positions, so controller behaviour under
every failure can be tested. It is not registered as an entry point: tests register it with
:func:`hicache_draft.register_backend`. Its storage is a module-level dict per ``space`` option,
so a "fresh instance" over the same space sees the same pages (persistence within a process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from hicache_draft.backend import BackendContext, StorageBackend
from hicache_draft.capabilities import Attention, Capabilities, Component, Layout, PoolCapability, PoolKind
from hicache_draft.hookspecs import API_VERSION, hookimpl
from hicache_draft.page_format import HEADER_SIZE, PageFormatError, make_header, parse_header, verify_payload
from hicache_draft.transfer import Page, PageResult, PageTransfer

_SPACES: dict[str, dict[str, bytes]] = {}
_SPACES_LOCK = threading.Lock()


@dataclass
class Faults:
    """What to break. Keys are page keys; positions are indices within a call's transfer."""

    fail_set_keys: set[str] = field(default_factory=set)
    fail_get_keys: set[str] = field(default_factory=set)
    corrupt_get_keys: set[str] = field(default_factory=set)
    fail_get_positions: dict[str, set[int]] = field(default_factory=dict)
    fail_set_positions: dict[str, set[int]] = field(default_factory=dict)
    raise_on: set[str] = field(default_factory=set)  # hook names that raise
    delay_s: dict[str, float] = field(default_factory=dict)  # hook name -> sleep
    wrong_length: set[str] = field(default_factory=set)  # hook names returning short result lists


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    space: str = "default"


def all_layouts() -> frozenset[Layout]:
    return frozenset(Layout)


class MemoryBackend(StorageBackend):
    """Everything declared: both roles, every component (pages are keyed by their full key, so
    pools of any name are kept apart), both attention types, every layout zero-copy, generic,
    split heads. Tests subclass it with narrower ``capabilities`` to exercise path choice."""

    api_version: ClassVar[int] = API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities(
        pools={
            role: PoolCapability(
                attention=frozenset(Attention), components=frozenset(Component), zero_copy_layouts=all_layouts()
            )
            for role in PoolKind
        },
        split_heads=True,
        persistent=True,
    )
    Options: ClassVar[type[BaseModel]] = MemoryOptions
    faults: ClassVar[Faults] = Faults()
    calls: ClassVar[list[tuple[str, dict[str, int]]]] = []

    def __init__(self, options: BaseModel, context: BackendContext) -> None:
        super().__init__(options, context)
        assert isinstance(options, MemoryOptions)
        with _SPACES_LOCK:
            self.data = _SPACES.setdefault(options.space, {})
        self.lock = threading.Lock()

    @classmethod
    def reset(cls, space: str | None = None) -> None:
        cls.faults = Faults()
        cls.calls = []
        with _SPACES_LOCK:
            if space is None:
                _SPACES.clear()
            else:
                _SPACES.pop(space, None)

    def _maybe(self, hook: str) -> None:
        f = type(self).faults
        if hook in f.delay_s:
            time.sleep(f.delay_s[hook])
        if hook in f.raise_on:
            raise RuntimeError(f"injected failure in {hook}")

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer]) -> dict[str, list[PageResult]]:
        type(self).calls.append(("page_set", {t.pool: len(t.pages) for t in transfers}))
        self._maybe("page_set")
        f = type(self).faults
        out: dict[str, list[PageResult]] = {}
        for t in transfers:
            res = []
            for i, page in enumerate(t.pages):
                if page.key in f.fail_set_keys or i in f.fail_set_positions.get(t.pool, set()):
                    res.append(PageResult.FAILED)
                    continue
                views = [b.view() for b in page.buffers]
                head = page.header.view() if page.header is not None else make_header(
                    page.key, page.namespace, t.pool, views
                )
                blob = bytes(head) + b"".join(bytes(v) for v in views)
                with self.lock:
                    self.data[page.key] = blob
                res.append(PageResult.OK)
            out[t.pool] = res[:-1] if "page_set" in f.wrong_length else res
        return out

    def _read_one(self, pool: str, page: Page) -> PageResult:
        with self.lock:
            blob = self.data.get(page.key)
        if blob is None:
            return PageResult.MISS
        if page.key in type(self).faults.corrupt_get_keys:
            blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
        try:
            header = parse_header(blob, page.key, page.namespace, pool)
            payload = memoryview(blob)[HEADER_SIZE:]
            verify_payload(header, [payload], page.nbytes)
        except PageFormatError:
            return PageResult.CORRUPT
        off = 0
        for b in page.buffers:
            b.view()[:] = payload[off : off + b.nbytes]
            off += b.nbytes
        if page.header is not None:
            page.header.view()[:] = blob[:HEADER_SIZE]
        return PageResult.OK

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[str, list[PageResult]]:
        type(self).calls.append(("page_get", {t.pool: len(t.pages) for t in transfers}))
        self._maybe("page_get")
        f = type(self).faults
        out: dict[str, list[PageResult]] = {}
        for t in transfers:
            res = []
            for i, page in enumerate(t.pages):
                if page.key in f.fail_get_keys or i in f.fail_get_positions.get(t.pool, set()):
                    res.append(PageResult.FAILED)
                else:
                    res.append(self._read_one(t.pool, page))
            out[t.pool] = res[:-1] if "page_get" in f.wrong_length else res
        return out

    @hookimpl
    def page_exists(self, queries: Mapping[str, Sequence[str]]) -> dict[str, int]:
        type(self).calls.append(("page_exists", {p: len(k) for p, k in queries.items()}))
        self._maybe("page_exists")
        out = {}
        with self.lock:
            for pool, keys in queries.items():
                n = 0
                for k in keys:
                    if k not in self.data:
                        break
                    n += 1
                out[pool] = n
        return out

    def drop(self, key: str) -> None:
        """Forget one stored page (simulates eviction)."""
        with self.lock:
            self.data.pop(key, None)

    def keys(self) -> list[str]:
        with self.lock:
            return list(self.data)
