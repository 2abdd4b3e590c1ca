"""Probes: /healthz is liveness, /readyz waits for every loader to leave ``starting``."""

from __future__ import annotations

import time

import httpx
import pytest

from pinfeed import NotReady
from tests.api.conftest import PLUGINS, MakeServer
from tests.api.test_datasets import _problem
from tests.conftest import Server


def test_healthz(server: Server) -> None:
    with server.client() as c:
        assert c.health() == {"status": "ok"}


@pytest.mark.slow
def test_readyz_is_503_while_a_loader_starts(make_server: MakeServer) -> None:
    server = make_server(PINFEED_ALLOWED_PLUGINS=PLUGINS)
    gate = server.root / "gate"
    with server.client() as c:
        assert c.ready() == {"status": "ok"}
        c.create_dataset(
            "gated", "python", {"factory": "tests.api.plugins:Gated", "kwargs": {"gate": str(gate)}}
        )
        # Its worker blocks building the dataset until the gate opens: state "starting".
        c.create_loader("slow", dataset="gated", batch_size=2, num_workers=1)
        problem = _problem(httpx.get(f"{server.url}/readyz"), 503, "not-ready")
        assert problem["loaders"] == ["slow"]
        with pytest.raises(NotReady, match="slow"):
            c.ready()
        assert c.loader("slow")["state"] == "starting"
        gate.touch()
        deadline = time.monotonic() + 60
        while c.loader("slow")["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the state the test waits for
        assert c.loader("slow")["state"] == "ready"
        assert c.ready() == {"status": "ok"}
