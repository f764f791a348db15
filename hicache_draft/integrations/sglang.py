"""An SGLang ``HiCacheStorage`` that stores every pool SGLang registers (target and draft KV, DSA
indexers, sliding-window KV) in any hicache-draft backend.

Load it through SGLang's own dynamic-backend mechanism::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "hicache_draft",
        "module_path": "hicache_draft.integrations.sglang", "class_name": "HiCacheDraftStorage",
        "interface_v1": true,
        "hicache_draft": {"backend": "file", "backend_options": {"root": "/mnt/kv"}}}'

What SGLang calls, and where it goes:

* ``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists``: target (``kv``) pages by host index.
* ``register_mem_host_pool_v2`` with any ``PoolName`` (DRAFT, INDEXER, DRAFT_INDEXER, SWA,
  DRAFT_SWA, ...), then ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``: the pages of
  every transfer in one backend call; the hit is :func:`hicache_draft.binding.usable_hit` over the
  target KV and every transfer's pool (ALL_PAGES pools over the whole prefix, TRAILING_PAGES pools
  over the transfer's keys, as SGLang's own backends check them).
* ``batch_set`` / ``batch_get`` / ``set`` / ``get`` / ``exists`` (SGLang's generic calls, flat data
  pages): ``"{hash}"`` keys are target pages, ``"{hash}.{pool}"`` keys that pool's pages.

Each pool is a :class:`hicache_draft.binding.PoolBinding`, planned by the same code the controller
and ``hicache-draft check`` use (:func:`~hicache_draft.integrations.sglang_pools.plan_pool`): its
namespaces, split factor, I/O path, registration, page building and staging are the binding's; this
module translates SGLang's calls, keys and results. A pool is held when its shape can be read
(:func:`~hicache_draft.integrations.sglang_pools.host_pool_spec`) and the backend declares its
component for its role; any other pool is logged once with the reason and answered as SGLang
expects of a pool not held: its pages are not stored, and its ALL_PAGES pools give no hit.
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
import logging
import operator
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from hicache_draft import _native
from hicache_draft.backend import BackendContext
from hicache_draft.binding import Batch, PoolBinding, Staging, query_hit, settle, staging_pages, usable_hit
from hicache_draft.capabilities import HitPolicy, IOPath, PoolKind
from hicache_draft.errors import ConfigError
from hicache_draft.integrations.sglang_config import (
    AdapterSettings,
    Placement,
    interface_v1,
    parse_settings,
    placement,
)
from hicache_draft.integrations.sglang_loader import load_storage_module
from hicache_draft.integrations.sglang_pools import (
    host_pool_arrays,
    host_pool_spec,
    legacy_draft_spec,
    plan_pool,
)
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft.store import Store
from hicache_draft.workers import DONE

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
_RESULT_FIELDS = frozenset(f.name for f in dataclasses.fields(PoolTransferResult))
_HAS_RESTORABLE = "restorable_prefix_pages" in _RESULT_FIELDS
_POOL_NAMES: dict[str, Any] = {m.value: m for m in PoolName}  # a pool's name -> SGLang's PoolName
_F = TypeVar("_F", bound=Callable[..., Any])
_KEY_CACHE = 1 << 15
# members an existence query asks for, as module names (an Enum member looked up on its class
# costs a Python-level attribute hook each time)
_KV, _DRAFT = PoolKind.KV, PoolKind.DRAFT
_ALL_PAGES, _TRAILING_PAGES = HitPolicy.ALL_PAGES, HitPolicy.TRAILING_PAGES


def transfer_result(kv_hit_pages: int, extra_pool_hit_pages: dict[Any, int], restorable: list[int]) -> Any:
    """A ``PoolTransferResult`` with the fields this SGLang release's dataclass has (found with
    :func:`dataclasses.fields`, not by version): ``restorable_prefix_pages`` only where it exists."""
    if _HAS_RESTORABLE:
        return PoolTransferResult(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=extra_pool_hit_pages,
                                  restorable_prefix_pages=restorable)
    return PoolTransferResult(kv_hit_pages=kv_hit_pages, extra_pool_hit_pages=extra_pool_hit_pages)


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


def page_groups(sglang_keys: Sequence[str]) -> list[str]:
    """:func:`page_group` of every key; a batch of lowercase hex keys (SGLang's) checked in one
    compiled pass and kept as it is."""
    if _native.lower_hex(sglang_keys):
        return list(sglang_keys)  # every key is non-empty lowercase hex: its own group
    return [page_group(k) for k in sglang_keys]


def split_generic_key(key: str) -> tuple[str, str]:
    """``"{hash}"`` -> (``"kv"``, group), ``"{hash}.{pool}"`` -> (pool, group): SGLang's generic
    keys (``HiCacheFile``'s ``{key}.{pool_name}``, the legacy ``{hash}.draft``)."""
    head, sep, tail = key.rpartition(".")
    if not sep:
        return PoolKind.KV, page_group(key)
    return tail, page_group(head)


def split_generic_keys(keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """:func:`split_generic_key` of every key, as (pools, groups); a batch without any ``"."``
    (target pages only, SGLang's usual batch) in whole-batch steps."""
    if _native.lower_hex(keys):  # SGLang's page hashes: no "." in any
        return [PoolKind.KV] * len(keys), list(keys)
    parsed = [split_generic_key(k) for k in keys]
    return [k for k, _ in parsed], [g for _, g in parsed]


class _Hashes:
    """One call's SGLang page hashes, with their page groups (:func:`page_groups`) made at most
    once, when a pool first needs them, and the storage keys found for them so far, per pool."""

    __slots__ = ("_groups", "_own", "found", "hashes")

    def __init__(self, hashes: Sequence[str], groups: Sequence[str] | None = None, own: bool | None = None) -> None:
        self.hashes = hashes
        self._groups = groups
        self._own = own  # every hash is lowercase hex, its own page group (None: not known yet)
        self.found: dict[str, Sequence[str] | None] = {}  # per pool: its remembered keys, or None

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, index: Any) -> Any:  # noqa: ANN401  (a Sequence of the hashes: query_hit slices windows)
        return self.hashes[index]

    @property
    def groups(self) -> Sequence[str]:
        if self._groups is None:
            self._groups = list(self.hashes) if self.own else page_groups(self.hashes)
        return self._groups

    @property
    def own(self) -> bool:
        """Every hash is lowercase hex (SGLang's page hashes), so each is its own page group."""
        if self._own is None:
            self._own = bool(_native.lower_hex(self.hashes))
        return self._own


@dataclass
class _Job:
    """The pages of one pool in one adapter call: from host slots or from flat SGLang pages."""

    binding: PoolBinding
    groups: list[str]
    slots: list[int] | None = None
    flats: list[torch.Tensor] | None = None
    keys: Sequence[str] | None = None  # storage keys, page-major (else made from groups)

    @property
    def staging(self) -> Staging | None:
        staged = self.slots is None or not self.binding.zero_copy
        return self.binding.staging if staged else None


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
    ``storage_config.extra_config["hicache_draft"]`` (:class:`AdapterSettings`). ``bindings``: every
    pool SGLang registered that we could read, by SGLang's pool name (disabled ones say why).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.storage_config = storage_config
        self.settings: AdapterSettings = parse_settings(extra)
        self.placement: Placement = placement(storage_config, self.settings)
        self.interface_v1 = interface_v1(extra)
        par = self.placement.parallel
        context = BackendContext(tp_rank=par.tp_rank, tp_size=par.tp_size, timeout_s=self.settings.timeout_s)
        self.store = Store.open(self.settings.backend, self.settings.backend_options, context,
                                poll_s=self.settings.handover_poll_us * 1e-6)
        self.bindings: dict[str, PoolBinding] = {}
        self.sources: dict[str, Any] = {}  # pool name -> the SGLang host pool it reads
        self.key_caches: dict[str, dict[str, str]] = {}  # pool name -> SGLang hash -> key
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
        """Every other host pool SGLang registers (``KV`` again is the target pool): held when its
        shape can be read and the backend declares its component; otherwise logged with why."""
        name = str(host_pool_name)
        if name == PoolKind.KV and self.sources.get(name) is host_pool:
            return
        self._register(name, host_pool)

    def on_host_pools_registered(self) -> None:
        for name, b in self.bindings.items():
            log.info("hicache-draft: pool %s: %s (%s)", name, b.path.value, b.reason)

    def _register(self, name: str, host_pool: Any) -> None:
        try:
            spec = host_pool_spec(host_pool, name)
            host = HostPool.wrap_arrays(spec, host_pool_arrays(host_pool, spec))
        except (ConfigError, ValueError) as exc:
            if name == PoolKind.KV:
                raise
            log.warning("hicache-draft: pool %r is not held (its pages are not stored and an all_pages pool "
                        "gives no hit): %s", name, exc)
            return
        self.sources[name] = host_pool
        self.bindings[name] = self._bind(spec, host)
        if name == PoolKind.KV and self.settings.legacy_draft_pool is not None and PoolKind.DRAFT not in self.bindings:
            self.bindings[PoolKind.DRAFT] = self._bind(legacy_draft_spec(self.settings.legacy_draft_pool, spec), None)
        why = settle(self.bindings)  # a target pool the backend cannot hold makes every pool useless
        if why:
            self._warn_once("blocked", "hicache-draft: offload disabled: %s", why)

    def _bind(self, spec: PoolSpec, host: HostPool | None) -> PoolBinding:
        """Plan, stage and register one pool (the binding's rules; staging sized for SGLang's batch)."""
        kv = self.bindings.get(PoolKind.KV)
        kv_active = spec.kind == PoolKind.KV or (kv is not None and kv.plan.path is not IOPath.DISABLED)
        plan = plan_pool(spec, self.placement, self.store.capabilities, has_memory=host is not None,
                         kv_active=kv_active)
        staged = plan.path is IOPath.GENERIC or host is None or (spec.kind == PoolKind.KV and not self.interface_v1)
        staging = None
        if plan.path is not IOPath.DISABLED and staged:
            staging = Staging(plan.spec.page_nbytes, staging_pages(plan.spec.page_nbytes, self.settings.staging_pages,
                                                                  STORAGE_BATCH_SIZE))
        binding = PoolBinding(plan, host, staging)
        self.key_caches[binding.name] = {}
        if not binding.register(self.store) and not binding.active:
            log.warning("hicache-draft: pool %r is not held: %s", str(spec.kind), binding.reason)
        return binding

    def _binding(self, name: Any) -> PoolBinding | None:
        # SGLang's PoolName is a str Enum: it finds its binding as it is; anything else by str()
        b = self.bindings.get(name) if isinstance(name, str) else None
        if b is None and name is not None:
            b = self.bindings.get(str(name))
        return b if b is not None and b.active else None

    @property
    def _legacy_draft(self) -> PoolBinding | None:
        """The draft pool known only from ``legacy_draft_pool`` (no registered memory): SGLang
        0.5.15-0.5.18 moves its pages as ``{hash}.draft`` flat pages."""
        b = self._binding(PoolKind.DRAFT)
        return b if b is not None and b.host is None else None

    # -- the page mover -----------------------------------------------------------------------
    def _run(self, op: str, jobs: Sequence[_Job]) -> list[list[bool]]:
        """Move pages in lockstep chunks (all pools of a chunk in one backend call); per-page results."""
        out = [[False] * len(j.groups) for j in jobs]
        total = max((len(j.groups) for j in jobs), default=0)
        if not total:
            return out
        stagings = {id(s): s for j in jobs if (s := j.staging) is not None}
        if not stagings and all(j.slots is not None and j.binding.zero_copy for j in jobs):
            # zero-copy pages only (v1, v2): one backend call, no staging to hold
            try:
                self._run_zero_copy(op, jobs, out)
            except Exception as exc:  # never raise into SGLang's I/O threads
                self._warn_once(f"run:{op}:{type(exc).__name__}", "hicache-draft: page %s failed: %s: %s",
                                op, type(exc).__name__, exc)
            return out
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

    def _run_zero_copy(self, op: str, jobs: Sequence[_Job], out: list[list[bool]]) -> None:
        """Every job's pages straight from or into SGLang's host slots, in one backend call (what
        :meth:`_run_chunk` does for one chunk, in the fewest steps: on a fast backend each step of the
        adapter's own counts, and the interpreter's caches are cold after every storage call)."""
        moved = [(ji, j.binding, j.binding.zero_copy_transfer(j.groups, j.slots, j.keys))  # type: ignore[arg-type]
                 for ji, j in enumerate(jobs) if j.groups]
        results, io_done = (self.store.page_set_tracked if op == "set" else self.store.page_get)(
            [t for *_, t in moved])
        for ji, b, t in moved:
            got = results.get(b.name, ())
            if len(got) == len(t.pages):  # the Store answers every page; anything else is a failure
                out[ji] = b.page_oks(got)
        if io_done is not DONE and not io_done.done():
            self._hold_slots(op, io_done)

    def _hold_slots(self, op: str, io_done: Future[Any]) -> None:
        """After a zero-copy call that timed out: SGLang reuses its host slots as soon as it sees the
        failure, so give the abandoned call up to timeout_s more to let go of them (this blocks only
        SGLang's I/O thread, bounded), and say so when it did not."""
        with suppress(BaseException):
            io_done.result(timeout=self.store.timeout_s)
        if not io_done.done():
            self._warn_once(
                "slots:held", "hicache-draft: backend %r ignored its deadline by more than timeout_s and may "
                "still %s SGLang's host slots; a late read is never stored as data, but fix the backend",
                self.store.name, "write into" if op == "get" else "read",
            )

    def _run_chunk(self, op: str, jobs: Sequence[_Job], lo: int, hi: int, out: list[list[bool]]) -> None:
        batches: list[tuple[int, int, int, Batch]] = []
        for ji, job in enumerate(jobs):
            end = min(hi, len(job.groups))
            if end <= lo:
                continue
            b = job.binding
            groups = job.groups[lo:end]
            keys = None if job.keys is None else job.keys[lo * b.split : end * b.split]
            if job.slots is not None:
                batch = b.slot_batch(groups, job.slots[lo:end], fill=op == "set", keys=keys, checked=True)
            else:
                assert job.flats is not None
                batch = b.flat_batch(groups, job.flats[lo:end], fill=op == "set", keys=keys)
            batches.append((ji, lo, end, batch))
        if not batches:
            return
        transfers = [batch.transfer for *_, batch in batches]
        if op == "set":
            results, io_done = self.store.page_set_tracked(transfers)
        else:
            results, io_done = self.store.page_get(transfers)
        for ji, start, end, batch in batches:
            b = batch.binding
            got = results.get(b.name, [])
            if len(got) != (end - start) * b.split:
                continue  # the Store answers every page; anything else is a failure (already False)
            oks = b.finish_get(batch, got) if op == "get" and batch.staged else b.page_oks(got)
            if start == 0 and end == len(out[ji]):
                out[ji] = oks
            else:
                out[ji][start:end] = oks
        if io_done is DONE or io_done.done():
            return
        if any(batch.zero_copy_slots for *_, batch in batches):
            self._hold_slots(op, io_done)
        if not io_done.done():  # this call timed out: the backend may still use its staging memory
            for *_, batch in batches:
                st = batch.binding.staging
                if batch.staged and st is not None:
                    self._warn_once("staging:replaced", "hicache-draft: a backend call timed out; its staging "
                                    "memory is left to it and replaced by unregistered memory")
                    st.replace()

    def _slot_job(self, binding: PoolBinding | None, keys: Sequence[str], host_indices: Any,
                  shared: dict[Any, Any] | None = None) -> _Job | None:
        """A job over host slots (page ``i`` starts at ``host_indices[i * page_size]``); None if unusable.
        ``shared``: what the pools of one call share, when SGLang hands them the same objects (a
        draft pool's transfer carries the target's key list and host indices): the slots read once
        per indices object, page size and slot count, the hashes' groups once per key list."""
        if binding is None or binding.host is None or host_indices is None:
            return None
        memo = (id(host_indices), binding.spec.page_size, binding.host.slots, len(keys))
        slots = shared.get(memo) if shared is not None else None
        if slots is None:
            try:  # only each page's first slot is used, checked; the count must be the keys' pages'
                slots = binding.page_slots(host_indices, len(keys))
            except ValueError as exc:
                self._warn_once(f"slot:{binding.name}", "hicache-draft: %s: %s", binding.name, exc)
                return None
            if shared is not None:
                shared[memo] = slots
        hashes = shared.get(id(keys)) if shared is not None else None
        if hashes is None:
            hashes = _Hashes(keys)
            if shared is not None:
                shared[id(keys)] = hashes  # it holds keys: the id stays this list's for the call
        known = self._recall(binding, hashes)
        if known is not None:  # only lowercase hex hashes are remembered: each is its own page group
            return _Job(binding, hashes.hashes, slots, keys=known)  # type: ignore[arg-type]
        return _Job(binding, hashes.groups, slots, keys=self._hash_keys(binding, hashes, True))

    def _hash_keys(self, binding: PoolBinding, hashes: Sequence[str], remember: bool = False) -> Sequence[str]:
        """``binding.keys(page_groups(hashes))`` (``hashes``: a :class:`_Hashes`, or SGLang hashes),
        remembered per SGLang hash for one-part pools (up to :data:`_KEY_CACHE` hashes) by the calls
        that move pages (``remember``; batches of lowercase hex hashes only, SGLang's: each is its own
        page group, so a remembered hash is never one of the generic ``{hash}.{pool}`` keys and a
        call that finds every hash remembered needs no pass over the hashes for their groups), so
        that the hit query for pages this server stored or restored is one lookup of the whole
        batch. It is :func:`query_hit`'s ``keys_of``."""
        if not isinstance(hashes, _Hashes):
            hashes = _Hashes(hashes)
        if binding.split != 1:
            return binding.keys(hashes.groups)
        known = self._recall(binding, hashes)
        if known is not None:
            return known
        keys = binding.keys(hashes.groups)
        if remember and hashes.own:
            cache = self.key_caches.setdefault(binding.name, {})
            if len(cache) + len(keys) > _KEY_CACHE:
                cache.clear()
            cache.update(zip(hashes.hashes, keys, strict=True))
        return keys

    def _recall(self, binding: PoolBinding, hashes: _Hashes) -> Sequence[str] | None:
        """The remembered storage keys of ``hashes`` in ``binding``'s one-part pool, when every
        one is remembered (one lookup of the whole batch, kept in ``hashes.found``), else None."""
        found = hashes.found
        if binding.name in found:
            return found[binding.name]
        cache = self.key_caches.get(binding.name)
        h = hashes.hashes
        got: Sequence[str] | None = None
        if cache and h and binding.split == 1:
            try:
                if h[0] in cache:  # a batch never seen misses here, without raising
                    got = operator.itemgetter(*h)(cache) if len(h) > 1 else [cache[h[0]]]
            except (KeyError, TypeError):
                got = None
        found[binding.name] = got
        return got

    # -- zero-copy v1 (target pages by host index) -----------------------------------------------
    @_never_raise(_all_false)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        job = self._slot_job(self._binding(PoolKind.KV), keys, host_indices)
        return self._run("set", [job])[0] if job else [False] * len(keys)

    @_never_raise(_all_false)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        job = self._slot_job(self._binding(PoolKind.KV), keys, host_indices)
        return self._run("get", [job])[0] if job else [False] * len(keys)

    # -- v2 pool transfers (every pool of a call in one backend call) ------------------------------
    def _v2(self, op: str, transfers: list[Any]) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        jobs: list[_Job] = []
        names: list[Any] = []
        shared: dict[Any, Any] = {}
        for t in transfers:
            keys = t.keys or []
            out[t.name] = [False] * len(keys)
            binding = self._binding(t.name)
            if binding is None:
                self._warn_once(f"v2:{t.name}", "hicache-draft: pool %r is not held; its %s pages fail", str(t.name),
                                op)
            job = self._slot_job(binding, keys, t.host_indices, shared)
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

    def _hit(
        self, hashes: Sequence[str], legacy: PoolBinding | None,
        keys_of: Callable[[PoolBinding, Sequence[str]], Sequence[str]] | None = None,
    ) -> int:
        """The usable hit (:func:`query_hit`) of ``hashes`` over the target KV, and over the legacy
        draft pool when it is given (:meth:`batch_exists`). ``keys_of``: as :func:`query_hit`'s
        (``hashes`` are then page groups); by default :meth:`_hash_keys`, which recalls the keys of
        pages this server moved."""
        kv = self.bindings.get(_KV)
        if kv is None or not kv.active:
            return 0
        held, windows = [kv], {}
        if legacy is not None:
            held.append(legacy)
            if legacy.spec.hit_policy is _TRAILING_PAGES:  # SGLang's all_pages: the whole prefix
                windows[legacy.name] = len(hashes)
        return query_hit(self.store.page_exists, held, hashes, keys_of or self._hash_keys, windows=windows).pages

    @_never_raise(_no_hit)
    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[Any] | None = None, extra_info: Any = None
    ) -> Any:
        """The usable hit over the target KV and every transfer's pool: ALL_PAGES pools over the
        whole prefix, TRAILING_PAGES pools over their last ``len(transfer.keys)`` pages; a pool
        we do not hold gives no hit (its pages could not be restored). Each pool's boundary is
        reported within the target's stored prefix. (One pass over the transfers and one
        :func:`query_hit`: SGLang asks this per request, and each layer's few tenths of a
        microsecond count several times over right after the Store's hop.)"""
        kv = self.bindings.get(_KV)
        if kv is None or not kv.active:
            return transfer_result(0, {}, [])
        held, windows = [kv], {}
        missing = trailing = False
        for t in pool_transfers or ():
            policy = t.hit_policy  # SGLang's PoolHitPolicy is a str Enum: compared as it is
            if not isinstance(policy, str):
                policy = str(getattr(policy, "value", policy))
            if policy == "block_groups":
                continue  # such a pool reports its own verdict and never gates the KV hit
            asks_window = policy == _TRAILING_PAGES
            trailing = trailing or asks_window
            binding = self._binding(t.name)
            if binding is None:
                self._warn_once(f"hit:{t.name}", "hicache-draft: pool %r is not held, so no prefix is "
                                "restorable with it: no hit", str(t.name))
                missing = True
                continue
            held.append(binding)
            if binding.spec.hit_policy is _TRAILING_PAGES:  # SGLang's all_pages: the whole prefix
                windows[binding.name] = max(1, len(t.keys or ())) if asks_window else len(keys)
        cache = self.key_caches.get(_KV)
        try:
            remembered = bool(cache) and keys[0] in cache
        except (IndexError, TypeError):  # no pages, or not SGLang's hashes
            remembered = False
        if remembered:  # pages this server moved: their storage keys are looked up, not made
            hit = query_hit(self.store.page_exists, held, _Hashes(keys), self._hash_keys, windows=windows)
        else:  # another server's pages: keys made as the controller makes them
            hit = query_hit(self.store.page_exists, held, page_groups(keys), PoolBinding.keys, windows=windows)
        final = 0 if missing else hit.pages
        kv_pages = hit.boundaries.get(kv.name, 0)
        hit_count: dict[Any, int] = {}
        for name, pages in hit.boundaries.items():
            if pages > kv_pages:
                pages = kv_pages
            if pages:
                hit_count[_POOL_NAMES.get(name, name)] = pages
        # every all_pages prefix up to the hit is restorable; with trailing pools only the hit
        # itself was checked (a window below it may be missing), so only it is reported
        restorable = [final] if final and trailing else list(range(1, final + 1))
        return transfer_result(final, hit_count, restorable)

    @_never_raise(_constant(0))
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading stored pages (target pages; ``{hash}.{pool}`` keys ask that pool).

        With ``legacy_draft_pool`` set (SGLang 0.5.15-0.5.18, whose hit query asks for target keys
        only and then restores draft pages best-effort), the target hit is shortened to the stored
        draft prefix, so no restored prefix keeps stale draft KV."""
        if not keys:
            return 0
        draft = self.bindings.get(_DRAFT)
        legacy = self._legacy_draft if draft is not None else None
        hashes = _Hashes(keys)
        kv = self.bindings.get(_KV)
        if kv is not None and self._recall(kv, hashes) is not None:  # hashes this server moved: lowercase hex
            hashes._groups, hashes._own = keys, True
            return self._hit(hashes, legacy)
        # pages another server moved: their keys made as the controller makes them
        if hashes.own:  # SGLang's hit query: target page hashes, each its own group
            return self._hit(keys, legacy, PoolBinding.keys)
        try:
            joined = "".join(keys)
        except TypeError:
            joined = "."
        if "." not in joined:  # target pages under other hashes
            return self._hit(page_groups(keys), legacy, PoolBinding.keys)
        names, groups = split_generic_keys(keys)
        if len(set(names)) != 1:
            for i, k in enumerate(keys):
                if not self.exists(k):
                    return i
            return len(keys)
        binding = self._binding(names[0])
        if binding is None:
            return 0
        pools = [binding] + ([legacy] if legacy is not None and binding.name == PoolKind.KV else [])
        counts = self.store.page_exists({b.name: b.keys(groups) for b in pools})
        return usable_hit(pools, {b.name: counts.get(b.name, 0) // b.split for b in pools},
                          lambda b, n: 0, limit=len(keys)).pages

    @_never_raise(_constant(False))
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- SGLang's generic calls: flat data pages ------------------------------------------------
    def _flat_binding(self, name: str) -> PoolBinding | None:
        """The binding for generic pages of ``name``, with staging (a zero-copy pool reached by
        generic calls gets unregistered staging once)."""
        b = self._binding(name)
        if b is not None and b.staging is None:
            with self._lock:
                if b.staging is None:
                    nbytes = b.spec.page_nbytes
                    b.staging = Staging(nbytes, staging_pages(nbytes, self.settings.staging_pages, STORAGE_BATCH_SIZE))
        return b

    def _flat_jobs(
        self, keys: Sequence[str], flats: Sequence[torch.Tensor | None],
        parsed: tuple[list[str], list[str]] | None = None,
    ) -> tuple[list[_Job], list[list[int]]]:
        """Group ``keys`` by pool into jobs over flat pages; also each job's positions in ``keys``."""
        names, groups = parsed if parsed is not None else split_generic_keys(keys)
        by_name: dict[str, tuple[_Job, list[int]]] = {}
        pools: dict[str, tuple[PoolBinding, int] | None] = {}  # each name's binding and page bytes, found once
        for pos, (name, group, flat) in enumerate(zip(names, groups, flats, strict=True)):
            if name not in pools:
                found = self._flat_binding(name)
                pools[name] = None if found is None else (found, found.spec.page_nbytes)
            pool = pools[name]
            if pool is None or flat is None:
                self._warn_once(f"generic:{name}", "hicache-draft: no usable pool for generic key %r", keys[pos])
                continue
            b, nbytes = pool
            if flat.numel() * flat.element_size() != nbytes:
                self._warn_once(f"size:{name}", "hicache-draft: flat %s page of %d bytes, expected %d",
                                b.name, flat.numel() * flat.element_size(), nbytes)
                continue
            entry = by_name.get(b.name)
            if entry is None:
                entry = by_name[b.name] = (_Job(binding=b, groups=[], flats=[]), [])
            entry[0].groups.append(group)
            assert entry[0].flats is not None
            entry[0].flats.append(flat)
            entry[1].append(pos)
        kv = by_name.get(PoolKind.KV)
        if kv is not None and kv[0].binding.split == 1:
            # target pages: their keys are remembered for the hit query (plain hashes only: _hash_keys)
            job, pos_kv = kv
            job.keys = self._hash_keys(job.binding, _Hashes([keys[p] for p in pos_kv], job.groups), True)
        return [j for j, _ in by_name.values()], [p for _, p in by_name.values()]

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
        given_n = len(target_locations) if target_locations is not None else 0
        tensor = torch.Tensor
        for i, name in enumerate(parsed[0]):
            given = target_locations[i] if i < given_n else None
            if isinstance(given, tensor) and given.is_cpu and given.is_contiguous():
                targets.append(given)
                continue
            b = self._binding(name)
            targets.append(torch.empty(b.spec.page_nbytes // b.spec.itemsize, dtype=b.spec.torch_dtype) if b else None)
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
