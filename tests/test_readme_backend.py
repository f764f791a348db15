"""The backend printed in README.md is complete: it registers, validates and passes the conformance kit."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from hicache_draft import Store, register_backend, unregister_backend
from hicache_draft.testing import ConformanceSuite

README = Path(__file__).resolve().parent.parent / "README.md"


def _load_readme_backend(tmp_dir: Path):
    text = README.read_text()
    block = re.search(r"<!-- readme-backend:start -->\n```python\n(.*?)```\n<!-- readme-backend:end -->", text, re.S)
    assert block, "README.md lost its backend example"
    code = block.group(1)
    cls_lines = [ln for ln in code[code.index("class DirBackend"):].splitlines() if ln.strip()]
    assert len(cls_lines) <= 32, f"the README promises at most 32 lines, the class has {len(cls_lines)}"
    path = tmp_dir / "hicache_dir_readme.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("hicache_dir_readme", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hicache_dir_readme"] = mod
    spec.loader.exec_module(mod)
    return mod.DirBackend


class TestReadmeBackend(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self, tmp_path_factory):
        cls = _load_readme_backend(tmp_path_factory.mktemp("code"))
        root = tmp_path_factory.mktemp("root")
        register_backend("dir", cls)
        yield lambda: Store.open("dir", {"root": str(root)})
        unregister_backend("dir")
