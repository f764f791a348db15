"""``read_runs``: the core reads many runs of a backend's stored records in one call, shared by
the calling thread and the core's compiled helper threads (``_native_team.c``).

What it must keep: every run gives exactly what ``read_check`` of that run alone gives, whatever
the number of runs and threads (every flipped byte and short record caught, every passing page
byte-exact); a failing read fails its run only; no run starts after the deadline; nothing is
touched after it returns; helpers really share the work; a forked child reads with helpers of its
own; and behind a Store, a page not in the call is refused before anything is read."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hicache_draft.store as store_mod
from hicache_draft import Buffer, Page, PageResult, PageTransfer, PoolKind, Store, _native, make_header
from hicache_draft.page_format import namespace_bytes, pool_code
from hicache_draft.testing import MemoryBackend

KV = PoolKind.KV
NS = "cd" * 12
CODE = pool_code(KV)
pytestmark = pytest.mark.usefixtures("reset_memory_backend")


def _records(path: Path, sizes: list[int], start: int, tag: int) -> tuple[list[str], list[bytes], list[int]]:
    """A file of records back to back from ``start``: keys, payloads and each record's end."""
    keys = [f"{tag:08x}{i:056x}.{NS}" for i in range(len(sizes))]
    payloads = [os.urandom(n) for n in sizes]
    blob = bytearray(start)
    ends = []
    for key, data in zip(keys, payloads, strict=True):
        blob += make_header(key, NS, KV, [data]) + data
        ends.append(len(blob))
    path.write_bytes(bytes(blob))
    return keys, payloads, ends


def _records_bytes(keys: list[str], payloads: list[bytes], start: int) -> bytes:
    """What _records wrote for these keys and payloads (its headers are deterministic)."""
    return bytes(start) + b"".join(make_header(k, NS, KV, [d]) + d for k, d in zip(keys, payloads, strict=True))


