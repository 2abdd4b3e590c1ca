"""``GET /metrics``: Prometheus text format (``api/prometheus.py`` renders it), read from
the live service at scrape time, with the process metrics (memory, CPU, fds) of
prometheus_client's own collectors, in one registry per app, so several apps in one
process never share series.

Scrapes faster than PINFEED_METRICS_MAX_AGE_S share one rendered body (``MetricsCache``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from pinfeed_server.api.prometheus import render
from pinfeed_server.service import Service

router = APIRouter(tags=["metrics"])


class MetricsCache:
    """The last rendered body, served while younger than ``max_age_s``.

    A render is O(loaders) but not free (~2 ms of CPU with 50 loaders here, several
    times that in wall time while the data plane and the workers hold the cores), so
    a scrape does not wait for one when it can be helped:

    - scrapes that come often share one body: one that finds the body older than
      ``max_age_s`` but younger than twice that gets it at once and starts one render
      in a worker thread for the next scrape (stale-while-revalidate);
    - a scraper that comes every ``period`` seconds (Prometheus every 15 s, which
      always misses a 1 s cache) gets a body rendered ahead of it: from the gaps
      between its scrapes the cache expects the next one and renders ``max_age_s / 2``
      before it, so the scrape finds a body younger than ``max_age_s`` and is answered
      at once. A render per scrape, as without it, only earlier;
    - a scrape that finds no body younger than twice ``max_age_s`` renders it.

    One render at a time; a scrape that arrives during one gets the previous body.
    """

    def __init__(self, service: Callable[[], Service], max_age_s: float) -> None:
        self._service = service
        self.max_age_s = max_age_s
        self._registry = CollectorRegistry()  # process metrics, by prometheus_client
        ProcessCollector(registry=self._registry)
        PlatformCollector(registry=self._registry)
        self._body: bytes | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Task[bytes] | None = None  # the background render, if any
        self._last_scrape: float | None = None
        self.period: float | None = None  # the scrapers' period, when they miss the cache
        self._ahead: asyncio.TimerHandle | None = None  # the render before the next scrape

    def render(self) -> bytes:
        return render(self._service()).encode() + generate_latest(self._registry)

    async def _render(self) -> bytes:
        async with self._lock:
            if self._body is None or time.monotonic() - self._at >= self.max_age_s:
                at = time.monotonic()
                self._body = await anyio.to_thread.run_sync(self.render)
                self._at = at
            return self._body

    def _background(self) -> None:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._render())

    def _expect_next(self, now: float) -> None:
        """Learn the scrapers' period (gaps longer than the cache keeps a body) and
        render ahead of the next scrape."""
        last, self._last_scrape = self._last_scrape, now
        if last is None or not self.max_age_s:
            return
        gap = now - last
        if gap < 2 * self.max_age_s:
            return  # frequent scrapes share bodies already
        self.period = gap if self.period is None else 0.7 * self.period + 0.3 * gap
        if self._ahead is not None:
            self._ahead.cancel()
        lead = self.period - self.max_age_s / 2
        self._ahead = asyncio.get_running_loop().call_later(lead, self._background)

    async def get(self) -> bytes:
        now = time.monotonic()
        self._expect_next(now)
        body = self._body
        if body is None:
            return await self._render()
        age = now - self._at
        if age < self.max_age_s or self._lock.locked():
            return body
        if age < 2 * self.max_age_s:
            self._background()
            return body
        return await self._render()


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text format, one series set per loader",
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: Request) -> Response:
    """Per-loader gauges, counters and wait histograms in Prometheus text format, at most
    PINFEED_METRICS_MAX_AGE_S old; never needs the token."""
    cache: MetricsCache = request.app.state.metrics
    return Response(await cache.get(), media_type=CONTENT_TYPE_LATEST)
