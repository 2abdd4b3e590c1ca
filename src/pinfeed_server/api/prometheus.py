"""The Prometheus text format of the live service, rendered at scrape time
(``GET /metrics``, ``routes/metrics.py``; ``python -m bench metrics-render`` times it).

Loaders' series are labelled ``loader``; each cached dataset's ``dataset``
(``pinfeed_dataset_cache_*``: the fields of its ``CacheStats`` that declare a
``Metric``).

The engine keeps every counter, so a render reads them once per loader (its
``LoaderStatus`` and a ``StatsSnapshot`` of the lock-free statistics, both built without
validation) and writes the text directly: O(loaders), a few microseconds per series, no
metric objects per scrape. The per-loader families are the fields of those two models
that declare a ``Metric`` (name, type, help: ``pinfeed_server/metric.py``), in their order; the
``state`` labels' values are ``LoaderState`` and the ``SlotCounts`` fields. A deleted
loader simply stops appearing.

Names follow Prometheus' rules (``tests/api/test_metric_names.py`` checks what
``promtool check metrics`` checks): base units, ``_total`` on counters only, snake case.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from operator import attrgetter
from typing import Any, NamedTuple, get_args

from pydantic import BaseModel

from pinfeed import __version__
from pinfeed_server.cache import CacheStats
from pinfeed_server.engine.stats import WAIT_BUCKETS_S, StatsSnapshot, WaitHistogram
from pinfeed_server.engine.status import LoaderState, LoaderStatus, SlotCounts
from pinfeed_server.metric import metric_fields
from pinfeed_server.service import Service

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
    kind: str
    help: str
    read: Callable[[LoaderRow], Any]
    write: Writer

    @property
    def head(self) -> str:
        """Its # HELP and # TYPE lines."""
        return f"# HELP {self.metric} {self.help}\n# TYPE {self.metric} {self.kind}\n"


def _series(part: str, model: type[BaseModel]) -> list[Series]:
    out = []
    for field, m in metric_fields(model):
        write = _writer(model.model_fields[field].annotation)
        out.append(
            Series(f"pinfeed_loader_{m.name}", m.kind, m.help, attrgetter(f"{part}.{field}"), write)
        )
    return out


# Every per-loader family, from the fields that declare one (status, then stats).
SERIES = [*_series("status", LoaderStatus), *_series("stats", StatsSnapshot)]
HEADS = [series.head for series in SERIES]
# Every per-dataset family of a cached dataset (each an int or bool field).
CACHE_SERIES = metric_fields(CacheStats)


class Gauge(NamedTuple):
    """A gauge of the whole server, read from the service, its loaders and its caches."""

    metric: str
    help: str
    read: Callable[[Service, list[LoaderRow], dict[str, CacheStats]], int]


GAUGES = (
    Gauge(
        "pinfeed_shm_budget_bytes",
        "PINFEED_MAX_SHM_BYTES",
        lambda s, r, c: s.settings.max_shm_bytes,
    ),
    Gauge(
        "pinfeed_shm_used_bytes",
        "Bytes of the budget held by rings and caches",
        lambda s, r, c: s.shm_used(),
    ),
    Gauge(
        "pinfeed_cache_budget_bytes",
        "PINFEED_CACHE_MAX_BYTES",
        lambda s, r, c: s.settings.cache_budget,
    ),
    Gauge(
        "pinfeed_cache_reserved_bytes",
        "Bytes of the budget reserved by sample caches",
        lambda s, r, c: sum(cache.max_bytes for cache in c.values()),
    ),
    Gauge("pinfeed_loaders", "Loaders registered", lambda s, r, c: len(r)),
    Gauge("pinfeed_workers", "Worker processes of all loaders", lambda s, r, c: s.workers_used()),
    Gauge("pinfeed_workers_max", "PINFEED_MAX_WORKERS", lambda s, r, c: s.settings.max_workers),
)
BUILD_INFO = "pinfeed version"
LOADER_INFO = "A loader's dataset and batch size"


class Family(NamedTuple):
    """A family as ``GET /metrics`` declares it: the reference's row (docs.gen)."""

    metric: str
    kind: str
    help: str
    labels: tuple[str, ...]


class RemoteCount(NamedTuple):
    """A count of the object store's reads (remote/stats.py), for the node and per loader."""

    key: str  # its key in RemoteStats' counts
    help: str

    @property
    def metric(self) -> str:
        """The node's family; the loaders' is ``pinfeed_remote_loader_..``."""
        name = self.key.removesuffix("_s") + ("_seconds" if self.key.endswith("_s") else "")
        return f"pinfeed_remote_{name}_total"

    @property
    def per_loader(self) -> str:
        return self.metric.replace("pinfeed_remote_", "pinfeed_remote_loader_")


# the object store and the node's object cache: written only where a dataset reads one
REMOTE_COUNTS = (
    RemoteCount("requests", "Requests sent to the object store, retries included"),
    RemoteCount("bytes", "Body bytes received from the object store"),
    RemoteCount("retries", "Requests to the object store tried again"),
    RemoteCount("throttled", "Answers of 503 SlowDown or 429 from the object store"),
    RemoteCount("errors", "Reads from the object store that failed for good"),
    RemoteCount("hits", "Units a batch read found in the node's object cache"),
    RemoteCount("misses", "Units a batch read had to fetch"),
    RemoteCount("prefetched", "Units fetched ahead of their batch"),
    RemoteCount("wait_s", "Seconds batches waited for the object store"),
)
REMOTE_CACHE = (  # gauge, help, the object cache's field
    ("pinfeed_remote_cache_max_bytes", "PINFEED_REMOTE_CACHE_MAX_BYTES", "max_bytes"),
    ("pinfeed_remote_cache_held_bytes", "Bytes the object cache holds", "held_bytes"),
    ("pinfeed_remote_cache_entries", "Units the object cache holds", "entries"),
    ("pinfeed_remote_cache_pinned", "Units pinned by batches in the making", "pinned"),
)
REMOTE_EVICTIONS = "Units evicted from the node's object cache"
REMOTE_WASTED = "Units fetched ahead and evicted before any read (fetched again when needed)"


