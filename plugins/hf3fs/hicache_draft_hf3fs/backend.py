"""The hf3fs backend class: a declaration that refuses to start.

Construction raises :class:`~hicache_draft.BackendSetupError` naming what a real 3FS deployment
needs. The hooks exist because the contract requires them; they are unreachable through a
:class:`~hicache_draft.Store` (whose construction fails first) and, if called anyway, report every
page ``FAILED`` and nothing stored: this stub never pretends to store a page.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import ClassVar

from pydantic import BaseModel

from hicache_draft import (
    BackendContext,
    BackendSetupError,
    Capabilities,
    PageResult,
    PageTransfer,
    PoolKind,
    StorageBackend,
    hookimpl,
)
from hicache_draft_hf3fs.declaration import HF3FS_CAPABILITIES
from hicache_draft_hf3fs.options import Hf3fsOptions

USRBIO_MODULE = "hf3fs_py_usrbio"
USRBIO_DISTRIBUTION = "hf3fs-py-usrbio"


def _own_version() -> str:
    try:
        return version("hicache-draft-hf3fs")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "(source tree)"


def _usrbio_state() -> str:
    try:
        found = importlib.util.find_spec(USRBIO_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    return "installed" if found else "not installed"


def _mount_state(mount_point: str) -> str:
    if os.path.ismount(mount_point):
        return "a mount point"
    if os.path.isdir(mount_point):
        return "a directory, but not a mount point"
    return "missing"


def not_implemented_message(options: Hf3fsOptions) -> str:
    """Why the backend cannot start, and what a real 3FS deployment needs, with what was found here."""
    metadata = options.metadata_server_url or "none configured (single node only)"
    return (
        f"backend 'hf3fs': 3FS I/O is not implemented; hicache-draft-hf3fs {_own_version()} is a "
        "declaration-only stub and stores nothing. A real 3FS backend needs: "
        f"(1) the {USRBIO_DISTRIBUTION} client (Python module {USRBIO_MODULE}; here: {_usrbio_state()}); "
        f"(2) a 3FS FUSE mount at {options.mount_point!r} (here: {_mount_state(options.mount_point)}); "
        f"(3) a key-to-slot metadata service shared by all ranks (metadata_server_url: {metadata}). "
        "Run 'hicache-draft check CONFIG' to see the I/O path each pool would take on 3FS without starting "
        "it, and configure another backend (e.g. 'file' or 'mooncake') to store pages now."
    )


class Hf3fsBackend(StorageBackend):
    """DeepSeek 3FS through usrbio: declared, validated, not implemented (see the module docs)."""

    api_version: ClassVar[int] = 2

    capabilities: ClassVar[Capabilities] = HF3FS_CAPABILITIES
    Options: ClassVar[type[BaseModel]] = Hf3fsOptions

    def __init__(self, options: BaseModel, context: BackendContext) -> None:
        super().__init__(options, context)
        if not isinstance(options, Hf3fsOptions):
            raise BackendSetupError(f"backend 'hf3fs': options must be Hf3fsOptions, got {type(options).__name__}")
        raise BackendSetupError(not_implemented_message(options))

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        return {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer]) -> dict[PoolKind, list[PageResult]]:
        return {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}

    @hookimpl
    def page_exists(self, queries: Mapping[PoolKind, Sequence[str]]) -> dict[PoolKind, int]:
        return {pool: 0 for pool in queries}
