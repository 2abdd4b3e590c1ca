"""``/`` (the operator's page) and ``/docs`` (Swagger UI) render completely in a real
headless Chromium cut off from every host but this one, and no request they make
leaves 127.0.0.1; the page's figures are those of ``GET /v1/node`` and
``GET /v1/loaders``, a mixture loader's per-source figures those of
``GET /v1/loaders/{name}``'s ``sources``. Skipped, with the reason, where no Chromium is installed
(``.ci/run`` installs Debian's)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from pinfeed import Client, Loader
from tests.api.conftest import MakeServer, synthetic
from tests.browser import CHROMIUM, Browser
from tests.conftest import Server

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)"
)

TABLE = """
JSON.stringify(Object.fromEntries([...document.querySelectorAll('#loaders tbody tr')].map(
  tr => [tr.dataset.loader, Object.fromEntries([...tr.querySelectorAll('td[data-field]')].map(
    td => [td.dataset.field, td.textContent]))])))
"""
DECISIONS = """
JSON.stringify([...document.querySelectorAll('#decisions tbody tr')].map(
  tr => Object.fromEntries([...tr.querySelectorAll('td[data-field]')].map(
    td => [td.dataset.field, td.textContent]))))
"""
SOURCES = """
JSON.stringify([...document.querySelectorAll('#sources tbody tr')].map(
  tr => [tr.dataset.loader, tr.dataset.dataset, Object.fromEntries(
    [...tr.querySelectorAll('td[data-field]')].map(td => [td.dataset.field, td.textContent])),
    parseFloat(tr.querySelector('.share > i').style.width),
    parseFloat(tr.querySelector('.share > b').style.left)]))
"""
HEADER = """
JSON.stringify(Object.fromEntries([...document.querySelectorAll('[data-node]')].map(
  b => [b.dataset.node, b.textContent])))