def _remote(out: list[str], service: Service) -> None:
    stats = service.remote_stats()
    if stats is None:
        return
    for count in REMOTE_COUNTS:
        _family(out, count.metric, "counter", f"{count.help} (node)")
        out.append(f"{count.metric} {_num(stats.counts[count.key])}\n")
        _family(out, count.per_loader, "counter", f"{count.help} (per loader)")
        out.extend(
            f'{count.per_loader}{{loader="{_esc(name)}"}} {_num(c[count.key])}\n'
            for name, c in stats.loaders.items()
        )
    for metric, doc, field in REMOTE_CACHE:
        _family(out, metric, "gauge", doc)
        out.append(f"{metric} {_num(getattr(stats.cache, field))}\n")
    _family(out, "pinfeed_remote_cache_evictions_total", "counter", REMOTE_EVICTIONS)
    out.append(f"pinfeed_remote_cache_evictions_total {_num(stats.cache.evictions)}\n")
    _family(out, "pinfeed_remote_cache_wasted_total", "counter", REMOTE_WASTED)
    out.append(f"pinfeed_remote_cache_wasted_total {_num(stats.cache.wasted)}\n")


# A mixture loader's sources (``LoaderStatus.sources``), labelled loader and dataset.
MIXTURE: list[tuple[str, str, str, str]] = [
    ("pinfeed_mixture_samples_total", "counter", "samples", "Samples of the source taken"),
    ("pinfeed_mixture_tokens_total", "counter", "tokens", "Tokens of the source taken"),
    ("pinfeed_mixture_weight", "gauge", "weight", "The source's weight, normalised"),
    (
        "pinfeed_mixture_proportion",
        "gauge",
        "proportion",
        "The source's share of the samples taken",
    ),
]


def _mixture(out: list[str], rows: list[LoaderRow], names: list[str]) -> None:
    mixed = [(n, row.status.sources) for row, n in zip(rows, names, strict=True)]
    for metric, kind, field, doc in MIXTURE:
        _family(out, metric, kind, doc)
        out.extend(
            f'{metric}{{loader="{n}",dataset="{_esc(s.dataset)}"}} {_num(getattr(s, field))}\n'
            for n, sources in mixed
            for s in sources or ()
        )


def families() -> list[Family]:
    """Every pinfeed family ``render`` writes, in its order (not prometheus_client's
    process and platform collectors)."""
    labels: dict[Writer, tuple[str, ...]] = {
        _state: ("loader", "state"),
        _slots: ("loader", "state"),
        _histogram: ("loader", "le"),
    }
    return [
        *(Family(g.metric, "gauge", g.help, ()) for g in GAUGES),
        Family("pinfeed_build_info", "gauge", BUILD_INFO, ("version",)),
        Family("pinfeed_loader_info", "gauge", LOADER_INFO, ("loader", "dataset", "batch_size")),
        *(Family(s.metric, s.kind, s.help, labels.get(s.write, ("loader",))) for s in SERIES),
        *(
            Family(f"pinfeed_dataset_cache_{m.name}", m.kind, m.help, ("dataset",))
            for _, m in CACHE_SERIES
        ),
        *(
            family
            for c in REMOTE_COUNTS
            for family in (
                Family(c.metric, "counter", f"{c.help} (node)", ()),
                Family(c.per_loader, "counter", f"{c.help} (per loader)", ("loader",)),
            )
        ),
        *(Family(metric, "gauge", doc, ()) for metric, doc, _ in REMOTE_CACHE),
        Family("pinfeed_remote_cache_evictions_total", "counter", REMOTE_EVICTIONS, ()),
        Family("pinfeed_remote_cache_wasted_total", "counter", REMOTE_WASTED, ()),
        *(Family(metric, kind, doc, ("loader", "dataset")) for metric, kind, _, doc in MIXTURE),
    ]


def render(service: Service) -> str:
    """The pinfeed series of every loader, in Prometheus text format 0.0.4."""
    rows = loader_rows(service)
    names = [_esc(row.name) for row in rows]
    caches = service.cache_stats()
    out: list[str] = []
    for gauge in GAUGES:
        _family(out, gauge.metric, "gauge", gauge.help)
        out.append(f"{gauge.metric} {_num(gauge.read(service, rows, caches))}\n")
    _family(out, "pinfeed_build_info", "gauge", BUILD_INFO)
    out.append(f'pinfeed_build_info{{version="{__version__}"}} 1\n')

    _family(out, "pinfeed_loader_info", "gauge", LOADER_INFO)
    for row, n in zip(rows, names, strict=True):
        out.append(
            f'pinfeed_loader_info{{loader="{n}",dataset="{_esc(row.dataset)}",'
            f'batch_size="{row.batch_size}"}} 1\n'
        )
    for series, head in zip(SERIES, HEADS, strict=True):
        out.append(head)
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
    _mixture(out, rows, names)
    return "".join(out)
