"""Unusable roots fail at start-up naming the path; I/O errors fail pages, never stored data."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import hicache_draft_file.segment_writer as segment_writer
import pytest

from hicache_draft import BackendSetupError, ConfigError, PageResult, PoolKind, Store

PAGE = 4096


def test_missing_parent_is_a_startup_error_naming_the_path(tmp_path: Path) -> None:
    root = tmp_path / "no" / "such" / "root"
    with pytest.raises(BackendSetupError, match=str(root)):
        Store.open("file", {"root": str(root)})
    with pytest.raises(BackendSetupError, match="does not exist"):
        Store.open("file", {"root": str(tmp_path / "absent"), "create_root": False})


def test_root_is_created_when_its_parent_exists(tmp_path: Path) -> None:
    with Store.open("file", {"root": str(tmp_path / "new")}) as store:
        assert store.backend.usage()["pages"] == 0
    assert (tmp_path / "new" / "FORMAT").read_text() == "hicache-draft-file 1\n"


@pytest.mark.parametrize("kind", ["file", "foreign dir", "other format"])
def test_unusable_roots_are_refused(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "r"
    if kind == "file":
        root.write_text("x")
    else:
        root.mkdir()
        (root / ("precious.txt" if kind == "foreign dir" else "FORMAT")).write_text("something else\n")
    with pytest.raises(BackendSetupError, match=str(root)):
        Store.open("file", {"root": str(root)})
    assert root.exists() and (root.is_file() or len(os.listdir(root)) == 1)  # nothing touched


def test_bad_options_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        Store.open("file", {"root": str(tmp_path), "max_bytes": 0})
    assert e.value.field == "backend_options.max_bytes"
    with pytest.raises(ConfigError) as e:
        Store.open("file", {"root": str(tmp_path), "rooot": "x"})
    assert "rooot" in (e.value.field or "")
    with pytest.raises(ConfigError) as e:
        Store.open("file", {})
    assert e.value.field == "backend_options.root"


def test_full_disk_fails_the_pages_and_keeps_what_was_stored(open_store, kit, monkeypatch, tmp_path: Path) -> None:
    store = open_store()
    kept = [kit.group(i, 1) for i in range(4)]
    store.page_set(kit.both(kept, PAGE))

    def no_space(*_a: object, **_kw: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_writer, "write_from", no_space)
    lost = [kit.group(i, 2) for i in range(4)]
    res = store.page_set(kit.both(lost, PAGE))
    assert res == {PoolKind.KV: [PageResult.FAILED] * 4, PoolKind.DRAFT: [PageResult.FAILED] * 4}
    assert store.backend.usage()["write_failures"] == 1
    assert kit.unfinished(store.backend, tmp_path / "store") == [], "a failed write left its temp file"
    monkeypatch.undo()
    got = kit.read_back(store, kept + lost, PAGE)
    assert [r for r, _ in got[PoolKind.KV]] == [PageResult.OK] * 4 + [PageResult.MISS] * 4
    assert all(eq for _, eq in got[PoolKind.KV][:4])
    assert store.page_set(kit.both(lost, PAGE))[PoolKind.KV] == [PageResult.OK] * 4


_UNPRIVILEGED = textwrap.dedent("""
    import os, sys
    from hicache_draft import BackendSetupError, PageResult, PoolKind, Store, Buffer, Page, PageTransfer
    from hicache_draft import discover_backends
    import hicache_draft_file.backend, hicache_draft_file.cli, logging
    import encodings.ascii, encodings.utf_8, concurrent.futures.thread
    discover_backends()
    if os.geteuid() == 0:  # root ignores permissions: become nobody (everything is imported already)
        os.setgid(65534); os.setuid(65534)
    root, key = sys.argv[1], sys.argv[2]
    try:
        Store.open("file", {"root": root})
        print("opened")
    except BackendSetupError as exc:
        print("refused:", exc)
    s = Store.open("file", {"root": root, "read_only": True})
    page = Page(key, key.split(".")[0], key.split(".")[1], (Buffer.of(bytearray(4096)),))
    print("exists", s.page_exists({PoolKind.KV: [key]})[PoolKind.KV])
    res, _ = s.page_get([PageTransfer(PoolKind.KV, [page])])
    print("get", res[PoolKind.KV][0].name)
    print("set", s.page_set([PageTransfer(PoolKind.KV, [page])])[PoolKind.KV][0].name)
""")


def test_read_only_root_for_an_unprivileged_process(kit) -> None:
    """Root runs the reader as ``nobody``; anyone else gets the store's directories made read-only."""
    base = Path(tempfile.mkdtemp(prefix="hcd-file-ro-"))
    try:
        os.chmod(base, 0o755)
        root = base / "store"
        with Store.open("file", {"root": str(root)}) as store:
            store.page_set(kit.both([kit.group(1)], PAGE))
        key = f"{kit.group(1)}.{kit.NS[PoolKind.KV]}"
        dirs = [root, *[p for p in root.rglob("*") if p.is_dir()]]
        if os.geteuid() != 0:
            for d in dirs:
                os.chmod(d, 0o555)
        try:
            out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, str(root), key], capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "HOME": "/tmp"})
        finally:
            for d in dirs:
                os.chmod(d, 0o755)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("refused:") and str(root) in lines[0] and "read_only=true" in lines[0]
        assert lines[1:] == ["exists 1", "get OK", "set FAILED"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
