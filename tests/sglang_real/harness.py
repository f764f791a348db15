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
never by version string. More pools (issue 14: indexer, SWA, ...) are added as more ``Pool``
entries: ``Rig`` registers every entry of ``pools`` with the controller and moves each page of
each pool.
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
from dataclasses import dataclass, field
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
HiCacheController = cache_controller.HiCacheController
HybridCacheController = hybrid_mod.HybridCacheController
PoolName, PoolTransfer, PoolHitPolicy = sg.PoolName, sg.PoolTransfer, sg.PoolHitPolicy
STORAGE_BATCH_SIZE = sg.STORAGE_BATCH_SIZE

HAS_LEGACY_DRAFT = hasattr(HiCacheController, "set_draft_kv_pool")
"""0.5.15-0.5.18: ``HiCacheController.set_draft_kv_pool`` and draft pages as ``{hash}.draft``."""
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
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


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes over a host pool's whole buffer (NaN patterns included: tests compare bytes)."""
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


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
    """One SGLang pool of the rig: its name, device pool and host pool."""

    name: Any
    device: Any
    host: Any


@dataclass
class Rig:
    """One "server": SGLang's pools and controller with the adapter attached.

    ``mode`` is "hybrid" (HybridCacheController over a HostPoolGroup, the draft a DRAFT sidecar
    entry whose indices come from KV) or "legacy" (HiCacheController + set_draft_kv_pool).
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
    pools: list[Pool] = field(default_factory=list)
    controller: Any = None
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
        kv_dev = device_pool(self.target, self.device_tokens, ps)
        self.allocator = allocator_mod.PagedTokenToKVPoolAllocator(
            self.device_tokens, ps, self.target.dtype, "cpu", kv_dev, need_sort=False)
        kv = Pool(PoolName.KV, kv_dev, host_pool(kv_dev, self.layout))
        self.pools = [kv]
        draft = None
        if self.draft is not None:
            ddev = device_pool(self.draft, self.device_tokens, ps)
            dlay = self.draft_layout or (self.layout if self.draft.attention == self.target.attention
                                         else "page_first")
            draft = Pool(PoolName.DRAFT, ddev, host_pool(ddev, dlay))
        extra = dict(self.extra)
        if self.mode == "legacy":
            self.controller = HiCacheController(
                self.allocator, kv.host, ps, None, threading.Event(), storage_backend="dynamic",
                prefetch_threshold=ps, model_name=MODEL, storage_backend_extra_config=extra)
            if draft is not None:
                self.pools.append(draft)
                self.controller.set_draft_kv_pool(draft.device, draft.host)
            return
        anchor = PoolEntry(name=PoolName.KV, host_pool=kv.host, device_pool=kv_dev, layer_mapper=lambda i: i,
                           is_primary_index_anchor=True)
        group = HostPoolGroup([anchor])
        kwargs: dict[str, Any] = {"storage_backend": "dynamic", "prefetch_threshold": ps, "model_name": MODEL,
                                  "storage_backend_extra_config": extra}
        self.controller = HybridCacheController(self.allocator, group, ps, None, threading.Event(), **kwargs)
        if draft is not None:
            self.add_pool(draft)

    def add_pool(self, pool: Pool) -> None:
        """A KV-indexed sidecar pool (DRAFT, ...), registered the way SGLang registers it."""
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

    def sidecars(self, keys: list[str] | None = None) -> list[Any] | None:
        if self.mode == "legacy" or len(self.pools) == 1:
            return None
        return [PoolTransfer(name=p.name, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES,
                             indices_from_pool=PoolName.KV) for p in self.pools[1:]]

    def alloc(self, n_pages: int) -> torch.Tensor:
        idx = self.kv.host.alloc(n_pages * self.page_size)
        assert idx is not None, "host pool full"
        return idx

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
        op.host_indices = host_indices
        if hasattr(op, "storage_start") and getattr(op, "storage_start", None) is None:
            op.storage_start = 0
        ctl.prefetch_buffer.put(op)
        return hit, host_indices, self._wait_prefetch(op, hit)

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

    def threads_alive(self) -> bool:
        ctl = self.controller
        names = ("prefetch_thread", "backup_thread", "prefetch_io_aux_thread", "prefetch_sync_thread")
        threads = [getattr(ctl, n) for n in names if getattr(ctl, n, None) is not None]
        return bool(threads) and all(t.is_alive() for t in threads)

    def detach(self) -> None:
        self.controller.detach_storage_backend()

    def attach(self) -> None:
        params = inspect.signature(self.controller.attach_storage_backend).parameters
        kw: dict[str, Any] = {"storage_backend": "dynamic", "prefetch_threshold": self.page_size,
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
