"""A small circuit breaker: after the master fails to answer, stop calling it for a while.

A dead master costs about 4.3 s per data call (the client's reconnect backoff). Once a call has
seen an RPC failure, the backend answers at once (misses / failures) for ``retry_interval_s``;
after that, one caller probes with a cheap existence call and, if the master answers, normal
service resumes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(self, retry_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._probing = False
        self.trips = 0

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def trip(self) -> None:
        """The master did not answer."""
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
                self.trips += 1
            self._retry_at = now + self.retry_interval_s
            self._probing = False

    def reset(self) -> None:
        """The master answered."""
        with self._lock:
            self._down_since = None
            self._probing = False

    def allow(self, probe: Callable[[], bool]) -> bool:
        """Whether a call may go to the master now. When down and the interval has passed, run
        ``probe`` (returns whether the master answered) in this caller, one caller at a time."""
        with self._lock:
            if self._down_since is None:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing = True
        ok = False
        try:
            ok = probe()
        finally:
            if ok:
                self.reset()
            else:
                self.trip()
        return ok
