"""The core's promise, whatever a backend does: a page reported restored is exactly the page stored.

Each test here fails on the code before contract v2 (commit 00dedc1): lying backends got pages
reported restored, late calls stored or restored wrong bytes, draft keys ignored the target model,
timed-out batches did not stop a backup, ``collect`` overran its policy, and exceptions or odd result
shapes escaped into the caller.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from hicache_draft import HEADER_SIZE, Capabilities, PageResult, PageTransfer, PoolCapability, PoolKind, hookimpl
from hicache_draft.capabilities import Attention, Layout
from hicache_draft.config import PrefetchPolicy
from hicache_draft.testing import Faults, MemoryBackend
from tests.helpers import fill_random, make_config, make_controller, make_pair, slots, tokens

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
OK = PageResult.OK


pytestmark = pytest.mark.usefixtures("reset_memory_backend")


_pair = make_pair


def _pool(ctrl, kind):
    return ctrl.target_pool if kind is KV else ctrl.draft_pool


def _restored_pages_are_exact(writer, reader, res, wslots, rslots) -> None:
    """Every page the result calls restored holds the writer's bytes, in both pools."""
    for kind in (KV, DRAFT):
        n = res.restored.get(kind, 0)
        for a, b in zip(wslots[:n], rslots[:n], strict=True):
            assert _pool(writer, kind).page_bytes(a) == _pool(reader, kind).page_bytes(b), (
                f"{kind.value} page at slot {b} reported restored with wrong bytes"
            )


# -- 3. the core trusts no backend's OK ----------------------------------------------------------------


class Liar(MemoryBackend):
    """Answers OK in a chosen dishonest way (``mode``) for every page it is asked for."""

    mode: ClassVar[str] = "honest"

    def _read_one(self, pool: PoolKind, page) -> PageResult:  # noqa: ANN001
        mode = type(self).mode
        res = super()._read_one(pool, page)
        if mode == "phantom" and res is not OK:  # OK for a page it never had, buffers left as they are
            return OK
        if mode == "phantom_zero_header" and res is not OK:
            for b in page.buffers:
                b.view()[:] = bytes(b.nbytes)
            return OK
        if res is not OK:
            return res
        first = page.buffers[0].view()
        if mode == "rotten":
            first[0] ^= 0x5A
        elif mode == "partial":  # only the first half of the bytes arrived
            for b in page.buffers:
                v = b.view()
                v[v.nbytes // 2 :] = bytes(v.nbytes - v.nbytes // 2)
        elif mode == "foreign":  # another stored page, header and all, under this key
            with self.lock:
                other = next(blob for k, blob in self.data.items() if k != page.key and len(blob) >= len(first))
            page.header.view()[:] = other[:HEADER_SIZE]
            at = HEADER_SIZE
            for b in page.buffers:
                v = b.view()
                v[:] = other[at : at + v.nbytes]
                at += v.nbytes
        elif mode == "header_only_rotten":
            h = page.header.view()
            h[40] ^= 0x01
        return OK


LIES = ["phantom", "phantom_zero_header", "rotten", "partial", "foreign", "header_only_rotten"]


@pytest.mark.parametrize("generic", [False, True], ids=["zero_copy", "generic"])
@pytest.mark.parametrize("lie", LIES)
def test_a_lying_backend_never_gets_a_wrong_page_reported_restored(lie, generic):
    layouts = frozenset() if generic else frozenset(Layout)
    cap = PoolCapability(attention=frozenset(Attention), zero_copy_layouts=layouts)
    backend = type("L", (Liar,), {"capabilities": Capabilities(pools={KV: cap, DRAFT: cap}, persistent=True)})
    writer, reader = _pair(make_config(), backend)
    toks = tokens(4)
    # phantom pages: only two of the four pages are stored, yet the liar answers OK for all of them
    stored = 2 if lie.startswith("phantom") else 4
    assert writer.backup(toks[: stored * 4], slots(range(stored))).pages_written == {KV: stored, DRAFT: stored}
    if lie.startswith("phantom"):
        reader.store.page_exists = lambda queries, timeout_s=None: {p: len(k) for p, k in queries.items()}
    backend.mode = lie
    res = reader.prefetch(toks, slots(range(8, 12)))
    _restored_pages_are_exact(writer, reader, res, slots(range(4)), slots(range(8, 12)))
    assert res.pages == (stored if lie.startswith("phantom") else 0)
    assert reader.metrics.snapshot()["kv"]["corrupt"] >= 1
    writer.close()
    reader.close()


def test_store_verification_names_the_problem_once(caplog):
    backend = type("L", (Liar,), {})
    writer, reader = _pair(make_config(), backend)
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    backend.mode = "rotten"
    with caplog.at_level(logging.WARNING, logger="hicache_draft.store"):
        reader.prefetch(toks, slots(range(8, 11)))
        reader.prefetch(toks, slots(range(8, 11)))
    msgs = [r.getMessage() for r in caplog.records if "fails verification" in r.getMessage()]
    assert len(msgs) == 1 and "payload checksum mismatch" in msgs[0] and "'memory'" in msgs[0]
    assert reader.store.corrupt_pages >= 2


# -- 1. timed-out calls never store or restore wrong bytes -------------------------------------------


def test_late_zero_copy_backup_of_reused_slots_is_never_served():
    """The backend sleeps past its deadline and its grace, then reads the slots, which the caller
    has meanwhile refilled with other bytes: those bytes must never come back as the old pages."""
    cfg = make_config(timeout_s=0.2)
    writer, reader = _pair(cfg)
    toks = tokens(4)
    original = [writer.target_pool.page_bytes(s) for s in slots(range(4))]
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.8})
    t0 = time.monotonic()
    b = writer.backup(toks, slots(range(4)))
    assert time.monotonic() - t0 < 0.2 * 2 + 1.5  # the deadline plus the bounded wait for release
    assert b.pages_written == {KV: 0, DRAFT: 0} and b.released is False
    assert b.held_slots == slots(range(4)) and writer.held_slots() == slots(range(4))
    fill_random(writer)  # a careless caller reuses the slots anyway
    assert writer.wait_released(timeout=5.0) and writer.held_slots() == []
    MemoryBackend.faults = Faults()
    assert MemoryBackend.calls and len(writer.store.backend.keys()) == 8  # the late write did store
    res = reader.prefetch(toks, slots(range(8, 12)))
    for kind in (KV, DRAFT):
        for i in range(res.restored[kind]):
            got = _pool(reader, kind).page_bytes(slots(range(8, 12))[i])
            assert kind is DRAFT or got == original[i]
    assert res.pages == 0  # the late pages fail the core's header: CORRUPT, never data
    assert reader.metrics.snapshot()["kv"]["corrupt"] >= 1


