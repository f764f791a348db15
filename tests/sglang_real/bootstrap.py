"""Make one SGLang release importable on this CPU host, with the smallest shims.

``install(release)`` runs in a fresh child process, before anything imports sglang:

1. ``sys.path``: the release's own directory first (``.venv/sglang/<release>``, made by
   ``scripts/setup.sh --test`` with ``pip install --no-deps --target``; the venv's own sglang is used
   for the pinned release), the shared pure dependencies of SGLang's modules last
   (``.venv/sglang/_deps``), so hicache-draft's own dependencies stay the venv's.
2. torch decides "no Triton" *before* the triton shim is importable: ``has_triton()`` (cached),
   inductor's ``triton_compat``, ``flop_counter`` and dynamo are imported first, so torch never
   probes the shim. Meanwhile an import finder hides any ``triton`` (a GPU host's Python has a real
   one: there the benchmark runs SGLang's CPU pools with CUDA hidden); afterwards it serves the shim,
   never the real one, so the same modules run on a CPU box and on a GPU host.
3. The shims (``shims/``) go last on ``sys.path`` (``triton`` through the finder):

   * ``triton``: SGLang's modules define Triton kernels at import time; the shim gives the decorators
     and ``tl`` names, and every kernel raises ``TritonShimError`` if launched (no storage code
     launches one; a test that did would fail, not pass on a fake result).
   * ``torchvision`` (inert): imported by SGLang's multimodal processors; the only wheel for this torch
     is a CUDA build whose ops fail on CPU torch.
   * ``IPython`` (inert): imported by ``sglang/utils.py`` for notebook display helpers.
   * ``sgl_kernel`` needs no shim: SGLang imports it only behind ``is_cuda()`` checks.

4. ``sglang`` is registered as a bare package (``hicache_draft.integrations.sglang_loader``), so
   ``sglang/__init__.py`` (the frontend language and server entry points) does not run; every
   ``sglang.srt`` module then imports as it is, unchanged.

Nothing on the storage path is shimmed: host pools, controllers, the hash chain, the backend
factory and the storage threads are SGLang's own code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIMS = HERE / "shims"


def release_dir(release: str) -> Path:
    return Path(os.environ.get("HICACHE_SGLANG_DIR", ROOT / ".venv" / "sglang")) / release


class TritonShimFinder(importlib.abc.MetaPathFinder):
    """``import triton``: refused while torch decides whether it has Triton (``deciding``), then
    the shim from ``shims/``, whatever other ``triton`` the interpreter could find."""

    def __init__(self) -> None:
        self.deciding = True

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "triton":
            return None  # its submodules are found on the shim package's own path
        if self.deciding:
            raise ModuleNotFoundError("No module named 'triton' (hidden while torch decides)", name=name)
        return importlib.machinery.PathFinder.find_spec(name, [str(SHIMS)])


def install(release: str) -> None:
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before the SGLang bootstrap: run it first, in a fresh process")
    base = release_dir(release).parent
    own = release_dir(release)
    if own.is_dir():
        sys.path.insert(0, str(own))
    deps = base / "_deps"
    if deps.is_dir():
        sys.path.append(str(deps))
    finder = TritonShimFinder()
    sys.meta_path.insert(0, finder)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.runtime.triton_compat as triton_compat
    import torch.utils.flop_counter  # noqa: F401
    from torch.utils._triton import has_triton, has_triton_package

    if has_triton_package() or has_triton() or triton_compat.HAS_TRITON:
        raise RuntimeError("torch had already decided that Triton is available: run the bootstrap in a fresh process")
    finder.deciding = False
    sys.path.append(str(SHIMS))
    from hicache_draft.integrations.sglang_loader import ensure_sglang_package, sglang_version

    ensure_sglang_package()
    found = sglang_version()
    if found != release:
        raise RuntimeError(
            f"sglang {release} is not installed (found {found!r}); run 'scripts/setup.sh --test'"
        )
    os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
    os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
    importlib.invalidate_caches()
    # every release refuses a host pool unless the machine has 10 GiB available beyond it (a
    # serving host's reserve for its other processes): on a shared CPU box the cases' pools of a few
    # MiB would fail whenever others use the memory. Set before any module imports the constant.
    base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = HOST_MEMORY_RESERVE_BYTES


HOST_MEMORY_RESERVE_BYTES = 0
"""The reserve the cases run with (SGLang's own is 10 GiB): the pools must still fit the memory
the machine has available."""