def _pages(keys: list[str], sizes: list[int]) -> tuple[list[Page], list[bytearray]]:
    keep: list[bytearray] = []
    pages = []
    for key, n in zip(keys, sizes, strict=True):
        head, body = bytearray(64), bytearray(n)
        keep += [head, body]
        pages.append(Page(key, key[:64], NS, (Buffer.of(body) if n else Buffer(0, 0),), Buffer.of(head)))
    return pages, keep


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layouts=st.lists(st.tuples(st.lists(st.integers(0, 70000), min_size=1, max_size=5), st.integers(0, 200),
                               st.lists(st.integers(0, 200000), max_size=2), st.one_of(st.none(), st.integers(0, 9))),
                     min_size=1, max_size=9),
    threads=st.integers(1, 6),
    chunk=st.sampled_from([4096, 65536, 256 << 10]),
)
def test_every_run_reads_as_it_would_alone(tmp_path_factory, layouts, threads, chunk) -> None:
    tmp = tmp_path_factory.mktemp("runs")
    runs, alone, fds, keep, expect = [], [], [], [], []
    try:
        for r, (sizes, start, flips, cut) in enumerate(layouts):
            path = tmp / f"r{r}"
            keys, payloads, ends = _records(path, sizes, start, r)
            blob = bytearray(path.read_bytes())
            for f in flips:
                if start <= f < len(blob):
                    blob[f] ^= 0x41
            if cut is not None:  # end of file inside the run
                del blob[start + (ends[-1] - start) * cut // 10 :]
            # ground truth: a page fails where a byte of its record changed or its record was cut
            clean = _records_bytes(keys, payloads, start)
            spans = [(e - 64 - n, e) for e, n in zip(ends, sizes, strict=True)]
            damaged = {j for j, (a, e) in enumerate(spans) if e > len(blob) or blob[a:e] != clean[a:e]}
            path.write_bytes(bytes(blob))
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            pages, bufs = _pages(keys, sizes)
            twin, twin_bufs = _pages(keys, sizes)
            keep += [bufs, twin_bufs]
            runs.append((fd, start, pages, CODE))
            alone.append(_native.read_check(fd, start, twin, CODE, namespace_bytes, chunk))
            expect.append((pages, twin, payloads, damaged))
        got = _native.read_runs(runs, namespace_bytes, chunk, threads, time.monotonic() + 60)
    finally:
        for fd in fds:
            os.close(fd)
    assert got == alone
    for (_nread, failed), (pages, twin, payloads, damaged) in zip(got, expect, strict=True):
        assert set(failed) == damaged
        for j, (p, t, data) in enumerate(zip(pages, twin, payloads, strict=True)):
            assert bytes(p.header.view()) == bytes(t.header.view())
            if j not in failed:  # a page that passed holds exactly the stored bytes
                assert bytes(p.buffers[0].view()) == data


def _one_file(tmp_path: Path, count: int, n: int) -> tuple[Path, list[str], list[bytes], list[int]]:
    path = tmp_path / "records"
    keys, payloads, ends = _records(path, [n] * count, 0, 7)
    return path, keys, payloads, ends


def test_a_failing_read_fails_its_run_only(tmp_path: Path) -> None:
    path, keys, payloads, ends = _one_file(tmp_path, 6, 50000)
    fd = os.open(path, os.O_RDONLY)
    dir_fd = os.open(tmp_path, os.O_RDONLY)  # preadv on a directory: EISDIR from the kernel
    try:
        a, ka = _pages(keys[:3], [50000] * 3)
        b, kb = _pages(keys[3:], [50000] * 3)
        got = _native.read_runs([(fd, 0, a, CODE), (dir_fd, ends[2], b, CODE)], namespace_bytes, 65536, 2,
                                time.monotonic() + 60)
    finally:
        os.close(fd)
        os.close(dir_fd)
    assert got[0] == (ends[2], [])
    assert isinstance(got[1], OSError) and got[1].errno == 21  # EISDIR
    assert [bytes(p.buffers[0].view()) for p in a] == payloads[:3]


def test_no_run_starts_after_the_deadline_and_none_touches_memory(tmp_path: Path) -> None:
    path, keys, _payloads, ends = _one_file(tmp_path, 4, 40000)
    fd = os.open(path, os.O_RDONLY)
    try:
        pages, keep = _pages(keys, [40000] * 4)
        got = _native.read_runs([(fd, ends[i] - 40064, [pages[i]], CODE) for i in range(4)], namespace_bytes,
                                65536, 4, time.monotonic() - 0.001)
    finally:
        os.close(fd)
    assert got == [None] * 4
    assert not any(any(b) for b in keep)


def test_helpers_share_the_runs(tmp_path: Path) -> None:
    _read_until_helped(tmp_path)


def _read_until_helped(tmp_path: Path) -> None:
    """Read 64 runs of 256 KiB with 4 threads, exactly, until a helper took part (at most 20 calls)."""
    path, keys, payloads, ends = _one_file(tmp_path, 64, 256 << 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _attempt in range(20):  # a helper that wakes after the caller took every run takes none
            before = _native.team_helped()
            pages, keep = _pages(keys, [256 << 10] * 64)
            got = _native.read_runs([(fd, ends[i] - (256 << 10) - 64, [pages[i]], CODE) for i in range(64)],
                                    namespace_bytes, 65536, 4, time.monotonic() + 60)
            assert got == [((256 << 10) + 64, [])] * 64
            assert [bytes(p.buffers[0].view()) for p in pages] == payloads
            if _native.team_helped() > before:
                break
        else:
            pytest.fail("no helper thread ever took part in 20 calls of 64 runs")
    finally:
        os.close(fd)


def _child_reads(path: str, count: int, n: int, ends: list[int], out: multiprocessing.Queue) -> None:
    keys = [f"{7:08x}{i:056x}.{NS}" for i in range(count)]
    fd = os.open(path, os.O_RDONLY)
    helped = 0
    for _attempt in range(20):
        before = _native.team_helped()
        pages, _keep = _pages(keys, [n] * count)
        got = _native.read_runs([(fd, ends[i] - n - 64, [pages[i]], CODE) for i in range(count)],
                                namespace_bytes, 65536, 4, time.monotonic() + 60)
        ok = all(g == (n + 64, []) for g in got)
        helped += _native.team_helped() > before
        if not ok or helped:
            break
    out.put((ok, helped))


def test_a_forked_child_reads_with_helpers_of_its_own(tmp_path: Path) -> None:
    path, _keys, _payloads, ends = _one_file(tmp_path, 64, 256 << 10)
    fd = os.open(path, os.O_RDONLY)
    try:  # the parent's helpers exist (and wait) before the fork
        pages, _keep = _pages(_keys, [256 << 10] * 64)
        _native.read_runs([(fd, ends[i] - (256 << 10) - 64, [pages[i]], CODE) for i in range(64)],
                          namespace_bytes, 65536, 4, time.monotonic() + 60)
    finally:
        os.close(fd)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(str(path), 64, 256 << 10, ends, out))
    child.start()
    try:
        ok, helped = out.get(timeout=60)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0 and ok and helped


def _store() -> Store:
    return Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": os.urandom(4).hex()})


def test_behind_a_store_read_runs_verifies_and_refuses_foreign_pages(tmp_path: Path) -> None:
    path, keys, payloads, ends = _one_file(tmp_path, 6, 30000)
    blob = bytearray(path.read_bytes())
    blob[ends[4] - 100] ^= 1  # page 4's payload rots
    path.write_bytes(bytes(blob))
    pages = [Page(k, k[:64], NS, (Buffer.of(bytearray(30000)),)) for k in keys]
    store = _store()
    fd = os.open(path, os.O_RDONLY)
    try:
        transfers = store.attach_headers([PageTransfer(KV, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers, time.monotonic() + 60)
        with pytest.raises(ValueError, match="no page 6"):  # nothing marked, nothing read
            early.read_runs([(fd, 0, [(KV, 0)]), (fd, ends[0], [(KV, 6)])], 2)
        got = early.read_runs([(fd, 0, [(KV, 0), (KV, 1), (KV, 2)]), (fd, ends[2], [(KV, 3), (KV, 4), (KV, 5)])], 2)
        assert got == [ends[2], ends[5] - ends[2]]
        with pytest.raises(ValueError, match="already read"):
            early.read_runs([(fd, 0, [(KV, 1)])], 1)
        out = {KV: [PageResult.OK] * 6}
        early.settle(out)
        assert out[KV] == [PageResult.OK] * 4 + [PageResult.CORRUPT, PageResult.OK]
        assert [bytes(transfers[0].pages[i].buffers[0].view()) for i in (0, 1, 2, 3, 5)] == \
            [payloads[i] for i in (0, 1, 2, 3, 5)]
        early.abandon()
        with pytest.raises(RuntimeError, match="abandoned"):
            early.read_runs([(fd, 0, [(KV, 0)])], 1)
    finally:
        os.close(fd)
        store.close()


@pytest.mark.parametrize("how", ["read_runs", "read_records", "finished"])
def test_pages_the_core_did_not_check_are_checked_after_the_call(tmp_path: Path, how: str) -> None:
    """A call whose checks all passed settles without looking again only when they covered every
    page: a backend that reads some pages through the core (or announces them) and reports all
    of them OK gets the rest checked after the call (zeroed headers: CORRUPT); a page announced
    twice is counted once."""
    path, keys, payloads, ends = _one_file(tmp_path, 4, 30000)
    pages = [Page(k, k[:64], NS, (Buffer.of(bytearray(30000)),)) for k in keys]
    store = _store()
    fd = os.open(path, os.O_RDONLY)
    try:
        transfers = store.attach_headers([PageTransfer(KV, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers, time.monotonic() + 60)
        if how == "read_runs":
            assert early.read_runs([(fd, 0, [(KV, 0)]), (fd, ends[0], [(KV, 1), (KV, 2)])], 2) == [ends[0],
                                                                                                   ends[2] - ends[0]]
        elif how == "read_records":
            assert early.read_records(fd, 0, [(KV, 0), (KV, 1), (KV, 2)]) == ends[2]
        else:
            with open(path, "rb") as f:  # the backend reads pages 0-2 itself, then announces them
                for i in range(3):
                    f.seek(ends[i] - 30000 - 64)
                    transfers[0].pages[i].header.view()[:] = f.read(64)
                    transfers[0].pages[i].buffers[0].view()[:] = f.read(30000)
            early.finished(KV, [0, 1, 2])
            early.finished(KV, [1, 2])  # announced again: neither checked nor counted twice
        assert early.clean == 3
        out = {KV: [PageResult.OK] * 4}  # page 3 was never read: its header is zeros
        early.settle(out)
        assert out[KV] == [PageResult.OK] * 3 + [PageResult.CORRUPT]
        assert [bytes(transfers[0].pages[i].buffers[0].view()) for i in range(3)] == payloads[:3]
    finally:
        os.close(fd)
        store.close()


def test_a_large_announcement_is_checked_by_the_core_threads(monkeypatch) -> None:
    """A backend that announces many bytes at once (``finished`` for a whole batch, as the Mooncake
    backend does after each native call) has them checked on the core's compiled threads, as
    after the call, not in its one thread (128 x 1 MiB took 15.8 ms in one thread on the H200
    host); a rotten page among them is still found, and only that one."""
    monkeypatch.setattr(store_mod, "_VERIFY_WORKERS", 4)
    asked: list[int] = []
    real = _native.mismatches

    def spy(pages, codes, ns, threads=1):  # noqa: ANN001, ANN202
        asked.append(threads)
        return real(pages, codes, ns, threads)

    monkeypatch.setattr(store_mod._native, "mismatches", spy)
    n, size = 8, 2 << 20  # 16 MiB: four checking threads of 4 MiB each
    keys = [f"{i:064x}.{NS}" for i in range(n)]
    pages, _keep = _pages(keys, [size] * n)
    for page in pages:
        data = os.urandom(size)
        page.buffers[0].view()[:] = data
        page.header.view()[:] = make_header(page.key, NS, KV, [data])
    pages[5].buffers[0].view()[size // 2] ^= 0xFF
    store = _store()
    try:
        early = store_mod._EarlyVerifier(store, [PageTransfer(KV, pages)], time.monotonic() + 60)
        early.finished(KV, range(n))
        assert asked == [4]
        out = {KV: [PageResult.OK] * n}
        early.settle(out)
        assert out[KV] == [PageResult.OK] * 5 + [PageResult.CORRUPT] + [PageResult.OK] * 2
        assert asked == [4]  # nothing was checked twice
    finally:
        store.close()


def test_a_run_that_was_not_read_is_checked_after_the_call(tmp_path: Path) -> None:
    """A run past the deadline (or whose read failed) is not taken as verified: a backend that
    still reports its pages OK gets them checked after the call, and they are CORRUPT."""
    path, keys, _payloads, ends = _one_file(tmp_path, 2, 30000)
    pages = [Page(k, k[:64], NS, (Buffer.of(bytearray(30000)),)) for k in keys]
    store = _store()
    fd = os.open(path, os.O_RDONLY)
    try:
        transfers = store.attach_headers([PageTransfer(KV, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers, time.monotonic() - 1)
        assert early.read_runs([(fd, 0, [(KV, 0), (KV, 1)])], 2) == [None]
        out = {KV: [PageResult.OK, PageResult.OK]}  # a backend that lies
        early.settle(out)
        assert out[KV] == [PageResult.CORRUPT, PageResult.CORRUPT]
    finally:
        os.close(fd)
        store.close()


def test_a_run_not_read_while_the_call_settles_is_still_checked(tmp_path: Path, monkeypatch) -> None:
    """The race a backend that returned too early opens: the call settles (its snapshot of the
    checks taken) while read_runs is still in flight, and then a run turns out not read. Those
    pages were marked as the call's check when the snapshot was taken; they must be checked, not
    taken as verified."""
    import threading

    path, keys, _payloads, _ends = _one_file(tmp_path, 2, 30000)
    pages = [Page(k, k[:64], NS, (Buffer.of(bytearray(30000)),)) for k in keys]
    store = _store()
    fd = os.open(path, os.O_RDONLY)
    out = {KV: [PageResult.OK, PageResult.OK]}  # what the backend answered (before the read ended)
    try:
        transfers = store.attach_headers([PageTransfer(KV, pages)], made=False)
        early = store_mod._EarlyVerifier(store, transfers, time.monotonic() + 60)
        settler = threading.Thread(target=early.settle, args=(out,))

        def late_read(*args: object) -> list:
            settler.start()  # the call settles now: snapshot, then it waits for this check
            t0 = time.monotonic()
            while early.open and time.monotonic() - t0 < 10:
                time.sleep(0.001)
            assert not early.open
            return [None]  # ... and the run was not read after all

        monkeypatch.setattr(store_mod._native, "read_runs", late_read)
        assert early.read_runs([(fd, 0, [(KV, 0), (KV, 1)])], 2) == [None]
        settler.join(timeout=10)
        assert not settler.is_alive()
        assert out[KV] == [PageResult.CORRUPT, PageResult.CORRUPT]
    finally:
        os.close(fd)
        store.close()


def test_helpers_are_named_and_block_every_signal(tmp_path: Path) -> None:
    """Helper threads show as ``hcd-team`` (top -H, /proc) and block every signal, so signals reach
    the process's own threads (where Python handles them) and a helper's read is never interrupted."""
    _read_until_helped(tmp_path)  # at least one helper has started
    masks = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "hcd-team":
                continue
            status = (task / "status").read_text()
        except FileNotFoundError:  # a thread that just ended
            continue
        masks.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16))
    assert masks, "no hcd-team thread in /proc/self/task"
    # signals 1-31, bit n-1 for signal n, but SIGKILL (9) and SIGSTOP (19), which no thread can block
    blockable = ((1 << 31) - 1) & ~(1 << (signal.SIGKILL - 1)) & ~(1 << (signal.SIGSTOP - 1))
    assert all(m & blockable == blockable for m in masks), [hex(m) for m in masks]


def test_many_calls_at_once_share_the_helpers_and_each_gets_its_own_bytes(tmp_path: Path) -> None:
    """Eight threads calling read_runs at once, over and over (several teams posted together, helpers
    moving between them): every call gets exactly its own file's bytes and results."""
    from concurrent.futures import ThreadPoolExecutor

    files = []
    for f in range(8):
        path = tmp_path / f"f{f}"
        keys, payloads, ends = _records(path, [30000 + 997 * f] * 12, 0, 100 + f)
        files.append((path, keys, payloads, ends))

    def reader(f: int) -> int:
        path, keys, payloads, ends = files[f]
        n = len(keys)
        size = 30000 + 997 * f
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(30):
                pages, _keep = _pages(keys, [size] * n)
                runs = [(fd, ends[i] - size - 64, [pages[i]], CODE) for i in range(n)]
                got = _native.read_runs(runs, namespace_bytes, 16384, 3, time.monotonic() + 60)
                assert got == [(size + 64, [])] * n
                assert [bytes(p.buffers[0].view()) for p in pages] == payloads
        finally:
            os.close(fd)
        return f

    with ThreadPoolExecutor(8) as ex:
        assert sorted(ex.map(reader, range(8))) == list(range(8))


def _mark_reference(runs, pages, slots, mark, codes):  # noqa: ANN001, ANN202 - the rule, in plain Python
    """What ``mark_runs`` must do, written out: every pair names a page of the call (an exact int
    index in range) not marked yet, which it marks; all or nothing."""
    marked, out = [], []
    for fd, offset, pairs in runs:
        run, run_codes = [], []
        for pool, i in pairs:
            ok = pool in pages and i.__class__ is int and 0 <= i < len(pages[pool])
            if not ok or slots[pool][i] is not None:
                for p, j in marked:
                    slots[p][j] = None
                raise ValueError(f"no page {i!r}" if not ok else "already read")
            slots[pool][i] = mark
            marked.append((pool, i))
            run.append(pages[pool][i])
            run_codes.append(codes[pool])
        same = len(set(run_codes)) <= 1
        out.append((fd, offset, run, (run_codes[0] if run_codes else 0) if same else bytes(run_codes)))
    return out


_PAIR = st.tuples(st.sampled_from([KV, PoolKind.DRAFT, "indexer", "nope"]),
                  st.one_of(st.integers(-2, 6), st.sampled_from([True, 1.0, "1", None])))


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.lists(_PAIR, max_size=6), max_size=5), lists=st.booleans(), premarked=st.integers(-1, 3))
def test_mark_runs_follows_the_marking_rule(runs, lists, premarked) -> None:
    """The compiled marking (``_native.mark_runs``, what the Store's ``read_records`` and
    ``read_runs`` use) does exactly what the rule says for any runs, foreign, repeated, mistyped or
    already-marked pages among them: the same pages and codes, or a ValueError naming the page
    with every slot as it was before the call."""
    pages = {KV: [f"kv{i}" for i in range(4)], PoolKind.DRAFT: [f"d{i}" for i in range(2)], "indexer": ["x0"]}
    codes = {p: pool_code(p) for p in pages}
    slots = {p: [None] * len(v) for p, v in pages.items()}
    if premarked >= 0:
        slots[KV][premarked] = "earlier"
    ref_slots = {p: list(v) for p, v in slots.items()}
    args = [(3 + k, 100 * k, [list(p) if lists else p for p in run] if lists else run) for k, run in enumerate(runs)]
    try:
        want = _mark_reference(args, pages, ref_slots, "m", codes)
    except ValueError as exc:
        before = {p: list(v) for p, v in slots.items()}
        with pytest.raises(ValueError, match="no page" if "no page" in str(exc) else "already read"):
            _native.mark_runs(args, pages, slots, "m", codes)
        assert slots == before
        return
    assert _native.mark_runs(args, pages, slots, "m", codes) == want
    assert slots == ref_slots
