"""After SIGTERM and a restart on the same state dir, datasets and loaders are back."""

from __future__ import annotations

import signal

import pytest
import torch

from pinfeed import Loader, ServerUnavailable
from tests.api.conftest import MakeServer, synthetic


def test_loader_survives_a_server_restart(make_server: MakeServer) -> None:
    server = make_server()
    with server.client() as c:
        c.create_dataset("ds", "synthetic", synthetic(40))
        before = c.create_loader(
            "lo", dataset="ds", batch_size=5, shuffle=True, seed=3, num_workers=1
        )
    with Loader("lo", socket=server.socket, timeout=60) as loader:
        it = iter(loader)
        first = [torch.clone(next(it)[1]) for _ in range(3)]
        assert server.stop(signal.SIGTERM) == 0
        assert "Application shutdown complete" in server.log.read_text()
        with pytest.raises(ServerUnavailable):
            next(it)

    server.start()
    with server.client() as c:
        assert [d["name"] for d in c.datasets()] == ["ds"]
        after = c.loader("lo")
        config = ("dataset", "batch_size", "shuffle", "seed", "num_workers", "created_at")
        assert {k: after[k] for k in config} == {k: before[k] for k in config}
        assert after["state"] in ("starting", "ready")
    with Loader("lo", socket=server.socket, timeout=60) as loader:
        labels = [y.clone() for _, y in loader]  # views are reused after the next batch
    assert len(labels) == 8
    # Same seed, same order: the restarted loader begins again at epoch 0.
    assert all(torch.equal(a, b) for a, b in zip(first, labels, strict=False))
