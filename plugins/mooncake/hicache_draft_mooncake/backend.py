"""The ``mooncake`` storage backend: one Mooncake object per page, header first.

A page is stored as ONE object: the 64-byte core header (key digest, namespace, pool, payload
length, xxh3_64 of the payload) followed by the page's raw bytes. Two ways to move it (option
``io_mode``, see :class:`~hicache_draft_mooncake.options.MooncakeOptions`):

* **direct**: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` over a small
  registered header slot plus the page's own buffers (K and V, or every layer's buffer): zero
  copy, ``1 + buffers`` transfers per page.
* **staged**: the header and the page are copied into one slot of a registered, reused staging
  arena (through a Store by the core's ``make_headers(pool, indices, into)``, which hashes each
  page from its copy: one pass over the page's memory; else with ``memmove``) and moved with
  ``batch_put_from`` / ``batch_get_into``: one transfer per page.

The stored header is the core's (``page.header``, made before the call). On a get through the
Store the backend copies the stored header into ``page.header`` and the core verifies every page
reported OK (key, namespace, pool, length, checksum over the destination); the backend then does
not checksum again (measured: shared-memory gets 25-34% faster). Pages read without a Store
header (direct backend calls) are still checked here: the expected header is rebuilt from the
bytes that arrived (one xxh3 pass) and compared, a mismatch is ``CORRUPT``.

Staged batches are pipelined (:mod:`hicache_draft_mooncake.pipeline`): the copies of one
sub-batch overlap the native transfer of the next. Direct batches go in one native call per
chunk of ``max_batch_pages`` (nothing of the backend's to overlap). A get tells the core which
pages landed after every native call (``finished``), so the core verifies them while the rest
moves. Puts skip keys the store already holds (one
``batch_is_exist`` per batch; equal keys hold equal bytes); existence is one ``batch_is_exist``
for all pools' keys. Every call checks its deadline between native calls; after a master RPC
failure the backend answers at once for ``retry_interval_s`` (see
:mod:`hicache_draft_mooncake.breaker`).

In shared-memory mode the backend offers host pool memory through the core's ``host_memory``
hook (memory from the segment holder's shared pool), so pages move without a bounce copy.

Failures (see the plugin README): the native client lives in a :class:`~hicache_draft_mooncake.
session.Session` held by a :class:`~hicache_draft_mooncake.link.Link` (one per process and holder in
shared-memory mode); a :class:`~hicache_draft_mooncake.breaker.Breaker` makes calls fail at once
while the store is down, and its background prober diagnoses (:mod:`~hicache_draft_mooncake.health`),
probes with a real round trip and, in shared-memory mode, replaces a client the holder no longer
serves.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    BackendContext,
    BackendSetupError,
    Buffer,
    Capabilities,
    Component,
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
from hicache_draft_mooncake import codes, health, pipeline
from hicache_draft_mooncake.breaker import Breaker
from hicache_draft_mooncake.client import new_client
from hicache_draft_mooncake.link import Link
from hicache_draft_mooncake.memory import Arena
from hicache_draft_mooncake.options import MooncakeOptions
from hicache_draft_mooncake.session import Session

log = logging.getLogger("hicache_draft_mooncake")

_POOL = PoolCapability(
    attention=frozenset({Attention.MHA, Attention.MLA}),
    components=frozenset(Component),  # an object is any bytes under its key: every pool of any name
    zero_copy_layouts=frozenset(Layout),
    generic=True,
    max_buffers_per_page=None,
)

OVERDUE_GRACE_S = 1.0
"""A call this far past its deadline means the store stopped answering: the breaker trips."""

RECONNECT_GRACE_S = 3.0
"""Shared-memory mode, holder and master answering but this client's RPCs failing: how long
Mooncake's own reconnect (every 2 s) gets before the backend builds a new client. A lost mapping
(``INVALID_PARAMS``) is never repaired by Mooncake, so it reconnects at once."""

DRAIN_S = 5.0
"""How long a replaced session waits for its calls to finish before it is closed."""

EXIST_BATCH_KEYS = 4096
"""Keys per ``batch_is_exist`` call in ``page_exists`` (one RPC for any usual prefetch)."""

OK, MISS, CORRUPT, FAILED = PageResult.OK, PageResult.MISS, PageResult.CORRUPT, PageResult.FAILED
_STAT = {OK: "get", MISS: "miss", CORRUPT: "corrupt", FAILED: "failed"}


@dataclass(slots=True)
class _Job:
    """One page of one call: where its result goes, its Mooncake key and its size."""

    pool: str
    index: int
    page: Page
    key: str
    nbytes: int


@dataclass(slots=True)
class _Sub:
    """A prepared sub-batch: its jobs, the arena it borrowed and the native call's arguments."""

    jobs: list[_Job]
    sess: Session
    arena: Arena | None = None
    ptrs: list[Any] = field(default_factory=list)
    sizes: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class _Outage:
    """One period in which the store is down: since when, what tripped it, what was found."""

    since: float
    op: str
    code: int | None
    text: str
    reported: bool = False
    fault: health.Fault | None = None
    last: str = ""


