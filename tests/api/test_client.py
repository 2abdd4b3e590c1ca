"""``client.Client`` raises the typed exception for each problem type it gets back."""

from __future__ import annotations

import pytest

from pinfeed import (
    Client,
    Conflict,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    PinfeedError,
    ProblemError,
    UnsupportedMediaType,
)
from tests.api.conftest import synthetic
from tests.conftest import Server, free_port
from tests.helpers import unique


def test_problem_types_come_back_typed(admin: Client) -> None:
    name = unique("typed")
    admin.create_dataset(name, "synthetic", synthetic())
    cases: list[tuple[type[ProblemError], int, object]] = [
        (Conflict, 409, lambda: admin.create_dataset(name, "synthetic", synthetic())),
        (NotFound, 404, lambda: admin.loader(unique("missing"))),
        (InvalidRequest, 422, lambda: admin.create_loader(unique("x"), dataset=name, batch_size=0)),
        (
            PayloadTooLarge,
            413,
            lambda: admin.create_dataset(unique("x"), "synthetic", {"pad": "x" * (2 << 20)}),
        ),
        (MethodNotAllowed, 405, lambda: admin._request("PUT", "/v1/loaders")),
        (
            UnsupportedMediaType,
            415,
            lambda: admin._request(
                "POST", "/v1/loaders", content=b"x", headers={"content-type": "text/plain"}
            ),
        ),
    ]
    for cls, status, call in cases:
        with pytest.raises(cls) as info:
            call()  # type: ignore[operator]
        error = info.value
        assert error.status == status
        assert error.type == f"urn:pinfeed:problem:{cls.slug}"
        assert error.detail and error.extra["instance"].startswith("/")


def test_names_are_quoted_into_paths(admin: Client) -> None:
    for weird in ("a/b", "..", "x?y=1", "%2e%2e"):
        with pytest.raises(NotFound):
            admin.dataset(weird)
        with pytest.raises(NotFound):
            admin.loader_stats(weird)


def test_unreachable_server_is_a_clear_pinfeed_error() -> None:
    with (
        Client(f"http://127.0.0.1:{free_port()}", timeout=5) as c,
        pytest.raises(PinfeedError, match="cannot reach the pinfeed server"),
    ):
        c.datasets()


def test_metrics_text(server: Server) -> None:
    with server.client() as c:
        assert "pinfeed_shm_budget_bytes" in c.metrics()
