"""Shared fixtures of the file backend tests: deterministic pages and store openers."""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store

NS = {PoolKind.KV: "a1" * 12, PoolKind.DRAFT: "d2" * 12}


def group(i: int, tag: int = 0) -> str:
    return f"{tag:08x}{i:056x}"


def payload(key: str, n: int) -> bytes:
    return hashlib.shake_256(key.encode()).digest(n)


def pages(pool: PoolKind, groups: list[str], n: int, fill: bool = True) -> list[Page]:
    out = []
    for g in groups:
        key = f"{g}.{NS[pool]}"
        buf = bytearray(payload(key, n)) if fill else bytearray(n)
        out.append(Page(key=key, group=g, namespace=NS[pool], buffers=(Buffer.of(buf),)))
    return out


def both(groups: list[str], n: int, fill: bool = True) -> list[PageTransfer]:
    return [PageTransfer(p, pages(p, groups, n, fill)) for p in (PoolKind.KV, PoolKind.DRAFT)]


def unfinished(backend: object, root: Path) -> list[str]:
    """The files in ``root``'s ``tmp/`` other than ``backend``'s spare segment files (spares.py),
    once its spare refill has settled: what an unfinished or failed write left."""
    spares = getattr(backend, "spares", None)
    held: set[str] = set()
    if spares is not None:
        assert spares.settle(10.0), "the spare-file refill did not settle"
        held = spares.names()
    return sorted(p.name for p in (root / "tmp").iterdir() if p.name not in held)


def flocked(path: Path) -> bool:
    """Whether some open file description holds a flock on ``path`` (tried from a new one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def read_back(store: Store, groups: list[str], n: int) -> dict[PoolKind, list[tuple[PageResult, bool]]]:
    """page_get of both pools: per page (result, bytes equal to what was written)."""
    ts = both(groups, n, fill=False)
    res, _ = store.page_get(ts)
    out = {}
    for t in ts:
        pairs = zip(res[t.pool], t.pages, strict=True)
        out[t.pool] = [(r, bytes(p.buffers[0].view()) == payload(p.key, n)) for r, p in pairs]
    return out


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(NS=NS, group=group, payload=payload, pages=pages, both=both, read_back=read_back,
                           unfinished=unfinished, flocked=flocked)


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def _open(root: Path | None = None, **opts: object) -> Store:
        s = Store.open("file", {"root": str(root or tmp_path / "store"), **opts})
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()
