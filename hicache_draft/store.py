"""An opened backend: its pluggy manager, its observers, and bounded, exception-free, verified calls.

:class:`Store` is what the controller and the SGLang adapter talk to. Every call runs on one of
a few worker threads (:mod:`hicache_draft.workers`) and is bounded by ``timeout_s``; an exception
(any ``BaseException`` but ``KeyboardInterrupt``), a result of the wrong shape or a timeout
becomes per-page ``FAILED`` results (or a zero existence count), logged once per kind with the
backend's name, never raised into the serving loop.

Integrity lives here, for every backend and both paths: :meth:`Store.page_set` makes each page's
header (key digest, namespace, length, xxh3 of the bytes handed over) before the call and gives it
to the backend to store (for a backend that declares ``writes_records`` it makes each header as it
writes the record itself, for one that declares ``headers_on_demand`` when the backend asks, just
before the page goes out; neither once the call has ended); :meth:`Store.page_get` gives the backend
a zeroed header buffer per page
and, after the call, checks every page reported ``OK`` against its key and the bytes in its
buffers. A lying, tearing, partly filling or foreign answer is ``CORRUPT``, never data.

A call that outlives its deadline is abandoned: its pages are ``FAILED`` whatever it returns
later, and the tracked variants hand back a future that completes when the backend no longer
touches the buffers. A late zero-copy ``page_set`` that reads slots after they were reused stores
bytes that no longer match the header made while the call was on, so every later read of them is
``CORRUPT``: a late write is never served as data.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from hicache_draft import _native
from hicache_draft.backend import BackendContext, StorageBackend
from hicache_draft.buffer_io import CORE_THREADS, threads_for
from hicache_draft.capabilities import Capabilities
from hicache_draft.errors import BackendSetupError, ConfigError, PluginError
from hicache_draft.page_format import (
    HEADER_SIZE,
    HeaderProblem,
    PageFormatError,
    check_page,
    namespace_bytes,
    pool_code,
)
from hicache_draft.plugins import get_backend, new_plugin_manager
from hicache_draft.transfer import (
    _BUFFER_FIELDS,
    _PAGE_FIELDS,
    Buffer,
    Page,
    PageResult,
    PageTransfer,
    PendingPages,
    PoolRegistration,
)
from hicache_draft.workers import DONE as _DONE
from hicache_draft.workers import SPIN_S, Job, Workers

log = logging.getLogger("hicache_draft.store")

def validate_options(name: str, cls: type[StorageBackend], options: Mapping[str, Any] | BaseModel) -> BaseModel:
    """Validate ``[backend_options]`` with the backend's own model; :class:`ConfigError` naming the field."""
    if isinstance(options, cls.Options):
        return options
    try:
        return cls.Options.model_validate(dict(options) if not isinstance(options, BaseModel) else options.model_dump())
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = f"backend_options.{loc}" if loc else "backend_options"
        raise ConfigError(f"invalid {field} for backend {name!r}: {err['msg']}", field=field) from None


@dataclass(frozen=True)
class CallReport:
    """How one page call ended, as the caller sees it.

    ``results``: per pool, one final (verified) result per page. ``outcome``: ``"ok"``,
    ``"timeout"`` (abandoned at its deadline: every page ``FAILED``) or ``"error"``.
    ``released``: completes when the backend no longer touches the call's buffers; already done
    unless the call was abandoned while still running."""

    results: dict[str, list[PageResult]]
    outcome: str
    released: Future[Any]


