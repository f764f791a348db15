"""Bounded stress (issue 12): two writer processes of three threads each on one root, a tiny
journal (compacted every few calls), capacity eviction on nearly every call, SIGKILLs at random
moments (most land in or next to an eviction), and a live reader in this process. Nothing wrong
is ever served; at the end the live reader sees exactly what a fresh process sees (no
acknowledged page hidden from a live peer), and no group whose calls were both acknowledged is
split between target and draft."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hicache_draft import PageResult, PoolKind

CHILD = Path(__file__).with_name("file_backend_fault_child.py")
PAGE = 4096
CAP = 48 * 2 * (PAGE + 64 + 64)  # about 48 two-page segments
RUN_S = 12.0


class _Writer:
    def __init__(self, root: Path, tag: int) -> None:
        self.tag = tag
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "stress", str(root), str(tag), "3", str(PAGE), str(CAP)],
            stdout=subprocess.PIPE, text=True,
        )
        self.acked: list[tuple[int, int, int]] = []  # (thread, first group, count)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts and parts[0] == "ok":
                self.acked.append((int(parts[2]), int(parts[3]), int(parts[4])))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)

    def groups(self, kit) -> list[str]:
        return [kit.group(first + j, self.tag * 16 + t) for t, first, n in list(self.acked) for j in range(n)]


def test_two_processes_six_threads_kills_and_compaction(tmp_path: Path, open_store, kit) -> None:
    root = tmp_path / "store"
    live = open_store(root, journal_max_records=16)
    rng = random.Random(12)
    writers = [_Writer(root, 1), _Writer(root, 2)]
    done: list[_Writer] = []
    bad: list[str] = []
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            acked = [g for w in writers + done for g in w.groups(kit)[-40:]]
            if not acked:
                time.sleep(0.05)
                continue
            sample = rng.sample(acked, min(8, len(acked)))
            got = kit.read_back(live, sample, PAGE)
            for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT]:
                if r is PageResult.CORRUPT or (r is PageResult.OK and not eq):
                    bad.append(f"{r} {eq}")

    reader = threading.Thread(target=read_loop, daemon=True)
    reader.start()
    kills = 0
    next_tag = 3
    t_end = time.monotonic() + RUN_S
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(1.0, 2.5))
            victim = writers.pop(rng.randrange(len(writers)))
            victim.kill()
            kills += 1
            done.append(victim)
            writers.append(_Writer(root, next_tag))
            next_tag += 1
    finally:
        stop.set()
        reader.join(timeout=60)
        for w in writers:
            w.kill()
        done += writers
    assert kills >= 3 and not bad, bad
    acked = [g for w in done for g in w.groups(kit)]
    assert len(acked) > 100, f"only {len(acked)} groups acknowledged: the stress did not run"

    fresh = open_store(root)  # finishes any eviction a kill interrupted
    for pool in (PoolKind.KV, PoolKind.DRAFT):
        keys = [f"{g}.{kit.NS[pool]}" for g in acked]
        seen_live = [live.page_exists({pool: [k]})[pool] for k in keys]
        seen_fresh = [fresh.page_exists({pool: [k]})[pool] for k in keys]
        hidden = [k for k, a, b in zip(keys, seen_live, seen_fresh, strict=True) if a != b]
        assert not hidden, f"{len(hidden)} {pool.value} pages: live and fresh views differ (hidden or stale)"
    kv = [fresh.page_exists({PoolKind.KV: [f"{g}.{kit.NS[PoolKind.KV]}"]})[PoolKind.KV] for g in acked]
    dr = [fresh.page_exists({PoolKind.DRAFT: [f"{g}.{kit.NS[PoolKind.DRAFT]}"]})[PoolKind.DRAFT] for g in acked]
    split = [f"{g} ({'target' if a else 'draft'} kept)" for g, a, b in zip(acked, kv, dr, strict=True) if a != b]
    assert not split, f"{len(split)} acknowledged groups split between target and draft: {split}"
    present = [g for g, a in zip(acked, kv, strict=True) if a]
    got = kit.read_back(fresh, present, PAGE)
    assert all(r is PageResult.OK and eq for r, eq in got[PoolKind.KV] + got[PoolKind.DRAFT])
    use = fresh.backend.usage()
    assert use["bytes"] <= CAP + 8 * 2 * (PAGE + 64) + 8192 and use["bytes"] > CAP // 4, use
    assert use["corrupt_pages"] == 0 and live.backend.usage()["corrupt_pages"] == 0
