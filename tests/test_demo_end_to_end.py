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


def test_both_pairs_are_reported(report):
    assert [p["attention"] for p in report["pairs"]] == ["mha", "mla"]
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
    assert p["control_restored_pages"]["kv"] == p["restored_pages"]["kv"]
    assert p["control_restored_pages"]["draft"] == 0


@pytest.mark.parametrize("index", [0, 1])
def test_logits_after_restore_equal_a_full_recompute(report, index):
    p = report["pairs"][index]
    assert p["logits_match"] is True
    assert all(p["checks"].values()), p["checks"]
    assert p["logits_match_first_run"] is True
    assert p["same_tokens"] is True  # greedy speculative decoding never changes the output


def test_user_layouts_are_used_and_page_head_falls_back_for_mla(report):
    mha, mla = report["pairs"]
    assert mha["target_layout"] == "page_head"
    assert mla["target_layout"] == "page_first_direct"
