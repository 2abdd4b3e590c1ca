"""The test S3 server and the fault proxy do what the remote tests rely on."""

from __future__ import annotations

import os
import time

import obstore
import pytest
from obstore.store import S3Store

from tests.remote.proxy import FaultProxy
from tests.remote.s3server import REGION, S3Server


def _store(s3: S3Server, endpoint: str, secret: str | None = None) -> S3Store:
    return S3Store(
        "pinfeed",
        endpoint=endpoint,
        access_key_id=s3.access_key,
        secret_access_key=secret or s3.secret_key,
        region=REGION,
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )


def test_server_checks_signatures_ranges_and_etags(s3: S3Server, prefix: str) -> None:
    data = os.urandom(100_000)
    etag = s3.put("pinfeed", f"{prefix}/a", data)
    store = _store(s3, s3.endpoint)
    got = obstore.get(store, f"{prefix}/a", options={"range": (10, 20)})
    assert bytes(got.bytes()) == data[10:20] and got.meta["e_tag"] == etag
    with pytest.raises(obstore.exceptions.PermissionDeniedError):
        obstore.get(_store(s3, s3.endpoint, "wrong"), f"{prefix}/a").bytes()
    with pytest.raises(obstore.exceptions.PreconditionError):
        obstore.get(store, f"{prefix}/a", options={"if_match": '"0"'}).bytes()


def test_proxy_faults_and_counts(s3: S3Server, proxy: FaultProxy, prefix: str) -> None:
    data = os.urandom(1 << 20)
    s3.put("pinfeed", f"{prefix}/b", data)
    store = _store(s3, proxy.endpoint)
    assert bytes(obstore.get(store, f"{prefix}/b").bytes()) == data
    assert (proxy.counts.requests, proxy.counts.bytes) == (1, len(data))
    for fault in ("503", "reset", "truncate"):
        proxy.inject(fault)  # type: ignore[arg-type]
        with pytest.raises(obstore.exceptions.GenericError):
            obstore.get(store, f"{prefix}/b").bytes()
        assert proxy.pending() == 0
    assert proxy.counts.faults == {"503": 1, "reset": 1, "truncate": 1}
    proxy.down()
    with pytest.raises(obstore.exceptions.GenericError):
        obstore.get(store, f"{prefix}/b").bytes()
    proxy.up()
    assert bytes(obstore.get(store, f"{prefix}/b").bytes()) == data
    proxy.bandwidth, proxy.latency_s = 5e6, 0.05
    t0 = time.monotonic()
    obstore.get(store, f"{prefix}/b").bytes()
    assert time.monotonic() - t0 >= 0.05 + 0.8 * len(data) / 5e6
