"""SGLang's own host pools and controllers around the adapter, on CPU (after ``bootstrap.install``).

What is SGLang's code here: the device pools (``MHATokenToKVPool`` / ``MLATokenToKVPool``), the
page allocator, the host pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, with
``pin_memory=False``), ``HostPoolGroup`` / ``PoolEntry``, the controllers (``HybridCacheController``,
and on releases that have ``set_draft_kv_pool`` the legacy ``HiCacheController``), their storage
threads, SGLang's page hash chain and its ``StorageBackendFactory`` (the adapter is attached as the
``dynamic`` backend). What the harness plays itself is the scheduler's part that lives in the radix
caches (which import the whole serving stack): fill host slots, call ``write_storage`` /
``prefetch``, take the hit from ``prefetch_hit_queue``, allocate host slots, hand the operation to
``prefetch_buffer`` and drain the acknowledgements. TP ranks are SGLang's parallel-state override.

Release differences are found by feature (a method, a signature parameter, a dataclass field),
never by version string.

Models (``Rig(model=...)``), each built the way SGLang's ``hybrid_pool_assembler`` builds it:

* ``"plain"``: an MHA/MLA KV anchor, and a DRAFT sidecar (KV slots, ALL_PAGES) for a draft.
* ``"dsa"`` (DeepSeek-V3.2 / GLM-5 with MTP): a ``DSATokenToKVPool`` target (MLA latent + indexer
  keys and scales, 64-token pages as DSA demands), its MLA host pool as the KV anchor and a
  ``DSAIndexerPoolHost`` laid out on it as ``PoolName.INDEXER`` (KV slots, ALL_PAGES), both in the
  controller's ``HostPoolGroup``; the draft is a ``DSATokenToKVPool`` too, registered as sidecars
  ``DRAFT`` and ``DRAFT_INDEXER`` (its indexer host pool laid out on the draft host pool, indices
  from KV), as ``build_full_draft_pools`` registers them.
* ``"swa"`` (hybrid sliding-window): a full-attention KV anchor and an SWA host pool over its own
  device pool as ``PoolName.SWA`` (its own host slots, TRAILING_PAGES over ``window_pages`` pages),
  as ``build_hybrid_swa_group`` builds them; the draft is a ``DRAFT_SWA`` sidecar whose indices come
  from SWA (TRAILING_PAGES), as ``build_swa_draft_pools`` builds it.

Pools with their own slots (SWA) get slots for the trailing window only: at backup the harness
allocates them (what the tree's SWA component holds), at prefetch it allocates
``min(window, hit)`` pages after the hit, as ``UnifiedRadixCache._alloc_prefetch_aux_staging`` does.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

RELEASE = importlib.metadata.version("sglang") if hasattr(importlib, "metadata") else ""
sg = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
allocator_mod = importlib.import_module("sglang.srt.mem_cache.allocator")
cache_controller = importlib.import_module("sglang.srt.managers.cache_controller")
hybrid_mod = importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
mem_utils = importlib.import_module("sglang.srt.mem_cache.utils")
runtime_context = importlib.import_module("sglang.srt.runtime_context")
try:
    _mha_host = importlib.import_module("sglang.srt.mem_cache.pool_host.mha")
    _mla_host = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
except ImportError:  # pragma: no cover  (every covered release has pool_host/)
    _mha_host = _mla_host = importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
MHATokenToKVPoolHost = _mha_host.MHATokenToKVPoolHost
MLATokenToKVPoolHost = _mla_host.MLATokenToKVPoolHost
_group_mod = importlib.import_module(
    "sglang.srt.mem_cache.pool_host.group" if importlib.util.find_spec("sglang.srt.mem_cache.pool_host.group")
    else "sglang.srt.mem_cache.memory_pool_host"
)
HostPoolGroup, PoolEntry = _group_mod.HostPoolGroup, _group_mod.PoolEntry
_dsa_host = importlib.import_module(
    "sglang.srt.mem_cache.pool_host.dsa" if importlib.util.find_spec("sglang.srt.mem_cache.pool_host.dsa")
    else "sglang.srt.mem_cache.memory_pool_host"
)
DSAIndexerPoolHost = _dsa_host.DSAIndexerPoolHost
HiCacheController = cache_controller.HiCacheController
HybridCacheController = hybrid_mod.HybridCacheController
PoolName, PoolTransfer, PoolHitPolicy = sg.PoolName, sg.PoolTransfer, sg.PoolHitPolicy
STORAGE_BATCH_SIZE = sg.STORAGE_BATCH_SIZE

HAS_LEGACY_DRAFT = hasattr(HiCacheController, "set_draft_kv_pool")
"""0.5.15-0.5.18: ``HiCacheController.set_draft_kv_pool`` and draft pages as ``{hash}.draft``."""
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DSA_PAGE_SIZE = 64  # DSATokenToKVPool asserts 64-token pages
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT_MODEL = "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B"
WAIT_S = 30.0


def page_hashes(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's own storage hash chain for ``tokens`` (the one its prefetch thread computes)."""
    fn = getattr(mem_utils, "get_storage_hash_str", None) or mem_utils.get_hash_str
    return list(fn(tokens, None, page_size=page_size))


