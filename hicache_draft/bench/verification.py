"""What the core's verification of restored pages costs, on a real backend.

Every round stores nothing new: it reads the same ``pages`` pages of ``page_bytes`` each three
times, back to back, into the same destination memory:

* ``store``: :meth:`hicache_draft.Store.page_get`, as the controller and the SGLang adapter call
  it: headers handed out, every page verified (early where the backend reports pages finished);
* ``unverified``: the very same :meth:`~hicache_draft.Store.page_get` with the check left out and
  nothing else changed (the store's verifier swapped for one that marks the pages the backend
  hands it as the real one does, reads them with the same compiled threads without hashing,
  ignores ``finished`` and checks nothing after the call): ``(store - unverified) / store`` is the
  share of ``page_get`` time the verification costs;
* ``bare``: the backend's own ``page_get`` hook with the same headers and nothing verified, run
  as the store runs every call (on its worker threads, bounded by its deadline: that hand-over is
  the price of the bound, not of verification, and costs both variants the same); a
  backend that hands runs of records to the core (``read_records``, ``read_runs``) gets one that
  reads them the same way (one :func:`~hicache_draft.read_into` per run; the same compiled threads
  with the check left out) and checks nothing, so both variants share the backend's plan, threads
  and reads, and differ only in the verification.

The ratio ``(store - bare) / store`` is the share of everything the core adds to the hook: the
verification, and the store's own handling of a call (the results' shape, the call's bookkeeping).
Medians over ``rounds``; the variants alternate so that drift hits all of them.

The same run also times the check alone (``hash``: :func:`~hicache_draft.corrupt_pages` in one
thread over a piece of the size the core reads and hashes at a time, ``_RECORD_CHUNK``, so that it
is in this core's cache as in the fused read-and-check; scaled to the pages' bytes) and prints
``(hash / T) / (bare + hash / T)`` with ``T`` the threads the core verifies with (one per CPU, at
most 16): what verifying costs when the cores that read the pages also hash them, the floor of the
share (a read limited by memory bandwidth rather than by its cores can hide part of it; a backend
that reads with fewer threads pays more).

And it times one thread's run (one thread's share of the batch, at least 2 MiB of records, from one
file of records in the core's page format in the system's temporary directory, in the page cache)
read plain with one :func:`~hicache_draft.read_into` and read and verified as ``read_records`` does
it: what verifying adds to the thread that reads, the floor for a store whose reading threads also
verify (the check is not free in that thread's cache: it is a pass at the hash's speed after a copy
at the kernel's).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_draft import _native
from hicache_draft.buffer_io import read_into, write_from
from hicache_draft.capabilities import PoolKind
from hicache_draft.keys import make_key
from hicache_draft.page_format import HEADER_SIZE, corrupt_pages, namespace_bytes, pack_page_headers, pool_code
from hicache_draft.store import _RECORD_CHUNK, _VERIFY_WORKERS, Store, _EarlyVerifier
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer


@dataclass(frozen=True)
class VerificationCost:
    page_bytes: int
    pages: int
    store_s: float
    bare_s: float
    hash_s: float = 0.0  # the check alone, one thread, each page in this core's cache
    unverified_s: float = 0.0  # the same Store.page_get with the check left out
    threads: int = 1  # the threads the core verifies with
    run_pages: int = 0  # the one-thread run: pages read from one file of records in the core's format
    run_read_s: float = 0.0  # that run read unchecked (one read_into)
    run_checked_s: float = 0.0  # that run read and verified as the core does (read_check)

    @property
    def floor(self) -> float:
        """The share verification costs when ``threads`` cores read and hash the pages."""
        spread = self.hash_s / self.threads
        return spread / (self.bare_s + spread) if self.hash_s else 0.0

    @property
    def share(self) -> float:
        """What verifying costs: the verified call against the same call without the check."""
        return (self.store_s - self.unverified_s) / self.store_s

    @property
    def core_share(self) -> float:
        """What the core adds to the backend's bare hook: verification and the store's own handling."""
        return (self.store_s - self.bare_s) / self.store_s

    @property
    def run_floor(self) -> float:
        """The share verification costs the thread that reads a run: what the fused read-and-check
        adds to one thread's plain read of the same records (a store that reads and verifies with
        the same threads pays it on every thread; 0 when not measured)."""
        return (self.run_checked_s - self.run_read_s) / self.run_checked_s if self.run_checked_s else 0.0

    def row(self) -> str:
        gb = self.page_bytes * self.pages / 1e9
        return (f"{self.page_bytes >> 10:>6} KiB x {self.pages:<4} | store {gb / self.store_s:6.2f} GB/s | "
                f"unverified {gb / self.unverified_s:6.2f} GB/s | bare {gb / self.bare_s:6.2f} GB/s | "
                f"verification {self.share * 100:5.1f}% of page_get (the core over the bare hook "
                f"{self.core_share * 100:5.1f}%) | "
                f"hash alone {gb / self.hash_s:6.2f} GB/s a thread: floor {self.floor * 100:4.1f}% with {self.threads} "
                f"thread(s) | one thread's run of {self.run_pages} pages read {self.run_read_s * 1e3:.3f} ms, read and "
                f"checked {self.run_checked_s * 1e3:.3f} ms: floor {self.run_floor * 100:4.1f}%")


def _pages(region: bytearray, groups: list[str], namespace: str, page_bytes: int) -> list[Page]:
    whole = Buffer.of(region)
    return [
        Page(make_key(g, namespace), g, namespace, (Buffer(whole.ptr + i * page_bytes, page_bytes, owner=whole),))
        for i, g in enumerate(groups)
    ]


def _unchecked_runs(
    transfers: Sequence[PageTransfer], deadline: float
) -> Callable[[Sequence[tuple[int, int, Sequence[tuple[str, int]]]], int], list[int | OSError | None]]:
    """A ``read_runs`` that reads the runs on the same threads in the same way and checks nothing
    (the ``bare`` variant)."""
    pages = {t.pool: list(t.pages) for t in transfers}
    codes = {t.pool: pool_code(t.pool) for t in transfers}

    def read(runs: Sequence[tuple[int, int, Sequence[tuple[str, int]]]], threads: int) -> list[int | OSError | None]:
        # the same compiled marking as the store's (its marks thrown away), so that both variants
        # do the same work per page and differ only in the check
        marks = {pool: [None] * len(p) for pool, p in pages.items()}
        todo = _native.mark_runs(runs, pages, marks, True, codes)
        got = _native.read_runs(todo, namespace_bytes, _RECORD_CHUNK, max(1, threads), deadline, False)
        return [r[0] if isinstance(r, tuple) else r for r in got]

    return read


class _Unverified(_EarlyVerifier):
    """The store's verifier with the check left out (the ``unverified`` variant): it marks and
    reads the runs a backend hands it exactly as the real one does, on the same threads, without
    hashing; ``finished`` and what is left after the call are not checked."""

    check = False

    def finished(self, pool: str, indices: Iterable[int]) -> None:
        return None

    def read_records(self, fd: int, offset: int, pages: Sequence[tuple[str, int]]) -> int:
        got = self.read_runs([(fd, offset, pages)], 1)[0]
        if isinstance(got, OSError):
            raise got
        if got is None:
            raise TimeoutError("read_records after the call's deadline")
        return got

    def settle(self, out: dict[str, list[PageResult]]) -> None:
        with self.lock:
            self.open = False


def _unchecked_reader(transfers: Sequence[PageTransfer]) -> Callable[[int, int, Sequence[tuple[str, int]]], int]:
    """A ``read_records`` that reads a run of records into the pages' headers and buffers in one
    :func:`~hicache_draft.read_into` and checks nothing (the ``bare`` variant)."""
    pages = {t.pool: t.pages for t in transfers}

    def read(fd: int, offset: int, run: Sequence[tuple[str, int]]) -> int:
        iov: list[Buffer] = []
        for pool, i in run:
            page = pages[pool][i]
            assert page.header is not None
            iov.append(page.header)
            iov.extend(page.buffers)
        return read_into(fd, offset, iov)

    return read


_RUN_FLOOR_BYTES = 2 << 20
"""The one-thread run is one thread's share of the batch, at least this (the file backend's run)."""


def _run_floor(
    src: bytearray, groups: list[str], namespace: str, page_bytes: int, rounds: int
) -> tuple[float, float]:
    """Median seconds for one thread to read a run of ``len(groups)`` records (the core's page
    format, one file in the system's temporary directory, in the page cache) unchecked with one
    :func:`read_into`, and read and verified as the core's ``read_records`` does it."""
    n = len(groups)
    stored = _pages(src, groups, namespace, page_bytes)
    headers = bytearray(HEADER_SIZE * n)
    whole = Buffer.of(headers)
    stored = [dataclasses.replace(p, header=Buffer(whole.ptr + i * HEADER_SIZE, HEADER_SIZE, owner=whole))
              for i, p in enumerate(stored)]
    pack_page_headers(memoryview(headers), stored, PoolKind.KV)
    dst = bytearray(page_bytes * n)
    into = _pages(dst, groups, namespace, page_bytes)
    zeroed = Buffer.of(bytearray(HEADER_SIZE * n))
    into = [dataclasses.replace(p, header=Buffer(zeroed.ptr + i * HEADER_SIZE, HEADER_SIZE, owner=zeroed))
            for i, p in enumerate(into)]
    iov = [b for p in into for b in (p.header, *p.buffers) if b is not None]
    reps = max(1, (64 << 20) // (page_bytes * n))  # about 64 MiB a timing
    timed: dict[str, list[float]] = {"read": [], "checked": []}
    with tempfile.TemporaryFile() as f:
        write_from(f.fileno(), 0, [b for p in stored for b in (p.header, *p.buffers) if b is not None])
        read_into(f.fileno(), 0, iov)  # in the page cache, the destination touched
        for _ in range(max(3, rounds)):
            t0 = time.perf_counter()
            for _ in range(reps):
                read_into(f.fileno(), 0, iov)
            timed["read"].append((time.perf_counter() - t0) / reps)
            t0 = time.perf_counter()
            for _ in range(reps):
                _, failed = _native.read_check(f.fileno(), 0, into, pool_code(PoolKind.KV), namespace_bytes,
                                               _RECORD_CHUNK)
                if failed:
                    raise RuntimeError("a record of the one-thread run fails its own check")
            timed["checked"].append((time.perf_counter() - t0) / reps)
    if dst != src[: len(dst)]:
        raise RuntimeError("the one-thread run read back other bytes than it wrote")
    return statistics.median(timed["read"]), statistics.median(timed["checked"])


def measure(
    backend: str | None, options: Mapping[str, Any], page_bytes: int = 1 << 20, pages: int = 128, rounds: int = 7
) -> VerificationCost:
    """Store ``pages`` random pages in ``backend`` and time verified against bare reads of them."""
    namespace = secrets.token_hex(12)
    groups = [secrets.token_hex(32) for _ in range(pages)]
    src = bytearray(os.urandom(page_bytes * pages))
    dst = bytearray(page_bytes * pages)
    store = Store.open(backend, dict(options))
    try:
        res = store.page_set([PageTransfer(PoolKind.KV, _pages(src, groups, namespace, page_bytes))])
        if any(r is not PageResult.OK for r in res[PoolKind.KV]):
            raise RuntimeError(f"backend {backend!r} did not store the benchmark pages: {res[PoolKind.KV][:4]}...")
        timed: dict[str, list[float]] = {"store": [], "bare": [], "hash": [], "unverified": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))])
            timed["store"].append(time.perf_counter() - t0)
            if any(r is not PageResult.OK for r in got[PoolKind.KV]):
                raise RuntimeError("a verified read failed; the benchmark needs a healthy store")
            store._verifier = _Unverified
            try:
                t0 = time.perf_counter()
                got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))])
                timed["unverified"].append(time.perf_counter() - t0)
            finally:
                del store._verifier
            if any(r is not PageResult.OK for r in got[PoolKind.KV]):
                raise RuntimeError("an unverified read failed; the benchmark needs a healthy store")
            t0 = time.perf_counter()
            bare = [PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))]
            transfers = store.attach_headers(bare, made=False)
            deadline = time.monotonic() + store.timeout_s
            status, _, _ = store._call("page_get", {  # the store's own bounded call, nothing verified
                "transfers": transfers, "deadline": deadline, "finished": lambda pool, idx: None,
                "read_records": _unchecked_reader(transfers), "read_runs": _unchecked_runs(transfers, deadline),
            }, deadline)
            timed["bare"].append(time.perf_counter() - t0)
            if status != "ok":
                raise RuntimeError(f"the unverified read {status}; the benchmark needs a healthy store")
        if dst != src:
            raise RuntimeError("the pages read back differ from the pages stored")
        # the check alone, in cache: one piece of the size the core reads and hashes at a time
        piece = min(page_bytes, _RECORD_CHUNK)
        probe = Page(make_key(groups[0], namespace), groups[0], namespace, (Buffer.of(memoryview(dst)[:piece]),),
                     Buffer.of(bytearray(HEADER_SIZE)))
        assert probe.header is not None
        pack_page_headers(probe.header.view(), [probe], PoolKind.KV)
        reps = max(1, page_bytes * pages // piece)
        for _ in range(rounds):
            corrupt_pages([probe], PoolKind.KV)
            t0 = time.perf_counter()
            for _ in range(reps):
                if corrupt_pages([probe], PoolKind.KV):
                    raise RuntimeError("a page fails its own check")
            timed["hash"].append((time.perf_counter() - t0) * page_bytes * pages / (reps * piece))
        run_pages = min(pages, max(1, -(-_RUN_FLOOR_BYTES // page_bytes), -(-pages // _VERIFY_WORKERS)))
        run_read, run_checked = _run_floor(src, groups[:run_pages], namespace, page_bytes, rounds)
        return VerificationCost(page_bytes, pages, *(statistics.median(timed[k]) for k in ("store", "bare", "hash")),
                                unverified_s=statistics.median(timed["unverified"]), threads=_VERIFY_WORKERS,
                                run_pages=run_pages, run_read_s=run_read, run_checked_s=run_checked)
    finally:
        store.close()
