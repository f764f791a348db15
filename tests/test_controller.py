"""The controller: path choice, byte-exact restores, hit rules, failure injection, ranks, batching."""

from __future__ import annotations

import os
import secrets
import time
from typing import ClassVar

import pytest

from hicache_draft import Attention, Capabilities, IOPath, Layout, PoolCapability, PoolKind
from hicache_draft.cli import check_report
from hicache_draft.config import PrefetchPolicy
from hicache_draft.controller import CacheController
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import Faults, MemoryBackend
from tests.helpers import PS, fill_random, in_forked_child, make_config, make_controller, make_pair, slots, tokens

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
ALL_LAYOUTS = frozenset(Layout)
BOTH = frozenset(Attention)


def backend_with(caps: Capabilities) -> type[MemoryBackend]:
    return type("Declared", (MemoryBackend,), {"capabilities": caps})


def caps(kv=None, draft=None, split=True) -> Capabilities:
    pools = {KV: kv or PoolCapability(attention=BOTH, zero_copy_layouts=ALL_LAYOUTS)}
    if draft is not False:
        pools[DRAFT] = draft or PoolCapability(attention=BOTH, zero_copy_layouts=ALL_LAYOUTS)
    return Capabilities(pools=pools, split_heads=split, persistent=True)


pytestmark = pytest.mark.usefixtures("reset_memory_backend")


_pair = make_pair


def _same(writer, reader, wslots, rslots, pool=KV):
    wp = writer.target_pool if pool is KV else writer.draft_pool
    rp = reader.target_pool if pool is KV else reader.draft_pool
    return all(wp.page_bytes(a) == rp.page_bytes(b) for a, b in zip(wslots, rslots, strict=True))


# -- the path table ------------------------------------------------------------------------------------

PATH_ROWS = [
    # (id, capabilities, config kwargs, expected kv path, expected draft path, words in the draft reason)
    ("all-zero-copy", caps(), {}, IOPath.ZERO_COPY, IOPath.ZERO_COPY, "zero-copy"),
    ("no-draft-pool", caps(draft=False), {}, IOPath.ZERO_COPY, IOPath.DISABLED, "does not declare the 'draft' pool"),
    ("draft-attention-undeclared", caps(draft=PoolCapability(attention=frozenset({Attention.MLA}))),
     {"draft": "mha"}, IOPath.ZERO_COPY, IOPath.DISABLED, "does not declare 'mha' attention"),
    ("split-heads-undeclared", caps(split=False), {"layout": "page_head", "tp_size": 2, "tp_lcm_size": 4},
     IOPath.ZERO_COPY, IOPath.ZERO_COPY, "does not declare split_heads: per-rank keys"),
    ("layout-not-zero-copy-generic", caps(draft=PoolCapability(attention=BOTH)), {}, IOPath.ZERO_COPY,
     IOPath.GENERIC, "not zero-copy for this backend; pages are copied"),
    ("layout-not-zero-copy-no-generic",
     caps(draft=PoolCapability(attention=BOTH, zero_copy_layouts=frozenset({Layout.LAYER_FIRST}), generic=False)),
     {}, IOPath.ZERO_COPY, IOPath.DISABLED, "no generic path"),
    ("too-many-buffers", caps(draft=PoolCapability(attention=BOTH, zero_copy_layouts=ALL_LAYOUTS,
                                                   max_buffers_per_page=1, generic=False)),
     {"draft": "mha"}, IOPath.ZERO_COPY, IOPath.DISABLED, "is 2 buffers"),
    ("single-buffer-mla-draft-ok", caps(draft=PoolCapability(attention=BOTH, zero_copy_layouts=ALL_LAYOUTS,
                                                             max_buffers_per_page=1, generic=False)),
     {"draft": "mla"}, IOPath.ZERO_COPY, IOPath.ZERO_COPY, "1 buffer per page"),
    ("split-heads-not-page-head", caps(), {"tp_size": 2, "tp_lcm_size": 4}, IOPath.GENERIC, IOPath.GENERIC,
     "head groups contiguous"),
    ("split-heads-page-head", caps(), {"layout": "page_head", "tp_size": 2, "tp_lcm_size": 4}, IOPath.ZERO_COPY,
     IOPath.ZERO_COPY, "2 head parts per page"),
    ("draft-off", caps(), {"draft": None}, IOPath.ZERO_COPY, IOPath.DISABLED, "draft.enabled = false"),
]


