"""What the core's verification of restored pages costs, on a real backend.

Every round stores nothing new: it reads the same ``pages`` pages of ``page_bytes`` each twice,
back to back, into the same destination memory:

* ``store``: :meth:`hicache_draft.Store.page_get`, as the controller and the SGLang adapter call
  it: headers handed out, every page verified (early where the backend reports pages finished);
* ``bare``: the backend's own ``page_get`` hook with the same headers and nothing verified.

The ratio ``(store - bare) / store`` is the share of ``page_get`` time the verification costs.
Medians over ``rounds``; the two variants alternate so that drift hits both.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache_draft.capabilities import PoolKind
from hicache_draft.keys import make_key
from hicache_draft.store import Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer


@dataclass(frozen=True)
class VerificationCost:
    page_bytes: int
    pages: int
    store_s: float
    bare_s: float

    @property
    def share(self) -> float:
        return (self.store_s - self.bare_s) / self.store_s

    def row(self) -> str:
        gb = self.page_bytes * self.pages / 1e9
        return (f"{self.page_bytes >> 10:>6} KiB x {self.pages:<4} | store {gb / self.store_s:6.2f} GB/s | "
                f"bare {gb / self.bare_s:6.2f} GB/s | verification {self.share * 100:5.1f}% of page_get")


def _pages(region: bytearray, groups: list[str], namespace: str, page_bytes: int) -> list[Page]:
    whole = Buffer.of(region)
    return [
        Page(make_key(g, namespace), g, namespace, (Buffer(whole.ptr + i * page_bytes, page_bytes, owner=whole),))
        for i, g in enumerate(groups)
    ]


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
        timed: dict[str, list[float]] = {"store": [], "bare": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            got, _ = store.page_get([PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))])
            timed["store"].append(time.perf_counter() - t0)
            if any(r is not PageResult.OK for r in got[PoolKind.KV]):
                raise RuntimeError("a verified read failed; the benchmark needs a healthy store")
            t0 = time.perf_counter()
            bare = [PageTransfer(PoolKind.KV, _pages(dst, groups, namespace, page_bytes))]
            transfers = store.attach_headers(bare, made=False)
            store.pm.hook.page_get(
                transfers=transfers, deadline=time.monotonic() + store.timeout_s, finished=lambda pool, idx: None,
                read_records=None,
            )
            timed["bare"].append(time.perf_counter() - t0)
        if dst != src:
            raise RuntimeError("the pages read back differ from the pages stored")
        return VerificationCost(page_bytes, pages, statistics.median(timed["store"]), statistics.median(timed["bare"]))
    finally:
        store.close()
