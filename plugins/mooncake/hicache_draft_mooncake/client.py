"""Building a Mooncake store client: environment defaults, a reachability check, ``setup`` or
``setup_dummy``, and a setup error that says what to check.

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
from typing import Any

from hicache_draft import BackendSetupError
from hicache_draft_mooncake.options import MooncakeOptions


def apply_env_defaults(opts: MooncakeOptions) -> None:
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(opts.rpc_timeout_ms))
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(opts.setup_retries))
    os.environ.setdefault("MC_LOG_LEVEL", opts.log_level)
    try:
        ipaddress.ip_address(opts.local_hostname)
    except ValueError:
        return
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", opts.local_hostname)


def _reachable(address: str, timeout_s: float) -> str | None:
    """``None`` when ``host:port`` accepts a TCP connection, else the reason."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _setup_error(opts: MooncakeOptions, what: str) -> BackendSetupError:
    if opts.shm:
        hint = (
            f"check that a mooncake_client segment holder runs on this host at {opts.shm_client_address} "
            f"(its --host/--port) and is connected to the master at {opts.master_server_address}"
        )
    else:
        hint = (
            f"check that mooncake_master runs and listens at {opts.master_server_address} (--rpc_port, "
            f"--rpc_address), that the metadata server {opts.metadata_server} answers (master flag "
            f"--enable_http_metadata_server), that at least one segment holder is mounted, and that "
            f"MC_TCP_BIND_ADDRESS / local_hostname ({opts.local_hostname}) is an address peers can reach"
        )
    return BackendSetupError(f"mooncake backend: {what}; {hint}")


def connect(opts: MooncakeOptions) -> Any:
    """A set-up ``MooncakeDistributedStore``; :class:`BackendSetupError` naming what to check."""
    apply_env_defaults(opts)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise BackendSetupError(
            f"mooncake backend: cannot import mooncake.store ({exc}); install 'hicache-draft-mooncake[cpu]' "
            "(needs Debian's libibverbs1: apt-get install libibverbs1) or 'hicache-draft-mooncake[cuda]'"
        ) from None
    target = opts.shm_client_address if opts.shm else opts.master_server_address
    why = _reachable(target, opts.connect_timeout_s)  # type: ignore[arg-type]
    if why is not None:
        role = "the local mooncake_client" if opts.shm else "the master"
        raise _setup_error(opts, f"{role} at {target} is unreachable ({why})")
    store = MooncakeDistributedStore()
    if opts.shm:
        rc = store.setup_dummy(opts.shm_pool_size, opts.local_buffer_size, opts.shm_client_address)
        call = f"setup_dummy(pool {opts.shm_pool_size} bytes, client {opts.shm_client_address})"
    else:
        rc = store.setup(
            opts.local_hostname, opts.metadata_server, opts.global_segment_size, opts.local_buffer_size,
            opts.protocol, opts.rdma_devices, opts.master_server_address,
        )
        call = f"setup(master {opts.master_server_address}, metadata {opts.metadata_server}, protocol {opts.protocol})"
    if rc != 0:
        raise _setup_error(opts, f"{call} returned {rc}")
    return store
