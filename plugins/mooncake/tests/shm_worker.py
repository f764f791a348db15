"""A shared-memory client process for test_two_shm_processes_recover_after_holder_restart.

``python shm_worker.py MASTER HOLDER BOUND_S``: opens the mooncake backend in shared-memory mode
with host pools in the holder's shared memory, proves one round trip, prints READY, waits for GO
on stdin (the holder restarts meanwhile), then retries round trips for at most BOUND_S seconds and
prints RECOVERED <seconds> or FAILED. Prints WRONG if a page reported OK ever differs.
"""

import select
import sys
import time

from conftest import groups, host_allocator, make_rig  # this directory is sys.path[0]

from hicache_draft import PageResult, PoolKind, Store


def main() -> None:
    master, holder, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
    store = Store.open("mooncake", {
        "master_server_address": master, "shm_client_address": holder, "shm_pool_size": 16 << 20,
        "retry_interval_s": 0.3,
    })
    alloc = host_allocator(store)
    w, r = make_rig(allocator=alloc), make_rig(allocator=alloc)
    for rig in (w, r):
        store.register_pool(rig.registration())
    w.fill_random()

    def round_trip() -> bool:
        g = groups(2)
        put = store.page_set([w.transfer(w.pages(g, [0, 1]))])[PoolKind.KV]
        got = store.page_get([r.transfer(r.pages(g, [2, 3]))])[0][PoolKind.KV]
        for res, (src, dst) in zip(got, ((0, 2), (1, 3)), strict=True):
            if res is PageResult.OK and r.page_bytes(dst) != w.page_bytes(src):
                print("WRONG", flush=True)
        if store.corrupt_pages:
            print("WRONG", flush=True)
        return put == [PageResult.OK] * 2 and got == [PageResult.OK] * 2

    try:
        if not round_trip():
            print("FAILED first round trip", flush=True)
            return
        print("READY", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], bound)
        if not ready or sys.stdin.readline().strip() != "GO":
            print("FAILED no GO", flush=True)
            return
        start = time.monotonic()
        while time.monotonic() - start < bound:
            if round_trip():
                print(f"RECOVERED {time.monotonic() - start:.1f}", flush=True)
                return
            time.sleep(0.2)
        print("FAILED", flush=True)
    finally:
        store.close()


if __name__ == "__main__":
    main()
