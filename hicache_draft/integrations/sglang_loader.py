"""Import SGLang's HiCache storage module without running ``sglang/__init__.py``.

``import sglang`` runs the package's ``__init__``, which pulls in numpy, triton and about forty other
distributions. The storage interface (``sglang.srt.mem_cache.hicache_storage``) needs only torch, and
``sglang/srt`` and ``sglang/srt/mem_cache`` have no ``__init__.py``. So when ``sglang`` is not yet
imported, :func:`ensure_sglang_package` puts a bare package object for it in ``sys.modules`` (its
``__path__`` taken from :func:`importlib.util.find_spec`, which locates without executing), and the
storage modules then import normally. Inside a running SGLang server ``sglang`` is already imported
and nothing is changed.

The adapter and the tests share these helpers; the core never imports them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib.metadata import PackageNotFoundError, version

TESTED_SGLANG_VERSION = "0.5.23"
STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"
FACTORY_MODULE = "sglang.srt.mem_cache.storage.backend_factory"


class SGLangMissingError(ImportError):
    """SGLang is not installed in this environment."""


def sglang_version() -> str | None:
    """The installed sglang distribution's version, or None."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def ensure_sglang_package() -> None:
    """Make ``sglang`` importable as a package without executing its ``__init__``.

    A no-op when ``sglang`` is already in ``sys.modules`` (e.g. inside the SGLang server).
    Raises :class:`SGLangMissingError` when sglang is not installed.
    """
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SGLangMissingError(
            "the SGLang integration needs the 'sglang' package; install it with "
            f"'pip install --no-deps sglang=={TESTED_SGLANG_VERSION}' (tested version) or run inside SGLang"
        )
    pkg = types.ModuleType("sglang")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    pkg.__package__ = "sglang"
    sys.modules["sglang"] = pkg


def load_storage_module() -> types.ModuleType:
    """``sglang.srt.mem_cache.hicache_storage`` (HiCacheStorage, PoolName, PoolTransfer, ...)."""
    ensure_sglang_package()
    return importlib.import_module(STORAGE_MODULE)


def load_backend_factory() -> type:
    """SGLang's ``StorageBackendFactory`` (the ``--hicache-storage-backend`` loader)."""
    ensure_sglang_package()
    return importlib.import_module(FACTORY_MODULE).StorageBackendFactory
