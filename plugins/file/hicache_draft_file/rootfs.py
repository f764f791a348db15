"""The root as a trust boundary: every file operation goes through descriptors of the root.

Someone else may be able to write into the store's directory (a shared cache on a shared
filesystem). Whatever they place there (a symbolic link, a hard link to a file elsewhere, a
directory swapped for a link) must never make this backend read, write, move or delete anything
outside the root. So the backend never resolves a path below the root by name:

* the root is opened once (the operator's path, which may itself be a link: that is configuration,
  not something found inside the store); ``seg``, ``tmp``, ``free`` and ``quarantine`` are opened
  once relative to it with ``O_DIRECTORY | O_NOFOLLOW`` and re-checked (device and inode against
  an ``lstat`` of the name) at every directory scan;
* a fan-out directory ``seg/xx`` is opened the same way, relative to ``seg``, for each operation
  that needs it (a publish, a load, a scan, an eviction), so a replaced one is never followed;
* every file is opened with ``O_NOFOLLOW`` relative to its directory's descriptor and then checked
  with ``fstat``: a regular file, and (for a file that will be written, recycled or served) a single
  link, so a hard link to a file outside the root is never served, overwritten or recycled;
* rename, unlink and scans take the directory descriptors (``src_dir_fd``/``dst_dir_fd``,
  ``dir_fd``, ``os.scandir(fd)``, ``follow_symlinks=False``), and rename or unlink act on the
  entry itself (the link, never its target).

An entry that fails these checks is reported once and moved into ``quarantine/`` (a writable store)
or ignored (a read-only one); pruning the quarantine unlinks entries (a link goes, its target stays)
and never descends into directories.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from hicache_draft_file.naming import RootLayout

log = logging.getLogger("hicache_draft_file")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
TOP_DIRS = ("quarantine", "seg", "tmp", "free")  # quarantine first: the others' bad entries go there
QUARANTINE_KEEP = 16
# open() of a link with O_NOFOLLOW fails with ELOOP; with O_DIRECTORY on a non-directory, ENOTDIR
_NOT_OURS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


class UnsafeEntry(OSError):
    """A directory entry that is not what the backend made: a link, or not a regular file."""


def ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class RootDirs:
    """Descriptors of one store root and its directories; the only way the backend touches files."""

    def __init__(self, layout: RootLayout, root_fd: int, writable: bool) -> None:
        self.layout = layout
        self.root_fd = root_fd
        self.writable = writable
        self.unsafe = 0  # entries found unsafe and ignored or quarantined
        self._reported: set[str] = set()
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []
        for name in TOP_DIRS:
            self._fds[name] = self._open_dir(root_fd, name, self.layout.root / name)

    # -- the four directories ------------------------------------------------------------------
    @property
    def seg(self) -> int:
        return self._fds["seg"]

    @property
    def tmp(self) -> int:
        return self._fds["tmp"]

    @property
    def free(self) -> int:
        return self._fds["free"]

    @property
    def quarantine_fd(self) -> int:
        return self._fds["quarantine"]

    def recheck(self) -> None:
        """Reopen a top directory whose name now points elsewhere (replaced, or made a link)."""
        for name in TOP_DIRS:
            fd = self._fds[name]
            try:
                now = ident(os.stat(name, dir_fd=self.root_fd, follow_symlinks=False))
                same = fd >= 0 and now == ident(os.fstat(fd))
            except OSError:
                same = False
            if not same:
                self.report(f"replaced:{name}", f"{self.layout.root / name} was replaced; reopened")
                if fd >= 0:  # another thread may be using it: closed with the store, never reused before
                    self._retired.append(fd)
                self._fds[name] = self._open_dir(self.root_fd, name, self.layout.root / name)

    def _open_dir(self, parent: int, name: str, shown: Path) -> int:
        """``parent/name`` as a directory descriptor, never through a link; created when missing
        (writable); a link or file in its place is quarantined and replaced (writable) or makes
        the directory absent (-1, read-only)."""
        if parent < 0:
            return -1
        for _attempt in range(3):
            try:
                return os.open(name, DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                if not self.writable:
                    return -1
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=parent)
            except OSError as exc:
                if exc.errno not in _NOT_OURS:
                    raise
                self.report(f"dir:{shown}", f"{shown} is not a directory of this store (a link or a file); "
                            + ("quarantined and replaced" if self.writable else "ignored"))
                if not self.writable:
                    return -1
                self.quarantine(parent, name)
        raise OSError(errno.ELOOP, "directory keeps being replaced", str(shown))

    @contextlib.contextmanager
    def fan(self, d: str, create: bool = True) -> Iterator[int]:
        """The fan-out directory ``seg/d`` for one operation (-1 when absent)."""
        fd = self._open_dir(self.seg, d, self.layout.seg / d) if create or not self.writable else self._peek(d)
        try:
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _peek(self, d: str) -> int:
        """Open ``seg/d`` without creating it (a link is still quarantined)."""
        try:
            return os.open(d, DIR_FLAGS, dir_fd=self.seg)
        except FileNotFoundError:
            return -1
        except OSError as exc:
            if exc.errno not in _NOT_OURS:
                raise
            return self._open_dir(self.seg, d, self.layout.seg / d)

    # -- files -----------------------------------------------------------------------------------
    def open_file(
        self, dir_fd: int, name: str, flags: int, *, single: bool, mode: int = 0o644
    ) -> tuple[int, os.stat_result]:
        """``open`` of ``name`` in ``dir_fd`` without following a link, then checked: a regular
        file, and with ``single`` one with a single link. Returns the descriptor and its ``fstat``;
        raises :class:`UnsafeEntry` otherwise (the descriptor closed)."""
        if dir_fd < 0:
            raise FileNotFoundError(errno.ENOENT, "directory absent", name)
        try:
            fd = os.open(name, flags | NOFOLLOW, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno in _NOT_OURS:
                raise UnsafeEntry(exc.errno, "a symbolic link", name) from None
            raise
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode) or (single and st.st_nlink != 1):
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} links"
            raise UnsafeEntry(errno.EPERM, what, name)
        return fd, st

    def report(self, what: str, msg: str) -> None:
        first = what not in self._reported
        self._reported.add(what)
        if first:
            self.unsafe += 1
        (log.warning if first else log.debug)("file backend: %s", msg)

    def unsafe_entry(self, dir_fd: int, name: str, shown: Path, why: object) -> None:
        """An entry that is not ours: reported once, quarantined (writable) or left alone."""
        self.report(f"unsafe:{shown}", f"{shown} is unsafe ({why}); "
                    + ("quarantined" if self.writable else "ignored"))
        if self.writable:
            self.quarantine(dir_fd, name)

    def quarantine(self, dir_fd: int, name: str) -> None:
        """Move the entry ``name`` of ``dir_fd`` (itself, never what a link points to) into
        ``quarantine/`` and prune the oldest entries there; an entry that cannot be moved is
        unlinked (not a directory) or left."""
        q = self._fds.get("quarantine", -1)
        dest = f"{int(time.time())}-{os.getpid()}-{name}"
        try:
            if q >= 0 and not (dir_fd == self.root_fd and name == "quarantine"):
                os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=q)
            else:
                os.unlink(name, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.debug("file backend: cannot quarantine %s: %s", name, exc)
            return
        self.prune_quarantine()

    def prune_quarantine(self) -> None:
        q = self._fds.get("quarantine", -1)
        if q < 0:
            return
        try:
            with os.scandir(q) as it:
                entries = []
                for e in it:
                    with contextlib.suppress(OSError):
                        mtime = e.stat(follow_symlinks=False).st_mtime
                        entries.append((mtime, e.name, e.is_dir(follow_symlinks=False)))
        except OSError:
            return
        entries.sort()
        for _mtime, name, is_dir in entries[: max(0, len(entries) - QUARANTINE_KEEP)]:
            with contextlib.suppress(OSError):
                if is_dir:
                    os.rmdir(name, dir_fd=q)  # only when empty: never walks into a tree
                else:
                    os.unlink(name, dir_fd=q)  # a link goes, its target stays

    def close(self, root: bool = True) -> None:
        for name, fd in list(self._fds.items()):
            self._fds[name] = -1
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for fd in self._retired:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._retired.clear()
        if root and self.root_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.root_fd)
            self.root_fd = -1


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie or another user's counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
