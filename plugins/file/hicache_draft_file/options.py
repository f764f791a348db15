"""The ``[backend_options]`` of the file backend (unknown keys are refused)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

MiB = 1 << 20


class FileOptions(BaseModel):
    """Options of the ``file`` backend.

    ``root``: the store's directory. Created when missing if its parent exists (``create_root``);
    a missing parent is a startup error naming the path. Several processes may share one root.
    ``max_bytes``: capacity of the stored segments; least recently used groups are evicted down to
    ``evict_to * max_bytes`` when a write goes over it (never the pages of that write itself); with a
    limit set, a full filesystem (ENOSPC) evicts the same way and the write is retried once. ``None``:
    no limit.
    ``fsync``: flush each segment (and its directory entry) to the device before publishing it.
    ``segment_max_bytes``: one ``page_set`` call is packed into segment files of at most this size
    (a group is never split; a larger single group still gets its own segment).
    ``read_only``: open without writing (``page_set`` fails every page); needed for a root the
    process cannot write.
    ``recycle_files``: evicted segment files kept for reuse, so eviction does not delete and then
    re-create files (slow on some filesystems after mass deletes).
    ``open_files``: segment file descriptors kept open per process.
    ``dedup``: skip groups whose every page of the call is already stored.
    ``journal_max_records``: the shared change journal is compacted past this many records.
    ``io_threads``: threads that do one call's I/O (the calling thread included): a large
    ``page_get`` is cut into contiguous shares of its runs of records, one per thread, and a large
    ``page_set`` into that many segment files written side by side (``preadv``/``pwritev`` release
    the GIL; buffered writes to one file are serialised by the kernel, so writes spread over files).
    ``None`` (default): ``os.cpu_count()``, at most 32. 1 does all I/O in the calling thread.
    ``prefault_spares``: the spare segment files an I/O thread claims after each call for the next
    one's segments (up to 16 MiB of them in all) are also filled with zeros there, so the next call's write
    overwrites pages already in the page cache instead of allocating them (PostgreSQL's
    ``wal_init_zero`` does the same for new WAL files). It costs that background write of zeros; a
    spare whose zeros reach the disk before it is used (a ``sync``, or 30 s idle) is written to the
    disk twice. Never on an in-memory filesystem (tmpfs), where there is nothing to gain. Off by
    default: on the development VM a 128 x 64 KiB call was 1.14-1.24x as fast when its spares were
    still cached and 0.98-0.99x when their pages had been dropped from the cache before the call;
    ``file bench`` prints the ratio: 1.12-1.19x on the VM, 0.94x (64 KiB) and 1.00x (1 MiB) on an
    H100 host.
    """

    model_config = ConfigDict(extra="forbid")

    root: Path
    max_bytes: int | None = Field(default=None, ge=1)
    fsync: bool = False
    segment_max_bytes: int = Field(default=256 * MiB, ge=4096)
    create_root: bool = True
    read_only: bool = False
    evict_to: float = Field(default=0.9, gt=0.0, le=1.0)
    recycle_files: int = Field(default=16, ge=0)
    open_files: int = Field(default=256, ge=2)
    dedup: bool = True
    journal_max_records: int = Field(default=1 << 16, ge=16)
    io_threads: int | None = Field(default=None, ge=1, le=64)
    prefault_spares: bool = False

    def workers(self) -> int:
        """The threads one call's I/O is spread over (``io_threads``, or sized from the machine)."""
        return self.io_threads if self.io_threads is not None else max(1, min(32, os.cpu_count() or 1))

    @field_validator("root", mode="before")
    @classmethod
    def _expand(cls, v: object) -> object:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("root must be a directory path, got an empty string")
            return Path(v).expanduser()
        if isinstance(v, Path):
            return v.expanduser()
        return v
