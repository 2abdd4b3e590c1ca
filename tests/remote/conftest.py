"""Fixtures: a real S3 server (``s3server.py``) per test process, and a fault-injecting
proxy (``proxy.py``) in front of it per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

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
