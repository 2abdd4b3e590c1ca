"""Fixtures: one real ``pinfeed serve`` for the session (``tests/launcher.py`` starts it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pinfeed import Client
from tests.launcher import REPO, Server, free_port

__all__ = ["REPO", "Server", "free_port"]  # tests import them from here too


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the session; tests use unique dataset and loader names. Loaders
    accumulate over the session (idle workers cost no CPU), so the server-wide worker
    cap, 8 on a 2-core machine by default, is raised here; tests of the cap use their
    own servers."""
    srv = Server(tmp_path_factory.mktemp("pinfeed"), env={"PINFEED_MAX_WORKERS": "1024"})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def admin(server: Server) -> Iterator[Client]:
    with server.client() as c:
        yield c


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
