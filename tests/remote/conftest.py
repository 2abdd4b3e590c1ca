"""Fixtures: a real S3 server (``s3server.py``) per test process, and a fault-injecting
proxy (``proxy.py``) in front of it per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from pinfeed import Client
from tests.launcher import Server
from tests.remote.data import Workload, make
from tests.remote.proxy import FaultProxy
from tests.remote.s3server import S3Server

BUCKETS = ("pinfeed", "other")


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the test process, torn down also when a test fails; tests put
    their objects under a prefix of their own (``prefix``)."""
    with S3Server(tmp_path_factory.mktemp("s3"), buckets=BUCKETS) as server:
        yield server


@pytest.fixture()
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.endpoint) as p:
        yield p


@pytest.fixture()
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def link(s3: S3Server) -> Iterator[FaultProxy]:
    """The module's proxy: the one its pinfeed server reads the store through."""
    with FaultProxy(s3.endpoint) as p:
        yield p


def remote_env(s3: S3Server, endpoint: str, **settings: str) -> dict[str, str]:
    """A pinfeed server's environment to read the test bucket through ``endpoint``:
    small blocks (several a test object), short retries."""
    return {
        **s3.env(endpoint),
        "PINFEED_REMOTE_ALLOW": '["s3://pinfeed/"]',
        "PINFEED_REMOTE_BLOCK_BYTES": str(1 << 16),
        "PINFEED_REMOTE_RETRY_S": "20",
        "PINFEED_REMOTE_RETRIES": "40",  # an outage is waited out by time, not by tries
        "PINFEED_MAX_WORKERS": "64",
        **settings,
    }


@pytest.fixture(scope="module")
def remote_server(
    tmp_path_factory: pytest.TempPathFactory, s3: S3Server, link: FaultProxy
) -> Iterator[Server]:
    """A pinfeed server that reads the test bucket through the module's proxy."""
    with Server(tmp_path_factory.mktemp("remote"), env=remote_env(s3, link.endpoint)) as srv:
        yield srv


@pytest.fixture()
def admin(remote_server: Server) -> Iterator[Client]:
    with remote_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def workloads(remote_server: Server, s3: S3Server) -> dict[str, Workload]:
    """The benchmarks' workloads, small, under the server's data root and in the store."""
    return make(remote_server.data_root, f"kinds-{uuid.uuid4().hex[:8]}", s3)
