"""``GET /metrics``: Prometheus text format, read from the live service at scrape time.

Loaders' series are labelled ``loader``; each cached dataset's ``dataset``
(``pinfeed_dataset_cache_*``: the fields of its ``CacheStats`` that declare a
``Metric``).

The engine keeps every counter, so a scrape reads them once per loader (its
``LoaderStatus`` and a ``StatsSnapshot`` of the lock-free statistics, both built without
validation) and writes the text directly: O(loaders), a few microseconds per series, no
metric objects per scrape. The per-loader families are the fields of those two models
that declare a ``Metric`` (name, type, help: ``pinfeed_server/metric.py``), in their order; the
``state`` labels' values are ``LoaderState`` and the ``SlotCounts`` fields. A deleted
loader simply stops appearing. Process metrics (memory, CPU, fds) come from
prometheus_client's own collectors, in one registry per app, so several apps in one
process never share series.

Scrapes faster than PINFEED_METRICS_MAX_AGE_S share one rendered body (``MetricsCache``).

Names follow Prometheus' rules (``tests/api/test_metric_names.py`` checks what
``promtool check metrics`` checks): base units, ``_total`` on counters only, snake case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import accumulate
from operator import attrgetter
from typing import Any, NamedTuple, get_args

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from pydantic import BaseModel

from pinfeed import __version__
from pinfeed_server.cache import CacheStats
from pinfeed_server.engine.stats import WAIT_BUCKETS_S, StatsSnapshot, WaitHistogram
from pinfeed_server.engine.status import LoaderState, LoaderStatus, SlotCounts
from pinfeed_server.metric import metric_fields
from pinfeed_server.service import Service

router = APIRouter(tags=["metrics"])

# The ``state`` label's values, from the types that declare them.
LOADER_STATES: tuple[str, ...] = get_args(LoaderState)
SLOT_STATES = tuple(s for s in SlotCounts.model_fields if s != "total")  # total: their sum
LE = [*(repr(b) for b in WAIT_BUCKETS_S), "+Inf"]
LE_CLOSED = [f'{le}"}} ' for le in LE]  # a bucket sample's text after ``le="``


def _esc(value: str) -> str:
    if "\\" not in value and '"' not in value and "\n" not in value:
        return value  # most names: no three replace() per loader and scrape
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _num(v: Any) -> str:
    if v is None:  # unknown (an IterableDataset's batches per epoch)
        return "NaN"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def _family(out: list[str], name: str, kind: str, doc: str) -> None:
    out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")


class LoaderRow(NamedTuple):
    """What a scrape reads of one loader: its info series' labels, status and stats."""

    name: str
    dataset: str
    batch_size: int
    status: LoaderStatus
    stats: StatsSnapshot


def loader_rows(service: Service) -> list[LoaderRow]:
    """Every loader in one pass, those that could not start too (zero stats)."""
    rows = [
        LoaderRow(name, e.config.dataset, e.config.batch_size, e.status(), e.stats_snapshot())
        for name, e in sorted(service.loaders.items())
    ]
    rows += [
        LoaderRow(config["name"], config["dataset"], config["batch_size"], status, stats)
        for config, status, stats in service.unstarted()
    ]
    return rows


# A family's samples from each loader's escaped name and value of the family's field.
Writer = Callable[[list[str], str, list[str], list[Any]], None]


