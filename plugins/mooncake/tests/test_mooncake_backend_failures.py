"""Failures: master killed and restarted mid-run, segment holder killed, setup errors, bad options.
Every failure gives bounded misses/failures, nothing raises out of the hooks, nothing stale is OK."""

import logging
import re
import time

import pytest
from hicache_draft_mooncake.service import free_ports

from hicache_draft import BackendSetupError, ConfigError, PageResult, PoolKind, Store

from .conftest import make_rig

OK = PageResult.OK
RECOVERY_BOUND_S = 30.0


def _until_round_trip(store, rig, new_groups):
    """Put and get fresh pages until both work again (bounded); the groups that made it, or None."""
    deadline = time.monotonic() + RECOVERY_BOUND_S
    reader = make_rig()
    while time.monotonic() < deadline:
        g = new_groups(2)
        if store.page_set([rig.transfer(rig.pages(g, [4, 5]))])[PoolKind.KV] == [OK, OK]:
            got, _ = store.page_get([reader.transfer(reader.pages(g, [4, 5]))])
            if got[PoolKind.KV] == [OK, OK]:
                assert [reader.page_bytes(4), reader.page_bytes(5)] == [rig.page_bytes(4), rig.page_bytes(5)]
                return g
        time.sleep(0.3)
    return None


