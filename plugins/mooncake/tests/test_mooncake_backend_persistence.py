"""Persistence across a restart of the serving process while the store runs: pages written by one
process are read back byte-exact by a new backend instance in another process, and vice versa."""

import hashlib
import json
import subprocess
import sys
import textwrap

from hicache_draft import Attention, PageResult, PoolKind, Store

from .conftest import make_rig

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from hicache_draft import Attention, Layout, PoolKind, Store
    from hicache_draft.keys import make_key
    from hicache_draft.pools import HostPool, PoolSpec
    from hicache_draft.transfer import Page, PageTransfer

    args = json.loads(sys.argv[1])
    store = Store.open("mooncake", args["options"])
    out = {}
    for kind in ("kv", "draft"):
        att = Attention(args["attention"][kind])
        spec = PoolSpec(kind=PoolKind(kind), attention=att, layers=2, page_size=4, dtype=torch.bfloat16,
                        layout=Layout.PAGE_FIRST, kv_heads=4, head_dim=8, latent_dim=16)
        pool = HostPool(spec, 4)
        ns = args["namespaces"][kind]
        pages = [Page(make_key(g, ns), g, ns, pool.page_buffers(i * 4)) for i, g in enumerate(args["groups"])]
        if args["mode"] == "write":
            pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8))
            res = store.page_set([PageTransfer(PoolKind(kind), pages, True)])[PoolKind(kind)]
        else:
            res = store.page_get([PageTransfer(PoolKind(kind), pages, True)])[0][PoolKind(kind)]
        out[kind] = {"results": [int(r) for r in res],
                     "digests": [hashlib.sha256(pool.page_bytes(i * 4)).hexdigest() for i in range(len(pages))]}
    store.close()
    print("RESULT " + json.dumps(out))
    """
)


def _child(args: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _rigs():
    return {PoolKind.KV: make_rig(PoolKind.KV, Attention.MHA), PoolKind.DRAFT: make_rig(PoolKind.DRAFT, Attention.MLA)}


def _args(mode, options, rigs, groups):
    return {
        "mode": mode, "options": options, "groups": groups,
        "attention": {k.value: r.attention.value for k, r in rigs.items()},
        "namespaces": {k.value: r.namespaces[0] for k, r in rigs.items()},
    }


def test_pages_written_by_another_process_come_back(mooncake_options, new_groups):
    rigs, g = _rigs(), new_groups(3)
    wrote = _child(_args("write", mooncake_options, rigs, g))
    assert all(v["results"] == [0, 0, 0] for v in wrote.values())
    store = Store.open("mooncake", mooncake_options)
    try:
        got, _ = store.page_get([r.transfer(r.pages(g, [0, 1, 2])) for r in rigs.values()])
        for kind, r in rigs.items():
            assert got[kind] == [PageResult.OK] * 3
            assert [hashlib.sha256(r.page_bytes(i)).hexdigest() for i in range(3)] == wrote[kind.value]["digests"]
    finally:
        store.close()


def test_pages_written_here_come_back_in_a_new_process(mooncake_options, new_groups):
    rigs, g = _rigs(), new_groups(3)
    store = Store.open("mooncake", mooncake_options)
    try:
        for r in rigs.values():
            r.fill_random()
        res = store.page_set([r.transfer(r.pages(g, [0, 1, 2])) for r in rigs.values()])
        assert all(v == [PageResult.OK] * 3 for v in res.values())
    finally:
        store.close()
    read = _child(_args("read", mooncake_options, rigs, g))
    for kind, r in rigs.items():
        assert read[kind.value]["results"] == [0, 0, 0]
        assert read[kind.value]["digests"] == [hashlib.sha256(r.page_bytes(i)).hexdigest() for i in range(3)]
