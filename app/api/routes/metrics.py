"""``GET /metrics``: Prometheus text format, read from the live service at scrape time.

A custom collector rather than long-lived metric objects: the engine already keeps
every counter, so a scrape reads them once, under the engine's own locks, and a
deleted loader simply stops appearing. One registry per app, so several apps in one
process (tests) never share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pinfeed_server import __version__
from pinfeed_server.service import Service

router = APIRouter(tags=["metrics"])

SLOT_STATES = ("free", "filling", "ready", "leased")
LOADER_STATES = ("starting", "ready", "failed", "draining", "closed")

# (metric suffix, help, key in Service.loader_metrics() rows)
COUNTERS = (
    ("batches_produced", "Batches written into the ring", "batches_produced"),
    ("batches_consumed", "Batches handed to the consumer", "batches_consumed"),
    ("samples_consumed", "Samples handed to the consumer", "samples_consumed"),
    ("bytes_consumed", "Ring bytes handed to the consumer", "bytes_consumed"),
    ("errors", "Batches that failed because a sample raised", "errors"),
    ("skipped", "Batches skipped because a sample raised (on_error=skip)", "skipped"),
    ("worker_restarts", "Worker processes replaced after dying", "worker_restarts"),
    ("consumer_wait_seconds", "Time the consumer spent waiting for batches", "consumer_wait_s"),
)
GAUGES = (
    ("ring_bytes", "Size of the loader's shared-memory ring", "ring_bytes"),
    ("page_locked", "1 if the ring is page-locked (mlock)", "page_locked"),
    ("consumer_attached", "1 if a trainer is attached", "consumer_attached"),
    (
        "consumer_cuda_registered",
        "1 if the trainer registered the ring with CUDA",
        "consumer_cuda_registered",
    ),
    (
        "consumer_wait_share",
        "Share of the last 10 s the trainers waited for batches: near 1 = input-bound",
        "consumer_wait_share",
    ),
    (
        "consumer_wait_share_total",
        "Share of time the trainers waited for batches since they started asking",
        "consumer_wait_share_total",
    ),
    ("worker_busy_share", "Share of worker time spent building batches", "worker_busy_share"),
    ("samples_per_second", "Samples consumed per second over the last 10 s", "samples_per_s"),
    ("bytes_per_second", "Bytes consumed per second over the last 10 s", "bytes_per_s"),
    ("epoch", "Epoch of the next batch handed to the consumer", "epoch"),
    ("position", "Index in its epoch of the next batch", "position"),
    ("batches_per_epoch", "Batches in one epoch", "batches_per_epoch"),
)


class ServiceCollector(Collector):
    def __init__(self, service: Callable[[], Service]) -> None:
        self._service = service

    def collect(self) -> Iterator[Any]:
        service = self._service()
        rows = service.loader_metrics()
        budget = GaugeMetricFamily("pinfeed_shm_budget_bytes", "PINFEED_MAX_SHM_BYTES")
        budget.add_metric([], service.settings.max_shm_bytes)
        used = GaugeMetricFamily("pinfeed_shm_used_bytes", "Bytes of the budget held by rings")
        used.add_metric([], service.shm_used())
        loaders = GaugeMetricFamily("pinfeed_loaders", "Loaders registered")
        loaders.add_metric([], len(rows))
        info = InfoMetricFamily("pinfeed_build", "pinfeed version")
        info.add_metric([], {"version": __version__})
        yield from (budget, used, loaders, info)

        loader_info = InfoMetricFamily(
            "pinfeed_loader", "A loader's dataset and batch size", labels=["loader"]
        )
        state = GaugeMetricFamily(
            "pinfeed_loader_state", "1 for the loader's current state", labels=["loader", "state"]
        )
        slots = GaugeMetricFamily(
            "pinfeed_loader_slots", "Ring slots by state", labels=["loader", "state"]
        )
        for row in rows:
            loader_info.add_metric(
                [row["name"]], {"dataset": row["dataset"], "batch_size": str(row["batch_size"])}
            )
            for s in LOADER_STATES:
                state.add_metric([row["name"], s], float(row["state"] == s))
            for s in SLOT_STATES:
                slots.add_metric([row["name"], s], row["slots"][s])
        yield from (loader_info, state, slots)

        for suffix, doc, key in COUNTERS:
            counter = CounterMetricFamily(f"pinfeed_loader_{suffix}", doc, labels=["loader"])
            for row in rows:
                counter.add_metric([row["name"]], float(row[key]))
            yield counter
        for suffix, doc, key in GAUGES:
            gauge = GaugeMetricFamily(f"pinfeed_loader_{suffix}", doc, labels=["loader"])
            for row in rows:
                gauge.add_metric([row["name"]], float(row[key]))
            yield gauge


def build_registry(service: Callable[[], Service]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ServiceCollector(service))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


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
def metrics(request: Request) -> Response:
    """Per-loader gauges and counters in Prometheus text format; never needs the token."""
    registry: CollectorRegistry = request.app.state.metrics
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