# -- pools ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One model's KV shape: ``attention`` is "mha" or "mla"."""

    attention: str
    layers: int
    heads: int = 2
    head_dim: int = 8
    kv_lora_rank: int = 12
    qk_rope_head_dim: int = 4
    dtype: torch.dtype = torch.bfloat16


def device_pool(shape: Shape, size: int, page_size: int) -> Any:
    """SGLang's device KV pool, on CPU."""
    common = {"size": size, "page_size": page_size, "dtype": shape.dtype, "layer_num": shape.layers,
              "device": "cpu", "enable_memory_saver": False}
    if shape.attention == "mha":
        return memory_pool.MHATokenToKVPool(head_num=shape.heads, head_dim=shape.head_dim, **common)
    return memory_pool.MLATokenToKVPool(kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
                                        **common)


def host_pool(device: Any, layout: str, ratio: float = 2.0) -> Any:
    """SGLang's host pool over ``device`` with ``pin_memory=False``; the constructor's parameters
    are read from its signature (the first is a device pool up to 0.5.22-ish, a buffer info later)."""
    cls = MLATokenToKVPoolHost if isinstance(device, memory_pool.MLATokenToKVPool) else MHATokenToKVPoolHost
    params = inspect.signature(cls.__init__).parameters
    first = list(params)[1]
    arg = device.get_device_pool_infos()[0].buffer_info if first == "buffer_info" else device
    kw: dict[str, Any] = {"host_to_device_ratio": ratio, "host_size": 0, "page_size": device.page_size,
                          "layout": layout, "pin_memory": False, "device": "cpu"}
    optional = {"device_capacity_tokens": device.size, "start_layer": device.start_layer,
                "end_layer": device.end_layer}
    if cls is MLATokenToKVPoolHost:
        optional["override_kv_cache_dim"] = device.kv_cache_dim
        optional["target_layer_num"] = device.layer_num
        optional["layer_shard_enabled"] = False
    kw.update({k: v for k, v in optional.items() if k in params})
    return cls(arg, **kw)


def dsa_device_pool(shape: Shape, size: int, page_size: int) -> Any:
    """SGLang's ``DSATokenToKVPool`` on CPU: MLA latent plus the indexer's keys and scales."""
    kw: dict[str, Any] = {"size": size, "page_size": page_size, "kv_lora_rank": shape.kv_lora_rank,
                          "dtype": shape.dtype, "qk_rope_head_dim": shape.qk_rope_head_dim,
                          "layer_num": shape.layers, "device": "cpu", "index_head_dim": 128,
                          "enable_memory_saver": False, "kv_cache_dim": shape.kv_lora_rank + shape.qk_rope_head_dim}
    return memory_pool.DSATokenToKVPool(**kw)


def indexer_host_pool(device: Any, anchor_host: Any, name: Any = None) -> Any:
    """SGLang's ``DSAIndexerPoolHost`` for ``device`` laid out on ``anchor_host`` (``pin_memory=False``).
    Releases with host-pool declarations build it from the device pool's own declaration (renamed
    DRAFT_INDEXER for a draft, as ``build_full_draft_pools`` does); older ones take the device pool."""
    params = inspect.signature(DSAIndexerPoolHost.__init__).parameters
    if "decl" in params:
        decl = _dsa_host.make_dsa_indexer_pool_decl(device, name=name or PoolName.INDEXER)
        return DSAIndexerPoolHost(decl=decl, anchor_host=anchor_host, pin_memory=False)
    return DSAIndexerPoolHost(device, anchor_host, anchor_host.layout, pin_memory=False)


