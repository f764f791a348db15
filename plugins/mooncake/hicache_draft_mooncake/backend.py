"""The ``mooncake`` storage backend: one Mooncake object per page, header first.

A page is stored as ONE object: the 64-byte core header (key digest, namespace, pool, payload
length, xxh3_64 of the payload) followed by the page's raw bytes. Two ways to move it (option
``io_mode``, see :class:`~hicache_draft_mooncake.options.MooncakeOptions`):

* **direct**: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` over a small
  registered header slot plus the page's own buffers (K and V, or every layer's buffer): zero
  copy, ``1 + buffers`` transfers per page.
* **staged**: the header and the page are copied with ``memmove`` into one slot of a registered,
  reused staging arena and moved with ``batch_put_from`` / ``batch_get_into``: one transfer per
  page. On a get the header and checksum are verified on the staging bytes before anything is
  copied to the destination.

The header is checked on every read: the expected header is rebuilt from the bytes that
arrived (one xxh3 pass) and compared; a mismatch is diagnosed with the core's
``parse_header``/``verify_payload`` and counted ``CORRUPT``. Nothing goes through Python bytes
objects; checksums run over memoryviews of registered memory.

Large batches are pipelined (:mod:`hicache_draft_mooncake.pipeline`): checksums and copies of one
sub-batch overlap the native transfer of the next. Puts skip keys the store already holds (one
``batch_is_exist`` per batch; equal keys hold equal bytes); existence is one ``batch_is_exist``
for all pools' keys. Every call checks its deadline between native calls; after a master RPC
failure the backend answers at once for ``retry_interval_s`` (see
:mod:`hicache_draft_mooncake.breaker`).

In shared-memory mode the backend offers host pool memory through the core's ``host_memory``
hook (memory from the segment holder's shared pool), so pages move without a bounce copy.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

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
from hicache_draft_mooncake import codes, pipeline
from hicache_draft_mooncake.breaker import Breaker
from hicache_draft_mooncake.client import connect
from hicache_draft_mooncake.memory import Arena, Memory
from hicache_draft_mooncake.options import MooncakeOptions

log = logging.getLogger("hicache_draft_mooncake")

_POOL = PoolCapability(
    attention=frozenset({Attention.MHA, Attention.MLA}),
    zero_copy_layouts=frozenset(Layout),
    generic=True,
    max_buffers_per_page=None,
)

EXIST_BATCH_KEYS = 4096
"""Keys per ``batch_is_exist`` call in ``page_exists`` (one RPC for any usual prefetch)."""

OK, MISS, CORRUPT, FAILED = PageResult.OK, PageResult.MISS, PageResult.CORRUPT, PageResult.FAILED
_STAT = {OK: "get", MISS: "miss", CORRUPT: "corrupt", FAILED: "failed"}


@dataclass(slots=True)
class _Job:
    """One page of one call: where its result goes, its Mooncake key and its size."""

    pool: PoolKind
    index: int
    page: Page
    key: str
    nbytes: int


@dataclass(slots=True)
class _Sub:
    """A prepared sub-batch: its jobs, the arena it borrowed and the native call's arguments."""

    jobs: list[_Job]
    arena: Arena | None = None
    ptrs: list[Any] = field(default_factory=list)
    sizes: list[Any] = field(default_factory=list)