def test_master_killed_then_restarted(mooncake_service_factory, new_groups):
    svc = mooncake_service_factory()
    store = Store.open("mooncake", {**svc.backend_options(), "retry_interval_s": 0.5})
    try:
        w, r = make_rig(), make_rig()
        w.fill_random()
        old = new_groups(2)
        assert store.page_set([w.transfer(w.pages(old, [0, 1]))])[PoolKind.KV] == [OK, OK]

        svc.master.kill()
        got, done = store.page_get([r.transfer(r.pages(old, [2, 3]))])
        assert done.done() and OK not in got[PoolKind.KV]
        deadline = time.monotonic() + 10.0  # the prober (a background thread) reports the outage
        while not store.backend.stats["outages"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.backend.stats["outages"] == 1 and not store.backend.available
        # while the master is down, calls are answered at once (no new native data call)
        assert store.page_exists({PoolKind.KV: [p.key for p in w.pages(old, [0, 1])]}) == {PoolKind.KV: 0}
        assert OK not in store.page_set([w.transfer(w.pages(new_groups(1), [4]))])[PoolKind.KV]

        svc.start_master()  # same ports; the master lost every object
        assert _until_round_trip(store, w, new_groups) is not None
        got, _ = store.page_get([r.transfer(r.pages(old, [2, 3]))])
        assert got[PoolKind.KV] == [PageResult.MISS, PageResult.MISS]
    finally:
        store.close()


def test_segment_holder_killed_gives_misses_never_stale_data(mooncake_service_factory, new_groups, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_draft_mooncake")
    svc = mooncake_service_factory(client_ttl_s=2)
    tcp = Store.open("mooncake", svc.backend_options())
    shm = Store.open("mooncake", {**svc.backend_options(shm=True), "shm_pool_size": 16 << 20})
    try:
        w = make_rig()
        w.fill_random()
        g = new_groups(3)
        assert tcp.page_set([w.transfer(w.pages(g, [0, 1, 2]))])[PoolKind.KV] == [OK] * 3

        svc.holder.kill()
        for store in (tcp, shm):
            r = make_rig()
            got, done = store.page_get([r.transfer(r.pages(g, [3, 4, 5]))])
            assert done.done() and OK not in got[PoolKind.KV]
        # the shared-memory client names the dead holder (not the master) with its address and code
        deadline = time.monotonic() + 10.0
        while "holder at" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"the holder at {svc.holder_address} is not reachable" in caplog.text
        assert re.search(r"got [A-Z_]+ \(-\d+\)", caplog.text)

        svc.start_holder()  # a new, empty holder
        assert _until_round_trip(tcp, w, new_groups) is not None
        r = make_rig()
        got, _ = tcp.page_get([r.transfer(r.pages(g, [0, 1, 2]))])
        assert OK not in got[PoolKind.KV]
    finally:
        tcp.close()
        shm.close()


def test_a_dead_holders_name_that_blocks_a_restart_is_found_in_the_log_and_removed(mooncake_service):
    """The restart of a killed holder once failed in CI: its transfer engine got the dead holder's
    port, whose name the metadata server still held ("Duplicate rpc_meta key not allowed", and the
    new holder exits). ``start_holder`` finds that name in the new holder's log and removes it
    before it tries again; a name on another metadata server is never touched."""
    import urllib.error
    import urllib.request

    from hicache_draft_mooncake.service import remove_name, stale_name

    base = mooncake_service.metadata_server
    (port,) = free_ports(1)
    url = f"{base}?key=mooncake%2Frpc_meta%2F127.0.0.1%3A{port}"
    put = urllib.request.Request(url, data=b'{"ip_or_host_name":"127.0.0.1","rpc_port":%d}' % port, method="PUT")
    with urllib.request.urlopen(put, timeout=5) as resp:  # the name a killed holder left behind
        assert resp.status == 200
    log = (  # the holder's own lines, as CI logged them, for that name
        "E1207 20:22:45.609216 24696 transfer_metadata_plugin.cpp:348] PUT "
        f"{url} http=400 body: Duplicate rpc_meta key not allowed\n"
        "E1207 20:22:45.609246 24696 transfer_metadata.cpp:1470] Failed to set location of 127.0.0.1:13070\n"
        "F1207 20:22:45.710145 24696 real_client_main.cpp:134] Failed to setup client: INTERNAL_ERROR\n"
    )
    assert stale_name(log, base) == url
    assert stale_name(log, "http://127.0.0.1:1/metadata") is None
    assert stale_name("F1207 real_client_main.cpp:134] Failed to setup client: INTERNAL_ERROR", base) is None
    assert remove_name(url)
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(url, timeout=5)
    assert gone.value.code == 404


def test_setup_failure_names_the_master_and_what_to_check():
    (port,) = free_ports(1)
    with pytest.raises(BackendSetupError) as err:
        Store.open("mooncake", {"master_server_address": f"127.0.0.1:{port}",
                                "metadata_server": "http://127.0.0.1:1/metadata", "connect_timeout_s": 0.5})
    msg = str(err.value)
    assert f"the master at 127.0.0.1:{port} is not reachable" in msg and "check that mooncake_master runs" in msg


def test_missing_metadata_server_is_called_out_at_open(mooncake_service):
    """Holders that publish to the master's HTTP metadata server, a client left on the default
    P2PHANDSHAKE: every put would fail with TRANSFER_FAIL; the open says why instead."""
    opts = {k: v for k, v in mooncake_service.backend_options().items() if k != "metadata_server"}
    with pytest.raises(BackendSetupError) as err:
        Store.open("mooncake", opts)
    msg = str(err.value)
    assert "TRANSFER_FAIL (-800)" in msg and "metadata_server is 'P2PHANDSHAKE'" in msg, msg


def test_wrong_metadata_server_is_named(mooncake_service):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}/metadata"
    start = time.monotonic()
    with pytest.raises(BackendSetupError) as err:
        Store.open("mooncake", {**mooncake_service.backend_options(), "metadata_server": url,
                                "connect_timeout_s": 1.0})
    assert time.monotonic() - start < 4.0
    assert f"the metadata server at {url} is not reachable" in str(err.value), str(err.value)


def test_shm_setup_failure_names_the_local_client(mooncake_service):
    (port,) = free_ports(1)
    opts = {**mooncake_service.backend_options(), "shm_client_address": f"127.0.0.1:{port}", "connect_timeout_s": 0.5}
    with pytest.raises(BackendSetupError) as err:
        Store.open("mooncake", opts)
    assert f"127.0.0.1:{port}" in str(err.value) and "mooncake_client" in str(err.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({}, "backend_options.master_server_address"),
        ({"master_server_address": "nohostport"}, "backend_options.master_server_address"),
        ({"master_server_address": "h:1", "metadata_server": "ftp://x"}, "backend_options.metadata_server"),
        ({"master_server_address": "h:1", "key_prefix": "bad key"}, "backend_options.key_prefix"),
        ({"master_server_address": "h:1", "protocol": "udp"}, "backend_options.protocol"),
        ({"master_server_address": "h:1", "shm_client_address": "h:99999"}, "backend_options.shm_client_address"),
        ({"master_server_address": "h:1", "unknown": 1}, "backend_options.unknown"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ConfigError) as err:
        Store.open("mooncake", options)
    assert err.value.field == field
