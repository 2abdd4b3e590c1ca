"""The control plane's pace (PINFEED_HTTP_MAX_RPS): a flood waits its turn, every request
is answered, and only one that would wait past MAX_WAIT_S is refused (503 overloaded)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from pinfeed_server.api import throttle
from pinfeed_server.api.throttle import Throttle
from tests.api.conftest import MakeServer


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _call(app: Throttle) -> tuple[int, dict[str, str], bytes, float]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/healthz", "headers": []}
    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, sent[1]["body"], time.monotonic()


@pytest.mark.serial  # requests served within a wall-clock bound
def test_a_flood_is_paced_and_past_the_wait_bound_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle, "MAX_WAIT_S", 1.0)
    app = Throttle(_ok, rps=8)  # one request every 125 ms, a burst of 2 unpaced

    async def flood() -> list[tuple[int, dict[str, str], bytes, float]]:
        return await asyncio.gather(*(_call(app) for _ in range(20)))

    t0 = time.monotonic()
    results = asyncio.run(flood())
    served = sorted(r[3] - t0 for r in results if r[0] == 200)
    refused = [r for r in results if r[0] != 200]
    # Served: the burst, then one per interval up to the 1 s bound (2 + 8 + 1).
    assert len(served) == 11
    assert served[-1] >= 8 * 0.125 - 0.01  # paced: not sooner than the pace allows
    assert len(refused) == 9
    for status, headers, body, _ in refused:
        assert status == 503 and headers["retry-after"] == "1"
        assert headers["content-type"] == "application/problem+json"
        problem = json.loads(body)
        assert problem["type"] == "urn:pinfeed:problem:overloaded"
        assert "PINFEED_HTTP_MAX_RPS" in problem["detail"]


def test_no_pace_with_rps_zero() -> None:
    app = Throttle(_ok, rps=0)

    async def many() -> list[Any]:
        return await asyncio.gather(*(_call(app) for _ in range(200)))

    assert all(r[0] == 200 for r in asyncio.run(many()))


def test_a_live_server_paces_its_clients(make_server: MakeServer) -> None:
    server = make_server(PINFEED_HTTP_MAX_RPS="20")
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url) as c:
        statuses = [c.get("/healthz").status_code for _ in range(30)]
    assert statuses == [200] * 30
    assert time.monotonic() - t0 >= (30 - 5 - 1) / 20  # a burst of 5, then 20 a second
