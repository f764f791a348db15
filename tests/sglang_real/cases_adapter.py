"""Contract tests of the SGLang adapter against the real SGLang package (the pinned release).

The adapter is built through SGLang's own ``StorageBackendFactory`` dynamic path and called the way
SGLang calls it, over SGLang's own host pools (harness.py); the controllers' side is in
cases_controllers.py.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import subprocess
import sys
from pathlib import Path

import cases_controllers
import harness as hr
import pytest
import torch
from hicache_draft_mooncake.pytest_plugin import mooncake_service  # noqa: F401  (the fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import Attention, Capabilities, PoolCapability, PoolKind, hookimpl, make_key, page_hashes
from hicache_draft.errors import ConfigError, UnknownBackendError
from hicache_draft.integrations.sglang_loader import (
    TESTED_SGLANG_VERSION,
    load_backend_factory,
    load_storage_module,
    sglang_version,
)
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend
from hicache_draft.testing.memory import Faults

sg = load_storage_module()
Factory = load_backend_factory()
PoolName, PoolTransfer, PoolHitPolicy = sg.PoolName, sg.PoolTransfer, sg.PoolHitPolicy

from hicache_draft.integrations import sglang as adapter_mod  # noqa: E402  (after the bootstrap, on purpose)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PS = 4
NUM_PAGES = 12
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


class GenericOnly(MemoryBackend):
    """Declares no zero-copy layout: every page goes through staging. Records each call's shape."""

    capabilities = Capabilities(
        pools={k: PoolCapability(attention=frozenset(Attention), generic=True) for k in PoolKind}, persistent=True
    )
    seen: list[tuple[str, PoolKind, bool, int]] = []

    @hookimpl
    def page_set(self, transfers):
        GenericOnly.seen += [("set", t.pool, t.zero_copy, len(t.pages)) for t in transfers]
        return super().page_set(transfers)


