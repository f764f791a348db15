"""The conformance kit is not vacuous: each fault a backend author could make fails it.

Every faulty backend below is the in-memory test backend with ONE fault, in the target ``kv`` pool
only (the kit used to run most cases on the first declared pool, which sorts as ``draft``, so
kv-only faults passed), or, for open pools, in how pools of one role are told apart. For each,
running the kit must fail the named case; the honest backend passes every case.
"""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import Callable, Mapping, Sequence

import pytest

from hicache_draft import Page, PageResult, PageTransfer, PoolKind, Store, hookimpl
from hicache_draft.page_format import HEADER_SIZE, make_header
from hicache_draft.testing import ConformanceSuite, MemoryBackend

KV = PoolKind.KV


def _fill_what_fits(page: Page, blob: bytes) -> PageResult:
    """A stored blob (header, then bytes) into the page, as much as fits, answered OK."""
    page.header.view()[:] = blob[:HEADER_SIZE]
    at = HEADER_SIZE
    for b in page.buffers:
        n = min(b.nbytes, len(blob) - at)
        b.view()[:n] = blob[at : at + n]
        at += n
    return PageResult.OK


class _Faulty(MemoryBackend):
    """The memory backend, with hooks that route the kv pool through ``_kv_*`` methods."""

    def _kv_read(self, page: Page) -> PageResult:
        return self._read_one(KV, page)

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        return {
            t.pool: [self._kv_read(p) if t.pool is KV else self._read_one(t.pool, p) for p in t.pages]
            for t in transfers
        }


class IgnoresNamespace(_Faulty):
    """Looks kv pages up by their page hash only: another model's page comes back."""

    def _kv_read(self, page: Page) -> PageResult:
        with self.lock:
            other = next((k for k in self.data if k.split(".")[0] == page.group), None)
        if other is None:
            return PageResult.MISS
        blob = self.data[other]
        return _fill_what_fits(page, blob)


class PhantomZeros(_Faulty):
    """OK with zeros for kv pages it never had."""

    def _kv_read(self, page: Page) -> PageResult:
        res = super()._kv_read(page)
        if res is PageResult.MISS:
            for b in page.buffers:
                b.view()[:] = bytes(b.nbytes)
            return PageResult.OK
        return res


class WrongSizeOK(_Faulty):
    """Fills what fits of a wrong-size kv destination and answers OK."""

    def _kv_read(self, page: Page) -> PageResult:
        with self.lock:
            blob = self.data.get(page.key)
        if blob is None:
            return PageResult.MISS
        return _fill_what_fits(page, blob)


class OutOfOrder(_Faulty):
    """Answers kv results sorted with the hits first instead of in request order."""

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        out = {t.pool: [self._read_one(t.pool, p) for p in t.pages] for t in transfers}
        if KV in out:
            out[KV] = sorted(out[KV])
        return out


class _Exists(MemoryBackend):
    def _kv_count(self, keys: Sequence[str]) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    @hookimpl
    def page_exists(self, queries: Mapping[PoolKind, Sequence[str]]) -> dict[PoolKind, int]:
        out = {}
        for pool, keys in queries.items():
            if pool is KV:
                out[pool] = self._kv_count(keys)
            else:
                n = 0
                while n < len(keys) and keys[n] in self.data:
                    n += 1
                out[pool] = n
        return out


class ExistsCountsAll(_Exists):
    """Counts every stored kv key, not the leading ones: holes are claimed."""

    def _kv_count(self, keys: Sequence[str]) -> int:
        return sum(1 for k in keys if k in self.data)


class ExistsSaysAll(_Exists):
    """Claims every kv key once the first is stored."""

    def _kv_count(self, keys: Sequence[str]) -> int:
        return len(keys) if keys and keys[0] in self.data else 0


class ExistsIgnoresNamespace(_Exists):
    """Answers kv existence by page hash only: another namespace's pages are claimed."""

    def _kv_count(self, keys: Sequence[str]) -> int:
        groups = {k.split(".")[0] for k in self.data}
        n = 0
        while n < len(keys) and keys[n].split(".")[0] in groups:
            n += 1
        return n


class OwnHeader(MemoryBackend):
    """Makes its own kv header from the bytes it reads (ignoring the core's): a late call that reads
    reused memory then stores wrong bytes with a valid checksum."""

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        out = {}
        for t in transfers:
            for p in t.pages:
                views = [b.view() for b in p.buffers]
                head = make_header(p.key, p.namespace, t.pool, views) if t.pool is KV else bytes(p.header.view())
                with self.lock:
                    self.data[p.key] = head + b"".join(bytes(v) for v in views)
            out[t.pool] = [PageResult.OK] * len(t.pages)
        return out


