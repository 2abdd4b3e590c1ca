"""``GET /metrics``: Prometheus text, per-loader series read from the live engine."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pinfeed import Client, Loader
from pinfeed.protocol import NEXTS_IN_FLIGHT
from pinfeed_server.api.prometheus import SERIES, render
from pinfeed_server.api.routes.metrics import MetricsCache
from pinfeed_server.engine.stats import StatsSnapshot
from pinfeed_server.engine.status import LoaderStatus
from tests.api.conftest import MakeServer, synthetic
from tests.conftest import Server
from tests.helpers import unique

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# The per-loader families as /metrics wrote them when metrics.py kept its own table of
# names (before the snapshot's fields declared them), for a loader that could not start.
ONE_LOADER = Path(__file__).with_name("metrics_one_loader.prom")


def _samples(server: Server) -> Samples:
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _fresh(server: Server, ready: Callable[[Samples], bool]) -> Samples:
    """Scrape until ``ready`` holds: a body is up to PINFEED_METRICS_MAX_AGE_S (1 s) old."""
    deadline = time.monotonic() + 10
    while not ready(m := _samples(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def test_metrics_follow_a_loader(admin: Client, server: Server) -> None:
    name = unique("metric")
    admin.create_dataset(name, "synthetic", synthetic(40))
    admin.create_loader(name, dataset=name, batch_size=4, num_workers=1, prefetch_factor=2)
    lo = (("loader", name),)
    with Loader(name, socket=server.socket, timeout=60) as loader:
        it = iter(loader)
        next(it)
        next(it)
        m = _fresh(server, lambda m: m.get(("pinfeed_loader_consumer_attached", lo)) == 1)
        assert m[("pinfeed_loader_consumer_attached", lo)] == 1
    status = admin.loader(name)
    consumed = m[("pinfeed_loader_batches_consumed_total", lo)]
    # the two batches taken, and those the client asked for ahead (NEXTS_IN_FLIGHT)
    assert 2 <= consumed <= 2 + NEXTS_IN_FLIGHT
    assert m[("pinfeed_loader_samples_consumed_total", lo)] == 4 * consumed
    assert m[("pinfeed_loader_bytes_consumed_total", lo)] == consumed * status["slot_bytes"]
    assert m[("pinfeed_loader_batches_produced_total", lo)] >= 2
    assert m[("pinfeed_loader_errors_total", lo)] == 0
    assert m[("pinfeed_loader_worker_restarts_total", lo)] == 0
    assert m[("pinfeed_loader_consumer_wait_seconds_total", lo)] >= 0
    assert m[("pinfeed_loader_ring_bytes", lo)] == status["ring_bytes"]
    assert m[("pinfeed_loader_page_locked", lo)] == float(status["page_locked"])
    assert 0 <= m[("pinfeed_loader_consumer_wait_share", lo)] <= 1
    assert 0 <= m[("pinfeed_loader_consumer_wait_share_since_start", lo)] <= 1
    assert m[("pinfeed_loader_worker_busy_seconds_total", lo)] >= 0
    assert m[("pinfeed_loader_workers", lo)] == 1
    assert m[("pinfeed_workers", ())] >= 1
    assert m[("pinfeed_workers_max", ())] >= m[("pinfeed_workers", ())]
    # One histogram observation per next() the trainer reported (the first one's wait
    # arrives with the second NEXT): cumulative buckets, +Inf equal to the count.
    waits = m[("pinfeed_loader_next_wait_seconds_count", lo)]
    assert waits >= 1
    assert m[("pinfeed_loader_next_wait_seconds_bucket", (("le", "+Inf"), *lo))] == waits
    assert (
        m[("pinfeed_loader_next_wait_seconds_sum", lo)]
        == m[("pinfeed_loader_consumer_wait_seconds_total", lo)]
    )
    assert m[("pinfeed_loader_skipped_total", lo)] == 0
    assert m[("pinfeed_loader_position", lo)] == consumed
    assert m[("pinfeed_loader_batches_per_epoch", lo)] == 10
    slots = {
        s: m[("pinfeed_loader_slots", (("loader", name), ("state", s)))]
        for s in ("free", "filling", "ready", "leased")
    }
    assert sum(slots.values()) == 1 * 2 + 3  # made ahead, plus the trainer's three
    assert m[("pinfeed_loader_state", (("loader", name), ("state", "ready")))] == 1
    assert m[("pinfeed_loader_state", (("loader", name), ("state", "failed")))] == 0
    assert m[("pinfeed_loader_info", (("batch_size", "4"), ("dataset", name), ("loader", name)))]
    assert m[("pinfeed_shm_used_bytes", ())] >= status["ring_bytes"]
    assert m[("pinfeed_shm_budget_bytes", ())] > 0
    assert ("process_resident_memory_bytes", ()) in m

    m = _fresh(server, lambda m: m.get(("pinfeed_loader_consumer_attached", lo)) == 0)
    assert m[("pinfeed_loader_consumer_attached", lo)] == 0
    admin.delete_loader(name)
    assert ("pinfeed_loader_ring_bytes", lo) not in _fresh(
        server, lambda m: ("pinfeed_loader_ring_bytes", lo) not in m
    )


@pytest.mark.slow
def test_scrapes_within_the_max_age_share_one_body(make_server: MakeServer) -> None:
    server = make_server(PINFEED_METRICS_MAX_AGE_S="30")
    first = httpx.get(f"{server.url}/metrics").text
    with server.client() as admin:
        admin.create_dataset("d", "synthetic", synthetic(8))
        admin.create_loader("l", dataset="d", batch_size=4)
    assert httpx.get(f"{server.url}/metrics").text == first  # the cached body
    fresh = make_server(PINFEED_METRICS_MAX_AGE_S="0")
    with fresh.client() as admin:
        admin.create_dataset("d", "synthetic", synthetic(8))
        assert "pinfeed_loaders 0" in httpx.get(f"{fresh.url}/metrics").text
        admin.create_loader("l", dataset="d", batch_size=4)
        assert "pinfeed_loaders 1" in httpx.get(f"{fresh.url}/metrics").text


class _CountingCache(MetricsCache):
    """The cache's policy alone: each render returns a new numbered body."""

    def __init__(self, max_age_s: float) -> None:
        super().__init__(lambda: None, max_age_s)  # type: ignore[arg-type, return-value]
        self.renders = 0

    def render(self) -> bytes:
        self.renders += 1
        return str(self.renders).encode()


