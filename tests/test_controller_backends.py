"""The controller over the real backends of this repository (file, sqlite example, Mooncake store).

For every target/draft attention combination: `check` and the controller agree on the paths, and a
backup in one controller is restored byte-exact for both pools by a fresh controller (a restarted
server) through the same storage. A draft page that the store lost shortens the hit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import pytest

from hicache_draft import PageResult, PoolKind, page_hashes
from hicache_draft.cli import check_report
from hicache_draft.controller import CacheController
from tests.helpers import PS, fill_random, make_config, slots, tokens

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
COMBOS = [("mha", "mha", "page_first"), ("mha", "mla", "layer_first"), ("mla", "mha", "page_first_direct"),
          ("mla", "mla", "layer_first")]


@pytest.fixture(params=["file", "sqlite", "mooncake"])
def backend(request, tmp_path):
    if request.param == "file":
        return "file", {"root": str(tmp_path / "file-root")}
    if request.param == "sqlite":
        return "sqlite", {"path": str(tmp_path / "pages.sqlite")}
    return "mooncake", request.getfixturevalue("mooncake_options")


def _controller(backend, **kw) -> CacheController:
    name, options = backend
    cfg = make_config(backend=name, backend_options=options, **kw)
    return CacheController.from_config(cfg, num_pages=16)


@pytest.mark.parametrize(("target", "draft", "layout"), COMBOS)
def test_restart_restores_both_pools_byte_exact(backend, target, draft, layout):
    writer = _controller(backend, target=target, draft=draft, layout=layout)
    try:
        report = check_report(writer.config)
        assert {k: {"path": v["path"], "reason": v["reason"]} for k, v in report["pools"].items()} == {
            k.value: writer.plan[k].as_dict() for k in PoolKind}
        fill_random(writer)
        toks = tokens(5, seed=zlib.crc32(f"{target}{draft}{layout}{backend[0]}".encode()) % 1000)
        assert writer.backup(toks, slots(range(5))).pages_written == {KV: 5, DRAFT: 5}
        reader = _controller(backend, target=target, draft=draft, layout=layout)
        try:
            res = reader.prefetch(toks, slots(range(8, 13)))
            assert (res.pages, res.restored, res.draft_cold) == (5, {KV: 5, DRAFT: 5}, [])
            for a, b in zip(slots(range(5)), slots(range(8, 13)), strict=True):
                assert writer.target_pool.page_bytes(a) == reader.target_pool.page_bytes(b)
                assert writer.draft_pool.page_bytes(a) == reader.draft_pool.page_bytes(b)
            other = reader.prefetch(tokens(5, seed=4242), slots(range(8, 13)))
            assert other.pages == 0
        finally:
            reader.close()
    finally:
        writer.close()


def _write_one_pool(ctrl: CacheController, pool: PoolKind, toks: list[int], pages: range) -> None:
    """Store only ``pool``'s pages (as if the other pool's write had failed), with the controller's keys."""
    hashes = page_hashes(toks, PS)
    batch = ctrl.bindings[pool].slot_batch([hashes[i] for i in pages], slots(pages), fill=True)
    res = ctrl.store.page_set([batch.transfer])
    assert res[pool] == [PageResult.OK] * len(pages)


@pytest.mark.parametrize("on_miss", ["shorten", "target_only"])
def test_hit_rules_on_a_real_store(backend, on_miss):
    """Target pages 0-3 stored, draft pages 0-1 only: shorten restores 2 pages, target_only 4 with 2 draft-cold.
    Draft pages without their target are never restored."""
    writer = _controller(backend, on_miss=on_miss)
    reader = _controller(backend, on_miss=on_miss)
    try:
        fill_random(writer)
        toks = tokens(6, seed=99 if on_miss == "shorten" else 98)
        _write_one_pool(writer, KV, toks, range(4))
        _write_one_pool(writer, DRAFT, toks, range(2))
        _write_one_pool(writer, DRAFT, toks, range(4, 6))  # draft beyond the target: never restored
        res = reader.prefetch(toks, slots(range(8, 14)))
        if on_miss == "shorten":
            assert (res.pages, res.restored, res.draft_cold) == (2, {KV: 2, DRAFT: 2}, [])
        else:
            assert (res.pages, res.restored, res.draft_cold) == (4, {KV: 4, DRAFT: 2}, [2, 3])
        for a, b in zip(slots(range(res.pages)), slots(range(8, 8 + res.pages)), strict=True):
            assert writer.target_pool.page_bytes(a) == reader.target_pool.page_bytes(b)
        for a, b in zip(slots(range(2)), slots(range(8, 10)), strict=True):
            assert writer.draft_pool.page_bytes(a) == reader.draft_pool.page_bytes(b)
    finally:
        reader.close()
        writer.close()


def test_restore_in_a_new_process(backend, tmp_path):
    """A real restart: the reader is another Python process."""
    name, options = backend
    writer = _controller(backend, target="mla", draft="mha", layout="page_first")
    fill_random(writer)
    toks = tokens(3, seed=11)
    writer.backup(toks, slots(range(3)))
    expect = [(writer.target_pool.page_bytes(s).hex(), writer.draft_pool.page_bytes(s).hex()) for s in slots(range(3))]
    writer.close()
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.helpers import make_config, slots, tokens
        from hicache_draft.controller import CacheController
        cfg = make_config(target="mla", draft="mha", layout="page_first", backend={name!r},
                          backend_options={options!r})
        c = CacheController.from_config(cfg, num_pages=16)
        r = c.prefetch(tokens(3, seed=11), slots(range(4, 7)))
        out = [(c.target_pool.page_bytes(s).hex(), c.draft_pool.page_bytes(s).hex()) for s in slots(range(4, 7))]
        print(json.dumps({{"pages": r.pages, "bytes": out}}))
        c.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["pages"] == 3
    assert [tuple(x) for x in got["bytes"]] == expect
