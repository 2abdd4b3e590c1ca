"""After SIGTERM and a restart on the same state dir, datasets and loaders are back; one
that cannot start again is served as failed, with zero stats."""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest
import torch

from pinfeed import Loader, ServerUnavailable
from pinfeed.protocol import NEXTS_IN_FLIGHT
from tests.api.conftest import synthetic
from tests.conftest import Server


@pytest.mark.slow
def test_loader_survives_a_server_restart(restartable: Server) -> None:
    server = restartable
    with server.client() as c:
        c.create_dataset("ds", "synthetic", synthetic(40))
        before = c.create_loader(
            "lo", dataset="ds", batch_size=5, shuffle=True, seed=3, num_workers=1
        )
        c.create_loader("wide", dataset="ds", batch_size=4, num_workers=2)
    with Loader("lo", socket=server.socket, timeout=60) as loader:
        it = iter(loader)
        first = [torch.clone(next(it)[1]) for _ in range(3)]
        logged = server.log.stat().st_size  # the log is the shared server's, appended to
        assert server.stop(signal.SIGTERM) == 0
        assert b"Application shutdown complete" in server.log.read_bytes()[logged:]
        # What the server sent before it stopped is delivered (at most the NEXTs in
        # flight), then the loss.
        with pytest.raises(ServerUnavailable):
            for _ in range(NEXTS_IN_FLIGHT + 1):
                next(it)

    server.env["PINFEED_MAX_WORKERS"] = "1"  # "lo" starts first (by name), "wide" cannot
    server.start()
    with server.client() as c:
        assert [d["name"] for d in c.datasets()] == ["ds"]
        after = c.loader("lo")
        config = ("dataset", "batch_size", "shuffle", "seed", "num_workers", "created_at")
        assert {k: after[k] for k in config} == {k: before[k] for k in config}
        assert after["state"] in ("starting", "ready")
        assert c.loader("wide")["state"] == "failed"
        _assert_zero_stats(c.loader_stats("wide"), httpx.get(f"{server.url}/metrics").text)
    with Loader("lo", socket=server.socket, timeout=60) as loader:
        labels = [y.clone() for _, y in loader]  # views are reused after the next batch
    assert len(labels) == 8
    # Same seed, same order: the restarted loader begins again at epoch 0.
    assert all(torch.equal(a, b) for a, b in zip(first, labels, strict=False))


def _assert_zero_stats(stats: dict[str, Any], metrics: str) -> None:
    """A loader that could not start: its stats are zeros (the same snapshot type as a
    running loader's), and /metrics lists it, failed, with its configured workers."""
    assert stats["name"] == "wide" and stats["autotune"] is None
    assert stats["batches_produced"] == stats["errors"] == stats["samples_per_s"] == 0
    assert stats["consumer_wait_p99_s"] is None and "workers" not in stats
    assert 'pinfeed_loader_state{loader="wide",state="failed"} 1\n' in metrics
    assert 'pinfeed_loader_workers{loader="wide"} 2\n' in metrics
    assert 'pinfeed_loader_next_wait_seconds_count{loader="wide"} 0\n' in metrics