class TargetOnly(MemoryBackend):
    """Holds no draft pool."""

    capabilities = Capabilities(
        pools={PoolKind.KV: MemoryBackend.capabilities.pools[PoolKind.KV]}, persistent=True
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    MemoryBackend.reset()
    GenericOnly.seen = []
    for name, cls in (("memory", MemoryBackend), ("generic-only", GenericOnly), ("target-only", TargetOnly)):
        register_backend(name, cls)
    yield
    while _OPEN:
        _OPEN.pop().close()
    for name in ("memory", "generic-only", "target-only"):
        unregister_backend(name)
    MemoryBackend.reset()


BACKENDS = ["memory", "generic-only", "file", "mooncake"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """(backend name, options): each adapter built from them sees the same storage.

    ``mooncake`` runs against a real store (master + segment holder on 127.0.0.1) started by the
    ``mooncake_service`` fixture of hicache-draft-mooncake; keys are isolated per test by a prefix.
    """
    if request.param == "file":
        return "file", {"root": str(request.getfixturevalue("tmp_path") / "kv")}
    if request.param == "mooncake":
        options = request.getfixturevalue("mooncake_service").backend_options()
        return "mooncake", {**options, "key_prefix": f"sgl-{secrets.token_hex(4)}-"}
    return request.param, {"space": secrets.token_hex(4)}


def extra_config(backend_name, options, **ours):
    return {
        "backend_name": "hicache_draft",
        "module_path": "hicache_draft.integrations.sglang",
        "class_name": "HiCacheDraftStorage",
        "interface_v1": True,
        "hicache_draft": {"backend": backend_name, "backend_options": options, **ours},
    }


def storage_config(extra, *, mla=False, tp_rank=0, tp_size=1, tp_lcm_size=None, split=False, model=MODEL):
    return sg.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        tp_lcm_size=tp_lcm_size, should_split_heads=split, extra_config=extra,
    )


_OPEN: list = []


def build(extra, **kw):
    """The adapter as SGLang builds it (closed when the test ends)."""
    adapter = Factory.create_backend("dynamic", storage_config(extra, **kw), None)
    _OPEN.append(adapter)
    return adapter


def _pool(shape, layout, seed):
    pool = hr.host_pool(hr.device_pool(shape, NUM_PAGES * PS // 2, PS), layout, ratio=2.0)
    if seed is not None:
        hr.fill_random(pool, seed)
    return pool


def mha(layout="page_first", layers=2, heads=2, seed=None):
    """SGLang's MHA host pool (13 pages of 4 tokens)."""
    return _pool(hr.Shape("mha", layers, heads=heads, head_dim=8), layout, seed)


def mla(layout="page_first", layers=2, seed=None):
    """SGLang's MLA host pool (kv_lora_rank 12, qk_rope_head_dim 4)."""
    return _pool(hr.Shape("mla", layers), layout, seed)


def attach(adapter, kv, draft=None):
    adapter.register_mem_pool_host(kv)
    adapter.register_mem_host_pool_v2(kv, PoolName.KV)
    if draft is not None:
        adapter.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    adapter.on_host_pools_registered()
    return adapter


def hashes(n, salt=0):
    return page_hashes([salt * 100_000 + t for t in range(n * PS)], PS)


def indices(slots):
    return torch.cat([torch.arange(s, s + PS) for s in slots]) if slots else torch.zeros(0, dtype=torch.int64)


def draft_transfer(keys, slots, policy=None):
    kw = {"hit_policy": policy} if policy is not None else {}
    return PoolTransfer(name=PoolName.DRAFT, host_indices=indices(slots) if slots is not None else None,
                        keys=keys, **kw)


# -- the SGLang contract ----------------------------------------------------------------------------


def test_pinned_sglang_and_no_package_init():
    assert sglang_version() == TESTED_SGLANG_VERSION
    assert "sglang.lang.api" not in sys.modules  # sglang/__init__.py did not run


def test_adapter_is_a_concrete_hicache_storage_with_sglang_signatures():
    cls = adapter_mod.HiCacheDraftStorage
    assert issubclass(cls, sg.HiCacheStorage)
    assert not inspect.isabstract(cls)
    for name in ("get", "set", "batch_get", "batch_set", "exists", "batch_exists", "batch_get_v1", "batch_set_v1",
                 "batch_exists_v2", "batch_get_v2", "batch_set_v2", "register_mem_pool_host",
                 "register_mem_host_pool_v2", "on_host_pools_registered", "get_stats"):
        ours = list(inspect.signature(getattr(cls, name)).parameters)
        theirs = list(inspect.signature(getattr(sg.HiCacheStorage, name)).parameters)
        assert ours == theirs, name
    assert list(inspect.signature(cls.__init__).parameters) == ["self", "storage_config", "kwargs"]


def test_factory_builds_adapter_from_documented_extra_config(tmp_path):
    """The extra-config JSON of the README's launch line, as SGLang's factory receives it."""
    extra = cases_controllers.readme_extra_configs()["0.5.19+"]
    extra["hicache_draft"]["backend_options"]["root"] = str(tmp_path / "kv")
    adapter = Factory.create_backend("dynamic", storage_config(extra), None)
    _OPEN.append(adapter)
    assert isinstance(adapter, adapter_mod.HiCacheDraftStorage)
    assert (adapter.store.name, adapter.interface_v1) == ("file", True)
    assert adapter.placement.draft_model == "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B"
    kv, dr = mha(seed=1), mha(layers=1, seed=2)
    attach(adapter, kv, dr)
    keys = hashes(2, salt=20)
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [True, True]
    assert adapter.batch_set_v2([draft_transfer(keys, [0, 4])]) == {PoolName.DRAFT: [True, True]}
    assert adapter.batch_exists_v2(keys, [draft_transfer(None, None)]).kv_hit_pages == 2


def test_factory_builds_adapter_on_every_backend(backend):
    adapter = build(extra_config(*backend))
    assert isinstance(adapter, adapter_mod.HiCacheDraftStorage)
    assert adapter.store.name == backend[0]


def test_factory_dynamic_path_still_demands_its_fields():
    extra = extra_config("memory", {})
    del extra["module_path"]
    with pytest.raises(ValueError, match="module_path"):
        build(extra)


def test_core_imports_without_sglang():
    code = (
        "import sys, hicache_draft, hicache_draft.integrations.sglang_config, "
        "hicache_draft.integrations.sglang_pools; "
        "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules), 'sglang imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_sglang_is_a_clear_error(monkeypatch):
    from hicache_draft.integrations import sglang_loader

    monkeypatch.delitem(sys.modules, "sglang")
    monkeypatch.setattr(sglang_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(sglang_loader.SGLangMissingError, match="pip install --no-deps sglang=="):
        sglang_loader.ensure_sglang_package()


# -- round trips --------------------------------------------------------------------------------------

POOL_CASES = (
    [("mha", lay, "mha") for lay in MHA_LAYOUTS]
    + [("mla", lay, "mla") for lay in MLA_LAYOUTS]
    + [("mla", "page_first", "mha")]  # an MHA EAGLE draft on an MLA target
)


def make(attention, layout, layers, seed):
    return mha(layout, layers=layers, seed=seed) if attention == "mha" else mla(layout, layers=layers, seed=seed)


@pytest.mark.parametrize(("target", "layout", "draft"), POOL_CASES)
def test_target_and_draft_round_trip_byte_exact(backend, target, layout, draft):
    extra = extra_config(*backend)
    is_mla = target == "mla"
    kv, dr = make(target, layout, 3, 1), make(draft, layout if draft == target else "page_first", 1, 2)
    writer = attach(build(extra, mla=is_mla), kv, dr)
    keys = hashes(5)
    src = [0, 8, 12, 24, 40]
    assert writer.batch_set_v1(keys[:3], indices(src[:3])) == [True] * 3
    res = writer.batch_set_v2([
        PoolTransfer(name=PoolName.KV, host_indices=indices(src[3:]), keys=keys[3:]),
        draft_transfer(keys, src),
    ])
    assert res == {PoolName.KV: [True, True], PoolName.DRAFT: [True] * 5}
    writer.close()

    kv2, dr2 = make(target, layout, 3, None), make(draft, layout if draft == target else "page_first", 1, None)
    reader = attach(build(extra, mla=is_mla), kv2, dr2)
    assert reader.batch_exists(keys) == 5
    hit = reader.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (5, {PoolName.KV: 5, PoolName.DRAFT: 5})
    dst = [44, 4, 16, 20, 32]
    assert reader.batch_get_v1(keys, indices(dst)) == [True] * 5
    assert reader.batch_get_v2([draft_transfer(keys, dst)]) == {PoolName.DRAFT: [True] * 5}
    for s, d in zip(src, dst, strict=True):
        assert hr.page_bytes(kv2, d) == hr.page_bytes(kv, s)
        assert hr.page_bytes(dr2, d) == hr.page_bytes(dr, s)
    reader.close()
    if backend[0] == "generic-only":
        assert GenericOnly.seen and not any(zc for _, _, zc, _ in GenericOnly.seen)


def test_a_generic_pool_without_its_staging_area_still_goes_through_staging():
    """Only pools on the zero-copy path take the one-call zero-copy route: a generic pool's slot
    pages are copied through staging (fresh memory when its area is gone), never handed to the
    backend as the host pool's own memory."""
    GenericOnly.seen = []
    kv = mha(seed=9)
    adapter = attach(build(extra_config("generic-only", {"space": secrets.token_hex(4)})), kv)
    adapter.bindings[PoolKind.KV].staging = None
    keys = hashes(2, salt=61)
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [True, True]
    assert GenericOnly.seen == [("set", PoolKind.KV, False, 2)]
    assert adapter.batch_get_v1(keys, indices([8, 12])) == [True, True]
    assert [hr.page_bytes(kv, d) for d in (8, 12)] == [hr.page_bytes(kv, s) for s in (0, 4)]


def test_v2_sends_target_and_draft_in_one_backend_call():
    adapter = attach(build(extra_config("memory", {})), mha(seed=1), mha(layers=1, seed=2))
    keys = hashes(3)
    MemoryBackend.calls.clear()
    adapter.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices([0, 4, 8]), keys=keys),
                          draft_transfer(keys, [0, 4, 8])])
    assert MemoryBackend.calls == [("page_set", {PoolKind.KV: 3, PoolKind.DRAFT: 3})]


def test_v2_pools_handed_the_same_indices_and_keys_check_them_against_their_own_pool(caplog):
    """A draft transfer that carries the target's own key list and host indices (one object for
    both pools, as SGLang builds them) moves the same bytes as one with copies of them, and each
    pool checks the slots against its own size: a slot the target has and a smaller draft pool
    does not fails the draft's pages, named, and leaves the target's."""
    kv, draft = mha(seed=1), mha(layers=1, seed=2)
    keys, idx = hashes(3, salt=41), indices([0, 4, 8])
    adapter = attach(build(extra_config("memory", {})), kv, draft)
    got = adapter.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys),
                                PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=keys)])
    assert got == {PoolName.KV: [True] * 3, PoolName.DRAFT: [True] * 3}
    kv2, draft2 = mha(), mha(layers=1)
    reader = attach(build(extra_config("memory", {})), kv2, draft2)
    idx2 = indices([12, 16, 20])
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx2, keys=keys),
                               PoolTransfer(name=PoolName.DRAFT, host_indices=idx2, keys=keys)])
    assert got == {PoolName.KV: [True] * 3, PoolName.DRAFT: [True] * 3}
    for pool, pool2 in ((kv, kv2), (draft, draft2)):
        assert [hr.page_bytes(pool2, d) for d in (12, 16, 20)] == [hr.page_bytes(pool, s) for s in (0, 4, 8)]

    small = hr.host_pool(hr.device_pool(hr.Shape("mha", 1, heads=2, head_dim=8), 2 * PS, PS), "page_first")
    small_slots = small.size  # the draft pool's slots: the target has more
    assert small_slots < kv.size
    adapter = attach(build(extra_config("memory", {})), mha(seed=5), small)
    past = indices([0, 4, small_slots])  # the last page is the target's, and past the draft pool's end
    with caplog.at_level(logging.WARNING, logger="hicache_draft.sglang"):
        got = adapter.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=past, keys=keys),
                                    PoolTransfer(name=PoolName.DRAFT, host_indices=past, keys=keys)])
    assert got == {PoolName.KV: [True] * 3, PoolName.DRAFT: [False] * 3}
    assert f"host slot {small_slots} is not the first slot of a page" in caplog.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=6), st.text(alphabet="0123456789abcdefABCDEF.", max_size=66)),
                min_size=0, max_size=6))
