"""``write_runs``: many ``write_records`` in one call, on the core's compiled threads, while the
backend's own thread runs ``meanwhile()``.

What it must keep: each run's file holds exactly the records ``write_records`` would write there,
every page's ``header`` buffer gets its header, the runs are shared with helper threads while
``meanwhile`` runs in the calling thread, a failing run answers its own ``OSError`` and leaves the
others written, nothing is written past the deadline or after the call, a page goes in one run
only, and an exception from ``meanwhile`` is raised only once no run is being written any more."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_draft.store as store_mod
from hicache_draft import Buffer, Page, PageTransfer, PoolKind, _native, attach_headers, make_header

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
NS = "ab" * 12
BIG = 1 << 20


def _pages(sizes: Sequence[int], pool: str, tag: int) -> tuple[list[Page], list[bytes]]:
    payloads = [os.urandom(n) for n in sizes]
    pages = []
    for i, data in enumerate(payloads):
        key = f"{tag:08x}{i:056x}"
        pages.append(Page(f"{key}.{NS}", key, NS, (Buffer.of(bytearray(data)) if data else Buffer(0, 0),)))
    return attach_headers([PageTransfer(pool, pages)], made=False)[0].pages, payloads


def _record(page: Page, pool: str, data: bytes) -> bytes:
    return make_header(page.key, NS, pool, [data]) + data


@settings(max_examples=25, deadline=None)
@given(
    runs=st.lists(st.lists(st.sampled_from([0, 1, 4096, 65536, 300_000, BIG + 1]), min_size=1, max_size=4),
                  min_size=1, max_size=5),
    chunk=st.sampled_from([4096, 256 << 10]),
    start=st.integers(0, 5000),
    threads=st.integers(1, 6),
)
def test_each_run_holds_exactly_the_records_write_records_would_write(runs, chunk, start, threads) -> None:
    kv, kv_data = _pages([n for sizes in runs for n in sizes], KV, 1)
    draft, draft_data = _pages([4096] * len(runs), DRAFT, 1)  # one draft page at the end of each run
    writer = store_mod._RecordWriter([PageTransfer(KV, kv), PageTransfer(DRAFT, draft)], time.monotonic() + 60)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in runs]
        plan, want, at = [], [], 0
        for r, sizes in enumerate(runs):
            refs = [(KV, i) for i in range(at, at + len(sizes))] + [(DRAFT, r)]
            plan.append((files[r].fileno(), start, refs))
            want.append(b"".join(_record(kv[i], KV, kv_data[i]) for i in range(at, at + len(sizes)))
                        + _record(draft[r], DRAFT, draft_data[r]))
            at += len(sizes)
        got = writer.write_runs(plan, threads, chunk)
        assert got == [len(w) for w in want]
        for f, w in zip(files, want, strict=True):
            f.seek(start)
            assert f.read() == w
        for p, d in zip(kv, kv_data, strict=True):
            assert bytes(p.header.view()) == make_header(p.key, NS, KV, [d])


def test_helpers_write_while_meanwhile_runs_in_the_calling_thread() -> None:
    """``meanwhile`` runs once, in the caller's thread, while the runs are already being written:
    it sees a run's bytes land before it returns (it waits for them), which only a helper thread
    can have written."""
    pages, _data = _pages([BIG] * 4, KV, 2)
    writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
    seen: list[tuple[int, int]] = []
    helped = _native.team_helped()
    files: list = []

    def meanwhile() -> None:
        end = time.monotonic() + 10
        while time.monotonic() < end and not any(os.fstat(f.fileno()).st_size for f in files):
            time.sleep(0.001)
        seen.append((threading.get_ident(), max(os.fstat(f.fileno()).st_size for f in files)))

    with contextlib.ExitStack() as stack:
        files.extend(stack.enter_context(tempfile.TemporaryFile()) for _ in range(4))
        got = writer.write_runs([(f.fileno(), 0, [(KV, i)]) for i, f in enumerate(files)], 8, 65536, meanwhile)
        assert got == [64 + BIG] * 4
        assert len(seen) == 1 and seen[0][0] == threading.get_ident() and seen[0][1] > 0
        assert _native.team_helped() > helped


def test_a_failing_run_answers_its_error_and_the_others_are_written() -> None:
    pages, data = _pages([65536, 65536, 65536], KV, 3)
    writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
    with tempfile.TemporaryFile() as a, tempfile.TemporaryFile() as b, open(os.devnull, "rb") as ro:
        got = writer.write_runs([(a.fileno(), 0, [(KV, 0)]), (ro.fileno(), 0, [(KV, 1)]), (b.fileno(), 0, [(KV, 2)])],
                                4, 65536)
        assert got[0] == got[2] == 64 + 65536
        assert isinstance(got[1], OSError) and not isinstance(got[1], TimeoutError) and got[1].errno is not None
        a.seek(0)
        b.seek(0)
        assert a.read() == _record(pages[0], KV, data[0]) and b.read() == _record(pages[2], KV, data[2])


def test_nothing_is_written_past_the_deadline_or_after_the_call() -> None:
    pages, _data = _pages([2 * BIG, 100], KV, 4)
    late = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() - 1)
    with tempfile.TemporaryFile() as f, tempfile.TemporaryFile() as g:
        got = late.write_runs([(f.fileno(), 0, [(KV, 0)]), (g.fileno(), 0, [(KV, 1)])], 4, 65536)
        assert all(isinstance(r, TimeoutError) for r in got)
        assert os.fstat(f.fileno()).st_size == os.fstat(g.fileno()).st_size == 0
        assert not any(any(p.header.view()) for p in pages)
        done = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
        done.close()
        with pytest.raises(RuntimeError, match="ended or was abandoned"):
            done.write_runs([(f.fileno(), 0, [(KV, 0)])], 4, 65536)
        assert os.fstat(f.fileno()).st_size == 0


def test_a_page_goes_in_one_run_and_must_be_in_the_call() -> None:
    pages, _data = _pages([4096, 4096], KV, 5)
    writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)
    with tempfile.TemporaryFile() as f:
        with pytest.raises(ValueError, match=r"write_runs: page 1 of pool .*kv.* is in two runs"):
            writer.write_runs([(f.fileno(), 0, [(KV, 0), (KV, 1)]), (f.fileno(), 9000, [(KV, 1)])], 2, 4096)
        with pytest.raises(ValueError, match=r"write_runs: no page 7 of pool .*kv.* in this call"):
            writer.write_runs([(f.fileno(), 0, [(KV, 7)])], 2, 4096)
        with pytest.raises(ValueError, match=r"no page 0 of pool .*draft"):
            writer.write_runs([(f.fileno(), 0, [(DRAFT, 0)])], 2, 4096)
        assert os.fstat(f.fileno()).st_size == 0
        # a refused request marks nothing: the same pages go out in a later one (a backend's retry)
        assert writer.write_runs([(f.fileno(), 0, [(KV, 0), (KV, 1)])], 2, 4096) == [2 * (64 + 4096)]


def test_what_meanwhile_raises_comes_once_every_run_is_written() -> None:
    pages, data = _pages([BIG, BIG], KV, 6)
    writer = store_mod._RecordWriter([PageTransfer(KV, pages)], time.monotonic() + 60)

    def meanwhile() -> None:
        raise LookupError("footer trouble")

    with tempfile.TemporaryFile() as f, tempfile.TemporaryFile() as g:
        with pytest.raises(LookupError, match="footer trouble"):
            writer.write_runs([(f.fileno(), 0, [(KV, 0)]), (g.fileno(), 0, [(KV, 1)])], 4, 65536, meanwhile)
        # no thread writes after the raise: both runs are complete already
        assert os.fstat(f.fileno()).st_size == os.fstat(g.fileno()).st_size == 64 + BIG
        f.seek(0)
        assert f.read() == _record(pages[0], KV, data[0])