class IgnoresDeadline(MemoryBackend):
    """Retries a slow kv transport long after the deadline."""

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        if any(t.pool is KV for t in transfers) and time.monotonic() > deadline:
            time.sleep(3.0)
        return {t.pool: [self._read_one(t.pool, p) for p in t.pages] for t in transfers}


class PoolsByRole(MemoryBackend):
    """Honest for the classic pools, but files a page of any other pool under its group in its
    role's classic pool (the ``kv`` or ``draft`` pool registered last), as a backend with one store
    per role would: an indexer page replaces the kv page of its prefix, and a kv query finds it."""

    def __init__(self, options, context) -> None:
        super().__init__(options, context)
        self.classic_ns: dict[PoolKind, str] = {}
        self.role_of: dict[str, PoolKind] = {}

    @hookimpl
    def register_pool(self, registration) -> None:
        self.check_registration(registration)
        self.role_of[str(registration.pool)] = registration.role
        if registration.pool in (PoolKind.KV, PoolKind.DRAFT):
            self.classic_ns[registration.role] = registration.namespace

    def _slot(self, pool: str, key: str) -> str:
        ns = None if pool in (PoolKind.KV, PoolKind.DRAFT) else self.classic_ns.get(self.role_of.get(pool, KV))
        return key if ns is None else f"{key.split('.')[0]}.{ns}"

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer]) -> dict[str, list[PageResult]]:
        for t in transfers:
            for p in t.pages:
                with self.lock:
                    self.data[self._slot(t.pool, p.key)] = bytes(p.header.view()) + b"".join(
                        bytes(b.view()) for b in p.buffers)
        return {t.pool: [PageResult.OK] * len(t.pages) for t in transfers}

    def _other_read(self, pool: str, page: Page) -> PageResult:
        with self.lock:
            blob = self.data.get(self._slot(pool, page.key))
        return PageResult.MISS if blob is None else _fill_what_fits(page, blob)

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[str, list[PageResult]]:
        return {
            t.pool: [self._read_one(t.pool, p) if t.pool in (KV, PoolKind.DRAFT) else self._other_read(t.pool, p)
                     for p in t.pages]
            for t in transfers
        }

    @hookimpl
    def page_exists(self, queries: Mapping[str, Sequence[str]]) -> dict[str, int]:
        out = {}
        for pool, keys in queries.items():
            n = 0
            while n < len(keys) and self._slot(pool, keys[n]) in self.data:
                n += 1
            out[pool] = n
        return out


FAULTS: list[tuple[type[MemoryBackend], str]] = [
    (IgnoresNamespace, "test_keys_are_isolated_between_pools_ranks_and_namespaces"),
    (PhantomZeros, "test_missing_pages_are_misses_in_a_mixed_batch"),
    (WrongSizeOK, "test_wrong_size_destination_fails_only_that_page"),
    (OutOfOrder, "test_results_follow_the_order_of_the_request"),
    (ExistsCountsAll, "test_exists_counts_leading_stored_pages"),
    (ExistsSaysAll, "test_exists_counts_leading_stored_pages"),
    (ExistsIgnoresNamespace, "test_exists_never_claims_another_namespace_or_pool"),
    (OwnHeader, "test_a_late_write_of_reused_memory_is_never_served"),
    (IgnoresDeadline, "test_a_call_past_its_deadline_returns_promptly"),
    (PoolsByRole, "test_pools_of_one_prefix_never_see_each_other"),
    (PoolsByRole, "test_all_pools_of_a_prefix_in_one_call"),
]


def _factory(cls: type[MemoryBackend]) -> Callable[[], Store]:
    space = secrets.token_hex(4)
    return lambda: Store("memory", cls, cls.capabilities, {"space": space})


def _run_case(cls: type[MemoryBackend], name: str) -> BaseException | None:
    """Run one kit case against ``cls`` the way pytest would (fresh store, fixtures by name)."""
    MemoryBackend.reset()
    factory = _factory(cls)
    store = factory()
    from hicache_draft.testing.suite import raw_answers

    raw_answers(store)
    method = getattr(ConformanceSuite(), name)
    kwargs = {"store": store}
    if "backend_factory" in inspect.signature(method).parameters:
        kwargs["backend_factory"] = factory
    try:
        method(**kwargs)
    except AssertionError as exc:
        return exc
    finally:
        store.close()
        MemoryBackend.reset()
    return None


@pytest.mark.parametrize(("cls", "case"), FAULTS, ids=[c.__name__ for c, _ in FAULTS])
def test_the_kit_fails_each_faulty_backend(cls, case):
    assert _run_case(cls, case) is not None, f"the kit's {case} passed a backend that {cls.__doc__.strip()}"


def test_the_honest_backend_passes_every_case():
    cases = [n for n in dir(ConformanceSuite) if n.startswith("test_")]
    assert len(cases) >= 15
    for name in cases:
        err = _run_case(MemoryBackend, name)
        assert err is None, f"{name}: {err}"
