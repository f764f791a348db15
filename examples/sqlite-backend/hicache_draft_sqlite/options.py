"""``[backend_options]`` of the sqlite backend (validated without touching the file system)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MIN_BUDGET = 1 << 16


class SqliteOptions(BaseModel):
    """``path``: the database file, created if missing (its directory must exist).
    ``max_bytes``: the byte budget of stored pages (header included); the least recently used page
    groups are evicted to stay within it. ``None``: no capacity control.
    ``busy_timeout_s``: the longest wait for another writer's lock (also bounded by each call's deadline).
    ``synchronous``: SQLite's ``PRAGMA synchronous`` in WAL mode: ``normal`` survives a crash of
    the process, ``full`` also a power loss, ``off`` neither (fastest).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description="SQLite database file")
    max_bytes: int | None = Field(default=None, ge=MIN_BUDGET, description="byte budget; None = unbounded")
    busy_timeout_s: float = Field(default=5.0, gt=0, le=600, description="longest wait for a lock")
    synchronous: Literal["off", "normal", "full"] = Field(default="normal", description="PRAGMA synchronous")

    @field_validator("path")
    @classmethod
    def _a_file(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("path contains a NUL character")
        if v.strip() == ":memory:" or v.startswith("file:"):
            raise ValueError(f"path must be a database file on disk (no ':memory:' or 'file:' URI), got {v!r}")
        return v
