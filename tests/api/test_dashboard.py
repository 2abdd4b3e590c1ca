"""``deploy/grafana/pinfeed.json``: a valid dashboard whose every query names series that
a live server serves, with the labels they carry, and ``rate()`` only over counters."""

from __future__ import annotations

import json
import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pinfeed import Client, Loader
from tests.api.conftest import synthetic
from tests.conftest import REPO, Server
from tests.helpers import unique

DASHBOARD = json.loads((REPO / "deploy" / "grafana" / "pinfeed.json").read_text())
SERIES = re.compile(r"\b((?:pinfeed|process)_[a-z0-9_]+)\b(\{[^}]*\})?")
RATE = re.compile(r"\b(?:rate|increase|irate)\(\s*([a-z_][a-z0-9_]*)")
LABEL = re.compile(r'([a-z_]+)\s*(?:=~|!~|!=|=)\s*"')
GRAFANA_VARIABLES = {"instance"}  # added by Prometheus at scrape time, not by pinfeed


def _queries() -> list[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    variables = [
        v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"
    ]
    return exprs + variables


def _scrape(server: Server, name: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Sample name -> label names seen on it, and family name -> type, from a body
    that has ``name`` in it (a body is up to PINFEED_METRICS_MAX_AGE_S old)."""
    deadline = time.monotonic() + 10
    while f'loader="{name}"' not in (text := httpx.get(f"{server.url}/metrics").text):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return labels, dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_dashboard_is_well_formed() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in DASHBOARD["panels"]}
    for wanted in ("Loader throughput", "Queue fill", "Trainers' wait share"):
        assert wanted in titles
    assert {"Worker busy share", "Errors"} <= titles
    for p in DASHBOARD["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert re.fullmatch(r"[A-Z]", t["refId"]), p["title"]


def test_dashboard_queries_name_served_series(admin: Client, server: Server) -> None:
    name = unique("dash")
    admin.create_dataset(name, "synthetic", synthetic(16))
    admin.create_loader(name, dataset=name, batch_size=4, num_workers=1)
    with Loader(name, socket=server.socket, timeout=60) as loader:
        for _ in loader:
            pass
        served, types = _scrape(server, name)
    admin.delete_loader(name)
    for query in _queries():
        found = SERIES.findall(query)
        assert found, query
        for series, matchers in found:
            assert series in served, f"{series} (in {query!r}) is not served"
            for label in LABEL.findall(matchers):
                if label not in GRAFANA_VARIABLES:
                    assert label in served[series], f"{series} has no label {label!r}"
        for series in RATE.findall(query):
            family = re.sub(r"_bucket$", "", series)
            assert types.get(series) == "counter" or types.get(family) == "histogram", (
                f"rate() over {series}, which is not a counter"
            )