def _chunks(items: list[_Job], n: int) -> Iterator[list[_Job]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class MooncakeBackend(StorageBackend):
    """Mooncake distributed store backend (TCP or shared-memory client mode)."""

    api_version: ClassVar[int] = 2

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
        self._worker: ThreadPoolExecutor | None = None
        self.stats: Counter[str] = Counter()

    # -- helpers ---------------------------------------------------------------------------
    def key(self, page: Page) -> str:
        """The Mooncake key of a page."""
        return self.opts.key_prefix + page.key

    def _note(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            self.stats[what] += 1
            first = what not in self._logged
            self._logged.add(what)
        (log.warning if first else log.debug)(msg, *args)

    def _merge(self, counts: Counter[str]) -> None:
        if counts:
            with self._lock:
                self.stats.update(counts)

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
        if not bad:
            return
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

    def _pool_worker(self) -> ThreadPoolExecutor | None:
        """The persistent thread native calls run on while the caller checksums (pipelining)."""
        if self.opts.pipeline_bytes <= 0:
            return None
        with self._lock:
            if self._worker is None and not self._closed:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-draft-mooncake-io")
            return self._worker

    def _jobs(self, transfers: Sequence[PageTransfer]) -> list[_Job]:
        prefix = self.opts.key_prefix
        return [
            _Job(t.pool, i, p, prefix + p.key, sum(b.nbytes for b in p.buffers))
            for t in transfers
            for i, p in enumerate(t.pages)
        ]

    def _split(self, jobs: list[_Job], counts: Counter[str]) -> tuple[list[_Job], list[_Job]]:
        """(staged, direct) jobs, by ``io_mode`` and, in shm mode, by where the buffers live."""
        staged: list[_Job] = []
        direct: list[_Job] = []
        mode = self.opts.io_mode
        shm = self._mem.shm
        limit = self.opts.staged_max_page_bytes
        auto_stage = mode == "auto" and not shm and self.opts.protocol == "tcp"
        for job in jobs:
            if shm and not self._mem.inside(job.page.buffers):
                counts["bounced_pages"] += 1
                staged.append(job)
            elif mode == "staged" or (auto_stage and job.nbytes <= limit):
                staged.append(job)
            else:
                direct.append(job)
        counts["staged_pages"] += len(staged)
        return staged, direct

    def _subs(self, jobs: list[_Job], staged: bool) -> list[list[_Job]]:
        limit = self.opts.pipeline_bytes
        if staged:
            limit = min(limit, self.opts.max_staging_bytes) if limit > 0 else self.opts.max_staging_bytes
        return pipeline.split_by_bytes(jobs, lambda j: j.nbytes + HEADER_SIZE, limit)

    def _release(self, sub: _Sub) -> None:
        if sub.arena is not None:
            self._mem.give_back(sub.arena)
            sub.arena = None

    def _payload_views(self, page: Page) -> list[memoryview]:
        return self._mem.views(page.buffers)

    # -- hooks -----------------------------------------------------------------------------
    @hookimpl
    def host_memory(self, pool: PoolKind, nbytes: int) -> Buffer | None:
        """Shared-memory mode: host pool memory from the segment holder's shared pool (registered,
        so pages move without a bounce copy; valid until the backend closes). TCP mode: ``None``."""
        if not self._mem.shm:
            return None
        ptr, arr = self._mem.allocate(nbytes)
        log.debug("mooncake: %d bytes of shared memory for the %r host pool at %#x", nbytes, pool.value, ptr)
        return Buffer(ptr, nbytes, owner=arr)

    @hookimpl
    def register_pool(self, registration: PoolRegistration) -> None:
        outside = 0
        for region in (*registration.regions, *registration.staging):
            if not self._mem.register_external(region.ptr, region.nbytes):
                outside += 1
        if outside:
            log.warning(
                "mooncake shared-memory mode: %d region(s) of pool %r are not in the shared pool, so its pages "
                "go through a staging copy; let the controller allocate host pools (host_memory hook) for zero copy",
                outside, registration.pool.value,
            )

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        return self._each_chunk("put", self._set_chunk, transfers, deadline)

    def _each_chunk(
        self,
        what: str,
        run: Callable[[list[_Job], dict[PoolKind, list[PageResult]], float, Counter[str]], None],
        transfers: Sequence[PageTransfer],
        deadline: float,
    ) -> dict[PoolKind, list[PageResult]]:
        """Run ``run`` chunk by chunk within the deadline; a chunk that raises fails only its pages."""
        results = {t.pool: [FAILED] * len(t.pages) for t in transfers}
        jobs = self._jobs(transfers)
        if not jobs or not self._open():
            return results
        counts: Counter[str] = Counter()
        try:
            for chunk in _chunks(jobs, self.opts.max_batch_pages):
                if time.monotonic() >= deadline or self._breaker.down or self._closed:
                    break
                try:
                    run(chunk, results, deadline, counts)
                except Exception as exc:  # noqa: BLE001 (per-page failures, never an exception)
                    for job in chunk:
                        results[job.pool][job.index] = FAILED
                    self._note(f"{what}:{type(exc).__name__}", "mooncake %s failed: %s: %s", what,
                               type(exc).__name__, exc)
        finally:
            self._merge(counts)
        return results

    def _set_chunk(
        self, chunk: list[_Job], results: dict[PoolKind, list[PageResult]], deadline: float, counts: Counter[str]
    ) -> None:
        present = self._exist([j.key for j in chunk])
        todo: list[_Job] = []
        for job, rc in zip(chunk, present, strict=True):
            if rc == 1:
                results[job.pool][job.index] = OK
                counts["put_skipped"] += 1
            elif rc == 0:
                todo.append(job)
        if not todo or self._breaker.down:
            return
        staged, direct = self._split(todo, counts)
        worker = self._pool_worker()
        for group, is_staged in ((staged, True), (direct, False)):
            if not group or time.monotonic() >= deadline:
                continue
            prepare = self._prepare_staged_put if is_staged else self._prepare_direct_put
            native = self._native_put_staged if is_staged else self._native_put_direct

            def finish(sub: list[_Job], prep: _Sub, rcs: list[int] | None) -> None:
                self._finish_put(sub, rcs, results, counts)

            pipeline.run(self._subs(group, is_staged), prepare, native, finish, self._release, worker, deadline)

    def _prepare_staged_put(self, jobs: list[_Job]) -> _Sub:
        sizes = [HEADER_SIZE + j.nbytes for j in jobs]
        arena = self._mem.borrow(sum(sizes))
        sub = _Sub(jobs, arena, sizes=sizes)
        mv, base, off = arena.view, arena.ptr, 0
        memmove = ctypes.memmove
        for job, size in zip(jobs, sizes, strict=True):
            dst = base + off + HEADER_SIZE
            for b in job.page.buffers:
                memmove(dst, b.ptr, b.nbytes)
                dst += b.nbytes
            mv[off : off + HEADER_SIZE] = self._header(job, [mv[off + HEADER_SIZE : off + size]])
            sub.ptrs.append(base + off)
            off += size
        return sub

    def _prepare_direct_put(self, jobs: list[_Job]) -> _Sub:
        arena = self._mem.borrow(HEADER_SIZE * len(jobs))
        sub = _Sub(jobs, arena)
        mv, base = arena.view, arena.ptr
        for n, job in enumerate(jobs):
            page = job.page
            off = n * HEADER_SIZE
            mv[off : off + HEADER_SIZE] = self._header(job, None)
            sub.ptrs.append([base + off, *(b.ptr for b in page.buffers)])
            sub.sizes.append([HEADER_SIZE, *(b.nbytes for b in page.buffers)])
        return sub

    def _native_put_staged(self, sub: _Sub) -> list[int]:
        return list(self._store.batch_put_from([j.key for j in sub.jobs], sub.ptrs, sub.sizes, self._cfg))

    def _native_put_direct(self, sub: _Sub) -> list[int]:
        return list(self._store.batch_put_from_multi_buffers([j.key for j in sub.jobs], sub.ptrs, sub.sizes,
                                                             self._cfg))

    def _finish_put(
        self, jobs: list[_Job], rcs: list[int] | None, results: dict[PoolKind, list[PageResult]],
        counts: Counter[str],
    ) -> None:
        if rcs is None:
            counts["put_not_sent"] += len(jobs)
            return
        if len(rcs) != len(jobs):
            rcs = [codes.INTERNAL_ERROR] * len(jobs)
        self._codes_seen("put", rcs)
        counts["put_batches"] += 1
        for job, rc in zip(jobs, rcs, strict=True):
            res = codes.put_result(rc)
            results[job.pool][job.index] = res
            counts["put" if res is OK else "put_failed"] += 1

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        return self._each_chunk("get", self._get_chunk, transfers, deadline)

    def _get_chunk(
        self, chunk: list[_Job], results: dict[PoolKind, list[PageResult]], deadline: float, counts: Counter[str]
    ) -> None:
        staged, direct = self._split(chunk, counts)
        worker = self._pool_worker()
        for group, is_staged in ((staged, True), (direct, False)):
            if not group or time.monotonic() >= deadline:
                continue
            prepare = self._prepare_staged_get if is_staged else self._prepare_direct_get
            native = self._native_get_staged if is_staged else self._native_get_direct

            def finish(jobs: list[_Job], sub: _Sub, rcs: list[int] | None, staged: bool = is_staged) -> None:
                self._finish_get(sub, rcs, staged, results, counts)

            pipeline.run(self._subs(group, is_staged), prepare, native, finish, self._release, worker, deadline)

    def _prepare_staged_get(self, jobs: list[_Job]) -> _Sub:
        sizes = [HEADER_SIZE + j.nbytes for j in jobs]
        arena = self._mem.borrow(sum(sizes))
        sub = _Sub(jobs, arena, sizes=sizes)
        off = 0
        for size in sizes:
            sub.ptrs.append(arena.ptr + off)
            off += size
        return sub

    def _prepare_direct_get(self, jobs: list[_Job]) -> _Sub:
        arena = self._mem.borrow(HEADER_SIZE * len(jobs))
        sub = _Sub(jobs, arena)
        for n, job in enumerate(jobs):
            bufs = job.page.buffers
            sub.ptrs.append([arena.ptr + n * HEADER_SIZE, *(b.ptr for b in bufs)])
            sub.sizes.append([HEADER_SIZE, *(b.nbytes for b in bufs)])
        return sub

    def _native_get_staged(self, sub: _Sub) -> list[int]:
        return list(self._store.batch_get_into([j.key for j in sub.jobs], sub.ptrs, sub.sizes))

    def _native_get_direct(self, sub: _Sub) -> list[int]:
        return list(self._store.batch_get_into_multi_buffers([j.key for j in sub.jobs], sub.ptrs, sub.sizes))

    def _finish_get(
        self, sub: _Sub, rcs: list[int] | None, staged: bool, results: dict[PoolKind, list[PageResult]],
        counts: Counter[str],
    ) -> None:
        jobs = sub.jobs
        if rcs is None:
            counts["get_not_sent"] += len(jobs)
            return
        if len(rcs) != len(jobs):
            rcs = [codes.INTERNAL_ERROR] * len(jobs)
        self._codes_seen("get", rcs)
        counts["get_batches"] += 1
        assert sub.arena is not None
        mv, base = sub.arena.view, sub.arena.ptr
        memmove = ctypes.memmove
        off = 0
        for n, (job, rc) in enumerate(zip(jobs, rcs, strict=True)):
            res = codes.get_result(rc, HEADER_SIZE + job.nbytes)
            if staged:
                if res is None:
                    body = off + HEADER_SIZE
                    res = self._check(job, mv[off:body], [mv[body : body + job.nbytes]])
                    if res is OK:
                        src = base + body
                        for b in job.page.buffers:
                            memmove(b.ptr, src, b.nbytes)
                            src += b.nbytes
                off += HEADER_SIZE + job.nbytes
            elif res is None:
                hoff = n * HEADER_SIZE
                res = self._check(job, mv[hoff : hoff + HEADER_SIZE], self._payload_views(job.page))
            if res is OK and job.page.header is not None:
                hoff = off - HEADER_SIZE - job.nbytes if staged else n * HEADER_SIZE
                job.page.header.view()[:] = mv[hoff : hoff + HEADER_SIZE]
            results[job.pool][job.index] = res
            counts[_STAT[res]] += 1

    def _header(self, job: _Job, payload: list[memoryview] | None) -> bytes | memoryview:
        """The header stored with a page: the core's (made before the call from the bytes handed
        over, so a late read of reused memory never matches it), or one made here."""
        page = job.page
        if page.header is not None:
            return page.header.view()
        return make_header(page.key, page.namespace, job.pool, payload or self._payload_views(page))

    def _check(self, job: _Job, header: memoryview, payload: list[memoryview]) -> PageResult:
        """``OK`` when the stored header is exactly the one these payload bytes, key, namespace and
        pool make (one checksum pass); otherwise the core's parser says what is wrong."""
        page = job.page
        if bytes(header) == make_header(page.key, page.namespace, job.pool, payload):
            return OK
        try:
            head = parse_header(header, page.key, page.namespace, job.pool)
            verify_payload(head, payload, job.nbytes)
        except PageFormatError as exc:
            self._note(f"corrupt:{exc.problem.name}", "mooncake page %s is corrupt (%s); counted as a miss",
                       page.key, exc)
            return CORRUPT
        return OK

    @hookimpl
    def page_exists(self, queries: Mapping[PoolKind, Sequence[str]], deadline: float) -> dict[PoolKind, int]:
        out = {pool: 0 for pool in queries}
        if not any(queries.values()) or not self._open():
            return out
        prefix = self.opts.key_prefix
        keys = [prefix + k for ks in queries.values() for k in ks]
        rcs: list[int] = []
        for start in range(0, len(keys), EXIST_BATCH_KEYS):
            if time.monotonic() >= deadline or self._breaker.down:
                break
            try:
                rcs += self._exist(keys[start : start + EXIST_BATCH_KEYS])
            except Exception as exc:  # noqa: BLE001 (an error counts as "not stored")
                self._note(f"exist:{type(exc).__name__}", "mooncake exist failed: %s", exc)
                break
        start = 0
        for pool, ks in queries.items():
            mine = rcs[start : start + len(ks)]
            start += len(ks)
            out[pool] = next((j for j, rc in enumerate(mine) if rc != 1), len(mine))
        return out

    @hookimpl
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        self._mem.release()
        try:
            self._store.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("mooncake close failed: %s", exc)

    # -- introspection (tests, CLI) ----------------------------------------------------------
    def in_shared_memory(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` is shared-memory-pool memory this backend handed out
        (always False in TCP mode)."""
        return self._mem.shm and self._mem.contains(ptr, nbytes)

    @property
    def native(self) -> Any:  # noqa: ANN401 (the native client has no type stubs)
        """The underlying ``MooncakeDistributedStore`` (benchmarks and tests)."""
        return self._store
