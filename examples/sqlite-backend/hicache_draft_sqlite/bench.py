"""Throughput of the sqlite backend next to a baseline measured in the same run.

    python -m hicache_draft_sqlite.bench [--pages 256] [--page-kib 256] [--batch 64]

The baseline is hicache-draft's in-memory test backend behind the same :class:`~hicache_draft.Store`
(page format, checksums and bounded calls included), so the ratios show what SQLite itself costs.
Numbers vary with the machine and its load; compare ratios, not absolute values.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from collections.abc import Callable

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store, make_key, register_backend


def _pages(groups: list[str], namespace: str, page_bytes: int, fill: bool) -> list[Page]:
    out = []
    for g in groups:
        data = bytearray(os.urandom(page_bytes)) if fill else bytearray(page_bytes)
        out.append(Page(make_key(g, namespace), g, namespace, (Buffer.of(data),)))
    return out


def _run(store: Store, groups: list[str], page_bytes: int, batch: int) -> tuple[float, float]:
    ns = secrets.token_hex(12)
    src = _pages(groups, ns, page_bytes, fill=True)
    dst = _pages(groups, ns, page_bytes, fill=False)
    t0 = time.perf_counter()
    for i in range(0, len(src), batch):
        res = store.page_set([PageTransfer(PoolKind.KV, src[i : i + batch])], timeout_s=600)
        assert all(r == PageResult.OK for r in res[PoolKind.KV]), res
    t1 = time.perf_counter()
    for i in range(0, len(dst), batch):
        res, _ = store.page_get([PageTransfer(PoolKind.KV, dst[i : i + batch])], timeout_s=600)
        assert all(r == PageResult.OK for r in res[PoolKind.KV]), res
    t2 = time.perf_counter()
    assert all(bytes(a.buffers[0].view()) == bytes(b.buffers[0].view()) for a, b in zip(src, dst, strict=True))
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    page_bytes = args.page_kib << 10
    mib = args.pages * page_bytes / (1 << 20)
    from hicache_draft.testing import MemoryBackend  # the kit's reference backend, as the baseline

    register_backend("bench-memory", MemoryBackend)
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, Callable[[], Store]] = {
            "memory (baseline)": lambda: Store.open("bench-memory", {"space": secrets.token_hex(4)}),
            "sqlite synchronous=normal": lambda: Store.open("sqlite", {"path": f"{tmp}/normal.db"}),
            "sqlite synchronous=off": lambda: Store.open("sqlite", {"path": f"{tmp}/off.db", "synchronous": "off"}),
        }
        for name, factory in runs.items():
            with factory() as store:
                results[name] = _run(store, [secrets.token_hex(32) for _ in range(args.pages)], page_bytes, args.batch)
    base_set, base_get = results["memory (baseline)"]
    print(f"{args.pages} pages x {args.page_kib} KiB = {mib:.0f} MiB, batches of {args.batch}")
    print(f"{'backend':28} {'set MiB/s':>10} {'get MiB/s':>10} {'set vs base':>12} {'get vs base':>12}")
    for name, (s, g) in results.items():
        print(f"{name:28} {mib / s:10.0f} {mib / g:10.0f} {base_set / s:11.2f}x {base_get / g:11.2f}x")


if __name__ == "__main__":
    main()
