"""With PINFEED_TOKEN set, mutating requests need the bearer token; reads stay open."""

from __future__ import annotations

import httpx
import pytest

from pinfeed import Client, Unauthorized
from tests.api.conftest import TOKEN, synthetic
from tests.api.test_datasets import _problem
from tests.conftest import Server
from tests.helpers import unique

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _mutations(name: str) -> list[tuple[str, str, object]]:
    return [
        ("POST", "/v1/datasets", {"name": name, "kind": "synthetic", "params": synthetic()}),
        ("POST", "/v1/loaders", {"name": name, "dataset": name, "batch_size": 2}),
        ("DELETE", f"/v1/loaders/{name}", None),
        ("DELETE", f"/v1/datasets/{name}", None),
    ]


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", TOKEN, "Bearer"]
)
def test_mutations_without_the_token_are_401(token_server: Server, header: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    for method, path, body in _mutations(unique("auth")):
        r = httpx.request(method, token_server.url + path, json=body, headers=headers)
        _problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")


def test_401_comes_before_parsing_and_routing(token_server: Server) -> None:
    r = httpx.post(
        f"{token_server.url}/v1/datasets",
        content=b"{bad",
        headers={"content-type": "application/json"},
    )
    _problem(r, 401, "unauthorized")
    _problem(httpx.post(f"{token_server.url}/v1/nothing"), 401, "unauthorized")


def test_mutations_with_the_token_succeed(token_server: Server) -> None:
    name = unique("auth")
    expected = [201, 201, 204, 204]
    for (method, path, body), status in zip(_mutations(name), expected, strict=True):
        r = httpx.request(method, token_server.url + path, json=body, headers=AUTH)
        assert r.status_code == status, r.text


@pytest.mark.parametrize(
    "path", ["/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/datasets", "/v1/loaders"]
)
def test_reads_and_probes_stay_open(token_server: Server, path: str) -> None:
    assert httpx.get(token_server.url + path).status_code == 200


def test_client_sends_the_token_and_raises_unauthorized(
    token_server: Server, token_admin: Client
) -> None:
    name = unique("auth")
    token_admin.create_dataset(name, "synthetic", synthetic())
    with Client(token_server.url, token="") as anonymous:
        assert anonymous.dataset(name)["name"] == name
        with pytest.raises(Unauthorized) as info:
            anonymous.delete_dataset(name)
    assert info.value.status == 401
    token_admin.delete_dataset(name)


def test_openapi_declares_the_bearer_scheme_where_it_is_enforced(token_server: Server) -> None:
    schema = httpx.get(f"{token_server.url}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method in ("post", "patch", "put", "delete"):
                assert op["security"] == [{"bearer": []}], (method, path)
                assert "401" in op["responses"], (method, path)
            else:  # reads and probes stay open (test_reads_and_probes_stay_open)
                assert "security" not in op and "401" not in op["responses"], (method, path)
