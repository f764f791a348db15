"""SGLang's own host pools and controllers drive the adapter, one child process per release.

The cases live in ``tests/sglang_real/`` (``cases_*.py``, collected only by the child, which first
makes that release importable: see ``tests/sglang_real/bootstrap.py`` for the shims and why).
What runs per release keeps CI short: the newest release runs everything (the adapter contract,
pool views and the full round-trip matrix), 0.5.18 (the last release with the legacy draft path
and the two-field ``PoolTransferResult``) runs the controller cases, the DSA / SWA models and the
agreement of ``check`` with the adapter, and each release in between
whose storage interface differs runs the smoke cases (one round trip per path and pool pair, every
``PoolName`` member, the ``should_backup`` gate, clear).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUN = HERE / "sglang_real" / "run.py"
CASES = HERE / "sglang_real"

# release -> pytest selection. 0.5.20 differs from 0.5.19 only by one DeepSeek-V4 PoolName member,
# which 0.5.21+ also define, so it is not run.
RELEASES = {
    "0.5.23": [str(CASES / "cases_adapter.py"), str(CASES / "cases_pools.py"), str(CASES / "cases_controllers.py"),
               str(CASES / "cases_hybrid.py"), str(CASES / "cases_check.py")],
    "0.5.18": [str(CASES / "cases_controllers.py"), str(CASES / "cases_hybrid.py"), str(CASES / "cases_check.py")],
    "0.5.19": [str(CASES / "cases_controllers.py"), "-m", "smoke"],
    "0.5.21": [str(CASES / "cases_controllers.py"), "-m", "smoke"],
    "0.5.22": [str(CASES / "cases_controllers.py"), "-m", "smoke"],
}


@pytest.mark.parametrize("release", list(RELEASES))
def test_sglang_release(release):
    proc = subprocess.run([sys.executable, str(RUN), release, *RELEASES[release]], capture_output=True, text=True,
                          timeout=900, cwd=HERE.parent)
    tail = (proc.stdout + proc.stderr)[-12000:]
    assert proc.returncode == 0, f"sglang {release}: the real-SGLang cases failed:\n{tail}"
    assert " passed" in proc.stdout, tail
    print(proc.stdout.strip().splitlines()[-1])
