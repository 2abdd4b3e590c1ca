"""Servers with special settings (token, tight memory budget, plugins) for the API tests.

The plain session ``server`` (tests/conftest.py) serves most tests; these start their
own ``pinfeed serve`` with a fresh state dir, socket and data root, on a free port.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pinfeed import Client
from tests.conftest import Server

TOKEN = "test-token-0123456789abcdef"
PLUGINS = '["tests.fixtures", "tests.api.plugins"]'

MakeServer = Callable[..., Server]


def synthetic(length: int = 20, shape: tuple[int, ...] = (3, 8, 8)) -> dict[str, object]:
    return {
        "length": length,
        "seed": 1,
        "fields": [
            {"shape": list(shape), "dtype": "float32"},
            {"shape": [], "dtype": "int64", "low": 0, "high": 10},
        ],
    }


@pytest.fixture()
def make_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeServer]:
    """Start servers with extra ``PINFEED_*`` settings; all stop at teardown."""
    started: list[Server] = []

    def make(root: Path | None = None, **env: str) -> Server:
        server = Server(root or tmp_path_factory.mktemp("srv"), env=env)
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A token (so the bearer scheme OpenAPI declares is enforced), a 64 MiB ring budget
    and the demo dataset and loader: the auth tests and the schemathesis run share it."""
    env = {"PINFEED_TOKEN": TOKEN, "PINFEED_MAX_SHM_BYTES": str(64 << 20), "PINFEED_DEMO": "true"}
    server = Server(tmp_path_factory.mktemp("token"), env=env)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def token_admin(token_server: Server) -> Iterator[Client]:
    with Client(token_server.url, token=TOKEN) as c:
        yield c
