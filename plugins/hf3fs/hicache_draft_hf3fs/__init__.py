"""hicache-draft-hf3fs: what a DeepSeek 3FS (usrbio) backend supports, declared as data.

This distribution is a stub. It publishes the declaration (so ``hicache-draft backends`` lists it
and ``hicache-draft check`` plans every pool's path against it) and validates its options, but
3FS I/O is not implemented: constructing the backend raises
:class:`hicache_draft.BackendSetupError` saying what a real deployment needs.
"""

from hicache_draft_hf3fs.backend import Hf3fsBackend
from hicache_draft_hf3fs.declaration import HF3FS_CAPABILITIES
from hicache_draft_hf3fs.options import Hf3fsOptions

__all__ = ["HF3FS_CAPABILITIES", "Hf3fsBackend", "Hf3fsOptions"]
