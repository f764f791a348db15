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

import ctypes
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
from hicache_draft.metrics import Metrics
from hicache_draft.paths import PathChoice, plan_paths, pool_specs
from hicache_draft.pools import Allocator, HostPool, PoolSpec
from hicache_draft.store import Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PoolRegistration

log = logging.getLogger("hicache_draft.controller")


@dataclass
class BackupResult:
    """What a backup stored. ``pages_written``/``failed`` per pool; ``pages`` asked for.

    ``released``: False only if a timed-out backend call may still read the host slots; do not
    overwrite them before the operation's :meth:`Operation.wait_released` returns True.
    """

    pages: int
    pages_written: dict[PoolKind, int] = field(default_factory=dict)
    failed: dict[PoolKind, int] = field(default_factory=dict)
    not_writer: list[PoolKind] = field(default_factory=list)
    dropped: bool = False
    released: bool = True  # False: a timed-out call may still read the host slots; see Operation.wait_released


@dataclass
class PrefetchResult:
    """What a prefetch restored into the given host slots.

    ``pages``: restorable prefix in pages (slots ``host_slots[:pages]`` are valid for the target,
    and for the draft unless listed in ``draft_cold``); ``tokens = pages * page_size``.
    ``restored``: pages per pool whose data is valid. ``hit``: what existence queries promised.
    ``released``: False only if a timed-out backend call may still write into slots past
    ``pages``; wait on the operation's :meth:`Operation.wait_released` before reusing them.
    """

    pages: int = 0
    tokens: int = 0
    restored: dict[PoolKind, int] = field(default_factory=dict)
    hit: dict[PoolKind, int] = field(default_factory=dict)
    draft_cold: list[int] = field(default_factory=list)
    failed: dict[PoolKind, int] = field(default_factory=dict)
    released: bool = True


