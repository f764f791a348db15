"""``[backend_options]`` of the ``mooncake`` backend."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def _check_host_port(value: str, what: str) -> str:
    if not _HOST_PORT.match(value):
        raise ValueError(f"{what} must be 'host:port', got {value!r}")
    port = int(value.rsplit(":", 1)[1])
    if not 0 < port < 65536:
        raise ValueError(f"{what} has port {port} outside 1..65535")
    return value


class MooncakeOptions(BaseModel):
    """Options of the Mooncake backend.

    Two client modes:

    * **TCP** (default): this process is a Mooncake client that talks to the master and moves
      bytes to whichever segment holders are mounted (local or remote) over the transfer engine.
    * **Shared memory** (``shm_client_address`` set): this process is a thin client of a
      ``mooncake_client`` segment holder running on the same host (``setup_dummy``); bytes move
      through shared memory. Zero-copy buffers must then live in the holder's shared pool: the
      backend implements the core's ``host_memory`` hook, so the cache controller builds its host
      pools there. Other buffers still work, through a staged copy in shared memory.

    How a page's bytes move (``io_mode``):

    * ``direct``: one multi-buffer native call per batch; Mooncake reads/writes the page's own
      buffers (zero copy) plus a 64-byte header slot: ``1 + buffers`` transfers per page.
    * ``staged``: header and payload are copied (C ``memmove``) into one registered, reused
      staging slot per page; one transfer per page. Over TCP the per-transfer cost dominates
      small pages, so this is faster there despite the copy.
    * ``auto`` (default): ``staged`` over TCP for pages of at most ``staged_max_page_bytes``,
      ``direct`` otherwise (RDMA, shared memory, larger pages). In shared-memory mode, pages
      outside the shared pool are always staged.
    """

    model_config = ConfigDict(extra="forbid")

    master_server_address: str = Field(description="the mooncake_master RPC address, 'host:port'")
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        description="the metadata server, e.g. 'http://127.0.0.1:8080/metadata', or 'P2PHANDSHAKE'",
    )
    local_hostname: str = Field(default="127.0.0.1", min_length=1, description="address this client advertises")
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = Field(default="", description="RDMA device names, comma-separated (rdma only)")
    global_segment_size: int = Field(
        default=0, ge=0, description="bytes this process contributes to the store (0: a pure client; TCP mode only)"
    )
    local_buffer_size: int = Field(default=16 << 20, ge=0, description="client staging buffer bytes")
    shm_client_address: str | None = Field(
        default=None, description="'host:port' of a local mooncake_client: turns on the shared-memory client mode"
    )
    shm_pool_size: int = Field(default=1 << 30, ge=1 << 20, description="shared-memory pool bytes (shm mode)")
    key_prefix: str = Field(default="hcd-", max_length=64, description="prefix of every key this backend writes")
    replica_num: int = Field(default=1, ge=1, le=16)
    rpc_timeout_ms: int = Field(
        default=2000, ge=100, description="default for MC_RPC_TIMEOUT_MS (bound of one master RPC)"
    )
    setup_retries: int = Field(
        default=1, ge=1, le=100, description="default for MC_STORE_CLIENT_SETUP_RETRIES (about 4.4 s each)"
    )
    connect_timeout_s: float = Field(default=3.0, gt=0, description="bound of the reachability check before setup")
    retry_interval_s: float = Field(
        default=1.0, ge=0, description="after a master RPC failure, answer at once for this long, then probe"
    )
    max_batch_pages: int = Field(default=256, ge=1, le=65536, description="pages per native batch call")
    io_mode: Literal["auto", "staged", "direct"] = Field(
        default="auto", description="how page bytes move: one staged buffer per page, or the page's own buffers"
    )
    staged_max_page_bytes: int = Field(
        default=128 << 10, ge=0, description="io_mode 'auto' over TCP: stage pages up to this size"
    )
    max_staging_bytes: int = Field(
        default=64 << 20, ge=1 << 20, description="bytes of staging memory one native call may use"
    )
    pipeline_bytes: int = Field(
        default=16 << 20, ge=0,
        description="staged pages: split a batch into native calls of about this many bytes, copying one while "
        "the next moves (0: one call per max_staging_bytes); direct pages go in one call per max_batch_pages",
    )
    log_level: Literal["INFO", "WARNING", "ERROR"] = Field(
        default="ERROR", description="default for MC_LOG_LEVEL (Mooncake's own logging)"
    )

    @field_validator("master_server_address")
    @classmethod
    def _master(cls, v: str) -> str:
        return _check_host_port(v, "master_server_address")

    @field_validator("shm_client_address")
    @classmethod
    def _shm(cls, v: str | None) -> str | None:
        return None if v is None else _check_host_port(v, "shm_client_address")

    @field_validator("metadata_server")
    @classmethod
    def _metadata(cls, v: str) -> str:
        if v != "P2PHANDSHAKE" and not re.match(r"^(https?|etcd|redis)://", v):
            raise ValueError(
                f"metadata_server must be 'P2PHANDSHAKE' or an http://, etcd:// or redis:// URL, got {v!r}"
            )
        return v

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.:/\-]*", v):
            raise ValueError(f"key_prefix may hold only letters, digits and _.:/- , got {v!r}")
        return v

    @property
    def shm(self) -> bool:
        return self.shm_client_address is not None
