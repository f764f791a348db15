"""Run a check in a forked child: does a backend (or anything holding threads and locks) still
work in a child of a process that used it? Threads do not survive ``fork``; locks they held stay held."""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable

CHILD_OK, CHILD_FALSE, CHILD_RAISED, CHILD_HUNG = 0, 3, 4, 5


def in_forked_child(body: Callable[[], bool], timeout_s: float = 60.0) -> int:
    """Run ``body`` in a forked child that never returns into the caller (it ends with
    ``os._exit``); its verdict: :data:`CHILD_OK` when it returned True, :data:`CHILD_FALSE` when
    False, :data:`CHILD_RAISED` when it raised, :data:`CHILD_HUNG` when it had not answered after
    ``timeout_s`` (the child is then killed). Every wait here is bounded by ``timeout_s``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = CHILD_RAISED
        try:
            code = CHILD_OK if body() else CHILD_FALSE
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    ready: list[int] = []
    got = b""
    try:
        ready, _, _ = select.select([r], [], [], timeout_s)
        got = os.read(r, 1) if ready else b""
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not ready:
        return CHILD_HUNG
    return got[0] if got else CHILD_RAISED  # no answer: it died on the way (a crash, a signal)