def test_sync_backup_waits_for_a_late_call_within_its_grace():
    writer, reader = _pair(make_config(timeout_s=0.3))
    toks = tokens(2)
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.45})  # past the deadline, within timeout_s more
    b = writer.backup(toks, slots(range(2)))
    assert b.released is True and b.held_slots == [] and b.failed == {KV: 2, DRAFT: 2}
    MemoryBackend.faults = Faults()
    res = reader.prefetch(toks, slots(range(8, 10)))  # the late call stored the right bytes: fine to serve
    _restored_pages_are_exact(writer, reader, res, slots(range(2)), slots(range(8, 10)))


class LateWriter(MemoryBackend):
    """page_get sleeps past its deadline, then writes the stored bytes into the buffers."""

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        time.sleep(type(self).faults.delay_s.get("late_get", 0.0))
        return {t.pool: [self._read_one(t.pool, p) for p in t.pages] for t in transfers}


def test_late_zero_copy_prefetch_never_writes_after_the_slots_are_handed_back():
    writer, reader = _pair(make_config(timeout_s=0.25), LateWriter)
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    reader.target_pool.raw.zero_()
    LateWriter.faults = Faults(delay_s={"late_get": 0.4})  # past the deadline, within the grace
    res = reader.prefetch(toks, slots(range(8, 11)))
    assert res.pages == 0 and res.released is True
    after_return = reader.target_pool.raw.clone()
    time.sleep(0.4)
    assert torch.equal(reader.target_pool.raw, after_return), "the backend wrote into slots after prefetch returned"


def test_late_prefetch_beyond_the_grace_holds_its_slots():
    writer, reader = _pair(make_config(timeout_s=0.2), LateWriter)
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    LateWriter.faults = Faults(delay_s={"late_get": 1.0})
    res = reader.prefetch(toks, slots(range(8, 11)))
    assert res.pages == 0 and res.released is False and res.held_slots == slots(range(8, 11))
    assert reader.held_slots() == slots(range(8, 11))
    assert reader.wait_released(timeout=5.0) and reader.held_slots() == []


# -- 2. draft keys carry the target model -----------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["memory", "file"])
def test_draft_of_one_target_revision_is_not_restored_for_another(backend_name, tmp_path):
    from hicache_draft import CacheController, Config

    def cfg(model: str) -> Config:
        base = make_config().model_dump(mode="json")
        base["namespace"]["model"] = model
        base["namespace"]["draft_model"] = "eagle-head"
        if backend_name == "file":
            base["backend"], base["backend_options"] = "file", {"root": str(tmp_path / "root")}
        return Config.model_validate(base)

    if backend_name == "memory":
        space = secrets.token_hex(4)
        rev1, rev2 = make_controller(cfg("m@rev1"), space=space), make_controller(cfg("m@rev2"), space=space)
    else:
        rev1, rev2 = CacheController.from_config(cfg("m@rev1"), 16), CacheController.from_config(cfg("m@rev2"), 16)
    fill_random(rev1)
    toks = tokens(3)
    assert rev1.keys_for(DRAFT, ["00" * 32]) != rev2.keys_for(DRAFT, ["00" * 32])
    assert rev1.backup(toks, slots(range(3))).pages_written == {KV: 3, DRAFT: 3}
    res = rev2.prefetch(toks, slots(range(8, 11)))
    assert res.hit.get(DRAFT, 0) == 0 and res.restored.get(DRAFT, 0) == 0
    rev1.close()
    rev2.close()


