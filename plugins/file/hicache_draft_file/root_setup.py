"""Opening a store root: create or check it, and fail at start-up with the path named.

Everything below the root is reached through the root's descriptor without following links
(see rootfs.py): a ``FORMAT`` or ``lock`` that is a link is refused or replaced, never read
through, and the directories are opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from hicache_draft import BackendSetupError
from hicache_draft_file.naming import FORMAT_LINE, INTENT_FILE, RootLayout
from hicache_draft_file.rootfs import NOFOLLOW, RootDirs

_OURS = {"FORMAT", "lock", "journal", INTENT_FILE, "seg", "tmp", "free", "quarantine"}


def prepare_root(root: Path, *, create: bool, read_only: bool) -> RootDirs:
    """Check (and, when writable, create) the store at ``root``; raise :class:`BackendSetupError`."""
    root = Path(os.path.abspath(root))
    layout = RootLayout(root)
    if not root.exists():
        parent = root.parent
        if read_only:
            raise BackendSetupError(f"file backend: root {root} does not exist (read_only stores are not created)")
        if not create:
            raise BackendSetupError(f"file backend: root {root} does not exist (create it, or set create_root=true)")
        if not parent.is_dir():
            raise BackendSetupError(
                f"file backend: root {root} does not exist and neither does its parent {parent}; "
                "create the parent directory or fix backend_options.root"
            )
        try:
            root.mkdir(exist_ok=True)
        except OSError as exc:
            raise BackendSetupError(f"file backend: cannot create root {root}: {exc.strerror or exc}") from None
    if not root.is_dir():
        raise BackendSetupError(f"file backend: root {root} is not a directory")
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendSetupError(f"file backend: cannot open root {root}: {exc.strerror or exc}") from None
    try:
        return _prepare(layout, root_fd, read_only)
    except BaseException:
        os.close(root_fd)
        raise


def _prepare(layout: RootLayout, root_fd: int, read_only: bool) -> RootDirs:
    root = layout.root
    try:
        entries = set(os.listdir(root_fd))
    except OSError as exc:
        raise BackendSetupError(f"file backend: cannot list root {root}: {exc.strerror or exc}") from None
    fmt = layout.format_file
    if "FORMAT" in entries:
        line = _read_format(root_fd, fmt)
        if line != FORMAT_LINE:
            raise BackendSetupError(
                f"file backend: {fmt} says {line.strip()!r}, expected {FORMAT_LINE.strip()!r}; "
                "this root belongs to another format or version"
            )
    elif entries - _OURS:
        raise BackendSetupError(
            f"file backend: root {root} is a non-empty directory that is not a hicache-draft-file store "
            "(no FORMAT file); point backend_options.root at an empty or new directory"
        )
    try:
        dirs = RootDirs(layout, root_fd, writable=not read_only)
    except OSError as exc:
        raise BackendSetupError(
            f"file backend: cannot open the directories of root {root} ({exc.filename or root}: "
            f"{exc.strerror or exc})" + ("" if read_only else "; fix its permissions, or open it with read_only=true")
        ) from None
    if read_only:
        return dirs
    try:
        if "FORMAT" not in entries:
            # a new store: its fan-out directories now, so no write pays for making one
            for d in layout.fanout_dirs():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d.name, 0o755, dir_fd=dirs.seg)
            tmp = f"FORMAT.{secrets.token_hex(4)}"
            _write_new(dirs.tmp, tmp, FORMAT_LINE.encode("ascii"))
            os.rename(tmp, "FORMAT", src_dir_fd=dirs.tmp, dst_dir_fd=root_fd)
        probe = f"probe.{secrets.token_hex(4)}"
        try:
            _write_new(dirs.tmp, probe, b"probe")
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe, dir_fd=dirs.tmp)
    except OSError as exc:
        dirs.close(root=False)  # the caller closes the root's descriptor
        raise BackendSetupError(
            f"file backend: root {root} is not writable ({exc.filename or root}: {exc.strerror or exc}); "
            "fix its permissions or free space, or open it with read_only=true"
        ) from None
    return dirs


def _read_format(root_fd: int, shown: Path) -> str:
    try:
        fd = os.open("FORMAT", os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW, dir_fd=root_fd)
    except OSError as exc:
        why = "it is a symbolic link (never followed)" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise BackendSetupError(f"file backend: cannot read {shown}: {why}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BackendSetupError(f"file backend: cannot read {shown}: not a regular file")
        return os.read(fd, 256).decode("ascii", errors="replace")
    except OSError as exc:
        raise BackendSetupError(f"file backend: cannot read {shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _write_new(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
