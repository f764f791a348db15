"""The kit's ``in_forked_child``: each verdict, and a hung child killed at its bound."""

from __future__ import annotations

import os
import signal
import time

from hicache_draft.testing import CHILD_FALSE, CHILD_HUNG, CHILD_OK, CHILD_RAISED, in_forked_child


def _boom() -> bool:
    raise ValueError("boom")


def _crash() -> bool:
    os.kill(os.getpid(), signal.SIGKILL)  # dies without answering
    return True


def test_each_verdict_of_a_child() -> None:
    assert in_forked_child(lambda: True) == CHILD_OK
    assert in_forked_child(lambda: False) == CHILD_FALSE
    assert in_forked_child(_boom) == CHILD_RAISED
    assert in_forked_child(_crash) == CHILD_RAISED


def test_a_hung_child_is_killed_at_the_bound() -> None:
    t0 = time.monotonic()
    assert in_forked_child(lambda: time.sleep(60) or True, timeout_s=0.5) == CHILD_HUNG
    assert time.monotonic() - t0 < 10.0
