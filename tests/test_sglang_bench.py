"""``hicache-draft bench sglang`` runs, tiny, over SGLang's real host pools (in a child process:
the SGLang bootstrap must run before anything imports sglang). No timing is asserted: it prints
ratios and the goal; each ratio must be a finite positive number, each row's verdict must follow
from its numbers, and every page must have moved."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hicache_draft.integrations.sglang_bench import GOAL, MEMORY, OPS, PATHS, SHAPES, Row


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", "from hicache_draft.cli import main; main()", "bench", "sglang", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


def test_bench_sglang_runs_tiny_and_prints_finite_positive_ratios(tmp_path):
    proc = _bench("--pages", "2", "--rounds", "1", "--root", str(tmp_path), "--json")
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["release"] and report["pages"] == 2 and report["goal"] == GOAL
    backends = report["backends"]
    assert len(backends) == 2 and MEMORY in backends  # the installed default and the in-process one
    assert report["checks"] and all(report["checks"].values()), report["checks"]
    assert {k.split("/")[0] for k in report["checks"]} == set(backends)
    rows = report["rows"]
    assert {(r["backend"], r["path"], r["page"], r["op"]) for r in rows} == {
        (b, p, s.label, o) for b in backends for p in PATHS for s in SHAPES.values() for o in OPS
    }
    for r in rows:
        for k in ("ratio", "ratio_min", "ratio_max", "adapter_s", "backend_s", "checked_ratio"):
            assert math.isfinite(r[k]) and r[k] > 0, r
        assert r["goal"] == GOAL and r["meets_goal"] is (r["checked_ratio"] <= GOAL), r
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"], r
        staged = r["path"] == "generic" and r["op"] in ("set", "get")
        query = r["op"].startswith("exists")
        assert ("copy_s" in r) is staged, r  # only the generic path copies through staging
        assert ("keyed_s" in r) is query, r  # an existence query makes its storage keys
        assert ("floor" in r) is (staged or query), r
        if staged:  # backend + copy, each timed apart
            assert math.isfinite(r["floor"]) and r["floor"] > 1, r
        elif query:  # keys + backend timed as one call: a ratio of two timings
            assert math.isfinite(r["floor"]) and r["floor"] > 0, r
        else:
            assert r["checked_ratio"] == r["ratio"], r
        assert ("hook_s" in r) is (r["op"] == "exists"), r  # the backend's hook alone, next to the Store call
        # the adapter's call with the Store answering at once, on every row
        assert math.isfinite(r["alone_s"]) and r["alone_s"] > 0, r
        assert math.isclose(r["alone_share"], r["alone_s"] / r["backend_s"], rel_tol=1e-9), r  # one round
        if "hook_s" in r:
            assert math.isfinite(r["hook_s"]) and r["hook_s"] > 0, r


def test_bench_sglang_prints_each_ratio_with_the_goal(tmp_path):
    proc = _bench("--pages", "2", "--rounds", "2", "--root", str(tmp_path), "--backend", MEMORY,
                  "--page", "64k", "--path", "v1", "--path", "generic")
    lines = proc.stdout.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith(f"{MEMORY} ")]
    assert len(rows) == 2 * len(OPS), proc.stdout
    verdicts = []
    for ln in rows:
        assert re.search(r"ratio +\d+\.\d\d \(rounds \d+\.\d\d-\d+\.\d\d\)", ln), ln
        found = re.search(rf"goal <= {GOAL:.2f} (ok|OVER)( +\(its hook alone \d+\.\d{{3}} ms\))?$", ln)
        assert found, ln
        verdicts.append(found.group(1))
        hook = re.search(r"its hook alone \d+\.\d{3} ms", ln)
        assert bool(hook) is (" exists " in ln), ln
        keys = re.search(r"keys \+ backend \d+\.\d{3} ms.*, floor \d+\.\d\d: ratio to keys \+ backend +\d+\.\d\d,", ln)
        assert bool(keys) is (" exists" in ln), ln  # exists and exists-cold
    assert sum("staging copy" in ln for ln in rows) == 2  # generic set and get
    summary = next(ln for ln in lines if ln.startswith(f"goal <= {GOAL:.2f}: "))
    met = verdicts.count("ok")
    assert summary.startswith(f"goal <= {GOAL:.2f}: {met} of {len(rows)} rows met"), summary
    assert lines[-1] == "checks: all pages moved and found"


def test_a_row_ratio_is_the_median_of_its_paired_rounds_and_the_goal_is_checked_on_it():
    """Not the ratio of the medians (1.2 here: one round where everything was slow skews it)."""
    row = Row("v1", "64 KiB", "get", "memory", adapter=[1.0, 1.2, 9.0], store=[1.0, 1.0, 10.0])
    assert row.ratios == [1.0, 1.2, 0.9]
    assert statistics.median(row.adapter) / statistics.median(row.store) == 1.2
    assert row.ratio == 1.0 and row.meets_goal
    staged = Row("generic", "64 KiB", "set", "memory", adapter=[1.3, 1.3], store=[1.0, 1.0], copy=[0.25, 0.25])
    assert staged.floor == 1.25 and math.isclose(staged.over_floor, 1.04) and staged.meets_goal
    assert staged.ratio == 1.3  # the ratio to the backend alone is printed too
    query = Row("v1", "64 KiB", "exists", "memory", adapter=[1.2, 1.2], store=[1.0, 1.0], keyed=[1.1, 1.1])
    assert query.floor == 1.1 and math.isclose(query.over_floor, 1.2 / 1.1) and query.meets_goal
    assert query.as_dict()["keyed_s"] == 1.1 and "copy_s" not in query.as_dict()


def test_bench_sglang_runs_where_an_installed_triton_is_never_imported(tmp_path):
    """A GPU host's Python has a real Triton (the benchmark runs SGLang's CPU pools there, CUDA
    hidden): the bootstrap hides it while torch decides whether it has Triton, then serves the
    shim, so torch never uses one and SGLang's modules get the shim. Here an installed ``triton``
    that must never be imported stands for it."""
    site = tmp_path / "site"
    (site / "triton").mkdir(parents=True)
    (site / "triton" / "__init__.py").write_text("raise RuntimeError('the installed triton was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    bootstrap = Path(__file__).resolve().parent / "sglang_real"
    probe = (
        f"import sys; sys.path.insert(0, {str(bootstrap)!r}); import bootstrap\n"
        "from hicache_draft.integrations.sglang_loader import sglang_version\n"
        "bootstrap.install(sglang_version())\n"
        "import importlib, triton\n"
        "from torch.utils._triton import has_triton\n"
        "importlib.import_module('sglang.srt.mem_cache.memory_pool')\n"
        "print(triton.__file__, has_triton())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    where, decided = proc.stdout.split()[-2:]
    assert Path(where).is_relative_to(bootstrap / "shims") and decided == "False", proc.stdout
    proc = _bench("--pages", "2", "--rounds", "1", "--root", str(tmp_path), "--backend", MEMORY, "--page", "64k",
                  "--path", "v1", "--json", env=env)
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["checks"] and all(report["checks"].values()), report["checks"]