# -- 4. one bound per operation -----------------------------------------------------------------------


def test_backup_stops_at_the_first_timed_out_batch():
    writer, _ = _pair(make_config(timeout_s=0.25, batch_pages=1, draft=None))
    MemoryBackend.faults = Faults(delay_s={"page_set": 0.3})
    t0 = time.monotonic()
    b = writer.backup(tokens(12), slots(range(12)))
    took = time.monotonic() - t0
    assert took < 0.25 + 0.25 + 1.0, f"12 batches after a timeout took {took:.2f}s"
    assert b.pages_written == {KV: 0} and b.failed == {KV: 12}
    assert writer.wait_released(timeout=5.0)


def test_backup_stops_after_a_batch_that_failed_entirely():
    writer, _ = _pair(make_config(batch_pages=2, draft=None))
    MemoryBackend.faults = Faults(raise_on={"page_set"})
    b = writer.backup(tokens(8), slots(range(8)))
    assert b.failed == {KV: 8}
    assert sum(1 for c in MemoryBackend.calls if c[0] == "page_set") == 1


@pytest.mark.parametrize(("policy", "bound"), [(PrefetchPolicy.BEST_EFFORT, 0.0), (PrefetchPolicy.TIMEOUT, 0.2)])
def test_collect_returns_within_its_policy_bound(policy, bound):
    writer, reader = _pair(make_config(timeout_s=2.0, prefetch_timeout_s=0.2, batch_pages=1))
    toks = tokens(4)
    writer.backup(toks, slots(range(4)))
    MemoryBackend.faults = Faults(delay_s={"page_get": 0.8})
    op = reader.prefetch_async(toks, slots(range(8, 12)))
    time.sleep(0.05)  # the first batch is in flight
    t0 = time.monotonic()
    res = reader.collect(op, policy)
    took = time.monotonic() - t0
    assert took < bound + 0.3, f"collect({policy.value}) took {took:.2f}s"
    assert res.pages == 0 and res.released is False and res.held_slots  # the batch in flight holds its slots
    assert op.wait_released(timeout=10.0)
    # nothing the cancelled operation read later was published as restored
    final = op.result(timeout=10.0)
    assert final.pages <= 1


def test_wait_complete_is_bounded_by_the_operation():
    writer, reader = _pair(make_config(timeout_s=0.2, batch_pages=2))
    toks = tokens(4)
    writer.backup(toks, slots(range(4)))
    MemoryBackend.faults = Faults(delay_s={"page_get": 5.0})
    op = reader.prefetch_async(toks, slots(range(8, 12)))
    t0 = time.monotonic()
    res = reader.collect(op, PrefetchPolicy.WAIT_COMPLETE)
    assert time.monotonic() - t0 < op.bound_s + 0.5
    assert res.pages == 0 and res.released is False


# -- 5. nothing escapes into the caller ---------------------------------------------------------------


class Raises(MemoryBackend):
    error: ClassVar[type[BaseException]] = SystemExit

    def _maybe(self, hook: str) -> None:
        raise type(self).error("injected")


@pytest.mark.parametrize("error", [SystemExit, asyncio.CancelledError, GeneratorExit])
def test_base_exceptions_from_a_backend_become_failures(error):
    backend = type("R", (Raises,), {"error": error})
    ctrl = make_controller(make_config(), backend)
    fill_random(ctrl)
    toks = tokens(2)
    b = ctrl.backup(toks, slots(range(2)))
    assert b.failed == {KV: 2, DRAFT: 2}
    r = ctrl.prefetch(toks, slots(range(8, 10)))
    assert r.pages == 0
    ctrl.close()


class WrongShape(MemoryBackend):
    shape: ClassVar[object] = None

    @hookimpl
    def page_set(self, transfers):  # noqa: ANN001, ANN201
        return type(self).shape

    @hookimpl
    def page_get(self, transfers):  # noqa: ANN001, ANN201
        return type(self).shape

    @hookimpl
    def page_exists(self, queries):  # noqa: ANN001, ANN201
        return type(self).shape


