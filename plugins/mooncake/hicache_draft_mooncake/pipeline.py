"""Overlapping Python-side page work (copies, checksums) with native Mooncake calls.

A batch is cut into sub-batches of about ``pipeline_bytes``. Each sub-batch is *prepared* in
the calling thread (e.g. copied into staging and checksummed), moved by one *native* call on a
single persistent worker thread (the Mooncake client releases the GIL while it moves bytes),
and *finished* in the calling thread (e.g. verified and scattered). While sub-batch ``k`` moves,
the caller prepares ``k + 1`` (puts) or finishes ``k - 1`` (gets). At most two sub-batches are
in flight, so staging memory stays bounded.

Every sub-batch that was handed to the worker is waited for before :func:`run` returns, even
when preparing or finishing raised: a ``page_get`` must not return while the store may still
write into its buffers.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")
Prepared = Any


def split_by_bytes(items: Sequence[T], nbytes: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive groups of ``items`` of at most ``limit`` bytes each (a larger item stands alone).
    ``limit <= 0`` means one group."""
    if limit <= 0 or not items:
        return [list(items)] if items else []
    groups: list[list[T]] = []
    cur: list[T] = []
    size = 0
    for it in items:
        n = nbytes(it)
        if cur and size + n > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    groups.append(cur)
    return groups


def run(
    subs: Sequence[T],
    prepare: Callable[[T], Prepared],
    native: Callable[[Prepared], list[int]],
    finish: Callable[[T, Prepared, list[int] | None], None],
    release: Callable[[Prepared], None],
    worker: Executor | None,
    deadline: float,
) -> None:
    """Run ``native(prepare(sub))`` for each sub-batch and hand its return codes to ``finish``.

    ``finish`` gets ``None`` for a sub-batch that was not moved (deadline passed, or the native
    call raised); ``release`` runs once for every prepared sub-batch, last. With one sub-batch,
    or without a worker, everything runs in the calling thread.
    """

    def call(prep: Prepared) -> list[int] | None:
        if time.monotonic() >= deadline:
            return None
        return native(prep)

    inline = worker is None or len(subs) < 2
    pending: deque[tuple[T, Prepared, Future[list[int] | None] | list[int] | None]] = deque()

    def settle(entry: tuple[T, Prepared, Future[list[int] | None] | list[int] | None]) -> None:
        sub, prep, out = entry
        try:
            rcs = out.result() if isinstance(out, Future) else out
        except Exception:  # noqa: BLE001 (the sub-batch counts as not moved)
            rcs = None
        try:
            finish(sub, prep, rcs)
        finally:
            release(prep)

    try:
        for sub in subs:
            if time.monotonic() >= deadline:
                break
            prep = prepare(sub)
            if inline:
                try:
                    rcs = call(prep)
                except Exception:
                    release(prep)
                    raise
                pending.append((sub, prep, rcs))
            else:
                assert worker is not None
                pending.append((sub, prep, worker.submit(call, prep)))
            while len(pending) > 1:
                settle(pending.popleft())
        while pending:
            settle(pending.popleft())
    finally:
        while pending:  # an exception above: wait for what is in flight, then free it
            sub, prep, out = pending.popleft()
            if isinstance(out, Future):
                with contextlib.suppress(Exception):  # already failing; the buffers are free once it ends
                    out.result()
            release(prep)
