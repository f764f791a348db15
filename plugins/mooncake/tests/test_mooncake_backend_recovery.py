"""Shared-memory clients survive holder restarts (one client, two in one process, two processes),
with host pools built in the holder's shared memory; a stopped holder or master is detected and
routed around; the breaker's probes run in the background; close and reopen in one process.

Every test starts its own master and holder and stops them by pid (SIGKILL, SIGSTOP/SIGCONT).
Every wait is bounded. Pages read while the store is broken are misses or failures: any page
reported OK is byte-exact, and the core never had to reject one (``corrupt_pages == 0``).
"""

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_draft import BackendContext, PageResult, PoolKind, Store

from .conftest import host_allocator, make_rig

OK = PageResult.OK
RECOVERY_BOUND_S = 30.0
WORKER = Path(__file__).with_name("shm_worker.py")


def _shm_store(svc, **options):
    opts = {**svc.backend_options(shm=True), "shm_pool_size": 16 << 20, "retry_interval_s": 0.3, **options}
    return Store.open("mooncake", opts)


def _pool_rigs(store):
    """Writer and reader rigs whose host pools live in the backend's shared memory, registered."""
    alloc = host_allocator(store)
    assert alloc is not None
    w, r = make_rig(allocator=alloc), make_rig(allocator=alloc)
    for rig in (w, r):
        store.register_pool(rig.registration())
    w.fill_random()
    return w, r


def _round_trip(store, w, r, new_groups, slots=(4, 5)):
    """One put and get of fresh pages; True when both worked. Pages reported OK must be exact."""
    g = new_groups(len(slots))
    put = store.page_set([w.transfer(w.pages(g, list(slots)))])[PoolKind.KV]
    got, done = store.page_get([r.transfer(r.pages(g, list(slots)))])
    assert done.done() or done.result(timeout=RECOVERY_BOUND_S) is None
    for res, slot in zip(got[PoolKind.KV], slots, strict=True):
        assert res in (OK, PageResult.MISS, PageResult.FAILED)
        if res is OK:
            assert r.page_bytes(slot) == w.page_bytes(slot)
    assert store.corrupt_pages == 0
    return put == [OK] * len(slots) and got[PoolKind.KV] == [OK] * len(slots)


def _until_round_trip(store, w, r, new_groups, bound_s=RECOVERY_BOUND_S):
    """Seconds until a round trip works again (bounded), or None."""
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if _round_trip(store, w, r, new_groups):
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def _restart_holder(svc):
    """A quick restart: Mooncake's own ping (every 1 s) usually never sees the holder gone."""
    svc.holder.kill()
    svc.start_holder()


class _Recorder:
    """Wraps a native client and records which buffers it registered and unregistered."""

    def __init__(self, native):
        self._native = native
        self.registered, self.unregistered, self.closed = set(), set(), 0

    def register_buffer(self, ptr, size):
        rc = self._native.register_buffer(ptr, size)
        if rc == 0:
            self.registered.add(ptr)
        return rc

    def unregister_buffer(self, ptr):
        self.unregistered.add(ptr)
        return self._native.unregister_buffer(ptr)

    def close(self):
        self.closed += 1
        return self._native.close()

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_one_shm_client_recovers_after_holder_restart(mooncake_service_factory, new_groups, caplog, monkeypatch):
    import hicache_draft_mooncake.backend as backend_module

    clients = []

    def recording(opts, real=getattr(backend_module, "new_client", None)):
        clients.append(_Recorder(real(opts)))
        return clients[-1]

    monkeypatch.setattr(backend_module, "new_client", recording, raising=False)
    caplog.set_level(logging.WARNING, logger="hicache_draft_mooncake")
    svc = mooncake_service_factory(client_ttl_s=2)
    store = _shm_store(svc)
    try:
        w, r = _pool_rigs(store)
        old = new_groups(2)
        assert store.page_set([w.transfer(w.pages(old, [0, 1]))])[PoolKind.KV] == [OK, OK]
        before = dict(store.backend.stats)

        _restart_holder(svc)
        took = _until_round_trip(store, w, r, new_groups)
        assert took is not None, "the shared-memory client never recovered from a holder restart"
        stats = store.backend.stats
        assert stats["reconnects"] >= 1
        # the host pools live in the old client's shared memory, which the new holder never mapped:
        # their pages now move through a staging copy, byte-exact
        assert stats["bounced_pages"] > before.get("bounced_pages", 0)
        assert stats["staging_bytes_given_back"] > 0  # the old client's arenas (MADV_REMOVE)
        got, _ = store.page_get([r.transfer(r.pages(old, [6, 7]))])  # the old holder took these along
        assert OK not in got[PoolKind.KV]
        text = caplog.text
        assert f"holder at {svc.holder_address}" in text and "restart this process" in text
        assert re.search(r"got [A-Z_]+ \(-\d+\)", text), text  # Mooncake's code, by name and number
    finally:
        store.close()
    assert len(clients) >= 2 and all(c.closed == 1 for c in clients)
    for c in clients:  # every buffer either client registered was unregistered at close
        assert c.registered and c.registered <= c.unregistered
    assert store.backend.registered_buffers == 0


def test_two_shm_clients_in_one_process_recover_and_reopen(mooncake_service_factory, new_groups):
    svc = mooncake_service_factory(client_ttl_s=2)
    stores = [_shm_store(svc), _shm_store(svc)]
    try:
        rigs = [_pool_rigs(s) for s in stores]
        for s, (w, r) in zip(stores, rigs, strict=True):
            assert _round_trip(s, w, r, new_groups)
        _restart_holder(svc)
        for s, (w, r) in zip(stores, rigs, strict=True):
            assert _until_round_trip(s, w, r, new_groups) is not None, "a client never recovered"
    finally:
        for s in stores:
            s.close()
    # closing both and opening again in the same process works
    again = _shm_store(svc)
    try:
        w, r = _pool_rigs(again)
        assert _until_round_trip(again, w, r, new_groups, bound_s=10.0) is not None
    finally:
        again.close()