@pytest.mark.parametrize(("capabilities", "kw", "kv_path", "draft_path", "words"),
                         [r[1:] for r in PATH_ROWS], ids=[r[0] for r in PATH_ROWS])
def test_path_table_and_check_agree(capabilities, kw, kv_path, draft_path, words):
    backend = backend_with(capabilities)
    cfg = make_config(**kw)
    ctrl = make_controller(cfg, backend)
    try:
        assert ctrl.plan[KV].path is kv_path, ctrl.plan[KV].reason
        assert ctrl.plan[DRAFT].path is draft_path, ctrl.plan[DRAFT].reason
        assert words in ctrl.plan[DRAFT].reason
        register_backend("memory", backend)
        try:
            report = check_report(cfg)
        finally:
            unregister_backend("memory")
        assert {k: {"path": v["path"], "reason": v["reason"]} for k, v in report["pools"].items()} == {
            k.value: ctrl.plan[k].as_dict() for k in PoolKind}
    finally:
        ctrl.close()


def test_disabled_draft_logs_one_warning_naming_the_reason(caplog):
    with caplog.at_level("WARNING", logger="hicache_draft.controller"):
        ctrl = make_controller(make_config(), backend_with(caps(draft=False)))
    msgs = [r.getMessage() for r in caplog.records if "draft KV offload disabled" in r.getMessage()]
    assert len(msgs) == 1 and "does not declare the 'draft' pool" in msgs[0]
    ctrl.close()


# -- byte-exact restores for every combination --------------------------------------------------------

COMBOS = [
    (t, d, lay)
    for t in ("mha", "mla")
    for d in ("mha", "mla")
    for lay in ("layer_first", "page_first", "page_first_direct", "page_head")
    if not (t == "mla" and lay == "page_head")
]


@pytest.mark.parametrize("generic", [False, True], ids=["zero_copy", "generic"])
@pytest.mark.parametrize(("target", "draft", "layout"), COMBOS)
def test_restore_is_byte_exact_for_both_pools(target, draft, layout, generic):
    pool_cap = PoolCapability(attention=BOTH, zero_copy_layouts=frozenset() if generic else ALL_LAYOUTS)
    backend = backend_with(caps(kv=pool_cap, draft=pool_cap))
    writer, reader = _pair(make_config(target, draft, layout), backend)
    want = IOPath.GENERIC if generic else IOPath.ZERO_COPY
    assert writer.plan[KV].path is want and writer.plan[DRAFT].path is want
    toks = tokens(6)
    b = writer.backup(toks, slots(range(6)))
    assert b.pages_written == {KV: 6, DRAFT: 6}
    r = reader.prefetch(toks, slots(range(8, 14)))
    assert (r.pages, r.tokens, r.restored) == (6, 6 * PS, {KV: 6, DRAFT: 6})
    assert _same(writer, reader, slots(range(6)), slots(range(8, 14)), KV)
    assert _same(writer, reader, slots(range(6)), slots(range(8, 14)), DRAFT)
    writer.close()
    reader.close()


def test_target_and_draft_travel_in_the_same_batched_calls():
    cfg = make_config(batch_pages=4)
    writer, reader = _pair(cfg)
    toks = tokens(6)
    writer.backup(toks, slots(range(6)))
    sets = [c for c in MemoryBackend.calls if c[0] == "page_set"]
    assert sets == [("page_set", {KV: 4, DRAFT: 4}), ("page_set", {KV: 2, DRAFT: 2})]
    MemoryBackend.calls.clear()
    reader.prefetch(toks, slots(range(6)))
    assert [c for c in MemoryBackend.calls if c[0] != "page_exists"] == [
        ("page_get", {KV: 4, DRAFT: 4}), ("page_get", {KV: 2, DRAFT: 2})]
    assert [c[0] for c in MemoryBackend.calls].count("page_exists") == 1


