"""Inert stub of ``torchvision``: every ``torchvision.*`` module imports, every name in it is inert.

The only torchvision wheel matching this torch is a CUDA build whose ops fail on CPU torch. SGLang
imports it (``torchvision.transforms``, ...) for multimodal preprocessing only, never on the storage
path; anything that used it would raise ``InertStubError``.
"""

from _inert_stub import install

__version__ = "0.0.0+hicache-draft-stub"
__getattr__ = install("torchvision")
