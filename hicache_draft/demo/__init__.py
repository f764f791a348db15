"""The speculative-decoding restart demo (``hicache-draft demo``).

Small torch models that copy from context (an induction circuit with set weights plus seeded
noise), paged device KV pools, host pools, the cache controller and a storage backend: run 1
backs up target and draft KV, a fresh process restores both and decodes, a control restart
restores only the target. The DSA pair adds both models' indexer caches (row pools ``indexer`` and
``draft_indexer``) and controls without each. See :mod:`hicache_draft.demo.models` for how the
models are built.
"""
