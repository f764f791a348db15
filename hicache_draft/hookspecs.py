"""The storage contract, as pluggy hook specifications (project name ``hicache_draft``).

A backend is a class whose methods are marked with :data:`hookimpl`. hicache-draft builds one
instance per store and registers it with its own :class:`pluggy.PluginManager`, together with any
observer plugins (metrics, tracing) that wrap the calls with ``@hookimpl(wrapper=True)``.

Rules every backend keeps:

* Results are per page: a batch may partly fail. Return one :class:`~hicache_draft.PageResult`
  per page, in order. Never return data you could not validate: a corrupt page is ``CORRUPT``.
* Do not raise for I/O trouble: report ``FAILED`` (hicache-draft also turns exceptions and
  timeouts into ``FAILED``, but the backend knows better which pages failed).
* Respect ``deadline`` (a :func:`time.monotonic` value) where you can; every call is bounded.
* A hookimpl may take any subset of a hook's arguments, by name. A misspelt argument or hook
  name is refused when the backend is registered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pluggy

from hicache_draft.capabilities import PoolKind
from hicache_draft.transfer import Buffer, PageResult, PageTransfer, PoolRegistration

PROJECT = "hicache_draft"
API_VERSION = 1
"""The storage contract version. A backend class declares ``api_version``; a different major
version is refused by name and reason at discovery."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_pool(registration: PoolRegistration) -> None:
    """A host pool is about to be used. Called once per pool, before any page I/O.

    Zero-copy backends register ``registration.regions`` (and ``registration.staging``) with
    their transport here. Raise to refuse the pool; the controller then disables that pool's
    offload with your message as the reason.
    """


@hookspec(firstresult=True)
def page_set(transfers: Sequence[PageTransfer], deadline: float) -> Mapping[PoolKind, Sequence[PageResult]]:
    """Store pages. ``transfers`` holds one :class:`PageTransfer` per pool (target and draft of
    one backup come in one call). Read each page's bytes from its buffers.

    Return, for every pool in ``transfers``, one result per page: ``OK`` when the page is stored
    (or was already stored: equal keys mean equal bytes, so skipping is fine) or ``FAILED``.
    The buffers are only valid during the call.
    """


@hookspec(firstresult=True)
def page_get(transfers: Sequence[PageTransfer], deadline: float) -> Mapping[PoolKind, Sequence[PageResult]]:
    """Load pages into the given buffers, which the backend fills completely.

    Return one result per page: ``OK`` (buffers hold exactly the stored bytes), ``MISS``,
    ``CORRUPT`` (stored data failed validation; leave it unreturned) or ``FAILED``.
    A page whose result is not ``OK`` may have buffers partly written; the controller treats
    them as garbage. Once ``page_get`` has returned, it must not touch the buffers again.
    """


@hookspec(firstresult=True)
def page_exists(queries: Mapping[PoolKind, Sequence[str]], deadline: float) -> Mapping[PoolKind, int]:
    """For each pool, how many leading keys of its list are stored (stop at the first missing).

    ``queries`` maps a pool to keys in prefix order. An error counts as "not stored" from that
    key on. This is a hint for planning; ``page_get`` is what decides.
    """


@hookspec(firstresult=True)
def host_memory(pool: PoolKind, nbytes: int) -> Buffer | None:
    """Optionally provide the memory for a host pool, before it is built.

    Return a :class:`~hicache_draft.Buffer` of at least ``nbytes`` bytes (e.g. from a shared-memory
    segment the store reads directly; keep it alive through ``owner``), or ``None`` to let
    hicache-draft allocate (pinned when CUDA is available). Called once per pool.
    """


@hookspec
def close() -> None:
    """Release connections, files and registered memory. Called once; no call follows."""
