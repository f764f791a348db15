"""``hicache-draft bench sglang`` runs, tiny, over SGLang's real host pools (in a child process:
the SGLang bootstrap must run before anything imports sglang). No timing is asserted: it prints
ratios; each must be a finite positive number and every page must have moved."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from hicache_draft.integrations.sglang_bench import OPS, PATHS, SHAPES


def test_bench_sglang_runs_tiny_and_prints_finite_positive_ratios(tmp_path):
    cmd = [sys.executable, "-c", "from hicache_draft.cli import main; main()", "bench", "sglang",
           "--pages", "2", "--rounds", "1", "--root", str(tmp_path), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["release"] and report["pages"] == 2
    assert report["checks"] and all(report["checks"].values()), report["checks"]
    rows = report["rows"]
    assert {(r["path"], r["page"], r["op"]) for r in rows} == {
        (p, s.label, o) for p in PATHS for s in SHAPES.values() for o in OPS
    }
    for r in rows:
        for k in ("ratio", "ratio_min", "ratio_max", "adapter_s", "backend_s"):
            assert math.isfinite(r[k]) and r[k] > 0, r