def test_two_shm_processes_recover_after_holder_restart(mooncake_service_factory):
    svc = mooncake_service_factory(client_ttl_s=2)
    args = [sys.executable, str(WORKER), svc.master_address, svc.holder_address, str(RECOVERY_BOUND_S)]
    procs = [subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"  # bounded: the worker gives up by itself
        _restart_holder(svc)
        for p in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=RECOVERY_BOUND_S + 30)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for out in outs:
        assert "RECOVERED" in out and "WRONG" not in out, out


@pytest.fixture
def silent_port():
    """A port whose kernel accepts connections that nobody ever answers."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


OPEN_BOUND = 1.0  # connect_timeout_s of the open tests


@pytest.mark.parametrize("case", ["frozen holder", "silent holder port", "frozen master", "silent master port"])
def test_open_is_bounded_against_a_process_that_does_not_answer(mooncake_service_factory, silent_port, case):
    svc = mooncake_service_factory()
    if "holder" in case:
        opts = {**svc.backend_options(shm=True), "shm_pool_size": 16 << 20}
        key, proc = "shm_client_address", svc.holder
    else:
        opts = svc.backend_options()
        key, proc = "master_server_address", svc.master
    if case.startswith("silent"):
        opts[key] = silent_port
    address = opts[key]
    opts["connect_timeout_s"] = OPEN_BOUND
    if case.startswith("frozen"):
        proc.freeze()
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as err:  # noqa: PT011 (the type is checked below)
            Store.open("mooncake", opts)
    finally:
        took = time.monotonic() - start
        if case.startswith("frozen"):
            proc.thaw()
    assert type(err.value).__name__ == "BackendSetupError"
    assert took < OPEN_BOUND + 3.0, f"open took {took:.1f}s"
    msg = str(err.value)
    role = "holder" if "holder" in case else "master"
    assert f"the {role} at {address}" in msg and "did not answer" in msg, msg


def test_probes_run_in_the_background_while_the_master_is_down(mooncake_service_factory, new_groups, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_draft_mooncake")
    svc = mooncake_service_factory()
    store = Store.open("mooncake", {**svc.backend_options(), "retry_interval_s": 0.5})
    try:
        w, r = make_rig(), make_rig()
        w.fill_random()
        assert _round_trip(store, w, r, new_groups)
        svc.master.kill()
        first = time.monotonic()
        store.page_exists({PoolKind.KV: [p.key for p in w.pages(new_groups(1), [0])]})  # trips the breaker
        assert time.monotonic() - first < 8.0
        # while it is down every call answers at once: no caller ever waits for a probe (a dead master
        # costs each native call about 4.3 s), though the prober runs every 0.5 s
        slowest, end = 0.0, time.monotonic() + 3.0
        while time.monotonic() < end:
            g = new_groups(1)
            t = time.monotonic()
            assert store.page_set([w.transfer(w.pages(g, [1]))])[PoolKind.KV] == [PageResult.FAILED]
            assert OK not in store.page_get([r.transfer(r.pages(g, [1]))])[0][PoolKind.KV]
            assert store.page_exists({PoolKind.KV: [p.key for p in w.pages(g, [1])]}) == {PoolKind.KV: 0}
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(0.05)
        assert slowest < 0.5, f"a call took {slowest:.2f}s while the master was down"
        assert f"master at {svc.master_address}" in caplog.text and "RPC_FAIL (-900)" in caplog.text

        svc.start_master()
        deadline = time.monotonic() + RECOVERY_BOUND_S
        while not store.backend.available and time.monotonic() < deadline:
            time.sleep(0.1)  # no calls: the prober alone finds out
        assert store.backend.available
        assert _round_trip(store, w, r, new_groups), "the first call after recovery failed"
    finally:
        store.close()


def test_frozen_holder_fails_calls_at_once_then_recovers(mooncake_service_factory, new_groups, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_draft_mooncake")
    svc = mooncake_service_factory()
    opts = {**svc.backend_options(shm=True), "shm_pool_size": 16 << 20, "retry_interval_s": 0.3}
    store = Store.open("mooncake", opts, context=BackendContext(timeout_s=1.0))
    try:
        w, r = _pool_rigs(store)
        assert _round_trip(store, w, r, new_groups)
        svc.holder.freeze()
        try:
            g = new_groups(2)
            t = time.monotonic()
            got, _ = store.page_get([r.transfer(r.pages(g, [4, 5]))])  # the Store gives up after 1 s
            assert OK not in got[PoolKind.KV] and time.monotonic() - t < 4.0
            time.sleep(1.5)  # the stuck call is now past its deadline: the backend stops calling
            t = time.monotonic()
            for _ in range(5):
                assert store.page_set([w.transfer(w.pages(g, [4, 5]))])[PoolKind.KV] == [PageResult.FAILED] * 2
                assert OK not in store.page_get([r.transfer(r.pages(g, [4, 5]))])[0][PoolKind.KV]
                assert store.page_exists({PoolKind.KV: [p.key for p in w.pages(g[:1], [4])]}) == {PoolKind.KV: 0}
            took = time.monotonic() - t
            assert took < 1.0, f"15 calls took {took:.1f}s against a frozen holder"
            deadline = time.monotonic() + 10.0
            while "did not answer" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"the holder at {svc.holder_address} accepts connections but did not answer" in caplog.text
        finally:
            svc.holder.thaw()
        assert _until_round_trip(store, w, r, new_groups) is not None
    finally:
        store.close()
