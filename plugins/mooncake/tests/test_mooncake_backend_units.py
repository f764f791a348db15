"""Unit tests without a store: return-code mapping and the circuit breaker."""

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


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_breaker_answers_at_once_while_down_then_probes():
    clock = Clock()
    b = Breaker(2.0, clock=clock)
    probes = []

    def probe(ok):
        def run():
            probes.append(ok)
            return ok
        return run

    assert b.allow(probe(True)) and probes == []  # up: no probe
    b.trip()
    assert b.down and not b.allow(probe(True)) and probes == []  # inside the interval
    clock.t += 2.5
    assert not b.allow(probe(False)) and probes == [False]  # probe failed: down again
    assert not b.allow(probe(True)) and probes == [False]  # new interval
    clock.t += 2.5
    assert b.allow(probe(True)) and probes == [False, True] and not b.down
    assert b.trips == 1
