"""A circuit breaker whose recovery probes run on a background thread, never in a caller's.

When a call sees the store fail in a way that means "down" (the master or the holder did not
answer, a native call outlived its deadline, the holder lost this client's shared memory), the
backend *trips* the breaker: from then on every call answers at once (failures / misses) without
touching the store. A daemon prober thread then runs ``probe`` (a real put/get round trip, and in
shared-memory mode a reconnect when that is what is broken) every ``retry_interval_s`` until it
succeeds, and resets the breaker: the next call goes to the store again, and works.

A dead master costs a native call about 4.3 s and a stopped holder 30 s; only the prober waits
that long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hicache_draft_mooncake")


class Breaker:
    """``down`` while the store is known to be unusable; ``probe`` runs on the prober thread.

    ``probe()`` returns whether the store works again; an exception counts as "not yet".
    ``trip(now=True)`` asks for a probe at once instead of after ``retry_interval_s`` (used for a
    suspicion that one round trip settles, e.g. a possibly lost shared-memory mapping).
    """

    def __init__(self, retry_interval_s: float, probe: Callable[[], bool], name: str = "mooncake") -> None:
        self.retry_interval_s = retry_interval_s
        self._probe = probe
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._down_since: float | None = None
        self._probe_now = False
        self._suspect = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.trips = 0
        self.probes = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def down_for_s(self) -> float:
        """Seconds since the breaker tripped (0.0 while up)."""
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    def trip(self, now: bool = False) -> bool:
        """Mark the store down and make sure the prober runs; whether this call tripped it."""
        with self._lock:
            if self._closed:
                return False
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self.trips += 1
                self._probe_now = now
            self._start()
        if first and now:
            self._wake.set()
        return first

    def suspect(self) -> None:
        """Probe once, at once, while calls go on; trip only if that probe fails (for a code that
        means a broken store only sometimes, e.g. shared-memory ``INVALID_PARAMS``)."""
        with self._lock:
            if self._closed or self._down_since is not None:
                return
            self._suspect = True
            self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=f"{self._name}-prober", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                verifying = self._suspect and self._down_since is None
                if self._closed or (self._down_since is None and not verifying):
                    self._thread = None
                    return
                now, self._probe_now, self._suspect = self._probe_now or verifying, False, False
            if not now:
                self._wake.wait(self.retry_interval_s)
            self._wake.clear()
            with self._lock:
                if self._closed:
                    self._thread = None
                    return
            self.probes += 1
            try:
                ok = bool(self._probe())
            except Exception as exc:  # noqa: BLE001 (a probe that raises means "not yet")
                log.debug("%s: probe raised %s: %s", self._name, type(exc).__name__, exc)
                ok = False
            with self._lock:
                if ok:
                    self._down_since = None
                elif self._down_since is None:  # a suspicion confirmed
                    self._down_since = time.monotonic()
                    self.trips += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the prober (waits at most ``timeout_s`` for a probe in progress; it is a daemon)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