class Operation:
    """A background backup or prefetch: wait on it, time-bound it, or cancel it."""

    def __init__(self) -> None:
        self.future: Future[Any] = Future()
        self.cancelled = threading.Event()
        self.partial: Any = None
        self._pending_io: list[Future[Any]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stop after the batch in flight; :meth:`result` then returns what was done."""
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
        for f in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                f.result(timeout=left)
            except FutureTimeout:
                return False
            except Exception:  # noqa: S110 - an I/O error still releases the buffers
                pass
        return True


def _still_held(io_done: Future[Any], op: Operation | None) -> bool:
    """True when the backend is done with the call's buffers; otherwise the operation tracks the call
    so that :meth:`Operation.wait_released` covers it."""
    if io_done.done():
        return True
    if op is not None:
        op._track(io_done)
    return False


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
        if config.draft.enabled and not self._pools[PoolKind.DRAFT].active:
            log.warning(
                "draft KV offload disabled for backend %r: %s; restored pages will be reported draft-cold",
                store.name, self.plan[PoolKind.DRAFT].reason,
            )
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
        """Open the configured backend and build the host pools."""
        ctx = BackendContext(
            tp_rank=config.parallel.tp_rank, tp_size=config.parallel.tp_size, timeout_s=config.timeout_s
        )
        store = Store.open(config.backend, config.backend_options, ctx, observers)
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
        if not zero_copy:
            stage = torch.empty((len(hashes) * st.split, st.part_nbytes), dtype=torch.uint8)
        for i, (h, slot) in enumerate(zip(hashes, slots, strict=True)):
            for part, ns in enumerate(st.namespaces):
                if zero_copy:
                    bufs = st.pool.page_buffers(slot, part, st.split)
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

    # -- backup ---------------------------------------------------------------------------------------
    def backup(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None,
        _op: Operation | None = None,
    ) -> BackupResult:
        """Store the full pages of ``token_ids`` from ``host_slots`` (first slot of each page),
        target and draft together. Never raises for storage trouble."""
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
        for start in range(0, n, step):
            if _op is not None and _op.cancelled.is_set():
                break
            hs, sl = hashes[start : start + step], list(host_slots[start : start + step])
            transfers = []
            for kind, st in writers:
                pages, _ = self._pages(st, hs, sl, fill=True)
                transfers.append(PageTransfer(kind, pages, st.choice.path is IOPath.ZERO_COPY))
            if not transfers:
                break
            t0 = time.perf_counter()
            res, io_done = self.store.page_set_tracked(transfers)
            dt = time.perf_counter() - t0
            result.released &= _still_held(io_done, _op)
            for kind, st in writers:
                r = res[kind]
                self.metrics.record_set(kind, r, st.part_nbytes, dt / len(writers))
                ok_pages = sum(
                    1 for i in range(0, len(r), st.split) if all(x == PageResult.OK for x in r[i : i + st.split])
                )
                result.pages_written[kind] += ok_pages
                result.failed[kind] += len(hs) - ok_pages
            if _op is not None:
                _op.partial = result
        return result

    # -- prefetch -------------------------------------------------------------------------------------
    def prefetch(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None,
        _op: Operation | None = None,
    ) -> PrefetchResult:
        """Load the longest restorable prefix of ``token_ids`` into ``host_slots``. Never raises
        for storage trouble; see :class:`PrefetchResult` for what is valid afterwards."""
        hashes = page_hashes(token_ids, self.page_size, prior_hash)
        n = min(len(hashes), len(host_slots))
        kv = self._pools[PoolKind.KV]
        draft = self._pools.get(PoolKind.DRAFT)
        draft_on = draft is not None and draft.active
        shorten = self.config.draft.on_miss is OnMiss.SHORTEN
        result = PrefetchResult()
        if not kv.active or n == 0:
            return result
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
        planned = self._agree(planned)
        draft_planned = min(draft_planned, planned)
        kv_ok = draft_ok = 0
        failed = {PoolKind.KV: 0, PoolKind.DRAFT: 0}
        step = self.config.batch_pages
        for start in range(0, planned, step):
            if _op is not None and _op.cancelled.is_set():
                break
            end = min(planned, start + step)
            hs, sl = hashes[start:end], list(host_slots[start:end])
            loads: list[tuple[PoolKind, _PoolState, list[tuple[int, int, torch.Tensor]]]] = []
            transfers = []
            if kv_ok == start:
                pages, staged = self._pages(kv, hs, sl, fill=False)
                transfers.append(PageTransfer(PoolKind.KV, pages, kv.choice.path is IOPath.ZERO_COPY))
                loads.append((PoolKind.KV, kv, staged))
            if draft_on and draft_ok == start and start < draft_planned:
                assert draft is not None
                dn = min(end, draft_planned) - start
                pages, staged = self._pages(draft, hs[:dn], sl[:dn], fill=False)
                transfers.append(PageTransfer(PoolKind.DRAFT, pages, draft.choice.path is IOPath.ZERO_COPY))
                loads.append((PoolKind.DRAFT, draft, staged))
            if not any(k is PoolKind.KV for k, _, _ in loads):
                break
            t0 = time.perf_counter()
            res, io_done = self.store.page_get(transfers)
            dt = time.perf_counter() - t0
            result.released &= _still_held(io_done, _op)
            for kind, st, staged in loads:
                r = res[kind]
                self.metrics.record_get(kind, r, st.part_nbytes, dt / len(loads))
                got = self._page_prefix(st, r)
                if io_done.done():
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
            failed={k: v for k, v in failed.items() if v},
        )
        out.restored[PoolKind.KV] = pages
        if self.config.draft.enabled:
            d = min(draft_ok, pages) if draft_on else 0
            out.restored[PoolKind.DRAFT] = d
            out.draft_cold = list(range(d, pages))
        return out

    # -- background --------------------------------------------------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any, empty: Any) -> Operation:  # noqa: ANN401
        op = Operation()
        op.partial = empty
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

    def backup_async(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None
    ) -> Operation:
        """Back up off the caller's thread. Do not overwrite ``host_slots`` until
        :meth:`Operation.wait_released` returns True (it waits for the operation and for any
        backend call that outlived its timeout)."""
        return self._submit(self.backup, list(token_ids), list(host_slots), prior_hash,
                            empty=BackupResult(pages=0))

    def prefetch_async(
        self, token_ids: Sequence[int], host_slots: Sequence[int], prior_hash: str | None = None
    ) -> Operation:
        """Prefetch off the caller's thread; collect with :meth:`collect`."""
        return self._submit(self.prefetch, list(token_ids), list(host_slots), prior_hash,
                            empty=PrefetchResult())

    def collect(self, op: Operation, policy: PrefetchPolicy | None = None) -> PrefetchResult:
        """Take a prefetch's result under a policy (default: the config's ``prefetch_policy``).

        ``best_effort``: what has arrived now (the rest is cancelled); ``wait_complete``: all of it,
        bounded by ``timeout_s`` per batch; ``timeout``: wait at most ``prefetch_timeout_s``.
        """
        policy = policy or self.config.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            timeout = 0.0
        elif policy is PrefetchPolicy.TIMEOUT:
            timeout = self.config.prefetch_timeout_s
        else:
            timeout = self.config.timeout_s * 4
        try:
            return op.future.result(timeout=timeout)
        except FutureTimeout:
            op.cancel()  # stop after the batch in flight; each batch is bounded by timeout_s
        try:
            res = op.future.result(timeout=self.config.timeout_s * 2)
        except FutureTimeout:
            res = op.partial if op.partial is not None else PrefetchResult()
            res.released = False
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
