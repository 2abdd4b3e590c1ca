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
    # One client (no address in the scope): the burst, then one per interval up to the
    # 1 s bound (2 + 8 + 1).
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


async def _call_as(app: Throttle, host: str, path: str = "/v1/loaders") -> float:
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": [],
        "client": (host, 1234),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        return None

    t0 = time.monotonic()
    await app(scope, receive, send)
    return time.monotonic() - t0


def test_a_flooding_client_does_not_delay_another_nor_the_probes() -> None:
    app = Throttle(_ok, rps=20)  # one request every 50 ms per client

    async def scene() -> tuple[list[float], list[float], list[float]]:
        flood = [asyncio.create_task(_call_as(app, "127.0.0.2")) for _ in range(40)]
        await asyncio.sleep(0.01)
        other = [await _call_as(app, "127.0.0.1") for _ in range(3)]
        probes = [await _call_as(app, "127.0.0.2", "/healthz") for _ in range(3)]
        return list(await asyncio.gather(*flood)), other, probes

    flood, other, probes = asyncio.run(scene())
    assert max(flood) >= (40 - 5 - 1) * 0.05 - 0.05  # the flood is paced
    assert max(other) < 0.05 and max(probes) < 0.05  # neither waits behind it


def test_clients_are_told_apart_by_their_header_too() -> None:
    app = Throttle(_ok, rps=4)
    key_a = {"type": "http", "path": "/x", "client": ("127.0.0.1", 1), "headers": []}
    key_b = key_a | {"headers": [(b"x-pinfeed-client", b"pinfeed-42")]}
    assert throttle.client_key(key_a) != throttle.client_key(key_b)
    assert throttle.client_key(key_a | {"path": "/healthz"})[2] == "probe"
    assert app._key(key_b, 0.0) == ("127.0.0.1", "pinfeed-42", "api")


def test_forgotten_clients_make_room(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle, "MAX_CLIENTS", 2)
    app = Throttle(_ok, rps=1)
    for host in ("a", "b"):
        scope = {"type": "http", "path": "/x", "client": (host, 1), "headers": []}
        app._tat[app._key(scope, 0.0)] = 100.0  # paced until t=100
    third = {"type": "http", "path": "/x", "client": ("c", 1), "headers": []}
    assert app._key(third, 50.0) == throttle._SHARED  # nobody to forget yet
    assert app._key(third, 150.0) == ("c", "", "api")  # a's turn passed: forgotten