def host_buffers(pool: Any) -> list[torch.Tensor]:
    """The host memory of an SGLang host pool: ``kv_buffer`` (MHA/MLA), the indexer buffer (DSA)."""
    for name in ("kv_buffer", "index_k_with_scale_buffer"):
        buf = getattr(pool, name, None)
        if isinstance(buf, torch.Tensor):
            return [buf]
    raise TypeError(f"no host buffer on {type(pool).__name__}")


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes over a host pool's whole memory (NaN patterns included: tests compare bytes)."""
    gen = torch.Generator().manual_seed(seed)
    for buf in host_buffers(pool):
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(pool: Any, index: int) -> bytes:
    """The bytes of SGLang's ``get_data_page(index, flat=True)``."""
    return pool.get_data_page(index, flat=True).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@contextlib.contextmanager
def parallel(tp_rank: int = 0, tp_size: int = 1) -> Iterator[None]:
    """SGLang's parallel-state override (no process group: every sync group is skipped)."""
    ctx = runtime_context.get_parallel()
    values = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": 0, "pp_size": 1, "attn_tp_rank": tp_rank,
              "attn_tp_size": tp_size, "attn_cp_rank": 0, "attn_cp_size": 1, "attn_dcp_size": 1,
              "attn_dcp_rank": 0, "attn_dp_rank": 0}
    fields = runtime_context._parallel_fields() if hasattr(runtime_context, "_parallel_fields") else set(values)
    with ctx.override(**{k: v for k, v in values.items() if k in fields}):
        yield


# -- the adapter's extra-config -------------------------------------------------------------------------


def extra_config(root: str, *, interface_v1: bool = True, legacy_draft: dict[str, Any] | None = None,
                 backend: str = "file", options: dict[str, Any] | None = None, **ours: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"backend": backend, "backend_options": options or {"root": root},
                               "draft_model": DRAFT_MODEL, **ours}
    if legacy_draft is not None:
        section["legacy_draft_pool"] = legacy_draft
    return {"backend_name": "hicache_draft", "module_path": "hicache_draft.integrations.sglang",
            "class_name": "HiCacheDraftStorage", "interface_v1": interface_v1, "hicache_draft": section}


def legacy_draft_shape(shape: Shape, layout: str | None = None) -> dict[str, Any]:
    """The ``legacy_draft_pool`` object describing ``shape`` (what a 0.5.18 launch line needs)."""
    if shape.attention == "mha":
        out: dict[str, Any] = {"attention": "mha", "layers": shape.layers, "kv_heads": shape.heads,
                               "head_dim": shape.head_dim}
    else:
        out = {"attention": "mla", "layers": shape.layers, "latent_dim": shape.kv_lora_rank + shape.qk_rope_head_dim}
    if layout is not None:
        out["layout"] = layout
    return out


# -- the rig ---------------------------------------------------------------------------------------------


@dataclass
class Pool:
    """One SGLang pool of the rig: its name, device pool, host pool, whose slots index it
    (``None``: its own, as KV and SWA), its hit policy and, for a trailing pool, its window."""

    name: Any
    device: Any
    host: Any
    indices_from: Any = None
    hit_policy: Any = PoolHitPolicy.ALL_PAGES
    window_pages: int = 0

    @property
    def trailing(self) -> bool:
        return self.hit_policy == PoolHitPolicy.TRAILING_PAGES


