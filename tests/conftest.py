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


@pytest.fixture(scope="session")
def _restartable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("restartable"), env={"PINFEED_MAX_WORKERS": "64"})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def restartable(_restartable_server: Server) -> Iterator[Server]:
    """A running server that the test may stop (SIGTERM or SIGKILL) and start again, as
    a fresh one would be: its registry is empty. Shared by the tests that restart a
    server, so that each pays for the one restart it checks and not for a server of its
    own as well (a start is 3-4 s, mostly torch's imports). A test may leave it stopped
    (also by failing): the next one starts it. Every loader and dataset a test made is
    deleted after it, or, if it left the server stopped, before the next one (a restart
    brings back every registered loader). A test may change ``env`` for its restart: the
    settings are put back after it. The worker cap is raised to 64 for the elastic
    tests (8 on 2 cores by default)."""
    srv = _restartable_server
    env = dict(srv.env)
    if srv.proc is None or srv.proc.poll() is not None:
        srv.start()
        _empty_registry(srv)
    try:
        yield srv
        if srv.proc is not None and srv.proc.poll() is None:
            _empty_registry(srv)
            if srv.env != env:  # settings changed for a restart: the next test starts it
                srv.stop()
    finally:
        srv.env = env


def _empty_registry(srv: Server) -> None:
    with srv.client() as c:
        for row in c.loaders():  # first: a dataset is not deleted while a loader uses it
            c.delete_loader(row["name"])
        for row in c.datasets():
            c.delete_dataset(row["name"])


@pytest.fixture()
def admin(server: Server) -> Iterator[Client]:
    with server.client() as c:
        yield c


@pytest.fixture()
def registered(admin: Client) -> Iterator[list[str]]:
    """Datasets a test registers (its names appended), deleted after it."""
    names: list[str] = []
    yield names
    for name in names:
        admin.delete_dataset(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
