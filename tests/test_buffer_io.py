"""The core's vectored I/O (:func:`hicache_draft.read_into`, :func:`hicache_draft.write_from`):
whatever the buffers, offsets and chunking, the file holds exactly their concatenation and reads
fill them back; a full disk, a passed deadline and bad buffers are errors that say so."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_draft import Buffer, read_into, write_from


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    f = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    yield f
    os.close(f)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.binary(max_size=5000), max_size=14),
    chunk=st.sampled_from([None, 1, 97, 700, 4096, 1 << 20]),
    start=st.integers(0, 5000),
    as_buffers=st.booleans(),
)
def test_written_bytes_are_the_concatenation_and_read_back(
    fd: int, parts: list[bytes], chunk: int | None, start: int, as_buffers: bool
) -> None:
    os.ftruncate(fd, 0)
    keep = [bytearray(p) for p in parts]
    bufs = [Buffer.of(b) if as_buffers and b else b for b in keep]
    want = b"".join(parts)
    assert write_from(fd, start, bufs, chunk=chunk) == len(want)
    assert os.pread(fd, len(want) + 10, start) == want
    back = [bytearray(len(p)) for p in parts]
    targets = [Buffer.of(b) if as_buffers and b else b for b in back]
    assert read_into(fd, start, targets) == len(want)
    assert b"".join(back) == want


def test_more_iovecs_than_iov_max(fd: int) -> None:
    parts = [bytes([i % 251]) * 3 for i in range(5000)]  # 5000 buffers: several preadv/pwritev calls
    assert write_from(fd, 7, parts) == 15000
    back = [bytearray(3) for _ in parts]
    assert read_into(fd, 7, back) == 15000
    assert [bytes(b) for b in back] == parts


def test_a_read_past_the_end_of_file_returns_what_there_is(fd: int) -> None:
    write_from(fd, 0, [b"abcdef"])
    a, b = bytearray(4), bytearray(4)
    assert read_into(fd, 0, [a, b]) == 6
    assert bytes(a) == b"abcd" and bytes(b[:2]) == b"ef"
    assert read_into(fd, 100, [bytearray(8)]) == 0


def test_a_passed_deadline_writes_nothing(fd: int) -> None:
    with pytest.raises(TimeoutError) as err:
        write_from(fd, 0, [b"x" * 4096], deadline=time.monotonic() - 1)
    assert err.value.errno == errno.ETIMEDOUT
    assert os.fstat(fd).st_size == 0


def test_bad_buffers_are_refused(fd: int) -> None:
    with pytest.raises(BufferError):
        read_into(fd, 0, [b"read-only"])
    with pytest.raises(AttributeError):
        write_from(fd, 0, [object()])
    with pytest.raises(ValueError, match="negative"):
        write_from(fd, 0, [Buffer(1, -1)])
    with pytest.raises(OSError) as err:
        write_from(-1, 0, [b"x"])
    assert err.value.errno == errno.EBADF


def test_a_full_disk_raises_enospc_after_writing_what_fits(tmp_path: Path) -> None:
    """A real 1 MiB filesystem (tmpfs; the tests run as root): the kernel accepts part of the call
    (a short write), the rest fails with ENOSPC, and the bytes that went in are the right ones."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        data = os.urandom(3 << 20)
        f = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as err:
                write_from(f, 0, [data[: 1 << 20], data[1 << 20 :]])
            assert err.value.errno == errno.ENOSPC
            size = os.fstat(f).st_size
            assert 0 < size < len(data)
            assert os.pread(f, size, 0) == data[:size]
        finally:
            os.close(f)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)
