"""``hicache-draft mooncake up`` (started as a real process, stopped with Ctrl-C) and ``bench``."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib

import click
import pytest
from click.testing import CliRunner
from hicache_draft_mooncake.cli import mooncake, parse_size
from hicache_draft_mooncake.service import port_open

from hicache_draft import PageResult, PoolKind, Store

from .conftest import make_rig


def test_up_prints_a_working_config_and_stops_on_ctrl_c(new_groups):
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_draft_mooncake.cli", "up", "--segment-size", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 30
        while not any(ln.startswith("# shm_client_address") for ln in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
        text = "\n".join(lines)
        assert 'backend = "mooncake"' in text and "[backend_options]" in text, text
        config = tomllib.loads(text)
        assert config["backend"] == "mooncake"
        opts = config["backend_options"]
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        store = Store.open("mooncake", opts)
        try:
            w = make_rig()
            w.fill_random()
            assert store.page_set([w.transfer(w.pages(new_groups(1), [0]))])[PoolKind.KV] == [PageResult.OK]
        finally:
            store.close()
        port = int(opts["master_server_address"].rsplit(":", 1)[1])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not port_open(port)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:  # a failed assertion: let `up` stop its children, then make sure
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_bench_runs_and_reports_ratios(mode):
    result = CliRunner().invoke(
        mooncake, ["bench", "--mode", mode, "--page-size", "16KiB", "--pages", "8", "--rounds", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("[") :])
    native = ["native: K/V objects, no exist", "native: one slot per page", "native: header slot + buffers",
              "native: same, 16 MiB calls", "native: buffers, no header slot"]
    variants = {"tcp": ["baseline", "plugin staged", "plugin staged, bare hooks", "plugin direct", *native],
                "shm": ["baseline", "plugin", "plugin, bare hooks", *native]}[mode]
    assert [r["variant"] for r in rows] == variants
    for r in rows:
        assert r["mode"] == mode and r["page_bytes"] == 16 << 10 and r["pages"] == 8
        assert r["set_gbps"] > 0 and r["get_gbps"] > 0 and r["set_ratio"] > 0 and r["get_ratio"] > 0
    assert rows[0]["set_ratio"] == rows[0]["get_ratio"] == 1.0
    through_store = [r for r in rows if r["variant"] in ("baseline", "plugin", "plugin staged", "plugin direct")]
    assert all(r["exist_us_per_key"] > 0 for r in through_store)
    # the breakdown sits on the row of the variant auto picks (16 KiB over TCP: staged)
    costs = rows[1]["costs_ms"]
    assert set(costs) >= {"core header", "core verify", "store hop", "exist", "header slot set", "backend get"}
    assert costs["core header"] > 0 and costs["exist"] > 0
    assert [r for r in rows if "costs_ms" in r] == [rows[1]]


def test_parse_size():
    assert parse_size("64KiB") == 64 << 10 and parse_size("1 GiB") == 1 << 30 and parse_size("4096") == 4096
    with pytest.raises(click.BadParameter):
        parse_size("lots")
