"""The core's compiled helper threads: woken ahead of a call that will share work with them, awake
for a bounded while after their work, asleep otherwise (they must not burn a core for nothing).

CPU is measured with ``time.process_time`` (this process only: other load on the machine does not
count), over windows long against the bounds (2 ms for a caller's expectation; ``team_spin``)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from hicache_draft import Capabilities, PageResult, PageTransfer, PoolKind, Store, _native, hookimpl
from hicache_draft.backend import BackendContext
from hicache_draft.testing import MemoryBackend
from hicache_draft.transfer import Buffer, Page

KV = PoolKind.KV


@pytest.fixture
def spin() -> Iterator[None]:
    """Restore the process's helper setting after a test that changes it."""
    was = _native.team_spin()
    yield
    _native.team_spin(was)
    assert _native.team_expecting() == 0


def _team(threads: int = 2, nbytes: int = 1 << 16) -> None:
    """One shared call (copy_regions, one region of ``nbytes`` per thread)."""
    src = [bytearray(secrets.token_bytes(nbytes)) for _ in range(threads)]
    dst = [bytearray(nbytes) for _ in range(threads)]
    _native.copy_regions([Buffer.of(d).ptr for d in dst], [Buffer.of(s).ptr for s in src], nbytes, threads)
    assert dst == src


def _helped_team() -> None:
    """A shared call long enough that a helper takes a piece of it (a sleeping thread wakes in
    tens of microseconds, on a VM up to milliseconds: the calling thread alone would finish a short
    call first)."""
    for _ in range(20):
        before = _native.team_helped()
        _team(2, 32 << 20)
        if _native.team_helped() > before:
            return
    raise AssertionError("no helper took part in 20 calls of 2 x 32 MiB copies")


def _cpu_over(seconds: float) -> float:
    """CPU seconds this process used while its calling thread slept ``seconds``."""
    t0 = time.process_time()
    time.sleep(seconds)
    return time.process_time() - t0


class _Cpu:
    """CPU this process uses beyond its background (threads of earlier tests: stores' pollers,
    clients), measured first with every helper asleep."""

    def __init__(self) -> None:
        was = _native.team_spin(0)
        time.sleep(0.05)  # any helper still awake from earlier work sleeps by now
        self.rate = _cpu_over(0.2) / 0.2
        _native.team_spin(was)

    def over(self, seconds: float) -> float:
        return _cpu_over(seconds) - self.rate * seconds


def test_team_spin_is_a_setting_that_answers_what_it_was(spin):
    _native.team_spin(123_000)
    assert _native.team_spin() == 123_000
    assert _native.team_spin(0) == 123_000
    assert _native.team_spin(-1) == 0  # -1 only asks
    assert _native.team_spin() == 0


def test_helpers_woken_ahead_are_awake_while_expected_and_sleep_once_it_ends(spin):
    _native.team_spin(0)
    _team()  # a helper exists and sleeps
    cpu = _Cpu()
    seen = []
    for _ in range(5):  # a loaded machine may keep a woken thread off the CPU for a while
        time.sleep(0.05)
        _native.team_expect(2)
        try:
            awake = cpu.over(0.05)  # woken (on a VM within milliseconds), the helper spins up to 2 ms
        finally:
            _native.team_unexpect()
        seen.append(awake)
        if awake >= 0.001:
            break
    asleep = cpu.over(0.2)
    assert max(seen) >= 0.001, f"no helper was woken ahead: {[round(x * 1e3, 2) for x in seen]} ms of CPU in 50 ms"
    assert asleep < 0.02, f"helpers kept a core busy after the expectation ended: {asleep * 1e3:.1f} ms in 200 ms"


def test_an_expectation_never_ended_holds_helpers_awake_only_within_its_bound(spin):
    _native.team_spin(0)
    _team()
    base = _Cpu()
    _native.team_expect(2)
    try:
        time.sleep(0.01)  # past the 2 ms bound
        cpu = base.over(0.2)
    finally:
        _native.team_unexpect()
    assert cpu < 0.02, f"a forgotten expectation kept helpers awake: {cpu * 1e3:.1f} ms of CPU in 200 ms"


def test_a_helper_stays_awake_after_its_work_for_team_spin_then_sleeps(spin):
    cpu = _Cpu()
    _native.team_spin(int(0.1e9))  # 100 ms
    _helped_team()
    awake = cpu.over(0.05)
    time.sleep(0.1)
    asleep = cpu.over(0.2)
    assert awake >= 0.02, f"the helper slept at once: {awake * 1e3:.1f} ms of CPU in 50 ms"
    assert asleep < 0.02, f"the helper stayed awake past team_spin: {asleep * 1e3:.1f} ms in 200 ms"
    _native.team_spin(0)
    _helped_team()
    after = cpu.over(0.1)
    assert after < 0.01, f"team_spin 0 and still awake: {after * 1e3:.1f} ms in 100 ms"


