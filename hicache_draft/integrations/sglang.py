"""An SGLang ``HiCacheStorage`` that stores target and draft KV pages in any hicache-draft backend.

Load it through SGLang's own dynamic-backend mechanism::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "hicache_draft",
        "module_path": "hicache_draft.integrations.sglang", "class_name": "HiCacheDraftStorage",
        "interface_v1": true,
        "hicache_draft": {"backend": "file", "backend_options": {"root": "/mnt/kv"}}}'

What SGLang calls, and where it goes:

* ``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists``: target (``kv``) pages by host index.
* ``register_mem_host_pool_v2`` with ``PoolName.DRAFT``, then ``batch_exists_v2`` /
  ``batch_get_v2`` / ``batch_set_v2``: target and draft pages in one backend call; the hit is the
  longest target prefix, shortened to the draft prefix (ALL_PAGES).
* ``batch_set`` / ``batch_get`` / ``set`` / ``get`` / ``exists`` (SGLang's generic calls, flat data
  pages): ``"{hash}"`` keys are target pages, ``"{hash}.draft"`` keys draft pages.

Every page key is ``make_key(page_hash, namespace)`` with a namespace built from SGLang's storage
config, the host pool's shape and the model identities. Pages go zero-copy from SGLang's host pool
memory when the backend declares the pool's layout zero-copy, through a staging area otherwise.
Nothing here raises into SGLang's I/O threads: every call SGLang makes answers ``False`` per page, a
miss or an empty result on any error (logged once). Results are built for the installed release's
own dataclass fields (0.5.18's ``PoolTransferResult`` has two, later ones three).

This module imports SGLang's storage module (without running ``sglang/__init__.py``); the core
package never imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hicache_draft.backend import BackendContext
from hicache_draft.capabilities import Attention, IOPath, PoolKind
from hicache_draft.errors import BackendSetupError, ConfigError
from hicache_draft.integrations.sglang_config import (
    AdapterSettings,
    Placement,
    interface_v1,
    parse_settings,
    placement,
)
from hicache_draft.integrations.sglang_loader import load_storage_module
from hicache_draft.integrations.sglang_pools import (
    PoolView,
    Staging,
    host_pool_spec,
    legacy_draft_spec,
    namespaces,
    pool_path,
    split_factor,
    staging_pages,
)
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft.store import Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PoolRegistration

_sg = load_storage_module()
HiCacheStorage = _sg.HiCacheStorage
HiCacheStorageConfig = _sg.HiCacheStorageConfig
HiCacheStorageExtraInfo = _sg.HiCacheStorageExtraInfo
PoolHitPolicy = _sg.PoolHitPolicy
PoolName = _sg.PoolName
PoolTransfer = _sg.PoolTransfer
PoolTransferResult = _sg.PoolTransferResult
STORAGE_BATCH_SIZE = int(getattr(_sg, "STORAGE_BATCH_SIZE", 128))

log = logging.getLogger("hicache_draft.sglang")

_HEX = re.compile(r"[0-9a-f]+")
_POOL_OF_NAME = {"kv": PoolKind.KV, "draft": PoolKind.DRAFT}
_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(PoolTransferResult))
_F = TypeVar("_F", bound=Callable[..., Any])
_KEY_CACHE = 1 << 15


def transfer_result(kv_hit_pages: int, extra_pool_hit_pages: dict[Any, int], restorable: list[int]) -> Any:
    """A ``PoolTransferResult`` with the fields this SGLang release's dataclass has (found with
    :func:`dataclasses.fields`, not by version): ``restorable_prefix_pages`` only where it exists."""
    values = {"kv_hit_pages": kv_hit_pages, "extra_pool_hit_pages": extra_pool_hit_pages,
              "restorable_prefix_pages": restorable}
    return PoolTransferResult(**{k: v for k, v in values.items() if k in _RESULT_FIELDS})


def _never_raise(default: Callable[..., Any]) -> Callable[[_F], _F]:
    """Guard one SGLang-facing call: any exception becomes ``default(self, *args, **kwargs)``
    (all-False, a miss, an empty result), logged once per call and exception type."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def guarded(self: HiCacheDraftStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:  # never raise into SGLang's threads
                self._warn_once(f"raise:{fn.__name__}:{type(exc).__name__}",
                                "hicache-draft: %s failed (%s: %s); answered as a miss", fn.__name__,
                                type(exc).__name__, exc)
                try:
                    return default(self, *args, **kwargs)
                except Exception:
                    return None

        return guarded  # type: ignore[return-value]

    return wrap


