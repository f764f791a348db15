"""Integrations of hicache-draft with serving engines.

Nothing here is imported by the core. :mod:`hicache_draft.integrations.sglang` needs the ``sglang``
package (any install, even ``pip install --no-deps``); the other modules do not.
"""
