"""An opened backend: its pluggy manager, its observers, and bounded, exception-free calls.

:class:`Store` is what the controller and the SGLang adapter talk to. Every call runs on a small
worker pool and is bounded by ``timeout_s``; an exception or a timeout becomes per-page
``FAILED`` results (or a zero existence count), logged once per kind, never raised into the
serving loop. A ``page_get`` that timed out is tracked: its buffers may still be written by the
backend until it returns, so :meth:`Store.page_get` hands back a future that says when they are
free again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from hicache_draft.backend import BackendContext, StorageBackend
from hicache_draft.capabilities import Capabilities, PoolKind
from hicache_draft.errors import BackendSetupError, ConfigError, PluginError
from hicache_draft.plugins import get_backend, new_plugin_manager
from hicache_draft.transfer import Buffer, PageResult, PageTransfer, PoolRegistration

log = logging.getLogger("hicache_draft.store")

_DONE: Future[None] = Future()
_DONE.set_result(None)


def validate_options(name: str, cls: type[StorageBackend], options: Mapping[str, Any] | BaseModel) -> BaseModel:
    """Validate ``[backend_options]`` with the backend's own model; :class:`ConfigError` naming the field."""
    if isinstance(options, cls.Options):
        return options
    try:
        return cls.Options.model_validate(dict(options) if not isinstance(options, BaseModel) else options.model_dump())
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = f"backend_options.{loc}" if loc else "backend_options"
        raise ConfigError(f"invalid {field} for backend {name!r}: {err['msg']}", field=field) from None


