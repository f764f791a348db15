"""Type stub of the compiled module ``hicache_draft._native`` (source: ``_native.c``)."""

from collections.abc import Callable, Sequence

IOV_MAX: int
HEADER_SIZE: int

def pack_headers(
    out: object | None, items: Sequence[object], codes: int | bytes, namespace_bytes: Callable[[str], bytes],
    threads: int = 1, deadline: float = ..., stop: object | None = None,
) -> None: ...
def pack_records(
    items: Sequence[object], dsts: Sequence[object], codes: int | bytes, namespace_bytes: Callable[[str], bytes],
    threads: int = 1, deadline: float = ..., stop: object | None = None,
) -> None: ...
def mismatches(
    pages: Sequence[object], codes: int | bytes, namespace_bytes: Callable[[str], bytes], threads: int = 1
) -> list[int]: ...
def read_into(fd: int, offset: int, buffers: Sequence[object]) -> int: ...
def write_from(fd: int, offset: int, buffers: Sequence[object], chunk: int, deadline: float) -> int: ...
def read_check(
    fd: int, offset: int, pages: Sequence[object], codes: int | bytes, namespace_bytes: Callable[[str], bytes],
    chunk: int,
) -> tuple[int, list[int]]: ...
def read_runs(
    runs: Sequence[tuple[int, int, Sequence[object], int | bytes]], namespace_bytes: Callable[[str], bytes],
    chunk: int, threads: int, deadline: float, check: bool = True,
) -> list[tuple[int, list[int]] | OSError | None]: ...
def mark_runs(
    runs: Sequence[tuple[int, int, Sequence[tuple[str, int]]]], pages: dict[str, list[object]],
    slots: dict[str, list[object]], mark: object, codes: dict[str, int],
) -> list[tuple[int, int, list[object], int | bytes]]: ...
def team_helped() -> int: ...
def write_records(
    fd: int, offset: int, pages: Sequence[object], codes: int | bytes, namespace_bytes: Callable[[str], bytes],
    chunk: int, deadline: float,
) -> int: ...
def make_pages(
    keys: Sequence[str], groups: Sequence[str], namespaces: str | Sequence[str], buffers: Sequence[object],
    page_type: type, page_fields: tuple[object, ...],
) -> list[object]: ...
def lower_hex(keys: Sequence[object]) -> bool: ...
def spin_wait(flag: bytearray, ring: bytearray, seconds: float) -> bool: ...
def post_and_spin(flag: bytearray, count: bytearray, ring: bytearray, seconds: float, settle: float) -> bool: ...
def with_headers(
    pages: Sequence[object], base: int, owner: object, page_type: type, page_fields: tuple[object, ...],
    buffer_type: type, buffer_fields: tuple[object, ...],
) -> list[object]: ...

XXH3_ISA: str
