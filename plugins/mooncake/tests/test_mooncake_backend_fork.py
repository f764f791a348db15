"""A forked child of a process with a Mooncake store: the connection is the parent's, so every call
in the child fails at once (nothing is sent through it), a store of its own is refused at once (one
hung in setup), and the parent's calls go on unharmed. A child that used the parent's connection
broke the parent's next call (RPC replies read by the wrong process), or crashed it."""

from __future__ import annotations

import time

from hicache_draft import BackendSetupError, PageResult, PoolKind, Store
from hicache_draft.testing import CHILD_OK, in_forked_child

from .conftest import make_rig

OK, FAILED = PageResult.OK, PageResult.FAILED


def test_a_forked_child_never_uses_the_parents_connection(open_store, new_groups, mooncake_service) -> None:
    store = open_store()
    w = make_rig(PoolKind.KV, model="m-fork")
    r = make_rig(PoolKind.KV, model="m-fork")
    for rig in (w, r):
        store.register_pool(rig.registration())
    w.fill_random()
    kept = new_groups(3)
    assert store.page_set([w.transfer(w.pages(kept, [0, 2, 5]))]) == {PoolKind.KV: [OK] * 3}

    def child() -> bool:
        t0 = time.monotonic()
        stored = store.page_set([w.transfer(w.pages(new_groups(2), [1, 3]))])
        got, _ = store.page_get([r.transfer(r.pages(kept, [1, 3, 7]))])
        found = store.page_exists({PoolKind.KV: [p.key for p in r.pages(kept, [1, 3, 7])]})
        try:
            store.register_pool(make_rig(PoolKind.KV, model="m-fork-child").registration())
            refused = ""
        except BackendSetupError as exc:
            refused = str(exc)
        try:  # a client of its own hung in setup: refused at once, saying how to do it instead
            Store.open("mooncake", mooncake_service.backend_options(shm=False)).close()
            reopened = "opened"
        except BackendSetupError as exc:
            reopened = str(exc)
        store.close()
        return (
            stored == {PoolKind.KV: [FAILED] * 2} and got == {PoolKind.KV: [FAILED] * 3}
            and found == {PoolKind.KV: 0} and "fork" in refused and "forked" in reopened and "spawn" in reopened
            and time.monotonic() - t0 < 3.0
        )

    assert in_forked_child(child, timeout_s=120) == CHILD_OK
    got, _ = store.page_get([r.transfer(r.pages(kept, [1, 3, 7]))])  # the parent's connection still works
    assert got == {PoolKind.KV: [OK] * 3}
    for src, dst in ((0, 1), (2, 3), (5, 7)):
        assert r.page_bytes(dst) == w.page_bytes(src)
    assert store.page_set([w.transfer(w.pages(new_groups(2), [1, 3]))]) == {PoolKind.KV: [OK] * 2}