class Store:
    """A backend instance behind bounded calls.

    Build it with :meth:`open` (by name, through discovery) or directly from a class.
    ``observers`` are extra pluggy plugins registered next to the backend; a
    ``@hookimpl(wrapper=True)`` on ``page_set``/``page_get``/``page_exists`` sees every call.
    """

    def __init__(
        self,
        name: str,
        cls: type[StorageBackend],
        capabilities: Capabilities,
        options: Mapping[str, Any] | BaseModel | None = None,
        context: BackendContext | None = None,
        observers: Iterable[object] = (),
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self.context = context or BackendContext()
        self.timeout_s = self.context.timeout_s
        opts = validate_options(name, cls, options or {})
        try:
            self.backend = cls(opts, self.context)
        except (BackendSetupError, ConfigError):
            raise
        except Exception as exc:
            raise BackendSetupError(f"backend {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
        self.pm: pluggy.PluginManager = new_plugin_manager()
        try:
            self.pm.register(self.backend, name=f"backend:{name}")
            for i, obs in enumerate(observers):
                self.pm.register(obs, name=f"observer:{i}:{type(obs).__name__}")
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"backend {name!r}: {exc}") from None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"hicache-draft-{name}")
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._closed = False
        self.abandoned_calls = 0

    @classmethod
    def open(
        cls,
        name: str,
        options: Mapping[str, Any] | BaseModel | None = None,
        context: BackendContext | None = None,
        observers: Iterable[object] = (),
    ) -> Store:
        """Discover the backend called ``name``, validate options and build it."""
        info = get_backend(name)
        assert info.cls is not None and info.capabilities is not None
        return cls(name, info.cls, info.capabilities, options, context, observers)

    # -- plumbing ---------------------------------------------------------------------------
    def _log_once(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            if what in self._logged:
                log.debug(msg, *args)
                return
            self._logged.add(what)
        log.warning(msg, *args)

    def _call(self, hook: str, kwargs: dict[str, Any], deadline: float) -> tuple[str, Any, Future[Any]]:
        """Run a hook bounded by the timeout: ("ok", result, fut) | ("error", exc, fut) | ("timeout", None, fut)."""
        if self._closed:
            return "error", RuntimeError("store is closed"), _DONE
        caller = getattr(self.pm.hook, hook)
        try:
            fut = self._pool.submit(caller, **kwargs)
        except RuntimeError as exc:  # executor shut down
            return "error", exc, _DONE
        try:
            return "ok", fut.result(timeout=max(0.0, deadline - time.monotonic())), fut
        except FutureTimeout:
            with self._lock:
                self.abandoned_calls += 1
            return "timeout", None, fut
        except Exception as exc:
            return "error", exc, fut

    def _per_page(
        self, hook: str, transfers: Sequence[PageTransfer], timeout_s: float | None
    ) -> tuple[dict[PoolKind, list[PageResult]], Future[Any]]:
        failed = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        if not any(t.pages for t in transfers):
            return {t.pool: [] for t in transfers}, _DONE
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        status, value, fut = self._call(hook, {"transfers": list(transfers), "deadline": deadline}, deadline)
        if status == "timeout":
            self._log_once(f"{hook}:timeout", "backend %r: %s timed out; pages counted as failed", self.name, hook)
            return failed, fut
        if status == "error":
            self._log_once(
                f"{hook}:error", "backend %r: %s raised %s: %s; pages counted as failed",
                self.name, hook, type(value).__name__, value,
            )
            return failed, fut
        out: dict[PoolKind, list[PageResult]] = {}
        for t in transfers:
            got = None if value is None else value.get(t.pool)
            if got is None or len(got) != len(t.pages):
                self._log_once(
                    f"{hook}:shape", "backend %r: %s returned no or wrong-length results for pool %s",
                    self.name, hook, t.pool.value,
                )
                out[t.pool] = [PageResult.FAILED] * len(t.pages)
                continue
            out[t.pool] = [_as_result(r) for r in got]
        return out, fut

    # -- the contract ----------------------------------------------------------------------
    def register_pool(self, registration: PoolRegistration) -> None:
        """Announce a pool; raises :class:`BackendSetupError` if the backend refuses it or times out."""
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("register_pool", {"registration": registration}, deadline)
        if status == "timeout":
            raise BackendSetupError(f"backend {self.name!r}: register_pool timed out after {self.timeout_s}s")
        if status == "error":
            raise BackendSetupError(f"backend {self.name!r} refused pool {registration.pool.value!r}: {value}")

    def has_hook(self, hook: str) -> bool:
        """Whether the backend (or an observer) implements ``hook``."""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def host_memory(self, pool: PoolKind, nbytes: int) -> Buffer | None:
        """Memory the backend offers for a host pool, or None (bounded; a failure is an error)."""
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("host_memory", {"pool": pool, "nbytes": nbytes}, deadline)
        if status != "ok":
            raise BackendSetupError(
                f"backend {self.name!r} could not provide host memory for the {pool.value!r} pool: "
                f"{'timed out' if status == 'timeout' else value}"
            )
        if value is not None and (not isinstance(value, Buffer) or value.nbytes < nbytes):
            raise BackendSetupError(f"backend {self.name!r} returned unusable host memory for {pool.value!r}")
        return value

    def page_set(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> dict[PoolKind, list[PageResult]]:
        """Store pages; per-page results, never raises. See :meth:`page_set_tracked` when the
        buffers are pool memory that will be reused."""
        results, _ = self._per_page("page_set", transfers, timeout_s)
        return results

    def page_set_tracked(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> tuple[dict[PoolKind, list[PageResult]], Future[Any]]:
        """Like :meth:`page_set`, plus a future that completes when the backend no longer reads
        the buffers (already done unless the call timed out): zero-copy pages must not be
        overwritten before it completes, or a late write could store other bytes under the key."""
        return self._per_page("page_set", transfers, timeout_s)

    def page_get(
        self, transfers: Sequence[PageTransfer], timeout_s: float | None = None
    ) -> tuple[dict[PoolKind, list[PageResult]], Future[Any]]:
        """Load pages; per-page results and a future that completes when the backend no
        longer touches the buffers (already done unless the call timed out)."""
        return self._per_page("page_get", transfers, timeout_s)

    def page_exists(
        self, queries: Mapping[PoolKind, Sequence[str]], timeout_s: float | None = None
    ) -> dict[PoolKind, int]:
        """Leading stored pages per pool; 0 for a pool on error or timeout."""
        zero = {p: 0 for p in queries}
        if not any(queries.values()):
            return zero
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        status, value, _ = self._call("page_exists", {"queries": dict(queries), "deadline": deadline}, deadline)
        if status != "ok" or value is None:
            self._log_once(
                f"page_exists:{status}", "backend %r: page_exists %s; counted as misses", self.name,
                "timed out" if status == "timeout" else f"failed: {value}",
            )
            return zero
        out: dict[PoolKind, int] = {}
        for pool, keys in queries.items():
            n = value.get(pool, 0)
            out[pool] = max(0, min(int(n), len(keys))) if isinstance(n, int) else 0
        return out

    def close(self) -> None:
        """Close the backend (bounded) and stop the workers. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + self.timeout_s
        status, value, _ = self._call("close", {}, deadline)
        if status != "ok":
            log.warning("backend %r: close %s", self.name, "timed out" if status == "timeout" else value)
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_result(r: object) -> PageResult:
    if isinstance(r, PageResult):
        return r
    if r is True:
        return PageResult.OK
    if r is False or r is None:
        return PageResult.FAILED
    try:
        return PageResult(int(r))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return PageResult.FAILED
