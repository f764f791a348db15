"""Prometheus metrics: an observer plugin on the store's ``call_done`` hook, and an HTTP exporter.

Needs ``prometheus-client`` (``pip install 'hicache-draft[prometheus]'``). Every series carries the
``backend`` label, the page series the ``pool`` (``kv``, ``draft``) too; they count what the caller
sees: the final per-page results after the core's verification (a page a backend called OK that
failed it is ``corrupt``), and a timed-out call's pages as failures.

=========================================  =====================  ==========================================
series                                     labels                 what
=========================================  =====================  ==========================================
``hicache_draft_written_pages_total``      backend, pool          pages stored (``page_set`` OK)
``hicache_draft_written_bytes_total``      backend, pool          their payload bytes
``hicache_draft_read_pages_total``         backend, pool          pages restored (``page_get`` OK, verified)
``hicache_draft_read_bytes_total``         backend, pool          their payload bytes
``hicache_draft_hits_total``               backend, pool, hook    pages found: ``page_exists`` (leading
                                                                  stored pages) or ``page_get`` (OK)
``hicache_draft_misses_total``             backend, pool, hook    pages not found (``page_exists`` past the
                                                                  stored prefix, ``page_get`` MISS)
``hicache_draft_corrupt_total``            backend, pool          ``page_get`` pages that failed verification
``hicache_draft_failures_total``           backend, pool, hook    pages FAILED (errors and timeouts included)
``hicache_draft_timeouts_total``           backend, pool, hook    calls abandoned at their deadline
``hicache_draft_calls_total``              backend, hook, outcome calls by outcome (ok, timeout, error)
``hicache_draft_call_seconds``             backend, hook          histogram of the caller's wait per call
=========================================  =====================  ==========================================

Use it through a config (``[metrics] prometheus_port``: :func:`hicache_draft.metrics.config_observers`
starts the exporter and adds the observer), or by hand: ``PrometheusObserver(registry)`` registers
the series into a caller-given :class:`~prometheus_client.CollectorRegistry` (an engine's own, as
SGLang keeps one) and :func:`serve` exposes a registry over HTTP.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server

from hicache_draft.hookspecs import hookimpl
from hicache_draft.transfer import PageResult, PageTransfer

PREFIX = "hicache_draft"
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Latency buckets in seconds: 100 µs (a cached existence check) to 30 s (past any sane ``timeout_s``)."""


class _Series:
    """The metric families of one registry (made once per registry: a family is registered once)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        page = ("backend", "pool")
        hooked = ("backend", "pool", "hook")

        def counter(name: str, doc: str, labels: Sequence[str]) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self.written_pages = counter("written_pages", "Pages stored (page_set OK).", page)
        self.written_bytes = counter("written_bytes", "Payload bytes of the pages stored.", page)
        self.read_pages = counter("read_pages", "Pages restored (page_get OK after verification).", page)
        self.read_bytes = counter("read_bytes", "Payload bytes of the pages restored.", page)
        self.hits = counter("hits", "Pages found: page_exists leading stored pages, page_get OK.", hooked)
        self.misses = counter("misses", "Pages not found: page_exists past the stored prefix, page_get MISS.", hooked)
        self.corrupt = counter("corrupt", "page_get pages that failed verification (never data).", page)
        self.failures = counter("failures", "Pages FAILED (backend errors and timeouts included).", hooked)
        self.timeouts = counter("timeouts", "Calls abandoned at their deadline, per pool in the call.", hooked)
        self.calls = counter("calls", "Storage calls by outcome (ok, timeout, error).", ("backend", "hook", "outcome"))
        self.seconds = Histogram(
            f"{PREFIX}_call_seconds", "Seconds the caller waited per storage call.", ("backend", "hook"),
            registry=registry, buckets=BUCKETS,
        )


_series: weakref.WeakKeyDictionary[CollectorRegistry, _Series] = weakref.WeakKeyDictionary()
_series_lock = threading.Lock()


def _series_for(registry: CollectorRegistry) -> _Series:
    with _series_lock:
        found = _series.get(registry)
        if found is None:
            found = _series[registry] = _Series(registry)
        return found


class PrometheusObserver:
    """An observer plugin (pass it in ``observers=``): turns every ``call_done`` into the series above.

    ``registry``: where the series live (default: prometheus_client's global ``REGISTRY``, which
    :func:`serve` and ``start_http_server`` expose by default). Several observers on one registry
    (one per store) share the series; the ``backend`` label tells stores of different backends apart.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._m = _series_for(self.registry)

    @hookimpl
    def call_done(
        self,
        backend: str,
        hook: str,
        outcome: str,
        seconds: float,
        transfers: Sequence[PageTransfer],
        results: Mapping[str, Sequence[PageResult]],
    ) -> None:
        m = self._m
        m.calls.labels(backend, hook, outcome).inc()
        m.seconds.labels(backend, hook).observe(seconds)
        sizes = {t.pool: [p.nbytes for p in t.pages] for t in transfers}
        for pool, per_page in results.items():
            p = str(pool)
            if outcome == "timeout":
                m.timeouts.labels(backend, p, hook).inc()
            ok = [i for i, r in enumerate(per_page) if r == PageResult.OK]
            ok_bytes = sum(sizes[pool][i] for i in ok) if pool in sizes else 0
            failed = sum(1 for r in per_page if r == PageResult.FAILED)
            if failed:
                m.failures.labels(backend, p, hook).inc(failed)
            if hook == "page_set":
                m.written_pages.labels(backend, p).inc(len(ok))
                m.written_bytes.labels(backend, p).inc(ok_bytes)
                continue
            missed = sum(1 for r in per_page if r == PageResult.MISS)
            m.hits.labels(backend, p, hook).inc(len(ok))
            m.misses.labels(backend, p, hook).inc(missed)
            if hook == "page_get":
                m.read_pages.labels(backend, p).inc(len(ok))
                m.read_bytes.labels(backend, p).inc(ok_bytes)
                corrupt = sum(1 for r in per_page if r == PageResult.CORRUPT)
                if corrupt:
                    m.corrupt.labels(backend, p).inc(corrupt)


