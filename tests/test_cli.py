"""The hicache-draft command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hicache_draft.cli import main
from hicache_draft.plugins import register_backend, unregister_backend
from hicache_draft.testing import MemoryBackend
from tests.helpers import BLOCK_TORCH, fake_distribution

CONFIG = """
backend = "memory"
[backend_options]
space = "cli"
[namespace]
model = "m"
draft_model = "d"
page_size = 16
[target]
attention = "mla"
layers = 4
latent_dim = 64
layout = "page_first"
[draft]
attention = "mha"
kv_heads = 2
head_dim = 16
"""


@pytest.fixture
def memory_backend():
    register_backend("memory", MemoryBackend, distribution="test-dist")
    yield
    unregister_backend("memory")


def test_backends_json_lists_declarations(memory_backend):
    res = CliRunner().invoke(main, ["backends", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    mem = rows["memory"]
    assert mem["distribution"] == "test-dist" and mem["error"] is None
    assert set(mem["capabilities"]["pools"]) == {"kv", "draft"}
    assert mem["capabilities"]["split_heads"] is True
    table = CliRunner().invoke(main, ["backends"])
    assert table.exit_code == 0 and "memory" in table.output


def test_check_json_reports_paths(memory_backend, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    res = CliRunner().invoke(main, ["check", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["backend"] == "memory"
    assert report["pools"]["kv"]["path"] == "zero_copy"
    assert report["pools"]["draft"]["path"] == "zero_copy"
    human = CliRunner().invoke(main, ["check", str(cfg)])
    assert human.exit_code == 0 and "zero_copy" in human.output


def test_bad_config_exits_2_naming_the_field(memory_backend, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace("page_size = 16", "page_size = -1"))
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 2
    assert "namespace.page_size" in res.output
    assert "Traceback" not in res.output


def test_bad_backend_option_exits_2(memory_backend, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace('space = "cli"', 'spaec = "cli"'))
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 2 and "backend_options.spaec" in res.output


def test_unknown_backend_exits_2_listing_installed(memory_backend, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.replace('backend = "memory"', 'backend = "nosuch"'))
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 2
    assert "unknown backend 'nosuch'" in res.output and "memory" in res.output


def test_installed_script_runs_without_traceback(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("backend = 1\n")
    exe = Path(sys.executable).with_name("hicache-draft")
    proc = subprocess.run([str(exe), "check", str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "invalid config" in proc.stderr


LIGHT = BLOCK_TORCH + """
import json
from click.testing import CliRunner
import hicache_draft
from hicache_draft import load_config
from hicache_draft.cli import main
cfg = load_config(sys.argv[1], environ={})
backends = CliRunner().invoke(main, ["backends", "--json"])
check = CliRunner().invoke(main, ["check", sys.argv[1], "--json"])
helps = [CliRunner().invoke(main, [group, "--help"]).exit_code for group in ("file", "mooncake", "demo")]
print(json.dumps({
    "torch_loaded": "torch" in sys.modules, "backend": cfg.backend, "helps": helps,
    "backends": [backends.exit_code, json.loads(backends.stdout)],
    "check": [check.exit_code, json.loads(check.stdout) if check.exit_code == 0 else check.output],
}))
"""


def test_discovery_check_and_config_need_no_torch(tmp_path):
    """Where torch cannot be imported, ``backends``, ``check``, config loading and the plugins' command
    groups still work: none of them touches a tensor."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[backend_options]\nroot = "/var/cache/x"\n[namespace]\nmodel = "m"\ndraft_model = "d"\n'
                   '[target]\nkv_heads = 2\nhead_dim = 8\n[draft]\nkv_heads = 1\nhead_dim = 8\n')
    proc = subprocess.run([sys.executable, "-c", LIGHT, str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["torch_loaded"] is False and out["backend"] is None
    code, rows = out["backends"]
    assert code == 0
    file = next(r for r in rows if r["name"] == "file")
    assert file["error"] is None and file["default"] is True
    code, report = out["check"]
    assert code == 0, report
    assert report["backend"] == "file" and report["backend_default"] is True
    assert report["pools"]["kv"]["path"] == "zero_copy" and report["pools"]["draft"]["path"] == "zero_copy"
    assert out["helps"] == [0, 0, 0]
    torch_probe = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import torch"], capture_output=True, timeout=60)
    assert torch_probe.returncode != 0  # the block itself works


def test_stats_of_a_root_asks_the_backends_own_command(memory_backend, tmp_path):
    res = CliRunner().invoke(main, ["stats", str(tmp_path), "--backend", "memory"])
    assert res.exit_code == 1 and "backend 'memory' (test-dist) offers no stats command" in res.output
    res = CliRunner().invoke(main, ["stats", str(tmp_path / "none"), "--backend", "memroy"])
    assert res.exit_code == 2 and "did you mean 'memory'?" in res.output
    res = CliRunner().invoke(main, ["stats", "http://127.0.0.1:1/metrics", "--timeout", "2"])
    assert res.exit_code == 1 and "cannot read metrics from http://127.0.0.1:1/metrics" in res.output
    assert "file (default)" in CliRunner().invoke(main, ["backends"]).output


def test_a_plugin_whose_commands_exit_at_import_does_not_break_the_cli(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "hicache-draft-exits-cli", {"hicache_draft.commands": {"exits": "hcd_exits_cli:group"}},
                      {"hcd_exits_cli": "raise SystemExit(4)\n"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "hicache_draft.cli", "backends", "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "commands of plugin 'exits' failed to load: SystemExit: 4" in proc.stderr
    assert any(r["name"] == "file" for r in json.loads(proc.stdout))


def test_importing_the_package_changes_no_process_wide_state():
    script = (
        "import sys, warnings\n"
        "before = list(warnings.filters)\n"
        "import hicache_draft\n"
        "assert 'torch' not in sys.modules\n"
        "from hicache_draft import CacheController\n"  # imports torch, quietly, without a lasting filter
        "assert 'torch' in sys.modules and CacheController.__name__ == 'CacheController'\n"
        "assert warnings.filters == before, [f for f in warnings.filters if f not in before]\n"
    )
    proc = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to initialize NumPy" not in proc.stderr


SPLIT_CONFIG = """
[namespace]
model = "meta-llama/Llama-3.1-8B-Instruct"
page_size = 16
[parallel]
tp_rank = 1
tp_size = 2
tp_lcm_size = 4
[target]
attention = "mha"
layers = 2
kv_heads = 4
head_dim = 8
layout = "page_head"
[[pools]]
name = "swa"
attention = "mha"
kv_heads = 4
head_dim = 8
layers = 1
window_pages = 4
"""


def test_check_plans_an_sglang_deployment_as_the_adapter_does(tmp_path, memory_backend):
    """`check --sglang-extra-config`: the adapter's identities (draft model from SGLang's model name), its
    legacy flat draft pages (generic: no registered memory) and the one split-heads policy."""
    cfg = tmp_path / "sglang.toml"
    cfg.write_text(SPLIT_CONFIG)
    extra = {"backend_name": "hicache_draft", "interface_v1": True, "hicache_draft": {
        "backend": "memory", "backend_options": {"space": "cli-sglang"},
        "legacy_draft_pool": {"attention": "mha", "layers": 1, "kv_heads": 4, "head_dim": 8}}}
    res = CliRunner().invoke(main, ["check", str(cfg), "--json", "--sglang-extra-config", json.dumps(extra)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["sglang"] and report["split_heads"]
    assert report["draft_model"] == "meta-llama/Llama-3.1-8B-Instruct#draft"
    kv, draft, swa = report["pools"]["kv"], report["pools"]["draft"], report["pools"]["swa"]
    assert (kv["path"], kv["split"], len(kv["namespaces"])) == ("zero_copy", 2, 2)
    assert draft["path"] == "generic" and "flat pages" in draft["reason"]
    assert (swa["role"], swa["component"], swa["hit_policy"], swa["split"]) == ("target", "window", "trailing_pages", 2)
    wide = CliRunner(env={"COLUMNS": "200"})
    text = wide.invoke(main, ["check", str(cfg), "--sglang-extra-config", json.dumps(extra)])
    assert text.exit_code == 0 and "window, trailing_pages" in text.output
    bad = CliRunner().invoke(main, ["check", str(cfg), "--sglang-extra-config", '{"hicache_draft": {"nope": 1}}'])
    assert bad.exit_code == 2 and "hicache_draft.nope" in bad.output