def test_a_stale_body_is_served_at_once_while_one_render_refreshes_it() -> None:
    async def scenario() -> None:
        # max_age 0.5 s: the window "stale but servable" is [0.5, 1.0) s after a render,
        # and a sleep of 0.6 s may overshoot by 0.4 s (a loaded machine) and land in it
        cache = _CountingCache(0.5)
        assert await cache.get() == b"1"  # nothing yet: this scrape renders
        assert await cache.get() == b"1"  # fresh: shared
        await asyncio.sleep(0.6)  # older than max_age, younger than twice it
        assert await cache.get() == b"1"  # served at once ...
        assert await cache.get() == b"1"  # ... and one refresh started, not two
        assert cache._refresh is not None
        assert await cache._refresh == b"2"
        assert cache.renders == 2
        assert await cache.get() == b"2"
        await asyncio.sleep(1.05)  # older than twice max_age: too stale to serve
        assert await cache.get() == b"3"

    asyncio.run(scenario())


def test_a_periodic_scraper_finds_a_body_rendered_ahead_of_it() -> None:
    """Prometheus every 15 s misses a 1 s cache: here every 0.6 s against 0.2 s. From
    the gaps the cache renders max_age / 2 before the next scrape, which is then served
    at once, a body younger than max_age, one render per scrape."""

    async def scenario() -> list[tuple[bytes, float]]:
        cache = _CountingCache(0.2)
        served = []
        for _ in range(5):
            t0 = time.monotonic()
            body = await cache.get()
            served.append((body, time.monotonic() - cache._at))
            await asyncio.sleep(0.6 - (time.monotonic() - t0))
        return served

    served = asyncio.run(scenario())
    # the first two render at the scrape (no period known); then rendered ahead
    assert [b for b, _ in served] == [b"1", b"2", b"3", b"4", b"5"]
    for _, age in served[2:]:
        assert 0.02 < age < 0.2  # rendered before the scrape, younger than max_age


def _loader_families(text: str) -> list[str]:
    """Each ``pinfeed_loader_*`` family's text (HELP, TYPE, samples), in name order:
    families may come in any order, a family's lines may not."""
    families = re.split(r"(?m)^(?=# HELP )", text)
    return sorted(f for f in families if f.startswith("# HELP pinfeed_loader_"))


def test_the_loader_series_are_byte_for_byte_the_ones_dashboards_know() -> None:
    """Names, HELP, TYPE, labels and values (a loader that could not start: zeros) as
    before; the families come from the fields of LoaderStatus and StatsSnapshot."""
    gone = (
        {"name": "gone", "dataset": "d", "batch_size": 4},
        LoaderStatus.unstarted("its dataset file is gone"),
        StatsSnapshot.zeros("gone", 0),
    )
    service: Any = SimpleNamespace(
        loaders={},
        unstarted=lambda: [gone],
        settings=SimpleNamespace(max_shm_bytes=1 << 30, max_workers=8, cache_budget=1 << 29),
        shm_used=lambda: 0,
        workers_used=lambda: 0,
        cache_stats=dict,
        remote_stats=lambda: None,  # no dataset in a store
    )
    assert _loader_families(render(service)) == _loader_families(ONE_LOADER.read_text())
    assert len({s.metric for s in SERIES}) == len(SERIES)  # no name declared twice
