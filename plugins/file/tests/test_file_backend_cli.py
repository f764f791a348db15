"""The ``hicache-draft file`` commands and the benchmark's building blocks (no timing asserted)."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from click.testing import CliRunner
from hicache_draft_file.bench import bench_exists, bench_restart, format_report
from hicache_draft_file.cli import file_group


def test_commands_are_published_for_the_core_cli() -> None:
    eps = {ep.name: ep for ep in entry_points(group="hicache_draft.commands")}
    assert eps["file"].load() is file_group
    assert {ep.name for ep in entry_points(group="hicache_draft.backends")} >= {"file"}
    assert set(file_group.commands) == {"bench", "stats"}


def test_stats_reports_use(open_store, kit, tmp_path: Path) -> None:
    store = open_store()
    store.page_set(kit.both([kit.group(i) for i in range(3)], 1024))
    out = CliRunner().invoke(file_group, ["stats", str(tmp_path / "store"), "--json"])
    assert out.exit_code == 0, out.output
    use = json.loads(out.output)
    assert use["pages"] == 6 and use["segments"] == 1 and use["bytes"] > 6 * 1024
    missing = CliRunner().invoke(file_group, ["stats", str(tmp_path / "nope")])
    assert missing.exit_code != 0 and str(tmp_path / "nope") in missing.output


def test_bench_pieces_measure_real_stores(tmp_path: Path) -> None:
    ex = bench_exists(tmp_path, 256)
    assert ex["keys"] == 256 and ex["file_us_per_key"] > 0 and ex["baseline_us_per_key"] > 0
    rs = bench_restart(tmp_path, 1024, batch=64)
    assert rs["pages"] == 1024 and rs["segments"] == 16 and rs["first_exists_s"] > 0
    rep = {
        "quick": True, "batch": 128, "cpus": 2, "goals_met": False, "exists": ex, "restart": [rs],
        "sizes": [{"page_bytes": 65536,
                   "gbps": {op: {"baseline": 1.0, "baseline_threads": 1.1, "zero_copy": 2.0, "generic": 1.5}
                            for op in ("set", "get")},
                   "ratios": {"set_zero_copy": 2.0, "set_generic": 1.5, "set_goal": 2.0,
                              "get_zero_copy": 2.0, "get_generic": 1.5, "get_goal": 1.0,
                              "set_zero_copy_vs_threads": 1.8, "get_zero_copy_vs_threads": 1.8}}],
    }
    text = format_report(rep)
    assert "64K  set" in text and "2.00x" in text and "GOALS NOT MET" in text


def test_bench_dir_that_does_not_exist_yet_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file bench --dir DIR`` creates DIR (and its parents) for its scratch store, as ``bench
    pipeline --root`` does, instead of failing in mkdtemp."""
    import hicache_draft_file.bench as bench_mod

    class Reached(Exception):
        pass

    def stop(scratch: Path) -> None:
        assert scratch.parent == tmp_path / "a" / "b" and scratch.is_dir()
        raise Reached

    monkeypatch.setattr(bench_mod, "load_reference", stop)
    with pytest.raises(Reached):
        bench_mod.run_bench(quick=True, root=tmp_path / "a" / "b", settle_max_s=0)
