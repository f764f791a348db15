"""The base class a storage backend subclasses, and the context it is built with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from hicache_draft.capabilities import Capabilities, PoolKind
from hicache_draft.hookspecs import hookimpl
from hicache_draft.transfer import PoolRegistration


class NoOptions(BaseModel):
    """Options model of a backend that takes none (unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class BackendContext:
    """What hicache-draft tells a backend when it builds it.

    ``tp_rank``/``tp_size``: this process's tensor-parallel place (keys already carry ranks where
    the bytes depend on them; this is for logging and per-rank resources). ``timeout_s``: the bound
    on every call, which the backend should also apply to its own waits.
    """

    tp_rank: int = 0
    tp_size: int = 1
    timeout_s: float = 10.0


class StorageBackend:
    """Subclass this, set the class attributes, and mark the methods you implement with
    ``@hookimpl`` (see :mod:`hicache_draft.hookspecs` for the contract).

    Class attributes:

    * ``capabilities``: a :class:`~hicache_draft.Capabilities` (or a dict of its fields).
    * ``Options``: a pydantic model for ``[backend_options]``; the default accepts none.
    * ``api_version``: the contract version you wrote against (required, no default: a backend
      written for an older contract must not silently claim a newer one).
    * ``default``: ``True`` makes this the backend used when a config names none (the embedded
      ``file`` backend sets it; two installed defaults are an error).

    The constructor receives the validated options and a :class:`BackendContext`. Raise
    :class:`~hicache_draft.BackendSetupError` with a message that names what to fix when the
    backend cannot start (a missing root, an unreachable master, ...).
    """

    api_version: ClassVar[int]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[BaseModel]] = NoOptions
    default: ClassVar[bool] = False

    def __init__(self, options: BaseModel, context: BackendContext) -> None:
        self.options = options
        self.context = context

    @classmethod
    def scratch_options(cls, directory: Path) -> dict[str, Any] | None:
        """``[backend_options]`` for a throwaway store kept under ``directory`` (an existing, empty
        directory), for ``hicache-draft demo``; ``None`` (the default): this backend cannot make one
        (the demo then needs its options from a config)."""
        return None

    def check_registration(self, registration: PoolRegistration) -> None:
        """Raise ValueError unless the pool's role, component and attention type are declared in
        ``capabilities``."""
        cap = type(self).capabilities
        caps = cap if isinstance(cap, Capabilities) else Capabilities.model_validate(cap)
        name = str(registration.pool)
        role = registration.role or PoolKind.KV
        pool = caps.pools.get(role)
        if pool is None:
            raise ValueError(f"this backend does not hold {role.value!r} pools (pool {name!r})")
        if registration.component not in pool.components:
            raise ValueError(
                f"this backend does not hold the {registration.component.value!r} component of {role.value!r} pools "
                f"(pool {name!r})"
            )
        if registration.attention is not None and registration.attention not in pool.attention:
            raise ValueError(f"this backend does not hold {registration.attention.value!r} pages in the {name!r} pool")

    @hookimpl
    def register_pool(self, registration: PoolRegistration) -> None:
        """Default: refuse what is not declared. Override (and call :meth:`check_registration`) to
        register memory with a transport."""
        self.check_registration(registration)