def test_whole_batch_groups_are_the_per_key_rule(keys):
    """page_groups / split_generic_keys (whole-batch steps) give what page_group / split_generic_key
    give key by key, for hex, upper-case, empty, dotted and arbitrary keys."""
    assert adapter_mod.page_groups(keys) == [adapter_mod.page_group(k) for k in keys]
    kinds, groups = adapter_mod.split_generic_keys(keys)
    assert list(zip(kinds, groups, strict=True)) == [adapter_mod.split_generic_key(k) for k in keys]


def test_remembered_keys_never_answer_for_another_pool_or_a_suffixed_key(backend):
    """The key cache is per pool view: a hash stored as a target page through v1 is no draft hit,
    and the same string with a ".draft" suffix asks the draft pool."""
    name, options = backend
    adapter = attach(build(extra_config(name, options)), mha(seed=1), mha(layers=1, seed=2))
    keys = hashes(3, salt=21)
    assert adapter.batch_set_v1(keys, indices([0, 4, 8])) == [True] * 3
    assert adapter.batch_exists(keys) == 3
    assert adapter.batch_exists([f"{k}.draft" for k in keys]) == 0
    hit = adapter.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (0, {PoolName.KV: 3})
    assert adapter.batch_exists([k.upper() for k in keys]) == 3  # SGLang hashes are case-free hex
    dotted = [f"{k}.draft" for k in hashes(2, salt=22)]  # target pages moved under dotted names
    assert adapter.batch_set_v1(dotted, indices([0, 4])) == [True] * 2
    assert not set(dotted) & set(adapter.key_caches[PoolKind.KV])  # so never answered as target pages
    assert adapter.batch_exists(dotted) == 0  # "{hash}.draft" asks the draft pool, which has none of them


