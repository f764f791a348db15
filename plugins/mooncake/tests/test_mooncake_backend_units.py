"""Unit tests without a store: return-code mapping, the circuit breaker's background prober and the
check of where page buffers lie."""

import threading
import time

from hicache_draft_mooncake import codes
from hicache_draft_mooncake.breaker import Breaker
from hicache_draft_mooncake.memory import Memory
from hypothesis import given
from hypothesis import strategies as st

from hicache_draft import Buffer, PageResult


@given(st.integers(min_value=-2000, max_value=1 << 40), st.integers(min_value=65, max_value=1 << 30))
def test_get_codes_map_to_page_results(code, expected):
    res = codes.get_result(code, expected)
    if code == expected:
        assert res is None
    elif code == codes.OBJECT_NOT_FOUND:
        assert res is PageResult.MISS
    elif code >= 0:
        assert res is PageResult.CORRUPT
    else:
        assert res is PageResult.FAILED


def test_put_codes():
    assert codes.put_result(0) is PageResult.OK
    assert codes.put_result(codes.OBJECT_ALREADY_EXISTS) is PageResult.OK
    for bad in (codes.TRANSFER_FAIL, codes.RPC_FAIL, codes.RPC_TIMEOUT, codes.INVALID_PARAMS, -1):
        assert codes.put_result(bad) is PageResult.FAILED
    assert codes.name(-704) == "OBJECT_NOT_FOUND (-704)" and codes.name(-12345) == "-12345"


def _wait(cond, bound_s=5.0):
    end = time.monotonic() + bound_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_breaker_probes_on_its_own_thread_until_the_store_answers():
    answers = [False, False, True]
    seen = []

    def probe():
        seen.append(threading.current_thread().name)
        return answers.pop(0)

    b = Breaker(0.05, probe, name="t")
    try:
        assert not b.down and seen == []  # up: nothing runs
        t = time.monotonic()
        assert b.trip(now=True) and not b.trip()  # the first trip counts, later ones do not
        assert time.monotonic() - t < 0.05  # tripping never waits for a probe
        assert b.down
        assert _wait(lambda: not b.down)
        assert seen == ["t-prober"] * 3 and b.trips == 1 and b.probes == 3
    finally:
        b.close()


def test_a_probe_that_raises_means_not_yet_and_close_stops_the_prober():
    calls = []

    def probe():
        calls.append(1)
        raise RuntimeError("boom")

    b = Breaker(0.02, probe)
    b.trip(now=True)
    assert _wait(lambda: len(calls) >= 3) and b.down
    b.close()
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) <= n + 1 and not b.trip()  # closed: no more probes, no more trips


class _Registrar:
    """The native client's registration call, all a TCP-mode Memory asks of it."""

    def register_buffer(self, ptr, nbytes):
        return 0


_ranges = st.lists(st.tuples(st.integers(0, 64), st.integers(1, 64)), min_size=0, max_size=6)
_buffers = st.lists(st.tuples(st.integers(0, 1200), st.integers(0, 80)), min_size=0, max_size=4)


@given(_ranges, st.lists(_buffers, max_size=12))
def test_inside_each_answers_as_inside_does_page_by_page(gaps_and_sizes, pages):
    """The batch check (one lock, the last range found tried first) says of every page what the
    per-page check says: buffers in one registered range, in neighbouring ranges, across a gap,
    before the first or past the last, and empty ones."""
    mem = Memory(_Registrar(), shm=False)
    at = 16
    for gap, size in gaps_and_sizes:  # ranges apart by gaps of 0-64 bytes (0: touching)
        at += gap
        mem.register_external(at, size * 8)
        at += size * 8
    batch = [[Buffer(ptr, n) for ptr, n in page] for page in pages]
    assert mem.inside_each(batch) == [mem.inside(page) for page in batch]
