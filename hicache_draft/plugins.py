"""Backend discovery: entry points, allow/block lists, validation, selection by name.

Backends are classes published under the entry-point group ``hicache_draft.backends``
(entry-point name = the name used in config). Discovery imports each one, validates it with
pluggy (hook names and argument names against :mod:`hicache_draft.hookspecs`), checks its
``api_version`` and its :class:`~hicache_draft.Capabilities`, and records any failure next to the
plugin's name without breaking the others. It is idempotent, thread-safe, and cheap to call
again in every process (TP workers each load it).

Environment:

* ``HICACHE_DRAFT_LOAD_PLUGINS``: comma-separated allow-list; when set, only these are loaded.
* ``HICACHE_DRAFT_DISABLE_PLUGINS``: comma-separated block-list.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import pluggy
from pydantic import BaseModel, ValidationError

from hicache_draft import hookspecs
from hicache_draft.backend import StorageBackend
from hicache_draft.capabilities import Capabilities
from hicache_draft.errors import PluginError, UnknownBackendError

ENTRY_POINT_GROUP = "hicache_draft.backends"
LOAD_ENV = "HICACHE_DRAFT_LOAD_PLUGINS"
DISABLE_ENV = "HICACHE_DRAFT_DISABLE_PLUGINS"


@dataclass
class BackendInfo:
    """One discovered backend: where it came from, what it declares, or why it failed."""

    name: str
    distribution: str | None = None
    version: str | None = None
    cls: type[StorageBackend] | None = field(default=None, repr=False)
    capabilities: Capabilities | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.cls is not None

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "capabilities": self.capabilities.summary() if self.capabilities else None,
            "error": self.error,
        }


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager that knows the storage hookspecs."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def validate_backend_class(name: str, cls: object) -> Capabilities:
    """Check a backend class against the contract; return its parsed capabilities.

    Raises :class:`PluginError` naming the backend and the reason.
    """
    if not isinstance(cls, type):
        raise PluginError(f"backend {name!r}: entry point must name a class, got {type(cls).__name__}")
    version = getattr(cls, "api_version", None)
    if not isinstance(version, int):
        raise PluginError(f"backend {name!r}: class {cls.__qualname__} has no integer 'api_version'")
    if version != hookspecs.API_VERSION:
        raise PluginError(
            f"backend {name!r}: written for storage API version {version}, but this hicache-draft "
            f"speaks version {hookspecs.API_VERSION}; upgrade the plugin or hicache-draft"
        )
    raw_caps = getattr(cls, "capabilities", None)
    if raw_caps is None:
        raise PluginError(f"backend {name!r}: class {cls.__qualname__} declares no 'capabilities'")
    try:
        caps = raw_caps if isinstance(raw_caps, Capabilities) else Capabilities.model_validate(raw_caps)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "capabilities"
        raise PluginError(f"backend {name!r}: invalid capabilities at {where!r}: {first['msg']}") from None
    options = getattr(cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise PluginError(f"backend {name!r}: 'Options' must be a pydantic BaseModel subclass")
    pm = new_plugin_manager()
    try:
        pm.register(cls, name=f"validate:{name}")
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"backend {name!r}: {exc}") from None
    required = ("page_set", "page_get", "page_exists")
    impls = {hook for hook in required if getattr(pm.hook, hook).get_hookimpls()}
    missing = set(required) - impls
    if missing:
        raise PluginError(f"backend {name!r}: does not implement required hook(s) {', '.join(sorted(missing))}")
    return caps


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._discovered: dict[str, BackendInfo] | None = None
        self._extra: dict[str, BackendInfo] = {}

    def _load_entry_point(self, ep: EntryPoint) -> BackendInfo:
        dist = getattr(ep, "dist", None)
        info = BackendInfo(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist is not None else None,
            version=dist.version if dist is not None else None,
        )
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            info.error = f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}"
            return info
        try:
            info.capabilities = validate_backend_class(ep.name, cls)
            info.cls = cls
        except PluginError as exc:
            info.error = str(exc)
        return info

    def discover(self, refresh: bool = False) -> dict[str, BackendInfo]:
        with self._lock:
            if self._discovered is None or refresh:
                allow, block = _env_list(LOAD_ENV), _env_list(DISABLE_ENV)
                found: dict[str, BackendInfo] = {}
                for ep in entry_points(group=ENTRY_POINT_GROUP):
                    if ep.name in found:
                        continue
                    if allow is not None and ep.name not in allow:
                        continue
                    if block is not None and ep.name in block:
                        found[ep.name] = BackendInfo(name=ep.name, error=f"disabled by {DISABLE_ENV}")
                        continue
                    found[ep.name] = self._load_entry_point(ep)
                self._discovered = found
            merged = dict(self._discovered)
            merged.update(self._extra)
            return merged

    def register(self, name: str, cls: type[StorageBackend], distribution: str = "(in-process)") -> BackendInfo:
        caps = validate_backend_class(name, cls)
        info = BackendInfo(name=name, distribution=distribution, version=None, cls=cls, capabilities=caps)
        with self._lock:
            self._extra[name] = info
        return info

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)


_registry = _Registry()


def discover_backends(refresh: bool = False) -> dict[str, BackendInfo]:
    """Every discovered backend by name (failed ones included, with ``error`` set)."""
    return _registry.discover(refresh=refresh)


def register_backend(name: str, cls: type[StorageBackend], distribution: str = "(in-process)") -> BackendInfo:
    """Register a backend class in this process without an entry point (tests, embedding).

    It is validated exactly like an installed plugin; :class:`PluginError` if it fails.
    """
    return _registry.register(name, cls, distribution)


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend`."""
    _registry.unregister(name)


def get_backend(name: str) -> BackendInfo:
    """The loadable backend called ``name``.

    Raises :class:`UnknownBackendError` (listing the installed ones) or :class:`PluginError`
    (with the plugin's load or validation error).
    """
    found = discover_backends()
    info = found.get(name)
    if info is None:
        usable = sorted(n for n, i in found.items() if i.ok)
        listing = ", ".join(usable) if usable else "none"
        raise UnknownBackendError(
            f"unknown backend {name!r}; installed backends: {listing} "
            f"(install a plugin distribution, e.g. 'pip install hicache-draft-{name}')",
            field="backend",
        )
    if not info.ok:
        raise PluginError(f"backend {name!r} is installed but unusable: {info.error}")
    return info