def test_only_lowercase_hex_hashes_are_remembered_and_the_others_still_move_by_their_group():
    """The key cache holds SGLang's own hashes (lowercase hex, each its own page group) only, so a
    call that finds every hash remembered uses the hashes as the groups; other hashes (here the same
    hashes in upper case, whose group is the lowercase hash) move and hit by their group, never from
    the cache, and a reader with the lowercase hashes restores the very pages."""
    kv = mha(seed=7)
    writer = attach(build(extra_config("memory", {})), kv)
    low = hashes(3, salt=51)
    upper = [h.upper() for h in low]
    assert writer.batch_set_v1(upper, indices([0, 4, 8])) == [True] * 3
    assert writer.key_caches[PoolKind.KV] == {}
    assert writer.batch_exists(upper) == 3 and writer.batch_exists(low) == 3
    kv2 = mha()
    reader = attach(build(extra_config("memory", {})), kv2)
    for _ in range(2):  # the first get remembers the keys, the second moves the pages from them
        assert reader.batch_get_v1(low, indices([12, 16, 20])) == [True] * 3
        assert [hr.page_bytes(kv2, d) for d in (12, 16, 20)] == [hr.page_bytes(kv, s) for s in (0, 4, 8)]
        assert set(reader.key_caches[PoolKind.KV]) == set(low)
        kv2.kv_buffer.zero_()
    assert reader.batch_get_v1(upper, indices([12, 16, 20])) == [True] * 3  # by group, not from the cache
    assert [hr.page_bytes(kv2, d) for d in (12, 16, 20)] == [hr.page_bytes(kv, s) for s in (0, 4, 8)]
    assert set(reader.key_caches[PoolKind.KV]) == set(low)


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "generic"])
def test_a_hit_query_after_a_write_builds_no_keys_and_suffixed_keys_are_not_remembered(monkeypatch, interface_v1):
    """Pages this server wrote through v1 or SGLang's generic ``batch_set`` (plain page hashes) are
    answered from the remembered keys: the hit query builds no key (``page_groups`` is never
    called); ``{hash}.draft`` keys are not remembered for the target pool."""
    extra = extra_config("memory", {"space": secrets.token_hex(4)})
    extra["interface_v1"] = interface_v1
    kv, dr = mha(seed=1), mha(layers=1, seed=2)
    adapter = attach(build(extra), kv, dr)
    keys, drafts = hashes(3, salt=31), hashes(2, salt=32)
    if interface_v1:
        assert adapter.batch_set_v1(keys, indices([0, 4, 8])) == [True] * 3
    else:
        assert adapter.batch_set(keys, [kv.get_data_page(s) for s in (0, 4, 8)]) is True
    assert adapter.batch_set([f"{k}.draft" for k in drafts], [dr.get_data_page(s) for s in (0, 4)]) is True
    assert set(adapter.key_caches[PoolKind.KV]) == set(keys)

    def no_keys(*args, **kwargs):
        raise AssertionError("a key was built for pages this server wrote")

    monkeypatch.setattr(adapter_mod, "page_groups", no_keys)
    assert adapter.batch_exists(keys) == 3
    assert adapter.batch_exists(keys[:1]) == 1


def test_a_v2_hit_query_recalls_the_keys_of_pages_this_server_moved_and_makes_any_others(monkeypatch):
    """``batch_exists_v2`` asks its key cache once, by the batch's first hash: a batch this server
    moved is answered from the remembered keys (no page group is made), one another server stored is
    answered from keys made as the controller makes them (``page_groups``, then each binding's keys),
    and one that starts with pages this server moved and goes on with another server's is answered
    right too (the recall finds part of it, so every pool's keys are made from the hashes)."""
    space = {"space": secrets.token_hex(4)}
    mine = attach(build(extra_config("memory", space)), mha(seed=1), mha(layers=1, seed=2))
    other = attach(build(extra_config("memory", space)), mha(seed=3), mha(layers=1, seed=4))
    keys = hashes(4, salt=61)
    store_pages(mine, keys, [0, 1], [0, 1])  # this server: pages 0 and 1 of both pools
    store_pages(other, keys, [2, 3], [2, 3])  # another server on the same store: pages 2 and 3
    assert set(mine.key_caches[PoolKind.KV]) == set(keys[:2])
    made = []
    real = adapter_mod.page_groups

    def counted(batch):
        made.append(list(batch))
        return real(batch)

    monkeypatch.setattr(adapter_mod, "page_groups", counted)
    draft = [draft_transfer(None, None)]
    for adapter, batch, groups_made in ((mine, keys[:2], []), (mine, keys, []), (other, keys[:2], [keys[:2]])):
        made.clear()
        hit = adapter.batch_exists_v2(batch, draft)
        n = len(batch)
        assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (n, {PoolName.KV: n, PoolName.DRAFT: n})
        assert hit.restorable_prefix_pages == list(range(1, n + 1))
        assert made == groups_made
    fresh = attach(build(extra_config("memory", space)), mha(), mha(layers=1))  # a restarted server
    hit = fresh.batch_exists_v2(keys, draft)
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (4, {PoolName.KV: 4, PoolName.DRAFT: 4})
    gap = hashes(2, salt=62)  # a batch whose second page nobody stored
    store_pages(mine, gap, [0], [0])
    assert mine.batch_exists_v2(gap, draft).kv_hit_pages == 1 and fresh.batch_exists_v2(gap, draft).kv_hit_pages == 1


