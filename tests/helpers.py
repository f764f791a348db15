"""Shared builders for the core tests."""

from __future__ import annotations

import secrets
import textwrap
from pathlib import Path
from typing import Any

import torch

from hicache_draft import BackendContext, Config
from hicache_draft.controller import CacheController
from hicache_draft.store import Store
from hicache_draft.testing import MemoryBackend, in_forked_child  # noqa: F401 (tests import it from here)

PS = 4


def make_config(
    target: str = "mha",
    draft: str | None = "mha",
    layout: str = "page_first",
    draft_layout: str | None = None,
    on_miss: str = "shorten",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_lcm_size: int | None = None,
    kv_heads: int = 4,
    draft_heads: int = 2,
    **extra: Any,
) -> Config:
    t: dict[str, Any] = {"attention": target, "layers": 2, "layout": layout}
    t.update({"kv_heads": kv_heads, "head_dim": 8} if target == "mha" else {"latent_dim": 24})
    d: dict[str, Any] = {"enabled": draft is not None, "on_miss": on_miss}
    if draft is not None:
        d.update({"attention": draft, "layers": 1})
        d.update({"kv_heads": draft_heads, "head_dim": 8} if draft == "mha" else {"latent_dim": 16})
        if draft_layout:
            d["layout"] = draft_layout
    data = {
        "backend": "memory",
        "namespace": {"model": "m-target", "draft_model": "m-draft", "kv_dtype": "float16", "page_size": PS},
        "parallel": {"tp_rank": tp_rank, "tp_size": tp_size, "tp_lcm_size": tp_lcm_size},
        "target": t,
        "draft": d,
    }
    data.update(extra)
    return Config.model_validate(data)


def make_controller(
    config: Config, backend: type[MemoryBackend] = MemoryBackend, space: str | None = None, num_pages: int = 16
) -> CacheController:
    ctx = BackendContext(tp_rank=config.parallel.tp_rank, tp_size=config.parallel.tp_size, timeout_s=config.timeout_s)
    store = Store("memory", backend, backend.capabilities, {"space": space or secrets.token_hex(4)}, ctx)
    return CacheController(config, store, num_pages)


def make_pair(
    config: Config, backend: type[MemoryBackend] = MemoryBackend, num_pages: int = 16
) -> tuple[CacheController, CacheController]:
    """A writer (pools filled with random bytes) and a reader over one fresh in-memory space."""
    space = secrets.token_hex(4)
    writer = make_controller(config, backend, space, num_pages)
    reader = make_controller(config, backend, space, num_pages)
    fill_random(writer)
    return writer, reader


def fill_random(ctrl: CacheController) -> None:
    ctrl.target_pool.raw.copy_(torch.randint(0, 256, ctrl.target_pool.raw.shape, dtype=torch.uint8))
    if ctrl.draft_pool is not None:
        ctrl.draft_pool.raw.copy_(torch.randint(0, 256, ctrl.draft_pool.raw.shape, dtype=torch.uint8))


def tokens(n_pages: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n_pages * PS,), generator=g).tolist()


def slots(indices: list[int] | range) -> list[int]:
    return [i * PS for i in indices]


def fake_distribution(
    where: Path, name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str], version: str = "1.0"
) -> None:
    """Write an installed distribution (``NAME-VERSION.dist-info`` with ``METADATA`` and
    ``entry_points.txt``) and its modules into ``where``, a directory to put on ``sys.path``:
    importlib.metadata then finds real entry points with a real ``dist``."""
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (where / f"{module}.py").write_text(textwrap.dedent(source))


BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test ({name})")
        return None
sys.meta_path.insert(0, _NoTorch())
"""
"""Prepend to a ``python -c`` script: any import of torch then raises ImportError."""
