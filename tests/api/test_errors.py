"""Every error is problem+json with a stable type; OpenAPI documents each one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from pinfeed_server.main import create_app
from pinfeed_server.settings import Settings
from tests.api.test_datasets import PROBLEM, _problem
from tests.conftest import Server


def test_unknown_route_is_404(server: Server) -> None:
    problem = _problem(httpx.get(f"{server.url}/v2/nothing"), 404, "not-found")
    assert "/openapi.json" in str(problem["detail"])


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/datasets", {"GET", "POST"}),
        ("PATCH", "/v1/datasets/x", {"DELETE", "GET"}),
        ("PUT", "/v1/loaders/x", {"DELETE", "GET", "PATCH"}),
        ("POST", "/healthz", {"GET"}),
        ("DELETE", "/metrics", {"GET"}),
    ],
)
def test_wrong_method_is_405_with_allow(
    server: Server, method: str, path: str, allow: set[str]
) -> None:
    r = httpx.request(method, server.url + path)
    _problem(r, 405, "method-not-allowed")
    assert set(r.headers["allow"].split(", ")) == allow


def test_an_unexpected_exception_is_500_without_a_stack_trace(tmp_path: Path) -> None:
    # Pure routing: no lifespan, so no engine; the route stands in for a bug.
    app = create_app(Settings(state_dir=tmp_path, data_root=tmp_path, socket=tmp_path / "s"))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals at /srv/x.py line 3")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pinfeed") as c:
            return await c.get("/boom")

    r = asyncio.run(get())
    assert r.status_code == 500
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["type"] == "urn:pinfeed:problem:internal"
    assert "secret" not in r.text and "Traceback" not in r.text and "x.py" not in r.text


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, op) for path, item in schema["paths"].items() for method, op in item.items()
    ]


def test_openapi_documents_every_error_as_problem_json(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "Problem" in schema["components"]["schemas"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, method, op in _operations(schema):
        where = f"{method.upper()} {path}"
        assert op.get("description"), f"{where} has no description"
        for code, response in op["responses"].items():
            if int(code) < 400:
                continue
            assert list(response["content"]) == [PROBLEM], where
            content = response["content"][PROBLEM]
            assert content["schema"] == {"$ref": "#/components/schemas/Problem"}, where
            assert content["example"]["status"] == int(code), where
        assert "503" in op["responses"], where  # overloaded, on every route
        if method in ("post", "delete"):
            assert "413" in op["responses"], where
            # This server has no PINFEED_TOKEN: it enforces no security, so none is declared.
            assert "401" not in op["responses"] and "security" not in op, where
        assert "securitySchemes" not in schema["components"]
        if "requestBody" in op:
            assert {"415", "422"} <= set(op["responses"]), where


def test_openapi_models_carry_examples(server: Server) -> None:
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    for name in (
        "DatasetCreate",
        "DatasetPublic",
        "LoaderCreate",
        "LoaderPublic",
        "LoaderStatsPublic",
        "Problem",
        "Health",
    ):
        assert schemas[name].get("examples"), name
