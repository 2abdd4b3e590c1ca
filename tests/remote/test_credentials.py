"""Credentials never leave the server: not in a response, a log line, /metrics, the page."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pinfeed import InvalidRequest
from tests.helpers import unique
from tests.launcher import Server
from tests.remote.conftest import remote_env
from tests.remote.s3server import ACCESS_KEY, SECRET_KEY, S3Server

WRONG_SECRET = "pinfeed-wrong-secret-Qx7Lk2Vb9Zm4"


def _outputs(srv: Server) -> dict[str, str]:
    return {
        "log": srv.tail(10**7),
        "metrics": httpx.get(srv.url + "/metrics").text,
        "node": httpx.get(srv.url + "/v1/node").text,
        "page": httpx.get(srv.url + "/").text,
        "datasets": httpx.get(srv.url + "/v1/datasets").text,
    }


def test_refused_credentials_say_what_to_set_and_leak_nothing(
    tmp_path: Path, s3: S3Server, prefix: str
) -> None:
    s3.put("pinfeed", f"{prefix}/t.bin", bytes(4096))
    env = remote_env(s3, s3.endpoint, AWS_SECRET_ACCESS_KEY=WRONG_SECRET)
    with Server(tmp_path, env=env | {"PINFEED_LOG_LEVEL": "debug"}) as srv:
        with srv.client() as admin, pytest.raises(InvalidRequest) as err:
            admin.create_dataset(
                unique("creds"), "tokens", {"path": f"s3://pinfeed/{prefix}/t.bin", "seq_len": 4}
            )
        detail = str(err.value)
        assert "403" in detail and "AWS_SECRET_ACCESS_KEY" in detail
        outputs = {"error": detail, **_outputs(srv)}
    for where, text in outputs.items():
        for secret in (WRONG_SECRET, ACCESS_KEY, SECRET_KEY):
            assert secret not in text, f"{secret} in the {where}"
