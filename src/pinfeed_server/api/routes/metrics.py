"""``GET /metrics``: Prometheus text format, read from the live service at scrape time.

Loaders' series are labelled ``loader``, each cached dataset's ``dataset``
(``pinfeed_dataset_cache_*``, from its ``CacheStats``). The engine keeps every
counter, so a scrape reads them once per loader (lock-free
statistics, ``engine.stats``) and writes the text directly: O(loaders), a few
microseconds per series, no metric objects per scrape. A deleted loader simply stops
appearing. Process metrics (memory, CPU, fds) come from prometheus_client's own
collectors, in one registry per app, so several apps in one process never share series.

Scrapes faster than PINFEED_METRICS_MAX_AGE_S share one rendered body (``MetricsCache``).

Names follow Prometheus' rules (``tests/api/test_metric_names.py`` checks what
``promtool check metrics`` checks): base units, ``_total`` on counters only, snake case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from pinfeed import __version__
from pinfeed_server.engine.stats import WAIT_BUCKETS_S, LoaderStats
from pinfeed_server.service import Service

router = APIRouter(tags=["metrics"])

SLOT_STATES = ("free", "filling", "ready", "leased")
LOADER_STATES = ("starting", "ready", "failed", "draining", "closed")

# (name after pinfeed_loader_, help, key in loader_rows() rows)
COUNTERS = (
    ("batches_produced_total", "Batches written into the ring", "batches_produced"),
    ("batches_consumed_total", "Batches handed to the consumer", "batches_consumed"),
    ("samples_consumed_total", "Samples handed to the consumer", "samples_consumed"),
    ("bytes_consumed_total", "Ring bytes handed to the consumer", "bytes_consumed"),
    ("errors_total", "Batches that failed because a sample raised", "errors"),
    ("skipped_total", "Batches skipped because a sample raised (on_error=skip)", "skipped"),
    ("worker_restarts_total", "Worker processes replaced after dying", "worker_restarts"),
    (
        "consumer_wait_seconds_total",
        "Time the consumers spent waiting for batches",
        "consumer_wait_s",
    ),
    (
        "worker_busy_seconds_total",
        "Time worker processes (or the in-server producer) spent building batches",
        "worker_busy_s",
    ),
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
        "consumer_wait_share_since_start",
        "Share of time the trainers waited for batches since they started asking",
        "consumer_wait_share_total",
    ),
    ("worker_busy_share", "Share of worker time spent building batches", "worker_busy_share"),
    ("workers", "Worker processes the loader is configured with", "num_workers"),
    ("samples_per_second", "Samples consumed per second over the last 10 s", "samples_per_s"),
    ("bytes_per_second", "Bytes consumed per second over the last 10 s", "bytes_per_s"),
    ("epoch", "Epoch of the next batch handed to the consumer", "epoch"),
    ("position", "Index in its epoch of the next batch", "position"),
    ("batches_per_epoch", "Batches in one epoch", "batches_per_epoch"),
)
# Each cached dataset's series: (name after pinfeed_dataset_cache_, kind, help, CacheStats field)
CACHE_SERIES = (
    ("bytes", "gauge", "Memory the dataset's sample cache uses", "bytes"),
    ("max_bytes", "gauge", "Memory the dataset's sample cache reserves", "max_bytes"),
    ("samples", "gauge", "Samples stored in the dataset's cache", "samples"),
    ("persisted", "gauge", "1 if the cache is kept in a file too", "persisted"),
    ("hits_total", "counter", "Reads served from the cache", "hits"),
    ("misses_total", "counter", "Reads from the dataset itself", "misses"),
    ("waits_total", "counter", "Hits that waited for another process to store", "waits"),
    ("corrupt_total", "counter", "Stored records that failed their checksum", "corrupt"),
    ("rebuilt_total", "counter", "Times the cache's file was unusable and rebuilt", "rebuilt"),
)
WAIT_HISTOGRAM = "pinfeed_loader_next_wait_seconds"
WAIT_HELP = "How long one next() of a trainer blocked for its batch"
LE = [*(repr(b) for b in WAIT_BUCKETS_S), "+Inf"]


def _esc(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _num(v: Any) -> str:
    if v is None:  # unknown (an IterableDataset's batches per epoch)
        return "NaN"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _family(out: list[str], name: str, kind: str, doc: str) -> None:
    out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")


# The LoaderStatus fields a row carries (besides ``slots``).
STATUS_FIELDS = (
    "state",
    "ring_bytes",
    "page_locked",
    "consumer_attached",
    "consumer_cuda_registered",
    "epoch",
    "position",
    "batches_per_epoch",
    "worker_restarts",
)


def loader_rows(service: Service) -> list[dict[str, Any]]:
    """Status and counters of every loader in one pass (those that could not start
    with zeros): read off the status model and the lock-free stats, no model_dump."""
    out = []
    for name, engine in sorted(service.loaders.items()):
        status = engine.status()
        out.append(
            {
                "name": name,
                "dataset": engine.config.dataset,
                "batch_size": engine.config.batch_size,
                **{k: getattr(status, k) for k in STATUS_FIELDS},
                "slots": vars(status.slots),
                **engine.stats_snapshot(),
                "num_workers": engine.config.num_workers,
                "bytes_consumed": engine.stats.bytes_consumed,
                "consumer_wait_s": engine.stats.wait_s,
            }
        )
    for row in service.unstarted():
        out.append(
            {
                **row,
                **LoaderStats().snapshot(0.0, 1),
                "bytes_consumed": 0,
                "consumer_wait_s": 0.0,
            }
        )
    return out


def render(service: Service) -> str:
    """The pinfeed series of every loader, in Prometheus text format 0.0.4."""
    rows = loader_rows(service)
    names = [(row, _esc(row["name"])) for row in rows]
    caches = service.cache_stats()
    out: list[str] = []
    for name, doc, value in (
        ("pinfeed_shm_budget_bytes", "PINFEED_MAX_SHM_BYTES", service.settings.max_shm_bytes),
        (
            "pinfeed_shm_used_bytes",
            "Bytes of the budget held by rings and caches",
            service.shm_used(),
        ),
        ("pinfeed_cache_budget_bytes", "PINFEED_CACHE_MAX_BYTES", service.settings.cache_budget),
        (
            "pinfeed_cache_reserved_bytes",
            "Bytes of the budget reserved by sample caches",
            sum(c.max_bytes for c in caches.values()),
        ),
        ("pinfeed_loaders", "Loaders registered", len(rows)),
        ("pinfeed_workers", "Worker processes of all loaders", service.workers_used()),
        ("pinfeed_workers_max", "PINFEED_MAX_WORKERS", service.settings.max_workers),
    ):
        _family(out, name, "gauge", doc)
        out.append(f"{name} {_num(value)}\n")
    _family(out, "pinfeed_build_info", "gauge", "pinfeed version")
    out.append(f'pinfeed_build_info{{version="{__version__}"}} 1\n')

    _family(out, "pinfeed_loader_info", "gauge", "A loader's dataset and batch size")
    for row, n in names:
        out.append(
            f'pinfeed_loader_info{{loader="{n}",dataset="{_esc(row["dataset"])}",'
            f'batch_size="{row["batch_size"]}"}} 1\n'
        )
    _family(out, "pinfeed_loader_state", "gauge", "1 for the loader's current state")
    for row, n in names:
        for s in LOADER_STATES:
            out.append(
                f'pinfeed_loader_state{{loader="{n}",state="{s}"}} {int(row["state"] == s)}\n'
            )
    _family(out, "pinfeed_loader_slots", "gauge", "Ring slots by state")
    for row, n in names:
        for s in SLOT_STATES:
            out.append(f'pinfeed_loader_slots{{loader="{n}",state="{s}"}} {row["slots"][s]}\n')
    for families, kind in ((COUNTERS, "counter"), (GAUGES, "gauge")):
        for suffix, doc, key in families:
            metric = f"pinfeed_loader_{suffix}"
            _family(out, metric, kind, doc)
            out.extend(f'{metric}{{loader="{n}"}} {_num(row[key])}\n' for row, n in names)

    for suffix, kind, doc, key in CACHE_SERIES:
        metric = f"pinfeed_dataset_cache_{suffix}"
        _family(out, metric, kind, doc)
        out.extend(
            f'{metric}{{dataset="{_esc(d)}"}} {_num(getattr(c, key))}\n' for d, c in caches.items()
        )

    _family(out, WAIT_HISTOGRAM, "histogram", WAIT_HELP)
    for row, n in names:
        counts, total_s = row["wait_histogram"]
        cumulative = 0
        for le, count in zip(LE, counts, strict=True):
            cumulative += count
            out.append(f'{WAIT_HISTOGRAM}_bucket{{loader="{n}",le="{le}"}} {cumulative}\n')
        out.append(f'{WAIT_HISTOGRAM}_sum{{loader="{n}"}} {float(total_s)!r}\n')
        out.append(f'{WAIT_HISTOGRAM}_count{{loader="{n}"}} {cumulative}\n')
    return "".join(out)


class MetricsCache:
    """The last rendered body, served while younger than ``max_age_s``.

    A render is O(loaders) but not free (~3 ms of CPU with 50 loaders here, several
    times that in wall time while the data plane and the workers hold the cores), so
    scrapes never wait for one while they come often: a scrape that finds the body
    older than ``max_age_s`` but younger than twice that gets it at once and starts one
    render in a worker thread for the next scrape (stale-while-revalidate). A body
    older than that (Prometheus scraping every 15 s) is rendered for the scrape that
    asks. One render at a time; a scrape that arrives during one gets the previous body.
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

    def render(self) -> bytes:
        return render(self._service()).encode() + generate_latest(self._registry)

    async def _render(self) -> bytes:
        async with self._lock:
            if self._body is None or time.monotonic() - self._at >= self.max_age_s:
                at = time.monotonic()
                self._body = await anyio.to_thread.run_sync(self.render)
                self._at = at
            return self._body

    async def get(self) -> bytes:
        body = self._body
        if body is None:
            return await self._render()
        age = time.monotonic() - self._at
        if age < self.max_age_s or self._lock.locked():
            return body
        if age < 2 * self.max_age_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self._render())
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
