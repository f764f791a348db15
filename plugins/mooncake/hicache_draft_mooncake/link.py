"""The link from this process to the store: the current :class:`Session`, shared in
shared-memory mode by every backend of the process that uses the same holder.

Why one shared-memory client per process: Mooncake keeps a client's shared memory in a
process-wide list, and when a client's ping to the holder fails, its reconnect loop re-registers
*every* shared-memory block of the process under its own id. With two clients in one process it
so registers the other client's staging buffer, the holder refuses it ("A local buffer is already
mapped") but keeps the memory registration, and from then on every registration that lands on
that address range fails ("does not support overlapped memory region"): neither client ever
recovers, nor can a new one register. One client per process avoids that. For the same reason a
replaced client is closed (which stops its ping thread) *before* its successor is created.

TCP-mode links are private to their backend (nothing is shared there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from hicache_draft_mooncake.options import MooncakeOptions
from hicache_draft_mooncake.session import Session

log = logging.getLogger("hicache_draft_mooncake")

_registry: dict[str, Link] = {}
_registry_lock = threading.Lock()


class Link:
    """The current session of one store connection, with reference counts and reconnection."""

    def __init__(self, opts: MooncakeOptions, connect: Callable[[MooncakeOptions], object]) -> None:
        self.opts = opts
        self._connect = connect
        self._lock = threading.Lock()
        self.session = Session(connect(opts), shm=opts.shm)
        self.users = 1
        self.reconnects = 0

    @classmethod
    def acquire(cls, opts: MooncakeOptions, connect: Callable[[MooncakeOptions], object]) -> Link:
        """The process's link for ``opts`` (shared in shm mode, by holder address), or a new one."""
        if not opts.shm:
            return cls(opts, connect)
        assert opts.shm_client_address is not None
        with _registry_lock:
            link = _registry.get(opts.shm_client_address)
            if link is not None:
                link.users += 1
                if link.opts.shm_pool_size != opts.shm_pool_size:
                    log.debug("mooncake: the shared-memory client for %s is shared; its first options win",
                              opts.shm_client_address)
                return link
            link = cls(opts, connect)  # bounded: see client.new_client
            _registry[opts.shm_client_address] = link
            return link

    def reconnect(self, seen: Session, drain_s: float) -> Session:
        """Replace ``seen`` by a new client (unless another backend already did): the old one is
        closed first (its calls drain for at most ``drain_s``). Raises what ``connect`` raises;
        the session stays closed then, and the next call of this method tries again."""
        with self._lock:
            if self.session is not seen or self.users <= 0:  # done by another backend, or all closed
                return self.session
            if not seen.close(drain_s):
                log.warning("mooncake: the old shared-memory client still has a call running; a new one is "
                            "made anyway")
            new = Session(self._connect(self.opts), shm=self.opts.shm, generation=seen.generation + 1)
            self.session = new
            self.reconnects += 1
            return new

    def release(self, drain_s: float) -> None:
        """One user less; the last one closes the session (unregistering its memory)."""
        with _registry_lock:
            self.users -= 1
            last = self.users <= 0
            if last and self.opts.shm and _registry.get(self.opts.shm_client_address or "") is self:
                del _registry[self.opts.shm_client_address or ""]
        if last:
            with self._lock:
                self.session.close(drain_s)
