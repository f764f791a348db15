"""A writer process for the file backend tests (run as a script, not collected by pytest).

usage: file_backend_child.py ROOT TAG FIRST COUNT PAGE_BYTES GROUPS_PER_CALL [MAX_BYTES]

Writes groups FIRST..FIRST+COUNT-1 of tag TAG (target and draft pages of a group in one call,
payloads derived from the keys), GROUPS_PER_CALL groups per call; COUNT < 0 loops for ever
(a write storm) over increasing group numbers. Prints "wrote N" after each call.
"""

from __future__ import annotations

import hashlib
import itertools
import sys

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store

NS = {PoolKind.KV: "a1" * 12, PoolKind.DRAFT: "d2" * 12}


def main() -> None:
    root, tag, first, count, n, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5]), int(sys.argv[6])
    opts: dict[str, object] = {"root": root}
    if len(sys.argv) > 7:
        opts["max_bytes"] = int(sys.argv[7])
    store = Store.open("file", opts)
    numbers = itertools.count(first) if count < 0 else iter(range(first, first + count))
    done = 0
    while True:
        batch = list(itertools.islice(numbers, per))
        if not batch:
            break
        groups = [f"{tag:08x}{i:056x}" for i in batch]
        transfers = []
        for pool in (PoolKind.KV, PoolKind.DRAFT):
            pages = []
            for g in groups:
                key = f"{g}.{NS[pool]}"
                data = bytearray(hashlib.shake_256(key.encode()).digest(n))
                pages.append(Page(key=key, group=g, namespace=NS[pool], buffers=(Buffer.of(data),)))
            transfers.append(PageTransfer(pool, pages))
        res = store.page_set(transfers, timeout_s=60)
        if any(r is not PageResult.OK for rs in res.values() for r in rs):
            print(f"failed {res}", flush=True)
            sys.exit(3)
        done += len(batch)
        print(f"wrote {done}", flush=True)
    store.close()


if __name__ == "__main__":
    main()