@dataclass
class Rig:
    """One "server": SGLang's pools and controller with the adapter attached.

    ``mode`` is "hybrid" (HybridCacheController over a HostPoolGroup, the draft a DRAFT sidecar
    entry whose indices come from KV) or "legacy" (HiCacheController + set_draft_kv_pool).
    ``model`` is "plain", "dsa" or "swa" (module docstring); "dsa" and "swa" run in hybrid mode.
    """

    target: Shape
    draft: Shape | None
    layout: str
    extra: dict[str, Any]
    mode: str = "hybrid"
    page_size: int = 4
    device_tokens: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    draft_layout: str | None = None
    model: str = "plain"
    swa_layers: int = 2
    window_pages: int = 2
    storage_backend: str = "dynamic"  # "file": SGLang's own HiCacheFile (checks the harness itself)
    pools: list[Pool] = field(default_factory=list)
    controller: Any = None
    own_slots: dict[Any, torch.Tensor] = field(default_factory=dict)
    _parallel: Any = None

    def __post_init__(self) -> None:
        self._parallel = parallel(self.tp_rank, self.tp_size)
        self._parallel.__enter__()
        try:
            self._build()
        except BaseException:
            self._parallel.__exit__(None, None, None)
            raise

    def _build(self) -> None:
        ps = self.page_size
        dsa = self.model == "dsa"
        kv_dev = (dsa_device_pool if dsa else device_pool)(self.target, self.device_tokens, ps)
        self.allocator = allocator_mod.PagedTokenToKVPoolAllocator(
            self.device_tokens, ps, self.target.dtype, "cpu", kv_dev, need_sort=False)
        kv = Pool(PoolName.KV, kv_dev, host_pool(kv_dev, self.layout))
        self.pools = [kv]
        # the target's other pools, in the controller's HostPoolGroup from the start
        if dsa:
            self.pools.append(Pool(PoolName.INDEXER, kv_dev, indexer_host_pool(kv_dev, kv.host),
                                   indices_from=PoolName.KV))
        elif self.model == "swa":
            swa_dev = device_pool(replace(self.target, layers=self.swa_layers), self.device_tokens, ps)
            self.pools.append(Pool(PoolName.SWA, swa_dev, host_pool(swa_dev, self.layout),
                                   hit_policy=PoolHitPolicy.TRAILING_PAGES, window_pages=self.window_pages))
        sidecars: list[Pool] = []
        if self.draft is not None:
            dlay = self.draft_layout or (self.layout if self.draft.attention == self.target.attention
                                         else "page_first")
            if dsa:
                ddev = dsa_device_pool(self.draft, self.device_tokens, ps)
                dhost = host_pool(ddev, dlay)
                sidecars = [Pool(PoolName.DRAFT, ddev, dhost, indices_from=PoolName.KV),
                            Pool(PoolName.DRAFT_INDEXER, ddev, indexer_host_pool(ddev, dhost, PoolName.DRAFT_INDEXER),
                                 indices_from=PoolName.KV)]
            elif self.model == "swa":
                swa = self.pools[1]
                ddev = device_pool(self.draft, self.device_tokens, ps)
                sidecars = [Pool(PoolName.DRAFT_SWA, ddev, host_pool(ddev, dlay, ratio=swa.host.size / ddev.size),
                                 indices_from=PoolName.SWA, hit_policy=PoolHitPolicy.TRAILING_PAGES,
                                 window_pages=self.window_pages)]
            else:
                ddev = device_pool(self.draft, self.device_tokens, ps)
                sidecars = [Pool(PoolName.DRAFT, ddev, host_pool(ddev, dlay), indices_from=PoolName.KV)]
        extra = dict(self.extra)
        if self.mode == "legacy":
            assert self.model == "plain", "the legacy controller has no extra pools"
            self.controller = HiCacheController(
                self.allocator, kv.host, ps, None, threading.Event(), storage_backend=self.storage_backend,
                prefetch_threshold=ps, model_name=MODEL, storage_backend_extra_config=extra)
            for draft in sidecars:
                self.pools.append(draft)
                self.controller.set_draft_kv_pool(draft.device, draft.host)
            return
        entries = [PoolEntry(name=p.name, host_pool=p.host, device_pool=p.device, layer_mapper=lambda i: i,
                             is_primary_index_anchor=p is kv) for p in self.pools]
        group = HostPoolGroup(entries)
        kwargs: dict[str, Any] = {"storage_backend": self.storage_backend, "prefetch_threshold": ps,
                                  "model_name": MODEL, "storage_backend_extra_config": extra}
        self.controller = HybridCacheController(self.allocator, group, ps, None, threading.Event(), **kwargs)
        for pool in sidecars:
            self.add_pool(pool)

    def add_pool(self, pool: Pool) -> None:
        """A sidecar pool (DRAFT, DRAFT_INDEXER, DRAFT_SWA), registered the way SGLang registers it."""
        self.pools.append(pool)
        self.controller.register_host_pool_entry(
            PoolEntry(name=pool.name, host_pool=pool.host, device_pool=pool.device, layer_mapper=lambda i: i))

    # -- what the scheduler does ----------------------------------------------------------------------
    @property
    def adapter(self) -> Any:
        return self.controller.storage_backend

    @property
    def kv(self) -> Pool:
        return self.pools[0]

    def pool(self, name: Any) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def sidecars(self, keys: list[str] | None = None) -> list[Any] | None:
        """The extra pools' transfers of one backup (``keys``: the op's page hashes) or prefetch
        (``keys`` None), as the unified tree builds them: KV-indexed sidecars take KV's keys; a pool
        with its own slots takes its trailing window (its slots at backup, placeholders at prefetch
        that the controller re-aligns to the hit); its sidecars take its keys."""
        if self.mode == "legacy" or len(self.pools) == 1:
            return None
        out: dict[Any, Any] = {}
        for p in self.pools[1:]:
            if p.indices_from is None:  # own slots: the trailing window
                if keys is None:
                    out[p.name] = PoolTransfer(name=p.name, keys=["__placeholder__"] * p.window_pages,
                                               hit_policy=p.hit_policy)
                else:
                    w = min(p.window_pages, len(keys))
                    out[p.name] = PoolTransfer(name=p.name, host_indices=self.own_slots[p.name],
                                               keys=keys[len(keys) - w:], hit_policy=p.hit_policy)
            else:
                src = out.get(p.indices_from)
                out[p.name] = PoolTransfer(name=p.name, keys=keys if src is None else src.keys,
                                           hit_policy=p.hit_policy, indices_from_pool=p.indices_from)
        return list(out.values())

    def alloc(self, n_pages: int) -> torch.Tensor:
        """KV host slots for ``n_pages`` pages; pools with their own slots get their trailing window."""
        idx = self.kv.host.alloc(n_pages * self.page_size)
        assert idx is not None, "host pool full"
        for p in self.pools[1:]:
            if p.indices_from is None:
                own = p.host.alloc(min(p.window_pages, n_pages) * self.page_size)
                assert own is not None, f"{p.name} host pool full"
                self.own_slots[p.name] = own
        return idx

    def page_slots(self, pool: Pool, kv_indices: torch.Tensor) -> list[int]:
        """The first slot of every page ``pool`` holds for an op over ``kv_indices``."""
        source = pool.indices_from if pool.indices_from is not None else pool.name
        idx = kv_indices if source == PoolName.KV else self.own_slots[source]
        return [int(i) for i in idx[:: self.page_size]]

    def snapshot(self, kv_indices: torch.Tensor) -> dict[str, list[bytes]]:
        """Every pool's pages for an op over ``kv_indices`` (``get_data_page`` bytes), by pool name."""
        return {str(p.name): [page_bytes(p.host, s) for s in self.page_slots(p, kv_indices)] for p in self.pools}

    def backup(self, tokens: list[int], host_indices: torch.Tensor) -> int:
        """``write_storage`` then wait for the backup ack: tokens SGLang counts as written."""
        keys = page_hashes(tokens, self.page_size)
        if self.mode == "legacy":
            self.controller.write_storage(host_indices, tokens, keys)
        else:
            self.controller.write_storage(host_indices, tokens, keys, None, extra_pools=self.sidecars(keys))
        op = self.controller.ack_backup_queue.get(timeout=WAIT_S)
        return int(op.completed_tokens)

    def prefetch(self, tokens: list[int]) -> tuple[int, torch.Tensor | None, int]:
        """SGLang's prefetch: (hit tokens from the hit query, host indices, tokens restored)."""
        ctl = self.controller
        rid = f"req-{uuid.uuid4().hex[:8]}"
        params = inspect.signature(ctl.prefetch).parameters
        first: Any = rid
        if "handle" in params:
            handle_cls = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache").CacheRequestHandle
            first = handle_cls(rid=rid, attempt_id=0)
        if self.mode == "legacy" or "extra_pools" not in params:
            op = ctl.prefetch(first, tokens, None, None)
        else:
            op = ctl.prefetch(first, tokens, None, None, extra_pools=self.sidecars())
        got = ctl.prefetch_hit_queue.get(timeout=WAIT_S)
        assert got is op
        hit = int(op.storage_hit_count)
        if hit == 0:
            return 0, None, 0
        if hasattr(ctl, "allocate_storage_hit"):
            host_indices, hit = ctl.allocate_storage_hit(op, hit, allow_partial=False, min_tokens=0,
                                                         evict_host=lambda n: 0)
        else:
            host_indices = ctl.mem_pool_host.alloc(hit)
        assert host_indices is not None
        self._alloc_aux_staging(op, hit // self.page_size)
        op.host_indices = host_indices
        if hasattr(op, "storage_start") and getattr(op, "storage_start", None) is None:
            op.storage_start = 0
        ctl.prefetch_buffer.put(op)
        return hit, host_indices, self._wait_prefetch(op, hit)

    def _alloc_aux_staging(self, op: Any, hit_pages: int) -> None:
        """Host slots for the pools with their own slots, ``min(window, hit)`` pages each."""
        for t in getattr(op, "pool_transfers", None) or []:
            if t.host_indices is not None or t.indices_from_pool is not None:
                continue
            n = min(len(t.keys or ()), hit_pages) * self.page_size
            if n:
                t.host_indices = self.pool(t.name).host.alloc(n)
                assert t.host_indices is not None, f"{t.name} host pool full"
                self.own_slots[t.name] = t.host_indices

    def _wait_prefetch(self, op: Any, hit: int) -> int:
        ctl = self.controller
        deadline = time.monotonic() + WAIT_S
        if getattr(ctl, "ack_prefetch_queue", None) is not None and hasattr(cache_controller, "PrefetchAck"):
            done = 0
            while time.monotonic() < deadline:
                try:
                    ack = ctl.ack_prefetch_queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                if ack.operation is not op:
                    continue
                if ack.completed_tokens is not None:
                    done = int(ack.completed_tokens)
                if getattr(ack, "completed_req", False):
                    return done
            raise TimeoutError("prefetch did not complete")
        # 0.5.18: the I/O thread counts op.completed_tokens; done when the count stops moving.
        last, stable = -1, 0.0
        while time.monotonic() < deadline:
            now = int(op.completed_tokens)
            if now == hit or (now == last and ctl.prefetch_buffer.empty() and time.monotonic() - stable > 0.5):
                return now
            if now != last:
                last, stable = now, time.monotonic()
            time.sleep(0.02)
        raise TimeoutError("prefetch did not complete")

    def threads_alive(self, within_s: float = 5.0) -> bool:
        """Every storage thread of the controller running, within ``within_s``. SGLang's prefetch
        thread starts its io-aux thread itself, so right after an attach the controller may still
        name the previous attach's aux thread, ended, until the new prefetch thread gets to run
        (seen on CI: 0.5.18's detach and reattach); a thread that died stays dead past the wait."""
        ctl = self.controller
        names = ("prefetch_thread", "backup_thread", "prefetch_io_aux_thread", "prefetch_sync_thread")
        deadline = time.monotonic() + within_s
        while True:
            threads = [getattr(ctl, n) for n in names if getattr(ctl, n, None) is not None]
            if threads and all(t.is_alive() for t in threads):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def detach(self) -> None:
        self.controller.detach_storage_backend()

    def attach(self) -> None:
        params = inspect.signature(self.controller.attach_storage_backend).parameters
        kw: dict[str, Any] = {"storage_backend": self.storage_backend, "prefetch_threshold": self.page_size,
                              "model_name": MODEL, "storage_backend_extra_config": dict(self.extra)}
        if "host_pools" in params:
            kw["host_pools"] = getattr(self.controller.mem_pool_host, "entries", None)
        self.controller.attach_storage_backend(**kw)

    def close(self) -> None:
        try:
            if self.controller is not None and self.controller.enable_storage:
                self.controller.detach_storage_backend()
        finally:
            self._parallel.__exit__(None, None, None)


def tokens(n_pages: int, page_size: int = 4, salt: int = 0) -> list[int]:
    return [salt * 1_000_003 + t for t in range(n_pages * page_size)]


def round_trip(
    rigs: Any, target: Shape, draft: Shape, layout: str, extra: dict[str, Any], *, pages: int = 5, seed: int = 1,
    **kw: Any,
) -> tuple[int, int, dict[str, list[bytes]], dict[str, list[bytes]], Rig]:
    """Back up ``pages`` pages of every pool in one rig (``rigs(target, draft, layout, extra, **kw)``),
    restore them in a fresh one (a restart) whose host slots hold other bytes first. Returns (hit
    tokens, restored tokens, pages before by pool, pages after by pool, the reading rig)."""
    writer = rigs(target, draft, layout, extra, **kw)
    for n, pool in enumerate(writer.pools):
        fill_random(pool.host, seed + n)
    toks = tokens(pages, writer.page_size, salt=seed)
    src = writer.alloc(pages)
    assert writer.backup(toks, src) == pages * writer.page_size
    before = writer.snapshot(src)
    writer.close()
    reader = rigs(target, draft, layout, extra, **kw)
    for n, pool in enumerate(reader.pools):
        fill_random(pool.host, seed + 100 + n)  # what a restarted server's host slots hold: other bytes
    hit, dst, done = reader.prefetch(toks)
    after = {} if dst is None else reader.snapshot(dst)
    return hit, done, before, after, reader