# -- hit rules --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_miss", ["shorten", "target_only"])
def test_missing_draft_page_shortens_or_is_reported_cold(on_miss):
    writer, reader = _pair(make_config(on_miss=on_miss))
    toks = tokens(6)
    writer.backup(toks, slots(range(6)))
    store_view = writer.store.backend
    store_view.drop(writer.keys_for(DRAFT, _hashes(toks))[3])  # evicted draft page 3
    r = reader.prefetch(toks, slots(range(8, 14)))
    if on_miss == "shorten":
        assert (r.pages, r.restored, r.draft_cold) == (3, {KV: 3, DRAFT: 3}, [])
    else:
        assert (r.pages, r.restored, r.draft_cold) == (6, {KV: 6, DRAFT: 3}, [3, 4, 5])
        assert _same(writer, reader, slots(range(6)), slots(range(8, 14)), KV)
    assert _same(writer, reader, slots(range(3)), slots(range(8, 11)), DRAFT)


def _hashes(toks):
    from hicache_draft import page_hashes

    return page_hashes(toks, PS)


@pytest.mark.parametrize("on_miss", ["shorten", "target_only"])
@pytest.mark.parametrize("pool", [KV, DRAFT])
@pytest.mark.parametrize("position", range(6))
@pytest.mark.parametrize("fault", ["fail", "corrupt"])
def test_failure_at_each_position_truncates_the_hit(on_miss, pool, position, fault):
    writer, reader = _pair(make_config(on_miss=on_miss))
    toks = tokens(6)
    writer.backup(toks, slots(range(6)))
    key = reader.keys_for(pool, _hashes(toks))[position]
    MemoryBackend.faults = Faults(**{f"{'fail' if fault == 'fail' else 'corrupt'}_get_keys": {key}})
    r = reader.prefetch(toks, slots(range(8, 14)))
    if pool is KV or on_miss == "shorten":
        assert r.pages == position
        assert r.restored[DRAFT] == position
        assert r.draft_cold == []
    else:
        assert r.pages == 6 and r.restored[DRAFT] == position
        assert r.draft_cold == list(range(position, 6))
    assert _same(writer, reader, slots(range(r.pages)), slots(range(8, 8 + r.pages)), KV)
    assert _same(writer, reader, slots(range(r.restored[DRAFT])), slots(range(8, 8 + r.restored[DRAFT])), DRAFT)
    snap = reader.metrics.snapshot()[pool.value]
    if fault == "corrupt":
        assert snap["corrupt"] == 1
    else:
        assert snap["read_failures"] >= 1


@pytest.mark.parametrize("hook", ["page_get", "page_exists"])
def test_backend_exception_gives_no_hit_and_no_exception(hook):
    writer, reader = _pair(make_config())
    toks = tokens(4)
    writer.backup(toks, slots(range(4)))
    MemoryBackend.faults = Faults(raise_on={hook})
    r = reader.prefetch(toks, slots(range(8, 12)))
    assert r.pages == 0 and r.restored == {KV: 0, DRAFT: 0}


def test_wrong_length_results_are_failures():
    writer, reader = _pair(make_config())
    toks = tokens(4)
    MemoryBackend.faults = Faults(wrong_length={"page_set"})
    b = writer.backup(toks, slots(range(4)))
    assert b.pages_written == {KV: 0, DRAFT: 0} and b.failed == {KV: 4, DRAFT: 4}


def test_backup_failures_are_counted_per_page():
    writer, reader = _pair(make_config())
    toks = tokens(4)
    MemoryBackend.faults = Faults(fail_set_positions={DRAFT: {2}})
    b = writer.backup(toks, slots(range(4)))
    assert b.pages_written == {KV: 4, DRAFT: 3} and b.failed == {KV: 0, DRAFT: 1}
    MemoryBackend.faults = Faults()
    r = reader.prefetch(toks, slots(range(8, 12)))
    assert r.pages == 2  # the draft hole at page 2 shortens the hit