def _scalar(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    out.extend(
        [f'{metric}{{loader="{n}"}} {_num(v)}\n' for n, v in zip(names, values, strict=True)]
    )


# The same for the fields typed int (or bool) and float: most families, so no call of
# _num per sample (a scrape writes ~1100 of them with 50 loaders).
def _ints(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    out.extend([f'{metric}{{loader="{n}"}} {int(v)}\n' for n, v in zip(names, values, strict=True)])


def _floats(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    out.extend(
        [f'{metric}{{loader="{n}"}} {float(v)!r}\n' for n, v in zip(names, values, strict=True)]
    )


def _state(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    out.extend(
        [
            f'{metric}{{loader="{n}",state="{s}"}} {int(v == s)}\n'
            for n, v in zip(names, values, strict=True)
            for s in LOADER_STATES
        ]
    )


def _slots(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    out.extend(
        [
            f'{metric}{{loader="{n}",state="{s}"}} {getattr(v, s)}\n'
            for n, v in zip(names, values, strict=True)
            for s in SLOT_STATES
        ]
    )


def _histogram(out: list[str], metric: str, names: list[str], values: list[Any]) -> None:
    for n, h in zip(names, values, strict=True):
        bucket = f'{metric}_bucket{{loader="{n}",le="'
        cumulative = list(accumulate(h.counts))
        out.extend([f"{bucket}{le}{c}\n" for le, c in zip(LE_CLOSED, cumulative, strict=True)])
        out.append(f'{metric}_sum{{loader="{n}"}} {float(h.sum_s)!r}\n')
        out.append(f'{metric}_count{{loader="{n}"}} {cumulative[-1]}\n')


def _writer(annotation: Any) -> Writer:
    """How a field's values become samples, by the field's type."""
    if annotation is WaitHistogram:
        return _histogram
    if annotation is SlotCounts:
        return _slots
    if annotation == LoaderState:
        return _state
    if annotation in (int, bool):
        return _ints
    if annotation is float:
        return _floats
    return _scalar  # e.g. int | None: NaN when unknown


class Series(NamedTuple):
    """One per-loader family and the ``LoaderRow`` field it reads."""

    metric: str
    head: str  # its # HELP and # TYPE lines
    read: Callable[[LoaderRow], Any]
    write: Writer


def _series(part: str, model: type[BaseModel]) -> list[Series]:
    out = []
    for field, m in metric_fields(model):
        metric = f"pinfeed_loader_{m.name}"
        head = f"# HELP {metric} {m.help}\n# TYPE {metric} {m.kind}\n"
        write = _writer(model.model_fields[field].annotation)
        out.append(Series(metric, head, attrgetter(f"{part}.{field}"), write))
    return out


# Every per-loader family, from the fields that declare one (status, then stats).
SERIES = [*_series("status", LoaderStatus), *_series("stats", StatsSnapshot)]
# Every per-dataset family of a cached dataset (each an int or bool field).
CACHE_SERIES = metric_fields(CacheStats)


def render(service: Service) -> str:
    """The pinfeed series of every loader, in Prometheus text format 0.0.4."""
    rows = loader_rows(service)
    names = [_esc(row.name) for row in rows]
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
    for row, n in zip(rows, names, strict=True):
        out.append(
            f'pinfeed_loader_info{{loader="{n}",dataset="{_esc(row.dataset)}",'
            f'batch_size="{row.batch_size}"}} 1\n'
        )
    for series in SERIES:
        out.append(series.head)
        series.write(out, series.metric, names, list(map(series.read, rows)))
    datasets = [_esc(name) for name in caches]
    for field, m in CACHE_SERIES:
        metric = f"pinfeed_dataset_cache_{m.name}"
        _family(out, metric, m.kind, m.help)
        out.extend(
            f'{metric}{{dataset="{d}"}} {int(getattr(c, field))}\n'
            for d, c in zip(datasets, caches.values(), strict=True)
        )
    _remote(out, service)
    return "".join(out)


# the object store and the node's object cache (remote/stats.py): name, kind, help
REMOTE_SERIES = (
    ("requests", "counter", "Requests sent to the object store, retries included"),
    ("bytes", "counter", "Body bytes received from the object store"),
    ("retries", "counter", "Requests to the object store tried again"),
    ("throttled", "counter", "Answers of 503 SlowDown or 429 from the object store"),
    ("errors", "counter", "Reads from the object store that failed for good"),
    ("hits", "counter", "Units a batch read found in the node's object cache"),
    ("misses", "counter", "Units a batch read had to fetch"),
    ("prefetched", "counter", "Units fetched ahead of their batch"),
    ("wait_s", "counter", "Seconds batches waited for the object store"),
)


def _remote(out: list[str], service: Service) -> None:
    stats = service.remote_stats()
    if stats is None:
        return
    for key, kind, doc in REMOTE_SERIES:
        metric = f"pinfeed_remote_{key.removesuffix('_s')}" + (
            "_seconds" if key == "wait_s" else ""
        )
        metric += "_total"
        _family(out, metric, kind, doc + " (node)")
        out.append(f"{metric} {_num(stats.counts[key])}\n")
        per = metric.replace("pinfeed_remote_", "pinfeed_remote_loader_")
        _family(out, per, kind, doc + " (per loader)")
        out.extend(
            f'{per}{{loader="{_esc(name)}"}} {_num(c[key])}\n' for name, c in stats.loaders.items()
        )
    cache = stats.cache
    for name, doc, value in (
        ("pinfeed_remote_cache_max_bytes", "PINFEED_REMOTE_CACHE_MAX_BYTES", cache.max_bytes),
        ("pinfeed_remote_cache_held_bytes", "Bytes the object cache holds", cache.held_bytes),
        ("pinfeed_remote_cache_entries", "Units the object cache holds", cache.entries),
        ("pinfeed_remote_cache_pinned", "Units pinned by batches in the making", cache.pinned),
    ):
        _family(out, name, "gauge", doc)
        out.append(f"{name} {_num(value)}\n")
    _family(out, "pinfeed_remote_cache_evictions_total", "counter", "Units evicted")
    out.append(f"pinfeed_remote_cache_evictions_total {_num(cache.evictions)}\n")


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
