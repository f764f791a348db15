"""The cache controller: backup and prefetch of target and draft KV pages, together.

* Every pool (target ``kv``, ``draft``, and the config's ``[[pools]]``: indexers, windows, states)
  is a :class:`~hicache_draft.binding.PoolBinding`: its path, split, keys, writer election,
  registration and page building are the binding's (planned by :func:`hicache_draft.paths.plan_pools`
  from the backend's declaration, never its name). Every pool is indexed by the target's host slots.
* Hit rule (:func:`hicache_draft.binding.usable_hit`): every ``all_pages`` pool must hold the whole
  prefix, every ``trailing_pages`` pool its last ``window_pages`` pages. ``draft.on_miss``:
  ``shorten`` lets the draft-role pools gate the hit too, so no slot is ever reported restored with
  stale draft state; ``target_only`` restores the target prefix and lists the draft-cold pages. A
  failure in any pool truncates the hit at the first failed page. With ``tp_size > 1`` and
  ``torch.distributed`` initialised, ranks agree on the MIN.
* Every pool's pages of a batch go to the backend in one call (trailing windows in one call after
  the prefix is in). Nothing here raises into the caller's loop for a storage failure: results say
  what happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_draft.backend import BackendContext
from hicache_draft.binding import Batch, PathChoice, PoolBinding, query_hit, settle
from hicache_draft.capabilities import Component, HitPolicy, PoolKind
from hicache_draft.config import Config, OnMiss, PrefetchPolicy
from hicache_draft.keys import page_hashes
from hicache_draft.metrics import Metrics, config_observers
from hicache_draft.paths import plan_paths, plan_pools
from hicache_draft.pools import Allocator, HostPool
from hicache_draft.store import CallReport, Store
from hicache_draft.workers import Workers

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
    pages_written: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    not_writer: list[str] = field(default_factory=list)
    dropped: bool = False
    released: bool = True  # False: a timed-out call may still read the host slots in held_slots
    held_slots: list[int] = field(default_factory=list)


@dataclass
class PrefetchResult:
    """What a prefetch restored into the given host slots.

    ``pages``: restorable prefix in pages (slots ``host_slots[:pages]`` are valid for the target,
    and for the draft unless listed in ``draft_cold``); ``tokens = pages * page_size``.
    ``restored``: pages per pool whose data is valid (for a ``trailing_pages`` pool, the pages of
    its window, the last ones of the prefix). ``hit``: each pool's own boundary from the existence
    queries.
    ``released``: False only if an abandoned backend call may still write into the slots listed
    in ``held_slots`` (never slots below ``pages``); wait with :meth:`CacheController.wait_released`
    or :meth:`Operation.wait_released` before reusing them.
    """

    pages: int = 0
    tokens: int = 0
    restored: dict[str, int] = field(default_factory=dict)
    hit: dict[str, int] = field(default_factory=dict)
    draft_cold: list[int] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
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
        self._claimed = False  # under _lock: a thread runs it, or close() answered it unrun

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


class CacheController:
    """Backs up and restores the target and draft host pools through one :class:`Store`."""

    def __init__(
        self,
        config: Config,
        store: Store,
        num_pages: int,
        allocator: Allocator | None = None,
        pools: Mapping[str, HostPool] | None = None,
        process_group: Any = None,  # noqa: ANN401
        max_pending: int = 64,
    ) -> None:
        self.config = config
        self.store = store
        self.page_size = config.namespace.page_size
        self.metrics = Metrics()
        self.process_group = process_group
        self._host_memory_owners: list[object] = []
        given = dict(pools or {})
        self._bindings: dict[str, PoolBinding] = {}
        for name, plan in plan_pools(config, store.capabilities, settle=False).items():  # own verdicts
            host = given.pop(name, None) or HostPool(
                plan.spec, num_pages, allocator=allocator or self._backend_allocator(name)
            )
            if host.spec != plan.spec:
                raise ValueError(f"given {name} host pool does not match the config's shape")
            self._bindings[name] = PoolBinding(plan, host)
        if given:
            raise ValueError(f"host pools given for pools the config does not have: {sorted(given)}")
        self._register_pools()
        self.plan: dict[str, PathChoice] = plan_paths(config, store.capabilities)
        self.plan.update({name: b.choice for name, b in self._bindings.items()})
        par = config.parallel
        if par.tp_size > 1 and not store.capabilities.shared:
            log.warning(
                "backend %r does not declare shared = true, yet %d TP ranks use it; "
                "each rank needs a store of its own", store.name, par.tp_size,
            )
        for name, b in self._bindings.items():
            if b.spec.role is PoolKind.DRAFT and not b.active:
                what = "KV" if b.spec.component is Component.KV else b.spec.component.value
                log.warning(
                    "draft %s offload disabled for backend %r (pool %r): %s; restored pages will be reported "
                    "draft-cold", what, store.name, str(name), b.reason,
                )
        self._held: list[tuple[Future[Any], tuple[int, ...]]] = []
        self._held_lock = threading.Lock()
        # background operations: daemon threads a forked child starts anew (hicache_draft.workers);
        # an operation takes milliseconds, so an idle thread sleeps at once (no polling)
        self._workers = Workers(2, "hicache-draft-ctl", spin_s=0.0)
        self._max_pending = max_pending
        self._fresh_ops()
        _CONTROLLERS.add(self)

    def _fresh_ops(self) -> None:
        """Track no background operation (also in a forked child, where the parent's never run)."""
        self._ops: dict[Operation, None] = {}  # queued or running, in submission order
        self._ops_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self._max_pending)

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
        store = Store.open(config.backend, config.backend_options, ctx, [*observers, *config_observers(config)],
                           poll_s=config.handover_poll_us * 1e-6)
        try:
            return cls(config, store, num_pages, allocator=allocator, process_group=process_group)
        except BaseException:
            store.close()
            raise

    def _backend_allocator(self, pool: str) -> Allocator | None:
        """An allocator over memory the backend offers through ``host_memory`` (if it does)."""
        if not self.store.has_hook("host_memory"):
            return None

        def alloc(nbytes: int) -> torch.Tensor:
            buf = self.store.host_memory(pool, nbytes)
            if buf is None:
                return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            arr = (ctypes.c_ubyte * buf.nbytes).from_address(buf.ptr)
            t = torch.frombuffer(arr, dtype=torch.uint8)
            self._host_memory_owners.append((buf, arr))
            return t

        return alloc

    # -- setup -------------------------------------------------------------------------------------
    def _register_pools(self) -> None:
        for name, b in self._bindings.items():
            if b.active and not b.register(self.store):
                log.warning("%s pool offload disabled: %s", name, b.reason)
        why = settle(self._bindings)
        if why:
            log.warning("offload disabled: %s", why)

    @property
    def bindings(self) -> dict[str, PoolBinding]:
        """Every pool's binding, by pool name (target ``kv`` first)."""
        return dict(self._bindings)

    def host_pool(self, name: str) -> HostPool:
        """The host pool called ``name`` (``"kv"``, ``"draft"``, ``"indexer"``, ...)."""
        host = self._bindings[name].host
        assert host is not None
        return host

    @property
    def target_pool(self) -> HostPool:
        return self.host_pool(PoolKind.KV)

    @property
    def draft_pool(self) -> HostPool | None:
        b = self._bindings.get(PoolKind.DRAFT)
        return b.host if b is not None else None

    @property
    def draft_active(self) -> bool:
        b = self._bindings.get(PoolKind.DRAFT)
        return b is not None and b.active

    def keys_for(self, pool: str, hashes: Sequence[str]) -> list[str]:
        """The storage keys of ``pool`` for page hashes, part after part for each page."""
        return self._bindings[pool].keys(hashes)

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
        every pool together. Never raises for storage trouble.

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
        writers = [b for b in self._bindings.values() if b.active and b.writer]
        result.not_writer = [name for name, b in self._bindings.items() if b.active and not b.writer]
        for b in writers:
            result.pages_written[b.name] = 0
            result.failed[b.name] = 0
        step = self.config.batch_pages
        done = 0
        for start in range(0, n if writers else 0, step):
            if _op is not None and _op.cancelled.is_set():
                break
            hs, sl = hashes[start : start + step], host_slots[start : start + step]
            batches = [b.slot_batch(hs, sl, fill=True) for b in writers]
            t0 = time.perf_counter()
            rep = self.store.call("page_set", [bt.transfer for bt in batches])
            dt = time.perf_counter() - t0
            done = start + len(hs)
            all_failed = True
            for b in writers:
                r = rep.results[b.name]
                self.metrics.record_set(b.name, r, b.part_nbytes, dt / len(writers))
                ok_pages = sum(b.page_oks(r))
                all_failed &= ok_pages == 0
                result.pages_written[b.name] += ok_pages
                result.failed[b.name] += len(hs) - ok_pages
            if rep.outcome != "ok":
                zc = sorted({s for bt in batches for s in bt.zero_copy_slots})
                if not self._let_go(rep, zc, _op):
                    result.released = False
                    result.held_slots.extend(zc)
            if _op is not None:
                _op.partial = result
            if rep.outcome != "ok" or all_failed:
                break
        for b in writers:  # what a stopped backup never sent
            result.failed[b.name] += n - done
        return result

    # -- prefetch -------------------------------------------------------------------------------------
    def _plan_hit(self, hashes: Sequence[str], n: int, shorten: bool, result: PrefetchResult) -> tuple[int, int]:
        """(pages, draft pages) the stores promise for ``hashes[:n]``: one existence query for the
        ``all_pages`` pools, then each ``trailing_pages`` pool's window
        (:func:`~hicache_draft.binding.query_hit`)."""
        active = [b for b in self._bindings.values() if b.active]
        hit = query_hit(self.store.page_exists, active, hashes[:n], PoolBinding.keys, draft_gates=shorten)
        result.hit = dict(hit.boundaries)
        return hit.pages, hit.draft_pages

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
        host_slots = list(host_slots)
        kv = self._bindings[PoolKind.KV]
        shorten = self.config.draft.on_miss is OnMiss.SHORTEN
        active = [b for b in self._bindings.values() if b.active]
        draft_on = any(b.spec.role is PoolKind.DRAFT for b in active)
        result = PrefetchResult()
        planned = draft_planned = 0
        if kv.active and n > 0:
            planned, draft_planned = self._plan_hit(hashes, n, shorten, result)
        planned = self._agree(planned)  # every rank, even one whose pool is disabled
        draft_planned = min(draft_planned, planned)
        # all-pages pools come in batch by batch; the target's and (shorten) the draft's gate the prefix
        every = [b for b in active if b.spec.hit_policy is HitPolicy.ALL_PAGES]
        trailing = [b for b in active if b.spec.hit_policy is HitPolicy.TRAILING_PAGES]
        gate = [b for b in every if shorten or b.spec.role is not PoolKind.DRAFT]
        lagging = [b for b in every if b not in gate]  # target_only drafts: best effort, never gating
        ok = {b.name: 0 for b in active}
        failed: dict[str, int] = {}
        step = self.config.batch_pages
        stopped = False
        for start in range(0, planned if kv.active else 0, step):
            if _op is not None and _op.cancelled.is_set():
                stopped = True
                break
            end = min(planned, start + step)
            hs, sl = hashes[start:end], host_slots[start:end]
            loads = [(b, b.slot_batch(hs, sl, fill=False)) for b in gate]
            for b in lagging:
                if ok[b.name] == start and start < draft_planned:
                    dn = min(end, draft_planned) - start
                    loads.append((b, b.slot_batch(hs[:dn], sl[:dn], fill=False)))
            if not self._load(loads, ok, failed, result, _op, gate=[b.name for b in gate], draft_on=draft_on,
                              shorten=shorten):
                stopped = True
                break
            if any(ok[b.name] < end for b in gate):
                break
        pages = min((ok[b.name] for b in gate), default=0)
        if any(b.spec.hit_policy is HitPolicy.TRAILING_PAGES for b in self._bindings.values()):
            # windows sit at the end of the prefix: load them where every rank ends (every rank enters
            # this collective whenever the config has a trailing pool, whatever its local state)
            pages = self._agree(pages)
        if trailing and pages and not stopped:
            lo = [max(0, pages - b.spec.window_pages) for b in trailing]
            windows = [(b, b.slot_batch(hashes[a:pages], host_slots[a:pages], fill=False))
                       for b, a in zip(trailing, lo, strict=True)]
            self._load(windows, ok, failed, result, _op, gate=[b.name for b in gate], draft_on=draft_on,
                       shorten=shorten, window=True)
        return self._finish(result, ok, pages, draft_on, shorten, failed, agree=True)

    def _load(
        self, loads: list[tuple[PoolBinding, Batch]], ok: dict[str, int], failed: dict[str, int],
        result: PrefetchResult, op: Operation | None, *, gate: Sequence[str], draft_on: bool, shorten: bool,
        window: bool = False,
    ) -> bool:
        """One ``page_get`` for ``loads``; publishes (copies staged pages, counts leading OK pages
        into ``ok``: added for batches of the prefix, set for ``window`` loads of trailing pools)
        unless the call failed or the operation was cancelled. False: stop."""
        zc = sorted({s for _, bt in loads for s in bt.zero_copy_slots})
        if op is not None:
            with op._lock:
                op.in_flight = zc
        t0 = time.perf_counter()
        rep = self.store.call("page_get", [bt.transfer for _, bt in loads])
        dt = time.perf_counter() - t0
        for b, _ in loads:
            self.metrics.record_get(b.name, rep.results[b.name], b.part_nbytes, dt / len(loads))
        if rep.outcome != "ok":
            for b, _ in loads:
                failed[b.name] = failed.get(b.name, 0) + 1
            if not self._let_go(rep, zc, op):
                result.released = False
                result.held_slots.extend(zc)
            if op is not None:
                with op._lock:
                    op.in_flight = []
            return False
        with op._lock if op is not None else contextlib.nullcontext():
            if op is not None:
                op.in_flight = []
                if op.cancelled.is_set():  # the caller took its result: publish nothing more
                    return False
            for b, bt in loads:
                r = rep.results[b.name]
                got = b.prefix(r)
                b.finish_get(bt, r, upto=got)
                if got < len(r) // b.split:
                    failed[b.name] = failed.get(b.name, 0) + 1
                ok[b.name] = got if window else ok[b.name] + got
            if op is not None:
                pages = min((ok[name] for name in gate), default=0)
                op.partial = self._finish(result, ok, pages, draft_on, shorten, failed, agree=False)
        return True

    def _finish(
        self, result: PrefetchResult, ok: Mapping[str, int], pages: int, draft_on: bool, shorten: bool,
        failed: dict[str, int], agree: bool,
    ) -> PrefetchResult:
        """The result for a prefix of ``pages``: shortened by every gating trailing window that did
        not come back whole; draft-role pools that did not come back make pages draft-cold."""
        for b in self._bindings.values():
            if (b.active and b.spec.hit_policy is HitPolicy.TRAILING_PAGES and pages
                    and (shorten or b.spec.role is not PoolKind.DRAFT)
                    and ok.get(b.name, 0) < min(b.spec.window_pages, pages)):
                pages = 0  # its window at this prefix did not come back: nothing here is usable
        if agree:
            pages = self._agree(pages)
        out = PrefetchResult(
            pages=pages, tokens=pages * self.page_size, hit=dict(result.hit), released=result.released,
            failed={k: v for k, v in failed.items() if v}, held_slots=list(result.held_slots),
        )
        draft = pages
        for name, b in self._bindings.items():
            if b.spec.role is PoolKind.DRAFT and not self.config.draft.enabled:
                continue
            if b.spec.hit_policy is HitPolicy.TRAILING_PAGES:
                got = min(ok.get(name, 0), pages) if b.active else 0
                whole = got >= min(b.spec.window_pages, pages)
                out.restored[name] = got
                if b.spec.role is PoolKind.DRAFT and not whole:
                    draft = 0
            else:
                got = min(ok.get(name, 0), pages) if b.active else 0
                out.restored[name] = pages if b.spec.role is PoolKind.KV and b.active else got
                if b.spec.role is PoolKind.DRAFT:
                    draft = min(draft, got)
        if self.config.draft.enabled:
            draft = draft if draft_on else 0
            out.draft_cold = list(range(draft, pages))
            if PoolKind.DRAFT in out.restored:
                out.restored[PoolKind.DRAFT] = min(out.restored[PoolKind.DRAFT], draft)
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
            with op._lock:
                if op._claimed:  # answered unrun by close()
                    return
                op._claimed = True
            try:
                op.future.set_result(fn(*args, _op=op))
            except BaseException as exc:  # never into the caller's loop: log and return the partial result
                log.exception("background offload operation failed: %s", exc)
                op.future.set_result(op.partial)
            finally:
                self._slots.release()
                with self._ops_lock:
                    self._ops.pop(op, None)

        with self._ops_lock:
            self._ops[op] = None
        try:
            self._workers.submit(run, {}, time.monotonic() + bound_s)
        except RuntimeError:  # closed
            with self._ops_lock:
                self._ops.pop(op, None)
            self._slots.release()
            raise
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
        """Let queued and running background operations finish, waiting for each in turn at
        most its own bound (:meth:`collect`), then close the store. An operation that had not
        started by then never will: it is answered with its empty result (a backup's
        ``dropped`` set)."""
        with self._ops_lock:
            ops = list(self._ops)
        for op in ops:
            with contextlib.suppress(FutureTimeout):
                op.future.result(timeout=op.bound_s)
        self._workers.shutdown()  # drops what has not started: answered here, never run
        with self._ops_lock:
            left = list(self._ops)  # running ones leave when they end; the rest never will
        for op in left:
            with op._lock:
                unrun, op._claimed = not op._claimed, True
            if unrun:
                with self._ops_lock:
                    self._ops.pop(op, None)
                self._slots.release()
                if isinstance(op.partial, BackupResult):
                    op.partial.dropped = True
                op.future.set_result(op.partial)
        self.store.close()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CONTROLLERS: weakref.WeakSet[CacheController] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child tracks none of the parent's background operations (they never run there), so
    its ``close`` does not wait for them; its own start on threads of its own (workers.py)."""
    for ctrl in list(_CONTROLLERS):
        ctrl._fresh_ops()


os.register_at_fork(after_in_child=_after_fork_in_child)