def _n_keys(args: tuple[Any, ...], kwargs: dict[str, Any], name: str = "keys") -> int:
    keys = kwargs.get(name, args[0] if args else None)
    try:
        return len(keys)
    except TypeError:
        return 0


def _all_false(self: Any, *args: Any, **kwargs: Any) -> list[bool]:
    return [False] * _n_keys(args, kwargs)


def _no_pages(self: Any, *args: Any, **kwargs: Any) -> dict[Any, list[bool]]:
    transfers = kwargs.get("transfers", args[0] if args else None) or []
    out: dict[Any, list[bool]] = {}
    for t in transfers:
        try:
            out[t.name] = [False] * len(t.keys or [])
        except Exception:  # noqa: BLE001, S112  (a malformed transfer gets no entry)
            continue
    return out


def _no_hit(self: Any, *args: Any, **kwargs: Any) -> Any:
    return transfer_result(0, {}, [])


def _constant(value: Any) -> Callable[..., Any]:
    return lambda self, *args, **kwargs: value


def _nones(self: Any, *args: Any, **kwargs: Any) -> list[None]:
    return [None] * _n_keys(args, kwargs)


def pool_of_group(mem_pool_host: Any) -> Any:
    """The anchor host pool of what SGLang passes to ``register_mem_pool_host``: the pool itself,
    or, for a ``HostPoolGroup`` (0.5.18 passes the group for hybrid models), its anchor entry's
    pool. Read by attribute, like everything else SGLang hands over."""
    anchor = getattr(mem_pool_host, "anchor_entry", None)
    return getattr(anchor, "host_pool", None) if anchor is not None else mem_pool_host


def page_group(sglang_key: str) -> str:
    """Our page group (lowercase hex) for an SGLang page hash. SGLang's hashes are 64 hex digits
    and are kept as they are; any other string is hashed (SHA-256), so keys stay well-formed."""
    low = sglang_key.lower()
    return low if _HEX.fullmatch(low) else hashlib.sha256(sglang_key.encode()).hexdigest()


_HEX_DIGITS = b"0123456789abcdef"


def page_groups(sglang_keys: Sequence[str], joined: str | None = None) -> list[str]:
    """:func:`page_group` of every key; a batch of lowercase hex keys (SGLang's) in whole-batch
    steps. ``joined``: ``"".join(sglang_keys)`` when the caller has it."""
    try:
        if joined is None:
            joined = "".join(sglang_keys)
        if all(sglang_keys) and not joined.encode().translate(None, _HEX_DIGITS):
            return list(sglang_keys)  # every key is non-empty lowercase hex: its own group
    except (TypeError, UnicodeError):
        pass
    return [page_group(k) for k in sglang_keys]


def split_generic_key(key: str) -> tuple[PoolKind | None, str]:
    """``"{hash}"`` -> target, ``"{hash}.draft"`` -> draft, ``"{hash}.kv"`` -> target; other
    pool suffixes -> ``None`` (a pool we do not hold)."""
    head, sep, tail = key.rpartition(".")
    if not sep:
        return PoolKind.KV, page_group(key)
    return _POOL_OF_NAME.get(tail), page_group(head)


def split_generic_keys(keys: Sequence[str]) -> tuple[list[PoolKind | None], list[str]]:
    """:func:`split_generic_key` of every key, as (pools, groups); a batch without any ``"."``
    (target pages only, SGLang's usual batch) in whole-batch steps."""
    try:
        joined = "".join(keys)
    except TypeError:
        joined = "."
    if "." not in joined:
        return [PoolKind.KV] * len(keys), page_groups(keys, joined)
    parsed = [split_generic_key(k) for k in keys]
    return [k for k, _ in parsed], [g for _, g in parsed]


