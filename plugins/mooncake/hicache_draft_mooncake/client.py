"""Building a Mooncake store client: environment defaults, bounded checks of every component the
client needs (master, segment holder, metadata server), ``setup`` or ``setup_dummy``, and errors
that name the component, its address and what to check.

Why the checks come first: ``setup`` and ``setup_dummy`` hold the GIL, so they cannot be bounded
from Python, and ``setup_dummy`` waits 30 s on a holder that accepts connections but does not
answer (a stopped process, or a port that is not a ``mooncake_client``). So before calling them
the client checks, each within ``connect_timeout_s``, that the master (and in shared-memory mode
the holder) accepts a TCP connection AND answers one coro_rpc request (Mooncake's RPC protocol;
an unknown function id gets an error reply, which proves the process is alive), and that an HTTP
metadata server answers HTTP. What remains unbounded is a process that freezes in the few
milliseconds between its check and ``setup``.

Environment (read by the Mooncake library; the backend sets these with ``os.environ.setdefault``
before it imports ``mooncake.store``, so a value already in the environment wins):

* ``MC_RPC_TIMEOUT_MS`` (option ``rpc_timeout_ms``, default 2000): bound of one master RPC
  (Mooncake's default is 30 s on a hung master).
* ``MC_STORE_CLIENT_SETUP_RETRIES`` (option ``setup_retries``, default 1): ``setup`` retries of
  about 4.4 s each (Mooncake's default 20 blocks about 90 s without a master).
* ``MC_TCP_BIND_ADDRESS`` (the ``local_hostname`` option when it is an IP address): the address
  the transfer engine advertises; without it Mooncake advertises the first non-loopback interface.
* ``MC_LOG_LEVEL`` (option ``log_level``, default ERROR).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
import urllib.error
import urllib.request
from typing import Any

from hicache_draft import BackendSetupError
from hicache_draft_mooncake.options import MooncakeOptions

_RPC_MAGIC = 21
# A coro_rpc request header (magic, version, serialize type, message type, sequence number,
# function id, body length, attachment length) for function id 0, which no server registers:
# a live server answers "function not registered".
_RPC_PING = struct.pack("<BBBBIIII", _RPC_MAGIC, 0, 0, 0, 1, 0, 0, 0)


def apply_env_defaults(opts: MooncakeOptions) -> None:
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(opts.rpc_timeout_ms))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(opts.setup_retries))
    os.environ.setdefault("MC_LOG_LEVEL", opts.log_level)
    try:
        ipaddress.ip_address(opts.local_hostname)
    except ValueError:
        return
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", opts.local_hostname)


def rpc_check(address: str, timeout_s: float) -> str | None:
    """``None`` when ``host:port`` accepts a TCP connection and answers a coro_rpc request within
    ``timeout_s`` (in total); otherwise what went wrong, in words."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except TimeoutError:
        return f"did not accept a TCP connection within {timeout_s:g}s"
    except OSError as exc:
        return f"is not reachable ({exc.strerror or exc})"
    with sock:
        try:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.sendall(_RPC_PING)
            reply = sock.recv(64)
        except TimeoutError:
            return (f"accepts connections but did not answer an RPC within {timeout_s:g}s (a stopped or hung "
                    "process, or a port that is not a Mooncake service)")
        except OSError as exc:
            return f"dropped the connection ({exc.strerror or exc})"
    if not reply:
        return "closed the connection without answering an RPC (not a Mooncake service?)"
    if reply[0] != _RPC_MAGIC:
        return "answered, but not in Mooncake's RPC protocol (another service on this port?)"
    return None