FORKED = (
    "this process is a fork of the one that opened the store, and the connection is that process's: calls "
    "through it from here would break its calls, so every call here fails; use the store from a process "
    "started with the 'spawn' or 'forkserver' method"
)


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.0f} KiB"


Finished = Callable[[str, Iterable[int]], None]
"""The core's ``finished(pool, indices)`` of a ``page_get``: those pages hold their final bytes."""
MakeHeaders = Callable[..., None]
"""The core's ``make_headers(pool, indices[, into])`` of a ``page_set``: those pages' headers, made now
(with ``into``, each page's record copied into its destination as well)."""


def _ask_headers(make_headers: MakeHeaders | None, jobs: list[_Job]) -> None:
    """Ask the core for the headers of ``jobs`` (by pool), right before they are prepared to go out;
    raises as the core does (the call has ended: nothing of these pages may go out)."""
    if make_headers is None:
        return
    by_pool: dict[str, list[int]] = {}
    for job in jobs:
        by_pool.setdefault(job.pool, []).append(job.index)
    for pool, indices in by_pool.items():
        make_headers(pool, indices)


def _announce(finished: Finished, jobs: list[_Job], results: dict[str, list[PageResult]]) -> None:
    """Tell the core which pages of a landed sub-batch are OK (final), pool by pool, so it
    verifies them while the next sub-batch moves."""
    by_pool: dict[str, list[int]] = {}
    for job in jobs:
        if results[job.pool][job.index] is OK:
            by_pool.setdefault(job.pool, []).append(job.index)
    for pool, indices in by_pool.items():
        finished(pool, indices)


