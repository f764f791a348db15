"""hicache-draft: offload LLM KV-cache pages, target and speculative-decoding draft alike, to
pluggable storage, so that both caches come back after a restart.

Public API for users and backend authors; plugins import only from here.
"""

import warnings

# torch warns at import when numpy is absent; hicache-draft never uses numpy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from hicache_draft.backend import BackendContext, NoOptions, StorageBackend
from hicache_draft.capabilities import Attention, Capabilities, IOPath, Layout, PoolCapability, PoolKind
from hicache_draft.config import Config, OnMiss, PrefetchPolicy, load_config
from hicache_draft.controller import BackupResult, CacheController, Operation, PrefetchResult
from hicache_draft.errors import (
    BackendSetupError,
    ConfigError,
    HiCacheDraftError,
    PluginError,
    UnknownBackendError,
)
from hicache_draft.hookspecs import API_VERSION, hookimpl
from hicache_draft.keys import make_key, page_hashes, pool_identities
from hicache_draft.metrics import CallTimer, Metrics
from hicache_draft.page_format import (
    HEADER_SIZE,
    HeaderProblem,
    PageFormatError,
    checksum,
    make_header,
    make_headers,
    parse_header,
    verify_payload,
)
from hicache_draft.paths import PathChoice, plan_paths
from hicache_draft.plugins import (
    BackendInfo,
    discover_backends,
    get_backend,
    register_backend,
    unregister_backend,
)
from hicache_draft.pools import HostPool, PoolSpec
from hicache_draft.store import Store
from hicache_draft.transfer import Buffer, Page, PageResult, PageTransfer, PoolRegistration, count_prefix

__version__ = "0.1.0"

__all__ = [
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
    "PluginError",
    "PoolCapability",
    "PoolKind",
    "PoolRegistration",
    "PoolSpec",
    "PrefetchPolicy",
    "StorageBackend",
    "Store",
    "UnknownBackendError",
    "checksum",
    "count_prefix",
    "discover_backends",
    "get_backend",
    "hookimpl",
    "load_config",
    "make_header",
    "make_headers",
    "make_key",
    "page_hashes",
    "parse_header",
    "register_backend",
    "unregister_backend",
    "verify_payload",
    "__version__",
]
