"""Helper of the inert stubs (``torchvision``, ``IPython``): every submodule imports, every name in
it is an inert object that raises :class:`InertStubError` when called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class InertStubError(RuntimeError):
    """Something used a package that is an inert test stub here."""


class Inert:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Inert:
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise InertStubError(f"{self._name} called, but it is an inert test stub here")

    def __mro_entries__(self, bases: tuple) -> tuple:  # ``class X(stub.Something)``
        return (object,)


def module_getattr(modname: str):  # noqa: ANN201
    def __getattr__(name: str) -> Any:  # noqa: N807
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert(f"{modname}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str, real: frozenset[str]) -> None:
        self.prefix = package + "."
        self.real = real

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith(self.prefix) and fullname not in self.real:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = module_getattr(spec.name)  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: str, real: tuple[str, ...] = ()) -> Any:
    """Serve every ``package.*`` submodule (except the ``real`` ones, which are files of the stub)
    as an inert module; returns the package's ``__getattr__``."""
    sys.meta_path.insert(0, _Finder(package, frozenset(real)))
    return module_getattr(package)
