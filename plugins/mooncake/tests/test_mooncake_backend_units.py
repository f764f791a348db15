"""Unit tests without a store: return-code mapping and the circuit breaker's background prober."""

import threading
import time

from hicache_draft_mooncake import codes
from hicache_draft_mooncake.breaker import Breaker
from hypothesis import given
from hypothesis import strategies as st

from hicache_draft import PageResult


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
