"""The adapter driven by SGLang's own controllers, host pools and storage threads (see harness.py).

Every round trip is a simulated restart: one rig (SGLang's pools, controller, adapter) backs pages
up through SGLang's backup thread and is closed; a fresh rig (fresh pools, fresh adapter, same
store) restores them through SGLang's prefetch threads; KV and DRAFT bytes are compared with
``get_data_page`` of SGLang's own host pools.
"""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path

import harness as h
import pytest
import torch

from hicache_draft import PoolKind

pytestmark = pytest.mark.usefixtures("memory_backend")

smoke = pytest.mark.smoke
HYBRID_MODES = ["hybrid", "legacy"] if h.HAS_LEGACY_DRAFT else ["hybrid"]
MHA_T, MHA_D = h.Shape("mha", 3), h.Shape("mha", 1)
MLA_T, MLA_D = h.Shape("mla", 3), h.Shape("mla", 1)
README = Path(__file__).resolve().parents[2] / "README.md"


def extra_for(mode, root, draft, *, layout=None, **kw):
    legacy = h.legacy_draft_shape(draft, layout) if mode == "legacy" and draft is not None else None
    return h.extra_config(str(root), legacy_draft=legacy, **kw)


# -- round trips -------------------------------------------------------------------------------------

PAIRS = [(MHA_T, MHA_D), (MLA_T, MLA_D), (MLA_T, MHA_D), (MHA_T, MLA_D)]
CASES = [(t, d, lay) for t, d in PAIRS for lay in (h.MHA_LAYOUTS if t.attention == "mha" else h.MLA_LAYOUTS)]


def _id(case):
    t, d, lay = case
    return f"{t.attention}+{d.attention}-{lay}"


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("mode", HYBRID_MODES)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_round_trip_after_restart_is_byte_exact(tmp_path, rigs, case, mode, v1):
    target, draft, layout = case
    extra = extra_for(mode, tmp_path / "kv", draft, layout=None if draft.attention == target.attention
                      else "page_first", interface_v1=v1)
    hit, done, before, after, _ = h.round_trip(rigs, target, draft, layout, extra, mode=mode)
    assert (hit, done) == (20, 20)
    assert after == before  # KV and DRAFT, every page


SMOKE = [(MHA_T, MHA_D, "page_first"), (MLA_T, MLA_D, "page_first_direct"), (MLA_T, MHA_D, "layer_first")]


@smoke
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("case", SMOKE, ids=[_id(c) for c in SMOKE])
def test_smoke_round_trip(tmp_path, rigs, case, v1):
    target, draft, layout = case
    extra = h.extra_config(str(tmp_path / "kv"), interface_v1=v1)
    hit, done, before, after, _ = h.round_trip(rigs, target, draft, layout, extra)
    assert (hit, done) == (20, 20) and after == before


@smoke
def test_host_pools_build_on_a_machine_with_less_than_sglangs_10_gib_reserve_free(monkeypatch):
    """SGLang refuses a host pool unless 10 GiB stay available beyond it (a serving host's reserve):
    the bootstrap runs the cases without it, so a shared CPU box with 1 GiB free still builds the
    cases' pools of a few KiB; a pool larger than what is available is still refused."""
    import psutil

    real = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 30))
    pool = h.host_pool(h.device_pool(MHA_T, 64, 4), "page_first")
    assert pool.kv_buffer.numel() > 0
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=1 << 10))
    with pytest.raises(ValueError, match="[Nn]ot enough host memory"):
        h.host_pool(h.device_pool(MHA_T, 64, 4), "page_first")


@smoke
@pytest.mark.parametrize("mode", HYBRID_MODES)
def test_a_backup_longer_than_sglangs_storage_batch(tmp_path, rigs, mode):
    pages = h.STORAGE_BATCH_SIZE + 3
    extra = extra_for(mode, tmp_path / "kv", MHA_D)
    hit, done, before, after, _ = h.round_trip(rigs, MHA_T, MHA_D, "page_first", extra, mode=mode, pages=pages,
                                               page_size=2, device_tokens=2 * pages + 8)
    assert (hit, done) == (2 * pages, 2 * pages)
    assert after == before


@smoke
def test_detach_and_reattach_keeps_serving(tmp_path, rigs):
    extra = h.extra_config(str(tmp_path / "kv"))
    rig = rigs(MHA_T, MHA_D, "page_first", extra)
    for n, pool in enumerate(rig.pools):
        h.fill_random(pool.host, 7 + n)
    toks = h.tokens(3, salt=7)
    src = rig.alloc(3)
    assert rig.backup(toks, src) == 12
    first = rig.adapter
    rig.detach()
    assert rig.controller.storage_backend is None
    rig.attach()
    assert rig.adapter is not first and rig.threads_alive()
    assert set(rig.adapter.bindings) == set(first.bindings)  # KV and DRAFT registered again
    hit, dst, done = rig.prefetch(toks)
    assert (hit, done) == (12, 12)
    for pool in rig.pools:
        assert [h.page_bytes(pool.host, int(i)) for i in dst[::4]] == [h.page_bytes(pool.host, int(i))
                                                                       for i in src[::4]]


