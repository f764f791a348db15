"""Prometheus metrics: the observer on ``call_done``, a real HTTP exporter scraped on 127.0.0.1, ``stats``."""

from __future__ import annotations

import json
import secrets
import socket
import sys
import urllib.request

import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hicache_draft import BackendContext, CacheController, ConfigError, PoolKind, Store, load_config
from hicache_draft.cli import main
from hicache_draft.metrics import CallTimer
from hicache_draft.prometheus import PrometheusObserver, running, serve
from hicache_draft.testing import MemoryBackend
from tests.helpers import fill_random, make_config, slots, tokens

POOLS = ("kv", "draft")


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample the exporter serves: (name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def _value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _before(name, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _file_config(root, port: int):
    # No backend named: the installed default (the file plugin declares itself) serves it.
    return load_config(data={
        "backend_options": {"root": str(root)},
        "namespace": {"model": "m-prom", "draft_model": "d-prom", "kv_dtype": "float16", "page_size": 4},
        "target": {"attention": "mha", "layers": 2, "kv_heads": 2, "head_dim": 8},
        "draft": {"attention": "mla", "layers": 1, "latent_dim": 16},
        "metrics": {"prometheus_port": port},
    }, environ={})


def test_exporter_from_the_config_is_scraped_after_a_round_trip(tmp_path):
    root = tmp_path / "kv"
    cfg = _file_config(root, 0)
    names = ("hicache_draft_written_pages_total", "hicache_draft_written_bytes_total",
             "hicache_draft_read_pages_total", "hicache_draft_read_bytes_total")
    before = {(n, p): _before(n, backend="file", pool=p) for n in names for p in POOLS}
    hits_before = {p: _before("hicache_draft_hits_total", backend="file", pool=p, hook="page_exists") for p in POOLS}
    miss_before = {p: _before("hicache_draft_misses_total", backend="file", pool=p, hook="page_exists") for p in POOLS}
    count_before = _before("hicache_draft_call_seconds_count", backend="file", hook="page_set")
    with CacheController.from_config(cfg, num_pages=16) as ctrl:
        fill_random(ctrl)
        toks = tokens(8, seed=7)
        assert ctrl.backup(toks[: 6 * 4], slots(range(6))).pages_written == {PoolKind.KV: 6, PoolKind.DRAFT: 6}
        res = ctrl.prefetch(toks, slots(range(8, 16)))
        assert res.restored == {"kv": 6, "draft": 6}
        nbytes = {p.value: ctrl.bindings[p].part_nbytes for p in PoolKind}
    exporter = next(e for e in running() if e.registry is REGISTRY and e.addr == "127.0.0.1")
    assert exporter.port > 0 and exporter.url.startswith("http://127.0.0.1:")
    got = _samples(exporter.url)
    for p in POOLS:
        delta = {n: _value(got, n, backend="file", pool=p) - before[(n, p)] for n in names}
        assert delta == {
            "hicache_draft_written_pages_total": 6, "hicache_draft_written_bytes_total": 6 * nbytes[p],
            "hicache_draft_read_pages_total": 6, "hicache_draft_read_bytes_total": 6 * nbytes[p],
        }, p
        hook = {"backend": "file", "pool": p, "hook": "page_exists"}
        assert _value(got, "hicache_draft_hits_total", **hook) - hits_before[p] == 6
        assert _value(got, "hicache_draft_misses_total", **hook) - miss_before[p] == 2
    # the latency histogram of each hook: buckets, count, sum
    count = _value(got, "hicache_draft_call_seconds_count", backend="file", hook="page_set")
    assert count - count_before >= 1
    assert _value(got, "hicache_draft_call_seconds_bucket", backend="file", hook="page_set", le="+Inf") == count
    assert _value(got, "hicache_draft_call_seconds_sum", backend="file", hook="page_get") > 0
    assert _value(got, "hicache_draft_calls_total", backend="file", hook="page_get", outcome="ok") >= 1

    # `hicache-draft stats URL` reads the same exporter back
    res = CliRunner().invoke(main, ["stats", exporter.url, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    kv = next(r for r in summary["pools"] if (r["backend"], r["pool"]) == ("file", "kv"))
    assert kv["written_pages"] == _value(got, "hicache_draft_written_pages_total", backend="file", pool="kv")
    assert kv["hits"]["page_exists"] == _value(got, "hicache_draft_hits_total", backend="file", pool="kv",
                                               hook="page_exists")
    get = next(r for r in summary["hooks"] if (r["backend"], r["hook"]) == ("file", "page_get"))
    assert get["calls"]["ok"] >= 1 and get["mean_seconds"] > 0
    table = CliRunner().invoke(main, ["stats", exporter.url])
    assert table.exit_code == 0 and "file kv" in table.output and "page_exists" in table.output

    # `hicache-draft stats ROOT` asks the (default) backend's own stats command
    res = CliRunner().invoke(main, ["stats", str(root), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["pages"] == 12


def test_observer_on_a_caller_given_registry_counts_corrupt_timeouts_and_failures():
    reg = CollectorRegistry()  # an engine's own registry, as SGLang keeps one
    timer = CallTimer()
    cfg = make_config(timeout_s=0.3)
    MemoryBackend.reset()
    store = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": secrets.token_hex(4)},
                  BackendContext(timeout_s=0.3), observers=[PrometheusObserver(reg), timer])
    try:
        ctrl = CacheController(cfg, store, 16)
        fill_random(ctrl)
        toks = tokens(4, seed=3)
        ctrl.backup(toks, slots(range(4)))
        MemoryBackend.faults.corrupt_get_keys = set(store.backend.keys())
        ctrl.prefetch(toks, slots(range(4, 8)))
        MemoryBackend.faults.corrupt_get_keys = set()
        MemoryBackend.faults.delay_s["page_get"] = 0.6
        ctrl.prefetch(toks, slots(range(8, 12)))
        snap = ctrl.metrics.snapshot()
        ctrl.close()
    finally:
        store.close()
        MemoryBackend.reset()
    exporter = serve(0, "127.0.0.1", registry=reg)
    try:
        got = _samples(exporter.url)
    finally:
        exporter.close()
    for p in POOLS:
        mem = {"backend": "memory", "pool": p}
        assert _value(got, "hicache_draft_written_pages_total", **mem) == 4
        assert _value(got, "hicache_draft_corrupt_total", **mem) == snap[p]["corrupt"] > 0
        assert _value(got, "hicache_draft_read_pages_total", **mem) == 0
        assert _value(got, "hicache_draft_timeouts_total", **mem, hook="page_get") == 1
        assert _value(got, "hicache_draft_failures_total", **mem, hook="page_get") == snap[p]["read_failures"] > 0
    assert _value(got, "hicache_draft_calls_total", backend="memory", hook="page_get", outcome="timeout") == 1
    assert REGISTRY.get_sample_value("hicache_draft_corrupt_total", {"backend": "memory", "pool": "kv"}) is None
    assert timer.calls["page_get"] == 2  # the pluggy-wrapper observer still sees every call


def test_prometheus_port_without_the_package_or_on_a_taken_port_names_the_field(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = _file_config(tmp_path / "a", taken.getsockname()[1])
        with pytest.raises(ConfigError, match=r"metrics.prometheus_port: cannot serve on 127.0.0.1:\d+") as err:
            CacheController.from_config(cfg, num_pages=4)
        assert err.value.field == "metrics.prometheus_port"
    monkeypatch.setitem(sys.modules, "hicache_draft.prometheus", None)  # as if prometheus-client were absent
    with pytest.raises(ConfigError, match=r"pip install 'hicache-draft\[prometheus\]'"):
        CacheController.from_config(_file_config(tmp_path / "b", 0), num_pages=4)
    assert load_config(data={"namespace": {"model": "m"}, "target": {"kv_heads": 1, "head_dim": 1}},
                       environ={"HICACHE_DRAFT_METRICS__PROMETHEUS_PORT": "9400"}).metrics.port_for(3) == 9403


def test_demo_runs_scraped_per_pool(tmp_path):
    """The demo's two runs (back up, then restore after a 'restart') in this process, with the exporter
    of ``[metrics] prometheus_port``: the scrape shows both pools' pages and the hooks' histograms."""
    from hicache_draft.capabilities import Attention
    from hicache_draft.demo.pairs import make_pair, pair_config
    from hicache_draft.demo.phases import Job, Phase, run_phase

    pair = make_pair(Attention.MLA, 5)
    base = {"backend": "file", "backend_options": {"root": str(tmp_path)}, "metrics": {"prometheus_port": 0}}
    raw = pair_config(base, pair, 16, True).model_dump(mode="json")
    label = {"backend": "file", "pool": "draft"}
    before = _before("hicache_draft_read_pages_total", **label), _before("hicache_draft_written_pages_total", **label)
    first = run_phase(Job(Phase.FIRST, Attention.MLA, 5, raw, 96, 32, 8, 2), lambda _s: None)
    after = run_phase(Job(Phase.AFTER_RESTART, Attention.MLA, 5, raw, 96, 32, 8, 2), lambda _s: None)
    exporter = next(e for e in running() if e.registry is REGISTRY and e.addr == "127.0.0.1")
    got = _samples(exporter.url)
    written = first["pages_backed_up"]["draft"]
    assert written > 0
    assert _value(got, "hicache_draft_written_pages_total", **label) - before[1] == written
    assert _value(got, "hicache_draft_read_pages_total", **label) - before[0] == after["restored_pages"]["draft"] > 0
    for hook in ("page_set", "page_get", "page_exists"):
        assert _value(got, "hicache_draft_call_seconds_bucket", backend="file", hook=hook, le="+Inf") >= 1
