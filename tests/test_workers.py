"""The Store's worker threads: a hung backend call never holds up the caller past its deadline,
nor the process's exit past it; an abandoned call that had not started never starts; a forked
child gets threads of its own; an unclosed store's threads end with it.

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

from hicache_draft import BackendContext, Buffer, Page, PageResult, PageTransfer, PoolKind, Store
from hicache_draft.testing import Faults, MemoryBackend
from hicache_draft.workers import DONE, Workers

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
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: answer through the pipe, never return into pytest
            code = 1
            try:
                MemoryBackend.calls.clear()
                t0 = time.monotonic()
                store.page_exists({KV: ["a"]})
                ran = [c for c, _ in MemoryBackend.calls] == ["page_exists"]
                code = 0 if ran and time.monotonic() - t0 < 2.5 else 3
            finally:
                os.write(w, bytes([code]))
                os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == b"\x00", f"the child's call did not run on a worker (code {got!r})"
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
