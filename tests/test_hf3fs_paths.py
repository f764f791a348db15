"""Path choice against the hf3fs declaration: plan_paths, `hicache-draft check`, and the controller.

Every target/draft attention combination, in every layout, with and without split heads. The
expected paths are written out from the 3FS facts (fixed one-buffer draft slots, K/V target slots,
zero-copy only for page_first*), not computed by the code under test.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hicache_draft_hf3fs import HF3FS_CAPABILITIES, Hf3fsBackend
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_draft import Attention, Config, IOPath, Layout, PoolKind, Store
from hicache_draft.cli import main
from hicache_draft.controller import CacheController
from hicache_draft.paths import plan_paths, plan_pools, pool_specs
from hicache_draft.testing import MemoryBackend

KV, DRAFT = PoolKind.KV, PoolKind.DRAFT
ZC, GEN, OFF = IOPath.ZERO_COPY, IOPath.GENERIC, IOPath.DISABLED
PS = 4
MLA_MTP_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "configs" / "hf3fs-mla-mtp.toml"

MHA_DRAFT_REASON = (
    "the backend does not declare 'mha' attention for the 'draft' pool (backend note: a 3FS draft slot holds "
    "one buffer; an MHA draft page is K plus V, twice the slot)"
)


def config_dict(
    target: str, draft: str | None, layout: str = "page_first", draft_layout: str | None = None,
    tp_size: int = 1, tp_lcm_size: int | None = None, draft_layers: int = 1,
) -> dict[str, Any]:
    t: dict[str, Any] = {"attention": target, "layers": 3, "layout": layout}
    t.update({"kv_heads": 4, "head_dim": 8} if target == "mha" else {"latent_dim": 24})
    d: dict[str, Any] = {"enabled": draft is not None}
    if draft is not None:
        d.update({"attention": draft, "layers": draft_layers})
        d.update({"kv_heads": 2, "head_dim": 8} if draft == "mha" else {"latent_dim": 16})
        if draft_layout is not None:
            d["layout"] = draft_layout
    return {
        "backend": "hf3fs",
        "backend_options": {"mount_point": "/mnt/3fs", "namespace": "test"},
        "namespace": {"model": "m-target", "draft_model": "m-draft", "kv_dtype": "bfloat16", "page_size": PS},
        "parallel": {"tp_rank": 0, "tp_size": tp_size, "tp_lcm_size": tp_lcm_size},
        "target": t,
        "draft": d,
    }


def plan(**kw: Any) -> dict[PoolKind, tuple[IOPath, str]]:
    cfg = Config.model_validate(config_dict(**kw))
    return {k: (c.path, c.reason) for k, c in plan_paths(cfg, HF3FS_CAPABILITIES).items()}


# -- target pool: every attention and layout ------------------------------------------------------
TARGET_PATHS = {
    ("mha", "page_first"): ZC,
    ("mha", "page_first_direct"): ZC,
    ("mha", "layer_first"): GEN,  # 2·L buffers per page, more than the 2 slots of a page
    ("mha", "page_head"): GEN,  # not zero-copy on 3FS
    ("mla", "page_first"): ZC,
    ("mla", "page_first_direct"): ZC,
    ("mla", "layer_first"): GEN,
}


@pytest.mark.parametrize(("target", "layout"), sorted(TARGET_PATHS))
def test_target_path_for_every_attention_and_layout(target, layout):
    path, reason = plan(target=target, draft=None, layout=layout)[KV]
    assert path is TARGET_PATHS[(target, layout)], reason
    if path is GEN:
        assert f"layout {layout!r}" in reason and "staging buffers" in reason


# -- every target x draft attention combination ---------------------------------------------------
COMBOS = {
    # (target, draft): (kv path, draft path) in the default page_first layout
    ("mha", None): (ZC, OFF),
    ("mla", None): (ZC, OFF),
    ("mha", "mha"): (ZC, OFF),  # EAGLE on a dense model
    ("mha", "mla"): (ZC, ZC),
    ("mla", "mha"): (ZC, OFF),  # MHA EAGLE head on an MLA target
    ("mla", "mla"): (ZC, ZC),  # DeepSeek MTP
}


@pytest.mark.parametrize(("target", "draft"), list(COMBOS), ids=[f"{t}-{d}" for t, d in COMBOS])
def test_every_target_draft_attention_combination(target, draft):
    got = plan(target=target, draft=draft)
    assert (got[KV][0], got[DRAFT][0]) == COMBOS[(target, draft)], got
    if draft is None:
        assert "draft.enabled = false" in got[DRAFT][1]
    elif draft == "mha":
        assert got[DRAFT][1] == MHA_DRAFT_REASON


@pytest.mark.parametrize("target", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_mha_draft_is_disabled_in_every_layout(target, layout):
    target_layout = "page_first" if (target, layout) == ("mla", "page_head") else layout  # page_head is MHA-only
    got = plan(target=target, draft="mha", layout=target_layout, draft_layout=layout)
    assert got[DRAFT] == (OFF, MHA_DRAFT_REASON)


@pytest.mark.parametrize(
    ("draft_layout", "layers", "expected"),
    [
        ("page_first", 1, ZC),
        ("page_first_direct", 1, ZC),
        ("page_first", 3, ZC),  # one buffer whatever the layer count
        ("layer_first", 1, GEN),  # not a zero-copy layout on 3FS
        ("layer_first", 3, GEN),
    ],
)
def test_mla_draft_paths(draft_layout, layers, expected):
    got = plan(target="mla", draft="mla", draft_layout=draft_layout, draft_layers=layers)
    assert got[DRAFT][0] is expected, got[DRAFT]


def test_split_heads_are_not_made_on_3fs_and_the_reason_says_so():
    """3FS does not declare split_heads: an MHA pool keeps per-rank keys (the one split-heads policy)."""
    mha = plan(target="mha", draft="mla", tp_size=2, tp_lcm_size=4, layout="page_head")
    assert mha[KV][0] is not OFF and "does not declare split_heads: per-rank keys" in mha[KV][1]
    assert mha[DRAFT][0] is not OFF
    cfg = Config.model_validate(config_dict("mha", "mla", "page_head", None, 2, 4, 1))
    assert plan_pools(cfg, HF3FS_CAPABILITIES)[KV].split == 1
    mla = plan(target="mla", draft="mla", tp_size=2, tp_lcm_size=4)
    assert (mla[KV][0], mla[DRAFT][0]) == (ZC, ZC)


LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    target = draw(st.sampled_from(["mha", "mla"]))
    draft = draw(st.sampled_from(["mha", "mla", None]))
    allowed = lambda att: [x for x in LAYOUTS if not (att == "mla" and x == "page_head")]  # noqa: E731
    layout = draw(st.sampled_from(allowed(target)))
    draft_layout = draw(st.sampled_from(allowed(draft))) if draft else None
    tp_size = draw(st.sampled_from([1, 2]))
    lcm = draw(st.sampled_from([None, tp_size, 2 * tp_size]))
    return config_dict(target, draft, layout, draft_layout, tp_size, lcm, draw(st.integers(1, 3)))


@settings(max_examples=150, deadline=None)
@given(configs())
def test_no_plan_ever_asks_3fs_for_what_it_cannot_hold(data):
    cfg = Config.model_validate(data)
    got = plan_paths(cfg, HF3FS_CAPABILITIES)
    plans = plan_pools(cfg, HF3FS_CAPABILITIES)
    specs = pool_specs(cfg)
    for kind, choice in got.items():
        if choice.path is OFF:
            assert choice.reason
            continue
        spec = specs[kind]
        cap = HF3FS_CAPABILITIES.pools[kind]
        assert spec.attention in cap.attention
        assert kind is KV or spec.attention is Attention.MLA  # never an MHA draft
        if spec.attention is Attention.MHA:
            assert plans[kind].split == 1  # no split heads on 3FS
        if choice.path is ZC:
            assert spec.layout in {Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT}
            assert spec.buffers_per_page() <= (2 if kind is KV else 1)
    if got[KV].path is OFF:
        assert got[DRAFT].path is OFF


# -- the CLI ---------------------------------------------------------------------------------------
def write_config(tmp_path, data: dict[str, Any]) -> str:
    path = tmp_path / "hf3fs.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def no_construction(monkeypatch):
    def boom(self, options, context):
        raise AssertionError("check must not construct the backend")

    monkeypatch.setattr(Hf3fsBackend, "__init__", boom)


def test_check_json_shows_the_disabled_mha_draft_with_its_reason(tmp_path, no_construction):
    cfg = write_config(tmp_path, config_dict(target="mha", draft="mha"))
    res = CliRunner().invoke(main, ["check", cfg, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["backend"] == "hf3fs" and report["distribution"] == "hicache-draft-hf3fs"
    assert report["pools"]["kv"]["path"] == "zero_copy"
    assert report["pools"]["draft"] == {
        "path": "disabled", "reason": MHA_DRAFT_REASON, "role": "draft", "component": "kv",
        "hit_policy": "all_pages", "split": 1, "writer": True,
    }
    assert report["capabilities"] == HF3FS_CAPABILITIES.summary()


def test_check_text_for_the_shipped_mla_mtp_example(no_construction):
    res = CliRunner().invoke(main, ["check", str(MLA_MTP_EXAMPLE)])
    assert res.exit_code == 0, res.output
    assert "backend hf3fs" in res.stdout
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("│")]
    assert any("kv" in ln and "zero_copy" in ln for ln in lines), res.stdout
    assert any("draft" in ln and "zero_copy" in ln for ln in lines), res.stdout


def test_check_text_never_splits_the_config_path_or_backend_name(tmp_path, no_construction):
    # Rich wraps at 80 columns when stdout is not a terminal; a long checkout path once split
    # "backend hf3fs" over two lines. The header line is prose and must stay whole.
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 4)
    deep.mkdir(parents=True)
    cfg = deep / MLA_MTP_EXAMPLE.name
    cfg.write_text(MLA_MTP_EXAMPLE.read_text())
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 0, res.output
    header = res.stdout.splitlines()[0]
    assert str(cfg) in header and "backend hf3fs (hicache-draft-hf3fs)" in header, res.stdout


def test_check_text_names_the_reason_for_a_disabled_draft(tmp_path, no_construction):
    cfg = write_config(tmp_path, config_dict(target="mla", draft="mha"))
    res = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["check", cfg])
    assert res.exit_code == 0, res.output
    assert "disabled" in res.stdout
    assert "does not declare 'mha' attention for the 'draft' pool" in res.stdout
    assert "K plus V" in res.stdout


def test_check_refuses_bad_hf3fs_options_with_exit_2(tmp_path, no_construction):
    data = config_dict(target="mla", draft="mla")
    data["backend_options"]["mount_point"] = "mnt/3fs"
    res = CliRunner().invoke(main, ["check", write_config(tmp_path, data)])
    assert res.exit_code == 2
    assert "backend_options.mount_point" in res.output and "absolute path" in res.output


def test_backends_lists_hf3fs_declaration():
    res = CliRunner().invoke(main, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    start = res.stdout.index("[")  # a plugin's command-load warning may precede the JSON
    rows = {r["name"]: r for r in json.loads(res.stdout[start:])}
    assert rows["hf3fs"]["error"] is None
    assert rows["hf3fs"]["capabilities"] == HF3FS_CAPABILITIES.summary()
    assert rows["hf3fs"]["distribution"] == "hicache-draft-hf3fs"


# -- the controller runs what check says, with no runtime failure ----------------------------------
class Hf3fsShaped(MemoryBackend):
    """The in-memory test backend, declaring exactly what hf3fs declares."""

    capabilities = HF3FS_CAPABILITIES


@pytest.mark.parametrize(("target", "draft"), [("mha", "mha"), ("mla", "mha"), ("mla", "mla"), ("mha", "mla")])
def test_controller_follows_the_check_plan_and_never_fails_at_runtime(target, draft):
    MemoryBackend.reset()
    cfg = Config.model_validate({**config_dict(target=target, draft=draft), "backend": "memory"})
    store = Store("memory", Hf3fsShaped, HF3FS_CAPABILITIES, {"space": secrets.token_hex(4)})
    try:
        with CacheController(cfg, store, num_pages=8) as ctrl:
            assert {k: c.path for k, c in ctrl.plan.items()} == {k: p for k, (p, _) in plan(
                target=target, draft=draft).items()}
            for pool in filter(None, [ctrl.target_pool, ctrl.draft_pool]):
                pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8))
            tokens = list(range(3 * PS))
            slots = [0, PS, 2 * PS]
            b = ctrl.backup(tokens, slots)
            draft_on = draft == "mla"
            assert ctrl.draft_active is draft_on
            assert b.pages_written == ({KV: 3, DRAFT: 3} if draft_on else {KV: 3})
            assert b.failed == ({KV: 0, DRAFT: 0} if draft_on else {KV: 0})
            assert all(kinds.keys() <= {KV, DRAFT} for _, kinds in MemoryBackend.calls)
            assert not any(DRAFT in kinds for _, kinds in MemoryBackend.calls) or draft_on
            r = ctrl.prefetch(tokens, [4 * PS, 5 * PS, 6 * PS])
            assert r.pages == 3 and r.restored[KV] == 3
            assert r.draft_cold == ([] if draft_on else [0, 1, 2])
            for i in range(3):
                assert ctrl.target_pool.page_bytes(slots[i]) == ctrl.target_pool.page_bytes((4 + i) * PS)
    finally:
        store.close()
        MemoryBackend.reset()


# -- extra pools: what one-buffer 3FS slots allow ---------------------------------------------------
ROWS, MLA_WINDOW = {"row_bytes": [132]}, {"attention": "mla", "latent_dim": 16}
MHA_WINDOW = {"attention": "mha", "kv_heads": 2, "head_dim": 8}
EXTRA_PATHS = [
    # (pool entry, path): written out from the slots, not computed
    ({"name": "indexer", **ROWS}, ZC),  # page_first: one buffer of L * row bytes, one slot
    ({"name": "indexer", **ROWS, "layout": "layer_first"}, GEN),  # L rows, copied into one buffer
    ({"name": "draft_indexer", **ROWS}, ZC),
    ({"name": "draft_indexer", **ROWS, "layout": "page_first_direct"}, ZC),
    ({"name": "draft_indexer", **ROWS, "layout": "layer_first"}, GEN),
    ({"name": "draft_swa", **MLA_WINDOW}, ZC),  # an MLA window page is one buffer
    ({"name": "draft_swa", **MHA_WINDOW}, OFF),  # K plus V: twice the slot
    ({"name": "draft_mamba", "role": "draft", "component": "state", "row_bytes": [64]}, ZC),
    ({"name": "draft_mamba", "role": "draft", "component": "state", "row_bytes": [64, 32]}, GEN),  # 2 buffers
    ({"name": "swa", **MLA_WINDOW}, OFF),  # no target window pools (see the kv note)
    ({"name": "swa", **MHA_WINDOW}, OFF),
    ({"name": "mamba", "row_bytes": [64, 32]}, OFF),  # no target state pools
]


@pytest.mark.parametrize(("entry", "expected"), EXTRA_PATHS, ids=[f"{e['name']}-{i}" for i, (e, _) in
                                                                  enumerate(EXTRA_PATHS)])
def test_extra_pool_paths_follow_the_one_buffer_slots(entry, expected):
    data = config_dict(target="mla", draft="mla")
    data["pools"] = [{"layers": 3, **entry}]
    plans = plan_pools(Config.model_validate(data), HF3FS_CAPABILITIES)
    got = plans[entry["name"]]
    assert got.path is expected, got.reason
    if expected is OFF and entry["name"] in ("swa", "mamba"):
        assert "for 'kv' pools" in got.reason and "backend note" in got.reason
    if expected is not OFF:
        assert got.spec.attention in (None, Attention.MLA)
        if expected is ZC:
            assert got.spec.buffers_per_page() == 1