def _header_block(jobs: list[_Job]) -> int:
    """The address of the jobs' headers when they lie one after another in one block (the core
    makes a batch's headers so), else 0."""
    at = [-1 if job.page.header is None else job.page.header.ptr for job in jobs]
    if not at or at[0] < 0:
        return 0
    return at[0] if at == list(range(at[0], at[0] + HEADER_SIZE * len(at), HEADER_SIZE)) else 0


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
        headers_on_demand=True,  # each sub-batch's headers are made while the one before moves
    )
    Options: ClassVar[type[MooncakeOptions]] = MooncakeOptions

    def __init__(self, options: MooncakeOptions, context: BackendContext) -> None:
        super().__init__(options, context)
        self.opts = options
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._closed = False
        self._worker: ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose connection this is
        self._fork_told = False
        self.stats: Counter[str] = Counter()
        self._link = Link.acquire(options, new_client)
        from mooncake.store import ReplicateConfig

        self._cfg = ReplicateConfig()
        self._cfg.replica_num = options.replica_num
        self._breaker = Breaker(options.retry_interval_s, self._probe, name="hicache-draft-mooncake")
        self._outage: _Outage | None = None
        self._check_at_open()

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

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that opened the store. The connection (its
        sockets, its transfer engine's threads and registrations) is the parent's: a call made
        through it here broke the parent's next calls (RPC replies read by the wrong process), so
        nothing is sent. Told once, without a lock (one another thread held at the fork stays held)."""
        if os.getpid() == self._pid:
            return False
        if not self._fork_told:
            self._fork_told = True
            log.error("mooncake: %s", FORKED)
        return True

    @property
    def _sess(self) -> Session:
        return self._link.session

    @property
    def available(self) -> bool:
        """Whether calls go to the store now (False while it is known to be down: calls then fail
        at once, and a background prober checks it every ``retry_interval_s``)."""
        return not self._closed and not self._breaker.down

    def _up(self, sess: Session) -> bool:
        """Whether a call may go to the store now; trips the breaker when an earlier call on this
        session is stuck past its deadline (a stopped holder or master)."""
        if self._closed or self._forked() or self._breaker.down:
            return False
        late = sess.overdue(OVERDUE_GRACE_S)
        if late > 0:
            self._trip("call", None, f"a call got no answer for {late + OVERDUE_GRACE_S:.1f}s past its deadline")
            return False
        return True

    # -- outages ---------------------------------------------------------------------------
    def _trip(self, op: str, code: int | None, what: str | None = None, now: bool = False) -> None:
        """The store is down (or, ``now``, possibly lost this client's mapping: probe at once)."""
        text = what or health.describe_code(self.opts, op, code if code is not None else codes.INTERNAL_ERROR)
        with self._lock:
            if self._outage is None or not self._breaker.down:
                self._outage = _Outage(time.monotonic(), op, code, text)
        if now:
            self._breaker.suspect()
        else:
            self._breaker.trip(now=True)

    def _probe(self) -> bool:
        """On the prober thread: diagnose, report once, round trip; in shared-memory mode, build a
        new client when this one is what is broken. Whether the store works again."""
        if self._closed:
            return True
        outage = self._outage or _Outage(time.monotonic(), "call", None, "unknown failure")
        fault = health.diagnose(self.opts, min(self.opts.connect_timeout_s, 2.0))
        if fault is not None:
            outage.fault = fault
            self._report(outage, str(fault))
            return False
        sess = self._sess
        if sess.closed and self.opts.shm:  # a reconnect closed it and then failed: try again
            return self._reconnect(outage, sess)
        step, code = health.round_trip(sess, self._cfg, self.opts.key_prefix, health.probe_deadline(self.opts))
        if step == "ok":
            self._recovered(outage, "")
            return True
        outage.last = f"probe {step} got {codes.name(code)}"
        who = "the holder and the master answer" if self.opts.shm else "the master answers"
        self._report(outage, f"{who}, but a test {step} got {health.describe_code(self.opts, step, code)}")
        if not (self.opts.shm and health.client_broken(code)):
            return False
        if code != codes.INVALID_PARAMS and time.monotonic() - outage.since < RECONNECT_GRACE_S:
            return False  # give Mooncake's own reconnect a chance first
        return self._reconnect(outage, sess)

    def _reconnect(self, outage: _Outage, old: Session) -> bool:
        """Shared-memory mode: replace a client the holder no longer serves by a new one (the
        process's one shared-memory client: every backend of this process on this holder moves)."""
        try:
            new = self._link.reconnect(old, DRAIN_S)
        except Exception as exc:  # noqa: BLE001 (stay down; the next probe tries again)
            outage.last = f"reconnect failed: {exc}"
            return False
        with self._lock:
            self.stats["reconnects"] += 1
        if old.native is None:  # closed: its own staging memory is of no use any more
            freed = old.mem.discard_arenas()
            with self._lock:
                self.stats["staging_bytes_given_back"] += freed
        step, code = health.round_trip(new, self._cfg, self.opts.key_prefix, health.probe_deadline(self.opts))
        if self._closed:
            return True
        note = ""
        if old.mem.host_bytes:
            note = (f"; the host pools built in the old client's shared memory ({_size(old.mem.host_bytes)}, "
                    "host_memory hook) are no longer mapped by the holder, so their pages now go through a staging "
                    "copy (correct, slower): restart this process to move them in place again")
        how = (f"reconnected as a new shared-memory client (the holder at {self.opts.shm_client_address} "
               f"restarted or lost this client's memory){note}")
        if step == "ok":
            self._recovered(outage, how)
        else:
            outage.last = f"new client's probe {step} got {codes.name(code)}"
            log.warning("mooncake: %s; its first probe got %s, so it stays down a little longer", how,
                        codes.name(code))
        return step == "ok"

    def _report(self, outage: _Outage, cause: str) -> None:
        """Say once per outage what is down (on the prober thread)."""
        if outage.reported:
            return
        outage.reported = True
        with self._lock:
            self.stats["outages"] += 1
        log.warning("mooncake store unusable: %s (%s); every call fails at once while it is down, probed every "
                    "%.1fs in the background", cause, outage.text, self.opts.retry_interval_s)

    def _recovered(self, outage: _Outage, how: str) -> None:
        if outage.reported or how:
            with self._lock:
                self.stats["recovered"] += 1
        if outage.reported:
            log.warning("mooncake store usable again after %.1fs%s", time.monotonic() - outage.since,
                        f": {how}" if how else "")
        elif how:
            log.warning("mooncake: %s", how)

    def _check_at_open(self) -> None:
        """One round trip at open (bounded by ``connect_timeout_s``): a wrong ``metadata_server``
        fails the open; other failures are reported and leave the backend down (probed)."""
        result: list[tuple[str, int]] = []
        sess = self._sess
        deadline = time.monotonic() + self.opts.connect_timeout_s

        def run() -> None:
            result.append(health.round_trip(sess, self._cfg, self.opts.key_prefix, deadline))

        t = threading.Thread(target=run, name="hicache-draft-mooncake-open", daemon=True)
        t.start()
        t.join(self.opts.connect_timeout_s)
        if not result:
            self._trip("open", None, f"the test put at open got no answer within {self.opts.connect_timeout_s:g}s")
            return
        step, code = result[0]
        if step == "ok":
            return
        if code == codes.TRANSFER_FAIL and not self.opts.shm and self.opts.metadata_server == "P2PHANDSHAKE":
            self.close()
            raise BackendSetupError(f"mooncake backend: the test {step} at open failed: "
                                    f"{health.describe_code(self.opts, step, code)}")
        text = health.describe_code(self.opts, step, code)
        if code in codes.RPC_CODES or (self.opts.shm and health.client_broken(code)):
            self._trip("open", code, f"the test {step} at open failed: {text}")
        else:
            self._note(f"open:{code}", "mooncake: the test %s at open failed: %s; pages will fail until it is fixed",
                       step, text)

    def _codes_seen(self, op: str, rcs: Sequence[int]) -> None:
        if not rcs or min(rcs) >= 0:
            return
        bad = {c for c in rcs if c < 0}
        rpc = bad & codes.RPC_CODES
        if rpc or (op == "exist" and codes.INTERNAL_ERROR in bad):
            self._trip(op, min(rpc) if rpc else codes.INTERNAL_ERROR)
        elif self.opts.shm and codes.INVALID_PARAMS in bad and op in ("put", "get"):
            self._trip(op, codes.INVALID_PARAMS, now=True)
        for c in bad - codes.RPC_CODES - {codes.OBJECT_NOT_FOUND}:
            self._note(f"{op}:{c}", "mooncake %s", health.describe_code(self.opts, op, c))

    def _exist(self, sess: Session, keys: list[str]) -> list[int]:
        rcs = list(sess.native.batch_is_exist(keys))
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
        return [_Job(t.pool, i, p, prefix + p.key, p.nbytes) for t in transfers for i, p in enumerate(t.pages)]

    def _split(self, sess: Session, jobs: list[_Job], counts: Counter[str]) -> tuple[list[_Job], list[_Job]]:
        """(staged, direct) jobs, by ``io_mode`` and, in shm mode, by where the buffers live."""
        mode = self.opts.io_mode
        if sess.mem.shm:  # memory outside the shared pool is bounced through staging
            inside = sess.mem.inside_each([job.page.buffers for job in jobs])
            outside = inside.count(False)
            if outside:
                counts["bounced_pages"] += outside
            if mode == "staged":
                staged, direct = jobs, []
            elif not outside:
                return [], jobs
            else:
                staged = [job for job, ok in zip(jobs, inside, strict=True) if not ok]
                direct = [job for job, ok in zip(jobs, inside, strict=True) if ok]
        elif mode == "staged":
            staged, direct = jobs, []
        elif mode == "auto" and self.opts.protocol == "tcp":
            limit = self.opts.staged_max_page_bytes
            staged = [job for job in jobs if job.nbytes <= limit]
            direct = [job for job in jobs if job.nbytes > limit]
        else:
            return [], jobs
        counts["staged_pages"] += len(staged)
        return staged, direct

    def _subs(self, jobs: list[_Job], staged: bool) -> list[list[_Job]]:
        """The native calls of one chunk. Staged: sub-batches of ``pipeline_bytes`` (at most
        ``max_staging_bytes``), so the copies of one overlap the transfer of the next. Direct: one
        call per chunk. A direct sub-batch has no copy of the backend's to overlap (the core makes
        its headers when asked, just before it goes, and verifies after a get), and each extra call
        costs its master RPCs and drains the transport (measured: 10-30% of a 1 MiB batch over TCP;
        a get split so that the core verifies one sub-batch while the next moves was slower too on
        2 cores). A get announces each chunk to the core (``finished``) as soon as it landed."""
        if not staged:
            return [jobs]
        limit = self.opts.pipeline_bytes
        limit = min(limit, self.opts.max_staging_bytes) if limit > 0 else self.opts.max_staging_bytes
        return pipeline.split_by_bytes(jobs, lambda j: j.nbytes + HEADER_SIZE, limit)

    def _release(self, sub: _Sub) -> None:
        if sub.arena is not None:
            sub.sess.mem.give_back(sub.arena)
            sub.arena = None

    def _payload_views(self, sess: Session, page: Page) -> list[memoryview]:
        return sess.mem.views(page.buffers)

    # -- hooks -----------------------------------------------------------------------------
    @hookimpl
    def host_memory(self, pool: str, nbytes: int) -> Buffer | None:
        """Shared-memory mode: host pool memory from the segment holder's shared pool (registered,
        so pages move without a bounce copy; valid until the backend closes). TCP mode: ``None``."""
        if self._forked():
            raise RuntimeError(FORKED)
        sess = self._sess
        if not sess.mem.shm:
            return None
        with sess.call(time.monotonic() + self.context.timeout_s):
            ptr, arr = sess.mem.allocate_host(nbytes)
        log.debug("mooncake: %d bytes of shared memory for the %r host pool at %#x", nbytes, str(pool), ptr)
        return Buffer(ptr, nbytes, owner=arr)

    @hookimpl
    def register_pool(self, registration: PoolRegistration) -> None:
        self.check_registration(registration)
        if self._forked():
            raise RuntimeError(FORKED)
        outside = 0
        sess = self._sess
        with sess.call(time.monotonic() + self.context.timeout_s):
            for region in (*registration.regions, *registration.staging):
                if not sess.mem.register_external(region.ptr, region.nbytes):
                    outside += 1
        if outside:
            log.warning(
                "mooncake shared-memory mode: %d region(s) of pool %r are not in the shared pool, so its pages "
                "go through a staging copy; let the controller allocate host pools (host_memory hook) for zero copy",
                outside, str(registration.pool),
            )

    @hookimpl(specname="page_set")
    def _page_set_hook(
        self, transfers: Sequence[PageTransfer], deadline: float, make_headers: MakeHeaders | None
    ) -> dict[str, list[PageResult]]:
        # every argument without a default: pluggy before 1.6 never passes one that has a default
        return self.page_set(transfers, deadline, make_headers)

    def page_set(
        self, transfers: Sequence[PageTransfer], deadline: float, make_headers: MakeHeaders | None = None
    ) -> dict[str, list[PageResult]]:
        """Store pages. With ``make_headers`` (a Store call: the pages' headers are zeroed), each
        sub-batch asks the core for its headers just before it is prepared, so the core hashes one
        sub-batch while the one before moves; without it (a direct call), headers given with the
        pages are stored, or made here."""
        return self._each_chunk("put", partial(self._set_chunk, make_headers=make_headers), transfers, deadline)

    def _each_chunk(
        self,
        what: str,
        run: Callable[[Session, list[_Job], dict[str, list[PageResult]], float, Counter[str]], None],
        transfers: Sequence[PageTransfer],
        deadline: float,
    ) -> dict[str, list[PageResult]]:
        """Run ``run`` chunk by chunk within the deadline; a chunk that raises fails only its pages."""
        results = {t.pool: [FAILED] * len(t.pages) for t in transfers}
        jobs = self._jobs(transfers)
        sess = self._sess
        if not jobs or not self._up(sess):
            if jobs:
                self.stats[f"{what}_refused"] += len(jobs)
            return results
        counts: Counter[str] = Counter()
        try:
            for chunk in _chunks(jobs, self.opts.max_batch_pages):
                if time.monotonic() >= deadline or self._breaker.down or self._closed:
                    break
                try:
                    with sess.call(deadline):
                        run(sess, chunk, results, deadline, counts)
                except Exception as exc:  # noqa: BLE001 (per-page failures, never an exception)
                    for job in chunk:
                        results[job.pool][job.index] = FAILED
                    self._note(f"{what}:{type(exc).__name__}", "mooncake %s failed: %s: %s", what,
                               type(exc).__name__, exc)
        finally:
            self._merge(counts)
        return results

    def _set_chunk(
        self, sess: Session, chunk: list[_Job], results: dict[str, list[PageResult]], deadline: float,
        counts: Counter[str], make_headers: MakeHeaders | None = None,
    ) -> None:
        present = self._exist(sess, [j.key for j in chunk])
        if present.count(0) == len(present):  # none stored yet (the usual backup)
            todo = chunk
        else:
            todo = []
            for job, rc in zip(chunk, present, strict=True):
                if rc == 1:
                    results[job.pool][job.index] = OK
                    counts["put_skipped"] += 1
                elif rc == 0:
                    todo.append(job)
        if not todo or self._breaker.down:
            return
        staged, direct = self._split(sess, todo, counts)
        worker = self._pool_worker()
        for group, is_staged in ((staged, True), (direct, False)):
            if not group or time.monotonic() >= deadline:
                continue
            prepare = partial(self._prepare_staged_put if is_staged else self._prepare_direct_put, sess,
                              make_headers=make_headers)
            native = self._native_put_staged if is_staged else self._native_put_direct

            def finish(sub: list[_Job], prep: _Sub, rcs: list[int] | None) -> None:
                self._finish_put(sub, rcs, results, counts)

            pipeline.run(self._subs(group, is_staged), prepare, native, finish, self._release, worker,
                         deadline)

    def _prepare_staged_put(self, sess: Session, jobs: list[_Job], make_headers: MakeHeaders | None = None) -> _Sub:
        sizes = [HEADER_SIZE + j.nbytes for j in jobs]
        arena = sess.mem.borrow(sum(sizes))
        sub = _Sub(jobs, sess, arena, sizes=sizes)
        mv, base, off = arena.view, arena.ptr, 0
        if make_headers is not None:  # the core copies each record into its slot, hashing the copy
            by_pool: dict[str, tuple[list[int], list[memoryview]]] = {}
            for job, size in zip(jobs, sizes, strict=True):
                idx, dst = by_pool.setdefault(job.pool, ([], []))
                idx.append(job.index)
                dst.append(mv[off : off + size])
                sub.ptrs.append(base + off)
                off += size
            try:
                for pool, (idx, dst) in by_pool.items():
                    make_headers(pool, idx, dst)
            except BaseException:  # the call has ended: nothing of these pages goes out
                self._release(sub)
                raise
            return sub
        memmove = ctypes.memmove
        for job, size in zip(jobs, sizes, strict=True):
            dst = base + off + HEADER_SIZE
            for b in job.page.buffers:
                memmove(dst, b.ptr, b.nbytes)
                dst += b.nbytes
            head = job.page.header
            mv[off : off + HEADER_SIZE] = (head.view() if head is not None else
                                           self._header(sess, job, [mv[off + HEADER_SIZE : off + size]]))
            sub.ptrs.append(base + off)
            off += size
        return sub

    def _prepare_direct_put(self, sess: Session, jobs: list[_Job], make_headers: MakeHeaders | None = None) -> _Sub:
        _ask_headers(make_headers, jobs)
        arena = sess.mem.borrow(HEADER_SIZE * len(jobs))
        sub = _Sub(jobs, sess, arena)
        mv, ptrs, sizes, memmove = arena.view, sub.ptrs, sub.sizes, ctypes.memmove
        block = _header_block(jobs)
        if block:  # the core's headers, one after another: stored verbatim, one copy
            memmove(arena.ptr, block, HEADER_SIZE * len(jobs))
        dst = arena.ptr
        for job in jobs:
            bufs = job.page.buffers
            if not block:
                head = job.page.header
                if head is not None:  # the core's, stored verbatim
                    memmove(dst, head.ptr, HEADER_SIZE)
                else:
                    off = dst - arena.ptr
                    mv[off : off + HEADER_SIZE] = self._header(sess, job, None)
            ptrs.append([dst, *[b.ptr for b in bufs]])
            sizes.append([HEADER_SIZE, *[b.nbytes for b in bufs]])
            dst += HEADER_SIZE
        return sub

    def _native_put_staged(self, sub: _Sub) -> list[int]:
        return list(sub.sess.native.batch_put_from([j.key for j in sub.jobs], sub.ptrs, sub.sizes, self._cfg))

    def _native_put_direct(self, sub: _Sub) -> list[int]:
        return list(sub.sess.native.batch_put_from_multi_buffers([j.key for j in sub.jobs], sub.ptrs, sub.sizes,
                                                                 self._cfg))

    def _finish_put(
        self, jobs: list[_Job], rcs: list[int] | None, results: dict[str, list[PageResult]],
        counts: Counter[str],
    ) -> None:
        if rcs is None:
            counts["put_not_sent"] += len(jobs)
            return
        if len(rcs) != len(jobs):
            rcs = [codes.INTERNAL_ERROR] * len(jobs)
        self._codes_seen("put", rcs)
        counts["put_batches"] += 1
        if rcs.count(codes.OK) == len(rcs):  # all stored (the usual put)
            for job in jobs:
                results[job.pool][job.index] = OK
            counts["put"] += len(jobs)
            return
        for job, rc in zip(jobs, rcs, strict=True):
            res = codes.put_result(rc)
            results[job.pool][job.index] = res
            counts["put" if res is OK else "put_failed"] += 1

    @hookimpl(specname="page_get")
    def _page_get_hook(
        self, transfers: Sequence[PageTransfer], deadline: float, finished: Finished | None
    ) -> dict[str, list[PageResult]]:
        # every argument without a default: pluggy before 1.6 never passes one that has a default
        return self.page_get(transfers, deadline, finished)

    def page_get(
        self, transfers: Sequence[PageTransfer], deadline: float, finished: Finished | None = None
    ) -> dict[str, list[PageResult]]:
        return self._each_chunk("get", partial(self._get_chunk, finished=finished), transfers, deadline)

    def _get_chunk(
        self, sess: Session, chunk: list[_Job], results: dict[str, list[PageResult]], deadline: float,
        counts: Counter[str], finished: Finished | None = None,
    ) -> None:
        staged, direct = self._split(sess, chunk, counts)
        worker = self._pool_worker()
        for group, is_staged in ((staged, True), (direct, False)):
            if not group or time.monotonic() >= deadline:
                continue
            prepare = partial(self._prepare_staged_get if is_staged else self._prepare_direct_get, sess)
            native = self._native_get_staged if is_staged else self._native_get_direct

            def finish(jobs: list[_Job], sub: _Sub, rcs: list[int] | None, staged: bool = is_staged) -> None:
                self._finish_get(sub, rcs, staged, results, counts)
                if finished is not None:
                    _announce(finished, jobs, results)

            pipeline.run(self._subs(group, is_staged), prepare, native, finish, self._release, worker,
                         deadline)

    def _prepare_staged_get(self, sess: Session, jobs: list[_Job]) -> _Sub:
        sizes = [HEADER_SIZE + j.nbytes for j in jobs]
        arena = sess.mem.borrow(sum(sizes))
        sub = _Sub(jobs, sess, arena, sizes=sizes)
        off = 0
        for size in sizes:
            sub.ptrs.append(arena.ptr + off)
            off += size
        return sub

    def _prepare_direct_get(self, sess: Session, jobs: list[_Job]) -> _Sub:
        arena = sess.mem.borrow(HEADER_SIZE * len(jobs))
        sub = _Sub(jobs, sess, arena)
        ptrs, sizes, dst = sub.ptrs, sub.sizes, arena.ptr
        for job in jobs:
            bufs = job.page.buffers
            ptrs.append([dst, *[b.ptr for b in bufs]])
            sizes.append([HEADER_SIZE, *[b.nbytes for b in bufs]])
            dst += HEADER_SIZE
        return sub

    def _native_get_staged(self, sub: _Sub) -> list[int]:
        return list(sub.sess.native.batch_get_into([j.key for j in sub.jobs], sub.ptrs, sub.sizes))

    def _native_get_direct(self, sub: _Sub) -> list[int]:
        return list(sub.sess.native.batch_get_into_multi_buffers([j.key for j in sub.jobs], sub.ptrs, sub.sizes))

    def _finish_get(
        self, sub: _Sub, rcs: list[int] | None, staged: bool, results: dict[str, list[PageResult]],
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
            # through the Store (page.header set), the core verifies every page reported OK against
            # the header written below, so the backend's own check would be a second checksum pass
            verify = job.page.header is None
            if staged:
                if res is None:
                    body = off + HEADER_SIZE
                    res = self._check(job, mv[off:body], [mv[body : body + job.nbytes]]) if verify else OK
                    if res is OK:
                        src = base + body
                        for b in job.page.buffers:
                            memmove(b.ptr, src, b.nbytes)
                            src += b.nbytes
                off += HEADER_SIZE + job.nbytes
            elif res is None:
                hoff = n * HEADER_SIZE
                res = (self._check(job, mv[hoff : hoff + HEADER_SIZE], self._payload_views(sub.sess, job.page))
                       if verify else OK)
            head = job.page.header
            if res is OK and head is not None:
                hoff = off - HEADER_SIZE - job.nbytes if staged else n * HEADER_SIZE
                memmove(head.ptr, base + hoff, HEADER_SIZE)
            results[job.pool][job.index] = res
            counts[_STAT[res]] += 1

    def _header(self, sess: Session, job: _Job, payload: list[memoryview] | None) -> bytes | memoryview:
        """The header stored with a page: the core's (made from the bytes handed over, before the
        call or when asked just before the page goes out, never once the call has ended, so a late
        read of reused memory never matches it), or one made here (a direct call without one)."""
        page = job.page
        if page.header is not None:
            return page.header.view()
        return make_header(page.key, page.namespace, job.pool, payload or self._payload_views(sess, page))

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
    def page_rejected(self, rejected: Mapping[str, Sequence[str]]) -> None:
        """Pages this backend answered OK that failed the core's verification: remove the stored
        objects (forced), so the next read is a clean miss and a later backup stores them again
        (puts skip keys that exist, so a bad copy would otherwise stay for good)."""
        keys = [self.opts.key_prefix + k for ks in rejected.values() for k in ks]
        sess = self._sess
        if not keys or not self._up(sess):
            return
        removed = 0
        with sess.call(time.monotonic() + self.context.timeout_s):
            for key in keys:
                try:
                    rc = sess.native.remove(key, True)
                except Exception:  # noqa: BLE001 (best effort; the page stays CORRUPT on read)
                    rc = codes.INTERNAL_ERROR
                removed += rc == codes.OK
        with self._lock:
            self.stats["rejected_removed"] += removed
        self._note("rejected", "mooncake: removed %d of %d stored page(s) that failed the core's verification, so "
                   "they miss and a later backup stores them again", removed, len(keys))

    @hookimpl
    def page_exists(self, queries: Mapping[str, Sequence[str]], deadline: float) -> dict[str, int]:
        out = {pool: 0 for pool in queries}
        sess = self._sess
        if not any(queries.values()) or not self._up(sess):
            return out
        prefix = self.opts.key_prefix
        keys = [prefix + k for ks in queries.values() for k in ks]
        rcs: list[int] = []
        with sess.call(deadline):
            for start in range(0, len(keys), EXIST_BATCH_KEYS):
                if time.monotonic() >= deadline or self._breaker.down:
                    break
                try:
                    rcs += self._exist(sess, keys[start : start + EXIST_BATCH_KEYS])
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
        if self._forked():  # the parent's connection: leave it to the parent (closing it unregisters its memory)
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker, self._worker = self._worker, None
        self._breaker.close()
        if worker is not None:
            worker.shutdown(wait=True)
        self._link.release(DRAIN_S)

    @property
    def registered_buffers(self) -> int:
        """How many buffers are registered with the native client now (0 after close)."""
        return len(self._sess.mem.registered())

    # -- introspection (tests, CLI) ----------------------------------------------------------
    def in_shared_memory(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` is shared-memory-pool memory this backend handed out
        (always False in TCP mode)."""
        mem = self._sess.mem
        return mem.shm and mem.contains(ptr, nbytes)

    @property
    def native(self) -> Any:  # noqa: ANN401 (the native client has no type stubs)
        """The underlying ``MooncakeDistributedStore`` of the current session (benchmarks and tests)."""
        return self._sess.native