@dataclass
class _Job:
    """The pages of one pool in one adapter call: from host slots or from flat SGLang pages."""

    view: PoolView
    groups: list[str]
    slots: list[int] | None = None
    flats: list[torch.Tensor] | None = None
    raw: list[torch.Tensor] | None = None  # flats as 1-D bytes (one head part per page)
    keys: list[str] | None = None  # storage keys, page-major (else made from groups)

    @property
    def staged(self) -> bool:
        return self.slots is None or self.view.path is IOPath.GENERIC


CLEAR_UNSUPPORTED = (
    "hicache-draft cannot clear stored pages: the storage plugin contract has no delete hook, so "
    "nothing this deployment's namespace stored can be removed through it (pages stay, and are "
    "still served); delete them with the backend's own tools"
)


class _Unclearable:
    """``clear`` as SGLang sees it: absent. Every SGLang release asks ``hasattr(backend, "clear")``
    before clearing and otherwise answers "does not support clear operation" and ``False`` (the
    HTTP clear endpoint then fails), which is the truth: no hook can delete pages. Looking the
    attribute up logs why, then raises :class:`AttributeError` with the same reason."""

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        log.warning("hicache-draft: %s", CLEAR_UNSUPPORTED)
        raise AttributeError(CLEAR_UNSUPPORTED)


