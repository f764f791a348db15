"""Shim of ``triton.language``: names used in kernel signatures and annotations, nothing that runs."""

from __future__ import annotations

from typing import Any


class constexpr:  # noqa: N801  (triton's name)
    def __init__(self, value: Any = None) -> None:
        self.value = value


class dtype:  # noqa: N801
    def __init__(self, name: str) -> None:
        self.name = name


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return dtype(name)
