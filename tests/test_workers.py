"""The Store's worker threads: a hung backend call never holds up the caller past its deadline,
nor the process's exit past it; an abandoned call that had not started never starts; a forked
child gets threads of its own; an unclosed store's threads end with it; the hand-over polls
(``_native.spin_wait`` / ``post_and_spin``) without losing or mixing up a result.

The Store-level tests here fail on the ThreadPoolExecutor the Store used before
(hicache_draft/workers.py says why each one did).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hicache_draft import BackendContext, Buffer, Page, PageResult, PageTransfer, PoolKind, Store, _native
from hicache_draft.testing import Faults, MemoryBackend
from hicache_draft.workers import DONE, Workers
from tests.helpers import in_forked_child

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("reset_memory_backend")

KV = PoolKind.KV


def _store(timeout_s: float, name: str = "memory") -> Store:
    return Store(name, MemoryBackend, MemoryBackend.capabilities, {}, BackendContext(timeout_s=timeout_s))


def _pages(n: int) -> tuple[list[Page], list[bytearray]]:
    keep = [bytearray(4096) for _ in range(n)]
    ns = "ab" * 12
    return [Page(f"{i:064x}.{ns}", f"{i:064x}", ns, (Buffer.of(b),)) for i, b in enumerate(keep)], keep


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_process_exit_waits_for_no_call_past_its_deadline(tmp_path):
    """A backend call that sleeps 25 s: the caller gives up at 0.3 s and the process exits at once
    (an executor joined that thread at exit, so the process lived the whole 25 s)."""
    script = textwrap.dedent("""
        import time
        from hicache_draft import BackendContext, Store
        from hicache_draft.testing import MemoryBackend
        MemoryBackend.faults.delay_s["page_exists"] = 25
        st = Store("memory", MemoryBackend, MemoryBackend.capabilities, {}, BackendContext(timeout_s=0.3))
        t0 = time.monotonic()
        print(st.page_exists({"kv": ["a"]}), round(time.monotonic() - t0, 1), flush=True)
        st.close()
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50, cwd=ROOT)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["{'kv':", "0}"], proc.stdout
    assert took < 15, f"the process took {took:.1f} s to exit behind a hung backend call"


