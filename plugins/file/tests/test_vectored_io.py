"""Vectored writes finish the job: whatever the kernel accepts per call, the file ends up holding
exactly the concatenation of the views (short writes resume where they stopped)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hicache_draft_file import vectored_io
from hicache_draft_file.vectored_io import pwritev_all
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.binary(max_size=3000), max_size=12),
    accept=st.lists(st.integers(1, 5000), min_size=1, max_size=8),
    chunk=st.sampled_from([97, 700, 4096, 1 << 20]),
    start=st.integers(0, 100),
)
def test_short_writes_resume_until_everything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: list[bytes], accept: list[int], chunk: int, start: int
) -> None:
    real = os.pwritev
    calls = iter(accept * 10_000)

    def short(fd: int, views: list[memoryview], offset: int) -> int:
        budget = next(calls)  # the kernel takes at most this many bytes of this call
        cut: list[memoryview] = []
        for v in views:
            if budget <= 0:
                break
            cut.append(v[:budget])
            budget -= cut[-1].nbytes
        return real(fd, cut, offset)

    monkeypatch.setattr(vectored_io.os, "pwritev", short)
    path = tmp_path / "f"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        end = pwritev_all(fd, [memoryview(p) for p in parts], start, chunk)
    finally:
        os.close(fd)
    want = b"".join(parts)
    assert end == start + len(want)
    assert path.read_bytes()[start:] == want


def test_a_write_that_makes_no_progress_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vectored_io.os, "pwritev", lambda fd, views, offset: 0)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as err:
            pwritev_all(fd, [memoryview(b"abc")], 0)
    finally:
        os.close(fd)
    assert err.value.errno == errno.EIO
