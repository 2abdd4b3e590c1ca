"""README.md names every route, setting, problem type and metric the code has."""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pinfeed_server.api.problems import PROBLEM_TYPES
from pinfeed_server.settings import Settings
from tests.conftest import REPO, Server

DOC = (REPO / "README.md").read_text()


def test_every_setting_is_documented() -> None:
    for name in Settings.model_fields:
        assert f"`PINFEED_{name.upper()}`" in DOC, name


def test_every_problem_type_is_documented() -> None:
    for cls in PROBLEM_TYPES:
        assert re.search(rf"\| `{cls.slug}` \| {cls.status} \|", DOC), cls.slug


def test_every_route_is_documented(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path, item in schema["paths"].items():
        for method in item:
            assert f"| {method.upper()} | `{path}` |" in DOC, f"{method} {path}"


def test_every_metric_is_documented(server: Server) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("process_", "python_")):
            continue
        assert re.search(rf"`{family.name}(_total|_info)?[{{`]", DOC), family.name
