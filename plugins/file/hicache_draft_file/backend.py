"""The ``file`` storage backend: pages packed into immutable segment files under one root.

Why segments: the obvious design (one file per page, temp file + rename) pays several syscalls
and a file creation per page, so it writes 64 KiB pages at about 1 GB/s. Here one ``page_set``
call becomes one file (one create or recycle, one ``pwritev`` straight from the page buffers, one
rename), and one ``page_get`` reads each run of adjacent records with one ``preadv`` straight into
the destination buffers. Existence is a dict lookup in an in-memory index that is rebuilt at
start-up from one footer per segment and kept current across processes by a shared journal.

One call uses the machine's cores (``io_threads``, default ``os.cpu_count()``): a large read is cut
into contiguous shares of its runs, a large write into one segment per worker (buffered writes to
one file are serialised by the kernel), each share done by a thread of the pool or the calling
thread; ``preadv``/``pwritev`` release the GIL. Every share checks the deadline before each run
(or write call), and the call returns only when every share has ended. Reads check each record's
header (magic, its checksum, key, namespace, pool, length) and tell the core which pages are
final (``finished``), so it verifies payloads while the rest is read; the payload checksum is the
core's alone, and a page it rejects (``page_rejected``) gets its segment quarantined. A segment
that left ``seg/`` while it was read (evicted, its file maybe recycled) yields misses.


Who owns what, under which lock (one process; locks taken in this order, never the reverse):

* ``_fs_lock`` then the flock on ``ROOT/lock`` (the root lock): shared to publish a call's segments
  (renames into ``seg/`` plus one journal append for them all), exclusive to evict, quarantine or
  compact the journal.
* ``_lock``: the catalog, the segment descriptors (``_handles``: reference counted, closed only
  when retired and unused) and the journal reading position.
* the journal's own lock: its descriptor, used only under it (see journal.py for how appends always
  reach the current journal and how a reader detects compaction, replacement and truncation by
  inode and by re-reading the record before its offset, then rescans the directory).

Eviction is crash-safe by groups: under the exclusive lock the evictor writes the victim set (the
closure of its groups, so target and draft pages go together even from different segments) to
``ROOT/evict.intent``, appends all their "removed" records in one write (live readers drop them
together, and drop every segment sharing a group with a removed one), then removes the files and
the intent. A directory scan skips the segments an intent names, and whoever next holds the
exclusive lock (or opens the root) finishes an intent left by a process that died.

Every file operation goes through descriptors of the root without following links (rootfs.py):
nothing a link, hard link or swapped directory inside the root points at is read, written, moved
or deleted.

See naming.py (root layout), segment_format.py (bytes on disk), journal.py (cross-process
notices), catalog.py (the index) and README for the promises.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import itertools
import logging
import operator
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import xxhash

from hicache_draft import (
    HEADER_SIZE,
    Attention,
    BackendContext,
    BackendSetupError,
    Buffer,
    Capabilities,
    Component,
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
    read_into,
)
from hicache_draft_file.catalog import _REC_BITS, _REC_MASK, Catalog, Segment
from hicache_draft_file.journal import Journal, JournalUnavailable, Op, is_leftover
from hicache_draft_file.naming import (
    FANOUT,
    INTENT_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    SEGMENT_SUFFIX,
    RootLayout,
    all_names_ok,
    fanout_dir,
    group_problem,
    is_segment_name,
    key_problem,
    new_writer_id,
    page_names_ok,
    segment_name,
)
from hicache_draft_file.options import FileOptions
from hicache_draft_file.root_setup import prepare_root
from hicache_draft_file.rootfs import RootDirs, UnsafeEntry, ident, pid_alive
from hicache_draft_file.segment_format import SegmentError, read_index, storable_pool
from hicache_draft_file.segment_writer import (
    SegmentFile,
    WrittenSegment,
    claim_file,
    discard_file,
    open_segment_file,
    seal_segment,
    write_footer,
    write_segment,
)
from hicache_draft_file.spares import SpareFiles
from hicache_draft_file.vectored_io import WRITE_CHUNK, memory_filesystem

log = logging.getLogger("hicache_draft_file")

# One preadv reads at most this much (a larger record alone), then its pages' headers are checked
# and the core is told they are final (``finished``), so it verifies them while the rest is read:
# a run this small is still in the CPU cache when the core's xxh3 reads it.
_RUN_MAX_BYTES = 1 << 20
_RUN_MAX_BUFFERS = 4096  # headers and page buffers of one run (read_into splits them into IOV_MAX calls)
# With the core's ``read_runs`` a call too small to give each worker a run of _RUN_MAX_BYTES is cut
# into runs of its bytes over the workers, down to this, so that every worker reads and verifies.
_RUN_MIN_BYTES = 256 << 10
# A call's reads are shared by several threads only with at least this much per thread (see
# README: smaller shares cost more in GIL hand-overs than the overlap saves).
_SHARE_MIN_BYTES = 4 << 20
_SHARE_MIN_RECORD = 256 << 10
# With the core's ``read_records`` a run costs one Python call whatever its records' size (the read
# and the verification release the GIL), so a call's runs are shared by threads down to this much each.
_SHARE_MIN_VERIFIED = 2 << 20  # H200 host, 64 KiB pages: 1.74-1.91x the baseline at 2 MiB, 1.61-1.81 at 0.5-1
# Pages read are announced to the core (``finished``) after every run: the core verifies them in
# this thread right away, while the run (at most _RUN_MAX_BYTES) is still in this core's cache.
_FINISH_BYTES = 1
_INTENT_MAGIC = "hicache-draft-file evict 1"
# a group's pools are written by calls that follow one another: a half group younger than this
# is evicted after every other candidate (deferred, never protected: it still goes when needed)
_PAIR_WINDOW_S = 10.0
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_TMP_RE = re.compile(r"([0-9a-f]{16}-[0-9a-f]{8})\.(\d+)\.tmp|(intent)\.(\d+)\.[0-9a-f]+")
_NBYTES = operator.attrgetter("nbytes")
# A call's writes go to k segment files side by side (the kernel serialises buffered writes to one
# file), k at most the I/O threads, each file of at least _SPLIT_MIN bytes, or _SPLIT_MIN_FEW with
# fewer than _SPLIT_CORES threads (each writer's Python work and the Store's hand-over need a core
# beside the ones writing). H100 host, 128 x 64 KiB behind a Store (os.sync before each call, medians
# of 16): 1 file 4.52 ms, 2 files 3.48, 4 files 3.84, 8 files 6.39 (creating the files in tmp/ and
# the root lock contend); 128 x 1 MiB in 8 or 16 files within noise (10.7-11.6 ms); 1 GiB calls
# (bench pipeline) 25.5 GB/s in 16 files, 19.1 in 8. 2-core VM, 128 x 64 KiB: 2 files behind a Store
# were slower (2.39x -> 2.08x the one-file-per-page baseline) though faster on the bare hook.
# Since each call's files are claimed after the call before (spares.py) and published together,
# 4 files beat 2 (H100 host, 128 x 64 KiB, same-run ratios to the baseline over four pairs of runs:
# 2 MiB per file 1.96-2.16x, 4 MiB 1.84-1.99x, 1 MiB 1.84-1.85x; 128 x 1 MiB within noise).
_SPLIT_MIN = 2 << 20
_SPLIT_MIN_FEW = 16 << 20
_SPLIT_CORES = 4
_OK = PageResult.OK
_FAILED = PageResult.FAILED

_POOL_CAP = PoolCapability(
    attention=frozenset({Attention.MHA, Attention.MLA}),
    components=frozenset(Component),  # a record is any bytes under its key: every pool of any name
    zero_copy_layouts=frozenset(Layout),
    generic=True,
    max_buffers_per_page=None,
)


# A page to read: (record offset in its segment, payload bytes, pool, index in the call, page).
_Item = tuple[int, int, str, int, Page]
_Finished = Callable[[str, Iterable[int]], None]
_ReadRecords = Callable[[int, int, Sequence[tuple[str, int]]], int]
_ReadRuns = Callable[[Sequence[tuple[int, int, Sequence[tuple[str, int]]]], int], list[int | OSError | None]]
_WriteRecords = Callable[[int, int, Sequence[tuple[str, int]], int], int]
_WriteRuns = Callable[..., list[int | OSError]]


def _not_told(pool: str, indices: Iterable[int]) -> None:
    """``finished`` of a caller that does not want to hear (a direct hook call)."""


@dataclass(eq=False)
class _SegRead:
    """One segment's part of a ``page_get``: its descriptor and what its readers found. Reader
    threads only append to ``bad`` and set flags (atomic under the GIL); the calling thread reads
    them after every reader has finished."""

    seg: Segment
    handle: _Handle
    items: list[_Item]
    bad: list[tuple[str, int, str]] = field(default_factory=list)
    any_ok: bool = False
    error: OSError | None = None


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
    unsafe_entries: int = 0
    intents_replayed: int = 0
    no_space_evictions: int = 0
    tmp_reclaimed: int = 0


class FileBackend(StorageBackend):
    """Embedded default backend: a directory on a local or shared POSIX filesystem."""

    api_version: ClassVar[int] = 2
    capabilities: ClassVar[Capabilities] = Capabilities(
        pools={PoolKind.KV: _POOL_CAP, PoolKind.DRAFT: _POOL_CAP},
        split_heads=True,
        persistent=True,
        shared=True,
        writes_records=True,
    )
    Options: ClassVar[type[FileOptions]] = FileOptions
    default: ClassVar[bool] = True  # the backend used when a config names none

    @classmethod
    def scratch_options(cls, directory: Path) -> dict[str, object]:
        return {"root": str(directory)}

    def __init__(self, options: FileOptions, context: BackendContext) -> None:
        super().__init__(options, context)
        self.opts = options
        self.dirs: RootDirs = prepare_root(options.root, create=options.create_root, read_only=options.read_only)
        self.layout: RootLayout = self.dirs.layout
        # segments are written in tmp/: preallocated, except in memory (tmpfs: it only zeroes pages)
        self.memory_fs = memory_filesystem(self.dirs.tmp) if self.dirs.writable else None
        self._prealloc = self.memory_fs is None
        self.root = self.layout.root
        self._seg_dir = self.layout.seg  # made once: a restart builds one Segment per file
        self.writable = not options.read_only
        self.stats = FileStats()
        self.catalog = Catalog()
        self.registrations: dict[str, PoolRegistration] = {}
        self._lock = threading.RLock()  # catalog, handles, journal offset
        self._fs_lock = threading.Lock()  # serialises this process's use of the root flock
        self._handles: OrderedDict[str, _Handle] = OrderedDict()
        self._logged: set[str] = set()
        self._writer = new_writer_id()
        self._seq = 0
        self._closed = False
        self.workers = options.workers()
        # the threads that take a share of a call's reads or writes, next to the calling thread
        self._pool = self._new_pool()
        # files for the next call's segments, claimed by an I/O thread after each call (spares.py)
        self.spares: SpareFiles | None = (
            SpareFiles(self.dirs, self._next_name, self._submit, self.workers, context.timeout_s, self._prealloc,
                       options.prefault_spares)
            if self.writable and self._pool is not None else None
        )
        try:
            self._lock_fd = self._open_lock()
            self._journal = Journal(self.dirs.root_fd, JOURNAL_FILE, writable=self.writable)
        except OSError as exc:
            self.dirs.close()
            raise BackendSetupError(
                f"file backend: cannot open {exc.filename or self.root}: {exc.strerror or exc}"
            ) from None
        if self.writable:
            self._recover()
        with self._lock:
            self._full_scan()
        _LIVE.add(self)  # from here a fork gives the child threads, locks and names of its own

    def _new_pool(self) -> ThreadPoolExecutor | None:
        if self.workers <= 1:
            return None
        return ThreadPoolExecutor(self.workers - 1, thread_name_prefix="hcd-file-io")

    def _submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run ``fn`` on an I/O thread (``RuntimeError`` once the backend is closing)."""
        if self._pool is None:
            raise RuntimeError("file backend: no I/O threads")
        return self._pool.submit(fn)

    def _after_fork_in_child(self) -> None:
        """A forked child has none of its parent's threads: the executor copied with the fork would
        queue its shares forever, a lock some other thread held at the fork stays held, and the
        parent goes on naming segments with its writer id. Its copy of ROOT/lock's descriptor
        shares the parent's flock (one open file description): the child's shared lock and unlock
        would turn the parent's exclusive lock into a shared one and then release it, so the child
        opens the file again and locks on its own."""
        self._lock = threading.RLock()
        self._fs_lock = threading.Lock()
        # segment names are <writer>-<seq>: the parent goes on with its own, so the child takes a new
        # writer id (the same names would have a later publish rename over the other's segment)
        self._writer, self._seq = new_writer_id(), 0
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # the child's copy only: the parent's lock stays
            self._lock_fd = -1
            try:
                self._lock_fd = self._open_lock()
            except (OSError, UnsafeEntry) as exc:
                self.writable = False  # never publish without the root lock
                log.error("file backend: a forked child could not open %s (%s); it stores nothing",
                          self.layout.lock_file, exc)
        self._journal.after_fork_in_child()
        if self.spares is not None:
            self.spares.after_fork_in_child()
        if self._pool is not None and not self._closed:
            self._pool = self._new_pool()

    def _open_lock(self) -> int:
        """ROOT/lock, never through a link (one in its place is quarantined and replaced)."""
        flags = os.O_RDWR | os.O_CREAT if self.writable else os.O_RDONLY
        for _attempt in range(3):
            try:
                fd, _st = self.dirs.open_file(self.dirs.root_fd, LOCK_FILE, flags, single=False)
                return fd
            except UnsafeEntry as exc:
                self.dirs.unsafe_entry(self.dirs.root_fd, LOCK_FILE, self.layout.lock_file, exc)
                if not self.writable:
                    return -1
            except FileNotFoundError:
                if not self.writable:
                    return -1
                raise
        raise OSError(errno.ELOOP, "keeps being replaced", str(self.layout.lock_file))

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
        """List every fan-out directory; load new segments, drop vanished ones and those an
        eviction in progress removes. Holds _lock. The garbage collector is paused meanwhile: a
        restart makes a few objects per segment, and with 6,250 segments the collections it
        triggered walked the growing index again and again (a third of the scan's time)."""
        was = gc.isenabled()
        gc.disable()
        try:
            self._scan_all()
        finally:
            if was:
                gc.enable()

    def _scan_all(self) -> None:
        self.stats.rescans += 1
        self.dirs.recheck()
        mark = self._journal.mark()
        evicting = self._read_intent()
        on_disk: set[str] = set()
        for i in range(FANOUT):
            d = f"{i:02x}"
            with self.dirs.fan(d, create=False) as fd:
                if fd < 0:
                    continue
                try:
                    it = os.scandir(fd)
                except OSError:
                    continue
                new: list[str] = []
                with it:
                    for e in it:
                        name = e.name
                        stem = name[: -len(SEGMENT_SUFFIX)] if name.endswith(SEGMENT_SUFFIX) else ""
                        if stem and is_segment_name(stem) and e.is_file(follow_symlinks=False):
                            if stem in evicting:
                                continue
                            on_disk.add(stem)
                            if stem not in self.catalog:
                                new.append(stem)
                        else:
                            self._foreign(fd, name, self.layout.seg / d / name)
                for stem in new:
                    self._load(stem, fd)
        for name in [n for n in self.catalog.segments if n not in on_disk]:
            self._drop(name)
        self._journal.resume(mark)
        self.stats.unsafe_entries = self.dirs.unsafe

    def _foreign(self, dir_fd: int, name: str, shown: Path) -> None:
        self.stats.foreign_files += 1
        self._log_once(f"foreign:{shown.parent}", "file backend: ignoring foreign entry %s in the segment tree", shown)
        if self.writable:
            self.dirs.quarantine(dir_fd, name)

    def _load(self, name: str, dir_fd: int | None = None) -> Segment | None:
        """Read a segment's footer into the catalog. Holds _lock."""
        if dir_fd is None:
            with self.dirs.fan(fanout_dir(name), create=False) as fd:
                return self._load(name, fd) if fd >= 0 else None
        fname = name + SEGMENT_SUFFIX
        try:
            fd, st = self.dirs.open_file(dir_fd, fname, os.O_RDONLY, single=True)
        except FileNotFoundError:
            return None
        except UnsafeEntry as exc:  # a link, or a hard link to a file that may live elsewhere
            self.dirs.unsafe_entry(dir_fd, fname, self.layout.segment_path(name), exc)
            self.stats.unsafe_entries = self.dirs.unsafe
            return None
        except OSError as exc:
            self.stats.read_failures += 1
            self._log_once(f"open:{exc.errno}", "file backend: cannot open segment %s: %s",
                           self.layout.segment_path(name), exc.strerror)
            return None
        try:
            index = read_index(fd, st.st_size)
        except SegmentError as exc:
            os.close(fd)
            self.stats.segments_quarantined += 1
            self._log_once(f"badseg:{exc}", "file backend: segment %s is not valid (%s); quarantined",
                           self.layout.segment_path(name), exc)
            if self.writable:
                self.dirs.quarantine(dir_fd, fname)
            return None
        except OSError as exc:
            os.close(fd)
            self.stats.read_failures += 1
            self._log_once(f"read:{exc.errno}", "file backend: cannot read segment %s: %s",
                           self.layout.segment_path(name), exc.strerror)
            return None
        seg = Segment(name=name, seg_dir=self._seg_dir, index=index, ident=ident(st))
        self.catalog.add(seg)
        if len(self._handles) < self.opts.open_files:
            self._put_handle(name, fd)
        else:  # a restart loading thousands: no churn through the descriptor cache
            os.close(fd)
        return seg


    def _drop(self, name: str) -> Segment | None:
        """Forget a segment (removed by someone, or by us). Holds _lock."""
        seg = self.catalog.remove(name)
        self._retire_handle(name)
        return seg

    def _poll(self) -> None:
        """Catch up with other processes' changes: one lstat and one pread when nothing changed.
        A removed segment takes every segment sharing a group with it (an evictor removes whole
        groups; a reader never keeps half of one, even while it has read only part of a batch)."""
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
                    for victim in self.catalog.closure([name]):
                        self._drop(victim)

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

    def _open_segment(self, seg: Segment) -> int:
        """A new descriptor of ``seg``'s file; FileNotFoundError when the name no longer holds the
        file that was loaded (evicted, or replaced by anything, a link included)."""
        with self.dirs.fan(fanout_dir(seg.name), create=False) as d:
            try:
                fd, st = self.dirs.open_file(d, seg.name + SEGMENT_SUFFIX, os.O_RDONLY, single=True)
            except UnsafeEntry:
                raise FileNotFoundError(errno.ENOENT, "replaced", str(seg.path)) from None
        if ident(st) != seg.ident:
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "replaced", str(seg.path))
        return fd

    def _acquire(self, seg: Segment) -> _Handle:
        with self._lock:
            h = self._handles.get(seg.name)
            if h is not None:
                self._handles.move_to_end(seg.name)
                h.refs += 1
                return h
        fd = self._open_segment(seg)
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
        self.check_registration(registration)
        if not storable_pool(registration.pool):
            raise ValueError(f"file backend cannot name pool {registration.pool!r} in its segments")
        with self._lock:
            self.registrations[registration.pool] = registration

    # The hooks take every argument without a default (pluggy before 1.6 never passes one that has
    # a default); page_set and page_get below are the same calls for direct use, the extras optional.
    @hookimpl(specname="page_set")
    def _page_set_hook(
        self, transfers: Sequence[PageTransfer], deadline: float, write_records: _WriteRecords | None,
        write_runs: _WriteRuns | None,
    ) -> dict[str, list[PageResult]]:
        return self.page_set(transfers, deadline, write_records, write_runs)

    @hookimpl(specname="page_get")
    def _page_get_hook(
        self, transfers: Sequence[PageTransfer], deadline: float, finished: _Finished | None,
        read_records: _ReadRecords | None, read_runs: _ReadRuns | None,
    ) -> dict[str, list[PageResult]]:
        return self.page_get(transfers, deadline, finished, read_records, read_runs)

    def page_set(
        self, transfers: Sequence[PageTransfer], deadline: float, write_records: _WriteRecords | None = None,
        write_runs: _WriteRuns | None = None,
    ) -> dict[str, list[PageResult]]:
        results = {t.pool: [PageResult.FAILED] * len(t.pages) for t in transfers}
        if not self.writable:
            self._log_once("ro", "file backend: root %s is open read-only; page_set stores nothing", self.root)
            return results
        self._poll()
        groups: dict[str, list[tuple[str, int, Page]]] = {}
        sizes: dict[str, int] = {}  # bytes of each group's records
        unstored: set[str] = set()  # groups with a page of the call not stored yet (dedup)
        dedup = self.opts.dedup
        for t in transfers:
            pool = t.pool
            if not storable_pool(pool):
                self._log_once(f"pool:{pool}", "file backend: pool name %r cannot be stored; pages failed", pool)
                continue
            pages = t.pages
            checked = all_names_ok([p.key for p in pages], [p.group for p in pages])  # all at once
            have = self.catalog.keys.get(pool, {})  # read without the lock: dedup is a hint
            # one plain loop per page (grouping, sizes and dedup together: 51 us for 128 pages on the
            # VM, 71 us as a grouping loop and a dedup loop over the groups)
            for i, page in enumerate(pages):
                group = page.group
                if not checked and not page_names_ok(page.key, group):
                    problem = key_problem(page.key) or group_problem(group)
                    self._log_once("set:badkey", "file backend: page_set refused a page (and maybe more): %s", problem)
                    continue
                n = HEADER_SIZE + page.nbytes
                items = groups.get(group)
                if items is None:
                    groups[group] = [(pool, i, page)]
                    sizes[group] = n
                else:
                    items.append((pool, i, page))
                    sizes[group] += n
                if dedup and page.key not in have:
                    unstored.add(group)
        if dedup:
            for group in [g for g in groups if g not in unstored]:  # every page of it is stored already
                for pool, i, _page in groups.pop(group):
                    results[pool][i] = _OK
        batches = []
        for batch, size in self._pack(groups, sizes):
            if self.opts.max_bytes is not None and size > self.opts.max_bytes:
                self._log_once(
                    "set:toobig", "file backend: a group of %d bytes cannot fit max_bytes=%d; pages failed",
                    size, self.opts.max_bytes,
                )
                continue
            batches.append((batch, size))

        written: list[tuple[WrittenSegment, list[tuple[str, int, Page]]]] = []  # list.append: thread-safe

        def write(share: list[tuple[list[tuple[str, int, Page]], int]]) -> None:
            for batch, size in share:
                if time.monotonic() > deadline:
                    self._log_once("set:deadline", "file backend: page_set ran past its deadline; pages failed")
                elif (ws := self._write(batch, size, deadline, write_records)) is not None:
                    written.append((ws, batch))

        if write_runs is not None and write_records is not None and not self.opts.fsync and batches:
            written = self._write_runs(batches, deadline, write_runs, write_records)
        else:
            # buffered writes to one file are serialised by its inode lock: one segment per thread
            self._spread(write, batches, [size for _b, size in batches], 1)
        published = self._publish(written)  # this call's segments: never evicted by its own eviction
        for batch in published.values():
            for pool, i, _page in batch:
                results[pool][i] = _OK
        self._maybe_evict(set(published))
        if self.spares is not None and batches:
            with self._lock:
                made = [seg.index for n in published if (seg := self.catalog.segments.get(n)) is not None]
            self.spares.refill(len(batches), max((i.size for i in made), default=0),
                               min((i.data_end for i in made), default=0))
        return results

    def _spread(self, fn: Callable[[list], None], work: list, weights: Sequence[int], share_min: int) -> None:
        """Run ``fn`` over contiguous shares of ``work`` of about equal ``weights``: one share in
        the calling thread, the others on the worker pool, at most ``self.workers`` shares and none
        lighter than ``share_min`` (one share: all in the calling thread). Returns only when every
        share has ended (so no thread touches the call's buffers after the call), then raises the
        first exception a share raised."""
        total = sum(weights)
        k = min(self.workers, len(work), max(1, total // max(1, share_min)))
        if k <= 1 or self._pool is None:
            fn(work)
            return
        cuts = [0]
        acc = 0
        for j, w in enumerate(weights):
            acc += w
            if acc * k >= total * len(cuts) and len(cuts) < k:
                cuts.append(j + 1)
        cuts.append(len(work))
        shares = [work[a:b] for a, b in itertools.pairwise(cuts) if b > a]
        futures: list[Future[None]] = []
        inline = [shares[0]]
        for sh in shares[1:]:
            try:
                futures.append(self._pool.submit(fn, sh))
            except RuntimeError:  # the pool is shut down (the backend is closing): do it here
                inline.append(sh)
        try:
            for sh in inline:
                fn(sh)
        finally:
            wait_all(futures)
        for f in futures:
            if (exc := f.exception()) is not None:
                raise exc

    def split_parts(self, total: int) -> int:
        """Into how many segments of about equal size a call of ``total`` record bytes is cut to be
        written side by side (1: not cut; ``segment_max_bytes`` may still cut it)."""
        split_min = _SPLIT_MIN if self.workers >= _SPLIT_CORES else _SPLIT_MIN_FEW
        return max(1, min(self.workers, total // split_min))

    def _pack(
        self, groups: Mapping[str, list[tuple[str, int, Page]]], sizes: Mapping[str, int]
    ) -> Iterator[tuple[list[tuple[str, int, Page]], int]]:
        """Batches of whole groups with their bytes, each at most ``segment_max_bytes`` (a bigger
        group alone); a call of ``k * _SPLIT_MIN`` bytes or more (``_SPLIT_MIN_FEW`` with fewer
        than ``_SPLIT_CORES`` workers) is cut into ``k`` segments of about equal size (``k`` at
        most the worker count), written side by side. ``sizes``: the bytes of each group's records."""
        total = sum(sizes[g] for g in groups)
        limit = self.opts.segment_max_bytes
        parts = self.split_parts(total)
        if parts > 1:
            limit = min(limit, -(-total // parts))
        cur: list[tuple[str, int, Page]] = []
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

    def _write(
        self, batch: list[tuple[str, int, Page]], size: int, deadline: float,
        write_records: _WriteRecords | None = None,
    ) -> WrittenSegment | None:
        """Write one segment in ``tmp/`` (published by :meth:`_publish`). A full filesystem
        (ENOSPC, EDQUOT) with eviction on is capacity pressure: evict least recently used groups
        (none of this call's: they are not published yet), then retry once."""
        for attempt in (0, 1):
            try:
                return self._write_once(batch, size, deadline, write_records)
            except OSError as exc:
                if attempt == 0 and exc.errno in _NO_SPACE and self.opts.max_bytes is not None:
                    self._make_room(size, set())
                    continue
                self._write_failed(exc, len(batch))
                return None
        return None

    def _write_failed(self, exc: OSError, pages: int) -> None:
        with self._lock:
            self.stats.write_failures += 1
        self._log_once(
            f"write:{exc.errno}", "file backend: writing a segment under %s failed (%s); %d pages failed, "
            "nothing stored was touched", self.layout.tmp, exc.strerror or exc, pages,
        )

    def _next_name(self) -> str:
        """A new segment name of this writer."""
        with self._lock:
            self._seq += 1
            return segment_name(self._writer, self._seq)

    def _write_runs(
        self, batches: list[tuple[list[tuple[str, int, Page]], int]], deadline: float, write_runs: _WriteRuns,
        write_records: _WriteRecords,
    ) -> list[tuple[WrittenSegment, list[tuple[str, int, Page]]]]:
        """Write the call's segments through the core's ``write_runs``: every segment's records on
        the core's compiled threads at once, while this thread makes and writes the footers (on
        the H100 host, Python writer threads started 0.2 ms apart, each waiting for the GIL). A
        segment whose file cannot be opened, or whose write fails, goes again alone through
        :meth:`_write` (a full filesystem with eviction on: room is made first), once."""
        files: list[tuple[SegmentFile, list[tuple[str, int, Page]], int]] = []
        again: list[tuple[list[tuple[str, int, Page]], int]] = []
        for batch, size in batches:
            try:
                files.append((self._open_file(size), batch, size))
            except OSError:
                again.append((batch, size))
        failed: dict[int, OSError] = {}  # by position in files: the footer's write failed

        def footers() -> None:
            for k, (f, batch, _size) in enumerate(files):
                try:
                    write_footer(f, [(pool, page) for pool, _i, page in batch])
                except OSError as exc:
                    failed[k] = exc

        runs = [(f.fd, 0, [(pool, i) for pool, i, _page in batch]) for f, batch, _size in files]
        try:
            results = write_runs(runs, self.workers, WRITE_CHUNK, footers)
        except BaseException:
            for f, _batch, _size in files:
                discard_file(self.dirs, f)
            raise
        written: list[tuple[WrittenSegment, list[tuple[str, int, Page]]]] = []
        for k, ((f, batch, size), got) in enumerate(zip(files, results, strict=True)):
            exc = got if isinstance(got, OSError) else failed.get(k)
            if exc is None and not isinstance(got, OSError):
                try:
                    written.append((seal_segment(self.dirs, f, got, False), batch))
                    continue
                except OSError as sealing:
                    exc = sealing
            assert exc is not None
            discard_file(self.dirs, f)
            if isinstance(exc, TimeoutError):
                self._log_once("set:deadline", "file backend: page_set ran past its deadline; pages failed")
            elif exc.errno in _NO_SPACE and self.opts.max_bytes is not None:
                again.append((batch, size))
            else:
                self._write_failed(exc, len(batch))
        for batch, size in again:
            if time.monotonic() > deadline:
                self._log_once("set:deadline", "file backend: page_set ran past its deadline; pages failed")
            elif (ws := self._write(batch, size, deadline, write_records)) is not None:
                written.append((ws, batch))
        return written

    def _spare(self) -> tuple[str, SegmentFile | None]:
        """A name and file for the next segment: a spare claimed before the call, or a new name
        (its file is claimed when written)."""
        spare = self.spares.take() if self.spares is not None else None
        return (self._next_name(), None) if spare is None else (spare.name, spare)

    def _open_file(self, size: int) -> SegmentFile:
        name, spare = self._spare()
        return open_segment_file(self.dirs, name, size, self._prealloc, spare)

    def _write_once(
        self, batch: list[tuple[str, int, Page]], size: int, deadline: float, write_records: _WriteRecords | None = None
    ) -> WrittenSegment:
        name, claimed = self._spare()
        items = [(pool, page) for pool, _i, page in batch]
        core = None
        if write_records is not None and all(page.header is not None for _pool, _i, page in batch):
            refs = [(pool, i) for pool, i, _page in batch]  # the core writes the records, headers made as they go

            def core(fd: int, chunk: int) -> int:
                return write_records(fd, 0, refs, chunk)

        return write_segment(self.dirs, name, items, self.opts.fsync, deadline=deadline, records=core,
                             prealloc=self._prealloc, claimed=claimed, data_end=size)

    def _publish(
        self, written: list[tuple[WrittenSegment, list[tuple[str, int, Page]]]]
    ) -> dict[str, list[tuple[str, int, Page]]]:
        """Publish a call's written segments together: renamed into ``seg/`` under one hold of the
        shared root lock and announced in one journal append (a publish per segment took the lock
        and appended once each, one writer after the other). Returns the published ones by name
        with their pages. A segment whose rename fails is dropped alone; a journal append that
        fails takes them all back to ``tmp/`` (no notice, no acknowledgement: a peer would never
        see them), and a full filesystem with eviction on then makes room and tries once more."""
        out: dict[str, list[tuple[str, int, Page]]] = {}
        for attempt in (0, 1):
            if not written:
                return out
            dropped: set[str] = set()  # discarded after a failed rename: closed, never touched again
            try:
                moved = self._publish_once([ws for ws, _batch in written], dropped)
            except OSError as exc:
                written = [(ws, batch) for ws, batch in written if ws.name not in dropped]
                if attempt == 0 and exc.errno in _NO_SPACE and self.opts.max_bytes is not None:
                    self._make_room(sum(ws.index.size for ws, _b in written), set())
                    continue
                for ws, batch in written:
                    self._discard(ws)
                    self._write_failed(exc, len(batch))
                return out
            done = [(ws, batch) for ws, batch in written if ws.name in moved]
            for ws, _batch in done:
                fcntl.flock(ws.fd, fcntl.LOCK_UN)
            with self._lock:  # once for the call's segments
                for ws, batch in done:
                    self.stats.segments_written += 1
                    self.stats.segments_recycled += ws.recycled
                    self.catalog.add(Segment(name=ws.name, seg_dir=self._seg_dir, index=ws.index, ident=ws.ident))
                    self._put_handle(ws.name, ws.fd)
                    out[ws.name] = batch
            return out
        return out

    def _publish_once(self, segments: list[WrittenSegment], dropped: set[str]) -> set[str]:
        """Rename ``segments`` into ``seg/`` and append their journal record, under the shared
        root lock. Returns the names renamed; a failed rename discards its segment and adds its
        name to ``dropped``. Raises the append's OSError once every renamed one is back in
        ``tmp/`` (or gone)."""
        moved: list[WrittenSegment] = []
        with self._root_lock(exclusive=False):
            for ws in segments:
                fname = ws.name + SEGMENT_SUFFIX
                try:
                    with self.dirs.fan(fanout_dir(ws.name)) as d:
                        os.rename(ws.tmp_name, fname, src_dir_fd=self.dirs.tmp, dst_dir_fd=d)
                        try:
                            if self.opts.fsync:
                                os.fsync(d)
                        except OSError:
                            os.unlink(fname, dir_fd=d)  # not durable, so never acknowledged
                            raise
                except OSError as exc:
                    self._discard(ws)
                    dropped.add(ws.name)
                    self._write_failed(exc, len(ws.index))
                    continue
                moved.append(ws)
            try:
                # under the shared lock no one compacts: the record lands in the journal every
                # live reader reads (append checks the inode and follows a compaction)
                self._journal.append(Op.ADD, [ws.name for ws in moved])
            except JournalUnavailable as exc:
                # readers without a journal list the directory once a second: still found
                self._log_once("journal:gone", "file backend: %s; other processes find new segments "
                               "by listing the directory", exc.strerror)
            except OSError:
                for ws in moved:
                    self._unpublish(ws)
                raise
        return {ws.name for ws in moved}

    def _unpublish(self, ws: WrittenSegment) -> None:
        """Take a renamed segment back to ``tmp/`` (its write can be published again)."""
        with self.dirs.fan(fanout_dir(ws.name)) as d:
            try:
                os.rename(ws.name + SEGMENT_SUFFIX, ws.tmp_name, src_dir_fd=d, dst_dir_fd=self.dirs.tmp)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(ws.name + SEGMENT_SUFFIX, dir_fd=d)

    def _discard(self, ws: WrittenSegment) -> None:
        """Drop a written, unpublished segment: its file in ``tmp/`` and its descriptor."""
        discard_file(self.dirs, ws)

    def page_get(
        self,
        transfers: Sequence[PageTransfer],
        deadline: float,
        finished: _Finished | None = None,
        read_records: _ReadRecords | None = None,
        read_runs: _ReadRuns | None = None,
    ) -> dict[str, list[PageResult]]:
        results = {t.pool: [PageResult.MISS] * len(t.pages) for t in transfers}
        self._poll()
        plan: dict[Segment, list[_Item]] = {}  # pages by segment, in call order
        with self._lock:
            by_sid = self.catalog.by_sid
            for t in transfers:
                pool = t.pool
                keys = self.catalog.keys.get(pool)
                get = keys.get if keys is not None else None
                last_sid = -1  # a call's pages are mostly in one segment, in order: its lookups made once
                seg: Segment | None = None
                last: list[_Item] | None = None  # seg's plan, made with its first page to read
                lengths: Sequence[int] = ()
                offsets: Sequence[int] = ()
                for i, page in enumerate(t.pages):
                    key = page.key
                    value = get(key) if get is not None and isinstance(key, str) else None
                    if value is None:
                        if key_problem(key):
                            results[pool][i] = PageResult.FAILED
                            self._log_once("get:badkey", "file backend: page_get: %s", key_problem(key))
                        continue
                    sid = value >> _REC_BITS
                    if sid != last_sid:
                        seg = by_sid[sid]
                        lengths, offsets, last_sid, last = seg.index.lengths, seg.index.offsets, sid, None
                    rec = value & _REC_MASK
                    stored = lengths[rec]
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
                    if last is None:
                        assert seg is not None
                        got = plan.get(seg)
                        last = plan[seg] = [] if got is None else got
                    last.append((offsets[rec], stored, pool, i, page))
        if plan:
            self._read_plan(plan, results, deadline, finished or _not_told, read_records, read_runs)
        return results

    def _read_plan(
        self,
        plan: Mapping[Segment, list[_Item]],
        results: dict[str, list[PageResult]],
        deadline: float,
        finished: _Finished,
        read_records: _ReadRecords | None = None,
        read_runs: _ReadRuns | None = None,
    ) -> None:
        """Read every planned page. Each segment's pages are sorted by offset and cut into runs of
        adjacent records (one ``preadv`` each); the runs of all segments are shared, contiguously
        and by bytes, among the calling thread and the worker pool. A share checks the deadline
        before each run and reports each run's pages finished as soon as their headers passed.
        With the core's ``read_runs`` (every page carries the core's header), all runs go to the
        core in one call instead: its threads read and verify them, each taking the next run."""
        reads: list[_SegRead] = []
        runs: list[tuple[_SegRead, int, int]] = []
        weights: list[int] = []
        run_max = None
        if read_runs is not None and all(it[4].header is not None for items in plan.values() for it in items):
            read_records = None  # runs of at most _RUN_MAX_BYTES: small enough to share out evenly
        else:
            read_runs = None
        if read_records is not None or read_runs is not None:
            total = sum(HEADER_SIZE * len(items) + sum(it[1] for it in items) for items in plan.values())
            per_worker = -(-total // self.workers)
            # read_records: the core reads a run in cache-sized pieces itself, about one run a thread;
            # read_runs: runs of at most _RUN_MAX_BYTES, smaller when the call is small (every worker takes part)
            run_max = (max(_RUN_MAX_BYTES, _SHARE_MIN_VERIFIED, per_worker) if read_records is not None else
                       min(_RUN_MAX_BYTES, max(_RUN_MIN_BYTES, per_worker)))
        for seg, items in plan.items():
            try:
                h = self._acquire(seg)
            except FileNotFoundError:  # evicted (or replaced) by another process since our last poll
                with self._lock:
                    self._drop(seg.name)
                continue
            except OSError as exc:
                self.stats.read_failures += 1
                self._log_once(f"open:{exc.errno}", "file backend: cannot open %s: %s", seg.path, exc.strerror)
                for _off, _n, pool, i, _page in items:
                    results[pool][i] = _FAILED
                continue
            sr = _SegRead(seg, h, items)
            reads.append(sr)
            if len(items) > 1:
                items.sort(key=_item_offset)
            bounds = _run_bounds(items, run_max)
            for a, b in itertools.pairwise(bounds):
                runs.append((sr, a, b))
                weights.append(items[b - 1][0] + items[b - 1][1] - items[a][0])
        def share(part: list[tuple[_SegRead, int, int]]) -> None:
            _read_share(part, results, finished, deadline, read_records)

        if read_runs is not None:
            try:
                _read_by_core(runs, results, read_runs, self.workers, deadline)
            finally:  # the core's threads are done: no thread uses a descriptor or a buffer any more
                for sr in reads:
                    try:
                        self._settle_read(sr, results)
                    finally:
                        self._release(sr.handle)
            return
        if read_records is not None:  # the core reads and verifies each run without the GIL
            share_min = _SHARE_MIN_VERIFIED
        else:  # small records are dominated by per-page Python work (see _SHARE_MIN_RECORD)
            spread = sum(len(sr.items) for sr in reads) * _SHARE_MIN_RECORD <= sum(weights)
            share_min = _SHARE_MIN_BYTES if spread else 1 << 62
        try:
            self._spread(share, runs, weights, share_min)
        finally:  # every share has ended: no thread uses a descriptor or a buffer any more
            for sr in reads:
                try:
                    self._settle_read(sr, results)
                finally:
                    self._release(sr.handle)

    def _settle_read(self, sr: _SegRead, results: dict[str, list[PageResult]]) -> None:
        seg = sr.seg
        if sr.error is not None:
            self.stats.read_failures += 1
            self._log_once(f"read:{sr.error.errno}", "file backend: reading %s failed: %s", seg.path, sr.error.strerror)
        if sr.any_ok and not self._still_published(seg):
            # evicted by another process while we read, and its file maybe recycled into another
            # segment under our descriptor: what was read may be anyone's bytes, so nothing of it
            # counts (a miss, as the pages are gone), never handed to the core as OK
            for _off, _n, pool, i, _page in sr.items:
                if results[pool][i] is _OK:
                    results[pool][i] = PageResult.MISS
            with self._lock:
                self._drop(seg.name)
            return
        if sr.any_ok and self.writable:
            with contextlib.suppress(OSError):
                os.utime(sr.handle.fd)  # recency for LRU eviction, seen by every process
        if sr.bad:
            self._on_bad(seg, sr.bad, results)

    def _still_published(self, seg: Segment) -> bool:
        """Whether ``seg``'s name still holds the file that was loaded. A published file is never
        written again while it has its name (an evicted file leaves ``seg/`` by rename before it is
        recycled), so a read that ends with this true read the segment's own bytes."""
        try:
            with self.dirs.fan(fanout_dir(seg.name), create=False) as d:
                if d < 0:
                    return False
                return ident(os.stat(seg.name + SEGMENT_SUFFIX, dir_fd=d, follow_symlinks=False)) == seg.ident
        except FileNotFoundError:
            return False
        except OSError:  # cannot tell (the payloads are still verified by the core)
            return True

    @hookimpl
    def page_rejected(self, rejected: Mapping[str, Sequence[str]]) -> None:
        """Pages this backend answered OK that failed the core's verification: their segments are
        quarantined (with every segment sharing a group with them evicted), so the next read is a
        clean miss. The backend checks only headers on reads; payloads are the core's to check."""
        victims: dict[str, int] = {}
        with self._lock:
            for pool, keys in rejected.items():
                stored = self.catalog.keys.get(pool)
                if stored is None:
                    continue
                for key in keys:
                    value = stored.get(key)
                    if value is not None:
                        seg, _rec = self.catalog.entry(value)
                        victims[seg.name] = victims.get(seg.name, 0) + 1
            self.stats.corrupt_pages += sum(victims.values())
        for name, n in sorted(victims.items()):
            self._log_once(
                "rejected", "file backend: %d page(s) of segment %s failed the core's verification; segment "
                "quarantined", n, name,
            )
            if self.writable:
                self._evict({name}, quarantine=name)
            else:
                with self._lock:
                    self._drop(name)

    def _on_bad(
        self, seg: Segment, bad: list[tuple[str, int, str]], results: dict[str, list[PageResult]]
    ) -> None:
        """Failed validation: corruption, or a segment evicted and recycled under us."""
        if not self._still_published(seg):  # removed by another process: the pages are simply gone

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
    def page_exists(self, queries: Mapping[str, Sequence[str]]) -> dict[str, int]:
        self._poll()
        out: dict[str, int] = {}
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
            for name in list(self._handles):
                with contextlib.suppress(OSError):
                    self._retire_handle(name)
            self._journal.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        with self._fs_lock:  # no thread is inside the root lock any more
            if self._lock_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
                self._lock_fd = -1
        if self.spares is not None and not self.spares.close():
            return  # a claim still runs in tmp/: its directory descriptors stay open (logged)
        with self._lock:
            self.dirs.close()

    # -- capacity ----------------------------------------------------------------------------
    def _maybe_evict(self, protect: set[str]) -> None:
        cap = self.opts.max_bytes
        journal_full = self._journal.records() > self.opts.journal_max_records or self._journal.damaged
        if (cap is None or self.catalog.bytes <= cap) and not journal_full:
            return
        with self._root_lock(exclusive=True):
            self._finish_intent()
            self._poll()
            if cap is not None and self.catalog.bytes > cap:
                self._evict_lru(cap * self.opts.evict_to, protect, recycle=True)
            if self._journal.records() > self.opts.journal_max_records or self._journal.damaged:
                with self._lock:
                    self._poll()  # caught up (no one else appends now), so nothing is lost in the swap
                    try:
                        self._journal.compact()
                    except OSError as exc:
                        self._log_once(f"compact:{exc.errno}", "file backend: cannot compact the journal: %s", exc)

    def _make_room(self, need: int, protect: set[str]) -> None:
        """The filesystem is full: drop the kept free files and evict least recently used groups
        (deleting their files) as if the capacity were what is stored now."""
        self.stats.no_space_evictions += 1
        self._log_once("nospace", "file backend: the filesystem under %s is full; evicting to make room", self.root)
        with self._root_lock(exclusive=True):
            self._finish_intent()
            self._poll()
            with contextlib.suppress(OSError), os.scandir(self.dirs.free) as it:
                names = [e.name for e in it if e.is_file(follow_symlinks=False)]
            for name in names:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dirs.free)
            target = max(0.0, self.catalog.bytes * self.opts.evict_to - need)
            self._evict_lru(target, protect, recycle=False)

    def _evict_lru(self, target: float, protect: set[str], recycle: bool) -> None:
        """Evict least recently used segments (with every segment sharing a group) down to
        ``target`` bytes, never one of ``protect`` (the calling ``page_set``'s own segments) nor
        anything sharing a group with them. Caller holds the exclusive root lock."""
        with self._lock:
            segs = list(self.catalog.segments.values())
        by_dir: dict[str, list[Segment]] = defaultdict(list)
        for seg in segs:
            by_dir[fanout_dir(seg.name)].append(seg)
        aged: list[tuple[float, Segment]] = []
        gone: list[str] = []
        for d, group in by_dir.items():
            with self.dirs.fan(d, create=False) as fd:
                if fd < 0:
                    gone.extend(seg.name for seg in group)
                    continue
                for seg in group:
                    try:
                        st = os.stat(seg.name + SEGMENT_SUFFIX, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        gone.append(seg.name)
                        continue
                    except OSError:
                        continue
                    if ident(st) != seg.ident:
                        gone.append(seg.name)
                    else:
                        aged.append((st.st_mtime, seg))
        with self._lock:
            for name in gone:
                self._drop(name)
            # least recently used first, but a young half group (one pool's pages whose other
            # pools' call is on its way: SGLang writes the draft and target pages of a prefix in
            # separate calls) goes last, so that the later call does not find its group split
            young = time.time() - _PAIR_WINDOW_S
            aged.sort(key=lambda a: (a[0] > young and self.catalog.half_groups(a[1]), a[0], a[1].name))
            victims: set[str] = set()
            freed = 0
            for _mtime, seg in aged:
                if self.catalog.bytes - freed <= target:
                    break
                if seg.name in victims or seg.name in protect:
                    continue
                closure = self.catalog.closure([seg.name])
                if closure & protect:
                    continue
                for name in closure - victims:
                    victims.add(name)
                    freed += self.catalog.segments[name].size
        self._remove(victims, quarantine=None, recycle=recycle)

    def _evict(self, names: set[str], quarantine: str | None) -> None:
        with self._root_lock(exclusive=True):
            self._finish_intent()
            # caught up first (no one publishes now): a segment another process added since our
            # last look that shares a group with ``names`` goes with them, or the group is split
            self._poll()
            with self._lock:
                victims = self.catalog.closure(names)
            self._remove(victims, quarantine)

    def _remove(self, victims: set[str], quarantine: str | None, recycle: bool = True) -> None:
        """Unpublish ``victims`` (rename to free/ for reuse, or unlink; ``quarantine`` to
        quarantine/), crash-safely as one set: the intent file, then every "removed" record in one
        append, then the files, then the intent goes. Caller holds the exclusive root lock."""
        if not victims:
            return
        with self._lock:
            segs = [seg for name in sorted(victims) if (seg := self._drop(name)) is not None]
        if not segs:
            return
        names = [seg.name for seg in segs]
        written = self._write_intent(names)
        self._notify_removed(names)
        self._remove_files(names, quarantine, recycle, {seg.name: seg for seg in segs})
        for seg in segs:
            if seg.name != quarantine:
                self.stats.segments_evicted += 1
                self.stats.pages_evicted += len(seg.index)
        if written:
            self._delete_intent()

    def _notify_removed(self, names: list[str]) -> None:
        try:
            self._journal.append(Op.REMOVE, names)
        except OSError as exc:  # the files still go: readers then miss the pages (never a torn group)
            self._log_once(f"journal:{exc.errno}", "file backend: cannot append to the journal: %s", exc)

    def _free_files(self) -> int:
        """Files waiting in free/ (``recycle_files`` when it cannot be listed: none are added)."""
        try:
            with os.scandir(self.dirs.free) as it:
                return sum(1 for e in it if e.name.endswith(".free"))
        except OSError:
            return self.opts.recycle_files

    def _remove_files(
        self, names: list[str], quarantine: str | None, recycle: bool, segs: Mapping[str, Segment]
    ) -> None:
        """The files of removed segments: to free/ (up to ``recycle_files``), quarantine/, or
        unlinked. A name that no longer holds the file that was loaded (``segs``) is not ours any
        more: a link or anything else there is quarantined, never followed."""
        free_now = self._free_files()
        for name in names:
            fname = name + SEGMENT_SUFFIX
            with self.dirs.fan(fanout_dir(name), create=False) as d:
                if d < 0:
                    continue
                try:
                    st = os.stat(fname, dir_fd=d, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self._log_once(f"evict:{exc.errno}", "file backend: cannot remove %s: %s", fname, exc.strerror)
                    continue
                seg = segs.get(name)
                try:
                    if seg is not None and ident(st) != seg.ident:
                        self.dirs.unsafe_entry(d, fname, self.layout.segment_path(name), "replaced")
                    elif name == quarantine:
                        self.stats.segments_quarantined += 1
                        self.dirs.quarantine(d, fname)
                    elif recycle and free_now < self.opts.recycle_files and st.st_nlink == 1:
                        os.rename(fname, f"{name}.free", src_dir_fd=d, dst_dir_fd=self.dirs.free)
                        free_now += 1
                    else:
                        os.unlink(fname, dir_fd=d)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self._log_once(f"evict:{exc.errno}", "file backend: cannot remove %s: %s", fname, exc.strerror)

    # -- the eviction intent ---------------------------------------------------------------------
    def _write_intent(self, names: list[str]) -> bool:
        """ROOT/evict.intent naming ``names`` (written in tmp/, renamed in: never torn)."""
        body = "\n".join(names)
        text = f"{_INTENT_MAGIC} {xxhash_hex(body)}\n{body}\n".encode("ascii")
        tmp = f"intent.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd, _st = self.dirs.open_file(self.dirs.tmp, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, single=True)
            try:
                view = memoryview(text)
                while view:
                    view = view[os.write(fd, view):]
                if self.opts.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, INTENT_FILE, src_dir_fd=self.dirs.tmp, dst_dir_fd=self.dirs.root_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.dirs.tmp)
            self._log_once(f"intent:{exc.errno}", "file backend: cannot write the eviction intent (%s); evicting "
                           "without it (a crash now could split a group)", exc.strerror or exc)
            return False
        return True

    def _read_intent(self) -> set[str]:
        """The segments an unfinished eviction removes (empty when none, or not readable)."""
        try:
            fd, st = self.dirs.open_file(self.dirs.root_fd, INTENT_FILE, os.O_RDONLY, single=True)
        except FileNotFoundError:
            return set()
        except OSError as exc:
            if isinstance(exc, UnsafeEntry):
                self.dirs.unsafe_entry(self.dirs.root_fd, INTENT_FILE, self.root / INTENT_FILE, exc)
            return set()
        try:
            raw = os.pread(fd, min(st.st_size, 64 << 20), 0).decode("ascii", "replace")
        except OSError:
            return set()
        finally:
            os.close(fd)
        head, _, body = raw.partition("\n")
        body = body[:-1] if body.endswith("\n") else body
        if head != f"{_INTENT_MAGIC} {xxhash_hex(body)}":
            return set()
        return {n for n in body.split("\n") if is_segment_name(n)}

    def _delete_intent(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(INTENT_FILE, dir_fd=self.dirs.root_fd)

    def _finish_intent(self) -> None:
        """Complete an eviction a dead process left half done. Caller holds the exclusive lock."""
        names = self._read_intent()
        if not names:
            return
        self.stats.intents_replayed += 1
        self._log_once("intent", "file backend: finishing an interrupted eviction of %d segment(s)", len(names))
        with self._lock:
            for name in names:
                self._drop(name)
        ordered = sorted(names)
        self._notify_removed(ordered)
        self._remove_files(ordered, None, True, {})
        self._delete_intent()

    # -- housekeeping ------------------------------------------------------------------------
    def _recover(self) -> None:
        """At open, under the exclusive lock: finish an interrupted eviction, remove compaction
        files of dead processes, reclaim dead writers' temp files."""
        with self._root_lock(exclusive=True):
            self._finish_intent()
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(JOURNAL_FILE, dir_fd=self.dirs.root_fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):  # a link or anything else: set aside, a new one is made
                    self.dirs.unsafe_entry(self.dirs.root_fd, JOURNAL_FILE, self.layout.journal, "not a regular file")
            try:
                entries = os.listdir(self.dirs.root_fd)
            except OSError:
                entries = []
            for name in entries:
                pid = is_leftover(name, JOURNAL_FILE)
                if pid is not None and not pid_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=self.dirs.root_fd)
            self._clean_stale_tmp()

    def _clean_stale_tmp(self) -> None:
        """Reclaim temp files whose writer is gone: named after a pid that no longer exists and not
        flocked (a live writer holds its flock), they are recycled or deleted at once; a file of
        the older naming, or of a pid that exists (maybe reused, or on another host of a shared
        filesystem), only when unflocked and older than 10 timeouts (at least 600 s)."""
        horizon = time.time() - max(600.0, 10 * self.context.timeout_s)
        tmp = self.dirs.tmp
        try:
            with os.scandir(tmp) as it:
                entries = [e.name for e in it]
        except OSError:
            return
        free_now = self._free_files()
        for name in entries:
            m = _TMP_RE.fullmatch(name)
            dead = m is not None and not pid_alive(int(m.group(2) or m.group(4)))
            try:
                st = os.stat(name, dir_fd=tmp, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    if stat.S_ISLNK(st.st_mode):
                        self.dirs.unsafe_entry(tmp, name, self.layout.tmp / name, "a symbolic link")
                    continue
                if not dead and (not name.endswith(".tmp") or st.st_ctime > horizon):
                    continue
                fd, st = self.dirs.open_file(tmp, name, os.O_RDONLY, single=False)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                if m is not None and m.group(1) and st.st_nlink == 1 and free_now < self.opts.recycle_files:
                    os.rename(name, f"{m.group(1)}.free", src_dir_fd=tmp, dst_dir_fd=self.dirs.free)
                    free_now += 1
                else:
                    os.unlink(name, dir_fd=tmp)
                self.stats.tmp_reclaimed += 1
            except OSError:
                pass
            finally:
                os.close(fd)

    def usage(self) -> dict[str, int | None]:
        """Current use of the whole root as this process sees it (after catching up)."""
        self._poll()
        free_files = free_bytes = 0
        with contextlib.suppress(OSError), os.scandir(self.dirs.free) as it:
            for e in it:
                free_files += 1
                free_bytes += e.stat(follow_symlinks=False).st_size
        with self._lock:
            self.stats.unsafe_entries = self.dirs.unsafe
            return {
                "bytes": self.catalog.bytes,
                "pages": self.catalog.pages,
                "segments": len(self.catalog.segments),
                "max_bytes": self.opts.max_bytes,
                "free_files": free_files,
                "free_bytes": free_bytes,
                **vars(self.stats),
            }


_LIVE: weakref.WeakSet[FileBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for backend in list(_LIVE):
        backend._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def xxhash_hex(text: str) -> str:
    return f"{xxhash.xxh32_intdigest(text.encode('ascii', 'replace')):08x}"


def _item_offset(item: _Item) -> int:
    return item[0]


def _run_bounds(items: list[_Item], max_bytes: int | None = None) -> list[int]:
    """Where offset-sorted ``items`` split into runs of adjacent records, each at most ``max_bytes``
    (default ``_RUN_MAX_BYTES``; a larger record alone) and ``_RUN_MAX_BUFFERS`` buffers: the index
    of every run's first item, then ``len(items)``."""
    limit = _RUN_MAX_BYTES if max_bytes is None else max_bytes
    bounds: list[int] = []
    next_off = -1
    nbytes = n_iov = 0
    for j, (off, n, _pool, _i, page) in enumerate(items):
        span = HEADER_SIZE + n
        more = 1 + len(page.buffers)
        if off != next_off or nbytes + span > limit or n_iov + more > _RUN_MAX_BUFFERS:
            bounds.append(j)
            nbytes = n_iov = 0
        nbytes += span
        n_iov += more
        next_off = off + span
    bounds.append(len(items))
    return bounds


def _read_share(
    runs: Sequence[tuple[_SegRead, int, int]],
    results: dict[str, list[PageResult]],
    finished: _Finished,
    deadline: float,
    read_records: _ReadRecords | None = None,
) -> None:
    """One thread's share of a ``page_get``: its runs in order, each checked against the deadline
    first (a run not started in time fails its pages). An I/O error fails that run's pages only.
    Pages that passed are announced to ``finished`` after each run (the core then verifies them in
    this thread, from the cache), and at the end of the share."""
    told: dict[str, list[int]] = {}
    waiting = 0
    for sr, a, b in runs:
        run = sr.items[a:b]
        if time.monotonic() > deadline:
            for _off, _n, pool, i, _page in run:
                results[pool][i] = _FAILED
            continue
        try:
            got = _read_run(sr.handle.fd, run, results, sr.bad, told, read_records)
        except OSError as exc:
            sr.error = exc
            for _off, _n, pool, i, _page in run:
                if results[pool][i] is not _OK:
                    results[pool][i] = _FAILED
            continue
        if got:
            sr.any_ok = True
            waiting += got
            if waiting >= _FINISH_BYTES:
                for pool, indices in told.items():
                    finished(pool, indices)
                told = {}
                waiting = 0
    for pool, indices in told.items():
        finished(pool, indices)


def _records_read(
    run: list[_Item], end: int, results: dict[str, list[PageResult]], bad: list[tuple[str, int, str]]
) -> int:
    """The pages of a run the core read up to ``end`` of the file (and verified): ``OK`` where whole,
    a truncated segment where not. Returns the bytes found OK."""
    ok = 0
    for off, n, pool, i, _page in run:
        if off + HEADER_SIZE + n > end:
            bad.append((pool, i, "truncated segment"))
            continue
        results[pool][i] = _OK
        ok += HEADER_SIZE + n
    return ok


def _read_by_core(
    runs: Sequence[tuple[_SegRead, int, int]],
    results: dict[str, list[PageResult]],
    read_runs: _ReadRuns,
    threads: int,
    deadline: float,
) -> None:
    """Every run read and verified by the core's ``read_runs`` in one call, on up to ``threads``
    threads. A run not started by the deadline fails its pages, and so does one whose read failed
    (an I/O error fails that run's pages only)."""
    if time.monotonic() > deadline:  # nothing started: the call may already have been abandoned
        for sr, a, b in runs:
            for _off, _n, pool, i, _page in sr.items[a:b]:
                results[pool][i] = _FAILED
        return
    got = read_runs([(sr.handle.fd, sr.items[a][0], [(it[2], it[3]) for it in sr.items[a:b]]) for sr, a, b in runs],
                    threads)
    for (sr, a, b), res in zip(runs, got, strict=True):
        run = sr.items[a:b]
        if res.__class__ is int:
            if _records_read(run, run[0][0] + res, results, sr.bad):  # type: ignore[operator]
                sr.any_ok = True
            continue
        if isinstance(res, OSError):
            sr.error = res
        for _off, _n, pool, i, _page in run:
            results[pool][i] = _FAILED


def _read_run(
    fd: int,
    run: list[_Item],
    results: dict[str, list[PageResult]],
    bad: list[tuple[str, int, str]],
    done: dict[str, list[int]],
    read_records: _ReadRecords | None = None,
) -> int:
    """One :func:`read_into` of adjacent records (``preadv`` without the GIL): each header straight
    into the page's ``header`` buffer, each payload straight into the page's buffers. A page with
    the core's header is the core's to verify (header and payload, :class:`~hicache_draft.Store`);
    a page without one (a direct hook call) has its header parsed here (magic, version, its own
    checksum, key, namespace, pool, length), which catches short, foreign and misplaced records.
    Pages that pass are reported to ``done`` (by pool). Returns the bytes found OK.

    With the core's ``read_records`` (a run whose pages all carry the core's header), the core reads
    the run itself and verifies every page as its bytes land; those pages are final already."""
    start = run[0][0]
    if read_records is not None and all(item[4].header is not None for item in run):
        end = start + read_records(fd, start, [(pool, i) for _off, _n, pool, i, _page in run])
        return _records_read(run, end, results, bad)
    iov: list[Buffer | memoryview] = []
    scratch: memoryview | None = None
    for j, item in enumerate(run):
        page = item[4]
        hb = page.header
        if hb is None:
            if scratch is None:
                scratch = memoryview(bytearray(HEADER_SIZE * len(run)))
            iov.append(scratch[j * HEADER_SIZE : (j + 1) * HEADER_SIZE])
        else:
            iov.append(hb)
        iov.extend(page.buffers)
    end = start + read_into(fd, start, iov)
    ok = 0
    for j, (off, n, pool, i, page) in enumerate(run):
        if off + HEADER_SIZE + n > end:
            bad.append((pool, i, "truncated segment"))
            continue
        if page.header is None:
            assert scratch is not None
            try:
                stored = parse_header(scratch[j * HEADER_SIZE : (j + 1) * HEADER_SIZE], page.key, page.namespace,
                                      pool).payload_len
            except PageFormatError as exc:
                bad.append((pool, i, str(exc)))
                continue
            if stored != n:
                bad.append((pool, i, f"payload length mismatch: header {stored}, index {n}"))
                continue
        results[pool][i] = _OK
        got = done.get(pool)
        if got is None:
            done[pool] = [i]
        else:
            got.append(i)
        ok += HEADER_SIZE + n
    return ok


__all__ = ["FileBackend", "FileOptions", "FileStats", "claim_file"]
