"""The conformance suite every storage backend runs.

Subclass :class:`ConformanceSuite` in a test module and provide a ``backend_factory`` fixture that
returns a zero-argument callable building a fresh :class:`~hicache_draft.Store` over the *same*
underlying storage each time it is called (so persistence can be checked across instances)::

    import pytest
    from hicache_draft import Store
    from hicache_draft.testing import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        @pytest.fixture
        def backend_factory(self, tmp_path):
            return lambda: Store.open("mine", {"root": str(tmp_path)})

The suite reads the store's declared capabilities and tests exactly what is declared. Its pools
are those of :data:`KIT_POOLS` whose role (target ``kv`` or ``draft``) and component (``kv``,
``indexer``, ``window``, ``state``) the backend declares: SGLang's ``kv``, ``draft``,
``indexer``, ``draft_indexer``, ``swa``, ``draft_swa`` and ``mamba``, and ``draft_mamba``, a name
SGLang does not have. Each is tried in every declared attention type (``kv`` / ``window``) or
its row geometry (``indexer``: one array; ``state``: several, wrapped as separate tensors or in
one allocation), in every layout, on the path the core's binding plans for it (zero-copy or
generic) and on the generic path too. Pools are built and registered, and their pages made,
by the core's :class:`~hicache_draft.PoolBinding` (:func:`~hicache_draft.plan_binding`), as the
controller and the SGLang adapter do.

Cases: byte-exact round trips, every pool of a prefix in one call, prefix-existence semantics,
per-page results when part of a batch fails, key isolation between pools (of other names and
components), ranks and namespaces, deadlines and late calls, persistence across a fresh instance
(when declared; never wrong data when not), refusal of roles and attention types it does not
declare, and of components it does not declare (refused, or at least never stored as another
pool's). The backend's own answers are recorded before the core's verification and judged.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from hicache_draft.backend import StorageBackend
from hicache_draft.binding import Batch, BindingPlan, PoolBinding, plan_binding
from hicache_draft.capabilities import Attention, Capabilities, Component, IOPath, Layout, PoolKind
from hicache_draft.config import ParallelConfig
from hicache_draft.errors import BackendSetupError
from hicache_draft.hookspecs import API_VERSION, hookimpl
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft.store import Store, _EarlyVerifier, _HeaderMaker, _RecordWriter
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer

PAGE_SIZE = 4
NUM_PAGES = 16
OK = PageResult.OK
MODEL = "conformance-model"
DRAFT_MODEL = "conformance-draft"
SOLO = ParallelConfig()


@dataclass(frozen=True)
class KitPool:
    """A pool the kit builds: its name, role and component, and its row geometry (row
    components: bytes of one page in one layer, per array; ``wrapped``: the arrays are separate
    tensors, as SGLang's Mamba host pool hands them over, rather than one allocation)."""

    name: str
    role: PoolKind
    component: Component
    rows: tuple[int, ...] = ()
    wrapped: bool = False


KIT_POOLS: tuple[KitPool, ...] = (
    KitPool("kv", PoolKind.KV, Component.KV),
    KitPool("draft", PoolKind.DRAFT, Component.KV),
    KitPool("indexer", PoolKind.KV, Component.INDEXER, rows=(36,)),
    KitPool("draft_indexer", PoolKind.DRAFT, Component.INDEXER, rows=(36,)),
    KitPool("swa", PoolKind.KV, Component.WINDOW),
    KitPool("draft_swa", PoolKind.DRAFT, Component.WINDOW),
    KitPool("mamba", PoolKind.KV, Component.STATE, rows=(40, 24), wrapped=True),
    KitPool("draft_mamba", PoolKind.DRAFT, Component.STATE, rows=(40, 8, 24)),
)
"""Every pool the kit tries, when the backend declares its role and component."""


def kit_pool(name: str) -> KitPool:
    return next(p for p in KIT_POOLS if p.name == name)


def _layouts(attention: Attention | None) -> list[Layout]:
    return [lay for lay in Layout if not (attention is not Attention.MHA and lay is Layout.PAGE_HEAD)]


def make_spec(
    pool: KitPool | str, attention: Attention | None, layout: Layout, layers: int = 2, name: str | None = None
) -> PoolSpec:
    """The kit's shape of ``pool`` (``attention`` None for row components); ``name``: the same
    pool under another name (role and component given, so any name is a pool)."""
    p = kit_pool(pool) if isinstance(pool, str) else pool
    rows = not p.component.has_attention
    return PoolSpec(
        kind=name or p.name, attention=None if rows else attention, layers=layers, page_size=PAGE_SIZE,
        dtype="uint8" if rows else "float16", layout=layout, kv_heads=0 if rows else 2, head_dim=0 if rows else 8,
        latent_dim=0 if rows else 24, rows=p.rows, role=p.role, component=p.component,
    )


def kit_plan(
    spec: PoolSpec, caps: Capabilities, *, model: str | None = None, target: str = MODEL,
    parallel: ParallelConfig = SOLO,
) -> BindingPlan:
    """The core's plan of ``spec`` for this backend (draft-role pools: the draft model over ``target``)."""
    if model is None:
        model = DRAFT_MODEL if spec.role is PoolKind.DRAFT else target
    return plan_binding(spec, caps, parallel, model=model, target_model=target)


@dataclass(frozen=True)
class Case:
    """One way of moving one pool's pages: its shape (name, attention or rows, layout) and path."""

    pool: KitPool
    spec: PoolSpec
    zero_copy: bool

    @property
    def name(self) -> str:
        return self.spec.kind

    @property
    def id(self) -> str:
        shape = self.spec.attention.value if self.spec.attention is not None else "rows" + "x".join(
            map(str, self.spec.rows))
        return f"{self.name}-{shape}-{self.spec.layout.value}-{'zc' if self.zero_copy else 'generic'}"


def declared_cases(caps: Capabilities) -> list[Case]:
    """Every (pool, attention or rows, layout, path) combination the declaration promises: the
    path each shape gets from the core's plan, and the generic path of each attention type (or
    row geometry) when declared."""
    out: list[Case] = []
    for kp in KIT_POOLS:
        if not caps.holds(kp.role, kp.component):
            continue
        cap = caps.pools[kp.role]
        attentions: list[Attention | None] = sorted(cap.attention) if kp.component.has_attention else [None]
        for att in attentions:
            generic = False
            for lay in _layouts(att):
                spec = make_spec(kp, att, lay)
                path = kit_plan(spec, caps).path
                if path is not IOPath.DISABLED:
                    out.append(Case(kp, spec, path is IOPath.ZERO_COPY))
                    generic |= path is IOPath.GENERIC
            if cap.generic and not generic:
                out.append(Case(kp, make_spec(kp, att, Layout.LAYER_FIRST), False))
    return out


def random_groups(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


def _slots(indices: Sequence[int]) -> list[int]:
    return [i * PAGE_SIZE for i in indices]


def _host(spec: PoolSpec, wrapped: bool) -> HostPool:
    if not wrapped:
        return HostPool(spec, NUM_PAGES)
    arrays = [torch.zeros((NUM_PAGES, spec.layers, 1, r) if spec.layout is not Layout.LAYER_FIRST
                          else (spec.layers, NUM_PAGES, r), dtype=torch.uint8) for r in spec.rows]
    return HostPool.wrap_arrays(spec, arrays)


class PoolRig:
    """One pool of the kit: a host pool filled with random bytes, bound through the core's
    :class:`~hicache_draft.PoolBinding` (its registration, keys and pages) on the case's path.

    ``spec``, ``model``, ``target`` and ``parallel`` make the same pool of another shape, name,
    model or rank (keys that must never meet the case's); ``plan``: bind this plan instead."""

    def __init__(
        self, case: Case, caps: Capabilities, *, spec: PoolSpec | None = None, model: str | None = None,
        target: str = MODEL, parallel: ParallelConfig = SOLO, plan: BindingPlan | None = None, fill: bool = True,
    ) -> None:
        self.case = case
        self.spec = spec or case.spec
        if plan is None:
            plan = kit_plan(self.spec, caps, model=model, target=target, parallel=parallel)
            if not case.zero_copy or plan.path is IOPath.DISABLED:  # the generic case, or an undeclared pool
                plan = replace(plan, path=IOPath.GENERIC, reason="the conformance kit's generic case")
        self.host = _host(self.spec, case.pool.wrapped)
        for a in self.host.arrays:
            flat = a.view(-1).view(torch.uint8)
            if fill:
                flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
            else:
                flat.zero_()
        self.binding = PoolBinding(plan, self.host)

    @property
    def pool(self) -> str:
        return self.binding.name

    @property
    def namespace(self) -> str:
        return self.binding.namespaces[0]

    def keys(self, groups: Sequence[str]) -> list[str]:
        return self.binding.keys(groups)

    def reader(self, caps: Capabilities) -> PoolRig:
        """A zeroed pool of the same shape, plan and keys."""
        return PoolRig(self.case, caps, spec=self.spec, plan=self.binding.plan, fill=False)

    def register(self, store: Store) -> None:
        store.register_pool(self.binding.registration())

    def batch(self, groups: Sequence[str], idx: Sequence[int], fill: bool) -> Batch:
        """The pages of ``groups`` at pages ``idx``; ``fill``: copy the pool's bytes into staging (set)."""
        return self.binding.slot_batch(groups, _slots(idx), fill=fill)

    def pages(self, groups: Sequence[str], idx: Sequence[int], fill: bool) -> list[Page]:
        return list(self.batch(groups, idx, fill).transfer.pages)

    def transfer(self, pages: Sequence[Page]) -> PageTransfer:
        return PageTransfer(self.pool, pages, self.binding.zero_copy)

    def page_bytes(self, page: Page) -> bytes:
        return b"".join(bytes(b.view()) for b in page.buffers)

    def host_bytes(self, index: int) -> bytes:
        return self.host.page_bytes(index * PAGE_SIZE)


class RawAnswers:
    """An observer registered next to the backend under test: it records what the backend itself
    answered, before the core's verification (which would otherwise turn a lie into ``CORRUPT`` and
    hide it), and can hold a call at its start until released (to make a call late on purpose)."""

    def __init__(self) -> None:
        self.answers: list[tuple[str, object]] = []
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def last(self, hook: str) -> Any:  # noqa: ANN401
        with self._lock:
            return next(a for h, a in reversed(self.answers) if h == hook)

    def _wrap(self, hook: str) -> Generator[None, object, object]:
        gate = self.gate
        if gate is not None:
            gate.wait(timeout=30)
        answer = yield
        with self._lock:
            self.answers.append((hook, answer))
        return answer

    @hookimpl(wrapper=True)
    def page_set(self) -> Generator[None, object, object]:
        return (yield from self._wrap("page_set"))

    @hookimpl(wrapper=True)
    def page_get(self) -> Generator[None, object, object]:
        return (yield from self._wrap("page_get"))

    @hookimpl(wrapper=True)
    def page_exists(self) -> Generator[None, object, object]:
        return (yield from self._wrap("page_exists"))


def raw_answers(store: Store) -> RawAnswers:
    """The :class:`RawAnswers` observer of ``store`` (registered on first use)."""
    found = store.pm.get_plugin("kit:raw-answers")
    if found is None:
        found = RawAnswers()
        store.pm.register(found, name="kit:raw-answers")
    assert isinstance(found, RawAnswers)
    return found


class ConformanceSuite:
    """Contract tests for a backend. Provide the ``backend_factory`` fixture (see module docs).

    Every case runs for every declared pool (role and component), attention type or row geometry
    and layout (and the generic path), and judges the backend's own answers (recorded before the
    core's verification), so a backend that would only be saved by the core's checks still fails.
    """

    #: bound on a call whose deadline has already passed (seconds), for the deadline case
    deadline_grace_s: float = 2.0

    @pytest.fixture
    def backend_factory(self) -> Callable[[], Store]:  # pragma: no cover - must be overridden
        raise NotImplementedError("a ConformanceSuite subclass must define the 'backend_factory' fixture")

    @pytest.fixture
    def store(self, backend_factory: Callable[[], Store]) -> Iterator[Store]:
        s = backend_factory()
        raw_answers(s)  # record the backend's own answers from the first call on
        try:
            yield s
        finally:
            s.close()

    # -- helpers ------------------------------------------------------------------------------
    def _cases(self, store: Store) -> list[Case]:
        cases = declared_cases(store.capabilities)
        assert cases, "the backend declares no usable (pool, attention, layout) combination"
        return cases

    def _one_per_pool(self, store: Store) -> list[Case]:
        """The first case of every declared pool (name)."""
        first: dict[str, Case] = {}
        for c in self._cases(store):
            first.setdefault(c.name, c)
        return list(first.values())

    def _rig(self, store: Store, case: Case, **kw: Any) -> PoolRig:  # noqa: ANN401
        raw_answers(store)
        rig = PoolRig(case, store.capabilities, **kw)
        rig.register(store)
        return rig

    def _write(self, store: Store, rig: PoolRig, groups: list[str], idx: list[int]) -> list[Page]:
        pages = rig.pages(groups, idx, fill=True)
        res = store.page_set([rig.transfer(pages)])
        assert res[rig.pool] == [OK] * len(pages), f"{rig.case.id}: page_set results {res}"
        return pages

    def _read(
        self, store: Store, rig: PoolRig, groups: list[str], idx: list[int], strict: bool = True
    ) -> tuple[list[Page], list[PageResult]]:
        """Read into a second, zeroed pool of the same shape. ``strict``: return the backend's own
        answers, which the core's verified results must equal (a page the backend called OK that
        fails verification is a backend bug); otherwise return the core's verified results."""
        rec = raw_answers(store)
        reader = rig.reader(store.capabilities)
        reader.register(store)
        pages = reader.pages(groups, idx, fill=False)
        res, done = store.page_get([reader.transfer(pages)])
        assert done.done()
        if not strict:
            return pages, res[rig.pool]
        raw = _results(rec.last("page_get"), rig.pool, len(pages), rig.case.id)
        assert res[rig.pool] == raw, (
            f"{rig.case.id}: the backend answered {raw} but the core's verification found {res[rig.pool]}"
        )
        return pages, raw

    def _exists(self, store: Store, pool: str, keys: list[str]) -> int:
        rec = raw_answers(store)
        counts = store.page_exists({pool: keys})
        if keys:
            answer = rec.last("page_exists")
            assert isinstance(answer, Mapping) and answer.get(pool) == counts[pool], (
                f"page_exists answered {answer!r} for {len(keys)} keys of pool {pool}"
            )
        return counts[pool]

    # -- declaration ----------------------------------------------------------------------------
    def test_declaration_is_valid(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, Capabilities)
        assert PoolKind.KV in caps.pools
        assert all(Component.KV in cap.components for cap in caps.pools.values())
        assert isinstance(store.backend, StorageBackend)
        assert store.backend.api_version == API_VERSION

    # -- round trips --------------------------------------------------------------------------
    def test_round_trip_every_declared_case(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(5)
            written = self._write(store, rig, groups, [0, 3, 7, 8, 15])
            reader = rig.reader(store.capabilities)
            reader.register(store)
            batch = reader.batch(groups, [1, 2, 4, 5, 6], fill=False)
            res, _ = store.page_get([batch.transfer])
            raw = _results(raw_answers(store).last("page_get"), rig.pool, 5, case.id)
            assert raw == res[rig.pool] == [OK] * 5, f"{case.id}: backend {raw}, verified {res[rig.pool]}"
            for w, r in zip(written, batch.transfer.pages, strict=True):
                assert rig.page_bytes(r) == rig.page_bytes(w), f"{case.id}: bytes differ"
            assert reader.binding.finish_get(batch, res[rig.pool]) == [True] * 5
            for src, dst in zip([0, 3, 7, 8, 15], [1, 2, 4, 5, 6], strict=True):
                assert reader.host_bytes(dst) == rig.host_bytes(src), f"{case.id}: host page {dst} differs"

    def test_all_pools_of_a_prefix_in_one_call(self, store: Store) -> None:
        """One page_set, one page_exists and one page_get carry every declared pool's pages of
        the same prefix (the same page groups), and each pool gets its own bytes back."""
        rigs = [self._rig(store, c) for c in self._one_per_pool(store)]
        groups = random_groups(3)
        transfers = [r.transfer(r.pages(groups, [0, 1, 2], fill=True)) for r in rigs]
        res = store.page_set(transfers)
        for r in rigs:
            assert res[r.pool] == [OK] * 3, f"{r.case.id}: {res[r.pool]}"
        counts = store.page_exists({r.pool: r.keys(groups) for r in rigs})
        assert counts == {r.pool: 3 for r in rigs}
        readers = [r.reader(store.capabilities) for r in rigs]
        for rd in readers:
            rd.register(store)
        reads = [rd.transfer(rd.pages(groups, [5, 6, 7], fill=False)) for rd in readers]
        got, _ = store.page_get(reads)
        raw = raw_answers(store).last("page_get")
        for r, rd, t, back in zip(rigs, readers, transfers, reads, strict=True):
            assert _results(raw, r.pool, 3, r.case.id) == got[r.pool] == [OK] * 3, f"{r.case.id}: {got[r.pool]}"
            for src, dst in zip(t.pages, back.pages, strict=True):
                assert rd.page_bytes(dst) == r.page_bytes(src), f"{r.case.id}: another pool's bytes"

    def test_large_batch(self, store: Store) -> None:
        for case in self._one_per_pool(store):
            rig = self._rig(store, case)
            groups = random_groups(128)
            idx = [i % NUM_PAGES for i in range(128)]
            self._write(store, rig, groups, idx)
            _, res = self._read(store, rig, groups, idx)
            assert res == [OK] * 128, f"{case.id}: {res}"

    # -- existence ------------------------------------------------------------------------------
    def test_exists_counts_leading_stored_pages(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(7)
            keys = rig.keys(groups)
            pool = rig.pool
            assert self._exists(store, pool, keys) == 0, f"{case.id}: claims pages never stored"
            self._write(store, rig, groups[:3], [0, 1, 2])
            self._write(store, rig, groups[4:6], [4, 5])  # a hole at index 3, then two stored, then one never
            assert self._exists(store, pool, keys) == 3, f"{case.id}: must stop at the hole at index 3"
            assert self._exists(store, pool, keys[:2]) == 2, f"{case.id}: more than the keys asked for"
            assert self._exists(store, pool, keys[3:]) == 0, f"{case.id}: a missing first key means 0"
            assert self._exists(store, pool, keys[4:]) == 2, f"{case.id}: stops at the never-stored key"
            assert self._exists(store, pool, []) == 0

    def test_exists_never_claims_another_namespace_or_pool(self, store: Store) -> None:
        others = self._one_per_pool(store)
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(3)
            self._write(store, rig, groups, [0, 1, 2])
            for o in _others(rig, store.capabilities):
                assert self._exists(store, o.pool, o.keys(groups)) == 0, (
                    f"{case.id}: claims the pages of namespace {o.namespace} (pool {o.pool!r})")
            for other in others:
                if other.name == rig.pool:
                    continue
                o = PoolRig(other, store.capabilities, fill=False)  # the same prefix in another pool
                assert self._exists(store, o.pool, o.keys(groups)) == 0, (
                    f"{case.id}: pool {o.pool!r} claims the pages of pool {rig.pool!r}")
                n = self._exists(store, o.pool, rig.keys(groups))  # this pool's keys asked for under another
                assert n in (0, 3), f"{case.id}: existence under pool {o.pool!r} answered {n}"

    # -- per-page results -------------------------------------------------------------------------
    def test_missing_pages_are_misses_in_a_mixed_batch(self, store: Store) -> None:
        """Never-stored pages are MISS (an OK for them is a phantom page), at their own positions."""
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(4)
            written = self._write(store, rig, [groups[0], groups[2]], [0, 2])
            pages, res = self._read(store, rig, groups, [8, 9, 10, 11])
            assert res == [OK, PageResult.MISS, OK, PageResult.MISS], f"{case.id}: {res}"
            assert rig.page_bytes(pages[0]) == rig.page_bytes(written[0])
            assert rig.page_bytes(pages[2]) == rig.page_bytes(written[1])

    def test_results_follow_the_order_of_the_request(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(6)
            written = dict(zip(groups, self._write(store, rig, groups, list(range(6))), strict=True))
            missing = random_groups(2)
            order = [groups[4], missing[0], groups[0], groups[5], missing[1], groups[2], groups[1]]
            pages, res = self._read(store, rig, order, [8, 9, 10, 11, 12, 13, 14])
            want = [PageResult.MISS if g in missing else OK for g in order]
            assert res == want, f"{case.id}: results {res} for the request order {want}"
            for g, p in zip(order, pages, strict=True):
                if g in written:
                    assert rig.page_bytes(p) == rig.page_bytes(written[g]), f"{case.id}: bytes out of order"

    def test_wrong_size_destination_fails_only_that_page(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(3)
            written = self._write(store, rig, groups, [0, 1, 2])
            for factor in (0.5, 2.0):
                reader = rig.reader(store.capabilities)
                reader.register(store)
                pages = reader.pages(groups, [4, 5, 6], fill=False)
                odd = torch.zeros(max(1, int(pages[1].nbytes * factor)), dtype=torch.uint8)
                pages[1] = Page(pages[1].key, pages[1].group, pages[1].namespace,
                                (Buffer(odd.data_ptr(), odd.numel(), odd),))
                res, _ = store.page_get([reader.transfer(pages)])
                raw = _results(raw_answers(store).last("page_get"), rig.pool, 3, case.id)
                assert raw[0] == OK and raw[2] == OK, f"{case.id}: {raw}"
                assert raw[1] != OK, f"{case.id}: a destination of {odd.numel()} bytes for a " \
                                     f"{rig.spec.page_nbytes}-byte page was answered OK"
                assert res[rig.pool][1] != OK
                assert rig.page_bytes(pages[0]) == rig.page_bytes(written[0])
                assert rig.page_bytes(pages[2]) == rig.page_bytes(written[2])

    def test_rewrite_of_a_stored_key_is_ok(self, store: Store) -> None:
        for case in self._one_per_pool(store):
            rig = self._rig(store, case)
            groups = random_groups(2)
            first = self._write(store, rig, groups, [0, 1])
            self._write(store, rig, groups, [0, 1])
            pages, res = self._read(store, rig, groups, [2, 3])
            assert res == [OK, OK], f"{case.id}: {res}"
            assert [rig.page_bytes(p) for p in pages] == [rig.page_bytes(p) for p in first]

    # -- isolation ----------------------------------------------------------------------------------
    def test_keys_are_isolated_between_pools_ranks_and_namespaces(self, store: Store) -> None:
        """Another model's, rank's, pool name's or shape's page never comes back: the backend answers MISS."""
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(2)
            self._write(store, rig, groups, [0, 1])
            for o in _others(rig, store.capabilities):
                o.register(store)
                res, _ = store.page_get([o.batch(groups, [4, 5], fill=False).transfer])
                raw = _results(raw_answers(store).last("page_get"), o.pool, 2, case.id)
                assert raw == [PageResult.MISS] * 2, (
                    f"{case.id}: namespace {o.namespace} (pool {o.pool!r}) got {raw} for another's pages")
                assert all(r != OK for r in res[o.pool])

    def test_pools_of_one_prefix_never_see_each_other(self, store: Store) -> None:
        """The pages of one prefix in pools of other names and components share their groups: each
        pool answers only for its own. Written one pool at a time, the others miss; written all,
        every pool reads its own bytes."""
        cases = self._one_per_pool(store)
        groups = random_groups(2)
        rigs = [self._rig(store, c) for c in cases]
        for i, rig in enumerate(rigs):
            self._write(store, rig, groups, [0, 1])
            for later in rigs[i + 1 :]:
                assert self._exists(store, later.pool, later.keys(groups)) == 0, (
                    f"pool {later.pool!r} claims pages only pool {rig.pool!r} holds")
                _, res = self._read(store, later, groups, [4, 5])
                assert res == [PageResult.MISS] * 2, f"pool {later.pool!r} got {res} for pool {rig.pool!r}'s pages"
        for rig in rigs:
            pages, res = self._read(store, rig, groups, [8, 9])
            assert res == [OK, OK], f"{rig.case.id}: {res} after every pool of the prefix was written"
            assert [rig.page_bytes(p) for p in pages] == [rig.host_bytes(0), rig.host_bytes(1)], (
                f"{rig.case.id}: another pool's bytes under this pool's keys")

    # -- deadlines and late calls --------------------------------------------------------------------
    def test_a_call_past_its_deadline_returns_promptly(self, store: Store) -> None:
        """Called with a deadline already passed, each hook returns within ``deadline_grace_s``
        with results of the right shape (whatever they say), and the store works afterwards."""
        for case in self._one_per_pool(store):
            rig = self._rig(store, case)
            groups = random_groups(32)
            pages = rig.pages(groups, [i % NUM_PAGES for i in range(32)], fill=True)
            for hook in ("page_set", "page_get"):
                caps = store.capabilities
                writes = hook == "page_set" and caps.writes_records  # the core writes the records
                on_demand = hook == "page_set" and not writes and caps.headers_on_demand  # ... or headers when asked
                transfers = store.attach_headers([rig.transfer(pages)],
                                                 made=hook == "page_set" and not writes and not on_demand)
                t0 = time.monotonic()
                deadline = time.monotonic() - 1.0
                early = _EarlyVerifier(store, transfers, deadline)
                extra: dict[str, object] = (
                    {"finished": early.finished, "read_records": early.read_records, "read_runs": early.read_runs}
                    if hook == "page_get" else
                    {"write_records": (rec := _RecordWriter(transfers, deadline)).write_records if writes else None,
                     "write_runs": rec.write_runs if writes else None,
                     "make_headers": _HeaderMaker(transfers, deadline).make_headers if on_demand else None}
                )
                answer = getattr(store.pm.hook, hook)(transfers=transfers, deadline=deadline, **extra)
                took = time.monotonic() - t0
                assert took < self.deadline_grace_s, f"{case.id}: {hook} ran {took:.2f}s past its deadline"
                _results(answer, rig.pool, len(pages), case.id)
            t0 = time.monotonic()
            store.pm.hook.page_exists(queries={rig.pool: [p.key for p in pages]}, deadline=time.monotonic() - 1.0)
            assert time.monotonic() - t0 < self.deadline_grace_s
            self._write(store, rig, groups[:2], [0, 1])
            assert self._read(store, rig, groups[:2], [2, 3])[1] == [OK, OK]

    def test_a_late_write_of_reused_memory_is_never_served(self, store: Store) -> None:
        """A page_set held past its deadline, then run after the caller reused the memory: the
        backend must store the core's header (made before the call), so the late bytes come back
        as a miss or corrupt, never as the page."""
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(2)
            pages = rig.pages(groups, [0, 1], fill=True)
            before = [rig.page_bytes(p) for p in pages]
            raw = raw_answers(store)
            raw.gate = threading.Event()
            try:
                rep = store.call("page_set", [rig.transfer(pages)], timeout_s=0.05)
                assert rep.outcome == "timeout"
                for p in pages:  # the caller reuses the memory (never do this while released is pending)
                    for b in p.buffers:
                        v = b.view()
                        v[:] = bytes(x ^ 0xA5 for x in v)
            finally:
                raw.gate.set()
                raw.gate = None
            rep.released.result(timeout=60)
            got, res = self._read(store, rig, groups, [8, 9], strict=False)
            for p, b, r in zip(got, before, res, strict=True):
                assert r != OK or rig.page_bytes(p) == b, f"{case.id}: late bytes served as the page"

    def test_buffers_are_untouched_once_a_call_has_let_go(self, store: Store) -> None:
        for case in self._one_per_pool(store):
            rig = self._rig(store, case)
            groups = random_groups(4)
            self._write(store, rig, groups, [0, 1, 2, 3])
            reader = rig.reader(store.capabilities)
            reader.register(store)
            pages = reader.pages(groups, [8, 9, 10, 11], fill=False)
            raw = raw_answers(store)
            raw.gate = threading.Event()
            try:
                rep = store.call("page_get", [reader.transfer(pages)], timeout_s=0.05)
                assert rep.outcome == "timeout" and all(r is PageResult.FAILED for r in rep.results[rig.pool])
            finally:
                raw.gate.set()
                raw.gate = None
            rep.released.result(timeout=60)
            snapshot = [reader.page_bytes(p) for p in pages]
            time.sleep(0.2)
            assert [reader.page_bytes(p) for p in pages] == snapshot, f"{case.id}: buffers written after the call"

    # -- persistence -------------------------------------------------------------------------------
    def test_fresh_instance_returns_stored_bytes_or_misses(
        self, backend_factory: Callable[[], Store], store: Store
    ) -> None:
        rigs = [self._rig(store, c) for c in self._cases(store)]
        groups_of = [random_groups(3) for _ in rigs]  # equal keys must mean equal bytes: fresh groups per rig
        written = [self._write(store, r, g, [0, 1, 2]) for r, g in zip(rigs, groups_of, strict=True)]
        persistent = store.capabilities.persistent
        fresh = backend_factory()
        try:
            for rig, src, groups in zip(rigs, written, groups_of, strict=True):
                reader = rig.reader(fresh.capabilities)
                reader.register(fresh)
                batch = reader.batch(groups, [8, 9, 10], fill=False)
                res, _ = fresh.page_get([batch.transfer])
                for p, s, r in zip(batch.transfer.pages, src, res[rig.pool], strict=True):
                    if persistent:
                        assert r == OK, f"{rig.case.id}: declared persistent but a fresh instance got {r!r}"
                    if r == OK:
                        assert rig.page_bytes(p) == rig.page_bytes(s), f"{rig.case.id}: wrong bytes after reopen"
                reader.binding.finish_get(batch, res[rig.pool])
                for i, r in enumerate(res[rig.pool]):
                    if r == OK:
                        assert reader.host_bytes(8 + i) == rig.host_bytes(i), f"{rig.case.id}: host page {8 + i}"
        finally:
            fresh.close()

    # -- refusal -------------------------------------------------------------------------------------
    def test_refuses_what_it_does_not_declare(self, store: Store) -> None:
        """Undeclared roles and attention types are refused at registration. An undeclared
        component (the core never sends one) is refused, or else kept apart: its pages are never
        answered as another pool's, nor another pool's as its."""
        caps = store.capabilities
        refused = 0
        for kp in KIT_POOLS:
            cap = caps.pools.get(kp.role)
            atts: list[Attention | None] = list(Attention) if kp.component.has_attention else [None]
            for att in atts:
                spec = make_spec(kp, att, _layouts(att)[0])
                rig = PoolRig(Case(kp, spec, False), caps)
                if cap is None or (att is not None and att not in cap.attention and kp.component in cap.components):
                    with pytest.raises(BackendSetupError):
                        rig.register(store)
                    refused += 1
                elif kp.component not in cap.components:
                    self._undeclared_component_is_kept_apart(store, rig)
                    refused += 1
        if refused == 0:  # everything declared: a registration of a declared pool must succeed
            PoolRig(self._cases(store)[0], caps).register(store)

    def _undeclared_component_is_kept_apart(self, store: Store, rig: PoolRig) -> None:
        try:
            rig.register(store)
        except BackendSetupError:
            return
        groups = random_groups(2)
        mine = self._rig(store, self._cases(store)[0])  # a declared pool holding the same prefix
        self._write(store, mine, groups, [0, 1])
        res = store.page_set([rig.transfer(rig.pages(groups, [0, 1], fill=True))])
        assert len(res[rig.pool]) == 2
        pages, got = self._read(store, mine, groups, [4, 5])
        assert got == [OK, OK], f"{mine.case.id}: pages of the undeclared pool {rig.pool!r} replaced them ({got})"
        assert [mine.page_bytes(p) for p in pages] == [mine.host_bytes(0), mine.host_bytes(1)], (
            f"{mine.case.id}: the undeclared pool {rig.pool!r}'s bytes under this pool's keys")
        pages, got = self._read(store, rig, groups, [4, 5])
        for i, (p, r) in enumerate(zip(pages, got, strict=True)):
            assert r != OK or rig.page_bytes(p) == rig.host_bytes(i), (
                f"the undeclared pool {rig.pool!r} served another pool's bytes")

    # -- concurrency ---------------------------------------------------------------------------------
    def test_concurrent_writers_and_readers(self, store: Store) -> None:
        case = self._cases(store)[0]
        rig = self._rig(store, case)
        errors: list[str] = []
        batches = [random_groups(4) for _ in range(4)]

        def work(i: int) -> None:
            groups = batches[i]
            pages = rig.pages(groups, [4 * i + j for j in range(4)], fill=True)
            res = store.page_set([rig.transfer(pages)])
            if res[rig.pool] != [OK] * 4:
                errors.append(f"set {i}: {res}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        for i, groups in enumerate(batches):
            pages, res = self._read(store, rig, groups, [4 * i + j for j in range(4)])
            assert res == [OK] * 4
            for j, p in enumerate(pages):
                assert rig.page_bytes(p) == rig.host_bytes(4 * i + j)


def _others(rig: PoolRig, caps: Capabilities) -> list[PoolRig]:
    """The same pool under keys that must never see ``rig``'s pages: another model (and for a
    draft-role pool another target), rank, pool name and shape (zeroed pools; rank-neutral pools
    such as MLA and row pools have no other rank)."""
    spec, case = rig.spec, rig.case
    kp = case.pool
    out = [
        PoolRig(case, caps, model="another-model", fill=False),
        PoolRig(case, caps, parallel=ParallelConfig(tp_rank=1, tp_size=2), fill=False),
        PoolRig(case, caps, spec=make_spec(kp, spec.attention, spec.layout, name="kit_other_pool"), fill=False),
        PoolRig(case, caps, spec=make_spec(kp, spec.attention, spec.layout, layers=3), fill=False),
    ]
    if spec.role is PoolKind.DRAFT:
        out.append(PoolRig(case, caps, target="another-target", fill=False))
    seen = {rig.namespace}
    kept = []
    for o in out:
        if o.namespace not in seen:
            seen.add(o.namespace)
            kept.append(o)
    return kept


def _results(answer: object, pool: str, n: int, what: str) -> list[PageResult]:
    """The backend's own answer for ``pool``, checked for shape: a mapping to ``n`` results."""
    assert isinstance(answer, Mapping), f"{what}: the backend answered {type(answer).__name__}, not a mapping"
    got = answer.get(pool)
    assert isinstance(got, Sequence) and len(got) == n, f"{what}: {n} results expected, got {got!r}"
    out = []
    for r in got:
        assert isinstance(r, PageResult), f"{what}: results must be PageResult values, got {r!r}"
        out.append(r)
    return out