def test_generic_path_chunks_through_small_staging():
    extra = extra_config("generic-only", {"space": secrets.token_hex(4)}, staging_pages=2)
    kv = mha("layer_first", seed=5)
    writer = attach(build(extra), kv, mha("layer_first", layers=1, seed=6))
    keys = hashes(5, salt=1)
    src = [0, 4, 8, 12, 16]
    assert writer.batch_set_v1(keys, indices(src)) == [True] * 5
    assert GenericOnly.seen == [("set", PoolKind.KV, False, 2)] * 2 + [("set", PoolKind.KV, False, 1)]
    kv2 = mha("layer_first")
    reader = attach(build(extra), kv2, mha("layer_first", layers=1))
    assert reader.batch_get_v1(keys, indices(src)) == [True] * 5
    assert all(hr.page_bytes(kv2, s) == hr.page_bytes(kv, s) for s in src)


# -- hit rules ------------------------------------------------------------------------------------------


def store_pages(adapter, keys, kv_pages, draft_pages):
    """Write target pages ``kv_pages`` and draft pages ``draft_pages`` (indices into ``keys``)."""
    for i in kv_pages:
        assert adapter.batch_set_v1([keys[i]], indices([4 * (i % NUM_PAGES)])) == [True]
    for i in draft_pages:
        assert adapter.batch_set_v2([draft_transfer([keys[i]], [4 * (i % NUM_PAGES)])]) == {PoolName.DRAFT: [True]}


def test_batch_exists_v2_missing_draft_page_shortens_the_hit(backend):
    adapter = attach(build(extra_config(*backend)), mha(seed=1), mha(layers=1, seed=2))
    keys = hashes(6, salt=2)
    store_pages(adapter, keys, range(6), [0, 1, 2, 4, 5])  # draft page 3 missing
    hit = adapter.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert hit.kv_hit_pages == 3
    assert hit.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.DRAFT: 3}
    assert hit.restorable_prefix_pages == [1, 2, 3]
    assert adapter.batch_exists(keys) == 6  # no sidecar asked: the target prefix alone
    plain = adapter.batch_exists_v2(keys, None)
    assert (plain.kv_hit_pages, plain.extra_pool_hit_pages) == (6, {PoolName.KV: 6})


def test_batch_exists_v2_pools_we_do_not_hold_give_no_hit(backend):
    adapter = attach(build(extra_config(*backend)), mha(seed=1), mha(layers=1, seed=2))
    keys = hashes(3, salt=3)
    store_pages(adapter, keys, range(3), range(3))
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    hit = adapter.batch_exists_v2(keys, [draft_transfer(None, None), mamba])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (0, {PoolName.KV: 3, PoolName.DRAFT: 3})
    assert adapter.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=indices([0]), keys=keys[:1])]) == {
        PoolName.MAMBA: [False]}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv=st.sets(st.integers(0, 7)), draft=st.sets(st.integers(0, 7)))
def test_hit_is_min_of_leading_target_and_draft_prefixes(kv, draft):
    adapter = attach(build(extra_config("memory", {"space": secrets.token_hex(4)})), mha(seed=1),
                     mha(layers=1, seed=2))
    keys = hashes(8, salt=4)
    store_pages(adapter, keys, sorted(kv), sorted(draft))

    def lead(s):
        return next(i for i in range(9) if i not in s)

    hit = adapter.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert hit.kv_hit_pages == min(lead(kv), lead(draft))
    assert hit.extra_pool_hit_pages.get(PoolName.KV, 0) == lead(kv)
    assert hit.extra_pool_hit_pages.get(PoolName.DRAFT, 0) == min(lead(kv), lead(draft))
    assert adapter.batch_exists(keys) == lead(kv)
    adapter.close()


def test_backend_without_draft_pool_reports_no_draft_hit_and_keeps_target():
    extra = extra_config("target-only", {"space": secrets.token_hex(4)})
    adapter = attach(build(extra), mha(seed=1), mha(layers=1, seed=2))
    keys = hashes(2, salt=5)
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [True, True]
    assert adapter.batch_set_v2([draft_transfer(keys, [0, 4])]) == {PoolName.DRAFT: [False, False]}
    assert adapter.batch_exists(keys) == 2
    assert adapter.batch_exists_v2(keys, [draft_transfer(None, None)]).kv_hit_pages == 0


# -- SGLang's generic calls ({hash} and {hash}.draft keys) ------------------------------------------------


def test_generic_draft_keys_with_unregistered_draft_pool(backend):
    """SGLang 0.5.15-0.5.18: draft pages arrive as flat pages under "{hash}.draft", pool never registered."""
    extra = extra_config(*backend, legacy_draft_pool={"attention": "mha", "layers": 1, "kv_heads": 2,
                                                       "head_dim": 8})
    extra["interface_v1"] = False
    kv, dr = mha("page_first_direct", seed=7), mha("page_first_direct", layers=1, seed=8)
    writer = build(extra)
    writer.register_mem_pool_host(kv)
    keys = hashes(3, salt=6)
    slots = [0, 8, 16]
    assert writer.batch_set(keys, [kv.get_data_page(s) for s in slots]) is True
    assert writer.batch_set([f"{k}.draft" for k in keys], [dr.get_data_page(s) for s in slots]) is True
    assert writer.exists(f"{keys[0]}.draft") and writer.exists(keys[2])
    assert writer.batch_exists([f"{k}.draft" for k in keys]) == 3

    reader = build(extra)
    reader.register_mem_pool_host(mha("page_first_direct"))
    dr2 = mha("page_first_direct", layers=1)
    got = reader.batch_get([f"{k}.draft" for k in keys] + [f"{hashes(1, salt=99)[0]}.draft"],
                           [dr2.get_dummy_flat_data_page() for _ in range(4)])
    assert got[3] is None
    for s, page in zip(slots, got[:3], strict=True):
        dr2.set_from_flat_data_page(s, page)
        assert hr.page_bytes(dr2, s) == hr.page_bytes(dr, s)
    one = reader.get(keys[1], mha("page_first_direct").get_dummy_flat_data_page())
    assert one is not None and bytes(one.view(torch.uint8).flatten().tolist()) == hr.page_bytes(kv, 8)


