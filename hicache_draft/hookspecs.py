"""The storage contract, as pluggy hook specifications (project name ``hicache_draft``).

A backend is a class whose methods are marked with :data:`hookimpl`. hicache-draft builds one
instance per store and registers it with its own :class:`pluggy.PluginManager`, together with any
observer plugins (metrics, tracing) that wrap the calls with ``@hookimpl(wrapper=True)``.

Rules every backend keeps:

* Results are per page: a batch may partly fail. Return one :class:`~hicache_draft.PageResult`
  per page, in order.
* Integrity is the core's. Every page carries a 64-byte ``header`` buffer: on ``page_set`` the
  header the core made (magic, key digest, namespace, payload length and xxh3 checksum): store it
  with the page's bytes; on ``page_get`` write the stored header into it. The core verifies header
  and payload of every page you report ``OK``; a mismatch is counted ``CORRUPT``, never data. So a
  backend need not re-verify, but may (to report ``CORRUPT`` itself, or to drop a bad copy).
* Do not raise for I/O trouble: report ``FAILED`` (hicache-draft also turns exceptions and
  timeouts into ``FAILED``, but the backend knows better which pages failed).
* Respect ``deadline`` (a :func:`time.monotonic` value). A call still running at its deadline is
  abandoned: its pages count as ``FAILED`` whatever it returns later, and the memory it was given
  stays reserved until it returns. Do not touch the buffers after the deadline.
* A hookimpl may take any subset of a hook's arguments, by name. A misspelt argument or hook
  name is refused when the backend is registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import pluggy

from hicache_draft.capabilities import PoolKind
from hicache_draft.transfer import Buffer, PageResult, PageTransfer, PoolRegistration

PROJECT = "hicache_draft"
API_VERSION = 2
"""The storage contract version. A backend class declares ``api_version``; a different version is
refused by name and reason at discovery. 2: pages carry the core's ``header`` (store it on set,
return it on get); the core verifies every restored page."""

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
def page_set(
    transfers: Sequence[PageTransfer],
    deadline: float,
    write_records: Callable[[int, int, Sequence[tuple[str, int]], int], int],
    make_headers: Callable[..., None],
    write_runs: Callable[..., list[int | OSError]],
) -> Mapping[str, Sequence[PageResult]]:
    """Store pages. ``transfers`` holds one :class:`PageTransfer` per pool (target and draft of
    one backup come in one call). Read each page's bytes from its buffers.

    Return, for every pool in ``transfers``, one result per page: ``OK`` when the page and its
    ``header`` are stored (or were already stored: equal keys mean equal bytes, so skipping is
    fine) or ``FAILED``. The buffers are only valid until the call returns or its deadline passes.

    ``write_records(fd, offset, pages, chunk)`` (``pages``: ``(pool, index)`` pairs; given when the
    backend declares ``Capabilities.writes_records``, and then the pages' headers are zeroed): the
    core writes those pages to ``fd`` from ``offset`` back to back in its page format (each page's
    64-byte header, then its payload), in calls that end on multiples of ``chunk`` in the file,
    making each header from the bytes as they go out (in the CPU cache: one pass over the memory)
    and putting it into ``page.header`` as well, without the GIL. It returns the bytes written,
    raises ``OSError`` as a write would, ``TimeoutError`` at the call's deadline (nothing more is
    read or written) and ``RuntimeError`` once the call has been abandoned.

    ``write_runs(runs, threads, chunk, meanwhile=None)`` (given with ``write_records``; ``runs``:
    ``(fd, offset, pages)`` each, a page in one run only): many ``write_records`` in one call, shared
    by your thread and up to ``threads - 1`` of the core's own threads (compiled, no GIL: they start
    together and each takes the next run as it gets free, where Python threads start one after
    another through the GIL). ``meanwhile()``, if given, runs in your thread while they write (work
    that needs none of the runs' bytes, such as making an index); your thread then takes any run not
    yet taken. Per run it returns the bytes written or the ``OSError`` its writes raised
    (``TimeoutError``: the deadline passed before or while it was written); it returns, or raises
    what ``meanwhile`` raised, only once no run is being written any more.

    ``make_headers(pool, indices)`` (given when the backend declares
    ``Capabilities.headers_on_demand``, and then the pages' headers are zeroed): the core makes the
    headers of those pages of ``pool``'s transfer from their bytes into ``page.header``, without the
    GIL; call it for each piece of the batch just before you send that piece, so that the core hashes
    one piece while the one before moves. ``make_headers(pool, indices, into)``, ``into`` one writable
    buffer per index (in the same order, each at least 64 bytes plus the page's bytes), also writes
    each page's record there (its header, then its payload), the header made from the copy as it is
    copied: for a backend that copies pages into its own staging memory anyway, one pass over the
    page's memory instead of two. It raises ``ValueError`` for a page not in the call (or given
    twice with ``into``, or a destination too small) and ``RuntimeError`` once the call has returned
    or was abandoned (then nothing is made or written).
    """


@hookspec(firstresult=True)
def page_get(
    transfers: Sequence[PageTransfer],
    deadline: float,
    finished: Callable[[PoolKind, Iterable[int]], None],
    read_records: Callable[[int, int, Sequence[tuple[str, int]]], int],
    read_runs: Callable[[Sequence[tuple[int, int, Sequence[tuple[str, int]]]], int], list[int | OSError | None]],
) -> Mapping[str, Sequence[PageResult]]:
    """Load pages into the given buffers, which the backend fills completely, and each page's
    stored 64-byte header into ``page.header``.

    Return one result per page: ``OK`` (header and buffers hold exactly the stored bytes), ``MISS``,
    ``CORRUPT`` (stored data failed validation; leave it unreturned) or ``FAILED``. The core
    verifies every ``OK`` page against its header; one that does not match counts as ``CORRUPT``.

    ``finished(pool, indices)`` (optional to use): tell the core that those pages of ``pool``'s
    transfer hold their final header and bytes. The core verifies them right then, in your thread,
    while their bytes are still in its cache (call it from each of your reader threads, right after
    its read). After it, as after returning, do not write those pages' buffers again. Only the
    results you return decide what counts.

    ``read_records(fd, offset, pages)`` (optional to use; ``pages``: ``(pool, index)`` pairs): for
    backends that keep pages in files in the core's page format (each page's 64-byte header, then
    its payload, back to back): the core reads those records from ``fd`` at ``offset`` into the
    pages' headers and buffers itself and verifies each as its bytes land (in the CPU cache: one
    pass over the memory instead of two), without the GIL; it returns the bytes read (fewer only at
    end of file) and the pages count as finished. It raises ``OSError`` as a read would, and
    ``RuntimeError`` once the call has been abandoned (its memory is no longer yours).

    ``read_runs(runs, threads)`` (optional to use; ``runs``: ``(fd, offset, pages)`` each): many
    ``read_records`` in one call, shared by your thread and up to ``threads - 1`` of the core's
    own threads (compiled, no GIL: they start together and each takes the next run as it gets
    free). Per run it returns the bytes read, the ``OSError`` its read raised, or ``None`` when the
    run was not started by ``deadline``; a run that was read counts as finished.
    A page whose result is not ``OK`` may have buffers partly written; the controller treats
    them as garbage. Once ``page_get`` has returned, it must not touch the buffers again.
    """


@hookspec
def page_rejected(rejected: Mapping[str, Sequence[str]]) -> None:
    """Optional: pages you answered ``OK`` that failed the core's verification (key by pool).

    Your copy of them is bad (torn, rotten, foreign): drop or quarantine it, so the next read is a
    clean miss and a later backup can store the page again. Called on a store worker thread after
    the ``page_get`` that returned them, not awaited by the caller; a backend that implements it
    can leave payload verification to the core entirely."""


@hookspec(firstresult=True)
def page_exists(queries: Mapping[str, Sequence[str]], deadline: float) -> Mapping[str, int]:
    """For each pool, how many leading keys of its list are stored (stop at the first missing).

    ``queries`` maps a pool to keys in prefix order. An error counts as "not stored" from that
    key on. This is a hint for planning; ``page_get`` is what decides.
    """


@hookspec(firstresult=True)
def host_memory(pool: str, nbytes: int) -> Buffer | None:
    """Optionally provide the memory for a host pool, before it is built.

    Return a :class:`~hicache_draft.Buffer` of at least ``nbytes`` bytes (e.g. from a shared-memory
    segment the store reads directly; keep it alive through ``owner``), or ``None`` to let
    hicache-draft allocate (pinned when CUDA is available). Called once per pool.
    """


@hookspec
def call_done(
    backend: str,
    hook: str,
    outcome: str,
    seconds: float,
    transfers: Sequence[PageTransfer],
    results: Mapping[str, Sequence[PageResult]],
) -> None:
    """For observers (metrics, tracing): a ``page_set``, ``page_get`` or ``page_exists`` call of
    the store is over, as the caller sees it.

    ``outcome``: ``"ok"``, ``"timeout"`` (abandoned at its deadline) or ``"error"`` (raised, or
    returned the wrong shape). ``seconds``: wall time the caller waited. ``results``: the final
    per-page results after the core's verification (a page the backend called ``OK`` that failed
    it is ``CORRUPT`` here); for ``page_exists`` the leading pages stored per pool are ``OK`` and
    the rest ``MISS``. ``transfers``: the pages as the backend was handed them, each with its
    header (empty for ``page_exists``). Called in the caller's thread after the call: keep it
    cheap; an exception is logged and ignored."""


@hookspec
def close() -> None:
    """Release connections, files and registered memory. Called once; no call follows."""
