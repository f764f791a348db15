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


@settings(max_examples=60, deadline=None)
@given(regions=st.integers(0, 40), nbytes=st.integers(0, 3000), threads=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_copy_regions_copies_each_region_and_nothing_else(regions: int, nbytes: int, threads: int, seed: int) -> None:
    """Regions scattered through one area land exactly where asked, whatever the thread count; the
    bytes around them are untouched."""
    import random

    import torch

    from hicache_draft.buffer_io import copy_regions

    rnd = random.Random(seed)
    src = torch.randint(0, 256, (regions * nbytes + 64,), dtype=torch.uint8)
    dst = torch.zeros(2 * regions * nbytes + 64, dtype=torch.uint8)
    order = list(range(regions))
    rnd.shuffle(order)
    dsts = [dst.data_ptr() + 2 * nbytes * k + 7 for k in order]  # every other slot, shuffled
    srcs = [src.data_ptr() + nbytes * i for i in range(regions)]
    copy_regions(dsts, srcs, nbytes, threads=threads)
    want = torch.zeros_like(dst)
    for i, k in enumerate(order):
        want[2 * nbytes * k + 7 : 2 * nbytes * k + 7 + nbytes] = src[nbytes * i : nbytes * (i + 1)]
    assert torch.equal(dst, want)


def test_copy_regions_shares_a_large_batch_and_refuses_bad_arguments() -> None:
    import torch

    from hicache_draft import _native
    from hicache_draft.buffer_io import copy_regions

    src = torch.randint(0, 256, (64, 256 << 10), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    before = _native.team_helped()
    for _attempt in range(20):  # a helper that wakes after the caller copied every region takes none
        copy_regions([r.data_ptr() for r in dst], [r.data_ptr() for r in src], 256 << 10, threads=4)
        if _native.team_helped() > before:
            break
    assert torch.equal(dst, src)
    assert _native.team_helped() > before
    with pytest.raises(ValueError, match="2 destinations, 1 sources"):
        copy_regions([dst.data_ptr(), dst.data_ptr()], [src.data_ptr()], 8)
    with pytest.raises(ValueError, match=r"srcs\[0\] is a null address"):
        copy_regions([dst.data_ptr()], [0], 8)
