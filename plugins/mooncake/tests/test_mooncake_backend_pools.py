"""Open pools on a real Mooncake store across a restart: indexer, window and state pages (target
and draft roles) written by one process come back byte-exact in a new process, each pool under
its own keys, built and registered through the core's pool binding (the kit's rigs)."""

import json
import subprocess
import sys
import textwrap

from hicache_draft import PageResult

POOLS = ["indexer", "draft_indexer", "swa", "draft_swa", "mamba", "draft_mamba"]

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from hicache_draft import Attention, Layout, Store
    from hicache_draft.testing import KIT_POOLS, Case, PoolRig, make_spec

    args = json.loads(sys.argv[1])
    store = Store.open("mooncake", args["options"])
    torch.manual_seed(args["seed"])  # the writer's pools, made again by the reader to compare
    out = {}
    for name in args["pools"]:
        kp = next(p for p in KIT_POOLS if p.name == name)
        att = Attention.MHA if kp.component.has_attention else None
        case = Case(kp, make_spec(kp, att, Layout.PAGE_FIRST), True)
        want = PoolRig(case, store.capabilities)
        rig = want if args["mode"] == "write" else PoolRig(case, store.capabilities, fill=False)
        assert rig.binding.path.value == "zero_copy", rig.binding.reason  # declared, so planned
        rig.register(store)
        batch = rig.batch(args["groups"], [0, 1, 2], fill=True)
        if args["mode"] == "write":
            res = store.page_set([batch.transfer])[rig.pool]
        else:
            res = store.page_get([batch.transfer])[0][rig.pool]
            rig.binding.finish_get(batch, res)
        out[name] = {
            "results": [int(r) for r in res],
            "same": [rig.host_bytes(i) == want.host_bytes(i) for i in range(3)],
            "keys": rig.keys(args["groups"]),
        }
    store.close()
    print("RESULT " + json.dumps(out))
    """
)


def _child(mode: str, options: dict, groups: list[str], seed: int) -> dict:
    args = {"mode": mode, "options": options, "groups": groups, "seed": seed, "pools": POOLS}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_indexer_window_and_state_pages_come_back_in_a_new_process(mooncake_options, new_groups):
    g = new_groups(3)
    wrote = _child("write", mooncake_options, g, seed=14)
    assert all(v["results"] == [PageResult.OK] * 3 for v in wrote.values()), wrote
    read = _child("read", mooncake_options, g, seed=14)
    for name in POOLS:
        assert read[name]["results"] == [PageResult.OK] * 3, (name, read[name])
        assert read[name]["same"] == [True] * 3, f"{name}: bytes differ after the restart"
    keys = [k for v in read.values() for k in v["keys"]]
    assert len(set(keys)) == len(keys)  # every pool of the prefix under keys of its own
