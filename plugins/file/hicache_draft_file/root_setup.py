"""Opening a store root: create or check it, and fail at start-up with the path named."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from hicache_draft import BackendSetupError
from hicache_draft_file.naming import FORMAT_LINE, RootLayout

_OURS = {"FORMAT", "lock", "journal", "seg", "tmp", "free", "quarantine"}


def prepare_root(root: Path, *, create: bool, read_only: bool) -> RootLayout:
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
        entries = set(os.listdir(root))
    except OSError as exc:
        raise BackendSetupError(f"file backend: cannot list root {root}: {exc.strerror or exc}") from None
    fmt = layout.format_file
    if "FORMAT" in entries:
        try:
            line = fmt.read_text(encoding="ascii", errors="replace")
        except OSError as exc:
            raise BackendSetupError(f"file backend: cannot read {fmt}: {exc.strerror or exc}") from None
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
    if read_only:
        return layout
    try:
        for d in layout.all_dirs():
            d.mkdir(exist_ok=True)
        if "FORMAT" not in entries:
            tmp = layout.tmp / f"FORMAT.{secrets.token_hex(4)}"
            tmp.write_text(FORMAT_LINE, encoding="ascii")
            os.rename(tmp, fmt)
        probe = layout.tmp / f"probe.{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
        lock_fd = os.open(layout.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        os.close(lock_fd)
    except OSError as exc:
        where = exc.filename or root
        raise BackendSetupError(
            f"file backend: root {root} is not writable ({where}: {exc.strerror or exc}); "
            "fix its permissions or free space, or open it with read_only=true"
        ) from None
    return layout