def test_timeout_is_bounded_and_reports_unreleased_slots():
    cfg = make_config(timeout_s=0.3)
    writer, reader = _pair(cfg)
    toks = tokens(4)
    writer.backup(toks, slots(range(4)))
    MemoryBackend.faults = Faults(delay_s={"page_get": 1.0})
    t0 = time.monotonic()
    op = reader.prefetch_async(toks, slots(range(8, 12)))
    r = reader.collect(op, PrefetchPolicy.WAIT_COMPLETE)
    assert time.monotonic() - t0 < 5.0
    assert r.pages == 0
    assert r.released is False
    assert op.wait_released(timeout=5.0)
    reader.close()


def test_draft_disabled_by_capability_restores_target_and_reports_draft_cold():
    backend = backend_with(caps(draft=False))
    writer, reader = _pair(make_config(), backend)
    toks = tokens(3)
    b = writer.backup(toks, slots(range(3)))
    assert b.pages_written == {KV: 3}
    r = reader.prefetch(toks, slots(range(8, 11)))
    assert (r.pages, r.restored, r.draft_cold) == (3, {KV: 3, DRAFT: 0}, [0, 1, 2])


def test_partial_prefix_and_no_pages():
    writer, reader = _pair(make_config())
    toks = tokens(6)
    writer.backup(toks[: 3 * PS + 2], slots(range(6)))  # 3 full pages (+ a partial, ignored)
    r = reader.prefetch(toks, slots(range(8, 14)))
    assert r.pages == 3 and r.hit == {KV: 3, DRAFT: 3}
    assert reader.prefetch([], []).pages == 0
    other = reader.prefetch(tokens(6, seed=9), slots(range(8, 14)))
    assert other.pages == 0


# -- ranks --------------------------------------------------------------------------------------------------


def test_mla_target_written_by_rank0_mha_draft_by_every_rank():
    space = secrets.token_hex(4)
    toks = tokens(4)
    r0 = make_controller(make_config("mla", "mha", tp_rank=0, tp_size=2), space=space)
    r1 = make_controller(make_config("mla", "mha", tp_rank=1, tp_size=2), space=space)
    fill_random(r0)
    fill_random(r1)
    b1 = r1.backup(toks, slots(range(4)))
    assert b1.not_writer == [KV] and b1.pages_written == {DRAFT: 4}
    b0 = r0.backup(toks, slots(range(4)))
    assert b0.pages_written == {KV: 4, DRAFT: 4}
    # a restarted rank 1 gets rank 0's (rank-neutral) MLA target pages and its own MHA draft shard
    again = make_controller(make_config("mla", "mha", tp_rank=1, tp_size=2), space=space)
    r = again.prefetch(toks, slots(range(8, 12)))
    assert r.pages == 4 and r.restored == {KV: 4, DRAFT: 4}
    assert _same(r0, again, slots(range(4)), slots(range(8, 12)), KV)
    assert _same(r1, again, slots(range(4)), slots(range(8, 12)), DRAFT)
    assert not _same(r0, again, slots(range(4)), slots(range(8, 12)), DRAFT)