def test_generic_and_v2_draft_pages_are_the_same_pages(backend):
    """A draft page written by batch_set_v2 reads back through "{hash}.draft", and the reverse."""
    extra = extra_config(*backend)
    dr = mha(layers=1, seed=9)
    a = attach(build(extra), mha(seed=1), dr)
    keys = hashes(4, salt=7)
    assert a.batch_set_v2([draft_transfer(keys[:2], [0, 4])]) == {PoolName.DRAFT: [True, True]}
    assert a.batch_set([f"{k}.draft" for k in keys[2:]], [dr.get_data_page(s) for s in (8, 12)]) is True
    dr2 = mha(layers=1)
    b = attach(build(extra), mha(), dr2)
    got = b.batch_get([f"{k}.draft" for k in keys[:2]], [dr2.get_dummy_flat_data_page() for _ in range(2)])
    assert [bytes(g.view(torch.uint8).flatten().tolist()) for g in got] == [hr.page_bytes(dr, 0), hr.page_bytes(dr, 4)]
    assert b.batch_get_v2([draft_transfer(keys[2:], [24, 28])]) == {PoolName.DRAFT: [True, True]}
    assert (hr.page_bytes(dr2, 24), hr.page_bytes(dr2, 28)) == (hr.page_bytes(dr, 8), hr.page_bytes(dr, 12))


def test_generic_calls_refuse_bad_input_without_raising(backend):
    adapter = attach(build(extra_config(*backend)), mha(seed=1), mha(layers=1, seed=2))
    key = hashes(1, salt=8)[0]
    assert adapter.set(key, torch.zeros(3, dtype=torch.bfloat16)) is False  # wrong page size
    assert adapter.batch_set([key, key], [mha().get_dummy_flat_data_page()]) is False  # one value for two keys
    assert adapter.set(f"{key}.mamba", mha().get_dummy_flat_data_page()) is False  # a pool we do not hold
    assert adapter.get(f"{key}.mamba") is None
    assert adapter.batch_get_v1(hashes(2), indices([0])) == [False, False]  # indices do not match the keys
    assert adapter.batch_set_v1([key], torch.arange(1, 1 + PS)) == [False]  # not the first slot of a page


# -- parallelism ---------------------------------------------------------------------------------------


def test_split_heads_share_pages_between_tp_sizes():
    """tp_size=2 (tp_lcm_size=4) writes head groups that tp_size=4 ranks read head for head."""
    space = secrets.token_hex(4)
    extra = extra_config("memory", {"space": space})
    keys = hashes(2, salt=9)
    writer_pool = mha("page_head", heads=4, seed=11)  # rank 1 of 2: global heads 4..7
    writer = attach(build(extra, tp_rank=1, tp_size=2, tp_lcm_size=4, split=True), writer_pool)
    assert writer.batch_set_v1(keys, indices([0, 4])) == [True, True]
    for rank, heads in ((2, slice(0, 2)), (3, slice(2, 4))):  # ranks 2, 3 of 4 hold global heads 4..5, 6..7
        pool = mha("page_head", heads=2)
        # SGLang sets should_split_heads only when tp_lcm_size > tp_size.
        reader = attach(build(extra, tp_rank=rank, tp_size=4, tp_lcm_size=4, split=False), pool)
        assert reader.batch_get_v1(keys, indices([8, 12])) == [True, True]
        for src, dst in ((0, 2), (1, 3)):
            got = pool.kv_buffer[:, dst].contiguous().view(torch.uint8)
            want = writer_pool.kv_buffer[:, src, heads].contiguous().view(torch.uint8)
            assert torch.equal(got, want)
    other = attach(build(extra, tp_rank=0, tp_size=4, tp_lcm_size=4), mha("page_head", heads=2))
    assert other.batch_exists(keys) == 0  # global heads 0..1 were never written


def test_ranks_of_an_mha_pool_do_not_share_pages_but_mla_ranks_do():
    extra = extra_config("memory", {"space": secrets.token_hex(4)})
    keys = hashes(1, salt=10)
    w = attach(build(extra, tp_rank=0, tp_size=2), mha(seed=1))
    assert w.batch_set_v1(keys, indices([0])) == [True]
    assert attach(build(extra, tp_rank=1, tp_size=2), mha()).batch_exists(keys) == 0
    w = attach(build(extra, mla=True, tp_rank=0, tp_size=2), mla(seed=1))
    assert w.batch_set_v1(keys, indices([0])) == [True]
    assert attach(build(extra, mla=True, tp_rank=1, tp_size=2), mla()).batch_exists(keys) == 1


# -- failures ------------------------------------------------------------------------------------------


def test_a_failing_backend_gives_false_and_misses_not_exceptions():
    adapter = attach(build(extra_config("memory", {"space": secrets.token_hex(4)})), mha(seed=1),
                     mha(layers=1, seed=2))
    keys = hashes(2, salt=11)
    MemoryBackend.faults = Faults(raise_on={"page_set", "page_get", "page_exists"})
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [False, False]
    assert adapter.batch_set_v2([draft_transfer(keys, [0, 4])]) == {PoolName.DRAFT: [False, False]}
    assert adapter.batch_get_v1(keys, indices([0, 4])) == [False, False]
    assert adapter.batch_exists(keys) == 0
    assert adapter.batch_exists_v2(keys, [draft_transfer(None, None)]).kv_hit_pages == 0
    assert adapter.batch_set(keys, [mha().get_dummy_flat_data_page()] * 2) is False
    assert adapter.batch_get(keys) == [None, None]


