"""One demo phase in a fresh process: ``python -m hicache_draft.demo.worker`` reads a job (JSON)
on stdin and writes JSON lines on stdout: ``{"event": "progress", "step": ...}`` while it works,
then one ``{"event": "result", "result": {...}}`` or ``{"event": "error", "message": ...}``."""

from __future__ import annotations

import json
import sys
from typing import Any

from hicache_draft.pools import import_torch

torch = import_torch()  # quietly, before the modules that need it

from hicache_draft.demo.phases import Job, run_phase  # noqa: E402
from hicache_draft.errors import HiCacheDraftError  # noqa: E402


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> int:
    # Same threads, deterministic kernels: the runs of different processes compute the same bits.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        job = Job.from_dict(json.loads(sys.stdin.read()))
    except (ValueError, KeyError, TypeError) as exc:
        _emit({"event": "error", "message": f"bad job description: {type(exc).__name__}: {exc}"})
        return 2
    try:
        result = run_phase(job, lambda step: _emit({"event": "progress", "step": step}))
    except HiCacheDraftError as exc:
        _emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    _emit({"event": "result", "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
