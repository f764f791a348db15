"""Shim of ``triton`` for SGLang on CPU: importable, with kernels that raise when launched.

SGLang's modules define Triton kernels at import time (``@triton.jit``, ``@triton.autotune``,
``triton.Config``, ``tl.constexpr`` annotations). None of them is on the storage path, and on a CPU
host none can run. Every kernel here raises :class:`TritonShimError` if SGLang ever launches it, so a
test that reached one fails loudly instead of passing on a fake result.
"""

from __future__ import annotations

from typing import Any

from _inert_stub import install

__version__ = "0.0.0+hicache-draft-shim"


class TritonShimError(RuntimeError):
    """A Triton kernel was launched under the test shim (there is no Triton on this host)."""


class _Kernel:
    def __init__(self, fn: Any = None, **_: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid: Any) -> _Kernel:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TritonShimError(f"triton kernel {self.__name__!r} launched, but triton is a test shim here")


def jit(fn: Any = None, **kwargs: Any) -> Any:
    if fn is None:
        return lambda f: _Kernel(f)
    return _Kernel(fn)


def autotune(*args: Any, **kwargs: Any) -> Any:
    return lambda f: f if isinstance(f, _Kernel) else _Kernel(f)


def heuristics(*args: Any, **kwargs: Any) -> Any:
    return autotune()


class Config:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


install("triton", real=("triton.language",))  # triton.language.extra.libdevice, triton.knobs, ...


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Kernel(None, name=name)
