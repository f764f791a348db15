"""pytest fixtures that start a real Mooncake store. Opt-in, like pytest's ``pytester``: a test
directory that wants them loads them explicitly, in its ``conftest.py``::

    pytest_plugins = ["hicache_draft_mooncake.pytest_plugin"]       # in a top-level conftest
    from hicache_draft_mooncake.pytest_plugin import mooncake_service  # noqa: F401  (anywhere)

Installing the plugin does not load them into every pytest run.

* ``mooncake_service`` (session): one master + segment holder for the whole run.
* ``mooncake_options``: ``[backend_options]`` (TCP mode) for ``mooncake_service``.
* ``mooncake_service_factory``: start private stores (for tests that kill processes); each is
  stopped at the end of the test.

Importing this module imports neither ``mooncake``, nor ``torch``, nor the hicache-draft core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_draft_mooncake.service import MooncakeService

TEST_SEGMENT_SIZE = 512 << 20


@pytest.fixture(scope="session")
def mooncake_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeService]:
    """A running master + ``mooncake_client`` holder on free 127.0.0.1 ports, shared by the session."""
    svc = MooncakeService.start(tmp_path_factory.mktemp("mooncake"), segment_size=TEST_SEGMENT_SIZE)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def mooncake_options(mooncake_service: MooncakeService) -> dict[str, object]:
    """TCP-mode ``[backend_options]`` for the session store."""
    return mooncake_service.backend_options()


@pytest.fixture
def mooncake_service_factory(tmp_path: Path) -> Iterator[Callable[..., MooncakeService]]:
    """``start(**kwargs)``: start a private store for one test (keywords of
    :meth:`MooncakeService.start`, e.g. ``client_ttl_s``); all are stopped by pid when the test ends."""
    started: list[MooncakeService] = []

    def start(**kwargs: Any) -> MooncakeService:  # noqa: ANN401 (MooncakeService.start's keywords)
        kwargs.setdefault("segment_size", TEST_SEGMENT_SIZE)
        svc = MooncakeService.start(tmp_path / f"mooncake{len(started)}", **kwargs)
        started.append(svc)
        return svc

    try:
        yield start
    finally:
        for svc in started:
            svc.stop()
