"""hicache-draft: offload LLM KV-cache pages, target and speculative-decoding draft alike, to
pluggable storage, so that both caches come back after a restart.

Public API for users and backend authors; plugins import only from here.

Importing this package does not import torch (nor change any process-wide state): discovery,
``check`` and configuration work where torch is absent. The names that make tensors
(:class:`CacheController` and its results) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hicache_draft.backend import BackendContext, NoOptions, StorageBackend
from hicache_draft.binding import BindingPlan, PoolBinding, Staging, plan_binding, query_hit, usable_hit
from hicache_draft.buffer_io import read_into, write_from
from hicache_draft.capabilities import (
    Attention,
    Capabilities,
    Component,
    HitPolicy,
    IOPath,
    Layout,
    PoolCapability,
    PoolKind,
)
from hicache_draft.config import Config, OnMiss, PrefetchPolicy, load_config
from hicache_draft.errors import (
    BackendSetupError,
    ConfigError,
    HiCacheDraftError,
    PluginError,
    UnknownBackendError,
)
from hicache_draft.hookspecs import API_VERSION, hookimpl
from hicache_draft.keys import hex_names_ok, make_key, page_hashes, pool_identities
from hicache_draft.metrics import CallTimer, Metrics
from hicache_draft.page_format import (
    HEADER_SIZE,
    HeaderProblem,
    PageFormatError,
    checksum,
    corrupt_pages,
    make_header,
    make_headers,
    pack_page_headers,
    parse_header,
    verify_payload,
)
from hicache_draft.paths import PathChoice, plan_paths, plan_pools
from hicache_draft.plugins import (
    BackendInfo,
    discover_backends,
    get_backend,
    register_backend,
    unregister_backend,
)
from hicache_draft.pools import KNOWN_POOLS, HostPool, PoolSpec
from hicache_draft.store import CallReport, Store, attach_headers
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PendingPages, PoolRegistration

if TYPE_CHECKING:
    from hicache_draft.controller import BackupResult, CacheController, Operation, PrefetchResult

__version__ = "0.1.0"

_LAZY = {n: "hicache_draft.controller" for n in ("BackupResult", "CacheController", "Operation", "PrefetchResult")}


def __getattr__(name: str) -> object:
    """The torch-touching names, imported when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache_draft' has no attribute {name!r}")
    from hicache_draft.pools import import_torch

    import_torch()  # quietly, before the module that needs it
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BindingPlan",
    "Component",
    "HitPolicy",
    "KNOWN_POOLS",
    "PoolBinding",
    "Staging",
    "plan_binding",
    "plan_pools",
    "query_hit",
    "usable_hit",
    "plan_paths",
    "PathChoice",
    "Metrics",
    "CallTimer",
    "pool_identities",
    "PrefetchResult",
    "Operation",
    "CacheController",
    "BackupResult",
    "API_VERSION",
    "HEADER_SIZE",
    "Attention",
    "BackendContext",
    "BackendInfo",
    "BackendSetupError",
    "Buffer",
    "Capabilities",
    "Config",
    "ConfigError",
    "HeaderProblem",
    "HiCacheDraftError",
    "HostPool",
    "IOPath",
    "Layout",
    "NoOptions",
    "OnMiss",
    "Page",
    "PageFormatError",
    "PageResult",
    "PageTransfer",
    "PendingPages",
    "PluginError",
    "PoolCapability",
    "PoolKind",
    "PoolRegistration",
    "PoolSpec",
    "PrefetchPolicy",
    "StorageBackend",
    "Store",
    "CallReport",
    "attach_headers",
    "UnknownBackendError",
    "checksum",
    "discover_backends",
    "get_backend",
    "hookimpl",
    "load_config",
    "make_header",
    "make_headers",
    "hex_names_ok",
    "make_key",
    "pack_page_headers",
    "corrupt_pages",
    "read_into",
    "write_from",
    "page_hashes",
    "parse_header",
    "register_backend",
    "unregister_backend",
    "verify_payload",
    "__version__",
]