def test_process_exit_lets_a_running_call_finish_within_its_deadline():
    """A call still inside its deadline at exit (one not waited for, here an unawaited one) finishes."""
    script = textwrap.dedent("""
        import threading, time
        from hicache_draft.workers import Workers
        w = Workers(1, "exit-test")
        def slow():
            time.sleep(0.5)
            print("finished", flush=True)
        w.submit(slow, {}, time.monotonic() + 30)
        time.sleep(0.1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "finished"


def test_an_abandoned_call_that_never_started_never_runs():
    """Four hung calls hold every worker; a fifth page_get gives up while queued and must never run
    later (an executor ran it once a worker was free: a read into slots handed back long before)."""
    store = _store(timeout_s=0.4)
    try:
        MemoryBackend.faults = Faults(delay_s={"page_exists": 1.5})
        hung = [threading.Thread(target=store.page_exists, args=({KV: ["k"]},)) for _ in range(4)]
        for t in hung:
            t.start()
        time.sleep(0.1)  # all four on the workers
        MemoryBackend.calls.clear()
        dst, _keep = _pages(2)
        rep = store.call("page_get", [PageTransfer(KV, dst, True)])
        assert rep.outcome == "timeout" and rep.results[KV] == [PageResult.FAILED] * 2
        assert rep.released.done(), "a call that never started touches nothing: released at once"
        for t in hung:
            t.join()
        time.sleep(0.3)  # a worker is free now: the old executor ran the abandoned get here
        assert [c for c, _ in MemoryBackend.calls] == [], MemoryBackend.calls
    finally:
        store.close()


def test_a_call_abandoned_while_running_is_released_when_it_returns():
    store = _store(timeout_s=0.2)
    try:
        MemoryBackend.faults = Faults(delay_s={"page_get": 0.6})
        dst, _keep = _pages(1)
        rep = store.call("page_get", [PageTransfer(KV, dst, True)])
        assert rep.outcome == "timeout" and not rep.released.done()
        rep.released.result(timeout=5)
        assert [c for c, _ in MemoryBackend.calls] == ["page_get"]
        MemoryBackend.faults = Faults()
        ok = store.call("page_get", [PageTransfer(KV, dst, True)])
        assert ok.outcome == "ok" and ok.released.done()
    finally:
        store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_calls_on_threads_of_its_own():
    """The parent used the store (its threads exist there only); the child's calls still run
    (an executor copied by fork believed its idle threads were there and queued forever)."""
    store = _store(timeout_s=3.0)
    try:
        store.page_exists({KV: ["a"]})
        def child() -> bool:
            MemoryBackend.calls.clear()
            t0 = time.monotonic()
            store.page_exists({KV: ["a"]})
            return [c for c, _ in MemoryBackend.calls] == ["page_exists"] and time.monotonic() - t0 < 2.5

        code = in_forked_child(child)
        assert code == 0, f"the child's call did not run on a worker (code {code})"
    finally:
        store.close()


def test_an_unclosed_store_takes_its_threads_with_it():
    store = _store(2.0, name="unclosed-probe")
    prefix = "hicache-draft-unclosed-probe"
    store.page_exists({KV: ["a"]})
    assert _threads(prefix)
    del store
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads(prefix) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _threads(prefix)


# -- Workers alone --------------------------------------------------------------------------
def test_workers_run_calls_and_report_errors():
    w = Workers(2, "unit-a")
    try:
        job = w.submit(lambda x: x * 2, {"x": 21}, time.monotonic() + 5)
        assert w.wait(job, time.monotonic() + 5) == (True, DONE) and job.value == 42 and job.error is None
        bad = w.submit(lambda: sys.exit(3), {}, time.monotonic() + 5)
        assert w.wait(bad, time.monotonic() + 5)[0] and isinstance(bad.error, SystemExit)
        seen = []
        w.submit(lambda: 1, {}, time.monotonic() + 5, then=seen.append)
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen[0].value == 1
    finally:
        w.shutdown()


def test_workers_start_no_more_threads_than_asked_and_only_when_calls_wait():
    w = Workers(3, "unit-b")
    try:
        for _ in range(20):  # one at a time: one thread serves them all
            job = w.submit(lambda: None, {}, time.monotonic() + 5)
            assert w.wait(job, time.monotonic() + 5)[0]
        assert len(_threads("unit-b")) == 1
        gate = threading.Event()
        jobs = [w.submit(gate.wait, {"timeout": 5}, time.monotonic() + 5) for _ in range(6)]
        time.sleep(0.2)
        assert len(_threads("unit-b")) == 3 and len(w.running()) == 3
        gate.set()
        assert all(w.wait(j, time.monotonic() + 5)[0] for j in jobs)
    finally:
        w.shutdown()
    deadline = time.monotonic() + 5
    while _threads("unit-b") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _threads("unit-b")


def test_shutdown_drops_calls_not_started_and_refuses_new_ones():
    w = Workers(1, "unit-c")
    gate = threading.Event()
    first = w.submit(gate.wait, {"timeout": 5}, time.monotonic() + 5)
    time.sleep(0.1)
    ran = []
    queued = w.submit(ran.append, {"object": 1}, time.monotonic() + 5)
    w.shutdown()
    assert w.wait(queued, time.monotonic() + 1)[0] and isinstance(queued.error, RuntimeError)
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit(lambda: None, {}, time.monotonic() + 5)
    gate.set()
    assert w.wait(first, time.monotonic() + 5)[0] and first.value is True
    time.sleep(0.1)
    assert ran == []


def test_workers_need_a_thread():
    with pytest.raises(ValueError, match="at least one thread"):
        Workers(0, "none")


# -- the polling hand-over ---------------------------------------------------------------------
def _int64(n: int) -> bytearray:
    return bytearray(n.to_bytes(8, sys.byteorder, signed=True))


def test_spin_wait_rings_once_then_sees_a_flag_another_thread_sets():
    flag, ring = bytearray(1), bytearray(8)
    setter = threading.Timer(0.05, flag.__setitem__, (0, 1))
    setter.start()
    t0 = time.monotonic()
    assert _native.spin_wait(flag, ring, 10.0)
    assert 0.04 <= time.monotonic() - t0 < 5.0
    assert int.from_bytes(ring, sys.byteorder) == 1
    setter.join()


def test_spin_wait_gives_up_at_its_time():
    flag, ring = bytearray(1), bytearray(8)
    t0 = time.monotonic()
    assert not _native.spin_wait(flag, ring, 0.05)
    assert 0.05 <= time.monotonic() - t0 < 5.0
    assert not _native.spin_wait(flag, ring, -1.0)  # past: one look
    assert int.from_bytes(ring, sys.byteorder) == 2


def test_post_and_spin_posts_then_waits_for_a_queued_call_and_its_caller():
    flag, ring = bytearray(1), bytearray(8)
    t0 = time.monotonic()
    assert not _native.post_and_spin(flag, _int64(0), ring, 0.05, 0.05)  # nothing queued
    assert flag[0] == 1 and 0.05 <= time.monotonic() - t0 < 5.0
    assert not _native.post_and_spin(bytearray(1), _int64(-1), ring, 0.0, 0.0)
    count = _int64(0)
    waiter = threading.Thread(target=_native.spin_wait, args=(bytearray(1), ring, 0.2))
    threading.Timer(0.05, count.__setitem__, (slice(0, 8), _int64(1))).start()
    threading.Timer(0.1, waiter.start).start()
    t0 = time.monotonic()
    assert _native.post_and_spin(bytearray(1), count, ring, 10.0, 10.0)  # the call, then its ring
    assert 0.09 <= time.monotonic() - t0 < 5.0
    waiter.join()


def test_the_hand_over_refuses_buffers_it_cannot_use():
    with pytest.raises(BufferError):
        _native.spin_wait(b"\0", bytearray(8), 0.0)
    with pytest.raises(ValueError, match="ring must be a writable buffer of at least 8 bytes"):
        _native.spin_wait(bytearray(1), bytearray(4), 0.0)
    with pytest.raises(ValueError, match="count must be a writable buffer of at least 8 bytes"):
        _native.post_and_spin(bytearray(1), bytearray(7), bytearray(8), 0.0, 0.0)
    with pytest.raises(ValueError, match="flag must be a writable buffer of at least 1 bytes"):
        _native.post_and_spin(bytearray(0), bytearray(8), bytearray(8), 0.0, 0.0)


class _NoLock:
    def acquire(self, *args: object, **kwargs: object) -> bool:
        raise AssertionError("the caller slept on the lock")


def test_a_caller_whose_call_returns_while_it_polls_never_sleeps_on_the_lock():
    w = Workers(1, "unit-poll", spin_s=10.0)
    try:
        for i in range(50):
            job = w.submit(lambda x: x + 1, {"x": i}, time.monotonic() + 30)
            job._finished = _NoLock()  # the worker only releases it
            job._finished.release = lambda: None  # type: ignore[method-assign]
            assert w.wait(job, time.monotonic() + 30) == (True, DONE) and job.value == i + 1
    finally:
        w.shutdown()


@pytest.mark.parametrize("spin_s", [0.0, 100e-6, 0.2])
def test_callers_on_many_threads_each_get_their_own_result(spin_s):
    w = Workers(2, f"unit-many-{spin_s}", spin_s=spin_s)
    errors: list[str] = []

    def caller(k: int) -> None:
        for i in range(200):
            x = k * 10_000 + i
            job = w.submit(lambda x: x * 3 if x % 7 else (time.sleep(0.001), x * 3)[1], {"x": x}, time.monotonic() + 30)
            returned, released = w.wait(job, time.monotonic() + 30)
            if not returned or released is not DONE or job.value != 3 * x:
                errors.append(f"{x}: {returned} {job.value}")

    callers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
    finally:
        w.shutdown()
    assert not errors and not any(t.is_alive() for t in callers)


def test_a_call_longer_than_the_poll_is_waited_for_on_the_lock():
    w = Workers(1, "unit-long", spin_s=1e-3)
    try:
        job = w.submit(lambda: (time.sleep(0.2), "late")[1], {}, time.monotonic() + 30)
        t0 = time.monotonic()
        assert w.wait(job, time.monotonic() + 30) == (True, DONE) and job.value == "late"
        assert time.monotonic() - t0 >= 0.15
        job = w.submit(lambda: (time.sleep(0.5), "later")[1], {}, time.monotonic() + 30)
        returned, released = w.wait(job, time.monotonic() + 0.1)  # gives up, then released on return
        assert not returned and released.result(timeout=5) is None and job.value == "later"
    finally:
        w.shutdown()


def test_drain_waits_for_queued_and_running_calls_each_until_its_deadline():
    """What close() of a controller and the interpreter's exit wait for: every call not yet
    returned, the queued ones too, but none past its own deadline."""
    w = Workers(1, "drain-probe", spin_s=0.0)
    ran: list[int] = []

    def slow(x: int) -> None:
        time.sleep(0.2)
        ran.append(x)

    try:
        now = time.monotonic()
        w.submit(slow, {"x": 1}, now + 5)
        w.submit(slow, {"x": 2}, now + 5)  # queued behind the first on the only thread
        w.drain()
        assert ran == [1, 2]
        hung = threading.Event()
        w.submit(hung.wait, {"timeout": 10}, time.monotonic() + 0.3)
        t0 = time.monotonic()
        w.drain()
        assert 0.25 < time.monotonic() - t0 < 2.0
        hung.set()
    finally:
        w.shutdown()
