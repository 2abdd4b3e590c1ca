"""What a live server serves is in the generated reference (docs/reference/, made by
``python -m docs.gen`` from the code, which tests/docs/test_reference.py holds it to):
every route of its ``/openapi.json`` and every family of its ``/metrics``."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pinfeed_server.api.prometheus import families
from tests.conftest import REPO, Server

REFERENCE = REPO / "docs" / "reference"


def test_every_route_is_documented(server: Server) -> None:
    page = (REFERENCE / "http-api.md").read_text()
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path, item in schema["paths"].items():
        for method in item:
            assert f"| {method.upper()} | `{path}` |" in page, f"{method} {path}"


def test_every_metric_is_declared_and_documented(server: Server) -> None:
    page = (REFERENCE / "metrics.md").read_text()
    declared = {f.metric for f in families()}
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("process_", "python_")):
            continue
        # the parser names a counter without _total, an info gauge without _info
        names = [n for n in (family.name, family.name + "_total") if n in declared]
        assert names, f"{family.name} is served but not declared in families()"
        assert f"| `{names[0]}` |" in page, names[0]
