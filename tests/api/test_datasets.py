"""``/v1/datasets`` against a real server: create, list, get, delete and every refusal."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from pinfeed import Client, Conflict, InvalidRequest, NotFound
from tests.api.conftest import synthetic
from tests.conftest import Server
from tests.helpers import unique

PROBLEM = "application/problem+json"


def _problem(response: httpx.Response, status: int, slug: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["type"] == f"urn:pinfeed:problem:{slug}"
    assert body["status"] == status
    assert body["title"] and body["detail"] and body["instance"] == response.request.url.path
    assert "Traceback" not in response.text
    return dict(body)


def test_create_get_list_delete(server: Server) -> None:
    name = unique("ds")
    r = httpx.post(
        f"{server.url}/v1/datasets",
        json={"name": name, "kind": "synthetic", "params": synthetic(20)},
    )
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"/v1/datasets/{name}"
    created = r.json()
    assert created["length"] == 20
    assert created["sample"] == [
        {"dtype": "float32", "shape": [3, 8, 8]},
        {"dtype": "int64", "shape": []},
    ]
    assert created["error"] is None
    got = httpx.get(f"{server.url}/v1/datasets/{name}").json()
    assert got == created
    listed = httpx.get(f"{server.url}/v1/datasets").json()
    assert created in listed
    r = httpx.delete(f"{server.url}/v1/datasets/{name}")
    assert r.status_code == 204 and r.content == b""
    _problem(httpx.get(f"{server.url}/v1/datasets/{name}"), 404, "not-found")


def test_npy_dataset_reports_dict_structure(server: Server) -> None:
    name = unique("npy")
    np.save(server.data_root / f"{name}-x.npy", np.zeros((6, 5), dtype=np.float16))
    np.save(server.data_root / f"{name}-y.npy", np.arange(6, dtype=np.int32))
    with server.client() as c:
        ds = c.create_dataset(name, "npy", {"paths": {"x": f"{name}-x.npy", "y": f"{name}-y.npy"}})
    assert ds["length"] == 6
    assert ds["sample"] == {
        "x": {"dtype": "float16", "shape": [5]},
        "y": {"dtype": "int32", "shape": []},
    }


def test_duplicate_name_is_409(admin: Client) -> None:
    name = unique("dup")
    admin.create_dataset(name, "synthetic", synthetic())
    with pytest.raises(Conflict, match="exists"):
        admin.create_dataset(name, "synthetic", synthetic())


def test_delete_while_a_loader_uses_it_is_409(admin: Client) -> None:
    name = unique("used")
    admin.create_dataset(name, "synthetic", synthetic())
    admin.create_loader(name, dataset=name, batch_size=4)
    with pytest.raises(Conflict, match="used by loaders") as info:
        admin.delete_dataset(name)
    assert info.value.status == 409
    admin.delete_loader(name)
    admin.delete_dataset(name)
    with pytest.raises(NotFound):
        admin.dataset(name)


def test_delete_unknown_is_404(server: Server) -> None:
    _problem(httpx.delete(f"{server.url}/v1/datasets/{unique('nope')}"), 404, "not-found")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"name": "x", "kind": "zarr"}, "kind"),
        ({"name": "-bad", "kind": "synthetic"}, "name"),
        ({"name": "x" * 64, "kind": "synthetic"}, "name"),
        ({"kind": "synthetic"}, "name"),
        ({"name": "x", "kind": "synthetic", "params": {}, "extra": 1}, "extra"),
        ({"name": "x", "kind": "synthetic", "params": []}, "params"),
    ],
)
def test_invalid_body_is_422_with_each_issue(server: Server, body: object, needle: str) -> None:
    problem = _problem(httpx.post(f"{server.url}/v1/datasets", json=body), 422, "invalid-request")
    assert needle in str(problem["detail"])
    errors = problem["errors"]
    assert isinstance(errors, list) and errors
    assert all(e["loc"][0] == "body" for e in errors)


@pytest.mark.parametrize(
    ("kind", "params", "needle"),
    [
        ("synthetic", {"length": 0, "fields": [{"shape": [1]}]}, "length"),
        ("synthetic", {"length": 5, "fields": [{"dtype": "complex64"}]}, "dtype"),
        ("npy", {"paths": ["../../etc/passwd"]}, "outside the data root"),
        ("npy", {"paths": ["/etc/hostname"]}, "outside the data root"),
        ("npy", {"paths": ["missing.npy"]}, "not found"),
        ("tensors", {"path": "missing.pt"}, "not found"),
        ("python", {"factory": "os:system"}, "not allowed"),
    ],
)
def test_bad_params_are_422(
    admin: Client, kind: str, params: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidRequest, match=needle) as info:
        admin.create_dataset(unique("bad"), kind, params)
    assert info.value.status == 422


def test_malformed_json_is_422(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/datasets", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert "JSON" in str(_problem(r, 422, "invalid-request")["detail"])


def test_body_that_is_not_utf8_is_422(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/datasets",
        content=b'{"name": "\xff\xfe"}',
        headers={"content-type": "application/json"},
    )
    _problem(r, 422, "invalid-request")


def test_non_json_body_is_415(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/datasets",
        content=b"name=x",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    _problem(r, 415, "unsupported-media-type")


def test_body_over_the_limit_is_413(server: Server) -> None:
    big = {"name": "big", "kind": "synthetic", "params": {"pad": "x" * (2 << 20)}}
    _problem(httpx.post(f"{server.url}/v1/datasets", json=big), 413, "payload-too-large")

    def chunks() -> object:  # no Content-Length: the limit holds for streamed bodies too
        for _ in range(3):
            yield b" " * (1 << 20)

    r = httpx.post(
        f"{server.url}/v1/datasets",
        content=chunks(),  # type: ignore[arg-type]
        headers={"content-type": "application/json"},
    )
    _problem(r, 413, "payload-too-large")


def test_synthetic_sample_size_is_capped(admin: Client) -> None:
    """A huge synthetic sample is refused before the server builds one."""
    with pytest.raises(InvalidRequest, match="capped"):
        admin.create_dataset(
            "huge",
            "synthetic",
            {"length": 1, "fields": [{"shape": [100000, 100000], "dtype": "float32"}]},
        )
