"""Fixtures for the reliability tests: servers that import this package's datasets,
trainer processes, and a fresh server for tests that kill or stop one."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from multiprocessing.context import ForkServerContext
from pathlib import Path

import pytest

from pinfeed import Client
from tests.conftest import Server
from tests.reliability import trainers

PLUGINS = '["tests.fixtures", "tests.reliability"]'


def new_server(root: Path, **env: str) -> Server:
    return Server(root, env={"PINFEED_ALLOWED_PLUGINS": PLUGINS, **env})


@pytest.fixture(scope="package")
def rserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the non-destructive reliability tests (unique names per test)."""
    srv = new_server(tmp_path_factory.mktemp("reliability"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """Fresh servers for tests that kill or stop theirs; whatever is left is killed."""
    made: list[Server] = []

    def make(**env: str) -> Server:
        srv = new_server(tmp_path_factory.mktemp("srv"), **env)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def trainer_ctx() -> ForkServerContext:
    return trainers.context()


@pytest.fixture()
def admin_r(rserver: Server) -> Iterator[Client]:
    with rserver.client() as c:
        yield c
