"""The `hicache-draft` command sees this plugin through its entry point: the installed script
once (a subprocess), then in-process through click's runner."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hicache_draft.cli import main

EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "sqlite-mha-eagle.toml"


def hicache_draft(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("hicache-draft")
    exe = str(script) if script.exists() else shutil.which("hicache-draft")
    assert exe, "the hicache-draft command is not installed"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_backends_lists_sqlite_with_its_declaration():
    out = hicache_draft("backends", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    sqlite = rows["sqlite"]
    assert sqlite["error"] is None
    assert sqlite["distribution"] == "hicache-draft-sqlite"
    caps = sqlite["capabilities"]
    assert caps["persistent"] is True and caps["split_heads"] is True
    for pool in ("kv", "draft"):
        assert caps["pools"][pool]["attention"] == ["mha", "mla"]
        assert caps["pools"][pool]["components"] == ["indexer", "kv", "state", "window"]
        assert caps["pools"][pool]["generic"] is True
        assert len(caps["pools"][pool]["zero_copy_layouts"]) == 4


def test_check_plans_both_pools_zero_copy_without_opening_the_file():
    out = CliRunner().invoke(main, ["check", str(EXAMPLE_CONFIG), "--json"])  # its directory need not exist
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["backend"] == "sqlite"
    assert {pool: p["path"] for pool, p in report["pools"].items()} == {"kv": "zero_copy", "draft": "zero_copy"}


@pytest.mark.parametrize(
    ("option", "value", "field"), [("max_bytes", "10", "max_bytes"), ("path", '":memory:"', "path")]
)
def test_check_rejects_bad_options_naming_the_field(tmp_path, option, value, field):
    text = EXAMPLE_CONFIG.read_text().replace(f"{option} = ", f"{option} = {value} # ", 1)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    out = CliRunner().invoke(main, ["check", str(cfg)])
    assert out.exit_code == 2
    assert f"backend_options.{field}" in out.output
