"""TP ranks agree on one restorable prefix through a real multi-process gloo group."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(dist, rank: int, world: int, port: int) -> None:  # noqa: ANN001
    """Join the gloo group; a rank that skipped a collective would leave its peer blocked until the
    group's timeout (20 s), then raising, so a test of collectives fails instead of hanging."""
    from datetime import timedelta

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))


def _rank_main(rank: int, world: int, port: int, space: str, drop_rank: int, out: dict) -> None:
    import torch.distributed as dist

    from hicache_draft import PoolKind
    from hicache_draft.testing import MemoryBackend
    from tests.helpers import fill_random, make_config, make_controller, slots, tokens

    _join(dist, rank, world, port)
    try:
        cfg = make_config("mha", "mha", tp_rank=rank, tp_size=world)
        ctrl = make_controller(cfg, space=space)
        fill_random(ctrl)
        toks = tokens(6)
        ctrl.backup(toks, slots(range(6)))
        if rank == drop_rank:  # this rank's draft page 2 is evicted
            key = ctrl.keys_for(PoolKind.DRAFT, __import__("hicache_draft").page_hashes(toks, 4))[2]
            ctrl.store.backend.drop(key)
        reader = make_controller(cfg, space=space)
        res = reader.prefetch(toks, slots(range(8, 14)))
        out[rank] = (res.pages, res.hit[PoolKind.DRAFT])
        MemoryBackend.reset()
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_min_prefix(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # spawned children take the parent's sys.path
    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(world, _free_port(), secrets.token_hex(4), 1, out), nprocs=world, join=True)
        result = dict(out)
    # rank 1 alone lost a draft page at index 2: its own hit is 2, rank 0's is 6; both restore 2
    assert result[0] == (2, 6)
    assert result[1] == (2, 2)


def _refusing_rank_main(rank: int, world: int, port: int, space: str, refuse_rank: int, out: dict) -> None:
    import torch.distributed as dist

    from hicache_draft import IOPath, PoolKind
    from hicache_draft.testing import MemoryBackend
    from tests.helpers import fill_random, make_config, make_controller, slots, tokens

    class RefusesKv(MemoryBackend):
        def check_registration(self, registration):  # noqa: ANN001, ANN202
            if registration.pool is PoolKind.KV:
                raise ValueError("this rank cannot register target memory")

    _join(dist, rank, world, port)
    try:
        cfg = make_config("mla", "mla", tp_rank=rank, tp_size=world)
        writer = make_controller(cfg, space=space)
        fill_random(writer)
        toks = tokens(4)
        writer.backup(toks, slots(range(4)))
        dist.barrier()
        reader = make_controller(cfg, RefusesKv if rank == refuse_rank else MemoryBackend, space=space)
        assert (reader.plan[PoolKind.KV].path is IOPath.DISABLED) == (rank == refuse_rank)
        first = reader.prefetch(toks, slots(range(8, 12)))
        second = reader.prefetch(toks, slots(range(8, 12)))  # collectives still paired after the first
        out[rank] = (first.pages, second.pages)
    finally:
        dist.destroy_process_group()


def test_every_rank_enters_the_collectives_when_one_rank_has_its_pool_disabled(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_refusing_rank_main, args=(world, _free_port(), secrets.token_hex(4), 1, out), nprocs=world,
                 join=True)
        result = dict(out)
    # rank 1 can restore nothing, so neither rank reports a prefix the other does not hold
    assert result == {0: (0, 0), 1: (0, 0)}


def _window_rank_main(rank: int, world: int, port: int, space: str, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from hicache_draft import page_hashes
    from hicache_draft.testing import MemoryBackend
    from tests.helpers import make_config, make_controller, slots, tokens

    _join(dist, rank, world, port)
    try:
        swa = {"name": "swa", "attention": "mha", "kv_heads": 2, "head_dim": 8, "layers": 1, "window_pages": 2}
        cfg = make_config("mha", None, tp_rank=rank, tp_size=world, pools=[swa])
        writer = make_controller(cfg, space=space)
        for b in writer.bindings.values():
            b.host.raw.copy_(torch.randint(0, 256, b.host.raw.shape, dtype=torch.uint8))
        toks = tokens(6)
        writer.backup(toks, slots(range(6)))
        stored = [writer.host_pool("swa").page_bytes(s) for s in slots(range(6))]
        if rank == 1:  # this rank's target page 3 exists but its read fails: its prefix ends at 3
            MemoryBackend.faults.fail_get_keys.add(writer.keys_for("kv", page_hashes(toks, 4))[3])
        dist.barrier()
        reader = make_controller(cfg, space=space)
        res = reader.prefetch(toks, slots(range(8, 14)))
        got = [reader.host_pool("swa").page_bytes(s) for s in slots(range(8, 14))]
        out[rank] = (res.pages, res.restored["swa"], got[1:3] == stored[1:3])
    finally:
        dist.destroy_process_group()


def test_trailing_windows_are_loaded_where_every_rank_ends(monkeypatch):
    """Rank 1's prefix ends at 3 during the reads (not in the existence query): both ranks restore 3
    pages, and rank 0's sliding window is the one of pages 1-2, not of its own longer prefix."""
    monkeypatch.syspath_prepend(str(ROOT))
    world = 2
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_window_rank_main, args=(world, _free_port(), secrets.token_hex(4), out), nprocs=world, join=True)
        result = dict(out)
    assert result == {0: (3, 2, True), 1: (3, 2, True)}
