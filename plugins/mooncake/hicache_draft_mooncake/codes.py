"""Mooncake store return codes (``ErrorCode`` in mooncake-store's ``types.h``) and what each
means for one page.

Mooncake calls return ints and never raise. A batch call returns one int per key: ``>= 0`` is
success (bytes read for gets), a negative value is an error code.
"""

from __future__ import annotations

from hicache_draft import PageResult

OK = 0
INTERNAL_ERROR = -1
SEGMENT_NOT_FOUND = -200
NO_AVAILABLE_HANDLE = -300
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

NAMES: dict[int, str] = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    SEGMENT_NOT_FOUND: "SEGMENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}

RPC_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})
"""Codes that mean the master did not answer: the backend stops calling it for a while."""


def name(code: int) -> str:
    """``"OBJECT_NOT_FOUND (-704)"``, or the bare number for codes without a known name."""
    n = NAMES.get(code)
    return f"{n} ({code})" if n else str(code)


def put_result(code: int) -> PageResult:
    """A put's code: stored (or already stored: equal keys hold equal bytes) or failed."""
    return PageResult.OK if code in (OK, OBJECT_ALREADY_EXISTS) else PageResult.FAILED


def get_result(code: int, expected_nbytes: int) -> PageResult | None:
    """A get's code before validation: ``None`` when ``expected_nbytes`` arrived (validate the
    header and checksum next), ``MISS`` when the key is not stored, ``CORRUPT`` when another
    length arrived, ``FAILED`` for lease, transfer, RPC and other errors."""
    if code == expected_nbytes:
        return None
    if code == OBJECT_NOT_FOUND:
        return PageResult.MISS
    if code >= 0:
        return PageResult.CORRUPT
    return PageResult.FAILED
