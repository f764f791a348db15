"""The baseline the benchmark measures against (the obvious design, one file per page), and the
floor under every design (:class:`RawBatch`, a batch's bytes in one call per thread).

Each page is written to a temporary file with one ``pwritev`` (the same 64-byte header as the
real backend, then the payload straight from the page buffers) and published by rename; it is
read back with one ``preadv`` into a preallocated buffer and validated the same way (header and
xxh3 payload checksum), so both sides keep the same promises. Existence is one ``stat`` per key.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hicache_draft import (
    HEADER_SIZE,
    Buffer,
    Page,
    PageFormatError,
    PoolKind,
    make_header,
    pack_page_headers,
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


class RawBatch:
    """The filesystem's floor for one batch, no design at all: each of ``threads`` contiguous shares
    of a call's pages goes to a new file of its own in one ``write_from`` (its pages' 64-byte headers,
    made beforehand and untimed, between the payloads, exactly the bytes the backend stores), and is
    read back with one ``read_into``; no checksum is made or checked, no header parsed, nothing
    indexed or renamed. A store that writes each call's bytes into new files on this filesystem
    cannot do less I/O, so ``baseline / raw`` (with as many threads) is the highest ratio such a
    design can reach.

    With ``prepared`` the share files are created and preallocated to their shares' sizes
    beforehand (untimed, in :meth:`prepare`), as a design does that claims its files between calls
    (the file backend's spare segment files): then ``baseline / raw`` is the highest write ratio
    such a design reaches with as many writers (on the H100 host, 4 writers into prepared files
    took 0.65-0.72 ms for 8 MiB, against 2.7 ms for one writer into a new file)."""

    def __init__(self, root: Path, threads: int, prepared: bool = False) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.threads = max(1, threads)
        self.prepared = prepared
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        self._heads: dict[str, bytearray] = {}
        self._fds: dict[str, list[int]] = {}  # prepared: each share's file, open for the next set

    def _shares(self, pages: Sequence[Page]) -> list[Sequence[Page]]:
        k = max(1, min(self.threads, len(pages)))
        cuts = [j * len(pages) // k for j in range(k + 1)]
        return [pages[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    def prepare(self, pool: PoolKind, tag: str, pages: Sequence[Page]) -> None:
        """Make the headers of ``pages`` (untimed: the floor moves bytes only); ``prepared``: also
        create each share's file, preallocated to its share's bytes."""
        out = bytearray(HEADER_SIZE * len(pages))
        pack_page_headers(out, pages, pool)
        self._heads[tag] = out
        if self.prepared:
            fds = self._fds[tag] = []
            for j, share in enumerate(self._shares(pages)):
                fd = os.open(self.root / f"{tag}-{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                size = sum(HEADER_SIZE + p.nbytes for p in share)
                with contextlib.suppress(OSError):  # a filesystem without it (tmpfs): created only
                    os.posix_fallocate(fd, 0, size)

    def _iov(self, tag: str, first: int, pages: Sequence[Page]) -> list[memoryview | Buffer]:
        heads = memoryview(self._heads[tag])
        iov: list[memoryview | Buffer] = []
        for j, page in enumerate(pages, start=first):
            iov.append(heads[j * HEADER_SIZE : (j + 1) * HEADER_SIZE])
            iov.extend(page.buffers)
        return iov

    def _each(self, fn: Callable[[int, int, Sequence[Page]], int], pages: Sequence[Page]) -> int:
        shares = self._shares(pages)
        firsts = [sum(len(s) for s in shares[:j]) for j in range(len(shares))]
        if self._pool is None or len(shares) == 1:
            return sum(fn(j, firsts[j], sh) for j, sh in enumerate(shares))
        futures = [self._pool.submit(fn, j, firsts[j], sh) for j, sh in enumerate(shares) if j]
        return fn(0, 0, shares[0]) + sum(f.result() for f in futures)

    def set(self, tag: str, pages: Sequence[Page]) -> int:
        ready = self._fds.pop(tag, None)

        def one(j: int, first: int, share: Sequence[Page]) -> int:
            if ready is not None:
                fd = ready[j]
            else:
                fd = os.open(self.root / f"{tag}-{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_from(fd, 0, self._iov(tag, first, share), chunk=WRITE_CHUNK)
            finally:
                os.close(fd)
            return len(share)

        return self._each(one, pages)

    def get(self, tag: str, pages: Sequence[Page]) -> int:
        def one(j: int, first: int, share: Sequence[Page]) -> int:
            fd = os.open(self.root / f"{tag}-{j}", os.O_RDONLY)
            try:
                got = read_into(fd, 0, self._iov(tag, first, share))
            finally:
                os.close(fd)
            return len(share) if got == sum(HEADER_SIZE + p.nbytes for p in share) else 0

        return self._each(one, pages)

    def close(self) -> None:
        for fds in self._fds.values():  # prepared and never written
            for fd in fds:
                os.close(fd)
        self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown()
