"""The demo's numbers hold, end to end, on the file backend, with every run in its own process."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hicache_draft.demo.command import demo

SMALL = ["--prompt-tokens", "192", "--period", "48", "--decode-tokens", "24", "--page-size", "16"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    cfg = tmp_path_factory.mktemp("cfg") / "demo.toml"
    # A user config: backend, its options and a layout; the demo lays its models' shapes over it.
    cfg.write_text(
        'backend = "file"\n'
        f'[backend_options]\nroot = "{root}"\n'
        '[namespace]\nmodel = "ignored-by-the-demo"\n'
        '[target]\nlayout = "page_head"\nkv_heads = 1\nhead_dim = 1\n'
    )
    result = CliRunner().invoke(demo, ["--config", str(cfg), "--json", *SMALL])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    doc["_root"] = root
    return doc


def test_every_pair_is_reported(report):
    assert [p["name"] for p in report["pairs"]] == ["mha", "mla", "dsa"]
    assert [p["attention"] for p in report["pairs"]] == ["mha", "mla", "mla"]
    assert report["backend"] == "file"
    assert not report["temporary_store"]
    assert any(report["_root"].iterdir()), "the file backend wrote nothing under the given root"


@pytest.mark.parametrize("index", [0, 1])
def test_restart_restores_both_pools_and_keeps_accept_length(report, index):
    p = report["pairs"][index]
    restored = p["restored_pages"]
    assert restored["kv"] > 0 and restored["draft"] > 0
    assert restored["kv"] == restored["draft"]
    assert p["prefill_tokens_skipped"] == restored["kv"] * report["page_size"]
    assert p["prefill_tokens_skipped"] + p["prefill_tokens_computed"] == report["prompt_tokens"]
    acc = p["accept_length"]
    assert acc["first"] >= 2.0  # the draft is useful at all
    assert acc["after_restart"] >= 0.9 * acc["first"]
    m = p["metrics"]
    assert m["first"]["kv"]["pages_written"] == p["pages_backed_up"]["kv"]
    assert m["first"]["draft"]["pages_written"] == p["pages_backed_up"]["draft"]
    assert m["after_restart"]["kv"]["hits"] == restored["kv"]
    assert m["after_restart"]["draft"]["hits"] == restored["draft"]
    assert m["control_no_draft"]["draft"]["hits"] == 0


@pytest.mark.parametrize("index", [0, 1])
def test_control_without_draft_offload_is_clearly_worse(report, index):
    p = report["pairs"][index]
    acc = p["accept_length"]
    assert acc["control_no_draft"] <= 0.6 * acc["first"]
    control = p["restarts"]["control_no_draft"]["restored_pages"]
    assert control["kv"] == p["restored_pages"]["kv"]
    assert control.get("draft", 0) == 0


@pytest.mark.parametrize("index", [0, 1, 2])
def test_logits_after_restore_equal_a_full_recompute(report, index):
    p = report["pairs"][index]
    assert p["logits_match"] is True
    assert all(p["checks"].values()), p["checks"]
    assert p["logits_match_first_run"] is True
    assert p["same_tokens"] is True  # greedy speculative decoding never changes the output


def test_user_layouts_are_used_and_page_head_falls_back_for_mla(report):
    mha, mla, dsa = report["pairs"]
    assert mha["target_layout"] == "page_head"
    assert mla["target_layout"] == "page_first_direct" == dsa["target_layout"]


# -- the DSA pair: MLA + top-k indexer target, MTP-like draft with its own indexer ------------------
INDEXERS = ("indexer", "draft_indexer")


@pytest.fixture
def dsa(report):
    return report["pairs"][2]


def test_dsa_full_restore_brings_back_all_four_pools_and_keeps_accept_length(dsa, report):
    assert dsa["pools"] == ["kv", "draft", *INDEXERS]
    restored = dsa["restored_pages"]
    assert restored["kv"] > 0
    assert set(restored.values()) == {restored["kv"]}  # every pool the whole prefix
    assert dsa["prefill_tokens_skipped"] == restored["kv"] * report["page_size"]
    acc = dsa["accept_length"]
    assert acc["first"] >= 2.0
    assert acc["after_restart"] == acc["first"]  # the same bits as run 1, so the same proposals accepted
    assert dsa["checks"]["target_indexer_bytes"] and dsa["checks"]["draft_indexer_bytes"]
    assert dsa["logits_match"] and dsa["logits_match_first_run"]
    m = dsa["metrics"]["after_restart"]
    assert all(m[pool]["hits"] == restored[pool] for pool in dsa["pools"])
    assert all(dsa["io_paths"][pool]["path"] != "disabled" for pool in dsa["pools"])


def test_dsa_control_without_the_draft_indexer_restores_draft_kv_and_loses_acceptance(dsa):
    """SGLang #28895: the config has no draft_indexer pool, so only the draft KV comes back."""
    run = dsa["restarts"]["control_no_draft_indexer"]
    assert "draft_indexer" not in run["restored_pages"]
    assert run["restored_pages"]["draft"] == run["restored_pages"]["indexer"] == dsa["restored_pages"]["kv"]
    assert run["prefill_tokens_skipped"] == dsa["prefill_tokens_skipped"]
    acc = dsa["accept_length"]
    assert acc["control_no_draft_indexer"] <= 0.6 * acc["first"]
    assert "draft_indexer" not in dsa["metrics"]["control_no_draft_indexer"]


def test_dsa_control_without_the_target_indexer_gets_no_hit(dsa):
    """Run 1 offloaded every pool but the target indexer; the restart declares it: an all-pages pool
    with no page stored, so nothing is restored though the KV pages are there."""
    assert "indexer" not in dsa["pages_backed_up"] and dsa["pages_backed_up"]["kv"] > 0
    run = dsa["restarts"]["control_no_target_indexer"]
    assert run["hit"]["indexer"] == 0
    assert run["hit"]["kv"] > 0 and run["hit"]["draft"] > 0  # the other pools' pages were stored
    assert run["prefill_tokens_skipped"] == 0
    assert set(run["restored_pages"].values()) == {0}
    # Nothing restored, everything computed: the draft is as good as in run 1.
    assert dsa["accept_length"]["control_no_target_indexer"] == dsa["accept_length"]["first"]
    assert dsa["metrics"]["control_no_target_indexer"]["kv"]["hits"] == 0


def test_the_table_shows_the_three_dsa_rows_next_to_the_others(report):
    from rich.console import Console

    from hicache_draft.demo.report import render

    console = Console(record=True, width=200)
    render(report, console)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if line.startswith("│")]
    assert [r[0] for r in rows] == [
        "mha: all restored", "mha: no draft offload", "mla: all restored", "mla: no draft offload",
        "dsa: all restored", "dsa: no draft indexer", "dsa: no target indexer",
    ]
    dsa_rows = rows[4:]
    assert dsa_rows[1][1].endswith("/-")  # that run's config has no draft_indexer pool
    assert dsa_rows[2][1] == "0/0/0/0"
    assert [r[-1] for r in rows] == ["yes", "-", "yes", "-", "yes", "-", "-"]
