"""The cache controller: backup and prefetch of target and draft KV pages, together.

* Paths come from :func:`hicache_draft.paths.plan_paths` (the backend's declaration), never from
  its name: ``zero_copy`` pools hand the backend the host pool's own memory; ``generic`` pools are
  copied through staging buffers; ``disabled`` pools are skipped with one logged warning.
* Writer election per pool: a rank-replicated (MLA) pool is written by TP rank 0 only; a sharded
  (MHA) pool by every rank, under its own keys (an MHA draft on an MLA target included).
* Hit rules (``draft.on_miss``): ``shorten`` restores min(target hit, draft hit) pages, so no slot
  is ever reported restored with stale draft KV; ``target_only`` restores the target prefix and
  lists the draft-cold pages. A failure in either pool truncates the hit at the first failed page.
  With ``tp_size > 1`` and ``torch.distributed`` initialised, ranks agree on the MIN.
* Target and draft pages go to the backend in the same batched calls. Nothing here raises into
  the caller's loop for a storage failure: results say what happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_draft.backend import BackendContext
from hicache_draft.capabilities import Attention, IOPath, PoolKind
from hicache_draft.config import Config, OnMiss, PrefetchPolicy
from hicache_draft.errors import BackendSetupError
from hicache_draft.keys import make_key, page_hashes, pool_identities
from hicache_draft.metrics import Metrics, config_observers
from hicache_draft.paths import PathChoice, plan_paths, pool_specs
from hicache_draft.pools import Allocator, HostPool, PoolSpec
from hicache_draft.store import CallReport, Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PoolRegistration

log = logging.getLogger("hicache_draft.controller")


@dataclass
class BackupResult:
    """What a backup stored. ``pages_written``/``failed`` per pool; ``pages`` asked for.

    ``released``: False only if an abandoned backend call may still read host slots, listed in
    ``held_slots``: do not overwrite those before :meth:`CacheController.wait_released` (or the
    operation's :meth:`Operation.wait_released`) returns True. A sync backup first waits up to
    ``timeout_s`` for the call to let go, so this is rare: a backend that ignores its deadline.
    """

    pages: int
    pages_written: dict[PoolKind, int] = field(default_factory=dict)
    failed: dict[PoolKind, int] = field(default_factory=dict)
    not_writer: list[PoolKind] = field(default_factory=list)
    dropped: bool = False
    released: bool = True  # False: a timed-out call may still read the host slots in held_slots
    held_slots: list[int] = field(default_factory=list)


@dataclass
class PrefetchResult:
    """What a prefetch restored into the given host slots.

    ``pages``: restorable prefix in pages (slots ``host_slots[:pages]`` are valid for the target,
    and for the draft unless listed in ``draft_cold``); ``tokens = pages * page_size``.
    ``restored``: pages per pool whose data is valid. ``hit``: what existence queries promised.
    ``released``: False only if an abandoned backend call may still write into the slots listed
    in ``held_slots`` (never slots below ``pages``); wait with :meth:`CacheController.wait_released`
    or :meth:`Operation.wait_released` before reusing them.
    """

    pages: int = 0
    tokens: int = 0
    restored: dict[PoolKind, int] = field(default_factory=dict)
    hit: dict[PoolKind, int] = field(default_factory=dict)
    draft_cold: list[int] = field(default_factory=list)
    failed: dict[PoolKind, int] = field(default_factory=dict)
    released: bool = True
    held_slots: list[int] = field(default_factory=list)


class Operation:
    """A background backup or prefetch: wait on it, time-bound it, or cancel it."""

    def __init__(self) -> None:
        self.future: Future[Any] = Future()
        self.cancelled = threading.Event()
        self.partial: Any = None
        self.bound_s: float = 0.0  # the longest the whole operation can take (see CacheController.collect)
        self.in_flight: list[int] = []  # zero-copy slots of the call in flight (prefetch)
        self._pending_io: list[Future[Any]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stop after the batch in flight (whose data is then not published); :meth:`result`
        returns what was done."""
        with self._lock:
            self.cancelled.set()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> Any:  # noqa: ANN401
        """The final result; on timeout, cancels and returns the partial result."""
        try:
            return self.future.result(timeout=timeout)
        except FutureTimeout:
            self.cancel()
            with self._lock:
                return self.partial

    def _track(self, fut: Future[Any]) -> None:
        with self._lock:
            self._pending_io.append(fut)

    def wait_released(self, timeout: float | None = None) -> bool:
        """True once no backend call of this operation can touch host memory any more."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.future.result(timeout=timeout)
        except FutureTimeout:
            return False
        with self._lock:
            pending = list(self._pending_io)
        return _all_done(pending, deadline)


def _all_done(futures: Sequence[Future[Any]], deadline: float | None) -> bool:
    """Wait for every future until ``deadline`` (``time.monotonic()``; None: no limit); a call that
    failed has let go of its buffers too."""
    for f in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            f.result(timeout=left)
        except FutureTimeout:
            return False
        except BaseException:  # noqa: S110
            pass
    return True


@dataclass
class _PoolState:
    spec: PoolSpec
    pool: HostPool
    choice: PathChoice
    namespaces: list[str]  # one per head part
    split: int
    writer: bool

    @property
    def active(self) -> bool:
        return self.choice.path is not IOPath.DISABLED

    @property
    def part_nbytes(self) -> int:
        return self.pool.part_nbytes(self.split)


class CacheController:
    """Backs up and restores the target and draft host pools through one :class:`Store`."""

    def __init__(
        self,
        config: Config,
        store: Store,
        num_pages: int,
        allocator: Allocator | None = None,
        pools: dict[PoolKind, HostPool] | None = None,
        process_group: Any = None,  # noqa: ANN401
        max_pending: int = 64,
    ) -> None:
        self.config = config
        self.store = store
        self.page_size = config.namespace.page_size
        self.metrics = Metrics()
        self.process_group = process_group
        self.plan: dict[PoolKind, PathChoice] = plan_paths(config, store.capabilities)
        self._host_memory_owners: list[object] = []
        specs = pool_specs(config)
        par = config.parallel
        self._pools: dict[PoolKind, _PoolState] = {}
        for kind, spec in specs.items():
            host = (pools or {}).get(kind) or HostPool(
                spec, num_pages, allocator=allocator or self._backend_allocator(kind)
            )
            if host.spec != spec:
                raise ValueError(f"given {kind.value} host pool does not match the config's shape")
            split = par.split_factor if spec.attention is Attention.MHA else 1
            model = config.namespace.model if kind is PoolKind.KV else str(config.namespace.draft_model)
            idents = pool_identities(
                pool=kind, model=model, dtype=str(spec.dtype).removeprefix("torch."), attention=spec.attention,
                page_size=spec.page_size, layers=spec.layers, layout=spec.layout, kv_heads=spec.kv_heads or None,
                head_dim=spec.head_dim or None, latent_dim=spec.latent_dim or None, tp_rank=par.tp_rank,
                tp_size=par.tp_size, pp_rank=par.pp_rank, pp_size=par.pp_size, tp_lcm_size=par.tp_lcm_size,
                target_model=config.namespace.model,
            )
            writer = spec.attention is Attention.MHA or par.tp_rank == 0
            state = _PoolState(spec, host, self.plan[kind], [i.fingerprint() for i in idents], split, writer)
            self._pools[kind] = state
        self._register_pools()
        if par.tp_size > 1 and not store.capabilities.shared:
            log.warning(
                "backend %r does not declare shared = true, yet %d TP ranks use it; "
                "each rank needs a store of its own", store.name, par.tp_size,
            )
        if config.draft.enabled and not self._pools[PoolKind.DRAFT].active:
            log.warning(
                "draft KV offload disabled for backend %r: %s; restored pages will be reported draft-cold",
                store.name, self.plan[PoolKind.DRAFT].reason,
            )
        self._held: list[tuple[Future[Any], tuple[int, ...]]] = []
        self._held_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hicache-draft-ctl")
        self._slots = threading.BoundedSemaphore(max_pending)

    @classmethod
    def from_config(
        cls,
        config: Config,
        num_pages: int,
        observers: Iterable[object] = (),
        allocator: Allocator | None = None,
        process_group: Any = None,  # noqa: ANN401
    ) -> CacheController:
        """Open the configured backend and build the host pools. The observers ``config.metrics``
        asks for (a Prometheus exporter: :func:`hicache_draft.metrics.config_observers`) join ``observers``."""
        ctx = BackendContext(
            tp_rank=config.parallel.tp_rank, tp_size=config.parallel.tp_size, timeout_s=config.timeout_s
        )
        store = Store.open(config.backend, config.backend_options, ctx, [*observers, *config_observers(config)])
        try:
            return cls(config, store, num_pages, allocator=allocator, process_group=process_group)
        except BaseException:
            store.close()
            raise

    def _backend_allocator(self, kind: PoolKind) -> Allocator | None:
        """An allocator over memory the backend offers through ``host_memory`` (if it does)."""
        if not self.store.has_hook("host_memory"):
            return None

        def alloc(nbytes: int) -> torch.Tensor:
            buf = self.store.host_memory(kind, nbytes)
            if buf is None:
                return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            arr = (ctypes.c_ubyte * buf.nbytes).from_address(buf.ptr)
            t = torch.frombuffer(arr, dtype=torch.uint8)
            self._host_memory_owners.append((buf, arr))
            return t

        return alloc

    # -- setup -------------------------------------------------------------------------------------
    def _register_pools(self) -> None:
        for kind, st in self._pools.items():
            if not st.active:
                continue
            reg = PoolRegistration(
                pool=kind, attention=st.spec.attention, layout=st.spec.layout, namespace=st.namespaces[0],
                page_nbytes=st.part_nbytes,
                buffers_per_page=st.spec.buffers_per_page() if st.choice.path is IOPath.ZERO_COPY else 1,
                regions=st.pool.regions(),
            )
            try:
                self.store.register_pool(reg)
            except BackendSetupError as exc:
                st.choice = PathChoice(IOPath.DISABLED, f"the backend refused the pool: {exc}")
                self.plan[kind] = st.choice
                log.warning("%s pool offload disabled: %s", kind.value, exc)
        kv = self._pools[PoolKind.KV]
        draft = self._pools.get(PoolKind.DRAFT)
        if draft is not None and draft.active and not kv.active:
            draft.choice = PathChoice(IOPath.DISABLED, "the target 'kv' pool is disabled, so nothing is offloaded")
            self.plan[PoolKind.DRAFT] = draft.choice

    @property
    def target_pool(self) -> HostPool:
        return self._pools[PoolKind.KV].pool

    @property
    def draft_pool(self) -> HostPool | None:
        st = self._pools.get(PoolKind.DRAFT)
        return st.pool if st is not None else None

    @property
    def draft_active(self) -> bool:
        st = self._pools.get(PoolKind.DRAFT)
        return st is not None and st.active

    def keys_for(self, kind: PoolKind, hashes: Sequence[str]) -> list[str]:
        """The storage keys of pool ``kind`` for page hashes, part after part for each page."""
        st = self._pools[kind]
        return [make_key(h, ns) for h in hashes for ns in st.namespaces]

    # -- page building --------------------------------------------------------------------------
    def _pages(
        self, st: _PoolState, hashes: Sequence[str], slots: Sequence[int], fill: bool
    ) -> tuple[list[Page], list[tuple[int, int, torch.Tensor]]]:
        """Pages (all parts of each page, in order) and, for the generic path, the staging copies."""
        pages: list[Page] = []
        staged: list[tuple[int, int, torch.Tensor]] = []
        zero_copy = st.choice.path is IOPath.ZERO_COPY
        stage: torch.Tensor | None = None
        regions: list[tuple[Buffer, ...]] = []
        if zero_copy:
            index = st.pool.slot_buffers(st.split)
            index.check(slots)
            regions = index.buffers(slots)  # page after page, its head parts in order
        else:
            stage = torch.empty((len(hashes) * st.split, st.part_nbytes), dtype=torch.uint8)
        for i, (h, slot) in enumerate(zip(hashes, slots, strict=True)):
            for part, ns in enumerate(st.namespaces):
                if zero_copy:
                    bufs = regions[i * st.split + part]
                else:
                    assert stage is not None
                    row = stage[i * st.split + part]
                    if fill:
                        st.pool.copy_page_out(slot, row, part, st.split)
                    staged.append((slot, part, row))
                    bufs = (Buffer(row.data_ptr(), row.numel(), owner=stage),)
                pages.append(Page(key=make_key(h, ns), group=h, namespace=ns, buffers=bufs))
        return pages, staged

    def _page_prefix(self, st: _PoolState, results: Sequence[PageResult]) -> int:
        """Leading pages whose every part is OK."""
        n = 0
        for i in range(0, len(results), st.split):
            if any(r != PageResult.OK for r in results[i : i + st.split]):
                break
            n += 1
        return n

    def _agree(self, value: int) -> int:
        """MIN of ``value`` across the TP group when torch.distributed is initialised."""
        if self.config.parallel.tp_size <= 1:
            return value
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(t.item())

    # -- holding memory that an abandoned call may still touch ---------------------------------------
    def _let_go(self, rep: CallReport, zero_copy_slots: Sequence[int], op: Operation | None) -> bool:
        """After a call that did not end well: True once the backend is done with the call's memory.

        Only zero-copy pages hand the backend the caller's host slots (staging memory is the
        controller's and lives as long as the call). For those, wait up to ``timeout_s`` for the
        abandoned call to return; if it still runs, hold the slots (``held_slots``,
        :meth:`wait_released`) and tell the caller through ``released = False``."""
        fut = rep.released
        if fut.done() or not zero_copy_slots:
            return True
        try:
            fut.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            pass
        except BaseException:  # noqa: S110 - an abandoned call that failed has let go of its buffers
            pass
        if fut.done():
            return True
        with self._held_lock:
            self._held.append((fut, tuple(zero_copy_slots)))
        if op is not None:
            op._track(fut)
        log.warning(
            "backend %r: an abandoned call still holds %d host slots %s timeout_s after its deadline; "
            "they stay reserved (CacheController.held_slots / wait_released)",
            self.store.name, len(zero_copy_slots), self.config.timeout_s,
        )
        return False

    def held_slots(self) -> list[int]:
        """Host slots (first slot of each page) that an abandoned backend call may still read or
        write: do not reuse them until :meth:`wait_released` returns True."""
        with self._held_lock:
            self._held = [(f, sl) for f, sl in self._held if not f.done()]
            return sorted({x for _, sl in self._held for x in sl})

    def wait_released(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) until no abandoned backend call holds host slots."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._held_lock:
            pending = [f for f, _ in self._held]
        if not _all_done(pending, deadline):
            return False
        self.held_slots()  # prune
        return True

    # -- backup ---------------------------------------------------------------------------------------
    def backup(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None,
        _op: Operation | None = None,
    ) -> BackupResult:
        """Store the full pages of ``token_ids`` from ``host_slots`` (first slot of each page),
        target and draft together. Never raises for storage trouble.

        Batches go out one after the other; the first batch that times out, errors or fails
        entirely ends the backup and the rest is reported failed. If an abandoned zero-copy call
        is still reading slots ``timeout_s`` after its deadline, ``released`` is False and those
        slots are in ``held_slots`` (and :meth:`held_slots`) until it returns. A late read of
        reused slots is never stored as data: the header the core made before the call no longer
        matches those bytes, so every later read of that page is ``CORRUPT``."""
        hashes = page_hashes(token_ids, self.page_size, prior_hash)
        n = min(len(hashes), len(host_slots))
        hashes, host_slots = hashes[:n], list(host_slots[:n])
        result = BackupResult(pages=n)
        writers = [(k, st) for k, st in self._pools.items() if st.active and st.writer]
        result.not_writer = [k for k, st in self._pools.items() if st.active and not st.writer]
        for k, _ in writers:
            result.pages_written[k] = 0
            result.failed[k] = 0
        step = self.config.batch_pages
        done = 0
        for start in range(0, n if writers else 0, step):
            if _op is not None and _op.cancelled.is_set():
                break
            hs, sl = hashes[start : start + step], list(host_slots[start : start + step])
            transfers = []
            for kind, st in writers:
                pages, _ = self._pages(st, hs, sl, fill=True)
                transfers.append(PageTransfer(kind, pages, st.choice.path is IOPath.ZERO_COPY))
            t0 = time.perf_counter()
            rep = self.store.call("page_set", transfers)
            dt = time.perf_counter() - t0
            done = start + len(hs)
            all_failed = True
            for kind, st in writers:
                r = rep.results[kind]
                self.metrics.record_set(kind, r, st.part_nbytes, dt / len(writers))
                ok_pages = sum(
                    1 for i in range(0, len(r), st.split) if all(x == PageResult.OK for x in r[i : i + st.split])
                )
                all_failed &= ok_pages == 0
                result.pages_written[kind] += ok_pages
                result.failed[kind] += len(hs) - ok_pages
            if rep.outcome != "ok":
                zc = sl if any(t.zero_copy for t in transfers) else []
                if not self._let_go(rep, zc, _op):
                    result.released = False
                    result.held_slots.extend(zc)
            if _op is not None:
                _op.partial = result
            if rep.outcome != "ok" or all_failed:
                break
        for k, _ in writers:  # what a stopped backup never sent
            result.failed[k] += n - done
        return result

    # -- prefetch -------------------------------------------------------------------------------------
    def prefetch(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None,
        _op: Operation | None = None,
    ) -> PrefetchResult:
        """Load the longest restorable prefix of ``token_ids`` into ``host_slots``. Never raises
        for storage trouble; see :class:`PrefetchResult` for what is valid afterwards.

        With ``tp_size > 1`` every rank enters the same two collectives (the planned prefix and
        the restored prefix, each a MIN), whatever its local state. The first batch that times
        out or errors ends the prefetch; nothing it read is used."""
        hashes = page_hashes(token_ids, self.page_size, prior_hash)
        n = min(len(hashes), len(host_slots))
        kv = self._pools[PoolKind.KV]
        draft = self._pools.get(PoolKind.DRAFT)
        draft_on = draft is not None and draft.active
        shorten = self.config.draft.on_miss is OnMiss.SHORTEN
        result = PrefetchResult()
        planned = draft_planned = 0
        if kv.active and n > 0:
            queries = {PoolKind.KV: self.keys_for(PoolKind.KV, hashes[:n])}
            if draft_on:
                queries[PoolKind.DRAFT] = self.keys_for(PoolKind.DRAFT, hashes[:n])
            counts = self.store.page_exists(queries)
            hit = {PoolKind.KV: counts[PoolKind.KV] // kv.split}
            if draft_on:
                assert draft is not None
                hit[PoolKind.DRAFT] = counts[PoolKind.DRAFT] // draft.split
            result.hit = dict(hit)
            planned = hit[PoolKind.KV]
            draft_planned = min(hit.get(PoolKind.DRAFT, 0), planned)
            if draft_on and shorten:
                planned = draft_planned
        planned = self._agree(planned)  # every rank, even one whose pool is disabled
        draft_planned = min(draft_planned, planned)
        kv_ok = draft_ok = 0
        failed = {PoolKind.KV: 0, PoolKind.DRAFT: 0}
        step = self.config.batch_pages
        for start in range(0, planned if kv.active else 0, step):
            if _op is not None and _op.cancelled.is_set():
                break
            end = min(planned, start + step)
            hs, sl = hashes[start:end], list(host_slots[start:end])
            loads: list[tuple[PoolKind, _PoolState, list[tuple[int, int, torch.Tensor]]]] = []
            transfers = []
            pages, staged = self._pages(kv, hs, sl, fill=False)
            transfers.append(PageTransfer(PoolKind.KV, pages, kv.choice.path is IOPath.ZERO_COPY))
            loads.append((PoolKind.KV, kv, staged))
            zc = list(sl) if kv.choice.path is IOPath.ZERO_COPY else []
            if draft_on and draft_ok == start and start < draft_planned:
                assert draft is not None
                dn = min(end, draft_planned) - start
                pages, staged = self._pages(draft, hs[:dn], sl[:dn], fill=False)
                transfers.append(PageTransfer(PoolKind.DRAFT, pages, draft.choice.path is IOPath.ZERO_COPY))
                loads.append((PoolKind.DRAFT, draft, staged))
                if draft.choice.path is IOPath.ZERO_COPY:
                    zc = sorted(set(zc) | set(sl[:dn]))
            if _op is not None:
                with _op._lock:
                    _op.in_flight = zc
            t0 = time.perf_counter()
            rep = self.store.call("page_get", transfers)
            dt = time.perf_counter() - t0
            for kind, st, _ in loads:
                self.metrics.record_get(kind, rep.results[kind], st.part_nbytes, dt / len(loads))
            if rep.outcome != "ok":
                for kind, _, _ in loads:
                    failed[kind] += 1
                if not self._let_go(rep, zc, _op):
                    result.released = False
                    result.held_slots.extend(zc)
                if _op is not None:
                    with _op._lock:
                        _op.in_flight = []
                break
            with _op._lock if _op is not None else contextlib.nullcontext():
                if _op is not None:
                    _op.in_flight = []
                    if _op.cancelled.is_set():  # the caller took its result: publish nothing more
                        break
                for kind, st, staged in loads:
                    r = rep.results[kind]
                    got = self._page_prefix(st, r)
                    for slot, part, row in staged[: got * st.split]:
                        st.pool.copy_page_in(slot, row, part, st.split)
                    if got < len(r) // st.split:
                        failed[kind] += 1
                    if kind is PoolKind.KV:
                        kv_ok += got
                    else:
                        draft_ok += got
                if _op is not None:
                    _op.partial = self._finish(result, kv_ok, draft_ok, draft_on, shorten, failed, agree=False)
            if kv_ok < end or (draft_on and shorten and draft_ok < min(end, draft_planned)):
                break
        return self._finish(result, kv_ok, draft_ok, draft_on, shorten, failed, agree=True)

    def _finish(
        self, result: PrefetchResult, kv_ok: int, draft_ok: int, draft_on: bool, shorten: bool,
        failed: dict[PoolKind, int], agree: bool,
    ) -> PrefetchResult:
        pages = min(kv_ok, draft_ok) if (draft_on and shorten) else kv_ok
        if agree:
            pages = self._agree(pages)
        out = PrefetchResult(
            pages=pages, tokens=pages * self.page_size, hit=dict(result.hit), released=result.released,
            failed={k: v for k, v in failed.items() if v}, held_slots=list(result.held_slots),
        )
        out.restored[PoolKind.KV] = pages
        if self.config.draft.enabled:
            d = min(draft_ok, pages) if draft_on else 0
            out.restored[PoolKind.DRAFT] = d
            out.draft_cold = list(range(d, pages))
        return out

    # -- background --------------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any, empty: Any, bound_s: float) -> Operation:  # noqa: ANN401
        op = Operation()
        op.partial = empty
        op.bound_s = bound_s
        if not self._slots.acquire(blocking=False):
            log.warning("offload queue full (%d pending); operation dropped", self._slots._initial_value)  # type: ignore[attr-defined]
            if isinstance(empty, BackupResult):
                empty.dropped = True
            op.future.set_result(empty)
            return op

        def run() -> None:
            try:
                op.future.set_result(fn(*args, _op=op))
            except BaseException as exc:  # never into the caller's loop: log and return the partial result
                log.exception("background offload operation failed: %s", exc)
                op.future.set_result(op.partial)
            finally:
                self._slots.release()

        self._executor.submit(run)
        return op

    def _bound_s(self, pages: int) -> float:
        """The longest a whole operation of ``pages`` pages can take: an existence call, one call
        per batch (each bounded by ``timeout_s``), and the wait for an abandoned call's memory."""
        batches = -(-pages // self.config.batch_pages)
        return self.config.timeout_s * (batches + 2)

    def backup_async(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None
    ) -> Operation:
        """Back up off the caller's thread. Do not overwrite ``host_slots`` until
        :meth:`Operation.wait_released` returns True (it waits for the operation and for any
        backend call that outlived its timeout)."""
        n = min(len(token_ids) // self.page_size, len(host_slots))
        return self._submit(self.backup, list(token_ids), list(host_slots), prior_hash,
                            empty=BackupResult(pages=0), bound_s=self._bound_s(n))

    def prefetch_async(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None
    ) -> Operation:
        """Prefetch off the caller's thread; collect with :meth:`collect`."""
        n = min(len(token_ids) // self.page_size, len(host_slots))
        return self._submit(self.prefetch, list(token_ids), list(host_slots), prior_hash,
                            empty=PrefetchResult(), bound_s=self._bound_s(n))

    def collect(self, op: Operation, policy: PrefetchPolicy | None = None) -> PrefetchResult:
        """Take a prefetch's result under a policy (default: the config's ``prefetch_policy``).

        ``best_effort``: what has arrived now; ``timeout``: what has arrived within
        ``prefetch_timeout_s``; ``wait_complete``: all of it, within the operation's own bound
        (``timeout_s`` x (batches + 2): each call is bounded and the operation stops at the
        first one that times out). When the wait ends first, the rest is cancelled and nothing
        it reads later is published; ``released`` is False while a call in flight may still
        write into the slots listed in ``held_slots`` (wait with :meth:`Operation.wait_released`).
        With ``tp_size > 1`` only ``wait_complete`` returns a prefix the ranks agreed on.
        """
        policy = policy or self.config.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            timeout = 0.0
        elif policy is PrefetchPolicy.TIMEOUT:
            timeout = self.config.prefetch_timeout_s
        else:
            timeout = op.bound_s
        try:
            res = op.future.result(timeout=timeout)
        except FutureTimeout:
            with op._lock:
                op.cancelled.set()  # under the lock: the worker publishes nothing after this
                part = op.partial if isinstance(op.partial, PrefetchResult) else PrefetchResult()
                res = dataclasses.replace(part, held_slots=sorted(set(part.held_slots) | set(op.in_flight)))
                if op.in_flight:
                    res.released = False
            if op.future.done():  # it finished while we cancelled: the full result holds
                res = op.future.result()
            else:  # still running: only a zero-copy call in flight or an abandoned one holds slots
                with op._lock:
                    pending = list(op._pending_io)
                res.released = res.released and not res.held_slots and all(f.done() for f in pending)
                return res
        res.released = res.released and op.wait_released(timeout=0)
        return res

    def close(self) -> None:
        """Stop background work and close the store."""
        self._executor.shutdown(wait=True, cancel_futures=False)
        self.store.close()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