def test_a_hung_backend_call_is_bounded_and_its_staging_is_abandoned():
    extra = extra_config("generic-only", {"space": secrets.token_hex(4)}, timeout_s=0.2)
    adapter = attach(build(extra), mha(seed=1))
    keys = hashes(1, salt=12)
    registered = adapter.bindings[PoolKind.KV].staging.tensor
    MemoryBackend.faults = Faults(delay_s={"page_get": 1.0})
    assert adapter.batch_get_v1(keys, indices([0])) == [False]
    staging = adapter.bindings[PoolKind.KV].staging
    assert staging is not None and staging.tensor is not registered  # abandoned to the late call
    MemoryBackend.faults = Faults()
    assert adapter.batch_set_v1(keys, indices([0])) == [True]  # the fresh staging works


def test_without_a_backend_name_the_declared_default_is_used(monkeypatch):
    """The adapter names no backend itself: unset, it takes whichever installed backend declares
    itself the default (here a registered one, with the file plugin switched off)."""
    from hicache_draft.plugins import discover_backends

    monkeypatch.setenv("HICACHE_DRAFT_DISABLE_PLUGINS", "file")
    discover_backends(refresh=True)  # discovery is cached per process: read the block-list again
    default = type("Default", (MemoryBackend,), {"default": True})
    register_backend("elected", default)
    try:
        extra = extra_config(None, {"space": secrets.token_hex(4)})
        del extra["hicache_draft"]["backend"]
        adapter = build(extra)
        assert adapter.store.name == "elected"
    finally:
        unregister_backend("elected")
        monkeypatch.undo()
        discover_backends(refresh=True)


def test_a_late_zero_copy_get_never_writes_after_sglang_got_its_answer():
    """A backend sleeps past its deadline, then fills the host slots: the adapter gives it up to
    timeout_s more before answering SGLang, which reuses the slots at once on a failure."""
    import time

    space = secrets.token_hex(4)
    writer = attach(build(extra_config("memory", {"space": space}, timeout_s=0.25)), mha(seed=1))
    keys = hashes(1, salt=14)
    assert writer.batch_set_v1(keys, indices([0])) == [True]
    pool = mha(seed=3)
    reader = attach(build(extra_config("memory", {"space": space}, timeout_s=0.25)), pool)
    from hicache_draft import IOPath

    assert reader.bindings[PoolKind.KV].path is IOPath.ZERO_COPY
    MemoryBackend.faults = Faults(delay_s={"page_get": 0.4})  # past the deadline, within the grace
    before = hr.page_bytes(pool, 8)
    assert reader.batch_get_v1(keys, indices([8])) == [False]
    answered = hr.page_bytes(pool, 8)
    time.sleep(0.4)
    assert hr.page_bytes(pool, 8) == answered, "the backend wrote into SGLang's slot after the adapter answered"
    assert answered != before  # the late call did write, but before the adapter answered
    MemoryBackend.faults = Faults()


def test_a_corrupt_page_is_a_miss_and_leaves_the_host_page_alone():
    extra = extra_config("generic-only", {"space": secrets.token_hex(4)})
    adapter = attach(build(extra), mha(seed=1))
    keys = hashes(2, salt=13)
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [True, True]
    bad = make_key(keys[1], adapter.bindings[PoolKind.KV].namespaces[0])
    MemoryBackend.faults = Faults(corrupt_get_keys={bad})
    pool = mha()
    before = hr.page_bytes(pool, 8)
    assert attach(build(extra), pool).batch_get_v1(keys, indices([4, 8])) == [True, False]
    assert hr.page_bytes(pool, 8) == before


# -- configuration -------------------------------------------------------------------------------------


def test_model_identity_is_required_and_named():
    with pytest.raises(ConfigError, match=r"hicache_draft\.model") as err:
        build(extra_config("memory", {}), model=None)
    assert err.value.field == "hicache_draft.model"
    assert build(extra_config("memory", {}, model="my-model@rev1"), model=None).placement.model == "my-model@rev1"


def test_draft_model_defaults_and_changes_draft_keys_only():
    space = secrets.token_hex(4)
    keys = hashes(1, salt=14)
    a = attach(build(extra_config("memory", {"space": space})), mha(seed=1), mha(layers=1, seed=2))
    assert a.placement.draft_model == MODEL + "#draft"
    store_pages(a, keys, [0], [0])
    b = attach(build(extra_config("memory", {"space": space}, draft_model="eagle3-other")), mha(), mha(layers=1))
    hit = b.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages) == (0, {PoolName.KV: 1})


@pytest.mark.parametrize(("section", "field"), [
    ({"bogus": 1}, "hicache_draft.bogus"),
    ({"timeout_s": 0}, "hicache_draft.timeout_s"),
    ({"legacy_draft_pool": {"attention": "mla"}}, "hicache_draft.legacy_draft_pool"),
])
def test_bad_extra_config_names_the_field(section, field):
    extra = extra_config("memory", {})
    extra["hicache_draft"] = {k: v for k, v in extra["hicache_draft"].items() if k not in section} | section
    with pytest.raises(ConfigError) as err:
        build(extra)
    assert err.value.field == field and field in str(err.value)