def test_split_heads_tp2_pages_read_by_tp4_head_for_head():
    space = secrets.token_hex(4)
    toks = tokens(3)
    writers = []
    for rank in range(2):
        w = make_controller(make_config(layout="page_head", tp_rank=rank, tp_size=2, tp_lcm_size=4, kv_heads=4,
                                        draft_heads=2), space=space)
        fill_random(w)
        assert w.backup(toks, slots(range(3))).pages_written == {KV: 3, DRAFT: 3}
        writers.append(w)
    for rank in range(4):
        rd = make_controller(make_config(layout="page_head", tp_rank=rank, tp_size=4, tp_lcm_size=4, kv_heads=2,
                                         draft_heads=1), space=space)
        r = rd.prefetch(toks, slots(range(8, 11)))
        assert r.pages == 3 and r.restored == {KV: 3, DRAFT: 3}
        w = writers[rank // 2]
        part = rank % 2
        for pool_w, pool_r in ((w.target_pool, rd.target_pool), (w.draft_pool, rd.draft_pool)):
            for i in range(3):
                assert pool_w.page_bytes(slots([i])[0], part, 2) == pool_r.page_bytes(slots([8 + i])[0])


# -- background work, policies, metrics ---------------------------------------------------------------


def test_async_backup_then_prefetch_policies():
    writer, reader = _pair(make_config())
    toks = tokens(5)
    op = writer.backup_async(toks, slots(range(5)))
    assert op.result(timeout=10).pages_written == {KV: 5, DRAFT: 5}
    op = reader.prefetch_async(toks, slots(range(8, 13)))
    r = reader.collect(op, PrefetchPolicy.WAIT_COMPLETE)
    assert r.pages == 5 and r.released
    assert _same(writer, reader, slots(range(5)), slots(range(8, 13)), DRAFT)


def test_timeout_policy_returns_what_arrived():
    cfg = make_config(batch_pages=1, prefetch_timeout_s=0.25)
    writer, reader = _pair(cfg)
    toks = tokens(6)
    writer.backup(toks, slots(range(6)))
    MemoryBackend.faults = Faults(delay_s={"page_get": 0.1})
    op = reader.prefetch_async(toks, slots(range(8, 14)))
    r = reader.collect(op, PrefetchPolicy.TIMEOUT)
    assert 0 <= r.pages < 6
    assert _same(writer, reader, slots(range(r.pages)), slots(range(8, 8 + r.pages)), KV)
    assert _same(writer, reader, slots(range(r.pages)), slots(range(8, 8 + r.pages)), DRAFT)


def test_cancel_stops_between_batches():
    writer, reader = _pair(make_config(batch_pages=1))
    toks = tokens(6)
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.05})
    op = writer.backup_async(toks, slots(range(6)))
    op.cancel()
    res = op.result(timeout=10)
    assert res.pages_written[KV] < 6


def test_metrics_snapshot_counts_bytes_and_pages():
    writer, reader = _pair(make_config())
    toks = tokens(2)
    writer.backup(toks, slots(range(2)))
    reader.prefetch(toks, slots(range(8, 10)))
    w, r = writer.metrics.snapshot(), reader.metrics.snapshot()
    assert w["kv"]["pages_written"] == 2 and w["kv"]["bytes_written"] == 2 * writer.target_pool.spec.page_nbytes
    assert w["draft"]["bytes_written"] == 2 * writer.draft_pool.spec.page_nbytes
    assert r["kv"]["hits"] == 2 and r["draft"]["bytes_read"] == 2 * reader.draft_pool.spec.page_nbytes


class _RefusesDraft(MemoryBackend):
    capabilities: ClassVar[Capabilities] = caps()

    def check_registration(self, registration):
        if registration.pool is DRAFT:
            raise ValueError("draft memory cannot be registered here")


def test_backend_refusing_a_pool_disables_it_with_its_reason():
    ctrl = make_controller(make_config(), _RefusesDraft)
    assert ctrl.plan[DRAFT].path is IOPath.DISABLED
    assert "draft memory cannot be registered here" in ctrl.plan[DRAFT].reason
    ctrl.close()


def test_backend_can_provide_host_pool_memory():
    import torch

    from hicache_draft import Buffer, hookimpl

    offered: list[torch.Tensor] = []

    class Offers(MemoryBackend):
        @hookimpl
        def host_memory(self, pool, nbytes):
            t = torch.zeros(nbytes + 64, dtype=torch.uint8)
            offered.append(t)
            return Buffer(t.data_ptr(), t.numel(), owner=t)

    writer, reader = _pair(make_config(), Offers)
    assert writer.target_pool.raw.data_ptr() == offered[0].data_ptr()
    assert writer.draft_pool.raw.data_ptr() == offered[1].data_ptr()
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    assert reader.prefetch(toks, slots(range(4, 7))).pages == 3
    assert _same(writer, reader, slots(range(3)), slots(range(4, 7)), DRAFT)


def test_timed_out_backup_keeps_slots_until_the_backend_lets_go():
    writer, _ = _pair(make_config(timeout_s=0.3))
    MemoryBackend.faults = Faults(delay_s={"page_set": 1.0})
    op = writer.backup_async(tokens(2), slots(range(2)))
    res = op.result(timeout=10)
    assert res.pages_written == {KV: 0, DRAFT: 0} and res.released is False
    assert not op.wait_released(timeout=0.01)
    assert op.wait_released(timeout=5.0)
    writer.close()


