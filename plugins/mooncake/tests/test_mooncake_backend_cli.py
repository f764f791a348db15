"""``hicache-draft mooncake up`` (started as a real process, stopped with Ctrl-C) and ``bench``."""

import json
import os
import re
import signal
import statistics
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


NATIVE = ["native: K/V objects, no exist", "native: one slot per page", "native: header slot + buffers",
          "native: same, 16 MiB calls", "native: buffers, no header slot"]


def test_bench_quick_prints_every_ratio_and_goal_and_its_checks_hold():
    """The CI run of the benchmark (real master and holder, both modes, 64 KiB and 1 MiB pages):
    the report's structure and its checks, never a timing."""
    result = CliRunner().invoke(mooncake, ["bench", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{") :])
    assert doc["checks"] == {"every call OK": True, "every get byte-exact": True,
                             "existence found every page": True, "no corrupt page": True}
    rows, goals = doc["rows"], doc["goals"]
    variants = {"tcp": ["baseline", "baseline, 2nd client", "plugin staged", "plugin direct", *NATIVE],
                "shm": ["baseline", "baseline, 2nd client", "plugin", *NATIVE]}
    cases = [(m, p) for m in ("tcp", "shm") for p in (64 << 10, 1 << 20)]
    assert [(r["mode"], r["page_bytes"]) for r in rows] == [c for c in cases for _ in range(len(variants[c[0]]) + 1)]
    for mode, page in cases:
        case = [r for r in rows if (r["mode"], r["page_bytes"]) == (mode, page)]
        auto = "plugin" if mode == "shm" else "plugin staged" if page <= 128 << 10 else "plugin direct"
        names = list(variants[mode])
        names.insert(names.index(auto) + 1, f"{auto}, bare hooks")  # after the variant auto picks
        assert [r["variant"] for r in case] == names
        for r in case:
            assert r["pages"] == 8 and r["set_gbps"] > 0 and r["get_gbps"] > 0
            if r["variant"] == "baseline":
                assert r["set_ratio"] == r["get_ratio"] == 1.0
                continue
            for op in ("set", "get"):  # a row's ratio is the median of its per-round ratios
                per_round = r[f"{op}_ratios"]
                assert len(per_round) == 2 and all(x > 0 for x in per_round)
                assert r[f"{op}_ratio"] == pytest.approx(statistics.median(per_round), abs=2e-3)
        with_costs = [r for r in case if "costs_ms" in r]
        assert [r["variant"] for r in with_costs] == [auto]
        assert set(with_costs[0]["costs_ms"]) >= {"core header", "core verify", "store over bare set", "exist",
                                                  "header slot set", "one object vs K/V set", "backend set"}
        costs = with_costs[0]["costs_ms"]
        assert costs["core header"] > 0 and costs["core verify alone"] > 0
        stored = [r for r in case if r["variant"] in ("baseline", "baseline, 2nd client", auto)]
        assert all(r["exist_us_per_key"] > 0 for r in stored)
        mine = [g for g in goals if (g["mode"], g["page_bytes"]) == (mode, page)]
        assert [g["op"] for g in mine] == ["set", "get"]
        for g in mine:
            assert g["variant"] == auto and g["goal"] == {"tcp": 1.0, "shm": 2.0}[mode]
            assert g["met"] == (g["ratio"] >= g["goal"])
            row = next(r for r in case if r["variant"] == auto)
            assert g["ratio"] == row[f"{g['op']}_ratio"] and g["ratios"] == row[f"{g['op']}_ratios"]
            ceiling = "native: one slot per page" if auto == "plugin staged" else "native: header slot + buffers"
            assert g["ceiling_variant"] == ceiling and g["raw_variant"] == "native: K/V objects, no exist"
            assert g["ceiling"] > 0 and g["raw"] > 0 and g["control"] > 0 and g["bare"] > 0
            assert g["plugin_ms"] > 0 and isinstance(g["core_ms"], float)
            # 8 pages fit one 16 MiB call: that row repeats the direct ceiling's calls (its twin)
            twin = next(r for r in case if r["variant"] == "native: same, 16 MiB calls")[f"{g['op']}_ratio"]
            assert g["ceiling_twin"] == (None if auto == "plugin staged" else twin)
            # the ceiling with the core's header / verification of the same pages made alone added
            alone = costs["core header" if g["op"] == "set" else "core verify alone"]
            with_core = 1 / (1 / g["ceiling"] + alone / costs[f"baseline {g['op']}"])
            assert g["ceiling_with_core"] == pytest.approx(with_core, rel=0.05)
            assert g["ceiling_with_core"] < g["ceiling"]
    assert [(g["mode"], g["page_bytes"]) for g in goals] == [c for c in cases for _ in range(2)]


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_bench_times_the_bare_hooks_in_a_turn_of_their_own_after_their_own_baseline(mooncake_service, monkeypatch,
                                                                                   mode):
    """The Store's calls and the backend's bare hooks are compared in like positions: each in a turn
    of its own, right after a baseline run on its reference (an earlier bench ran the hooks inside
    the Store's turn, alternately before and after its calls, and so compared unlike positions)."""
    from hicache_draft_mooncake import bench as b
    from hicache_draft_mooncake.backend import MooncakeBackend

    events: list[tuple[str, object]] = []
    for cls, what in ((b._Baseline, "baseline"), (b._Native, "native")):
        def logged(self, groups, out, turn=0, _orig=cls.round, _what=what):
            events.append((_what, self.client))
            return _orig(self, groups, out, turn)
        monkeypatch.setattr(cls, "round", logged)
    store_set = Store.page_set

    def logged_store_set(self, transfers, *args, **kwargs):
        events.append(("store set", self.backend.native))
        return store_set(self, transfers, *args, **kwargs)

    hook_set = MooncakeBackend.page_set

    def logged_hook_set(self, transfers, deadline, make_headers=None):
        if make_headers is None:  # not through a Store: the bare hooks
            events.append(("bare set", self.native))
        return hook_set(self, transfers, deadline, make_headers)

    monkeypatch.setattr(Store, "page_set", logged_store_set)
    monkeypatch.setattr(MooncakeBackend, "page_set", logged_hook_set)
    rounds = 3
    rows = b.run_case(mooncake_service, mode, 64 << 10, 4, rounds, b.Checks(), warm=False)
    auto = "plugin" if mode == "shm" else "plugin staged"
    assert [r.variant for r in rows].count(f"{auto}, bare hooks") == 1
    # cut the log into turns: a turn is what runs between a variant's baseline before and after it
    turns, cur = [], []
    for what, client in events:
        if what == "baseline":
            if cur:
                turns.append(cur)
            cur = [(what, client)]
        else:
            cur.append((what, client))
    bare_turns = [t for t in turns if any(w == "bare set" for w, _ in t)]
    store_turns = [t for t in turns if any(w == "store set" for w, _ in t)]
    assert len(bare_turns) == rounds  # one turn per round, never inside the Store's turns
    assert not [t for t in bare_turns if any(w == "store set" for w, _ in t)]
    assert len(store_turns) >= rounds
    if mode == "tcp":  # the bare hooks follow a baseline run on their own client, as the Store's calls do
        for t in bare_turns:
            assert t[0][0] == "baseline" and t[0][1] is t[1][1]


def test_bench_exits_1_and_names_a_broken_check(monkeypatch):
    from hicache_draft_mooncake import bench as b

    def broken_run(modes, sizes, pages, rounds, echo):
        checks = b.Checks()
        checks.expect("every get byte-exact", False, "plugin direct")
        echo("check every get byte-exact: BROKEN in plugin direct")
        return b.Report([], [], checks.result())

    monkeypatch.setattr(b, "run", broken_run)
    result = CliRunner().invoke(mooncake, ["bench", "--quick"])
    assert result.exit_code == 1 and "BROKEN in plugin direct" in result.output


def test_parse_size():
    assert parse_size("64KiB") == 64 << 10 and parse_size("1 GiB") == 1 << 30 and parse_size("4096") == 4096
    with pytest.raises(click.BadParameter):
        parse_size("lots")