def test_bad_section_type_unknown_backend_and_bad_options():
    extra = extra_config("memory", {})
    extra["hicache_draft"] = "file"
    with pytest.raises(ConfigError, match="expected a JSON object"):
        build(extra)
    with pytest.raises(UnknownBackendError, match="no-such-backend"):
        build(extra_config("no-such-backend", {}))
    with pytest.raises(ConfigError, match=r"backend_options\.colour"):
        build(extra_config("memory", {"colour": "red"}))


def test_unsupported_parallelism_is_refused_by_name():
    with pytest.raises(ConfigError, match="tp_lcm_size"):
        build(extra_config("memory", {}), tp_size=4, tp_rank=0, tp_lcm_size=6, split=True)
    with pytest.raises(ConfigError, match="page_unified"):
        pool = mha()
        pool.layout = "page_unified"
        build(extra_config("memory", {})).register_mem_pool_host(pool)


WRITER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import bootstrap; bootstrap.install(sys.argv[4])
import harness as hr, torch
from hicache_draft.integrations.sglang_loader import load_backend_factory, load_storage_module
from hicache_draft import page_hashes
sg = load_storage_module()
extra = json.loads(sys.argv[1])
cfg = sg.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
    is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True, model_name=sys.argv[2],
    extra_config=extra)
a = load_backend_factory().create_backend("dynamic", cfg, None)
kv = hr.host_pool(hr.device_pool(hr.Shape("mha", 3), 24, 4), "page_first")
dr = hr.host_pool(hr.device_pool(hr.Shape("mha", 1), 24, 4), "page_first")
hr.fill_random(kv, 31); hr.fill_random(dr, 32)
a.register_mem_pool_host(kv); a.register_mem_host_pool_v2(dr, sg.PoolName.DRAFT); a.on_host_pools_registered()
keys = page_hashes(list(range(300_000, 300_000 + 16)), 4)
idx = torch.arange(0, 16)
ok = a.batch_set_v1(keys, idx) + a.batch_set_v2([sg.PoolTransfer(name=sg.PoolName.DRAFT, host_indices=idx,
                                                                   keys=keys)])[sg.PoolName.DRAFT]
a.close()
sys.exit(0 if all(ok) else 3)
"""


def test_pages_written_by_another_process_come_back_after_restart(tmp_path):
    """A server process writes target and draft pages and exits; a new one restores both (file backend)."""
    extra = extra_config("file", {"root": str(tmp_path / "kv")})
    here = str(Path(__file__).resolve().parent)
    subprocess.run([sys.executable, "-c", WRITER, json.dumps(extra), MODEL, here, sglang_version()], check=True,
                   timeout=120)
    kv, dr = mha(layers=3), mha(layers=1)
    reader = attach(build(extra), kv, dr)
    keys = page_hashes(list(range(300_000, 300_000 + 16)), PS)
    hit = reader.batch_exists_v2(keys, [draft_transfer(None, None)])
    assert hit.kv_hit_pages == 4
    dst = [20, 24, 28, 32]
    assert reader.batch_get_v1(keys, indices(dst)) == [True] * 4
    assert reader.batch_get_v2([draft_transfer(keys, dst)]) == {PoolName.DRAFT: [True] * 4}
    want_kv, want_dr = mha(layers=3, seed=31), mha(layers=1, seed=32)
    for i, d in enumerate(dst):
        assert hr.page_bytes(kv, d) == hr.page_bytes(want_kv, 4 * i)
        assert hr.page_bytes(dr, d) == hr.page_bytes(want_dr, 4 * i)


@pytest.mark.parametrize("poll_us", [0, 250])
def test_the_settings_hand_over_polls_as_long_as_they_say(poll_us):
    """``handover_poll_us`` in the extra-config reaches the Store's worker threads; queries answer."""
    extra = extra_config("memory", {"space": secrets.token_hex(4)})
    extra["hicache_draft"]["handover_poll_us"] = poll_us
    adapter = attach(build(extra), mha(seed=1))
    assert adapter.store._workers.spin_s == pytest.approx(poll_us * 1e-6)
    keys = hashes(2, salt=41)
    assert adapter.batch_set_v1(keys, indices([0, 4])) == [True, True]
    assert adapter.batch_exists(keys) == 2


def test_host_indices_name_each_page_by_its_first_slot_as_a_tensor_or_a_list(caplog):
    """Only each page's first token slot is used (taken before the indices become Python ints);
    a tensor, a list and a 2-D tensor of the same indices move the same pages, and a count that is
    not pages x page size fails every page with a warning naming it."""
    kv = mha(seed=3)
    writer = attach(build(extra_config("memory", {})), kv)
    keys = hashes(3, salt=23)
    src, dst = [0, 4, 8], [12, 16, 20]
    assert writer.batch_set_v1(keys, indices(src)) == [True] * 3
    for handed in (indices(dst), indices(dst).tolist(), indices(dst).reshape(3, PS)):
        kv2 = mha(seed=None)
        reader = attach(build(extra_config("memory", {})), kv2)
        assert reader.batch_get_v1(keys, handed) == [True] * 3
        assert [hr.page_bytes(kv2, d) for d in dst] == [hr.page_bytes(kv, s) for s in src]
    with caplog.at_level(logging.WARNING, logger="hicache_draft.sglang"):
        assert reader.batch_get_v1(keys, indices(dst)[:-1]) == [False] * 3
    assert f"{len(keys) * PS - 1} host indices for 3 pages of {PS} tokens" in caplog.text