def test_shared_calls_stay_exact_while_helpers_are_woken_ahead_and_spin(spin):
    """Many threads post teams while others expect and end expectations: every copy exact."""
    _native.team_spin(200_000)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(200):
                if (seed + i) % 3 == 0:
                    _native.team_expect(4)
                    try:
                        _team(4)
                    finally:
                        _native.team_unexpect()
                else:
                    _team(1 + (seed + i) % 4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


class _Records(MemoryBackend):
    """A backend that declares the core's records (the file backend's capability): the Store wakes
    every helper ahead of its calls. Its page_get can raise or outlive the call's deadline."""

    capabilities: ClassVar[Capabilities] = MemoryBackend.capabilities.model_copy(update={"writes_records": True})
    behave: ClassVar[str] = "ok"

    @hookimpl
    def page_get(self, transfers):  # noqa: ANN001
        if type(self).behave == "raises":
            raise OSError("injected")
        if type(self).behave == "late":
            time.sleep(0.3)
        return {t.pool: [PageResult.MISS] * len(t.pages) for t in transfers}


def _get(store: Store, n: int = 4) -> list[PageResult]:
    buf = bytearray(4096 * n)
    whole = Buffer.of(buf)
    pages = [Page(secrets.token_hex(32), secrets.token_hex(32), "ns",
                  (Buffer(whole.ptr + i * 4096, 4096, owner=whole),)) for i in range(n)]
    got, _ = store.page_get([PageTransfer(KV, pages)])
    return got[KV]


@pytest.mark.parametrize("behave", ["ok", "raises", "late"])
def test_the_store_wakes_helpers_ahead_of_a_records_backend_and_always_ends_it(monkeypatch, spin, behave):
    calls: list[object] = []
    expect, unexpect = _native.team_expect, _native.team_unexpect
    monkeypatch.setattr(_native, "team_expect", lambda n: (calls.append(n), expect(n))[1])
    monkeypatch.setattr(_native, "team_unexpect", lambda: (calls.append("end"), unexpect())[1])
    backend = type("R", (_Records,), {"behave": behave})
    store = Store("records", backend, backend.capabilities, {"space": secrets.token_hex(4)},
                  BackendContext(timeout_s=0.1))
    try:
        t0 = time.monotonic()
        got = _get(store)
        took = time.monotonic() - t0
        # the backend's answer (misses) or the core's failures for a call that raised or timed out
        assert got == [PageResult.MISS if behave == "ok" else PageResult.FAILED] * 4
        assert behave != "late" or took < 0.25  # returned at the 0.1 s deadline, the hook still asleep
        assert _native.team_expecting() == 0  # ended when the call returned, even raised or timed out
        assert len(calls) == 2 and calls[1] == "end" and isinstance(calls[0], int) and calls[0] > 1
    finally:
        store.close()


def test_the_store_wakes_no_helper_for_another_backend_or_with_polling_off(monkeypatch, spin):
    calls: list[object] = []
    monkeypatch.setattr(_native, "team_expect", lambda n: calls.append(n))
    monkeypatch.setattr(_native, "team_unexpect", lambda: calls.append("end"))
    plain = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": secrets.token_hex(4)})
    off = Store("records", _Records, _Records.capabilities, {"space": secrets.token_hex(4)}, poll_s=0.0)
    try:
        _get(plain, 8192)  # 32 MiB, verified on several threads, but only after the pages moved
        _get(off)  # a host short of CPU (handover_poll_us 0): nothing is woken ahead
    finally:
        plain.close()
        off.close()
    assert calls == []


def test_a_store_keeps_helpers_awake_a_while_after_their_work_unless_it_polls_nothing(spin):
    from hicache_draft.store import _HELPERS_AWAKE_S

    _native.team_spin(0)
    quiet = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": secrets.token_hex(4)}, poll_s=0.0)
    quiet.close()
    assert _native.team_spin() == 0  # a host short of CPU: nothing spins
    store = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": secrets.token_hex(4)})
    store.close()
    assert _native.team_spin() == int(_HELPERS_AWAKE_S * 1e9)
    longer = Store("memory", MemoryBackend, MemoryBackend.capabilities, {"space": secrets.token_hex(4)}, poll_s=0.005)
    longer.close()
    assert _native.team_spin() == 5_000_000  # the longest of the process's stores


_ONE_CPU_CHILD = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})  # before any helper exists: they inherit it
from hicache_draft import _native
from tests.test_helper_threads import _helped_team


def share():
    # the most of the one CPU this thread gets in three windows of 0.1 s of busy work
    best = 0.0
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < 0.1:
            pass
        best = max(best, (time.thread_time() - c0) / (time.perf_counter() - t0))
    return best


_native.team_spin(0)  # the helper sleeps right after its work: the CPU as other load leaves it
_helped_team()
asleep = share()
_native.team_spin(int(2e9))  # now it stays awake (watching for work) for 2 s after its work
_helped_team()
print(asleep, share())
"""


def test_an_awake_helper_never_holds_a_core_that_another_thread_wants():
    """A helper awake after its work (and one woken ahead) watches for the next call, but yields its
    CPU to any thread that wants it: in a process on one CPU, a busy thread beside an awake helper
    gets as much of that CPU as beside a sleeping one, not the half a helper that only spins leaves
    it (which cost Mooncake's shared-memory gets 15% on the 2-core VM, its client's threads starved).
    Against the same thread beside a sleeping helper, so other load on that CPU counts for both."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _ONE_CPU_CHILD, str(cpu)], cwd=root, capture_output=True,
                         text=True, timeout=60, check=True)
    asleep, awake = map(float, out.stdout.split()[-2:])
    assert asleep > 0.2, f"the busy thread got {asleep:.0%} of its CPU with the helper asleep"
    assert awake > 0.8 * asleep, (
        f"a busy thread got {awake:.0%} of its CPU beside an awake helper, {asleep:.0%} beside a sleeping one")