class Store:
    """A backend instance behind bounded calls.

    Build it with :meth:`open` (by name, through discovery) or directly from a class.
    ``observers`` are extra pluggy plugins registered next to the backend; a
    ``@hookimpl(wrapper=True)`` on ``page_set``/``page_get``/``page_exists`` sees every call.
    """

    # the page_get verifier class; only ``bench verify`` sets another (one that checks nothing,
    # to time what verifying costs against the very same call without it)
    _verifier: type[_EarlyVerifier] | None = None

    def __init__(
        self,
        name: str,
        cls: type[StorageBackend],
        capabilities: Capabilities,
        options: Mapping[str, Any] | BaseModel | None = None,
        context: BackendContext | None = None,
        observers: Iterable[object] = (),
        poll_s: float = SPIN_S,
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self.context = context or BackendContext()
        self.timeout_s = self.context.timeout_s
        opts = validate_options(name, cls, options or {})
        try:
            self.backend = cls(opts, self.context)
        except (BackendSetupError, ConfigError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # SystemExit from a constructor too: that backend failed to start
            raise BackendSetupError(f"backend {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
        self.pm: pluggy.PluginManager = new_plugin_manager()
        try:
            self.pm.register(self.backend, name=f"backend:{name}")
            for i, obs in enumerate(observers):
                self.pm.register(obs, name=f"observer:{i}:{type(obs).__name__}")
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"backend {name!r}: {exc}") from None
        self._observed = bool(self.pm.hook.call_done.get_hookimpls())
        self._hears_rejections = bool(self.pm.hook.page_rejected.get_hookimpls())
        self._workers = Workers(4, f"hicache-draft-{name}", spin_s=poll_s)
        # helper threads to wake as a call starts (1: none). A backend that keeps the core's records
        # hands the core its runs to read or write on up to every thread once it has planned them (a
        # fraction of a millisecond); any other backend's pages are checked while or after they move,
        # too late for helpers woken now to still be waiting (at most 2 ms). Polling off (0: a host
        # short of CPU): none.
        self._helpers_ahead = _VERIFY_WORKERS if poll_s > 0 and capabilities.writes_records else 1
        _helpers_stay_awake(poll_s)
        weakref.finalize(self, self._workers.shutdown)  # an unclosed store's idle threads end with it
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._closed = False
        self.corrupt_pages = 0  # pages a backend reported OK that failed the core's verification

    @classmethod
    def open(
        cls,
        name: str | None,
        options: Mapping[str, Any] | BaseModel | None = None,
        context: BackendContext | None = None,
        observers: Iterable[object] = (),
        poll_s: float = SPIN_S,
    ) -> Store:
        """Discover the backend called ``name`` (``None``: the installed default), validate options and
        build it. ``poll_s``: how long a caller polls for a call's result, and an idle worker thread
        for the next call, before sleeping (:data:`hicache_draft.workers.SPIN_S`; 0: at once)."""
        info = get_backend(name)
        assert info.cls is not None and info.capabilities is not None
        return cls(info.name, info.cls, info.capabilities, options, context, observers, poll_s)

    # -- plumbing ---------------------------------------------------------------------------
    def _log_once(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            if what in self._logged:
                log.debug(msg, *args)
                return
            self._logged.add(what)
        log.warning(msg, *args)

    def _call(self, hook: str, kwargs: dict[str, Any], deadline: float) -> tuple[str, Any, Future[Any]]:
        """Run a hook bounded by the timeout: ("ok", result, fut) | ("error", exc, fut) | ("timeout", None, fut)."""
        started = self._start(hook, kwargs, deadline)
        if isinstance(started, BaseException):
            return "error", started, _DONE
        return self._wait(started, deadline)

    def _start(
        self, hook: str, kwargs: dict[str, Any], deadline: float, then: Callable[[Job], None] | None = None
    ) -> Job | BaseException:
        if self._closed:
            return RuntimeError("store is closed")
        try:
            return self._workers.submit(getattr(self.pm.hook, hook), kwargs, deadline, then)
        except RuntimeError as exc:  # shut down
            return exc

    def _wait(self, job: Job, deadline: float) -> tuple[str, Any, Future[Any]]:
        returned, released = self._workers.wait(job, deadline)
        if not returned:
            return "timeout", None, released
        if job.error is not None:  # SystemExit, asyncio.CancelledError, ... from a backend: its failure
            return "error", job.error, released
        return "ok", job.value, released

    def _done(
        self, hook: str, outcome: str, started: float, transfers: Sequence[PageTransfer],
        results: Mapping[str, Sequence[PageResult]],
    ) -> None:
        """Tell observers (``call_done``) how a call ended; their errors never reach the caller."""
        if not self._observed:
            return
        try:
            self.pm.hook.call_done(
                backend=self.name, hook=hook, outcome=outcome, seconds=time.perf_counter() - started,
                transfers=transfers, results=results,
            )
        except Exception as exc:
            self._log_once("call_done", "an observer of backend %r failed in call_done: %s", self.name, exc)

    def call(self, hook: str, transfers: Sequence[PageTransfer], timeout_s: float | None = None) -> CallReport:
        """Run ``page_set`` or ``page_get`` bounded by ``timeout_s`` (default: the store's), with
        headers made or checked by the core; never raises for the backend's trouble."""
        if hook not in ("page_set", "page_get"):
            raise ValueError(f"Store.call runs page_set or page_get, not {hook!r}")
        started = time.perf_counter()
        outcome, results, fut, handed = self._per_page_call(hook, transfers, timeout_s)
        if handed and any(t.pages for t in handed):  # observers see what the backend was handed
            self._done(hook, outcome, started, handed, results)
        return CallReport(results, outcome, fut)

    def attach_headers(self, transfers: Sequence[PageTransfer], made: bool) -> list[PageTransfer]:
        """The transfers as this store hands them to its backend (for tools that time or call
        hooks directly, such as benchmarks): headers made from the pages' bytes (``made``, as for
        ``page_set``, on the store's threads) or zeroed for the backend to fill (``page_get``)."""
        return attach_headers(transfers, made=made, parallel=made)

    def check_pages(self, transfers: Sequence[PageTransfer]) -> list[tuple[str, int, PageFormatError]]:
        """The pages of ``transfers`` that fail the core's verification, as ``(pool, index,
        problem)``: the check a ``page_get`` makes before it reports a page restored, made alone on
        the store's threads (for tools that time or call hooks directly, such as benchmarks: the
        pages as :meth:`attach_headers` gave them for ``page_get``, once the backend filled them)."""
        todo = [(t.pool, i, page) for t in transfers for i, page in enumerate(t.pages)]
        return [(pool, i, exc) for pool, i, _page, exc in self._check(todo)]

    def _per_page(
        self, hook: str, transfers: Sequence[PageTransfer], timeout_s: float | None
    ) -> tuple[dict[str, list[PageResult]], Future[Any]]:
        rep = self.call(hook, transfers, timeout_s)
        return rep.results, rep.released

    def _per_page_call(
        self, hook: str, transfers: Sequence[PageTransfer], timeout_s: float | None
    ) -> tuple[str, dict[str, list[PageResult]], Future[Any], Sequence[PageTransfer]]:
        """(outcome, per-page results, released, the transfers as the backend was handed them)."""
        if not any(t.pages for t in transfers):
            return "ok", {t.pool: [] for t in transfers}, _DONE, transfers
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        # a backend that writes through write_records gets zeroed headers: the core makes each
        # one while writing the page (one pass over its memory), not before the call
        writes = hook == "page_set" and self.capabilities.writes_records
        on_demand = hook == "page_set" and not writes and self.capabilities.headers_on_demand
        transfers = attach_headers(transfers, made=hook == "page_set" and not writes and not on_demand, parallel=True)
        out = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        kwargs: dict[str, Any] = {"transfers": transfers, "deadline": deadline}
        early: _EarlyVerifier | None = None
        writer: _RecordWriter | _HeaderMaker | None = None
        if hook == "page_get":
            early = (self._verifier or _EarlyVerifier)(self, transfers, deadline)
            kwargs["finished"] = early.finished
            kwargs["read_records"] = early.read_records
            kwargs["read_runs"] = early.read_runs
        else:  # every spec argument is passed (pluggy warns otherwise)
            writer = (_RecordWriter(transfers, deadline) if writes else
                      _HeaderMaker(transfers, deadline) if on_demand else None)
            kwargs["write_records"] = writer.write_records if isinstance(writer, _RecordWriter) else None
            kwargs["write_runs"] = writer.write_runs if isinstance(writer, _RecordWriter) else None
            kwargs["make_headers"] = writer.make_headers if isinstance(writer, _HeaderMaker) else None
        if self._helpers_ahead > 1:  # woken now, so they are running when the backend hands its runs over
            _native.team_expect(self._helpers_ahead)
            try:
                status, value, fut = self._call(hook, kwargs, deadline)
            finally:
                _native.team_unexpect()
        else:
            status, value, fut = self._call(hook, kwargs, deadline)
        if writer is not None:
            writer.close()  # returned or abandoned: no further write or header reads the call's memory
        got = self._results(hook, status, value, transfers)
        if got is None:
            if early is not None:
                early.abandon()
            return status if status != "ok" else "error", out, fut, transfers
        if early is not None:
            early.settle(got)
        return "ok", got, fut, transfers

    def _results(
        self, hook: str, status: str, value: Any, transfers: Sequence[PageTransfer]  # noqa: ANN401
    ) -> dict[str, list[PageResult]] | None:
        """The backend's answer as per-page results, or None (logged once) when the call timed out,
        raised or answered something that is not a mapping of pool to results."""
        if status == "timeout":
            self._log_once(f"{hook}:timeout", "backend %r: %s timed out; pages counted as failed", self.name, hook)
            return None
        if status == "error":
            self._log_once(
                f"{hook}:error", "backend %r: %s raised %s: %s; pages counted as failed",
                self.name, hook, type(value).__name__, value,
            )
            return None
        if not isinstance(value, Mapping):
            self._log_once(
                f"{hook}:shape", "backend %r: %s returned %s, not a mapping of pool to results; "
                "pages counted as failed", self.name, hook, type(value).__name__,
            )
            return None
        out: dict[str, list[PageResult]] = {}
        for t in transfers:
            got = value.get(t.pool)
            if not isinstance(got, Sequence) or isinstance(got, (str, bytes)) or len(got) != len(t.pages):
                self._log_once(
                    f"{hook}:shape", "backend %r: %s returned no or wrong-length results for pool %s",
                    self.name, hook, t.pool,
                )
                out[t.pool] = [PageResult.FAILED] * len(t.pages)
                continue
            res = list(got)
            out[t.pool] = res if set(map(type, res)) <= _RESULT_TYPE else [_as_result(r) for r in res]
        return out

    def _check(self, todo: Sequence[tuple[str, int, Page]]) -> list[tuple[str, int, Page, PageFormatError]]:
        """Verify pages now, shared by the core's compiled threads when there are many bytes."""
        return _problems(todo, _threads_for(sum(p.nbytes for _, _, p in todo)))

    def _mark(
        self, problems: Iterable[tuple[str, int, Page, PageFormatError]], out: dict[str, list[PageResult]]
    ) -> None:
        rejected: dict[str, list[str]] = {}
        for pool, i, page, exc in problems:
            out[pool][i] = PageResult.CORRUPT
            rejected.setdefault(pool, []).append(page.key)
            with self._lock:
                self.corrupt_pages += 1
            self._log_once(
                f"verify:{exc.problem.value}", "backend %r returned page %s of pool %s that fails verification "
                "(%s); counted as corrupt, never data", self.name, page.key, pool, exc,
            )
        if rejected and self._hears_rejections:
            # off the caller's thread, unawaited
            self._start("page_rejected", {"rejected": rejected}, time.monotonic() + self.timeout_s,
                        self._rejection_done)

    def _rejection_done(self, job: Job) -> None:
        exc = job.error
        if exc is not None:
            self._log_once("page_rejected", "backend %r: page_rejected raised %s: %s", self.name,
                           type(exc).__name__, exc)

    # -- the contract ----------------------------------------------------------------------
    def register_pool(self, registration: PoolRegistration) -> None:
        """Announce a pool; raises :class:`BackendSetupError` if the backend refuses it or times out."""
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("register_pool", {"registration": registration}, deadline)
        if status == "timeout":
            raise BackendSetupError(f"backend {self.name!r}: register_pool timed out after {self.timeout_s}s")
        if status == "error":
            raise BackendSetupError(f"backend {self.name!r} refused pool {str(registration.pool)!r}: {value}")

    def has_hook(self, hook: str) -> bool:
        """Whether the backend (or an observer) implements ``hook``."""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def host_memory(self, pool: str, nbytes: int) -> Buffer | None:
        """Memory the backend offers for a host pool, or None (bounded; a failure is an error)."""
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("host_memory", {"pool": pool, "nbytes": nbytes}, deadline)
        if status != "ok":
            raise BackendSetupError(
                f"backend {self.name!r} could not provide host memory for the {str(pool)!r} pool: "
                f"{'timed out' if status == 'timeout' else value}"
            )
        if value is not None and (not isinstance(value, Buffer) or value.nbytes < nbytes):
            raise BackendSetupError(f"backend {self.name!r} returned unusable host memory for {str(pool)!r}")
        return value

    def page_set(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> dict[str, list[PageResult]]:
        """Store pages; per-page results, never raises. See :meth:`page_set_tracked` when the
        buffers are pool memory that will be reused."""
        results, _ = self._per_page("page_set", transfers, timeout_s)
        return results

    def page_set_tracked(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> tuple[dict[str, list[PageResult]], Future[Any]]:
        """Like :meth:`page_set`, plus a future that completes when the backend no longer reads
        the buffers (already done unless the call timed out): zero-copy pages must not be
        overwritten before it completes, or a late write could store other bytes under the key."""
        return self._per_page("page_set", transfers, timeout_s)

    def page_get(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> tuple[dict[str, list[PageResult]], Future[Any]]:
        """Load pages; per-page results and a future that completes when the backend no
        longer touches the buffers (already done unless the call timed out)."""
        return self._per_page("page_get", transfers, timeout_s)

    def page_exists(
        self, queries: Mapping[str, Sequence[str]], timeout_s: float | None = None
    ) -> dict[str, int]:
        """Leading stored pages per pool; 0 for a pool on error or timeout."""
        zero = {p: 0 for p in queries}
        if not any(queries.values()):
            return zero
        started = time.perf_counter()
        outcome, counts = self._exists(queries, timeout_s)
        if self._observed:
            self._done("page_exists", outcome, started, (), {
                p: [PageResult.OK] * counts[p] + [PageResult.MISS] * (len(k) - counts[p]) for p, k in queries.items()
            })
        return counts

    def _exists(
        self, queries: Mapping[str, Sequence[str]], timeout_s: float | None
    ) -> tuple[str, dict[str, int]]:
        zero = {p: 0 for p in queries}
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        status, value, _ = self._call("page_exists", {"queries": dict(queries), "deadline": deadline}, deadline)
        if status != "ok" or not isinstance(value, Mapping):
            self._log_once(
                f"page_exists:{status}", "backend %r: page_exists %s; counted as misses", self.name,
                "timed out" if status == "timeout" else
                f"failed: {value}" if status == "error" else f"returned {type(value).__name__}, not a mapping",
            )
            return (status if status != "ok" else "error"), zero
        out: dict[str, int] = {}
        for pool, keys in queries.items():
            n = value.get(pool, 0)
            out[pool] = max(0, min(int(n), len(keys))) if isinstance(n, int) and not isinstance(n, bool) else 0
        return "ok", out

    def close(self) -> None:
        """Close the backend (bounded) and stop the workers. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("close", {}, deadline)
        if status != "ok":
            log.warning("backend %r: close %s", self.name, "timed out" if status == "timeout" else value)
        self._closed = True
        self._workers.shutdown()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_VERIFY_CHUNK_BYTES = 4 << 20  # below this per worker, one thread makes or checks the headers
# read_records: bytes per read, hashed right after it lands. One thread reading a run of records
# from the page cache and verifying it, H200 host: 64 KiB records (8 MiB) 1.18 ms in 64 KiB reads,
# 1.04 in 128 KiB, 0.99 in 256 KiB, 1.01 in 512 KiB (0.80 unverified); 1 MiB records (64 MiB) 16.0 /
# 15.4 / 15.5 / 15.7 (12.5 unverified). On the 2-core VM every size from 64 KiB to 512 KiB is within
# its noise. The hash (about 30 GB/s a core, as fast from memory as from cache) is what verification
# costs; a read per record (64 KiB) costs a call per record on top.
_RECORD_CHUNK = 256 << 10
_VERIFY_WORKERS = CORE_THREADS


_HELPERS_AWAKE_S = 1e-3
"""How long a helper thread that finished a piece of work stays awake for the next shared call (at
least; a store's ``poll_s`` if longer). Calls that follow one another (a prefetch or backup of many
batches) then find their helpers running: on the 2-core VM, back-to-back verified gets of 128 x 64
KiB went 6.7 -> 8.1 GB/s with helpers awake 0.5 ms and 6.8 -> 8.3 with 1 ms, and gained nothing
with 0.1 ms (a call's own preparation takes longer). Bounded: an idle process's helpers sleep
after it."""


def _helpers_stay_awake(poll_s: float) -> None:
    """The core's compiled helper threads are the process's: one that finished a piece of work stays
    awake (``_HELPERS_AWAKE_S``, or ``poll_s`` if longer) for the longest setting of the stores
    opened in this process before it sleeps; a store that polls nothing (``poll_s`` 0, a host
    short of CPU) asks for none."""
    ns = int(max(poll_s, _HELPERS_AWAKE_S) * 1e9) if poll_s > 0 else 0
    if ns > _native.team_spin():
        _native.team_spin(ns)


def _threads_for(nbytes: int) -> int:
    """Threads to make or check the headers of ``nbytes`` of pages: one per ``_VERIFY_CHUNK_BYTES``,
    at most ``_VERIFY_WORKERS`` (the calling thread and the core's compiled helpers)."""
    return threads_for(nbytes, _VERIFY_CHUNK_BYTES, _VERIFY_WORKERS)


def attach_headers(transfers: Sequence[PageTransfer], made: bool, parallel: bool = False) -> list[PageTransfer]:
    """What the store hands a backend (public for tools that call hooks directly, such as the
    conformance kit): the transfers with every page's ``header`` set, made from the page's bytes
    (``page_set``) or zeroed for the backend to fill (``page_get``). Headers are made by compiled
    code without the GIL in one call; with ``parallel``, a large call's pages are shared by the
    calling thread and the core's compiled helper threads (they start together)."""
    count = sum(len(t.pages) for t in transfers)
    if not count:
        return list(transfers)
    block = bytearray(HEADER_SIZE * count)
    whole = Buffer.of(block)
    out: list[PageTransfer] = []
    at = whole.ptr
    for t in transfers:
        if isinstance(t.pages, PendingPages):  # built now, each page with its header (one compiled pass)
            pages = t.pages.build(at, whole)
        else:
            try:  # built in compiled code (about 0.1 us a page, not 1)
                pages = _native.with_headers(t.pages, at, whole, Page, _PAGE_FIELDS, Buffer, _BUFFER_FIELDS)
            except TypeError:  # objects that only look like pages
                pages = [Page(p.key, p.group, p.namespace, p.buffers, Buffer(at + HEADER_SIZE * j, HEADER_SIZE, whole))
                         for j, p in enumerate(t.pages)]
        at += HEADER_SIZE * len(pages)
        out.append(PageTransfer(t.pool, pages, t.zero_copy))
    if made:  # header i of the block is page i's, in the order of the transfers and their pages
        pages = [p for t in out for p in t.pages]
        codes = b"".join(bytes([pool_code(t.pool)]) * len(t.pages) for t in out)
        nbytes = sum(len(t.pages) * t.pages[0].nbytes for t in out if t.pages)  # pages of a pool: one size
        _native.pack_headers(block, pages, codes, namespace_bytes, _threads_for(nbytes) if parallel else 1)
    return out


class _RecordWriter:
    """The core's ``write_records`` for one ``page_set`` (backends that declare
    ``writes_records``): it writes pages of the call to the backend's file in the core's page
    format, making each header from the bytes as they go out, until the call returns or is
    abandoned; the deadline is the call's."""

    def __init__(self, transfers: Sequence[PageTransfer], deadline: float) -> None:
        self.pages = {t.pool: t.pages if t.pages.__class__ is list else list(t.pages) for t in transfers}
        self.codes = {t.pool: pool_code(t.pool) for t in transfers}
        self.deadline = deadline
        self.lock = threading.Lock()
        self.open = True

    def write_records(self, fd: int, offset: int, pages: Sequence[tuple[str, int]], chunk: int) -> int:
        """Write ``pages`` (``(pool, index)`` in their transfers) back to back from ``offset`` of
        ``fd``, each its 64-byte header then its payload, in calls that end on multiples of
        ``chunk`` in the file; each header is made from the bytes as they are written and put into
        the page's ``header`` too. Returns the bytes written. A page may be written again (a
        backend that retries). Raises once the call has returned or was abandoned, ``TimeoutError``
        at its deadline (nothing more read or written) and ``OSError`` as a write does."""
        todo: list[Page] = []
        codes = bytearray()
        with self.lock:
            if not self.open:
                raise RuntimeError("write_records after the page_set call ended or was abandoned")
            for pool, i in pages:
                got = self.pages.get(pool)
                if got is None or not isinstance(i, int) or not 0 <= i < len(got):
                    raise ValueError(f"write_records: no page {i!r} of pool {pool!r} in this call")
                todo.append(got[i])
                codes.append(self.codes[pool])
        return _native.write_records(fd, offset, todo, bytes(codes), namespace_bytes, chunk, self.deadline)

    def write_runs(
        self, runs: Sequence[tuple[int, int, Sequence[tuple[str, int]]]], threads: int, chunk: int,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[int | OSError]:
        """Many :meth:`write_records` in one call (``runs``: ``(fd, offset, pages)`` each), shared
        by the calling thread and up to ``threads - 1`` of the core's compiled threads, each taking
        the next run as it gets free; ``meanwhile()``, if given, runs in the calling thread while
        they write (it then takes whatever run is left). Per run: the bytes written, or the
        ``OSError`` its writes raised (``TimeoutError``: the deadline passed before or while it was
        written). A page may be in one run only. Raises once the call has returned or was
        abandoned, and what ``meanwhile`` raised, once no run is being written any more."""
        with self.lock:
            if not self.open:
                raise RuntimeError("write_runs after the page_set call ended or was abandoned")
            # the marking rule of reads, compiled, over marks of this request only (a page in one run)
            slots = {pool: [None] * len(pages) for pool, pages in self.pages.items()}
            loaded = _native.mark_runs(runs, self.pages, slots, True, self.codes, True)
        return _native.write_runs(loaded, namespace_bytes, chunk, threads, self.deadline, meanwhile)

    def close(self) -> None:
        with self.lock:
            self.open = False


class _HeaderMaker:
    """The core's ``make_headers`` for one ``page_set`` (backends that declare
    ``headers_on_demand``): it makes the headers of the pages the backend is about to send, from
    their bytes (a large request shared by the core's compiled threads), until the call returns or
    is abandoned; every page checks the deadline and the stop flag :meth:`close` sets, and
    :meth:`close` waits for a request in progress (at most one page per thread after the flag)."""

    def __init__(self, transfers: Sequence[PageTransfer], deadline: float) -> None:
        self.pages = {t.pool: t.pages for t in transfers}
        self.deadline = deadline
        self.cond = threading.Condition()
        self.open = True
        self.busy = 0
        self.stop = bytearray(1)  # read by the compiled code before each page: 1 once the call ended

    def make_headers(self, pool: str, indices: Sequence[int], into: Sequence[object] | None = None) -> None:
        """Make the headers of ``indices`` of ``pool``'s transfer (see the ``page_set`` hookspec);
        with ``into`` (one writable buffer per index, in order), also write each page's record
        there, its header made from the copy."""
        pages = self.pages.get(pool)
        idx = list(indices)
        if pages is None or not all(i.__class__ is int and 0 <= i < len(pages) for i in idx):
            bad = next((i for i in idx if pages is None or not (i.__class__ is int and 0 <= i < len(pages))), None)
            raise ValueError(f"make_headers: no page {bad!r} of pool {pool!r} in this call")
        if into is None:
            todo = [pages[i] for i in sorted(set(idx))]
        else:
            into = list(into)
            if len(into) != len(idx):
                raise ValueError(f"make_headers: {len(idx)} pages of pool {pool!r} but {len(into)} destinations")
            if len(set(idx)) != len(idx):
                raise ValueError(f"make_headers: a page of pool {pool!r} is given twice with destinations")
            todo = [pages[i] for i in idx]
        with self.cond:
            if not self.open or time.monotonic() >= self.deadline:
                raise RuntimeError("make_headers after the page_set call ended or was abandoned")
            self.busy += 1
        try:
            threads = _threads_for(sum(p.nbytes for p in todo))
            if into is None:
                _native.pack_headers(None, todo, pool_code(pool), namespace_bytes, threads, self.deadline, self.stop)
            else:
                _native.pack_records(todo, into, pool_code(pool), namespace_bytes, threads, self.deadline, self.stop)
        except BufferError as exc:
            raise ValueError(f"make_headers: a destination of pool {pool!r} is not writable memory: {exc}") from None
        except TimeoutError:
            raise RuntimeError("make_headers after the page_set call ended or was abandoned") from None
        finally:
            with self.cond:
                self.busy -= 1
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.open = False
            self.stop[0] = 1
            self.cond.wait_for(lambda: self.busy == 0, timeout=_HEADER_CLOSE_S)


_HEADER_CLOSE_S = 5.0  # bound on waiting for a request in progress (it stops at its next page)


class _EarlyVerifier:
    """The core's verification of one ``page_get``, done early where the backend says a page is
    final (the ``finished`` argument): in the backend's thread, while the bytes are in its cache,
    and overlapping the reading of the rest.

    It trusts ``finished`` exactly as far as the core trusts a return: after it (or after
    returning) the backend must not write the page's buffers again. What is checked, and what
    counts, is still decided here: pages the backend did not announce are checked after the call,
    and only pages the backend finally reports ``OK`` can count as restored."""

    check = True  # read_runs verifies what it reads (False: only bench verify's unverified variant)

    def __init__(self, store: Store, transfers: Sequence[PageTransfer], deadline: float = math.inf) -> None:
        self.store = store
        self.deadline = deadline  # read_runs starts no run after it
        self.pages = {t.pool: t.pages if t.pages.__class__ is list else list(t.pages) for t in transfers}
        self.codes = {t.pool: pool_code(t.pool) for t in transfers}
        # per pool, per page: the check that started early (None: not started); a check's result is
        # (the pages that failed it, the pages it was to read but did not: see settle)
        self.started: dict[str, list[_Check | None]] = {t.pool: [None] * len(t.pages) for t in transfers}
        self.lock = threading.Lock()
        self.open = True
        # pages whose check has ended and found nothing wrong (each page is checked at most once):
        # when that is every page of the call, settle has nothing to look at
        self.total = sum(len(p) for p in self.pages.values())
        self.clean = 0

    def finished(self, pool: str, indices: Iterable[int]) -> None:
        """Pages ``indices`` of ``pool``'s transfer hold their final header and bytes: the core
        checks them now, before this returns: in the calling thread while their bytes are still in
        its CPU cache (a backend that reads with several threads verifies with all of them), and
        shared by the core's compiled threads when they are many bytes, as after the call (one
        thread checked a 128 MiB announcement in 15.8 ms on the H200 host)."""
        pages = self.pages.get(pool)
        if pages is None:
            return
        slots = self.started[pool]
        todo = []
        fut: _Check = Future()
        with self.lock:
            if not self.open:
                return
            for i in indices:
                if isinstance(i, int) and 0 <= i < len(pages) and slots[i] is None:
                    slots[i] = fut
                    todo.append((pool, i, pages[i]))
            if not todo:
                return
        try:
            problems = self.store._check(todo)
            fut.set_result((problems, ()))
            if not problems:
                self._passed(len(todo))
        except BaseException as exc:  # a check that did not finish is redone after the call
            fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    def read_records(self, fd: int, offset: int, pages: Sequence[tuple[str, int]]) -> int:
        """Read ``pages`` (``(pool, index)`` in their transfers), stored back to back from ``offset``
        of ``fd`` in the core's page format (each its 64-byte header, then its payload), into their
        headers and buffers, and verify each as its bytes land, in calls of ``_RECORD_CHUNK`` bytes
        (the hash reads each piece right after it lands). Returns the bytes read (fewer only at
        end of file); the pages count as finished. Raises once the call was abandoned (its memory
        may be someone else's) and for a page named twice or already announced."""
        fut: _Check = Future()
        if pages.__class__ not in _PAIRS:
            pages = list(pages)
        with self.lock:
            if not self.open:
                raise RuntimeError("read_records after the page_get call ended or was abandoned")
            ((_fd, _offset, run, codes),) = self._mark_runs([(fd, offset, pages)], fut)
        try:
            nread, failed = _native.read_check(fd, offset, run, codes, namespace_bytes, _RECORD_CHUNK)
        except BaseException as exc:  # nothing read counts: checked again after the call, if reported OK
            with self.lock:
                self._unmark(pages)
            fut.set_exception(exc)
            raise
        fut.set_result((_named([(pages[j][0], pages[j][1], run[j]) for j in failed]) if failed else [], ()))
        if not failed:
            self._passed(len(run))
        return nread

    def read_runs(
        self, runs: Sequence[tuple[int, int, Sequence[tuple[str, int]]]], threads: int
    ) -> list[int | OSError | None]:
        """``read_records`` for many runs ``(fd, offset, pages)`` at once, shared by this thread and
        up to ``threads - 1`` of the core's helper threads (compiled, no GIL: they start together,
        and each takes the next run as it gets free). Per run: the bytes read, the ``OSError`` its
        read raised, or ``None`` when it was not started by the call's deadline; the pages of a
        run that was read count as finished. Raises as ``read_records`` does, before reading
        anything, for a page not in the call, named twice or already read."""
        fut: _Check = Future()  # one check for the whole call (a future per run cost ~5 us a run)
        if runs.__class__ not in _PAIRS:  # a Sequence (hookspec): iterated again below
            runs = list(runs)
        with self.lock:
            if not self.open:
                raise RuntimeError("read_runs after the page_get call ended or was abandoned")
            todo = self._mark_runs(runs, fut)
        try:
            got = _native.read_runs(todo, namespace_bytes, _RECORD_CHUNK, max(1, threads), self.deadline, self.check)
        except BaseException as exc:  # nothing read counts: checked again after the call, if reported OK
            with self.lock:
                for _fd, _offset, pages in runs:
                    self._unmark(pages)
            fut.set_exception(exc)
            raise
        out = [r[0] if r.__class__ is tuple else r for r in got]
        failed: list[tuple[str, int, Page]] = []
        unread: list[tuple[str, int]] = []
        if any(r.__class__ is not tuple or r[1] for r in got):  # some run failed its check or was not read
            for (_fd, _offset, pages), (_f, _o, run, _codes), res in zip(runs, todo, got, strict=True):
                if res.__class__ is tuple:
                    failed.extend((pages[j][0], pages[j][1], run[j]) for j in res[1])
                else:  # not read: those pages may be read again, and are checked after the call if reported OK
                    unread.extend(pages)
            if unread:
                with self.lock:
                    self._unmark(unread)
        fut.set_result((_named(failed) if failed else [], unread))
        if not failed and not unread:
            self._passed(sum(map(len, map(_THIRD, todo))))
        return out

    def _passed(self, n: int) -> None:
        """``n`` pages of a check that has ended passed it."""
        with self.lock:
            self.clean += n

    def _mark_runs(
        self, runs: Sequence[tuple[int, int, Sequence[tuple[str, int]]]], fut: _Check
    ) -> list[tuple[int, int, list[Page], int | bytes]]:
        """Mark every page of ``runs`` as read by the core's check ``fut`` (under the lock) and
        return each run as ``read_runs`` reads it: ``(fd, offset, its Page objects, their pool
        codes)``. Raises, leaving nothing marked, for a page not in the call, named twice or
        already read or announced (compiled: a Python loop cost about 0.2 us a page, 1.6 us a run)."""
        return _native.mark_runs(runs, self.pages, self.started, fut, self.codes)

    def _unmark(self, marked: Sequence[tuple[str, int]]) -> None:
        for pool, i in marked:
            self.started[pool][i] = None

    def abandon(self) -> None:
        with self.lock:
            self.open = False

    def settle(self, out: dict[str, list[PageResult]]) -> None:
        """Verify what was not verified early and mark every failure ``CORRUPT`` in ``out``."""
        with self.lock:
            self.open = False
            if self.clean == self.total:  # every page was checked, by a check that has ended, and passed
                return
            # as the checks stood when the call ended: a read still failing after it (a backend
            # that returned too early) unmarks its pages, which must still be checked here
            started = {pool: list(slots) for pool, slots in self.started.items()}
        later: list[tuple[str, int, Page]] = []
        problems_early: list[tuple[str, int, Page, PageFormatError]] = []
        early: dict[int, _Check] = {}
        ok = PageResult.OK
        for pool, pages in self.pages.items():
            slots, res = started[pool], out[pool]
            if None in slots:  # pages the backend neither read through the core nor announced
                later.extend((pool, i, pages[i]) for i, f in enumerate(slots) if f is None and res[i] is ok)
            for fut in set(slots):  # a check per run or read_runs call: its failures count only where OK
                if fut is not None:
                    early[id(fut)] = fut
        for fut in early.values():
            try:
                found, unread = fut.result()
            except Exception:  # noqa: BLE001 - a check that did not finish is done again here
                later.extend((pool, i, self.pages[pool][i]) for pool, slots in started.items()
                             for i, f in enumerate(slots) if f is fut and out[pool][i] is ok)
                continue
            problems_early.extend(p for p in found if out[p[0]][p[1]] is ok)
            # pages it was to read and did not, still its own when the call ended: checked here
            later.extend((pool, i, self.pages[pool][i]) for pool, i in unread
                         if started[pool][i] is fut and out[pool][i] is ok)
        self.store._mark([*problems_early, *(self.store._check(later) if later else [])], out)


def _problems(
    todo: Sequence[tuple[str, int, Page]], threads: int = 1
) -> list[tuple[str, int, Page, PageFormatError]]:
    """The pages of ``todo`` that fail verification, each with the problem :func:`check_page` names.
    The check itself is one compiled call (``_native.mismatches``, without the GIL, shared by up to
    ``threads`` threads)."""
    if not todo:
        return []
    codes = bytes(pool_code(pool) for pool, _i, _page in todo)
    failed = _native.mismatches([page for _pool, _i, page in todo], codes, namespace_bytes, threads)
    return _named([todo[j] for j in failed])


def _named(failed: Sequence[tuple[str, int, Page]]) -> list[tuple[str, int, Page, PageFormatError]]:
    """Pages that failed the compiled check, each with the problem :func:`check_page` finds."""
    bad = []
    for pool, i, page in failed:
        assert page.header is not None
        try:
            check_page(page.header.view(), page.key, page.namespace, pool, [b.view() for b in page.buffers],
                       page.nbytes)
        except PageFormatError as exc:
            bad.append((pool, i, page, exc))
        else:  # the bytes changed between the two checks (a writer is still at them), or a short read
            bad.append((pool, i, page, PageFormatError(HeaderProblem.PAYLOAD_CHECKSUM, "changed while checked")))
    return bad


_RESULT_TYPE = {PageResult}  # results that need no conversion
_PAIRS = (list, tuple)
_THIRD = operator.itemgetter(2)  # runs and their (pool, index) pairs that are indexed as they are
# an early check: (the pages that failed it, each with its problem; the pages it was to read and did not)
_Check = Future[tuple[list[tuple[str, int, Page, PageFormatError]], Sequence[tuple[str, int]]]]


def _as_result(r: object) -> PageResult:
    if r.__class__ is PageResult:
        return r  # type: ignore[return-value]
    if r is True:
        return PageResult.OK
    if r is False or r is None:
        return PageResult.FAILED
    try:
        return PageResult(int(r))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return PageResult.FAILED