def test_split_heads_share_pages_across_tp_sizes(rigs):
    """tp_size 2 (tp_lcm_size 4, page_head) writes head groups that tp_size 4 ranks read."""
    space = secrets.token_hex(4)
    extra = h.extra_config("", backend="memory", options={"space": space})
    extra["tp_lcm_size"] = 4
    wshape = h.Shape("mha", 2, heads=4)
    writer = rigs(wshape, None, "page_head", dict(extra), tp_rank=1, tp_size=2)
    assert writer.controller.storage_config.should_split_heads is True
    h.fill_random(writer.kv.host, 11)
    toks = h.tokens(2, salt=11)
    src = writer.alloc(2)
    assert writer.backup(toks, src) == 8
    wbuf = writer.kv.host.kv_buffer  # (2, pages, heads, page_size, layers, head_dim)
    for rank, heads in ((2, slice(0, 2)), (3, slice(2, 4))):
        reader = rigs(h.Shape("mha", 2, heads=2), None, "page_head", dict(extra), tp_rank=rank, tp_size=4)
        assert reader.controller.storage_config.should_split_heads is False  # tp_lcm_size == tp_size
        hit, dst, done = reader.prefetch(toks)
        assert (hit, done) == (8, 8)
        for s, d in zip(src[::4].tolist(), dst[::4].tolist(), strict=True):
            got = reader.kv.host.kv_buffer[:, d // 4].contiguous().view(torch.uint8)
            want = wbuf[:, s // 4, heads].contiguous().view(torch.uint8)
            assert torch.equal(got, want)
    other = rigs(h.Shape("mha", 2, heads=2), None, "page_head", dict(extra), tp_rank=0, tp_size=4)
    assert other.prefetch(toks)[0] == 0  # global heads 0..1 were never written


# -- hits --------------------------------------------------------------------------------------------


def _store_partial(rig, toks, kv_pages, draft_pages):
    """Write target pages ``kv_pages`` and draft pages ``draft_pages`` through the adapter."""
    keys = h.page_hashes(toks, rig.page_size)
    for i in kv_pages:
        idx = torch.arange(i * 4, i * 4 + 4)
        assert rig.adapter.batch_set_v1([keys[i]], idx) == [True]
    for i in draft_pages:
        idx = torch.arange(i * 4, i * 4 + 4)
        if rig.mode == "legacy":
            assert rig.adapter.batch_set([f"{keys[i]}.draft"], [rig.pools[1].host.get_data_page(i * 4)]) is True
        else:
            t = h.PoolTransfer(name=h.PoolName.DRAFT, host_indices=idx, keys=[keys[i]])
            assert rig.adapter.batch_set_v2([t]) == {h.PoolName.DRAFT: [True]}


@smoke
@pytest.mark.parametrize("mode", HYBRID_MODES)
def test_sglangs_hit_is_shortened_to_the_stored_draft_prefix(tmp_path, rigs, mode):
    """Draft stored for 2 of 6 pages: SGLang restores 2, never 6 with 4 stale draft pages."""
    extra = extra_for(mode, tmp_path / "kv", MHA_D)
    rig = rigs(MHA_T, MHA_D, "page_first", extra, mode=mode)
    for n, pool in enumerate(rig.pools):
        h.fill_random(pool.host, 3 + n)
    toks = h.tokens(6, salt=3)
    _store_partial(rig, toks, range(6), [0, 1])
    rig.close()
    reader = rigs(MHA_T, MHA_D, "page_first", extra, mode=mode)
    hit, _, done = reader.prefetch(toks)
    assert (hit, done) == (8, 8)


def test_legacy_hit_without_legacy_draft_pool_is_the_target_prefix(tmp_path, rigs):
    """0.5.18 without ``legacy_draft_pool``: the draft is not offloaded, the target hit stands."""
    if not h.HAS_LEGACY_DRAFT:
        rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")))
        assert not hasattr(rig.controller, "set_draft_kv_pool")  # the legacy path is gone here
        return
    rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")), mode="legacy")
    h.fill_random(rig.kv.host, 4)
    toks = h.tokens(3, salt=4)
    assert rig.backup(toks, rig.alloc(3)) == 12
    assert rig.adapter.batch_exists([f"{k}.draft" for k in h.page_hashes(toks, 4)]) == 0  # draft refused
    rig.close()
    assert rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")), mode="legacy").prefetch(toks)[0] == 12


@smoke
def test_should_backup_gate_mla_target_mha_draft_on_a_non_writer_rank(tmp_path, rigs):
    """SGLang limit, pinned: with an MLA target, ranks other than 0 skip the target (replicated) and
    back up the DRAFT pool only when the backend is ``mooncake``. An MHA draft is rank-sharded, so
    with any other backend (``dynamic`` included) rank 1 stores no draft page and its restore finds
    no hit. If a release lifts the gate this test fails: update the README table."""
    extra = h.extra_config(str(tmp_path / "kv"))
    rank1 = rigs(MLA_T, MHA_D, "page_first", extra, tp_rank=1, tp_size=2)
    gate = getattr(rank1.controller, "should_backup", None)
    if gate is None:  # releases without the hook skip the whole op on non-writer ranks
        assert rank1.controller.backup_skip
    else:
        draft = h.PoolTransfer(name=h.PoolName.DRAFT, keys=[], indices_from_pool=h.PoolName.KV)
        assert gate(draft) is False
        rank1.controller.storage_backend_type = "mooncake"
        assert gate(draft) is True
        rank1.controller.storage_backend_type = "dynamic"
    for n, pool in enumerate(rank1.pools):
        h.fill_random(pool.host, 5 + n)
    toks = h.tokens(3, salt=5)
    rank1.backup(toks, rank1.alloc(3))
    rank1.close()
    reader = rigs(MLA_T, MHA_D, "page_first", extra, tp_rank=1, tp_size=2)
    assert reader.prefetch(toks)[0] == 0  # nothing restorable on rank 1


# -- never raise into SGLang ----------------------------------------------------------------------------


def _calls(adapter, keys, idx, name):
    """Every call SGLang makes, with pool ``name``."""
    t = h.PoolTransfer(name=name, host_indices=idx, keys=keys)
    t_nokeys = h.PoolTransfer(name=name, host_indices=None, keys=None)
    policies = list(h.PoolHitPolicy)
    held = {h.PoolName.KV, h.PoolName.DRAFT}  # registering those is the attach itself, not I/O
    return [
        *([lambda: adapter.register_mem_host_pool_v2(object(), name)] if name not in held else []),
        lambda: adapter.batch_set_v2([t]),
        lambda: adapter.batch_get_v2([t]),
        lambda: adapter.batch_set_v2([t_nokeys]),
        lambda: adapter.batch_get_v2([t, t_nokeys]),
        *[lambda p=p: adapter.batch_exists_v2(keys, [h.PoolTransfer(name=name, keys=keys[-1:], hit_policy=p)])
          for p in policies],
        lambda: adapter.batch_exists_v2(keys, [t_nokeys]),
        lambda: adapter.batch_set([f"{k}.{name}" for k in keys], [torch.zeros(3)] * len(keys)),
        lambda: adapter.batch_get([f"{k}.{name}" for k in keys], [torch.zeros(3)] * len(keys)),
        lambda: adapter.batch_exists([f"{k}.{name}" for k in keys]),
        lambda: adapter.exists(f"{keys[0]}.{name}"),
        lambda: adapter.get(f"{keys[0]}.{name}"),
        lambda: adapter.set(f"{keys[0]}.{name}", torch.zeros(3)),
    ]


@smoke
def test_every_call_with_every_pool_name_never_raises_and_threads_survive(tmp_path, rigs):
    rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")))
    adapter = rig.adapter
    keys = h.page_hashes(h.tokens(2, salt=9), 4)
    bad = [torch.arange(0, 8), torch.arange(1, 3), torch.tensor([10_000, 10_001, 10_002, 10_003] * 2), None]
    for name in h.PoolName:
        for idx in bad:
            for call in _calls(adapter, keys, idx, name):
                call()  # must not raise
    for call in (lambda: adapter.batch_set_v1(keys, None), lambda: adapter.batch_get_v1(keys, torch.arange(3)),
                 lambda: adapter.batch_exists_v2(keys, [object()]), lambda: adapter.batch_set_v2([object()]),
                 lambda: adapter.batch_get(keys, None), lambda: adapter.batch_set(keys, None),
                 lambda: adapter.register_mem_host_pool_v2(None, None), adapter.on_host_pools_registered,
                 adapter.get_stats):
        call()
    # SGLang's own threads with every pool name as a sidecar: they survive and keep working.
    for name in h.PoolName:
        extra = [h.PoolTransfer(name=name, keys=None, hit_policy=h.PoolHitPolicy.ALL_PAGES,
                                indices_from_pool=h.PoolName.KV)]
        op = rig.controller.prefetch(*_prefetch_args(rig, h.tokens(2, salt=9)), extra_pools=extra)
        assert rig.controller.prefetch_hit_queue.get(timeout=h.WAIT_S) is op
    assert rig.threads_alive()
    for n, pool in enumerate(rig.pools):
        h.fill_random(pool.host, 12 + n)
    toks = h.tokens(2, salt=12)
    assert rig.backup(toks, rig.alloc(2)) == 8
    assert rig.prefetch(toks)[0] == 8


def _prefetch_args(rig, toks):
    import inspect

    params = inspect.signature(rig.controller.prefetch).parameters
    if "handle" in params:
        handle = h.importlib.import_module("sglang.srt.mem_cache.base_prefix_cache").CacheRequestHandle
        return handle(rid="fuzz", attempt_id=0), toks, None, None
    return "fuzz", toks, None, None


def test_the_result_dataclass_is_the_releases_own(tmp_path, rigs):
    """``batch_exists_v2`` builds this release's ``PoolTransferResult`` (two fields on 0.5.18)."""
    import dataclasses

    mode = "legacy" if h.HAS_LEGACY_DRAFT else "hybrid"  # the legacy rig attaches on old code too
    rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")), mode=mode)
    draft = h.PoolTransfer(name=h.PoolName.DRAFT, keys=None, indices_from_pool=h.PoolName.KV)
    result = rig.adapter.batch_exists_v2(h.page_hashes(h.tokens(1), 4), [draft])
    assert isinstance(result, h.sg.PoolTransferResult)
    assert {f.name for f in dataclasses.fields(result)} == {f.name for f in dataclasses.fields(h.sg.PoolTransferResult)}


def test_a_host_pool_group_attaches(tmp_path, rigs):
    """What ``register_mem_pool_host`` receives (0.5.18: the HostPoolGroup) resolves to its anchor."""
    rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")))
    passed = rig.adapter.mem_pool_host
    assert rig.adapter.sources[PoolKind.KV] is rig.kv.host
    assert passed is rig.kv.host or getattr(passed, "anchor_entry", None) is not None


# -- clear ---------------------------------------------------------------------------------------------


@smoke
def test_clear_is_reported_unsupported_by_sglang_and_pages_stay(tmp_path, rigs, caplog):
    rig = rigs(MHA_T, MHA_D, "page_first", h.extra_config(str(tmp_path / "kv")))
    h.fill_random(rig.kv.host, 2)
    toks = h.tokens(2, salt=2)
    assert rig.backup(toks, rig.alloc(2)) == 8
    with caplog.at_level(logging.WARNING):
        clear = getattr(rig.controller, "clear_storage_backend", None)
        assert clear is not None
        assert clear() is False  # SGLang: "does not support clear operation"
    assert "no delete hook" in caplog.text
    assert rig.prefetch(toks)[0] == 8  # nothing was deleted, and SGLang did not claim otherwise


# -- the README's launch lines ----------------------------------------------------------------------------


def readme_extra_configs() -> dict[str, dict]:
    """release label -> the extra-config JSON of the README's launch line for it."""
    import json

    text = README.read_text()
    section = text.split("## Using hicache-draft from SGLang", 1)[1].split("\n## ", 1)[0]
    out = {}
    for label, body in re.findall(r"<!-- launch: (\S+) -->\s*```bash\n(.*?)```", section, re.S):
        m = re.search(r"--hicache-storage-backend-extra-config '(.*?)'", body, re.S)
        assert m and "--hicache-storage-backend dynamic" in body and "--enable-hierarchical-cache" in body, label
        out[label] = json.loads(m.group(1))
    return out


def _readme_label() -> str:
    return "0.5.18" if h.HAS_LEGACY_DRAFT else "0.5.19+"


@smoke
def test_the_readme_launch_line_for_this_release_round_trips_the_draft(tmp_path, rigs):
    configs = readme_extra_configs()
    assert set(configs) == {"0.5.18", "0.5.19+"}
    extra = configs[_readme_label()]
    extra["hicache_draft"]["backend_options"]["root"] = str(tmp_path / "kv")
    mode = "legacy" if h.HAS_LEGACY_DRAFT else "hybrid"
    # The README's pair: Llama-3.1-8B (MHA, 8 KV heads of 128 per TP rank at tp 1) with a one-layer EAGLE3
    # draft of the same head shape; scaled down here to 2 heads of 8 in the draft shape the line states.
    section = extra["hicache_draft"].get("legacy_draft_pool")
    draft = h.Shape("mha", section["layers"], heads=section["kv_heads"], head_dim=section["head_dim"]) if section \
        else MHA_D
    target = h.Shape("mha", 3, heads=draft.heads, head_dim=draft.head_dim)
    hit, done, before, after, reader = h.round_trip(rigs, target, draft, "page_first", extra, mode=mode)
    assert (hit, done) == (20, 20) and after == before
    assert reader.adapter.placement.draft_model == h.DRAFT_MODEL
