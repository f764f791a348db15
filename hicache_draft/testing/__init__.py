"""The conformance kit for storage backends (a pytest plugin) and test helpers.

Backend authors: subclass :class:`ConformanceSuite` and provide a ``backend_factory`` fixture.
"""

from hicache_draft.testing.memory import Faults, MemoryBackend
from hicache_draft.testing.suite import Case, ConformanceSuite, PoolRig, declared_cases, make_spec, namespace_for

__all__ = [
    "Case",
    "ConformanceSuite",
    "Faults",
    "MemoryBackend",
    "PoolRig",
    "declared_cases",
    "make_spec",
    "namespace_for",
]
