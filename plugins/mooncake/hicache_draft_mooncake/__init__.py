"""hicache-draft-mooncake: the Mooncake distributed KV store as a hicache-draft storage backend.

Entry point ``mooncake`` in group ``hicache_draft.backends``; CLI group ``hicache-draft mooncake``
(``up``, ``bench``) in group ``hicache_draft.commands``.
"""

from hicache_draft_mooncake.backend import MooncakeBackend
from hicache_draft_mooncake.options import MooncakeOptions

__version__ = "0.1.0"

__all__ = ["MooncakeBackend", "MooncakeOptions", "__version__"]
