"""The ``mooncake`` storage backend: one Mooncake object per page, header first, zero-copy.

A page is stored as ONE object built by ``batch_put_from_multi_buffers`` from the 64-byte core
header followed by the page's buffers (K and V, or every layer's buffer), and read back with
``batch_get_into_multi_buffers`` into a small registered header slot plus the destination
buffers. The header (key digest, namespace, pool, payload length, xxh3_64 of the payload) is
verified before a page is reported ``OK``; anything else is ``CORRUPT``. Nothing is copied
through Python bytes: Mooncake reads and writes the host pool's memory directly.

Puts skip keys the store already holds (one ``batch_is_exist`` per batch; equal keys hold equal
bytes). Existence is one ``batch_is_exist`` per query. Every call checks its deadline between
native batches; after a master RPC failure the backend answers at once for ``retry_interval_s``
(see :mod:`hicache_draft_mooncake.breaker`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, ClassVar

import torch

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    BackendContext,
    Buffer,
    Capabilities,
    Layout,
    Page,
    PageFormatError,
    PageResult,
    PageTransfer,
    PoolCapability,
    PoolKind,
    PoolRegistration,
    StorageBackend,
    hookimpl,
    make_header,
    parse_header,
    verify_payload,
)
from hicache_draft_mooncake import codes
from hicache_draft_mooncake.breaker import Breaker
from hicache_draft_mooncake.client import connect
from hicache_draft_mooncake.memory import Memory
from hicache_draft_mooncake.options import MooncakeOptions

log = logging.getLogger("hicache_draft_mooncake")

_POOL = PoolCapability(
    attention=frozenset({Attention.MHA, Attention.MLA}),
    zero_copy_layouts=frozenset(Layout),
    generic=True,
    max_buffers_per_page=None,
)

Item = tuple[PoolKind, int, Page]
Span = tuple[int, int]  # (ptr, nbytes)


def _chunks(items: list[Item], n: int) -> Iterator[list[Item]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _views(spans: Sequence[Span]) -> list[memoryview]:
    return [Buffer(p, n).view() for p, n in spans]


class MooncakeBackend(StorageBackend):
    """Mooncake distributed store backend (TCP or shared-memory client mode)."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        pools={PoolKind.KV: _POOL, PoolKind.DRAFT: _POOL},
        split_heads=True,
        persistent=True,
        shared=True,
    )
    Options: ClassVar[type[MooncakeOptions]] = MooncakeOptions

    def __init__(self, options: MooncakeOptions, context: BackendContext) -> None:
        super().__init__(options, context)
        self.opts = options
        self._store = connect(options)
        from mooncake.store import ReplicateConfig

        self._cfg = ReplicateConfig()
        self._cfg.replica_num = options.replica_num
        self._mem = Memory(self._store, shm=options.shm)
        self._breaker = Breaker(options.retry_interval_s)
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._closed = False
        self.stats: Counter[str] = Counter()

    # -- helpers ---------------------------------------------------------------------------
    def host_allocator(self) -> Callable[[int], torch.Tensor] | None:
        """An allocator for host pools whose pages this backend can move without a copy.

        Shared-memory mode: memory from the segment holder's shared pool (pass it to
        ``HostPool(spec, n, allocator=...)``; keep the backend open while the pool is used).
        TCP mode: ``None`` (any host memory works).
        """
        return self._mem.tensor if self.opts.shm else None

    def key(self, page: Page) -> str:
        """The Mooncake key of a page."""
        return self.opts.key_prefix + page.key

    def _note(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            self.stats[what] += 1
            first = what not in self._logged
            self._logged.add(what)
        (log.warning if first else log.debug)(msg, *args)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    def _probe(self) -> bool:
        try:
            rc = self._store.batch_is_exist([self.opts.key_prefix + "probe"])
        except Exception:  # noqa: BLE001 (the native client must never break the caller)
            return False
        return bool(rc) and rc[0] >= 0

    def _open(self) -> bool:
        """Whether calls may go to the store now (not closed, master not known to be down)."""
        return not self._closed and self._breaker.allow(self._probe)

    def _codes_seen(self, op: str, rcs: Sequence[int]) -> None:
        bad = {c for c in rcs if c < 0}
        if bad & codes.RPC_CODES or (op == "exist" and codes.INTERNAL_ERROR in bad):
            self._breaker.trip()
            self._note("master_unreachable", "mooncake master %s did not answer (%s); pages count as misses "
                       "for %.1fs, then it is probed again", self.opts.master_server_address,
                       ", ".join(codes.name(c) for c in sorted(bad)), self.opts.retry_interval_s)
        for c in bad - codes.RPC_CODES - {codes.OBJECT_NOT_FOUND}:
            self._note(f"{op}:{c}", "mooncake %s returned %s", op, codes.name(c))

    def _exist(self, keys: list[str]) -> list[int]:
        rcs = list(self._store.batch_is_exist(keys))
        if len(rcs) != len(keys):
            return [codes.INTERNAL_ERROR] * len(keys)
        self._codes_seen("exist", rcs)
        return rcs

    def _place(self, stack: ExitStack, pages: Sequence[Page]) -> list[tuple[list[Span], bool]]:
        """Where Mooncake reads/writes each page: its own buffers, or (shm mode, buffers outside
        the shared pool) a borrowed shared-memory bounce region. Returns (spans, bounced)."""
        placed: list[tuple[list[Span], bool]] = []
        if self._mem.shm:
            outside = [not all(self._mem.contains(b.ptr, b.nbytes) for b in p.buffers) for p in pages]
        else:
            outside = [False] * len(pages)
        if any(outside):
            total = sum(p.nbytes for p, o in zip(pages, outside, strict=True) if o)
            base = stack.enter_context(self._mem.arena(total))
            self._count("bounced_pages", sum(outside))
        off = 0
        for page, out in zip(pages, outside, strict=True):
            if out:
                placed.append(([(base + off, page.nbytes)], True))
                off += page.nbytes
            else:
                placed.append(([(b.ptr, b.nbytes) for b in page.buffers], False))
        return placed

    # -- hooks -----------------------------------------------------------------------------
    @hookimpl
    def register_pool(self, registration: PoolRegistration) -> None:
        outside = 0
        for region in (*registration.regions, *registration.staging):
            if not self._mem.register_external(region.ptr, region.nbytes):
                outside += 1
        if outside:
            log.warning(
                "mooncake shared-memory mode: %d region(s) of pool %r are not in the shared pool, so its pages "
                "go through a bounce copy; allocate host pools with backend.host_allocator() for zero copy",
                outside, registration.pool.value,
            )

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        results = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        items = [(t.pool, i, p) for t in transfers for i, p in enumerate(t.pages)]
        if not items or not self._open():
            return results
        for chunk in _chunks(items, self.opts.max_batch_pages):
            if time.monotonic() >= deadline or self._breaker.down or self._closed:
                break
            try:
                self._set_chunk(chunk, results)
            except Exception as exc:  # noqa: BLE001 (per-page failures, never an exception)
                self._note(f"set:{type(exc).__name__}", "mooncake put failed: %s: %s", type(exc).__name__, exc)
        return results

    def _set_chunk(self, chunk: list[Item], results: dict[PoolKind, list[PageResult]]) -> None:
        keys = [self.key(p) for _, _, p in chunk]
        present = self._exist(keys)
        todo: list[tuple[Item, str]] = []
        for item, key, rc in zip(chunk, keys, present, strict=True):
            if rc == 1:
                results[item[0]][item[1]] = PageResult.OK
                self._count("put_skipped")
            elif rc == 0:
                todo.append((item, key))
        if not todo or self._breaker.down:
            return
        with ExitStack() as stack:
            hdr = stack.enter_context(self._mem.arena(HEADER_SIZE * len(todo)))
            placed = self._place(stack, [it[2] for it, _ in todo])
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for j, ((pool, _, page), _key) in enumerate(todo):
                spans, bounced = placed[j]
                src = [b.view() for b in page.buffers]
                if bounced:
                    dst = spans[0][0]
                    for b in page.buffers:
                        ctypes.memmove(dst, b.ptr, b.nbytes)
                        dst += b.nbytes
                header = make_header(page.key, page.namespace, pool, src)
                ctypes.memmove(hdr + j * HEADER_SIZE, header, HEADER_SIZE)
                ptrs.append([hdr + j * HEADER_SIZE, *(p for p, _ in spans)])
                sizes.append([HEADER_SIZE, *(n for _, n in spans)])
            rcs = list(self._store.batch_put_from_multi_buffers([k for _, k in todo], ptrs, sizes, self._cfg))
        if len(rcs) != len(todo):
            rcs = [codes.INTERNAL_ERROR] * len(todo)
        self._codes_seen("put", rcs)
        for ((pool, i, _), _), rc in zip(todo, rcs, strict=True):
            results[pool][i] = codes.put_result(rc)
            self._count("put" if rc == 0 else "put_failed")

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        results = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        items = [(t.pool, i, p) for t in transfers for i, p in enumerate(t.pages)]
        if not items or not self._open():
            return results
        for chunk in _chunks(items, self.opts.max_batch_pages):
            if time.monotonic() >= deadline or self._breaker.down or self._closed:
                break
            try:
                self._get_chunk(chunk, results)
            except Exception as exc:  # noqa: BLE001 (per-page failures, never an exception)
                for pool, i, _ in chunk:
                    results[pool][i] = PageResult.FAILED
                self._note(f"get:{type(exc).__name__}", "mooncake get failed: %s: %s", type(exc).__name__, exc)
        return results

    def _get_chunk(self, chunk: list[Item], results: dict[PoolKind, list[PageResult]]) -> None:
        with ExitStack() as stack:
            hdr = stack.enter_context(self._mem.arena(HEADER_SIZE * len(chunk)))
            placed = self._place(stack, [p for _, _, p in chunk])
            ptrs = [[hdr + j * HEADER_SIZE, *(p for p, _ in spans)] for j, (spans, _) in enumerate(placed)]
            sizes = [[HEADER_SIZE, *(n for _, n in spans)] for spans, _ in placed]
            keys = [self.key(p) for _, _, p in chunk]
            rcs = list(self._store.batch_get_into_multi_buffers(keys, ptrs, sizes))
            if len(rcs) != len(chunk):
                rcs = [codes.INTERNAL_ERROR] * len(chunk)
            self._codes_seen("get", rcs)
            for j, ((pool, i, page), rc) in enumerate(zip(chunk, rcs, strict=True)):
                spans, bounced = placed[j]
                res = codes.get_result(rc, HEADER_SIZE + page.nbytes)
                if res is None:
                    res = self._validate(pool, page, Buffer(hdr + j * HEADER_SIZE, HEADER_SIZE).view(), spans)
                if res is PageResult.OK and bounced:
                    src = spans[0][0]
                    for b in page.buffers:
                        ctypes.memmove(b.ptr, src, b.nbytes)
                        src += b.nbytes
                results[pool][i] = res
                self._count({PageResult.OK: "get", PageResult.MISS: "miss"}.get(res, res.name.lower()))

    def _validate(self, pool: PoolKind, page: Page, header: memoryview, spans: Sequence[Span]) -> PageResult:
        try:
            head = parse_header(header, page.key, page.namespace, pool)
            verify_payload(head, _views(spans), page.nbytes)
        except PageFormatError as exc:
            self._note(f"corrupt:{exc.problem.name}", "mooncake page %s is corrupt (%s); counted as a miss",
                       page.key, exc)
            return PageResult.CORRUPT
        return PageResult.OK

    @hookimpl
    def page_exists(self, queries: Mapping[PoolKind, Sequence[str]], deadline: float) -> dict[PoolKind, int]:
        out = {pool: 0 for pool in queries}
        if not any(queries.values()) or not self._open():
            return out
        for pool, keys in queries.items():
            n = 0
            step = self.opts.max_batch_pages
            for start in range(0, len(keys), step):
                if time.monotonic() >= deadline or self._breaker.down:
                    break
                batch = keys[start : start + step]
                try:
                    rcs = self._exist([self.opts.key_prefix + k for k in batch])
                except Exception as exc:  # noqa: BLE001 (an error counts as "not stored")
                    self._note(f"exist:{type(exc).__name__}", "mooncake exist failed: %s", exc)
                    break
                lead = next((j for j, rc in enumerate(rcs) if rc != 1), len(rcs))
                n += lead
                if lead < len(batch):
                    break
            out[pool] = n
        return out

    @hookimpl
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mem.release()
        try:
            self._store.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("mooncake close failed: %s", exc)

    # -- introspection (tests, CLI) ----------------------------------------------------------
    @property
    def native(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (benchmarks and tests)."""
        return self._store
