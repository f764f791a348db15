"""Helpers shared by the mooncake backend tests (fixtures come from hicache_draft_mooncake.pytest_plugin)."""

import secrets
from dataclasses import dataclass, field

import pytest
import torch

from hicache_draft import Attention, Layout, Page, PageTransfer, PoolKind, PoolRegistration, Store
from hicache_draft.keys import make_key, pool_identities
from hicache_draft.pools import HostPool, PoolSpec

PAGE_SIZE = 4


@dataclass
class Rig:
    """A host pool of one rank, with its per-part namespaces, as the controller would build it."""

    kind: PoolKind
    attention: Attention
    layout: Layout
    pool: HostPool
    namespaces: list[str]
    split: int = 1
    extra: list = field(default_factory=list)

    def registration(self) -> PoolRegistration:
        return PoolRegistration(
            pool=self.kind, attention=self.attention, layout=self.layout, namespace=self.namespaces[0],
            page_nbytes=self.pool.part_nbytes(self.split), buffers_per_page=self.pool.spec.buffers_per_page(),
            regions=self.pool.regions(),
        )

    def pages(self, groups, page_indices, part=0) -> list[Page]:
        ns = self.namespaces[part]
        return [
            Page(make_key(g, ns), g, ns, self.pool.page_buffers(i * PAGE_SIZE, part, self.split))
            for g, i in zip(groups, page_indices, strict=True)
        ]

    def transfer(self, pages) -> PageTransfer:
        return PageTransfer(self.kind, pages, zero_copy=True)

    def page_bytes(self, index: int, part: int = 0) -> bytes:
        return self.pool.page_bytes(index * PAGE_SIZE, part, self.split)

    def fill_random(self) -> None:
        self.pool.raw.copy_(torch.randint(0, 256, self.pool.raw.shape, dtype=torch.uint8))


def make_rig(kind=PoolKind.KV, attention=Attention.MHA, layout=Layout.PAGE_FIRST, *, num_pages=8, layers=2,
             kv_heads=4, tp_rank=0, tp_size=1, tp_lcm_size=None, allocator=None, model="test-model") -> Rig:
    spec = PoolSpec(kind=kind, attention=attention, layers=layers, page_size=PAGE_SIZE, dtype=torch.bfloat16,
                    layout=layout, kv_heads=kv_heads, head_dim=8, latent_dim=16)
    split = (tp_lcm_size or tp_size) // tp_size
    idents = pool_identities(
        pool=kind, model=model, dtype="bfloat16", attention=attention, page_size=PAGE_SIZE, layers=layers,
        layout=layout, kv_heads=kv_heads if attention is Attention.MHA else None, head_dim=8,
        latent_dim=16, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, tp_lcm_size=tp_lcm_size,
    )
    return Rig(kind, attention, layout, HostPool(spec, num_pages, allocator=allocator),
               [i.fingerprint() for i in idents], split)


def groups(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


@pytest.fixture
def open_store(mooncake_service):
    """``open_store(shm=False, **options)``: a Store over the session service, closed after the test."""
    opened: list[Store] = []

    def open_(shm: bool = False, service=None, **options) -> Store:
        svc = service or mooncake_service
        opts = {**svc.backend_options(shm=shm), **options}
        if shm:
            opts.setdefault("shm_pool_size", 64 << 20)
        store = Store.open("mooncake", opts)
        opened.append(store)
        return store

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def rig_factory():
    return make_rig


@pytest.fixture
def new_groups():
    return groups


@pytest.fixture
def tcp_store(open_store):
    """One TCP-mode Store for the whole test function (shared by hypothesis examples)."""
    return open_store()
