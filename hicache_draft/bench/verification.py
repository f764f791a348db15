"""What the core's verification of restored pages costs, on a real backend.

Every round stores nothing new: it reads the same ``pages`` pages of ``page_bytes`` each twice,
back to back, into the same destination memory:

* ``store``: :meth:`hicache_draft.Store.page_get`, as the controller and the SGLang adapter call
  it: headers handed out, every page verified (early where the backend reports pages finished);
* ``bare``: the backend's own ``page_get`` hook with the same headers and nothing verified, run
  as the store runs every call (on its worker threads, bounded by its deadline: that hand-over is
  the price of the bound, not of verification, and costs both variants the same); a
  backend that hands runs of records to the core (``read_records``) gets one that reads them the
  same way (one :func:`~hicache_draft.read_into` per run) and checks nothing, so both variants
  share the backend's plan, threads and reads, and differ only in the verification.

The ratio ``(store - bare) / store`` is the share of ``page_get`` time the verification costs.
Medians over ``rounds``; the two variants alternate so that drift hits both.

The same run also times the check alone (``hash``: :func:`~hicache_draft.corrupt_pages` in one
thread over a piece of the size the core reads and hashes at a time, ``_RECORD_CHUNK``, so that it
is in this core's cache as in the fused read-and-check; scaled to the pages' bytes) and prints
``(hash / T) / (bare + hash / T)`` with ``T`` the threads the core verifies with (one per CPU, at
most 16): what verifying costs when the cores that read the pages also hash them, the floor of the
share (a read limited by memory bandwidth rather than by its cores can hide part of it; a backend
that reads with fewer threads pays more).
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache_draft.buffer_io import read_into
from hicache_draft.capabilities import PoolKind
from hicache_draft.keys import make_key
from hicache_draft.page_format import HEADER_SIZE, corrupt_pages, pack_page_headers
from hicache_draft.store import _RECORD_CHUNK, _VERIFY_WORKERS, Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer


@dataclass(frozen=True)
class VerificationCost:
    page_bytes: int
    pages: int
    store_s: float
    bare_s: float
    hash_s: float = 0.0  # the check alone, one thread, each page in this core's cache
    threads: int = 1  # the threads the core verifies with

    @property
    def floor(self) -> float:
        """The share verification costs when ``threads`` cores read and hash the pages."""
        spread = self.hash_s / self.threads
        return spread / (self.bare_s + spread) if self.hash_s else 0.0

    @property
    def share(self) -> float:
        return (self.store_s - self.bare_s) / self.store_s

    def row(self) -> str:
        gb = self.page_bytes * self.pages / 1e9
        return (f"{self.page_bytes >> 10:>6} KiB x {self.pages:<4} | store {gb / self.store_s:6.2f} GB/s | "
                f"bare {gb / self.bare_s:6.2f} GB/s | verification {self.share * 100:5.1f}% of page_get | "
                f"hash alone {gb / self.hash_s:6.2f} GB/s a thread: floor {self.floor * 100:4.1f}% with {self.threads} "
                f"thread(s)")


def _pages(region: bytearray, groups: list[str], namespace: str, page_bytes: int) -> list[Page]:
    whole = Buffer.of(region)
    return [
        Page(make_key(g, namespace), g, namespace, (Buffer(whole.ptr + i * page_bytes, page_bytes, owner=whole),))
        for i, g in enumerate(groups)
    ]


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
        timed: dict[str, list[float]] = {"store": [], "bare": [], "hash": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))])
            timed["store"].append(time.perf_counter() - t0)
            if any(r is not PageResult.OK for r in got[PoolKind.KV]):
                raise RuntimeError("a verified read failed; the benchmark needs a healthy store")
            t0 = time.perf_counter()
            bare = [PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))]
            transfers = store.attach_headers(bare, made=False)
            deadline = time.monotonic() + store.timeout_s
            status, _, _ = store._call("page_get", {  # the store's own bounded call, nothing verified
                "transfers": transfers, "deadline": deadline, "finished": lambda pool, idx: None,
                "read_records": _unchecked_reader(transfers),
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
        return VerificationCost(page_bytes, pages, *(statistics.median(timed[k]) for k in ("store", "bare", "hash")),
                                threads=_VERIFY_WORKERS)
    finally:
        store.close()
