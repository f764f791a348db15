"""The whole offload pipeline of one serving rank, measured in one run against its own limits.

A Llama-3.1-8B-shaped rank by default (32 layers, 8 KV heads x 128, bf16, 64-token pages = 8 MiB per
page) with a one-layer EAGLE draft (256 KiB per page). Steps, each over the same ``pages`` pages:

1. ``d2h``: device KV pool -> host pool (pinned on CUDA): the limit every other step is compared to;
2. ``backup``: :meth:`CacheController.backup` of target and draft pages to the store (after one
   untimed backup of two other pages: a store's first call starts its threads);
3. ``prefetch``: a fresh controller (a restarted server) restores them into other host slots (after
   one untimed prefetch of those two pages);
4. ``h2d``: host pool -> device pool;
5. ``ceiling write`` / ``ceiling rewrite`` / ``ceiling read``: plain threads (``ceiling_threads``, one
   file each, a contiguous share of the pages each) doing one ``os.pwritev`` per page of the restored
   pages, straight from the host pool's memory, into new files on the store's filesystem, again into
   the same files (space already allocated), and one ``os.preadv`` per page back into the same pool
   memory: the same bytes between the same memory and that filesystem, nothing else done (a buffer
   reused for every call would stay in the CPU cache and overstate the ceiling). Backup is compared
   to the first, prefetch to the last.

Every step prints GB/s and its ratio to ``d2h``; backup and prefetch also their ratio to the ceiling.
Without CUDA the "device" is a second host tensor, so the copies are host copies (CI runs it that way).
"""

from __future__ import annotations

import itertools
import os
import secrets
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_draft.transfer import Buffer


@dataclass(frozen=True)
class Shape:
    """One rank's pools: the target's and the draft's."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    draft_layers: int = 1
    kv_dtype: str = "bfloat16"

    @classmethod
    def quick(cls) -> Shape:
        return cls(layers=4, kv_heads=4, head_dim=64, page_size=16)


@dataclass
class PipelineReport:
    device: str
    pages: int
    target_page_bytes: int
    draft_page_bytes: int
    root: str
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    def gbps(self, step: str) -> float:
        return self.nbytes[step] / self.seconds[step] / 1e9

    def rows(self) -> list[tuple[str, float, float, float | None]]:
        """(step, GB/s, ratio to d2h, ratio to the filesystem ceiling or None)."""
        d2h = self.gbps("d2h")
        ceil = {"backup": "ceiling write", "prefetch": "ceiling read"}
        out = []
        for step in self.seconds:
            g = self.gbps(step)
            c = ceil.get(step)
            out.append((step, g, g / d2h, g / self.gbps(c) if c in self.seconds else None))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "pages": self.pages, "target_page_bytes": self.target_page_bytes,
            "draft_page_bytes": self.draft_page_bytes, "root": self.root, "checks": self.checks,
            "steps": [
                {"step": s, "gbps": round(g, 3), "vs_d2h": round(r, 4),
                 "vs_ceiling": None if c is None else round(c, 4)}
                for s, g, r, c in self.rows()
            ],
        }


def scratch_options(backend: str | None, directory: Path) -> dict[str, Any]:
    """The backend's own options for a throwaway store under ``directory`` (never guessed here)."""
    from hicache_draft.errors import ConfigError
    from hicache_draft.plugins import get_backend

    info = get_backend(backend)
    assert info.cls is not None
    offered = info.cls.scratch_options(directory)
    if offered is None:
        raise ConfigError(
            f"backend {info.name!r} offers no scratch options (StorageBackend.scratch_options); "
            "give its options with --option KEY=VALUE", field="backend_options",
        )
    return offered


