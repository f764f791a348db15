"""The conformance kit for storage backends, and test helpers.

Backend authors: subclass :class:`ConformanceSuite` and provide a ``backend_factory`` fixture.
The kit's pytest plugin is opt-in (like pytest's own ``pytester``): load it with
``pytest_plugins = ["hicache_draft.testing.plugin"]`` in a ``conftest.py``, or ``-p hicache_draft.testing.plugin``.
"""

from hicache_draft.pools import import_torch

import_torch()  # quietly, before the modules that need it

from hicache_draft.testing.fork import CHILD_FALSE, CHILD_HUNG, CHILD_OK, CHILD_RAISED, in_forked_child  # noqa: E402
from hicache_draft.testing.memory import Faults, MemoryBackend  # noqa: E402
from hicache_draft.testing.suite import (  # noqa: E402
    KIT_POOLS,
    Case,
    ConformanceSuite,
    KitPool,
    PoolRig,
    declared_cases,
    make_spec,
)

__all__ = [
    "CHILD_FALSE",
    "CHILD_HUNG",
    "CHILD_OK",
    "CHILD_RAISED",
    "KIT_POOLS",
    "Case",
    "ConformanceSuite",
    "Faults",
    "KitPool",
    "MemoryBackend",
    "PoolRig",
    "declared_cases",
    "in_forked_child",
    "make_spec",
]