@pytest.mark.parametrize("shape", [[PageResult.OK], 7, "OK", {KV: 3}, {KV: "OK"}])
def test_wrong_result_shapes_become_failures_logged_once_with_the_backend_name(shape, caplog):
    backend = type("W", (WrongShape,), {"shape": shape})
    ctrl = make_controller(make_config(draft=None), backend)
    fill_random(ctrl)
    with caplog.at_level(logging.WARNING, logger="hicache_draft.store"):
        for _ in range(2):
            assert ctrl.backup(tokens(2), slots(range(2))).pages_written == {KV: 0}
            assert ctrl.prefetch(tokens(2), slots(range(8, 10))).pages == 0
    msgs = [r.getMessage() for r in caplog.records if "page_set" in r.getMessage()]
    assert len(msgs) == 1 and "'memory'" in msgs[0]
    ctrl.close()


class Listens(Liar):
    heard: ClassVar[list[dict]] = []

    @hookimpl
    def page_rejected(self, rejected):  # noqa: ANN001, ANN201
        type(self).heard.append({p: list(k) for p, k in rejected.items()})
        with self.lock:
            for keys in rejected.values():
                for k in keys:
                    self.data.pop(k, None)


def test_the_backend_hears_which_pages_failed_verification_and_can_drop_them():
    Listens.heard = []
    writer, reader = _pair(make_config(draft=None), Listens)
    toks = tokens(2)
    writer.backup(toks, slots(range(2)))
    Listens.mode = "rotten"
    assert reader.prefetch(toks, slots(range(8, 10))).pages == 0
    deadline = time.monotonic() + 5
    while not Listens.heard and time.monotonic() < deadline:
        time.sleep(0.01)
    keys = writer.keys_for(KV, __import__("hicache_draft").page_hashes(toks, 4))
    assert Listens.heard and Listens.heard[0][KV] == keys
    Listens.mode = "honest"
    assert reader.store.page_exists({KV: keys}) == {KV: 0}  # dropped: a clean miss, and storable again
    assert writer.backup(toks, slots(range(2))).pages_written == {KV: 2}
    assert reader.prefetch(toks, slots(range(8, 10))).pages == 2


class Announces(MemoryBackend):
    """Reports pages finished as it goes (with some nonsense indices too), optionally rotten."""

    rot: ClassVar[set[int]] = set()
    announced: ClassVar[list[int]] = []

    @hookimpl
    def page_get(self, transfers, finished):  # noqa: ANN001, ANN201
        out = {}
        for t in transfers:
            res = []
            for i, p in enumerate(t.pages):
                r = self._read_one(t.pool, p)
                if r is OK and i in type(self).rot:
                    p.buffers[0].view()[0] ^= 0xFF
                finished(t.pool, [i, -1, 10_000, "x"])
                type(self).announced.append(i)
                res.append(r)
            out[t.pool] = res
        return out


def test_pages_announced_finished_are_verified_early_and_still_judged():
    Announces.rot, Announces.announced = {1}, []
    writer, reader = _pair(make_config(draft=None, batch_pages=8), Announces)
    toks = tokens(4)
    writer.backup(toks[:12], slots(range(3)))  # page 3 never stored: a MISS that was announced finished
    res = reader.prefetch(toks, slots(range(8, 12)))
    assert Announces.announced[:3] == [0, 1, 2]
    assert res.pages == 1 and reader.metrics.snapshot()["kv"]["corrupt"] == 1
    _restored_pages_are_exact(writer, reader, res, slots(range(4)), slots(range(8, 12)))
    Announces.rot = set()
    assert reader.prefetch(toks, slots(range(8, 12))).pages == 3


class ExitsOnStart(MemoryBackend):
    def __init__(self, options, context):  # noqa: ANN001
        raise SystemExit("the transport library called exit()")


def test_a_backend_that_exits_in_its_constructor_is_a_setup_error():
    from hicache_draft import BackendSetupError, Store

    with pytest.raises(BackendSetupError, match="SystemExit: the transport library called exit"):
        Store("memory", ExitsOnStart, ExitsOnStart.capabilities, {})


def test_collect_on_the_generic_path_releases_at_once_even_while_the_call_runs():
    """Generic pages travel in the controller's staging memory: a call still in flight holds no host slot."""
    cap = PoolCapability(attention=frozenset(Attention), zero_copy_layouts=frozenset())
    backend = type("G", (MemoryBackend,), {"capabilities": Capabilities(pools={KV: cap, DRAFT: cap}, persistent=True)})
    writer, reader = _pair(make_config(timeout_s=2.0, batch_pages=1), backend)
    toks = tokens(3)
    writer.backup(toks, slots(range(3)))
    MemoryBackend.faults = Faults(delay_s={"page_get": 0.5})
    op = reader.prefetch_async(toks, slots(range(8, 11)))
    time.sleep(0.05)
    res = reader.collect(op, PrefetchPolicy.BEST_EFFORT)
    assert res.pages == 0 and res.released is True and res.held_slots == []
    op.result(timeout=10)