# -- background operations: close and fork ---------------------------------------------------------------
def test_close_lets_queued_background_backups_finish():
    """Five backups queued behind two threads, each call slowed: close() returns once every one
    has written its pages (none is dropped while it could still run)."""
    writer, reader = _pair(make_config())
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.05})
    ops = [writer.backup_async(tokens(2, seed=i), slots(range(2 * i, 2 * i + 2))) for i in range(5)]
    writer.close()
    assert all(op.done() for op in ops)
    assert [op.result().pages_written for op in ops] == [{KV: 2, DRAFT: 2}] * 5
    MemoryBackend.faults = Faults()
    assert [reader.prefetch(tokens(2, seed=i), slots(range(12, 14))).pages for i in range(5)] == [2] * 5
    reader.close()


def test_close_answers_a_backup_that_never_started_as_dropped():
    """A backup stuck behind operations that outlive their bounds never starts: close() answers it
    (dropped, nothing written) instead of leaving its waiter hanging."""
    writer, _ = _pair(make_config(timeout_s=1.0))
    MemoryBackend.faults = Faults(delay_s={"page_set": 3.0})
    first = [writer.backup_async(tokens(2, seed=i), slots(range(2 * i, 2 * i + 2))) for i in range(2)]
    for op in first:  # both threads busy until their calls give up (1 s), past these bounds
        op.bound_s = 0.05
    late = writer.backup_async(tokens(2, seed=9), slots(range(10, 12)))
    late.bound_s = 0.05  # close() waits for each at most its bound
    t0 = time.monotonic()
    writer.close()
    assert time.monotonic() - t0 < 2.9
    res = late.result(timeout=0)
    assert res.dropped and res.pages == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_runs_background_operations():
    """The parent ran a background backup (its threads exist there only); the child's backup still
    runs (a ThreadPoolExecutor copied by fork believed its threads were there and never ran it)."""
    writer, _ = _pair(make_config())
    assert writer.backup_async(tokens(2), slots(range(2))).result(timeout=5).pages_written == {KV: 2, DRAFT: 2}

    def child() -> bool:
        return writer.backup_async(tokens(2, seed=7), slots(range(2, 4))).future.result(timeout=5).pages_written \
            == {KV: 2, DRAFT: 2}

    code = in_forked_child(child)
    writer.close()
    assert code == 0, f"the child's background backup did not run (code {code})"


@pytest.mark.parametrize("poll_us", [0, 100, 2500])
def test_the_hand_over_polls_as_long_as_the_config_says(poll_us):
    """``handover_poll_us`` reaches the store's worker threads through ``from_config`` (0: callers
    and idle threads sleep at once), and calls still answer."""
    register_backend("memory", MemoryBackend)
    try:
        cfg = make_config(handover_poll_us=poll_us, backend_options={"space": secrets.token_hex(4)})
        writer = CacheController.from_config(cfg, num_pages=16)
        reader = CacheController.from_config(cfg, num_pages=16)
        try:
            assert writer.store._workers.spin_s == pytest.approx(poll_us * 1e-6)
            fill_random(writer)
            writer.backup(tokens(2), slots(range(2)))
            assert reader.prefetch(tokens(2), slots(range(4, 6))).pages == 2
        finally:
            writer.close()
            reader.close()
    finally:
        unregister_backend("memory")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_closes_without_waiting_for_the_parents_operations():
    """A backup runs in the parent when it forks: it never runs in the child, so the child's
    close() does not wait out its bound (timeout_s x 3 here)."""
    writer, _ = _pair(make_config(timeout_s=1.0))
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.8})
    op = writer.backup_async(tokens(2), slots(range(2)))
    time.sleep(0.2)  # on its thread now, in the parent

    def child() -> bool:
        t0 = time.monotonic()
        writer.close()
        return time.monotonic() - t0 < 0.6

    code = in_forked_child(child)
    assert op.result(timeout=10).pages_written == {KV: 2, DRAFT: 2}
    writer.close()
    assert code == 0, f"the child's close waited for the parent's backup (code {code})"
