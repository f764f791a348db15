"""Configuration loading, env overrides and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_draft import ConfigError, Layout, OnMiss, load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "configs" / "file-mha-eagle.toml"


def test_documented_example_loads():
    cfg = load_config(EXAMPLE, environ={})
    assert cfg.backend == "file"
    assert cfg.backend_options == {"root": "/var/cache/hicache-draft"}
    assert cfg.namespace.page_size == 64
    assert cfg.target.layout is Layout.PAGE_FIRST
    assert cfg.draft.enabled and cfg.draft.on_miss is OnMiss.SHORTEN
    assert cfg.parallel.split_factor == 1


def test_json_file_and_env_override(tmp_path):
    data = {
        "backend": "file",
        "namespace": {"model": "m", "draft_model": "d"},
        "target": {"attention": "mla", "layers": 3, "latent_dim": 64},
        "draft": {"attention": "mha", "kv_heads": 2, "head_dim": 16},
    }
    p = tmp_path / "c.json"
    p.write_text(json.dumps(data))
    env = {
        "HICACHE_DRAFT_BACKEND": "mooncake",
        "HICACHE_DRAFT_PARALLEL__TP_RANK": "1",
        "HICACHE_DRAFT_PARALLEL__TP_SIZE": "2",
        "HICACHE_DRAFT_BACKEND_OPTIONS__ROOT": "/x",
        "HICACHE_DRAFT_DRAFT__ON_MISS": "target_only",
        "UNRELATED": "1",
    }
    cfg = load_config(p, environ=env)
    assert cfg.backend == "mooncake"
    assert (cfg.parallel.tp_rank, cfg.parallel.tp_size) == (1, 2)
    assert cfg.backend_options == {"root": "/x"}
    assert cfg.draft.on_miss is OnMiss.TARGET_ONLY
    assert cfg.draft_layout is Layout.PAGE_FIRST


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"namespace": {"model": "m", "page_size": 0}}, "namespace.page_size", "greater than or equal to 1"),
        ({"namespace": {"model": "m", "kv_dtype": "float64"}}, "namespace.kv_dtype", "Input should be"),
        ({"target": {"attention": "mha", "layers": 2}}, "target", "needs kv_heads and head_dim"),
        ({"target": {"attention": "mla", "latent_dim": 8, "layout": "page_head"}}, "target", "MHA-only"),
        ({"parallel": {"tp_rank": 2, "tp_size": 2}}, "parallel", "tp_rank 2 must be < tp_size 2"),
        ({"parallel": {"tp_size": 2, "tp_lcm_size": 3}}, "parallel", "multiple of tp_size"),
        ({"draft": {"enabled": True, "attention": "mla", "latent_dim": 4}, "namespace": {"model": "m"}},
         None, "draft_model is required"),
        ({"bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"handover_poll_us": -1}, "handover_poll_us", "greater than or equal to 0"),
        ({"handover_poll_us": 20_000}, "handover_poll_us", "less than or equal to 10000"),
        ({"parallel": {"tp_size": 2, "tp_lcm_size": 4}, "target": {"attention": "mha", "kv_heads": 3, "head_dim": 8}},
         None, "not divisible by the split factor"),
    ],
)
def test_bad_config_names_the_field(patch, field, words):
    data = {
        "namespace": {"model": "m"},
        "target": {"attention": "mha", "kv_heads": 4, "head_dim": 8},
    }
    for k, v in patch.items():
        data[k] = v
    with pytest.raises(ConfigError) as err:
        load_config(data=data, environ={})
    msg = str(err.value)
    assert words in msg
    if field:
        assert field in msg
        assert err.value.field is not None and err.value.field.startswith(field)


def test_unreadable_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("backend = [unclosed")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad, environ={})


def test_split_heads_factor():
    cfg = load_config(
        data={
            "namespace": {"model": "m"},
            "parallel": {"tp_size": 2, "tp_rank": 1, "tp_lcm_size": 4},
            "target": {"attention": "mha", "kv_heads": 4, "head_dim": 8, "layout": "page_head"},
        },
        environ={},
    )
    assert cfg.parallel.split_factor == 2
