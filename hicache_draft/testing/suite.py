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

The suite reads the store's declared capabilities and tests exactly what is declared: byte-exact
round trips of target and draft pages for every declared attention type and zero-copy layout and
on the generic path, target and draft pages in one call, prefix-existence semantics, per-page
results when part of a batch fails, key isolation between pools, ranks and namespaces, persistence
across a fresh instance (when declared; never wrong data when not), and refusal of pools and
attention types it does not declare.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hicache_draft.backend import StorageBackend
from hicache_draft.capabilities import Attention, Capabilities, Layout, PoolKind
from hicache_draft.errors import BackendSetupError
from hicache_draft.hookspecs import API_VERSION, hookimpl
from hicache_draft.keys import make_key, pool_identities
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft.store import Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PoolRegistration

PAGE_SIZE = 4
NUM_PAGES = 16
OK = PageResult.OK


@dataclass(frozen=True)
class Case:
    """One way of moving one pool's pages: attention type, layout, zero-copy or generic."""

    pool: PoolKind
    attention: Attention
    layout: Layout
    zero_copy: bool

    @property
    def id(self) -> str:
        return f"{self.pool.value}-{self.attention.value}-{self.layout.value}-{'zc' if self.zero_copy else 'generic'}"


def _valid_layouts(attention: Attention) -> list[Layout]:
    return [lay for lay in Layout if not (attention is Attention.MLA and lay is Layout.PAGE_HEAD)]


def declared_cases(caps: Capabilities) -> list[Case]:
    """Every (pool, attention, layout, path) combination the declaration promises."""
    out: list[Case] = []
    for kind, cap in sorted(caps.pools.items()):
        for att in sorted(cap.attention):
            for lay in _valid_layouts(att):
                if lay in cap.zero_copy_layouts:
                    spec = make_spec(kind, att, lay)
                    if cap.max_buffers_per_page is None or spec.buffers_per_page() <= cap.max_buffers_per_page:
                        out.append(Case(kind, att, lay, True))
            if cap.generic:
                out.append(Case(kind, att, Layout.LAYER_FIRST, False))
    return out


def make_spec(kind: PoolKind, attention: Attention, layout: Layout, layers: int = 2) -> PoolSpec:
    return PoolSpec(
        kind=kind, attention=attention, layers=layers, page_size=PAGE_SIZE, dtype=torch.float16, layout=layout,
        kv_heads=2, head_dim=8, latent_dim=24,
    )


def namespace_for(spec: PoolSpec, model: str = "conformance-model", tp_rank: int = 0, tp_size: int = 1) -> str:
    ident = pool_identities(
        pool=spec.kind, model=model, dtype=str(spec.dtype).removeprefix("torch."), attention=spec.attention,
        page_size=spec.page_size, layers=spec.layers, layout=spec.layout, kv_heads=spec.kv_heads,
        head_dim=spec.head_dim, latent_dim=spec.latent_dim, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
        tp_lcm_size=None, target_model=model if spec.kind is PoolKind.DRAFT else None,
    )
    return ident[0].fingerprint()


