"""Per-pool offload metrics, and an observer plugin that times every storage call.

:class:`Metrics` is a thread-safe counter set the controller fills; :meth:`Metrics.snapshot`
returns plain dicts (JSON-ready). :class:`CallTimer` is an example observer: a pluggy plugin with
``wrapper=True`` hookimpls that sees every ``page_set``/``page_get``/``page_exists`` call without the
backend knowing. Pass observers to :meth:`hicache_draft.Store.open` (or the controller).
:func:`config_observers` gives the observers a config's ``[metrics]`` asks for (the Prometheus
exporter of :mod:`hicache_draft.prometheus`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from rich.table import Table

from hicache_draft.capabilities import PoolKind
from hicache_draft.config import Config
from hicache_draft.errors import ConfigError
from hicache_draft.hookspecs import hookimpl
from hicache_draft.transfer import PageResult, PageTransfer


@dataclass
class PoolCounters:
    pages_written: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    read_failures: int = 0
    corrupt: int = 0
    seconds: float = 0.0


@dataclass
class Metrics:
    """Counters per pool (``kv``, ``draft``, and any other pool once it moves a page), updated by
    the controller."""

    pools: dict[str, PoolCounters] = field(default_factory=lambda: {p: PoolCounters() for p in PoolKind})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_set(self, pool: str, results: Sequence[PageResult], page_nbytes: int, seconds: float) -> None:
        ok = sum(1 for r in results if r == PageResult.OK)
        with self._lock:
            c = self._counters(pool)
            c.pages_written += ok
            c.bytes_written += ok * page_nbytes
            c.write_failures += len(results) - ok
            c.seconds += seconds

    def record_get(self, pool: str, results: Sequence[PageResult], page_nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self._counters(pool)
            for r in results:
                if r == PageResult.OK:
                    c.pages_read += 1
                    c.bytes_read += page_nbytes
                    c.hits += 1
                elif r == PageResult.MISS:
                    c.misses += 1
                elif r == PageResult.CORRUPT:
                    c.corrupt += 1
                    c.misses += 1
                else:
                    c.read_failures += 1
            c.seconds += seconds

    def _counters(self, pool: str) -> PoolCounters:
        got = self.pools.get(pool)
        if got is None:
            got = self.pools[pool] = PoolCounters()
        return got

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {str(p): asdict(c) for p, c in self.pools.items()}


def metrics_table(snapshot: Mapping[str, Mapping[str, float]], title: str = "offload metrics") -> Table:
    """A rich table of a :meth:`Metrics.snapshot` (one column per pool)."""
    pools = list(snapshot)
    table = Table(title=title)
    table.add_column("counter")
    for pool in pools:
        table.add_column(pool, justify="right")
    for name in PoolCounters.__dataclass_fields__:
        cells = []
        for pool in pools:
            v = snapshot[pool].get(name, 0)
            cells.append(f"{v:.4f}" if isinstance(v, float) else str(v))
        table.add_row(name, *cells)
    return table


class CallTimer:
    """An observer plugin: counts calls and seconds per hook, through pluggy wrappers."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.pages: dict[str, int] = {}
        self._lock = threading.Lock()

    def _note(self, hook: str, started: float, pages: int) -> None:
        with self._lock:
            self.calls[hook] = self.calls.get(hook, 0) + 1
            self.seconds[hook] = self.seconds.get(hook, 0.0) + time.perf_counter() - started
            self.pages[hook] = self.pages.get(hook, 0) + pages

    @hookimpl(wrapper=True)
    def page_set(self, transfers: Sequence[PageTransfer]) -> Generator[None, object, object]:
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            self._note("page_set", started, sum(len(t.pages) for t in transfers))

    @hookimpl(wrapper=True)
    def page_get(self, transfers: Sequence[PageTransfer]) -> Generator[None, object, object]:
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            self._note("page_get", started, sum(len(t.pages) for t in transfers))

    @hookimpl(wrapper=True)
    def page_exists(self, queries: Mapping[str, Sequence[str]]) -> Generator[None, object, object]:
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            self._note("page_exists", started, sum(len(k) for k in queries.values()))


def config_observers(config: Config) -> list[object]:
    """The observers ``config.metrics`` asks for: with ``prometheus_port`` set, a
    :class:`~hicache_draft.prometheus.PrometheusObserver` on the global registry, served on
    ``prometheus_addr:prometheus_port + tp_rank`` (started once per process). :class:`ConfigError`
    naming the field when prometheus-client is missing or the port cannot be served."""
    port = config.metrics.port_for(config.parallel.tp_rank)
    if port is None:
        return []
    try:
        from hicache_draft.prometheus import PrometheusObserver, serve
    except ImportError as exc:
        raise ConfigError(
            f"metrics.prometheus_port needs prometheus-client ({exc}); pip install 'hicache-draft[prometheus]'",
            field="metrics.prometheus_port",
        ) from None
    addr = config.metrics.prometheus_addr
    try:
        serve(port, addr)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"metrics.prometheus_port: cannot serve on {addr}:{port}: {exc}",
                          field="metrics.prometheus_port") from None
    return [PrometheusObserver()]
