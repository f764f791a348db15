"""Inert stub of ``IPython``: ``sglang/utils.py`` imports ``IPython.display`` for notebook helpers,
never used on the storage path; anything that used it would raise ``InertStubError``."""

from _inert_stub import install

__version__ = "0.0.0+hicache-draft-stub"
__getattr__ = install("IPython")
