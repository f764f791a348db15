"""One native Mooncake client with the memory registered with it, and the calls in flight on it.

The backend replaces its session when a shared-memory client cannot be repaired in place (the
holder restarted and no longer maps this client's shared memory: Mooncake's own reconnect does
not notice a quick restart, and with two clients in one process it never succeeds). A call
takes the session it starts with and finishes on it; the old session is closed only once its
calls are done (bounded: a call that never returns keeps it open, it is then left to the
process exit rather than closed under a running call).

The session also knows when a native call outlived its deadline: the store (a stopped holder or
master) is then not answering, and the backend stops calling it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from hicache_draft_mooncake.memory import Memory

log = logging.getLogger("hicache_draft_mooncake")

_ids = itertools.count(1)


class SessionClosed(RuntimeError):
    """A call tried to use a session that was replaced or closed (its pages fail)."""


class Session:
    """A native client (``native``), its :class:`Memory` and its in-flight native calls."""

    def __init__(self, native: Any, shm: bool, generation: int = 1) -> None:  # noqa: ANN401
        self.native = native
        self.mem = Memory(native, shm=shm)
        self.generation = generation
        self.opened_at = time.monotonic()
        self._lock = threading.Lock()
        self._calls: dict[int, float] = {}  # call id -> its deadline
        self._idle = threading.Condition(self._lock)
        self.closed = False

    @contextlib.contextmanager
    def call(self, deadline: float) -> Iterator[None]:
        """``with session.call(deadline):`` around every use of the native client or its memory;
        raises :class:`SessionClosed` once the session is closing (no call starts after that)."""
        token = next(_ids)
        with self._lock:
            if self.closed:
                raise SessionClosed("this Mooncake client was replaced or closed")
            self._calls[token] = deadline
        try:
            yield
        finally:
            with self._lock:
                del self._calls[token]
                if not self._calls:
                    self._idle.notify_all()

    def overdue(self, grace_s: float = 0.0) -> float:
        """Seconds by which the oldest native call in flight is past its deadline (0.0 if none)."""
        with self._lock:
            if not self._calls:
                return 0.0
            late = time.monotonic() - min(self._calls.values()) - grace_s
        return max(0.0, late)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded) until no native call is in flight; whether that happened."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._calls:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, drain_s: float) -> bool:
        """Refuse new calls, then unregister the memory and close the native client once no call
        is in flight (waits at most ``drain_s``). Whether it was closed (False: a call still
        runs; the native client is then left open, to the process exit)."""
        with self._lock:
            if self.closed and self.native is None:
                return True
            self.closed = True
        if not self.wait_idle(drain_s):
            log.warning("mooncake: a native call on the old client is still running after %.1fs; the old "
                        "client is left open (it is released at process exit)", drain_s)
            return False
        with self._lock:
            native, self.native = self.native, None
        if native is None:
            return True
        failed = self.mem.release()
        if failed:
            log.debug("mooncake: %d unregister_buffer calls failed while closing a client", failed)
        try:
            native.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("mooncake close failed: %s", exc)
        return True
