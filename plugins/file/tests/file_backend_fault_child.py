"""A process that dies at a chosen point of the file backend (run as a script, not collected).

usage: file_backend_fault_child.py MODE ROOT [ARGS...]

  evict-kill ROOT PAGE   store groups whose draft and target pages sit in different segments
                         (draft call first, then target, as SGLang does), then fill the store
                         until eviction; SIGKILL itself right after eviction removed its first
                         segment file.
  compact-kill ROOT      write until the journal is compacted; SIGKILL itself just before the
                         new journal is renamed in.
  write-kill ROOT PAGE   SIGKILL itself in the middle of writing a segment.
  stress ROOT TAG THREADS PAGE MAX_BYTES
                         THREADS threads write groups for ever (the draft call, then the target
                         call, two groups per call); prints "ok TAG THREAD FIRST N" once both
                         calls of groups FIRST..FIRST+N-1 were acknowledged.

Faults are placed by wrapping the ``os`` module the backend modules see (a proxy), so the same
child runs against older versions of the backend for the fails-first checks.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import hicache_draft_file.backend as backend_mod
import hicache_draft_file.journal as journal_mod
import hicache_draft_file.segment_writer as writer_mod

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store

NS = {PoolKind.KV: "a1" * 12, PoolKind.DRAFT: "d2" * 12}


class OsProxy:
    """``os`` with some functions wrapped."""

    def __init__(self, **wrapped: Callable[..., Any]) -> None:
        self._wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        return self._wrapped.get(name) or getattr(os, name)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def group(i: int, tag: int) -> str:
    return f"{tag:08x}{i:056x}"


def transfer(pool: PoolKind, groups: list[str], n: int) -> PageTransfer:
    pages = []
    for g in groups:
        key = f"{g}.{NS[pool]}"
        data = bytearray(hashlib.shake_256(key.encode()).digest(n))
        pages.append(Page(key=key, group=g, namespace=NS[pool], buffers=(Buffer.of(data),)))
    return PageTransfer(pool, pages)


def ok(res: dict[PoolKind, list[PageResult]]) -> bool:
    return all(r is PageResult.OK for rs in res.values() for r in rs)


def evict_kill(root: str, n: int) -> None:
    seg_bytes = 8 * (n + 64) + 4096
    store = Store.open("file", {"root": root, "max_bytes": 6 * seg_bytes, "io_threads": 1})
    split = [group(i, 7) for i in range(8)]
    assert ok(store.page_set([transfer(PoolKind.DRAFT, split, n)]))
    assert ok(store.page_set([transfer(PoolKind.KV, split, n)]))
    print("split stored", flush=True)

    def rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        os.rename(src, dst, *a, **kw)
        if str(src).endswith(".seg"):
            die()

    def unlink(path: Any, *a: Any, **kw: Any) -> None:
        os.unlink(path, *a, **kw)
        if str(path).endswith(".seg"):
            die()

    backend_mod.os = OsProxy(rename=rename, unlink=unlink)  # type: ignore[assignment]
    for call in range(100):
        store.page_set([transfer(p, [group(i, 100 + call) for i in range(8)], n) for p in PoolKind])
    print("no eviction happened", flush=True)
    sys.exit(3)


def compact_kill(root: str) -> None:
    store = Store.open("file", {"root": root, "journal_max_records": 16, "io_threads": 1})

    def rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        if str(src).endswith(".new"):
            die()
        os.rename(src, dst, *a, **kw)

    journal_mod.os = OsProxy(rename=rename)  # type: ignore[assignment]
    for call in range(40):
        store.page_set([transfer(PoolKind.KV, [group(call, 3)], 1024)])
    print("no compaction happened", flush=True)
    sys.exit(3)


def write_kill(root: str, n: int) -> None:
    store = Store.open("file", {"root": root, "io_threads": 1})
    real = writer_mod.write_from

    def write_from(fd: int, *a: Any, **kw: Any) -> int:
        if os.fstat(fd).st_size >= n:  # the file has been started (preallocated, or a first chunk)
            real(fd, *a, **kw)
            die()
        return real(fd, *a, **kw)

    writer_mod.write_from = write_from  # type: ignore[assignment]
    store.page_set([transfer(p, [group(i, 4) for i in range(8)], n) for p in PoolKind])
    print("not killed", flush=True)
    sys.exit(3)


def stress(root: str, tag: int, threads: int, n: int, max_bytes: int) -> None:
    store = Store.open("file", {"root": root, "max_bytes": max_bytes, "journal_max_records": 16})
    out = threading.Lock()

    def run(t: int) -> None:
        i = 0
        while True:
            groups = [group(i + j, tag * 16 + t) for j in range(2)]
            if ok(store.page_set([transfer(PoolKind.DRAFT, groups, n)], timeout_s=60)) and ok(
                store.page_set([transfer(PoolKind.KV, groups, n)], timeout_s=60)
            ):
                with out:
                    print(f"ok {tag} {t} {i} 2", flush=True)
            i += 2

    workers = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main() -> None:
    mode, root, *args = sys.argv[1:]
    if mode == "evict-kill":
        evict_kill(root, int(args[0]))
    elif mode == "compact-kill":
        compact_kill(root)
    elif mode == "write-kill":
        write_kill(root, int(args[0]))
    elif mode == "stress":
        stress(root, int(args[0]), int(args[1]), int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