def _config(
    shape: Shape, backend: str | None, options: Mapping[str, Any], model: str, batch_pages: int
) -> Any:  # noqa: ANN401
    from hicache_draft.config import Config

    data: dict[str, Any] = {
        "backend_options": dict(options),
        "namespace": {"model": model, "draft_model": f"{model}-eagle", "kv_dtype": shape.kv_dtype,
                      "page_size": shape.page_size},
        "target": {"attention": "mha", "layers": shape.layers, "kv_heads": shape.kv_heads,
                   "head_dim": shape.head_dim, "layout": "page_first"},
        "draft": {"enabled": True, "attention": "mha", "layers": shape.draft_layers, "kv_heads": shape.kv_heads,
                  "head_dim": shape.head_dim},
        "timeout_s": 120.0,
        "batch_pages": batch_pages,
    }
    if backend is not None:
        data["backend"] = backend
    return Config.model_validate(data)


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _ceiling(root: Path, pages: Sequence[Buffer], threads: int) -> tuple[float, float, float]:
    """Seconds for ``threads`` threads, each with a contiguous share of ``pages`` (host-pool memory,
    one ``Buffer`` per page), to ``pwritev`` their pages one call each into a new file of their own,
    to write them again (space already allocated), and to ``preadv`` them back into the same pages:
    the store's bytes, from and into the pool's own memory, with nothing else done."""
    k = max(1, min(threads, len(pages)))
    cuts = [j * len(pages) // k for j in range(k + 1)]
    shares = [pages[a:b] for a, b in itertools.pairwise(cuts)]
    paths = [root / f"ceiling-{secrets.token_hex(4)}-{i}" for i in range(k)]

    def run(write: bool) -> float:
        barrier = threading.Barrier(k + 1)

        def one(i: int) -> None:
            fd = os.open(paths[i], os.O_RDWR | os.O_CREAT, 0o600)
            try:
                views = [b.view() for b in shares[i]]
                barrier.wait()
                off = 0
                for view in views:
                    (os.pwritev if write else os.preadv)(fd, [view], off)
                    off += view.nbytes
            finally:
                os.close(fd)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    try:
        return run(True), run(True), run(False)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def run_pipeline(
    root: Path | None = None,
    pages: int = 384,
    shape: Shape | None = None,
    backend: str | None = None,
    options: Mapping[str, Any] | None = None,
    ceiling_threads: int | None = None,
    batch_pages: int = 128,
) -> PipelineReport:
    """Measure every step once, each copy after a first touch of its memory (``batch_pages``:
    the controller's pages per storage call)."""
    with warnings.catch_warnings():  # torch's "Failed to initialize NumPy" (we never use NumPy), scoped
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        return _run(root, pages, shape or Shape(), backend, options, ceiling_threads, batch_pages)


def _run(
    root: Path | None, pages: int, shape: Shape, backend: str | None, options: Mapping[str, Any] | None,
    ceiling_threads: int | None, batch_pages: int,
) -> PipelineReport:
    from hicache_draft.controller import CacheController
    from hicache_draft.pools import import_torch

    torch = import_torch()

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    tmp = None
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="hicache-draft-bench-")
        root = Path(tmp.name)
    store_root = root / f"store-{secrets.token_hex(4)}"
    store_root.mkdir()
    opts = dict(options) if options is not None else scratch_options(backend, store_root)
    model = f"bench-{secrets.token_hex(4)}"
    try:
        cfg = _config(shape, backend, opts, model, batch_pages)
        writer = CacheController.from_config(cfg, num_pages=pages)
        tgt, drf = writer.target_pool, writer.draft_pool
        assert drf is not None
        tpage, dpage = tgt.spec.page_nbytes, drf.spec.page_nbytes
        report = PipelineReport("cuda:" + torch.cuda.get_device_name() if cuda else "cpu (host copies)",
                                pages, tpage, dpage, str(root))
        t_bytes, d_bytes = pages * tpage, pages * dpage
        device_kv = torch.randint(0, 256, (t_bytes,), dtype=torch.uint8, device=dev)
        device_draft = torch.randint(0, 256, (d_bytes,), dtype=torch.uint8, device=dev)
        host_t, host_d = tgt.raw.view(-1)[:t_bytes], drf.raw.view(-1)[:d_bytes]

        def d2h() -> None:
            host_t.copy_(device_kv, non_blocking=cuda)
            host_d.copy_(device_draft, non_blocking=cuda)

        d2h()  # first touch of the host pages (page faults) is not the copy's speed
        report.seconds["d2h"] = _timed(d2h, sync)
        report.nbytes["d2h"] = t_bytes + d_bytes
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 50_000, (pages * shape.page_size,), generator=gen).tolist()
        slots = [i * shape.page_size for i in range(pages)]
        # one untimed call each way first (other tokens, two pages): starting the store's threads
        # and its first segment are not the copy's speed
        warm = torch.randint(50_000, 100_000, (2 * shape.page_size,), generator=gen).tolist()
        writer.backup(warm, slots[:2])
        res = None

        def backup() -> None:
            nonlocal res
            res = writer.backup(tokens, slots)

        report.seconds["backup"] = _timed(backup, sync)
        report.nbytes["backup"] = t_bytes + d_bytes
        assert res is not None
        report.checks["backup stored every page"] = all(v == pages for v in res.pages_written.values())
        writer.close()
        reader = CacheController.from_config(cfg, num_pages=2 * pages)
        reader.prefetch(warm, [pages * shape.page_size + i * shape.page_size for i in range(2)])
        got = None

        def prefetch() -> None:
            nonlocal got
            got = reader.prefetch(tokens, [(pages + i) * shape.page_size for i in range(pages)])

        report.seconds["prefetch"] = _timed(prefetch, sync)
        report.nbytes["prefetch"] = t_bytes + d_bytes
        assert got is not None
        rt, rd = reader.target_pool, reader.draft_pool
        assert rd is not None
        report.checks["prefetch restored every page"] = got.pages == pages
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # NaN != NaN: compare bits
        report.checks["restored bytes equal"] = all(
            torch.equal(w.page_view(s).view(as_int[w.spec.itemsize]),
                        r.page_view(pages * shape.page_size + s).view(as_int[w.spec.itemsize]))
            for w, r in ((tgt, rt), (drf, rd)) for s in slots
        )
        back_t, back_d = rt.raw.view(-1)[-t_bytes:], rd.raw.view(-1)[-d_bytes:]

        def h2d() -> None:
            device_kv.copy_(back_t, non_blocking=cuda)
            device_draft.copy_(back_d, non_blocking=cuda)

        h2d()
        report.seconds["h2d"] = _timed(h2d, sync)
        report.nbytes["h2d"] = t_bytes + d_bytes
        threads = ceiling_threads or min(16, os.cpu_count() or 1)
        # the restored pages (the same bytes as stored), target and draft interleaved as stored
        parts = ((back_t, tpage), (back_d, dpage))
        pages_mem = [Buffer(t.data_ptr() + i * n, n, t) for i in range(pages) for t, n in parts]
        w, rw, r = _ceiling(store_root, pages_mem, threads)
        reader.close()
        for step, secs in (("ceiling write", w), ("ceiling rewrite", rw), ("ceiling read", r)):
            report.seconds[step], report.nbytes[step] = secs, t_bytes + d_bytes
        return report
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_report(rep: PipelineReport) -> str:
    lines = [
        f"device {rep.device}; {rep.pages} pages of {rep.target_page_bytes >> 10} KiB (target) + "
        f"{rep.draft_page_bytes >> 10} KiB (draft); store under {rep.root}",
        f"{'step':<14} {'GB/s':>8} {'x d2h':>7} {'x ceiling':>10}",
    ]
    for step, g, r, c in rep.rows():
        lines.append(f"{step:<14} {g:8.2f} {r:7.3f} {'' if c is None else f'{c:10.3f}'}")
    lines.append("checks: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in rep.checks.items()))
    return "\n".join(lines)
