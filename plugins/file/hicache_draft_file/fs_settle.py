"""Waiting, before a benchmark, until file creation on the scratch filesystem runs at its usual speed.

On the development VM (ext4 mounted with ``discard``) creating a file is 3 to 50 times slower for
seconds to minutes after many blocks or inodes were freed: a previous benchmark's scratch being
removed, or any other mass delete. The one-file-per-page baseline creates a file per page and the
file backend one per batch, so a run that starts in that phase measures the baseline slow and the
ratio high (the last engineer saw the 64 KiB zero-copy set ratio at 4.6-4.9x when runs followed
each other and 1.6-1.7x after an idle minute). The benchmark therefore first probes how long it
takes to create, write (4 KiB), close and rename a few files, as the baseline does per page, and
starts only once that has stopped improving; it reports the wait and the settled cost, so a reader
can see the state it measured in.

Telling a settled phase from a steady slow one needs a reference: each settled measurement is
remembered per filesystem (``~/.cache/hicache-draft/file-bench-fs.json``, the lowest one kept)
and the next run waits until creation is within ``TARGET_WITHIN`` of it; a first run has only the
relative rule, and can take a steady slow phase for a settled one.

The probe deletes nothing (its files go with the scratch root), so it does not prolong what it
waits out. Slow phases also come in bursts for minutes, starting seconds after the delete, so the
benchmark also probes (16 files) before and after every round and does not count a round measured
in one. Bursts shorter than a round still get through: the gate lowers the spread, it does not
remove it (see the README for medians over several runs).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROBE_FILES = 64
MIN_PROBES = 8
WINDOW = 4
SETTLED_WITHIN = 1.5  # the recent probes' median at most this much above the best such median
TARGET_WITHIN = 3.0  # ... and this much above a settled cost measured before, when there is one
INTERVAL_S = 0.25


@dataclass(frozen=True)
class Settled:
    """``waited_s``: time spent probing; ``create_us``: µs per small file (create, write, close, rename) at the end
    (median of the last probes); ``settled``: False when ``max_s`` ran out first."""

    waited_s: float
    create_us: float
    probes: int
    settled: bool


_PROBE_DATA = b"\xa5" * 4096


def probe_creates(where: Path, n: int = PROBE_FILES) -> float:
    """Seconds per file to do what the baseline does per page, with 4 KiB: create a temp file in a
    new directory under ``where``, write, close, rename. Nothing is unlinked: a probe that deletes
    its files keeps the filesystem in the slow phase it measures (create-and-unlink probes slowed
    from 30 to 110 us per file over 20 s on the development VM). Empty-file creates alone missed a
    phase in which the baseline wrote 64 KiB pages at 0.5 GB/s instead of 1.0-1.4."""
    where.mkdir(parents=True, exist_ok=True)
    fresh = tempfile.mkdtemp(dir=where)
    names = [(os.path.join(fresh, f"p{i}.tmp"), os.path.join(fresh, f"p{i}")) for i in range(n)]
    t0 = time.perf_counter()
    for tmp, final in names:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, _PROBE_DATA)
        finally:
            os.close(fd)
        os.rename(tmp, final)
    return (time.perf_counter() - t0) / n


def is_settled(samples: list[float], target: float | None = None) -> bool:
    """Enough probes, and the median of the last ``WINDOW`` probes (medians, because single probes
    are noisy): within ``SETTLED_WITHIN`` of the best such median so far, not ``SETTLED_WITHIN``
    better than the window before it (still improving means still recovering), and, given
    ``target`` (a cost measured in a settled phase), within ``TARGET_WITHIN`` of it (the slow
    phase is about 10x or more)."""
    if len(samples) < max(MIN_PROBES, 2 * WINDOW):
        return False
    windows = [statistics.median(samples[i - WINDOW : i]) for i in range(WINDOW, len(samples) + 1)]
    now, before = windows[-1], windows[-1 - WINDOW]
    steady = now <= SETTLED_WITHIN * min(windows) and before <= SETTLED_WITHIN * now
    return steady and (target is None or now <= TARGET_WITHIN * target)


def wait_until_settled(
    probe: Callable[[], float],
    max_s: float,
    target: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Settled:
    """Probe every ``INTERVAL_S`` until :func:`is_settled` or ``max_s`` has passed."""
    start = clock()
    samples: list[float] = []
    while True:
        samples.append(probe())
        done = is_settled(samples, target)
        if done or clock() - start >= max_s:
            recent = statistics.median(samples[-WINDOW:]) * 1e6
            return Settled(waited_s=clock() - start, create_us=recent, probes=len(samples), settled=done)
        sleep(INTERVAL_S)


def reference_file() -> Path:
    """Where the settled create cost of each filesystem is remembered between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache-draft" / "file-bench-fs.json"


def load_reference(where: Path, store: Path | None = None) -> float | None:
    """The settled create cost (seconds) last recorded for the filesystem holding ``where``:
    without one, a run that starts in a steady slow phase cannot tell it from a settled one."""
    try:
        refs = json.loads((store or reference_file()).read_text())
        value = refs.get(_ref_key(where))
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def save_reference(where: Path, cost: float, store: Path | None = None) -> None:
    """Record ``cost`` (seconds, from a settled probe) for the filesystem holding ``where``, unless
    a lower one is recorded: a run that took a steady slow phase for a settled one must not raise
    the bar for the next (delete the file to start over). Best effort (an unwritable cache only
    loses the reference)."""
    path = store or reference_file()
    try:
        try:
            refs = json.loads(path.read_text())
            if not isinstance(refs, dict):
                refs = {}
        except (OSError, ValueError):
            refs = {}
        key = _ref_key(where)
        known = refs.get(key)
        refs[key] = min(cost, known) if isinstance(known, int | float) and known > 0 else cost
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(refs))
        os.replace(tmp, path)
    except OSError:
        return


def _ref_key(where: Path) -> str:
    """The filesystem (device id) and the probe's kind: a reference from another probe does not count."""
    return f"{os.stat(where).st_dev}/create-write-rename"