class HiCacheDraftStorage(HiCacheStorage):
    """SGLang storage backend over a hicache-draft :class:`~hicache_draft.Store`.

    Built by SGLang as ``HiCacheDraftStorage(storage_config, kwargs)``; settings come from
    ``storage_config.extra_config["hicache_draft"]`` (:class:`AdapterSettings`).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.storage_config = storage_config
        self.settings: AdapterSettings = parse_settings(extra)
        self.placement: Placement = placement(storage_config, self.settings)
        self.interface_v1 = interface_v1(extra)
        par = self.placement.parallel
        context = BackendContext(tp_rank=par.tp_rank, tp_size=par.tp_size, timeout_s=self.settings.timeout_s)
        self.store = Store.open(self.settings.backend, self.settings.backend_options, context)
        self.views: dict[PoolKind, PoolView] = {}
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        log.info(
            "hicache-draft SGLang adapter: backend %r, model %r, draft model %r, tp %d/%d, pp %d/%d",
            self.store.name, self.placement.model, self.placement.draft_model,
            par.tp_rank, par.tp_size, par.pp_rank, par.pp_size,
        )

    # -- logging ----------------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        (log.warning if first else log.debug)(msg, *args)

    # -- pool registration ------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The target host pool, right after construction: a host pool, or a ``HostPoolGroup``
        whose anchor pool is the target's (0.5.18 passes the group for hybrid models)."""
        self.mem_pool_host = mem_pool_host
        self._register(PoolKind.KV, pool_of_group(mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Extra host pools: ``PoolName.DRAFT`` becomes our draft pool; ``KV`` the target pool;
        others are answered with misses."""
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            if self.views.get(PoolKind.KV) is None or self.views[PoolKind.KV].source is not host_pool:
                self._register(PoolKind.KV, host_pool)
        elif name == str(PoolName.DRAFT):
            self._register(PoolKind.DRAFT, host_pool)
        else:
            log.info("hicache-draft: pool %r is not held by hicache-draft; its pages are misses", name)

    def on_host_pools_registered(self) -> None:
        for kind, view in self.views.items():
            log.info("hicache-draft: pool %s: %s (%s)", kind.value, view.path.value, view.reason)

    def _register(self, kind: PoolKind, host_pool: Any) -> None:
        try:
            spec = host_pool_spec(host_pool, kind)
        except ConfigError as exc:
            if kind is PoolKind.KV:
                raise
            log.warning("hicache-draft: %s pool offload disabled: %s", kind.value, exc)
            return
        pool = HostPool.wrap(spec, host_pool.kv_buffer)
        view = self._make_view(spec, pool, host_pool)
        self.views[kind] = view
        if kind is PoolKind.KV and self.settings.legacy_draft_pool is not None and PoolKind.DRAFT not in self.views:
            dspec = legacy_draft_spec(self.settings.legacy_draft_pool, spec)
            self.views[PoolKind.DRAFT] = self._make_view(dspec, None, None)

    @property
    def _legacy_draft(self) -> PoolView | None:
        """The draft pool known only from ``legacy_draft_pool`` (no registered memory): SGLang
        0.5.15-0.5.18 moves its pages as ``{hash}.draft`` flat pages."""
        view = self._view(PoolKind.DRAFT)
        return view if view is not None and view.pool is None else None

    def _make_view(self, spec: PoolSpec, pool: HostPool | None, source: Any) -> PoolView:
        caps = self.store.capabilities
        split = split_factor(spec, self.placement, caps)
        if self.placement.parallel.split_factor > 1 and split == 1 and spec.attention is Attention.MHA:
            self._warn_once(
                f"split:{spec.kind}", "hicache-draft: %s pool: head groups not split (backend %r declares "
                "split_heads=%s, layout %s); pages are shared only with servers of the same tp_size",
                spec.kind.value, self.store.name, caps.split_heads, spec.layout.value,
            )
        choice = pool_path(caps, spec, split, has_memory=pool is not None)
        path, reason = choice.path, choice.reason
        kv = self.views.get(PoolKind.KV)
        if spec.kind is PoolKind.DRAFT and (kv is None or kv.path is IOPath.DISABLED):
            path, reason = IOPath.DISABLED, "the target 'kv' pool is disabled, so nothing is offloaded"
        view = PoolView(spec=spec, pool=pool, namespaces=namespaces(spec, self.placement, split), path=path,
                        reason=reason, source=source)
        if path is IOPath.DISABLED:
            log.warning("hicache-draft: %s pool offload disabled: %s", spec.kind.value, reason)
            return view
        needs_staging = path is IOPath.GENERIC or (spec.kind is PoolKind.KV and not self.interface_v1)
        if needs_staging or pool is None:
            view.staging = Staging(spec.page_nbytes, self._staging_pages(spec))
        zero_copy = path is IOPath.ZERO_COPY
        registration = PoolRegistration(
            pool=spec.kind,
            attention=spec.attention,
            layout=spec.layout,
            namespace=view.namespaces[0],
            page_nbytes=view.part_nbytes,
            buffers_per_page=spec.buffers_per_page() if zero_copy else 1,
            regions=pool.regions() if (zero_copy and pool is not None) else (),
            staging=(view.staging.region(),) if view.staging is not None else (),
        )
        try:
            self.store.register_pool(registration)
        except BackendSetupError as exc:
            log.warning("hicache-draft: %s pool offload disabled: %s", spec.kind.value, exc)
            view.path, view.reason = IOPath.DISABLED, str(exc)
        return view

    def _staging_pages(self, spec: PoolSpec) -> int:
        return staging_pages(spec.page_nbytes, self.settings.staging_pages, STORAGE_BATCH_SIZE)

    def _view(self, kind: PoolKind | None) -> PoolView | None:
        view = self.views.get(kind) if kind is not None else None
        return view if view is not None and view.path is not IOPath.DISABLED else None

    # -- the page mover -----------------------------------------------------------------------
    def _run(self, op: str, jobs: Sequence[_Job]) -> list[list[bool]]:
        """Move pages in lockstep chunks (all pools of a chunk in one backend call); per-page results."""
        out = [[False] * len(j.groups) for j in jobs]
        if not jobs or not any(j.groups for j in jobs):
            return out
        stagings = {id(j.view.staging): j.view.staging for j in jobs if j.staged and j.view.staging is not None}
        total = max(len(j.groups) for j in jobs)
        chunk = min((s.pages for s in stagings.values()), default=total)
        for start in range(0, total, chunk):
            with ExitStack() as stack:
                for key in sorted(stagings):
                    st = stagings[key]
                    if not st.lock.acquire(timeout=self.settings.timeout_s):
                        self._warn_once(f"staging:{op}", "hicache-draft: staging busy for %ss; pages failed",
                                        self.settings.timeout_s)
                        break
                    stack.callback(st.lock.release)
                else:
                    try:
                        self._run_chunk(op, jobs, start, start + chunk, out)
                    except Exception as exc:  # never raise into SGLang's I/O threads
                        self._warn_once(f"run:{op}:{type(exc).__name__}", "hicache-draft: page %s failed: %s: %s",
                                        op, type(exc).__name__, exc)
        return out

    def _run_chunk(self, op: str, jobs: Sequence[_Job], lo: int, hi: int, out: list[list[bool]]) -> None:
        transfers: list[PageTransfer] = []
        plans: list[tuple[int, _Job, int, int, list[tuple[tuple[Buffer], torch.Tensor]] | None]] = []
        for ji, job in enumerate(jobs):
            end = min(hi, len(job.groups))
            if end <= lo:
                continue
            view = job.view
            split = view.split
            groups = job.groups[lo:end]
            keys = view.keys(groups) if job.keys is None else job.keys[lo * split : end * split]
            staged: list[tuple[tuple[Buffer], torch.Tensor]] | None = None
            if job.staged:
                assert view.staging is not None
                staged = view.staging.parts(view.part_nbytes)[: len(keys)]
                if op == "set":
                    self._copy_out(job, lo, staged)
                bufs: Sequence[tuple[Buffer, ...]] = [b for b, _ in staged]
            else:
                assert job.slots is not None
                bufs = view.slot_buffers.buffers(job.slots[lo:end])
            if split == 1:
                pages = list(map(Page, keys, groups, itertools.repeat(view.namespaces[0]), bufs))
            else:
                pages = list(map(Page, keys, [g for g in groups for _ in range(split)],
                                 view.namespaces * len(groups), bufs))
            transfers.append(PageTransfer(pool=view.kind, pages=pages, zero_copy=staged is None))
            plans.append((ji, job, lo, end, staged))
        if not transfers:
            return
        if op == "set":
            results, io_done = self.store.page_set_tracked(transfers)
        else:
            results, io_done = self.store.page_get(transfers)
        ok_result = PageResult.OK
        for ji, job, start, end, staged in plans:
            got = results.get(job.view.kind, [])
            split = job.view.split
            n = end - start
            if len(got) != n * split:
                continue  # the Store answers every page; anything else is a failure (already False)
            if split == 1:
                oks = [r is ok_result for r in got]
            else:
                oks = [all(r is ok_result for r in got[i * split : (i + 1) * split]) for i in range(n)]
            if op == "get" and staged is not None:
                self._copy_in(job, start, staged, oks)
            out[ji][start:end] = oks
        if not io_done.done() and any(t.zero_copy for t in transfers):
            # SGLang reuses these host slots as soon as it sees the failure: give the abandoned call up
            # to timeout_s more to let go of them (this blocks only SGLang's I/O thread, bounded)
            with suppress(BaseException):
                io_done.result(timeout=self.store.timeout_s)
            if not io_done.done():
                self._warn_once(
                    "slots:held", "hicache-draft: backend %r ignored its deadline by more than timeout_s and may "
                    "still %s SGLang's host slots; a late read is never stored as data, but fix the backend",
                    self.store.name, "write into" if op == "get" else "read",
                )
        if not io_done.done():  # this call timed out: the backend may still use its staging memory
            for _, job, _, _, staged in plans:
                if staged is not None and job.view.staging is not None:
                    self._warn_once("staging:replaced", "hicache-draft: a backend call timed out; its staging "
                                    "memory is left to it and replaced by unregistered memory")
                    job.view.staging.replace()

    @staticmethod
    def _copy_out(job: _Job, lo: int, staged: Sequence[tuple[tuple[Buffer], torch.Tensor]]) -> None:
        """Pages ``lo``... of the job into their staging pieces (page-major, head parts)."""
        view, split = job.view, job.view.split
        if job.raw is not None:  # flat pages of one part: their bytes are the page's bytes
            assert view.staging is not None  # the pieces are the area's first ones, in order
            n = len(staged)
            torch.cat(job.raw[lo : lo + n], out=view.staging.tensor[: n * view.part_nbytes])
            return
        for n, (_, dst) in enumerate(staged):
            i, part = lo + n // split, n % split
            if job.slots is not None:
                assert view.pool is not None
                view.pool.copy_page_out(job.slots[i], dst, part, split)
            else:
                assert job.flats is not None
                view.one_page(job.flats[i]).copy_page_out(0, dst, part, split)

    @staticmethod
    def _copy_in(
        job: _Job, lo: int, staged: Sequence[tuple[tuple[Buffer], torch.Tensor]], oks: Sequence[bool]
    ) -> None:
        """The staging pieces of the pages that came back into their destinations."""
        view, split = job.view, job.view.split
        if job.raw is not None:
            for (_, src), dst, ok in zip(staged, job.raw[lo:], oks, strict=False):
                if ok:
                    dst.copy_(src)
            return
        for n, (_, src) in enumerate(staged):
            i, part = lo + n // split, n % split
            if not oks[n // split]:
                continue
            if job.slots is not None:
                assert view.pool is not None
                view.pool.copy_page_in(job.slots[i], src, part, split)
            else:
                assert job.flats is not None
                view.one_page(job.flats[i]).copy_page_in(0, src, part, split)

    def _slot_job(self, view: PoolView | None, keys: Sequence[str], host_indices: Any) -> _Job | None:
        """A job over host slots (page ``i`` starts at ``host_indices[i * page_size]``); None if unusable."""
        if view is None or view.pool is None or host_indices is None:
            return None
        ps = view.spec.page_size
        idx = host_indices.tolist() if isinstance(host_indices, torch.Tensor) else list(host_indices)
        if len(idx) != len(keys) * ps:
            self._warn_once(f"indices:{view.kind}", "hicache-draft: %s: %d host indices for %d pages of %d tokens",
                            view.kind.value, len(idx), len(keys), ps)
            return None
        slots = idx[::ps] if isinstance(host_indices, torch.Tensor) else [int(s) for s in idx[::ps]]
        try:
            view.slot_buffers.check(slots)
        except ValueError as exc:
            self._warn_once(f"slot:{view.kind}", "hicache-draft: %s: %s", view.kind.value, exc)
            return None
        return _Job(view=view, groups=page_groups(keys), slots=slots, keys=self._hash_keys(view, keys))

    @staticmethod
    def _hash_keys(
        view: PoolView, hashes: Sequence[str], joined: str | None = None, remember: bool = True
    ) -> list[str]:
        """``view.keys(page_groups(hashes))``, remembered per SGLang hash for one-part pools (up to
        :data:`_KEY_CACHE` hashes) by the calls that move pages (``remember``), so that the hit
        query for pages this server stored or restored is a dictionary lookup per page."""
        if view.split != 1:
            return view.keys(page_groups(hashes, joined))
        cache = view.key_cache
        try:
            return list(map(cache.__getitem__, hashes))
        except (KeyError, TypeError):
            pass
        keys = view.keys(page_groups(hashes, joined))
        if remember:
            if len(cache) + len(keys) > _KEY_CACHE:
                cache.clear()
            cache.update(zip(hashes, keys, strict=True))
        return keys

    # -- zero-copy v1 (target pages by host index) -----------------------------------------------
    @_never_raise(_all_false)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        job = self._slot_job(self._view(PoolKind.KV), keys, host_indices)
        return self._run("set", [job])[0] if job else [False] * len(keys)

    @_never_raise(_all_false)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        job = self._slot_job(self._view(PoolKind.KV), keys, host_indices)
        return self._run("get", [job])[0] if job else [False] * len(keys)

    # -- v2 pool transfers (KV and DRAFT in one call) ---------------------------------------------
    def _v2(self, op: str, transfers: list[Any]) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        jobs: list[_Job] = []
        names: list[Any] = []
        for t in transfers:
            keys = list(t.keys or [])
            out[t.name] = [False] * len(keys)
            job = self._slot_job(self._view(_POOL_OF_NAME.get(str(t.name))), keys, t.host_indices)
            if job is not None:
                jobs.append(job)
                names.append(t.name)
        for name, res in zip(names, self._run(op, jobs), strict=True):
            out[name] = res
        return out

    @_never_raise(_no_pages)
    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._v2("set", transfers)

    @_never_raise(_no_pages)
    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        return self._v2("get", transfers)

    @_never_raise(_no_hit)
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None
    ) -> Any:
        """Longest stored target prefix, then each extra pool's rule; DRAFT (ALL_PAGES) shortens
        the hit to the draft prefix; pools we do not hold give no hit."""
        extra = [(t, _POOL_OF_NAME.get(str(t.name))) for t in pool_transfers or []]
        queries: dict[PoolKind, list[str]] = {}
        for kind in (PoolKind.KV, PoolKind.DRAFT):
            view = self._view(kind)
            if view is not None and (kind is PoolKind.KV or any(k is kind for _, k in extra)):
                queries[kind] = self._hash_keys(view, keys, remember=False)
        counts = self.store.page_exists(queries) if queries else {}

        def pages(kind: PoolKind) -> int:
            view = self._view(kind)
            return counts.get(kind, 0) // view.split if view is not None else 0

        kv_pages = pages(PoolKind.KV)
        hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        final = kv_pages
        for t, kind in extra:
            if str(getattr(t.hit_policy, "value", t.hit_policy)) == "block_groups":
                continue  # such a pool reports its own verdict and never gates the KV hit
            boundary = min(pages(kind), kv_pages) if kind is not None else 0
            # Pages are written prefix-first, so the stored prefix answers TRAILING_PAGES too
            # (conservatively: a window past the prefix is not reported). Restorable prefixes are
            # 1..n for every pool, so together they are 1..(the smallest boundary).
            if boundary:
                hit_count[t.name] = boundary
            final = min(final, boundary)
        return transfer_result(final, hit_count, list(range(1, final + 1)))

    @_never_raise(_constant(0))
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading stored pages (target pages; ``{hash}.draft`` keys ask the draft pool).

        With ``legacy_draft_pool`` set (SGLang 0.5.15-0.5.18, whose hit query asks for target keys
        only and then restores draft pages best-effort), the target hit is shortened to the stored
        draft prefix: ``min(target, draft)``, so no restored prefix keeps stale draft KV."""
        if not keys:
            return 0
        try:
            joined = "".join(keys)
        except TypeError:
            joined = "."
        if "." not in joined:  # target page hashes only (SGLang's hit query)
            view = self._view(PoolKind.KV)
            if view is None:
                return 0
            legacy = self._legacy_draft
            if legacy is None:
                counts = self.store.page_exists({PoolKind.KV: self._hash_keys(view, keys, joined, False)})
                return counts[PoolKind.KV] // view.split
            pools = [view, legacy]
            counts = self.store.page_exists({v.kind: self._hash_keys(v, keys, joined, False) for v in pools})
            return min(counts.get(v.kind, 0) // v.split for v in pools)
        kinds_of, groups = split_generic_keys(keys)
        kinds = set(kinds_of)
        if len(kinds) != 1:
            for i, k in enumerate(keys):
                if not self.exists(k):
                    return i
            return len(keys)
        kind = next(iter(kinds))
        pools = [self._view(kind)]
        if kind is PoolKind.KV and self._legacy_draft is not None:
            pools.append(self._legacy_draft)
        if pools[0] is None:
            return 0
        queries = {v.kind: v.keys(groups) for v in pools if v}
        counts = self.store.page_exists(queries)
        return min(counts.get(v.kind, 0) // v.split for v in pools if v)

    @_never_raise(_constant(False))
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- SGLang's generic calls: flat data pages ------------------------------------------------
    def _flat_jobs(
        self, keys: Sequence[str], flats: Sequence[torch.Tensor | None],
        parsed: tuple[list[PoolKind | None], list[str]] | None = None,
    ) -> tuple[list[_Job], list[list[int]]]:
        """Group ``keys`` by pool into jobs over flat pages; also each job's positions in ``keys``."""
        kinds, groups = parsed if parsed is not None else split_generic_keys(keys)
        by_kind: dict[PoolKind, tuple[_Job, list[int]]] = {}
        for pos, (kind, group, flat) in enumerate(zip(kinds, groups, flats, strict=True)):
            view = self._view(kind)
            if view is not None and view.staging is None:
                with self._lock:
                    if view.staging is None:  # zero-copy pool reached by generic calls: unregistered staging
                        view.staging = Staging(view.spec.page_nbytes, self._staging_pages(view.spec))
            if view is None or flat is None:
                self._warn_once(f"generic:{kind}", "hicache-draft: no usable pool for generic key %r", keys[pos])
                continue
            if flat.numel() * flat.element_size() != view.spec.page_nbytes:
                self._warn_once(f"size:{kind}", "hicache-draft: flat %s page of %d bytes, expected %d",
                                view.kind.value, flat.numel() * flat.element_size(), view.spec.page_nbytes)
                continue
            entry = by_kind.get(view.kind)
            if entry is None:
                entry = by_kind[view.kind] = (_Job(view=view, groups=[], flats=[]), [])
            entry[0].groups.append(group)
            assert entry[0].flats is not None
            entry[0].flats.append(flat)
            entry[1].append(pos)
        jobs = [j for j, _ in by_kind.values()]
        for job in jobs:
            assert job.flats is not None
            if job.view.split == 1 and all(f.is_contiguous() and f.device.type == "cpu" for f in job.flats):
                # one part per page: a flat page's bytes in order are the page's stored bytes
                job.raw = [f.view(-1).view(torch.uint8) for f in job.flats]
        return jobs, [p for _, p in by_kind.values()]

    @_never_raise(_constant(False))
    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat data pages (``get_data_page(i, flat=True)``); True only if every page is stored."""
        if values is None or len(values) != len(keys):
            self._warn_once("batch_set:values", "hicache-draft: batch_set needs one flat page per key")
            return False
        jobs, positions = self._flat_jobs(keys, values)
        results = [False] * len(keys)
        for pos, res in zip(positions, self._run("set", jobs), strict=True):
            for p, r in zip(pos, res, strict=True):
                results[p] = r
        return all(results)

    @_never_raise(_nones)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Load flat data pages into ``target_locations`` (allocated when absent); the filled
        tensor per key, or None for a page that did not come back."""
        parsed = split_generic_keys(keys)
        targets: list[torch.Tensor | None] = []
        for i, kind in enumerate(parsed[0]):
            given = target_locations[i] if target_locations is not None and i < len(target_locations) else None
            if isinstance(given, torch.Tensor) and given.is_contiguous() and given.device.type == "cpu":
                targets.append(given)
                continue
            view = self._view(kind)
            targets.append(
                torch.empty(view.spec.page_nbytes // view.spec.itemsize, dtype=view.spec.torch_dtype) if view else None
            )
        jobs, positions = self._flat_jobs(keys, targets, parsed)
        got: list[torch.Tensor | None] = [None] * len(keys)
        for pos, res in zip(positions, self._run("get", jobs), strict=True):
            for p, r in zip(pos, res, strict=True):
                if r:
                    got[p] = targets[p]
        return got

    @_never_raise(_constant(None))
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    @_never_raise(_constant(False))
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -- lifecycle ------------------------------------------------------------------------------
    clear = _Unclearable()

    def get_stats(self) -> None:
        return None

    @_never_raise(_constant(None))
    def close(self) -> None:
        self.store.close()
