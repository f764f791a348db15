"""hicache-draft-mooncake: the Mooncake distributed KV store as a hicache-draft storage backend.

Entry point ``mooncake`` in group ``hicache_draft.backends``; CLI group ``hicache-draft mooncake``
(``up``, ``bench``) in group ``hicache_draft.commands``. pytest fixtures that start a real store:
:mod:`hicache_draft_mooncake.pytest_plugin` (opt-in, see the README).

The public names are imported lazily, so importing a submodule (the service helpers, the pytest
fixtures) imports neither the core, nor ``mooncake``, nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["MooncakeBackend", "MooncakeOptions", "__version__"]

if TYPE_CHECKING:
    from hicache_draft_mooncake.backend import MooncakeBackend
    from hicache_draft_mooncake.options import MooncakeOptions


def __getattr__(name: str) -> Any:  # noqa: ANN401 (module attributes of any type)
    if name == "MooncakeBackend":
        from hicache_draft_mooncake.backend import MooncakeBackend

        return MooncakeBackend
    if name == "MooncakeOptions":
        from hicache_draft_mooncake.options import MooncakeOptions

        return MooncakeOptions
    raise AttributeError(f"module 'hicache_draft_mooncake' has no attribute {name!r}")
