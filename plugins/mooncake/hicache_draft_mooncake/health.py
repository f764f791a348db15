"""Is the store usable, and if not, which component is at fault: the probe round trip, the
diagnosis of a failure (master, holder, metadata server, transport, with address and code), and
the texts the operator reads.

The probe is a real round trip, not an existence call: ``health_check()`` and ``batch_is_exist``
answer while puts still fail (a restarted master before the holders have re-mounted, a holder
that lost this client's shared memory). In shared-memory mode it puts 64 bytes from the start
of *every* buffer registered with the client (arenas and host pools; a put only reads), so a
holder that lost any of the mappings fails the probe, and reads one object back.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hicache_draft_mooncake import codes
from hicache_draft_mooncake.client import metadata_check, rpc_check
from hicache_draft_mooncake.options import MooncakeOptions
from hicache_draft_mooncake.session import Session

PROBE_BYTES = 64


@dataclass(frozen=True, slots=True)
class Fault:
    """A component that does not answer: its role, address and what is wrong."""

    component: str
    address: str
    why: str

    def __str__(self) -> str:
        return f"the {self.component} at {self.address} {self.why}"


def diagnose(opts: MooncakeOptions, timeout_s: float) -> Fault | None:
    """The first component (holder in shm mode, master, metadata server in TCP mode) that does
    not answer within ``timeout_s``; ``None`` when all of them answer."""
    if opts.shm:
        assert opts.shm_client_address is not None
        why = rpc_check(opts.shm_client_address, timeout_s)
        if why is not None:
            return Fault("holder", opts.shm_client_address, why)
    why = rpc_check(opts.master_server_address, timeout_s)
    if why is not None:
        return Fault("master", opts.master_server_address, why)
    if not opts.shm:
        why = metadata_check(opts.metadata_server, timeout_s)
        if why is not None:
            return Fault("metadata server", opts.metadata_server, why)
    return None


def round_trip(sess: Session, cfg: Any, prefix: str, deadline: float) -> tuple[str, int]:  # noqa: ANN401
    """``("ok", 0)``, or the step that failed (``"put"``, ``"get"``, ``"bytes"``) and its code."""
    sources = sess.mem.registered() if sess.mem.shm else []
    tag = f"{prefix}probe-{os.getpid()}-{uuid.uuid4().hex[:16]}"
    with sess.call(deadline), sess.mem.arena(2 * PROBE_BYTES) as arena:
        native = sess.native
        payload = os.urandom(PROBE_BYTES)
        arena.view[:PROBE_BYTES] = payload
        arena.view[PROBE_BYTES : 2 * PROBE_BYTES] = bytes(PROBE_BYTES)
        keys = [f"{tag}-0"] + [f"{tag}-{n + 1}" for n in range(len(sources))]
        ptrs = [arena.ptr] + [ptr for ptr, _ in sources]
        sizes = [PROBE_BYTES] + [min(PROBE_BYTES, n) for _, n in sources]
        try:
            rcs = list(native.batch_put_from(keys, ptrs, sizes, cfg))
            if len(rcs) != len(keys):
                return "put", codes.INTERNAL_ERROR
            bad = [rc for rc in rcs if rc != codes.OK]
            if bad:
                return "put", bad[0]
            got = list(native.batch_get_into(keys[:1], [arena.ptr + PROBE_BYTES], [PROBE_BYTES]))
            if not got or got[0] != PROBE_BYTES:
                return "get", got[0] if got else codes.INTERNAL_ERROR
            if bytes(arena.view[PROBE_BYTES : 2 * PROBE_BYTES]) != payload:
                return "bytes", codes.INTERNAL_ERROR
            return "ok", codes.OK
        finally:
            for key in keys:
                with contextlib.suppress(Exception):  # a leftover probe object is harmless
                    native.remove(key, True)


def client_broken(code: int) -> bool:
    """Whether a failed shared-memory round trip (with holder and master answering) means this
    client's link to the holder is broken: lost mapping, or RPCs that fail locally."""
    return code in (codes.INVALID_PARAMS, codes.INTERNAL_ERROR) or code in codes.RPC_CODES


def describe_code(opts: MooncakeOptions, op: str, code: int) -> str:
    """What a failed put/get/exist code means for the operator (component, address, code)."""
    name = codes.name(code)
    holder = opts.shm_client_address
    master = opts.master_server_address
    if code in codes.RPC_CODES or (op == "exist" and code == codes.INTERNAL_ERROR):
        if holder:
            return f"{op} got {name}: no answer from the holder at {holder} or, through it, the master at {master}"
        return f"{op} got {name}: no answer from the master at {master}"
    if code == codes.TRANSFER_FAIL:
        if holder:
            return (f"{op} got {name}: the holder at {holder} could not move the bytes to or from the segment "
                    "holding them (another holder down, or its transport)")
        text = (f"{op} got {name}: the {opts.protocol} transport could not move the bytes to or from the segment "
                f"holder the master at {master} chose")
        if opts.metadata_server == "P2PHANDSHAKE":
            text += (". metadata_server is 'P2PHANDSHAKE' (the default): if the segment holders publish to an HTTP "
                     "metadata server (master flag --enable_http_metadata_server), set metadata_server to its URL, "
                     "e.g. http://<master host>:<--http_metadata_server_port>/metadata")
        else:
            text += (f" (metadata server {opts.metadata_server}; is that holder running, and is "
                     f"MC_TCP_BIND_ADDRESS / local_hostname {opts.local_hostname} reachable?)")
        return text
    if code == codes.INVALID_PARAMS and holder:
        return (f"{op} got {name}: the holder at {holder} does not map this client's shared memory (it restarted, "
                "or lost the mapping)")
    if code in (codes.SEGMENT_NOT_FOUND, codes.NO_AVAILABLE_HANDLE):
        return f"{op} got {name}: the master at {master} has no segment holder with room mounted"
    return f"{op} got {name}"


def probe_deadline(opts: MooncakeOptions) -> float:
    """Bookkeeping deadline of one probe: a dead master costs about 4.3 s per call."""
    return time.monotonic() + max(5.0, 3 * opts.rpc_timeout_ms / 1000)
