"""The baseline the benchmark measures against: the obvious design, one file per page.

Each page is written to a temporary file with one ``pwritev`` (the same 64-byte header as the
real backend, then the payload straight from the page buffers) and published by rename; it is
read back with one ``preadv`` into a preallocated buffer and validated the same way (header and
xxh3 payload checksum), so both sides keep the same promises. Existence is one ``stat`` per key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hicache_draft import (
    HEADER_SIZE,
    Page,
    PageFormatError,
    PoolKind,
    make_header,
    parse_header,
    read_into,
    verify_payload,
    write_from,
)
from hicache_draft_file.vectored_io import WRITE_CHUNK


class OneFilePerPage:
    """A minimal page store: ``ROOT/<key[:2]>/<key>.<pool>``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for i in range(256):
            (root / f"{i:02x}").mkdir(parents=True, exist_ok=True)

    def _path(self, pool: PoolKind, key: str) -> str:
        return f"{self.root}/{key[:2]}/{key}.{pool.value}"

    def set(self, pool: PoolKind, pages: Sequence[Page]) -> int:
        done = 0
        for page in pages:
            views = [b.view() for b in page.buffers]
            final = self._path(pool, page.key)
            tmp = final + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_from(fd, 0, [make_header(page.key, page.namespace, pool, views), *views], chunk=WRITE_CHUNK)
            finally:
                os.close(fd)
            os.rename(tmp, final)
            done += 1
        return done

    def get(self, pool: PoolKind, pages: Sequence[Page]) -> int:
        ok = 0
        head = bytearray(HEADER_SIZE)
        for page in pages:
            views = [b.view() for b in page.buffers]
            try:
                fd = os.open(self._path(pool, page.key), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                got = read_into(fd, 0, [head, *views])
            finally:
                os.close(fd)
            if got != HEADER_SIZE + page.nbytes:
                continue
            try:
                verify_payload(parse_header(head, page.key, page.namespace, pool), views, page.nbytes)
            except PageFormatError:
                continue
            ok += 1
        return ok

    def exists(self, pool: PoolKind, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not os.path.exists(self._path(pool, key)):
                break
            n += 1
        return n


class ThreadedFilePerPage(OneFilePerPage):
    """The same store with a call's pages split into ``threads`` contiguous shares, each done by
    its own thread (the calling thread takes one): what the obvious design gains from the cores
    the file backend uses too (``open``, ``pwritev``, ``preadv`` and xxh3 release the GIL)."""

    def __init__(self, root: Path, threads: int) -> None:
        super().__init__(root)
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    def _split(self, fn: Callable[[PoolKind, Sequence[Page]], int], pool: PoolKind, pages: Sequence[Page]) -> int:
        k = min(self.threads, len(pages))
        if self._pool is None or k <= 1:
            return fn(pool, pages)
        cuts = [j * len(pages) // k for j in range(k + 1)]
        futures = [self._pool.submit(fn, pool, pages[a:b]) for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
        return fn(pool, pages[: cuts[1]]) + sum(f.result() for f in futures)

    def set(self, pool: PoolKind, pages: Sequence[Page]) -> int:
        return self._split(super().set, pool, pages)

    def get(self, pool: PoolKind, pages: Sequence[Page]) -> int:
        return self._split(super().get, pool, pages)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