def metadata_check(url: str, timeout_s: float) -> str | None:
    """``None`` when the HTTP metadata server at ``url`` answers HTTP within ``timeout_s`` (any
    status: an unknown key is a 404); otherwise what went wrong. Other kinds are not checked."""
    if not url.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(f"{url}?key=hicache-draft-check", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return f"did not answer within {timeout_s:g}s"
        return f"is not reachable ({getattr(reason, 'strerror', None) or reason})"


def component_error(opts: MooncakeOptions, component: str, address: str, what: str) -> BackendSetupError:
    """A setup error naming the component, its address and what the operator should check."""
    hints = {
        "master": f"check that mooncake_master runs and listens at {address} (--rpc_port, --rpc_address)",
        "holder": (f"check that a mooncake_client segment holder runs on this host with --host/--port {address} "
                   f"and is connected to the master at {opts.master_server_address}"),
        "metadata server": (f"check the metadata_server option ({address}): the master serves it with "
                            "--enable_http_metadata_server=true on --http_metadata_server_port"),
    }
    return BackendSetupError(f"mooncake backend: the {component} at {address} {what}; "
                             f"{hints.get(component, 'check the Mooncake processes')}")


def check_components(opts: MooncakeOptions) -> None:
    """Raise :class:`BackendSetupError` naming the first component that is down, frozen or not a
    Mooncake service (holder first in shared-memory mode, then master, then metadata server).
    Each check is bounded by ``connect_timeout_s``."""
    timeout = opts.connect_timeout_s
    if opts.shm:
        assert opts.shm_client_address is not None
        why = rpc_check(opts.shm_client_address, timeout)
        if why is not None:
            raise component_error(opts, "holder", opts.shm_client_address, why)
        return  # the holder talks to the master and the metadata server, not this process
    why = rpc_check(opts.master_server_address, timeout)
    if why is not None:
        raise component_error(opts, "master", opts.master_server_address, why)
    why = metadata_check(opts.metadata_server, timeout)
    if why is not None:
        raise component_error(opts, "metadata server", opts.metadata_server, why)


_client_pid: int | None = None  # the process that made a native client here (a forked child inherits the value)

FORKED_OPEN = (
    "mooncake backend: this process was forked from one that had a Mooncake client open, and Mooncake's "
    "client does not work in such a child (a new one hung in setup); open the store in a process started "
    "with the 'spawn' or 'forkserver' method, or before any Mooncake store is opened in the parent"
)


def new_client(opts: MooncakeOptions) -> Any:  # noqa: ANN401 (the native client has no type stubs)
    """A set-up ``MooncakeDistributedStore``; :class:`BackendSetupError` naming what to check.

    Bounded by about ``connect_timeout_s`` per checked component plus the time of ``setup``
    itself (a few ms to tens of ms on a healthy store; see the module docstring). Refused at once
    in a forked child of a process that had made one (it would hang there)."""
    global _client_pid
    if _client_pid is not None and _client_pid != os.getpid():
        raise BackendSetupError(FORKED_OPEN)
    apply_env_defaults(opts)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise BackendSetupError(
            f"mooncake backend: cannot import mooncake.store ({exc}); install 'hicache-draft-mooncake[cpu]' "
            "(needs Debian's libibverbs1: apt-get install libibverbs1) or 'hicache-draft-mooncake[cuda]'"
        ) from None
    check_components(opts)
    _client_pid = os.getpid()
    store = MooncakeDistributedStore()
    if opts.shm:
        assert opts.shm_client_address is not None
        rc = store.setup_dummy(opts.shm_pool_size, opts.local_buffer_size, opts.shm_client_address)
        if rc != 0:
            raise component_error(opts, "holder", opts.shm_client_address,
                                  f"answers RPCs but refused the shared-memory client (setup_dummy returned {rc})")
        return store
    rc = store.setup(
        opts.local_hostname, opts.metadata_server, opts.global_segment_size, opts.local_buffer_size,
        opts.protocol, opts.rdma_devices, opts.master_server_address,
    )
    if rc != 0:
        raise BackendSetupError(
            f"mooncake backend: setup(master {opts.master_server_address}, metadata {opts.metadata_server}, "
            f"protocol {opts.protocol}) returned {rc} although the master answers; check that "
            f"MC_TCP_BIND_ADDRESS / local_hostname ({opts.local_hostname}) is an address of this host that peers "
            "can reach, and the master's log"
        )
    return store