"""


@pytest.fixture()
def browser() -> Iterator[Browser]:
    with Browser() as b:
        yield b


@pytest.fixture()
def node_server(make_server: MakeServer) -> Server:
    """Two worker slots on the node: loader ``b`` is made room for from ``a`` (no
    trainer), so the arbiter has a decision to show. Loader ``m`` mixes two packed token
    files 0.7/0.3, and a trainer has read five of its batches (then left: its counts
    stay as they are)."""
    server = make_server(PINFEED_MAX_WORKERS="2")
    rng = np.random.default_rng(0)
    with Client(server.url) as c:
        c.create_dataset("d", "synthetic", synthetic(64))
        auto = {"max_workers": 2}
        c.create_loader("a", dataset="d", batch_size=4, num_workers=2, autotune=auto)
        c.create_loader("b", dataset="d", batch_size=4, num_workers=1, priority=3, min_workers=1)
        c.create_loader("c", dataset="d", batch_size=8)
        for name in ("web", "code"):
            docs = [np.append(rng.integers(1, 500, int(n)), 0) for n in rng.integers(1, 60, 90)]
            np.concatenate(docs).astype(np.uint16).tofile(server.data_root / f"{name}.bin")
            params = {"path": f"{name}.bin", "seq_len": 32, "eos": 0, "pack": "greedy"}
            c.create_dataset(name, "tokens", params)
        mixture = [{"dataset": "web", "weight": 0.7}, {"dataset": "code", "weight": 0.3}]
        c.create_loader(
            "m", dataset=None, mixture={"sources": mixture, "samples": 64}, batch_size=4
        )
    with Loader("m", socket=server.socket) as loader:
        for _, _ in zip(range(5), loader, strict=False):
            pass
    return server


def _pct(x: float | None, d: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{d}f}%"


def _num(x: float | None, d: int = 0) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _outside(b: Browser, server: Server) -> list[str]:
    """Requests to anything but this server: inline data and this origin's blobs (ReDoc
    makes both) never leave the page."""
    local = (server.url + "/", "data:", f"blob:{server.url}/")
    return [u for u in b.requests if not u.startswith(local)]


def test_the_page_shows_what_the_api_says(node_server: Server, browser: Browser) -> None:
    browser.open(node_server.url + "/")
    browser.wait_for("Number(document.body.dataset.rendered || 0) >= 1")
    shown: dict[str, dict[str, str]] = json.loads(browser.evaluate(TABLE))
    last: dict[str, Any] = browser.evaluate("window.pinfeedLast")
    header = json.loads(browser.evaluate(HEADER))
    decisions = json.loads(browser.evaluate(DECISIONS))
    node = httpx.get(f"{node_server.url}/v1/node").json()
    loaders = httpx.get(f"{node_server.url}/v1/loaders").json()

    assert sorted(shown) == [lo["name"] for lo in loaders] == ["a", "b", "c", "m"]
    by_node = {lo["name"]: lo for lo in node["loaders"]}
    for lo in loaders:
        row, n = shown[lo["name"]], by_node[lo["name"]]
        assert row["dataset"] == lo["dataset"] and row["state"] == lo["state"]
        assert row["queue"] == f"{lo['slots']['ready']}/{lo['slots']['total']}"
        auto = " (auto)" if not n["fixed"] else ""
        assert row["workers"] == f"{lo['num_workers']}{auto}" == f"{n['workers']}{auto}"
        assert row["priority"] == str(lo["priority"]) and row["min_workers"] == str(
            lo["min_workers"]
        )
        assert row["trainers"] == str(n["trainers"])
        # the measured figures: as the page's own fetch had them, and as the API has them
        # now (no trainer reads: they stay as they are)
        mine = next(x for x in last["node"]["loaders"] if x["name"] == lo["name"])
        assert row["samples_per_s"] == _num(mine["samples_per_s"]) == _num(n["samples_per_s"])
        assert row["wait_share"] == _pct(mine["wait_share"]) == _pct(n["wait_share"])
    # the mixture's sources: as GET /v1/loaders/{name} has them, one row each
    sources = httpx.get(f"{node_server.url}/v1/loaders/m").json()["sources"]
    assert all(s["samples"] > 0 and s["tokens"] > 0 for s in sources)
    assert next(lo for lo in last["loaders"] if lo["name"] == "m")["sources"] == sources
    assert json.loads(browser.evaluate(SOURCES)) == [
        [
            "m",
            s["dataset"],
            {
                "loader": "m",
                "dataset": s["dataset"],
                "samples": str(s["samples"]),
                "tokens": str(s["tokens"]),
                "proportion": _pct(s["proportion"], 1),
                "weight": _pct(s["weight"], 1),
            },
            # the bar's length and the weight's mark on it, in % of the bar
            pytest.approx(100 * s["proportion"], abs=0.05),
            pytest.approx(100 * s["weight"], abs=0.05),
        ]
        for s in sources
    ]
    assert browser.evaluate("document.getElementById('mixtures').hidden") is False
    assert header["cpus"] == str(node["cpus"])
    assert header["workers"] == f"{node['workers_used']}/{node['max_workers']}"
    assert node["lifetime"]["started_by"] == "serve" and node["lifetime"]["idle_exit_s"] is None
    assert header["lifetime"] == "pinfeed serve, runs until stopped"
    assert [d["reason"] for d in decisions] == [d["reason"] for d in node["decisions"][::-1]]
    assert any(d["kind"] == "room" and d["loader"] == "a" for d in decisions)
    assert _outside(browser, node_server) == []
    assert set(browser.requests) >= {f"{node_server.url}/v1/node", f"{node_server.url}/v1/loaders"}


def test_the_page_refreshes_itself(node_server: Server, browser: Browser) -> None:
    browser.open(node_server.url + "/")
    browser.wait_for("Number(document.body.dataset.rendered || 0) >= 1")
    with Client(node_server.url) as c:
        c.patch_loader("c", priority=7)
    browser.wait_for(
        "document.querySelector('tr[data-loader=c] td[data-field=priority]').textContent === '7'",
        timeout=15,
    )
    assert _outside(browser, node_server) == []


def test_the_docs_render_offline(server: Server, browser: Browser) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    operations = sum(len(item) for item in schema["paths"].values())
    browser.open(server.url + "/docs")
    count = browser.wait_for("document.querySelectorAll('.swagger-ui .opblock').length", timeout=60)
    assert count == operations
    assert "pinfeed" in browser.evaluate("document.querySelector('.swagger-ui .title').textContent")
    assert browser.requests, "the page made no request"
    assert _outside(browser, server) == []
    assert not browser.failed, browser.failed
    served = {u.removeprefix(server.url) for u in browser.requests}
    assert {"/docs", "/openapi.json"} <= served
    assert any(u.endswith("swagger-ui-bundle.js") for u in served)


def test_redoc_renders_offline(server: Server, browser: Browser) -> None:
    browser.open(server.url + "/redoc")
    browser.wait_for("document.querySelector('.api-info h1') !== null", timeout=60)
    assert _outside(browser, server) == []
    assert not browser.failed, browser.failed
