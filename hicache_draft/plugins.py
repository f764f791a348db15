"""Backend discovery: entry points, allow/block lists, validation, selection by name.

Backends are classes published under the entry-point group ``hicache_draft.backends``
(entry-point name = the name used in config). Discovery imports each one, validates it with
pluggy (hook names and argument names against :mod:`hicache_draft.hookspecs`), checks its
``api_version`` and its :class:`~hicache_draft.Capabilities`, and records any failure next to the
plugin's name without breaking the others. It is idempotent, thread-safe, and cheap to call
again in every process (TP workers each load it).

Anything a plugin raises while it is imported or validated (``SystemExit`` included; only
``KeyboardInterrupt`` passes) is that plugin's load error. Two distributions that publish the
same entry-point name are both named in an error for that name, and neither is selected.

Environment (entry-point names, comma-separated):

* ``HICACHE_DRAFT_LOAD_PLUGINS``: allow-list; when set, only these are loaded.
* ``HICACHE_DRAFT_DISABLE_PLUGINS``: block-list.

With no backend configured, the one installed backend whose class sets ``default = True`` is
selected (the embedded ``file`` backend does); none or several is an error that says what to do.
"""

from __future__ import annotations

import difflib
import os
import threading
from collections import defaultdict
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
DEFAULT_DISTRIBUTION = "hicache-draft-file"
"""What to install when no backend is configured and none declares itself the default (advice only:
the default is whichever installed backend declares ``default = True``)."""


@dataclass
class BackendInfo:
    """One discovered backend: where it came from, what it declares, or why it failed."""

    name: str
    distribution: str | None = None
    version: str | None = None
    cls: type[StorageBackend] | None = field(default=None, repr=False)
    capabilities: Capabilities | None = None
    error: str | None = None
    default: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.cls is not None

    @property
    def origin(self) -> str:
        """``distribution version`` (or ``in-process``), for messages."""
        return " ".join(p for p in (self.distribution, self.version) if p) or "in-process"

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "default": self.default,
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
    for hook in pm.hook.__dict__.values():
        for impl in hook.get_hookimpls() if isinstance(hook, pluggy.HookCaller) else ():
            defaulted = [a for a in impl.kwargnames if a != "self"]
            if defaulted:  # pluggy before 1.6 never passes them: the hook would silently go without
                raise PluginError(
                    f"backend {name!r}: hook {hook.name} gives argument(s) {', '.join(defaulted)} a default; pluggy "
                    "passes an argument with a default to a hook implementation only from version 1.6 on, so "
                    "declare every argument you take without one (and take only those you use)"
                )
    return caps


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._discovered: dict[str, BackendInfo] | None = None
        self._extra: dict[str, BackendInfo] = {}

    def _load_entry_point(self, ep: EntryPoint) -> BackendInfo:
        info = BackendInfo(name=ep.name, distribution=_dist_name(ep), version=_dist_version(ep))
        step = "import"
        try:
            cls = ep.load()
            step = "validation"
            info.capabilities = validate_backend_class(ep.name, cls)
            info.default = getattr(cls, "default", False) is True
            info.cls = cls
        except KeyboardInterrupt:
            raise
        except PluginError as exc:
            info.error = str(exc)
        except BaseException as exc:  # SystemExit too: a broken plugin must not break the others
            what = f"import of {ep.value!r}" if step == "import" else f"validation of {ep.value!r}"
            info.error = f"{what} failed: {type(exc).__name__}: {exc}"
        return info

    def discover(self, refresh: bool = False) -> dict[str, BackendInfo]:
        with self._lock:
            if self._discovered is None or refresh:
                allow, block = _env_list(LOAD_ENV), _env_list(DISABLE_ENV)
                by_name: dict[str, list[EntryPoint]] = defaultdict(list)
                for ep in entry_points(group=ENTRY_POINT_GROUP):
                    if allow is None or ep.name in allow:
                        by_name[ep.name].append(ep)
                found: dict[str, BackendInfo] = {}
                for name, eps in by_name.items():
                    if block is not None and name in block:
                        found[name] = BackendInfo(name=name, error=f"disabled by {DISABLE_ENV}")
                    elif len(eps) > 1:
                        found[name] = _duplicate(name, eps)
                    else:
                        found[name] = self._load_entry_point(eps[0])
                self._discovered = found
            merged = dict(self._discovered)
            merged.update(self._extra)
            return merged

    def register(self, name: str, cls: type[StorageBackend], distribution: str = "(in-process)") -> BackendInfo:
        caps = validate_backend_class(name, cls)
        info = BackendInfo(
            name=name, distribution=distribution, version=None, cls=cls, capabilities=caps,
            default=getattr(cls, "default", False) is True,
        )
        with self._lock:
            self._extra[name] = info
        return info

    def unregister(self, name: str) -> None:
        with self._lock:
            self._extra.pop(name, None)


def _dist_name(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _dist_version(ep: EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else None


def _duplicate(name: str, eps: list[EntryPoint]) -> BackendInfo:
    """Several distributions publish ``name``: refuse it, naming each (none is imported)."""
    eps = sorted(eps, key=lambda ep: (_dist_name(ep) or "", ep.value))
    who = [f"{_dist_name(ep) or '?'} {_dist_version(ep) or ''}".strip() + f" ({ep.value})" for ep in eps]
    return BackendInfo(
        name=name,
        distribution=", ".join(_dist_name(ep) or "?" for ep in eps),
        error=f"entry-point name {name!r} is published by {len(eps)} distributions: {'; '.join(who)}; "
        "uninstall all but one",
    )


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


def _installed(found: dict[str, BackendInfo]) -> str:
    usable = sorted(n for n, i in found.items() if i.ok)
    broken = sorted(n for n, i in found.items() if not i.ok)
    listing = ", ".join(usable) if usable else "none"
    return listing + (f" (installed but unusable: {', '.join(broken)})" if broken else "")


def get_backend(name: str | None = None) -> BackendInfo:
    """The loadable backend called ``name``; with ``None``, the installed default backend.

    Raises :class:`UnknownBackendError` (listing the installed ones and suggesting the closest
    name), or :class:`PluginError` (the plugin's load or validation error, a name published by
    several distributions, or several defaults).
    """
    found = discover_backends()
    if name is None:
        return _default_backend(found)
    info = found.get(name)
    if info is None:
        close = difflib.get_close_matches(name, list(found), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownBackendError(
            f"unknown backend {name!r}{hint}; installed backends: {_installed(found)}", field="backend"
        )
    if not info.ok:
        raise PluginError(f"backend {name!r} is installed but unusable: {info.error}")
    return info


def _default_backend(found: dict[str, BackendInfo]) -> BackendInfo:
    defaults = sorted((i for i in found.values() if i.ok and i.default), key=lambda i: i.name)
    if len(defaults) == 1:
        return defaults[0]
    if defaults:
        named = ", ".join(f"{i.name!r} ({i.origin})" for i in defaults)
        raise PluginError(
            f"no backend is configured and {len(defaults)} installed backends declare themselves the default: "
            f"{named}; set `backend` to one of them"
        )
    raise UnknownBackendError(
        "no backend is configured and no installed backend declares itself the default; install the embedded "
        f"default (pip install {DEFAULT_DISTRIBUTION}) or set `backend` (installed backends: {_installed(found)})",
        field="backend",
    )
