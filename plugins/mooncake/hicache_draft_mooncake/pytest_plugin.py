"""pytest fixtures that start a real Mooncake store (loaded through the ``pytest11`` entry point).

* ``mooncake_service`` (session): one master + segment holder for the whole run.
* ``mooncake_options``: ``[backend_options]`` (TCP mode) for ``mooncake_service``.
* ``mooncake_service_factory``: start private stores (for tests that kill processes); each is
  stopped at the end of the test.

Importing this module imports neither ``mooncake`` nor ``torch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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
def mooncake_service_factory(tmp_path: Path) -> Iterator[Callable[[], MooncakeService]]:
    """Start private stores for one test; all are stopped by pid when the test ends."""
    started: list[MooncakeService] = []

    def start() -> MooncakeService:
        svc = MooncakeService.start(tmp_path / f"mooncake{len(started)}", segment_size=TEST_SEGMENT_SIZE)
        started.append(svc)
        return svc

    try:
        yield start
    finally:
        for svc in started:
            svc.stop()
