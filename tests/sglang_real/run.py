"""Run the real-SGLang cases for one release in this (fresh) process: ``run.py RELEASE [pytest args]``.

``bootstrap.install`` must run before anything imports sglang, so each release gets its own
process; ``tests/test_sglang_real.py`` starts one per release.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    release, args = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, str(HERE))
    import bootstrap

    bootstrap.install(release)
    import pytest

    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]), *args]))