@dataclass
class PrometheusExporter:
    """An HTTP server exposing ``registry`` at ``url`` (``/metrics``), on a daemon thread."""

    addr: str
    port: int
    registry: CollectorRegistry
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (bounded: the server thread only waits for a request in progress)."""
        with _servers_lock:
            for key, exp in list(_servers.items()):
                if exp is self:
                    del _servers[key]
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


_servers: dict[tuple[str, int], PrometheusExporter] = {}
_servers_lock = threading.Lock()


def serve(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> PrometheusExporter:
    """Serve ``registry`` (default: the global ``REGISTRY``) on ``addr:port`` (0: a free port).

    Idempotent per process: asking again for the same address and port with the same registry (or
    for port 0 on an address that already serves that registry) returns the running exporter.
    Raises ``OSError`` when the port cannot be bound, and ``ValueError`` when that address and port
    already serve another registry.
    """
    reg = REGISTRY if registry is None else registry
    with _servers_lock:
        if port == 0:
            same = [e for (a, _p), e in _servers.items() if a == addr and e.registry is reg]
            if same:
                return same[0]
        running = _servers.get((addr, port))
        if running is not None:
            if running.registry is not reg:
                raise ValueError(f"{addr}:{port} already serves another Prometheus registry in this process")
            return running
        server, thread = start_http_server(port, addr=addr, registry=reg)
        exporter = PrometheusExporter(addr, int(server.server_port), reg, server, thread)
        _servers[(addr, exporter.port)] = exporter
        return exporter


def running() -> list[PrometheusExporter]:
    """The exporters this process serves."""
    with _servers_lock:
        return list(_servers.values())


# -- reading an exporter back (``hicache-draft stats URL``) ---------------------------------------------------------

POOL_COUNTERS = ("written_pages", "written_bytes", "read_pages", "read_bytes", "corrupt")
HOOK_COUNTERS = ("hits", "misses", "failures", "timeouts")


def summarize(text: str) -> dict[str, list[dict[str, Any]]]:
    """Our series in a Prometheus text exposition, summed per (backend, pool) and (backend, hook).

    ``pools``: the page counters, with ``hits``, ``misses``, ``failures``, ``timeouts`` per hook;
    ``hooks``: calls per outcome, the latency histogram's sum, count, mean and cumulative buckets.
    """
    from prometheus_client.parser import text_string_to_metric_families

    pools: dict[tuple[str, str], dict[str, Any]] = {}
    hooks: dict[tuple[str, str], dict[str, Any]] = {}

    def pool_row(labels: Mapping[str, str]) -> dict[str, Any]:
        key = (labels.get("backend", ""), labels.get("pool", ""))
        if key not in pools:
            pools[key] = {"backend": key[0], "pool": key[1], **dict.fromkeys(POOL_COUNTERS, 0)}
            pools[key].update({c: {} for c in HOOK_COUNTERS})
        return pools[key]

    def hook_row(labels: Mapping[str, str]) -> dict[str, Any]:
        key = (labels.get("backend", ""), labels.get("hook", ""))
        if key not in hooks:
            hooks[key] = {"backend": key[0], "hook": key[1], "calls": {}, "seconds_sum": 0.0, "seconds_count": 0,
                          "buckets": {}}
        return hooks[key]

    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix(f"{PREFIX}_")
        if not family.name.startswith(f"{PREFIX}_"):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if name in POOL_COUNTERS:
                pool_row(s.labels)[name] += int(s.value)
            elif name in HOOK_COUNTERS:
                per_hook = pool_row(s.labels)[name]
                per_hook[s.labels["hook"]] = per_hook.get(s.labels["hook"], 0) + int(s.value)
            elif name == "calls":
                calls = hook_row(s.labels)["calls"]
                calls[s.labels["outcome"]] = calls.get(s.labels["outcome"], 0) + int(s.value)
            elif name == "call_seconds":
                row = hook_row(s.labels)
                if s.name.endswith("_sum"):
                    row["seconds_sum"] += s.value
                elif s.name.endswith("_count"):
                    row["seconds_count"] += int(s.value)
                elif s.name.endswith("_bucket"):
                    row["buckets"][s.labels["le"]] = row["buckets"].get(s.labels["le"], 0) + int(s.value)
    for row in hooks.values():
        row["mean_seconds"] = row["seconds_sum"] / row["seconds_count"] if row["seconds_count"] else None
    return {"pools": [pools[k] for k in sorted(pools)], "hooks": [hooks[k] for k in sorted(hooks)]}


def quantile_bound(buckets: Mapping[str, int], q: float) -> float | None:
    """The upper bound of the histogram bucket that holds quantile ``q`` (None: no observation)."""
    ordered = sorted(((float(le), n) for le, n in buckets.items()), key=lambda b: b[0])
    if not ordered or ordered[-1][1] == 0:
        return None
    want = q * ordered[-1][1]
    return next(le for le, n in ordered if n >= want)


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, list[dict[str, Any]]]:
    """GET ``url`` (an exporter's ``/metrics``) and :func:`summarize` it; ``OSError`` when unreachable."""
    from urllib.request import urlopen

    with urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - the URL is the operator's own
        return summarize(resp.read().decode("utf-8"))