def random_groups(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


class PoolRig:
    """A host pool filled with random bytes, plus the means to build pages and staging buffers."""

    def __init__(self, case: Case, namespace: str | None = None) -> None:
        self.case = case
        self.spec = make_spec(case.pool, case.attention, case.layout)
        self.pool = HostPool(self.spec, NUM_PAGES)
        self.pool.raw.copy_(torch.randint(0, 256, self.pool.raw.shape, dtype=torch.uint8))
        self.namespace = namespace or namespace_for(self.spec)
        self.staging: list[torch.Tensor] = []

    def registration(self) -> PoolRegistration:
        return PoolRegistration(
            pool=self.case.pool, attention=self.case.attention, layout=self.case.layout, namespace=self.namespace,
            page_nbytes=self.spec.page_nbytes,
            buffers_per_page=self.spec.buffers_per_page() if self.case.zero_copy else 1,
            regions=self.pool.regions(),
        )

    def pages(self, groups: list[str], slots: list[int], fill: bool) -> list[Page]:
        """Pages for ``groups`` at host ``slots``; ``fill``: copy the pool's bytes into staging (set)."""
        out = []
        for g, slot in zip(groups, slots, strict=True):
            if self.case.zero_copy:
                bufs = self.pool.page_buffers(slot)
            else:
                stage = torch.zeros(self.spec.page_nbytes, dtype=torch.uint8)
                if fill:
                    self.pool.copy_page_out(slot, stage)
                self.staging.append(stage)
                bufs = (Buffer(stage.data_ptr(), stage.numel(), owner=stage),)
            out.append(Page(key=make_key(g, self.namespace), group=g, namespace=self.namespace, buffers=bufs))
        return out

    def page_bytes(self, page: Page) -> bytes:
        return b"".join(bytes(b.view()) for b in page.buffers)

    def transfer(self, pages: list[Page]) -> PageTransfer:
        return PageTransfer(self.case.pool, pages, self.case.zero_copy)


def _slots(indices: list[int]) -> list[int]:
    return [i * PAGE_SIZE for i in indices]


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

    Every case runs for every declared pool, attention type and layout (and the generic path),
    and judges the backend's own answers (recorded before the core's verification), so a backend
    that would only be saved by the core's checks still fails here.
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

    def _rig(self, store: Store, case: Case, namespace: str | None = None) -> PoolRig:
        raw_answers(store)
        rig = PoolRig(case, namespace)
        store.register_pool(rig.registration())
        return rig

    def _write(self, store: Store, rig: PoolRig, groups: list[str], idx: list[int]) -> list[Page]:
        pages = rig.pages(groups, _slots(idx), fill=True)
        res = store.page_set([rig.transfer(pages)])
        assert res[rig.case.pool] == [OK] * len(pages), f"{rig.case.id}: page_set results {res}"
        return pages

    def _read(
        self, store: Store, rig: PoolRig, groups: list[str], idx: list[int], strict: bool = True
    ) -> tuple[list[Page], list[PageResult]]:
        """Read into a second, zeroed pool of the same shape. ``strict``: return the backend's own
        answers, which the core's verified results must equal (a page the backend called OK that
        fails verification is a backend bug); otherwise return the core's verified results."""
        rec = raw_answers(store)
        reader = PoolRig(rig.case, rig.namespace)
        reader.pool.raw.zero_()
        store.register_pool(reader.registration())
        pages = reader.pages(groups, _slots(idx), fill=False)
        res, done = store.page_get([reader.transfer(pages)])
        assert done.done()
        if not strict:
            return pages, res[rig.case.pool]
        raw = _results(rec.last("page_get"), rig.case.pool, len(pages), rig.case.id)
        assert res[rig.case.pool] == raw, (
            f"{rig.case.id}: the backend answered {raw} but the core's verification found {res[rig.case.pool]}"
        )
        return pages, raw

    def _exists(self, store: Store, pool: PoolKind, keys: list[str]) -> int:
        rec = raw_answers(store)
        counts = store.page_exists({pool: keys})
        if keys:
            answer = rec.last("page_exists")
            assert isinstance(answer, Mapping) and answer.get(pool) == counts[pool], (
                f"page_exists answered {answer!r} for {len(keys)} keys of pool {pool.value}"
            )
        return counts[pool]

    # -- declaration ----------------------------------------------------------------------------
    def test_declaration_is_valid(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, Capabilities)
        assert PoolKind.KV in caps.pools
        assert isinstance(store.backend, StorageBackend)
        assert store.backend.api_version == API_VERSION

    # -- round trips --------------------------------------------------------------------------
    def test_round_trip_every_declared_case(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(5)
            written = self._write(store, rig, groups, [0, 3, 7, 8, 15])
            pages, res = self._read(store, rig, groups, [1, 2, 4, 5, 6])
            assert res == [OK] * 5, f"{case.id}: {res}"
            for w, r in zip(written, pages, strict=True):
                assert rig.page_bytes(r) == rig.page_bytes(w), f"{case.id}: bytes differ"

    def test_target_and_draft_in_one_call(self, store: Store) -> None:
        kinds = sorted(store.capabilities.pools)
        rigs = []
        for kind in kinds:
            case = next(c for c in self._cases(store) if c.pool is kind)
            rigs.append(self._rig(store, case))
        groups = random_groups(3)
        transfers = [r.transfer(r.pages(groups, _slots([0, 1, 2]), fill=True)) for r in rigs]
        res = store.page_set(transfers)
        for r in rigs:
            assert res[r.case.pool] == [OK] * 3
        counts = store.page_exists({r.case.pool: [make_key(g, r.namespace) for g in groups] for r in rigs})
        assert counts == {r.case.pool: 3 for r in rigs}
        readers = [PoolRig(r.case, r.namespace) for r in rigs]
        for rd in readers:
            store.register_pool(rd.registration())
        reads = [rd.transfer(rd.pages(groups, _slots([5, 6, 7]), fill=False)) for rd in readers]
        got, _ = store.page_get(reads)
        for r, rd, t, back in zip(rigs, readers, transfers, reads, strict=True):
            assert got[r.case.pool] == [OK] * 3
            for src, dst in zip(t.pages, back.pages, strict=True):
                assert rd.page_bytes(dst) == r.page_bytes(src)

    def test_large_batch(self, store: Store) -> None:
        for kind in sorted(store.capabilities.pools):
            case = next(c for c in self._cases(store) if c.pool is kind)
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
            keys = [make_key(g, rig.namespace) for g in groups]
            assert self._exists(store, case.pool, keys) == 0, f"{case.id}: claims pages never stored"
            self._write(store, rig, groups[:3], [0, 1, 2])
            self._write(store, rig, groups[4:6], [4, 5])  # a hole at index 3, then two stored, then one never
            assert self._exists(store, case.pool, keys) == 3, f"{case.id}: must stop at the hole at index 3"
            assert self._exists(store, case.pool, keys[:2]) == 2, f"{case.id}: more than the keys asked for"
            assert self._exists(store, case.pool, keys[3:]) == 0, f"{case.id}: a missing first key means 0"
            assert self._exists(store, case.pool, keys[4:]) == 2, f"{case.id}: stops at the never-stored key"
            assert self._exists(store, case.pool, []) == 0

    def test_exists_never_claims_another_namespace_or_pool(self, store: Store) -> None:
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(3)
            self._write(store, rig, groups, [0, 1, 2])
            for ns in _other_namespaces(rig):
                keys = [make_key(g, ns) for g in groups]
                assert self._exists(store, case.pool, keys) == 0, f"{case.id}: claims namespace {ns}'s pages"
            other = PoolKind.DRAFT if case.pool is PoolKind.KV else PoolKind.KV
            if other in store.capabilities.pools:  # the same keys asked for under the other pool
                keys = [make_key(g, rig.namespace) for g in groups]
                n = self._exists(store, other, keys)
                assert n in (0, 3), f"{case.id}: existence under pool {other.value} answered {n}"

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
                reader = PoolRig(case, rig.namespace)
                store.register_pool(reader.registration())
                pages = reader.pages(groups, _slots([4, 5, 6]), fill=False)
                odd = torch.zeros(max(1, int(pages[1].nbytes * factor)), dtype=torch.uint8)
                pages[1] = Page(pages[1].key, pages[1].group, pages[1].namespace,
                                (Buffer(odd.data_ptr(), odd.numel(), odd),))
                res, _ = store.page_get([reader.transfer(pages)])
                raw = _results(raw_answers(store).last("page_get"), case.pool, 3, case.id)
                assert raw[0] == OK and raw[2] == OK, f"{case.id}: {raw}"
                assert raw[1] != OK, f"{case.id}: a destination of {odd.numel()} bytes for a " \
                                     f"{rig.spec.page_nbytes}-byte page was answered OK"
                assert res[case.pool][1] != OK
                assert rig.page_bytes(pages[0]) == rig.page_bytes(written[0])
                assert rig.page_bytes(pages[2]) == rig.page_bytes(written[2])

    def test_rewrite_of_a_stored_key_is_ok(self, store: Store) -> None:
        case = self._cases(store)[0]
        rig = self._rig(store, case)
        groups = random_groups(2)
        first = self._write(store, rig, groups, [0, 1])
        self._write(store, rig, groups, [0, 1])
        pages, res = self._read(store, rig, groups, [2, 3])
        assert res == [OK, OK]
        assert [rig.page_bytes(p) for p in pages] == [rig.page_bytes(p) for p in first]

    # -- isolation ----------------------------------------------------------------------------------
    def test_keys_are_isolated_between_pools_ranks_and_namespaces(self, store: Store) -> None:
        """Another model's, rank's, pool's or shape's page never comes back: the backend answers MISS."""
        for case in self._cases(store):
            rig = self._rig(store, case)
            groups = random_groups(2)
            self._write(store, rig, groups, [0, 1])
            for ns in _other_namespaces(rig):
                other = PoolRig(case, ns)
                store.register_pool(other.registration())
                res, _ = store.page_get([other.transfer(other.pages(groups, _slots([4, 5]), fill=False))])
                raw = _results(raw_answers(store).last("page_get"), case.pool, 2, case.id)
                assert raw == [PageResult.MISS] * 2, f"{case.id}: namespace {ns} got {raw} for another's pages"
                assert all(r != OK for r in res[case.pool])

    # -- deadlines and late calls --------------------------------------------------------------------
    def test_a_call_past_its_deadline_returns_promptly(self, store: Store) -> None:
        """Called with a deadline already passed, each hook returns within ``deadline_grace_s``
        with results of the right shape (whatever they say), and the store works afterwards."""
        for kind in sorted(store.capabilities.pools):
            case = next(c for c in self._cases(store) if c.pool is kind)
            rig = self._rig(store, case)
            groups = random_groups(32)
            pages = rig.pages(groups, _slots([i % NUM_PAGES for i in range(32)]), fill=True)
            for hook in ("page_set", "page_get"):
                transfers = store.attach_headers([rig.transfer(pages)], made=hook == "page_set")
                t0 = time.monotonic()
                extra = {"finished": lambda pool, indices: None} if hook == "page_get" else {}
                answer = getattr(store.pm.hook, hook)(transfers=transfers, deadline=time.monotonic() - 1.0, **extra)
                took = time.monotonic() - t0
                assert took < self.deadline_grace_s, f"{case.id}: {hook} ran {took:.2f}s past its deadline"
                _results(answer, case.pool, len(pages), case.id)
            t0 = time.monotonic()
            store.pm.hook.page_exists(queries={case.pool: [p.key for p in pages]}, deadline=time.monotonic() - 1.0)
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
            pages = rig.pages(groups, _slots([0, 1]), fill=True)
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
        case = self._cases(store)[0]
        rig = self._rig(store, case)
        groups = random_groups(4)
        self._write(store, rig, groups, [0, 1, 2, 3])
        reader = PoolRig(case, rig.namespace)
        reader.pool.raw.zero_()
        store.register_pool(reader.registration())
        raw = raw_answers(store)
        raw.gate = threading.Event()
        try:
            rep = store.call("page_get", [reader.transfer(reader.pages(groups, _slots([8, 9, 10, 11]), False))],
                             timeout_s=0.05)
            assert rep.outcome == "timeout" and all(r is PageResult.FAILED for r in rep.results[case.pool])
        finally:
            raw.gate.set()
            raw.gate = None
        rep.released.result(timeout=60)
        snapshot = reader.pool.raw.clone()
        time.sleep(0.2)
        assert torch.equal(reader.pool.raw, snapshot), f"{case.id}: buffers written after the call returned"

    # -- persistence -------------------------------------------------------------------------------
    def test_fresh_instance_returns_stored_bytes_or_misses(
        self, backend_factory: Callable[[], Store], store: Store
    ) -> None:
        cases = self._cases(store)
        rigs = [self._rig(store, c) for c in cases]
        groups_of = [random_groups(3) for _ in rigs]  # equal keys must mean equal bytes: fresh groups per rig
        written = [self._write(store, r, g, [0, 1, 2]) for r, g in zip(rigs, groups_of, strict=True)]
        persistent = store.capabilities.persistent
        fresh = backend_factory()
        try:
            for rig, src, groups in zip(rigs, written, groups_of, strict=True):
                reader = PoolRig(rig.case, rig.namespace)
                fresh.register_pool(reader.registration())
                pages = reader.pages(groups, _slots([8, 9, 10]), fill=False)
                res, _ = fresh.page_get([reader.transfer(pages)])
                for p, s, r in zip(pages, src, res[rig.case.pool], strict=True):
                    if persistent:
                        assert r == OK, f"{rig.case.id}: declared persistent but a fresh instance got {r!r}"
                    if r == OK:
                        assert rig.page_bytes(p) == rig.page_bytes(s), f"{rig.case.id}: wrong bytes after reopen"
        finally:
            fresh.close()

    # -- refusal -------------------------------------------------------------------------------------
    def test_refuses_what_it_does_not_declare(self, store: Store) -> None:
        caps = store.capabilities
        refused = 0
        for kind in PoolKind:
            cap = caps.pools.get(kind)
            for att in Attention:
                if cap is not None and att in cap.attention:
                    continue
                rig = PoolRig(Case(kind, att, _valid_layouts(att)[0], False))
                with pytest.raises(BackendSetupError):
                    store.register_pool(rig.registration())
                refused += 1
        if refused == 0:  # everything declared: a registration of a declared pool must succeed
            store.register_pool(PoolRig(self._cases(store)[0]).registration())

    # -- concurrency ---------------------------------------------------------------------------------
    def test_concurrent_writers_and_readers(self, store: Store) -> None:
        case = self._cases(store)[0]
        rig = self._rig(store, case)
        errors: list[str] = []
        batches = [random_groups(4) for _ in range(4)]

        def work(i: int) -> None:
            groups = batches[i]
            pages = rig.pages(groups, _slots([4 * i + j for j in range(4)]), fill=True)
            res = store.page_set([rig.transfer(pages)])
            if res[case.pool] != [OK] * 4:
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
                assert rig.page_bytes(p) == rig.pool.page_bytes(_slots([4 * i + j])[0])


def _other_namespaces(rig: PoolRig) -> list[str]:
    """Namespaces that must never see ``rig``'s pages: another model, rank, pool and shape."""
    case = rig.case
    other_pool = PoolKind.DRAFT if case.pool is PoolKind.KV else PoolKind.KV
    out = [
        namespace_for(rig.spec, model="another-model"),
        namespace_for(rig.spec, tp_rank=1, tp_size=2),
        namespace_for(make_spec(other_pool, case.attention, case.layout)),
        namespace_for(make_spec(case.pool, case.attention, case.layout, layers=3)),
    ]
    return [ns for ns in dict.fromkeys(out) if ns != rig.namespace]  # e.g. rank-neutral MLA


def _results(answer: object, pool: PoolKind, n: int, what: str) -> list[PageResult]:
    """The backend's own answer for ``pool``, checked for shape: a mapping to ``n`` results."""
    assert isinstance(answer, Mapping), f"{what}: the backend answered {type(answer).__name__}, not a mapping"
    got = answer.get(pool)
    assert isinstance(got, Sequence) and len(got) == n, f"{what}: {n} results expected, got {got!r}"
    out = []
    for r in got:
        assert isinstance(r, PageResult), f"{what}: results must be PageResult values, got {r!r}"
        out.append(r)
    return out
