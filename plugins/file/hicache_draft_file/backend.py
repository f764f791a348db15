"""The ``file`` storage backend: pages packed into immutable segment files under one root.

Why segments: the obvious design (one file per page, temp file + rename) pays several syscalls
and a file creation per page, so it writes 64 KiB pages at about 1 GB/s. Here one ``page_set``
call becomes one file (one create or recycle, one ``pwritev`` straight from the page buffers, one
rename), and one ``page_get`` reads each run of adjacent records with one ``preadv`` straight into
the destination buffers. Existence is a dict lookup in an in-memory index that is rebuilt at
start-up from one footer per segment and kept current across processes by a shared journal.

See naming.py (root layout), segment_format.py (bytes on disk), journal.py (cross-process
notices), catalog.py (the index) and README for the promises.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import operator
import os
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    BackendContext,
    BackendSetupError,
    Buffer,
    Capabilities,
    Layout,
    Page,
    PageFormatError,
    PageResult,
    PageTransfer,
    PoolCapability,
    PoolKind,
    PoolRegistration,
    StorageBackend,
    hookimpl,
    parse_header,
    verify_payload,
)
from hicache_draft_file.catalog import Catalog, Segment
from hicache_draft_file.journal import Journal, Op
from hicache_draft_file.naming import (
    SEGMENT_SUFFIX,
    RootLayout,
    group_problem,
    is_segment_name,
    key_problem,
    new_writer_id,
    page_names_ok,
    segment_name,
)
from hicache_draft_file.options import FileOptions
from hicache_draft_file.region_views import RegionViews
from hicache_draft_file.root_setup import prepare_root
from hicache_draft_file.segment_format import SegmentError, read_index
from hicache_draft_file.segment_writer import claim_file, fsync_dir, write_segment
from hicache_draft_file.vectored_io import IOV_MAX, preadv_all

log = logging.getLogger("hicache_draft_file")

# One preadv reads at most this much, then its pages are checked: a run this small is still in
# the CPU cache when its xxh3 is computed (a whole 8 MiB batch in one preadv is hashed from memory;
# on the development VM, 128-512 KiB runs read and check 64 KiB pages fastest, 2 MiB ones ~10% slower).
_RUN_MAX_BYTES = 256 << 10
# A page_get reads one segment in several threads only when it spans at least this much in pages
# of at least _PARALLEL_MIN_PAGE bytes on average: small pages are dominated by per-page Python
# work, and two threads contending for the GIL made batches of 64 KiB two-buffer pages slower
# (0.95x instead of 1.07x the baseline), while 128 MiB batches of 1 MiB pages went from 0.97x to 1.65x.
_PARALLEL_MIN_BYTES = 16 << 20
_PARALLEL_MIN_PAGE = 256 << 10
_QUARANTINE_KEEP = 16
_NBYTES = operator.attrgetter("nbytes")
_SPLIT_MIN = 16 << 20

_POOL_CAP = PoolCapability(
    attention=frozenset({Attention.MHA, Attention.MLA}),
    zero_copy_layouts=frozenset(Layout),
    generic=True,
    max_buffers_per_page=None,
)


# A page to read: (record offset in its segment, payload bytes, pool, index in the call, page).
_Item = tuple[int, int, PoolKind, int, Page]


@dataclass
class _Handle:
    """An open segment descriptor shared by concurrent calls; closed when retired and unused."""

    fd: int
    refs: int = 0
    retired: bool = False


@dataclass
class FileStats:
    """Counters since this backend instance started."""

    segments_written: int = 0
    segments_recycled: int = 0
    segments_evicted: int = 0
    pages_evicted: int = 0
    corrupt_pages: int = 0
    segments_quarantined: int = 0
    foreign_files: int = 0
    write_failures: int = 0
    read_failures: int = 0
    rescans: int = 0


class FileBackend(StorageBackend):
    """Embedded default backend: a directory on a local or shared POSIX filesystem."""

    api_version: ClassVar[int] = 2
    capabilities: ClassVar[Capabilities] = Capabilities(
        pools={PoolKind.KV: _POOL_CAP, PoolKind.DRAFT: _POOL_CAP},
        split_heads=True,
        persistent=True,
        shared=True,
    )
    Options: ClassVar[type[FileOptions]] = FileOptions

    def __init__(self, options: FileOptions, context: BackendContext) -> None:
        super().__init__(options, context)
        self.opts = options
        self.layout: RootLayout = prepare_root(options.root, create=options.create_root, read_only=options.read_only)
        self.root = self.layout.root
        self.writable = not options.read_only
        self.stats = FileStats()
        self.catalog = Catalog()
        self.registrations: dict[PoolKind, PoolRegistration] = {}
        self._regions = RegionViews()  # views of the registered pools' memory (reads slice them)
        self._lock = threading.RLock()  # catalog, handles, journal offset
        self._fs_lock = threading.Lock()  # serialises this process's use of the root flock
        self._handles: OrderedDict[str, _Handle] = OrderedDict()
        self._logged: set[str] = set()
        self._writer = new_writer_id()
        self._seq = 0
        self._closed = False
        self._readers = (
            ThreadPoolExecutor(options.io_threads, thread_name_prefix="hcd-file-read")
            if options.io_threads > 1 else None
        )
        self._writers = (
            ThreadPoolExecutor(2, thread_name_prefix="hcd-file-write") if options.io_threads > 1 else None
        )
        # copies pages into segment files while the writing thread makes the next headers
        self._io = ThreadPoolExecutor(2, thread_name_prefix="hcd-file-io") if options.io_threads > 1 else None
        try:
            self._lock_fd = (
                os.open(self.layout.lock_file, os.O_RDWR)
                if self.writable
                else (os.open(self.layout.lock_file, os.O_RDONLY) if self.layout.lock_file.exists() else -1)
            )
            self._journal = Journal(self.layout.journal, writable=self.writable)
        except OSError as exc:
            raise BackendSetupError(
                f"file backend: cannot open {exc.filename or self.root}: {exc.strerror or exc}"
            ) from None
        with self._lock:
            self._full_scan()
        if self.writable:
            self._clean_stale_tmp()

    # -- logging -----------------------------------------------------------------------------
    def _log_once(self, what: str, msg: str, *args: object) -> None:
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        (log.warning if first else log.debug)(msg, *args)

    # -- the root lock -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _root_lock(self, exclusive: bool) -> Iterator[None]:
        """flock on ROOT/lock: shared to publish, exclusive to evict or compact."""
        with self._fs_lock:
            if self._lock_fd < 0:
                yield
                return
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- discovery ---------------------------------------------------------------------------
    def _full_scan(self) -> None:
        """List every fan-out directory; load new segments, drop vanished ones. Holds _lock."""
        self.stats.rescans += 1
        start = self._journal.size()
        on_disk: dict[str, Path] = {}
        for d in self.layout.fanout_dirs():
            try:
                it = os.scandir(d)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    stem = e.name[: -len(SEGMENT_SUFFIX)] if e.name.endswith(SEGMENT_SUFFIX) else ""
                    if stem and is_segment_name(stem):
                        on_disk[stem] = Path(e.path)
                    else:
                        self._foreign(Path(e.path))
        for name in [n for n in self.catalog.segments if n not in on_disk]:
            self._drop(name)
        for name, path in on_disk.items():
            if name not in self.catalog:
                self._load(name, path)
        self._journal.skip_to_end(start)

    def _foreign(self, path: Path) -> None:
        self.stats.foreign_files += 1
        self._log_once(f"foreign:{path.parent}", "file backend: ignoring foreign file %s in the segment tree", path)
        if self.writable:
            self._move_to_quarantine(path)

    def _load(self, name: str, path: Path | None = None) -> Segment | None:
        """Read a segment's footer into the catalog. Holds _lock."""
        path = path or self.layout.segment_path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.stats.read_failures += 1
            self._log_once(f"open:{exc.errno}", "file backend: cannot open segment %s: %s", path, exc.strerror)
            return None
        try:
            index = read_index(fd)
        except SegmentError as exc:
            os.close(fd)
            self.stats.segments_quarantined += 1
            self._log_once(f"badseg:{exc}", "file backend: segment %s is not valid (%s); quarantined", path, exc)
            if self.writable:
                self._move_to_quarantine(path)
            return None
        except OSError as exc:
            os.close(fd)
            self.stats.read_failures += 1
            self._log_once(f"read:{exc.errno}", "file backend: cannot read segment %s: %s", path, exc.strerror)
            return None
        seg = Segment(name=name, path=path, index=index)
        self.catalog.add(seg)
        self._put_handle(name, fd)
        return seg

    def _drop(self, name: str) -> Segment | None:
        """Forget a segment (removed by someone, or by us). Holds _lock."""
        seg = self.catalog.remove(name)
        self._retire_handle(name)
        return seg

    def _poll(self) -> None:
        """Catch up with other processes' changes: one fstat when nothing changed."""
        with self._lock:
            res = self._journal.poll()
            if res.rescan:
                self._full_scan()
                return
            for op, name in res.records:
                if op is Op.ADD:
                    if name not in self.catalog and is_segment_name(name):
                        self._load(name)
                else:
                    self._drop(name)

    # -- descriptors -------------------------------------------------------------------------
    def _put_handle(self, name: str, fd: int) -> None:
        old = self._handles.pop(name, None)
        if old is not None:
            self._retire(old)
        self._handles[name] = _Handle(fd)
        while len(self._handles) > self.opts.open_files:
            _, h = self._handles.popitem(last=False)
            self._retire(h)

    def _retire(self, h: _Handle) -> None:
        h.retired = True
        if h.refs == 0 and h.fd >= 0:
            os.close(h.fd)
            h.fd = -1

    def _retire_handle(self, name: str) -> None:
        h = self._handles.pop(name, None)
        if h is not None:
            self._retire(h)

    def _acquire(self, seg: Segment) -> _Handle:
        with self._lock:
            h = self._handles.get(seg.name)
            if h is not None:
                self._handles.move_to_end(seg.name)
                h.refs += 1
                return h
        fd = os.open(seg.path, os.O_RDONLY)
        with self._lock:
            h = self._handles.get(seg.name)
            if h is not None:
                os.close(fd)
            else:
                self._put_handle(seg.name, fd)
                h = self._handles[seg.name]
            h.refs += 1
            return h

    def _release(self, h: _Handle) -> None:
        with self._lock:
            h.refs -= 1
            if h.retired and h.refs == 0 and h.fd >= 0:
                os.close(h.fd)
                h.fd = -1

    # -- the contract ------------------------------------------------------------------------
    @hookimpl
    def register_pool(self, registration: PoolRegistration) -> None:
        cap = self.capabilities.pools.get(registration.pool)
        if cap is None or registration.attention not in cap.attention:
            raise ValueError(f"file backend does not hold {registration.attention.value} pool {registration.pool}")
        with self._lock:
            self.registrations[registration.pool] = registration
            self._regions = RegionViews(
                b for reg in self.registrations.values() for b in (*reg.regions, *reg.staging)
            )

    @hookimpl
    def page_set(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        results = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        if not self.writable:
            self._log_once("ro", "file backend: root %s is open read-only; page_set stores nothing", self.root)
            return results
        self._poll()
        groups: dict[str, list[tuple[PoolKind, int, Page]]] = defaultdict(list)
        sizes: dict[str, int] = defaultdict(int)  # bytes of each group's records
        for t in transfers:
            pool = t.pool
            if pool not in self.capabilities.pools:
                self._log_once(f"pool:{pool}", "file backend: unknown pool %r; pages failed", pool)
                continue
            for i, page in enumerate(t.pages):
                key, group = page.key, page.group
                if not page_names_ok(key, group):
                    problem = key_problem(key) or group_problem(group)
                    self._log_once("set:badkey", "file backend: page_set refused a page (and maybe more): %s", problem)
                    continue
                groups[group].append((pool, i, page))
                sizes[group] += HEADER_SIZE + page.nbytes
        if self.opts.dedup:
            for group in [g for g, items in groups.items() if self._all_stored(items)]:
                for pool, i, _page in groups.pop(group):
                    results[pool][i] = PageResult.OK
        batches = []
        for batch, size in self._pack(groups, sizes):
            if self.opts.max_bytes is not None and size > self.opts.max_bytes:
                self._log_once(
                    "set:toobig", "file backend: a group of %d bytes cannot fit max_bytes=%d; pages failed",
                    size, self.opts.max_bytes,
                )
                continue
            batches.append(batch)

        def write(batch: list[tuple[PoolKind, int, Page]]) -> None:
            if time.monotonic() > deadline:
                self._log_once("set:deadline", "file backend: page_set ran past its deadline; pages failed")
            elif self._write(batch):
                for pool, i, _page in batch:
                    results[pool][i] = PageResult.OK

        if self._writers is not None and len(batches) > 1:
            # buffered writes to one file are serialised by its inode lock: two files, two cores
            list(self._writers.map(write, batches))
        else:
            for batch in batches:
                write(batch)
        self._maybe_evict()
        return results

    def _all_stored(self, items: list[tuple[PoolKind, int, Page]]) -> bool:
        keys = self.catalog.keys
        return all(page.key in keys[pool] for pool, _i, page in items)

    def _pack(
        self, groups: Mapping[str, list[tuple[PoolKind, int, Page]]], sizes: Mapping[str, int]
    ) -> Iterator[tuple[list[tuple[PoolKind, int, Page]], int]]:
        """Batches of whole groups with their bytes, each at most ``segment_max_bytes`` (a bigger
        group alone); a call of more than ``2 * _SPLIT_MIN`` bytes is cut in two halves written
        in parallel. ``sizes``: the bytes of each group's records."""
        total = sum(sizes[g] for g in groups)
        limit = self.opts.segment_max_bytes
        if self._writers is not None and total >= 2 * _SPLIT_MIN:
            limit = min(limit, (total + 1) // 2)
        cur: list[tuple[PoolKind, int, Page]] = []
        size = 0
        for g, items in groups.items():
            add = sizes[g]
            if cur and size + add > limit:
                yield cur, size
                cur, size = [], 0
            cur.extend(items)
            size += add
        if cur:
            yield cur, size

    def _write(self, batch: list[tuple[PoolKind, int, Page]]) -> bool:
        with self._lock:
            self._seq += 1
            name = segment_name(self._writer, self._seq)
        try:
            items = [(pool, page) for pool, _i, page in batch]
            ws = write_segment(self.layout, name, items, self.opts.fsync, self._regions.view, self._io)
        except OSError as exc:
            self.stats.write_failures += 1
            self._log_once(
                f"write:{exc.errno}", "file backend: writing a segment under %s failed (%s); %d pages failed, "
                "nothing stored was touched", self.layout.tmp, exc.strerror or exc, len(batch),
            )
            return False
        final = self.layout.segment_path(name)
        try:
            with self._root_lock(exclusive=False):
                os.rename(ws.tmp_path, final)
                self._journal.append(Op.ADD, [name])
            if self.opts.fsync:
                fsync_dir(final.parent)
        except OSError as exc:
            self.stats.write_failures += 1
            self._log_once(f"publish:{exc.errno}", "file backend: publishing %s failed: %s", final, exc.strerror)
            os.close(ws.fd)
            for p in (ws.tmp_path, final):
                with contextlib.suppress(OSError):
                    os.unlink(p)
            return False
        fcntl.flock(ws.fd, fcntl.LOCK_UN)
        self.stats.segments_written += 1
        self.stats.segments_recycled += ws.recycled
        with self._lock:
            self.catalog.add(Segment(name=name, path=final, index=ws.index))
            self._put_handle(name, ws.fd)
        return True

    @hookimpl
    def page_get(self, transfers: Sequence[PageTransfer], deadline: float) -> dict[PoolKind, list[PageResult]]:
        results = {t.pool: [PageResult.MISS] * len(t.pages) for t in transfers}
        self._poll()
        plan: dict[Segment, list[_Item]] = {}  # pages by segment, in call order
        with self._lock:
            for t in transfers:
                pool = t.pool
                keys = self.catalog.keys.get(pool)
                last_seg: Segment | None = None
                last: list[_Item] = []
                for i, page in enumerate(t.pages):
                    key = page.key
                    value = keys.get(key) if keys is not None and isinstance(key, str) else None
                    if value is None:
                        if key_problem(key):
                            results[pool][i] = PageResult.FAILED
                            self._log_once("get:badkey", "file backend: page_get: %s", key_problem(key))
                        continue
                    seg, rec = self.catalog.entry(value)
                    index = seg.index
                    stored = index.lengths[rec]
                    bufs = page.buffers
                    nbytes = bufs[0].nbytes if len(bufs) == 1 else sum(map(_NBYTES, bufs))
                    if stored != nbytes:
                        results[pool][i] = PageResult.CORRUPT
                        self.stats.corrupt_pages += 1
                        self._log_once(
                            "get:len", "file backend: stored page %s has %d bytes, the caller's buffers %d",
                            key, stored, nbytes,
                        )
                        continue
                    if seg is not last_seg:  # a call's pages are mostly in one segment, in order
                        last_seg = seg
                        got = plan.get(seg)
                        last = plan[seg] = [] if got is None else got
                    last.append((index.offsets[rec], stored, pool, i, page))
        for seg, items in plan.items():
            if time.monotonic() > deadline:
                for _off, _n, pool, i, _page in items:
                    results[pool][i] = PageResult.FAILED
                continue
            self._read_segment(seg, items, results)
        return results

    def _read_segment(self, seg: Segment, items: list[_Item], results: dict[PoolKind, list[PageResult]]) -> None:
        try:
            h = self._acquire(seg)
        except FileNotFoundError:  # evicted by another process since our last poll
            with self._lock:
                self._drop(seg.name)
            return
        except OSError as exc:
            self.stats.read_failures += 1
            self._log_once(f"open:{exc.errno}", "file backend: cannot open %s: %s", seg.path, exc.strerror)
            for _off, _n, pool, i, _page in items:
                results[pool][i] = PageResult.FAILED
            return
        bad: list[tuple[PoolKind, int, str]] = []
        try:
            items.sort(key=_item_offset)
            ok = self._read_runs(h.fd, items, _run_bounds(items), results, bad)
            if ok and self.writable:
                with contextlib.suppress(OSError):
                    os.utime(h.fd)  # recency for LRU eviction, seen by every process
            if bad:
                self._on_bad(seg, h.fd, bad, results)
        except OSError as exc:
            self.stats.read_failures += 1
            self._log_once(f"read:{exc.errno}", "file backend: reading %s failed: %s", seg.path, exc.strerror)
            for _off, _n, pool, i, _page in items:
                if results[pool][i] is not PageResult.OK:
                    results[pool][i] = PageResult.FAILED
        finally:
            self._release(h)

    def _read_runs(
        self,
        fd: int,
        items: list[_Item],
        bounds: list[int],
        results: dict[PoolKind, list[PageResult]],
        bad: list[tuple[PoolKind, int, str]],
    ) -> int:
        """Read and check the runs ``items[bounds[j]:bounds[j + 1]]``. A large read of large pages
        is cut into contiguous shares, one per reader thread and one in the calling thread
        (``preadv`` and xxh3 release the GIL); any other read stays in the calling thread, where
        handing work to a thread costs more than it saves (see ``_PARALLEL_MIN_BYTES``)."""
        view = self._regions.view
        n_runs = len(bounds) - 1
        extent = items[-1][0] + HEADER_SIZE + items[-1][1] - items[0][0]  # of the file, items sorted
        if (
            self._readers is None
            or n_runs < 2
            or extent < _PARALLEL_MIN_BYTES
            or extent < _PARALLEL_MIN_PAGE * len(items)
        ):
            return _read_share(fd, items, bounds, view, results, bad)
        k = min(self.opts.io_threads, n_runs)
        cuts = [j * n_runs // k for j in range(k + 1)]
        shares = [bounds[cuts[j] : cuts[j + 1] + 1] for j in range(k)]
        futures = [self._readers.submit(_read_share, fd, items, sh, view, results, bad) for sh in shares[1:]]
        try:
            ok = _read_share(fd, items, shares[0], view, results, bad)
        finally:
            failed = [f.exception() for f in futures]  # every share ends before the fd is released
        for exc in failed:
            if exc is not None:
                raise exc
        return ok + sum(f.result() for f in futures)

    def _on_bad(
        self, seg: Segment, fd: int, bad: list[tuple[PoolKind, int, str]], results: dict[PoolKind, list[PageResult]]
    ) -> None:
        """Failed validation: corruption, or a segment evicted and recycled under us."""
        try:
            same = os.stat(seg.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # removed by another process: the pages are simply gone
            with self._lock:
                self._drop(seg.name)
            return
        for pool, i, _why in bad:
            results[pool][i] = PageResult.CORRUPT
        self.stats.corrupt_pages += len(bad)
        self._log_once(
            f"corrupt:{bad[0][2]}", "file backend: %d page(s) of %s failed validation (%s); never returned, "
            "segment quarantined", len(bad), seg.path, bad[0][2],
        )
        if self.writable:
            self._evict({seg.name}, quarantine=seg.name)
        else:
            with self._lock:
                self._drop(seg.name)

    @hookimpl
    def page_exists(self, queries: Mapping[PoolKind, Sequence[str]]) -> dict[PoolKind, int]:
        self._poll()
        out: dict[PoolKind, int] = {}
        for pool, keys in queries.items():
            stored = self.catalog.keys.get(pool, {})
            n = 0
            for k in keys:
                if k not in stored:
                    break
                n += 1
            out[pool] = n
        return out

    @hookimpl
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._regions = RegionViews()
            for name in list(self._handles):
                self._retire_handle(name)
            self._journal.close()
            for ex in (self._readers, self._writers, self._io):
                if ex is not None:
                    ex.shutdown(wait=False)
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    # -- capacity ----------------------------------------------------------------------------
    def _maybe_evict(self) -> None:
        cap = self.opts.max_bytes
        journal_full = self._journal.records() > self.opts.journal_max_records
        if (cap is None or self.catalog.bytes <= cap) and not journal_full:
            return
        with self._root_lock(exclusive=True):
            self._poll()
            if cap is not None and self.catalog.bytes > cap:
                self._evict_lru(cap)
            if self._journal.records() > self.opts.journal_max_records:
                with self._lock:
                    self._journal.compact()

    def _evict_lru(self, cap: int) -> None:
        """Evict least recently used segments (with every segment sharing a group) down to
        ``evict_to * max_bytes``. Caller holds the exclusive root lock."""
        target = cap * self.opts.evict_to
        with self._lock:
            segs = list(self.catalog.segments.values())
        aged: list[tuple[float, Segment]] = []
        gone: list[str] = []
        for seg in segs:
            try:
                aged.append((os.stat(seg.path).st_mtime, seg))
            except FileNotFoundError:
                gone.append(seg.name)
        with self._lock:
            for name in gone:
                self._drop(name)
            aged.sort(key=lambda a: (a[0], a[1].name))
            victims: set[str] = set()
            freed = 0
            for _mtime, seg in aged:
                if self.catalog.bytes - freed <= target:
                    break
                if seg.name in victims:
                    continue
                for name in self.catalog.closure([seg.name]) - victims:
                    victims.add(name)
                    freed += self.catalog.segments[name].size
        self._remove(victims, quarantine=None)

    def _evict(self, names: set[str], quarantine: str | None) -> None:
        with self._root_lock(exclusive=True):
            with self._lock:
                victims = self.catalog.closure(names)
            self._remove(victims, quarantine)

    def _remove(self, victims: set[str], quarantine: str | None) -> None:
        """Unpublish ``victims`` (rename to free/ for reuse, or unlink; ``quarantine`` to
        quarantine/), then tell the others. Caller holds the exclusive root lock."""
        if not victims:
            return
        try:
            free_now = sum(1 for e in os.scandir(self.layout.free) if e.name.endswith(".free"))
        except OSError:
            free_now = self.opts.recycle_files
        removed: list[str] = []
        for name in sorted(victims):
            with self._lock:
                seg = self._drop(name)
            if seg is None:
                continue
            try:
                if name == quarantine:
                    self.stats.segments_quarantined += 1
                    self._move_to_quarantine(seg.path)
                elif free_now < self.opts.recycle_files:
                    os.rename(seg.path, self.layout.free / f"{name}.free")
                    free_now += 1
                else:
                    os.unlink(seg.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._log_once(f"evict:{exc.errno}", "file backend: cannot remove %s: %s", seg.path, exc.strerror)
                continue
            removed.append(name)
            if name != quarantine:
                self.stats.segments_evicted += 1
                self.stats.pages_evicted += len(seg.index)
        self._journal.append(Op.REMOVE, removed)

    def _move_to_quarantine(self, path: Path) -> None:
        q = self.layout.quarantine
        try:
            os.rename(path, q / f"{int(time.time())}-{path.name}")
            entries = sorted(os.scandir(q), key=lambda e: e.stat().st_mtime)
            for e in entries[: max(0, len(entries) - _QUARANTINE_KEEP)]:
                os.unlink(e.path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._log_once(f"quarantine:{exc.errno}", "file backend: cannot quarantine %s: %s", path, exc)

    # -- housekeeping ------------------------------------------------------------------------
    def _clean_stale_tmp(self) -> None:
        """Recycle temp files left by dead writers (their flock is gone) once they are old."""
        horizon = time.time() - max(600.0, 10 * self.context.timeout_s)
        try:
            entries = list(os.scandir(self.layout.tmp))
        except OSError:
            return
        for e in entries:
            try:
                if e.stat().st_ctime > horizon:
                    continue
                fd = os.open(e.path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                os.unlink(e.path)
            except OSError:
                pass
            finally:
                os.close(fd)

    def usage(self) -> dict[str, int | None]:
        """Current use of the whole root as this process sees it (after catching up)."""
        self._poll()
        free_files = free_bytes = 0
        with contextlib.suppress(OSError), os.scandir(self.layout.free) as it:
            for e in it:
                free_files += 1
                free_bytes += e.stat().st_size
        with self._lock:
            return {
                "bytes": self.catalog.bytes,
                "pages": self.catalog.pages,
                "segments": len(self.catalog.segments),
                "max_bytes": self.opts.max_bytes,
                "free_files": free_files,
                "free_bytes": free_bytes,
                **vars(self.stats),
            }


def _item_offset(item: _Item) -> int:
    return item[0]


def _run_bounds(items: list[_Item]) -> list[int]:
    """Where offset-sorted ``items`` split into runs of adjacent records, each at most
    ``_RUN_MAX_BYTES`` (a larger record alone) and ``4 * IOV_MAX`` buffers: the index of every
    run's first item, then ``len(items)``."""
    bounds: list[int] = []
    next_off = -1
    nbytes = n_iov = 0
    for j, (off, n, _pool, _i, page) in enumerate(items):
        span = HEADER_SIZE + n
        more = 1 + len(page.buffers)
        if off != next_off or nbytes + span > _RUN_MAX_BYTES or n_iov + more > 4 * IOV_MAX:
            bounds.append(j)
            nbytes = n_iov = 0
        nbytes += span
        n_iov += more
        next_off = off + span
    bounds.append(len(items))
    return bounds


def _read_share(
    fd: int,
    items: list[_Item],
    bounds: list[int],
    view: Callable[[Buffer], memoryview],
    results: dict[PoolKind, list[PageResult]],
    bad: list[tuple[PoolKind, int, str]],
) -> int:
    """Each run: one ``preadv`` of the records' headers (into a small buffer) interleaved with
    their payloads (straight into the destination buffers), then every page of the run validated,
    header and xxh3 of the payload, while its bytes are still in the CPU cache. A run's views are
    made just before it is read and dropped after it is checked, so few objects live at a time."""
    ok = 0
    for a, b in itertools.pairwise(bounds):
        run = items[a:b]
        heads = memoryview(bytearray(HEADER_SIZE * (b - a)))
        iov: list[memoryview] = []
        checks: list[tuple[memoryview, Sequence[memoryview]]] = []
        h = 0
        for item in run:
            head = heads[h : h + HEADER_SIZE]
            h += HEADER_SIZE
            iov.append(head)
            bufs = item[4].buffers
            if len(bufs) == 1:
                v = view(bufs[0])
                iov.append(v)
                checks.append((head, (v,)))
            else:
                pv = list(map(view, bufs))
                iov.extend(pv)
                checks.append((head, pv))
        start = run[0][0]
        end = start + preadv_all(fd, iov, start)
        for (off, n, pool, i, page), (head, pv) in zip(run, checks, strict=True):
            if off + HEADER_SIZE + n > end:
                bad.append((pool, i, "truncated segment"))
                continue
            try:
                verify_payload(parse_header(head, page.key, page.namespace, pool), pv, n)
            except PageFormatError as exc:
                bad.append((pool, i, str(exc)))
                continue
            if page.header is not None:
                page.header.view()[:] = head
            results[pool][i] = PageResult.OK
            ok += 1
    return ok


__all__ = ["FileBackend", "FileOptions", "FileStats", "claim_file"]
