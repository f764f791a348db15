"""Helpers shared by the mooncake backend tests. The store fixtures are opt-in (no pytest11 entry
point): this directory loads them from hicache_draft_mooncake.pytest_plugin explicitly."""

import ctypes
import secrets
from dataclasses import dataclass, field

import pytest
import torch
from hicache_draft_mooncake import MooncakeBackend

from hicache_draft import (
    Attention,
    Layout,
    Page,
    PageTransfer,
    PoolBinding,
    PoolKind,
    PoolRegistration,
    PoolSpec,
    Store,
    plan_binding,
)
from hicache_draft.config import ParallelConfig
from hicache_draft.pools import HostPool

pytest_plugins = ["hicache_draft_mooncake.pytest_plugin"]

PAGE_SIZE = 4


@dataclass
class Rig:
    """A host pool of one rank, bound as the controller binds it (the core's PoolBinding: its
    namespaces per head part, split and registration), with its pages addressed part by part."""

    kind: PoolKind
    attention: Attention
    layout: Layout
    binding: PoolBinding
    extra: list = field(default_factory=list)

    @property
    def pool(self) -> HostPool:
        assert self.binding.host is not None
        return self.binding.host

    @property
    def namespaces(self) -> list[str]:
        return list(self.binding.namespaces)

    @property
    def split(self) -> int:
        return self.binding.split

    def registration(self) -> PoolRegistration:
        return self.binding.registration()

    def pages(self, groups, page_indices, part=0) -> list[Page]:
        """The pages of head part ``part`` (the binding's pages, which are page-major over the parts)."""
        batch = self.binding.slot_batch(groups, [i * PAGE_SIZE for i in page_indices], fill=False)
        return list(batch.transfer.pages[part :: self.split])

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
    parallel = ParallelConfig(tp_rank=tp_rank, tp_size=tp_size, tp_lcm_size=tp_lcm_size)
    plan = plan_binding(spec, MooncakeBackend.capabilities, parallel, model=model, target_model=model)
    assert plan.path.value == "zero_copy", plan.reason  # the rigs hand over host pool memory
    return Rig(kind, attention, layout, PoolBinding(plan, HostPool(spec, num_pages, allocator=allocator)))


def host_allocator(store: Store, kind: PoolKind = PoolKind.KV):
    """What the controller does with the ``host_memory`` hook: an allocator over the backend's
    memory, or None when the backend offers none (TCP mode)."""
    if store.host_memory(kind, 1) is None:
        return None

    def alloc(nbytes: int) -> torch.Tensor:
        buf = store.host_memory(kind, nbytes)
        return torch.frombuffer((ctypes.c_ubyte * buf.nbytes).from_address(buf.ptr), dtype=torch.uint8)

    return alloc


def groups(n: int) -> list[str]:
    return [secrets.token_hex(32) for _ in range(n)]


@pytest.fixture(scope="session")
def shared_stores(mooncake_service):
    """``get(shm=False, **options)``: one Store per distinct option set, shared by the whole session
    and closed at its end (a Mooncake client's close takes about 1 s). Every test uses fresh random
    page groups, so tests never see each other's pages; tests that read ``backend.stats`` compare
    counts before and after (see :func:`stat_delta`)."""
    opened: dict[tuple, Store] = {}

    def get(shm: bool = False, **options) -> Store:
        key = (shm, tuple(sorted(options.items())))
        if key not in opened:
            opts = {**mooncake_service.backend_options(shm=shm), **options}
            if shm:
                opts.setdefault("shm_pool_size", 64 << 20)
            opened[key] = Store.open("mooncake", opts)
        return opened[key]

    yield get
    for s in opened.values():
        s.close()


@pytest.fixture
def open_store(shared_stores):
    """``open_store(shm=False, **options)``: the session's shared Store for these options."""
    return shared_stores


def stat_delta(store: Store, before: dict[str, int]) -> dict[str, int]:
    """What ``store.backend.stats`` counted since ``before = dict(store.backend.stats)``."""
    return {k: v - before.get(k, 0) for k, v in store.backend.stats.items() if v != before.get(k, 0)}


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
