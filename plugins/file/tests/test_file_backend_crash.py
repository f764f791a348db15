"""Crash safety: a writer killed with SIGKILL in a write storm never leaves a bad or torn page."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from hicache_draft import PageResult, PoolKind, Store

CHILD = Path(__file__).with_name("file_backend_child.py")
PAGE = 64 << 10
PER_CALL = 16  # 16 groups x 2 pools x 64 KiB = 2 MiB per segment: a kill lands mid-write often


def _storm_and_kill(root: Path, tag: int, rng: random.Random) -> int:
    """Start a write storm, SIGKILL it at a random moment after a few calls; return groups reported."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), str(tag), "0", "-1", str(PAGE), str(PER_CALL)],
        stdout=subprocess.PIPE, text=True,
    )
    reported = 0
    try:
        want = rng.randint(2, 6)
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line.startswith("wrote"), f"writer said {line!r}"
            reported = int(line.split()[1])
            if reported >= want * PER_CALL:
                break
        time.sleep(rng.uniform(0, 0.02))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return reported


def test_sigkilled_writer_never_yields_a_bad_page(tmp_path: Path, kit) -> None:
    root = tmp_path / "store"
    rng = random.Random(1234)
    reported = {}
    for tag in range(3):  # three storms on one root, each killed; the root is reopened each time
        reported[tag] = _storm_and_kill(root, tag, rng)
    store = Store.open("file", {"root": str(root)})
    try:
        total_ok = 0
        for tag, n in reported.items():
            candidates = [kit.group(i, tag) for i in range(n + 4 * PER_CALL)]  # beyond what was reported too
            got = kit.read_back(store, candidates, PAGE)
            kv, draft = got[PoolKind.KV], got[PoolKind.DRAFT]
            for i, ((rk, ek), (rd, ed)) in enumerate(zip(kv, draft, strict=True)):
                assert rk in (PageResult.OK, PageResult.MISS) and rd in (PageResult.OK, PageResult.MISS), (i, rk, rd)
                assert rk == rd, f"group {i} of storm {tag}: target {rk!r} but draft {rd!r} (torn pair)"
                if rk is PageResult.OK:
                    assert ek and ed, f"group {i} of storm {tag}: wrong bytes"
                    total_ok += 1
                if i < n:
                    assert rk is PageResult.OK, f"group {i} of storm {tag} was reported written but is {rk!r}"
        assert total_ok >= sum(reported.values()) > 0
        use = store.backend.usage()
        assert use["corrupt_pages"] == 0 and use["segments_quarantined"] == 0
        leftovers = [p for p in (root / "tmp").iterdir() if p.name.endswith(".tmp")]
        seg_files = [p for d in (root / "seg").iterdir() for p in d.iterdir()]
        assert all(p.suffix == ".seg" for p in seg_files)  # temp files never appear among published segments
        assert len(leftovers) <= 3  # at most one unfinished write per killed storm, invisible to readers
    finally:
        store.close()
    assert os.path.isdir(root)
