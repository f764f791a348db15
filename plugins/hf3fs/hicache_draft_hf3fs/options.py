"""``[backend_options]`` of the hf3fs backend, validated without touching the file system
(``hicache-draft check`` runs them on machines that have no 3FS mount)."""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Hf3fsOptions(BaseModel):
    """Where the pages would live on 3FS.

    ``mount_point``: absolute path of the 3FS FUSE mount (usrbio opens its rings and Iovs there).
    ``namespace``: a directory under the mount that separates deployments sharing one 3FS
    (letters, digits, ``.``, ``_``, ``-``; at most 64 characters).
    ``file_size_gib``: size of each rank's page file per pool.
    ``metadata_server_url``: the key-to-slot metadata service shared by every rank and server
    (``http://`` or ``https://``); ``None`` means a single-node, in-process index.
    ``entries``: usrbio ring entries (pages in flight per ring).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mount_point: str = Field(description="absolute path of the 3FS FUSE mount")
    namespace: str = Field(pattern=NAMESPACE_PATTERN, description="directory under the mount for this deployment")
    file_size_gib: int = Field(default=64, ge=1, le=1 << 20, description="page file size per rank and pool, GiB")
    metadata_server_url: str | None = Field(default=None, description="key-to-slot metadata service URL")
    entries: int = Field(default=8, ge=1, le=4096, description="usrbio ring entries")

    @field_validator("mount_point")
    @classmethod
    def _absolute_mount(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("mount_point contains a NUL character")
        path = PurePosixPath(v)
        if not path.is_absolute():
            raise ValueError(f"mount_point must be an absolute path (the 3FS mount, e.g. /mnt/3fs), got {v!r}")
        if ".." in path.parts:
            raise ValueError(f"mount_point must not contain '..', got {v!r}")
        if path == PurePosixPath("/"):
            raise ValueError("mount_point must be the 3FS mount, not '/'")
        return str(path)

    @field_validator("namespace")
    @classmethod
    def _not_dots(cls, v: str) -> str:
        if set(v) <= {"."}:
            raise ValueError(f"namespace must name a directory, got {v!r}")
        return v

    @field_validator("metadata_server_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in {"http", "https"} or not rest.strip("/"):
            raise ValueError(f"metadata_server_url must be an http:// or https:// URL with a host, got {v!r}")
        return v

    @property
    def root(self) -> PurePosixPath:
        """Where this deployment's page files would be created."""
        return PurePosixPath(self.mount_point) / self.namespace
