"""The core's cache controller over the Mooncake backend: in shared-memory mode its host pools
come from the backend's ``host_memory`` hook (the segment holder's shared pool), and target and
draft pages move in place, with no bounce copy, across two controllers (a restart)."""

import secrets

import pytest
import torch

from hicache_draft import Config, IOPath, PoolKind
from hicache_draft.controller import CacheController

PS = 4


def _config(options: dict, draft: str) -> Config:
    d = {"enabled": True, "attention": draft, "layers": 1}
    d.update({"kv_heads": 2, "head_dim": 8} if draft == "mha" else {"latent_dim": 16})
    return Config.model_validate({
        "backend": "mooncake",
        "backend_options": options,
        "namespace": {"model": f"m-{secrets.token_hex(4)}", "draft_model": "m-draft", "kv_dtype": "bfloat16",
                      "page_size": PS},
        "target": {"attention": "mha", "layers": 2, "kv_heads": 4, "head_dim": 8, "layout": "page_first"},
        "draft": d,
    })


def _pools(ctrl: CacheController):
    return {PoolKind.KV: ctrl.target_pool, PoolKind.DRAFT: ctrl.draft_pool}


@pytest.mark.parametrize("draft", ["mla", "mha"])
def test_shm_controller_pools_live_in_the_shared_pool_and_pages_move_in_place(mooncake_service, draft):
    options = {**mooncake_service.backend_options(shm=True), "shm_pool_size": 32 << 20}
    cfg = _config(options, draft)
    writer = CacheController.from_config(cfg, num_pages=16)
    reader = None
    try:
        reader = CacheController.from_config(cfg, num_pages=16)
        for ctrl in (writer, reader):
            backend = ctrl.store.backend
            for kind, pool in _pools(ctrl).items():
                assert ctrl.plan[kind].path is IOPath.ZERO_COPY
                assert backend.in_shared_memory(pool.raw.data_ptr(), pool.raw.numel()), kind
        for pool in _pools(writer).values():
            pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8))
        toks = [int(t) for t in torch.randint(0, 50_000, (3 * PS + 1,))]
        wrote = writer.backup(toks, [0, 4, 8])
        assert wrote.pages_written == {PoolKind.KV: 3, PoolKind.DRAFT: 3}
        got = reader.prefetch(toks, [20, 28, 36])
        assert got.pages == 3 and got.restored == {PoolKind.KV: 3, PoolKind.DRAFT: 3} and got.draft_cold == []
        for kind in (PoolKind.KV, PoolKind.DRAFT):
            w, r = _pools(writer)[kind], _pools(reader)[kind]
            for a, b in ((0, 20), (4, 28), (8, 36)):
                assert w.page_bytes(a) == r.page_bytes(b), (kind, a)
        for ctrl in (writer, reader):
            stats = ctrl.store.backend.stats
            assert stats["bounced_pages"] == 0 and stats["staged_pages"] == 0
        assert writer.store.backend.stats["put"] == 6 and reader.store.backend.stats["get"] == 6
    finally:
        writer.close()
        if reader is not None:
            reader.close()


def test_tcp_mode_offers_no_host_memory(open_store):
    store = open_store()
    assert store.has_hook("host_memory")
    assert store.host_memory(PoolKind.KV, 4096) is None
