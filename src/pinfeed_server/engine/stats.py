"""Per-loader statistics: O(1) per batch, O(1) per read, read without the writers' lock,
and ``StatsSnapshot``, the one typed reading of them that every view renders.

The per-batch path (publisher, data-plane threads) records into counters, fixed one-
second buckets for the rates over the last ``WINDOW_S`` seconds, and a histogram of
the trainers' waits with fixed bounds (``WAIT_BUCKETS_S``, served to Prometheus as a
histogram so dashboards compute quantiles). Writers serialize on a small lock of
their own; readers (``snapshot()``, ``GET /metrics``) never take it: every value they
read is one object that a writer replaces whole (a tuple) or one list they copy in
one step, so a scrape never makes a batch wait and never walks per-batch history.
A read is consistent per value group (batches and samples agree), not across groups.

``LoaderStats.snapshot()`` (and ``LoaderEngine.stats_snapshot()``, which adds the
workers' busy time and autotune's report) returns a ``StatsSnapshot``: the body of
``GET /v1/loaders/{name}/stats`` (``schemas.LoaderStatsPublic`` adds only its OpenAPI
examples), the source of the ``/metrics`` series its fields declare (``pinfeed_server.metric``),
and what ``pinfeed status`` parses the body back into.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from typing import Annotated, Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from pinfeed_server.metric import Metric, built

# Upper bounds of the wait histogram's buckets, in seconds (+Inf is implied).
WAIT_BUCKETS_S = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class WaitHistogram(NamedTuple):
    """The trainers' waits since the loader started: a count per bucket of
    ``WAIT_BUCKETS_S`` (then +Inf), not cumulative, and their sum."""

    counts: tuple[int, ...]
    sum_s: float


NO_WAITS = WaitHistogram((0,) * (len(WAIT_BUCKETS_S) + 1), 0.0)


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: Sequence[int]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket that holds rank
    ``q``; the last finite bound for the +Inf bucket. ``counts`` are per bucket."""
    return bucket_quantiles((q,), bounds, counts)[0]


def bucket_quantiles(
    qs: Sequence[float], bounds: tuple[float, ...], counts: Sequence[int]
) -> list[float | None]:
    """``bucket_quantile`` of each of ``qs`` (ascending) in one pass over the buckets:
    a snapshot takes two per loader, and a scrape one snapshot per loader."""
    total = sum(counts)
    if total == 0:
        return [None] * len(qs)
    out: list[float | None] = []
    seen, i = 0, 0
    for q in qs:
        rank = q * total
        while i < len(counts) and not (counts[i] and seen + counts[i] >= rank):
            seen += counts[i]
            i += 1
        if i >= len(bounds):  # the +Inf bucket (or past the last, by rounding)
            out.append(bounds[-1])
        else:
            lower = bounds[i - 1] if i else 0.0
            out.append(lower + (bounds[i] - lower) * (rank - seen) / counts[i])
    return out


class RateWindow:
    """Sums of (samples, bytes, wait seconds) over the last ``window_s`` seconds in
    one-second buckets: a ring of ``window_s + 1`` tuples ``(second, samples, bytes,
    wait_s)``; a bucket whose second has passed is reused, so memory is fixed."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._buckets: list[tuple[int, int, int, float]] = [(-1, 0, 0, 0.0)] * (window_s + 1)

    def add(self, now: float, samples: int = 0, nbytes: int = 0, wait_s: float = 0.0) -> None:
        """Callers serialize (the stats' write lock)."""
        second = int(now)
        i = second % len(self._buckets)
        t, s, b, w = self._buckets[i]
        if t != second:
            s, b, w = 0, 0, 0.0
        self._buckets[i] = (second, s + samples, b + nbytes, w + wait_s)

    def sums(self, now: float) -> tuple[int, int, float, float]:
        """(samples, bytes, wait_s, seconds covered): the buckets of the last
        ``window_s`` whole seconds plus the current one, and how long that is."""
        second = int(now)
        first = second - self.window_s
        s_sum, b_sum, w_sum = 0, 0, 0.0
        for t, s, b, w in list(self._buckets):  # one copy: a writer may replace a bucket
            if first <= t <= second:
                s_sum, b_sum, w_sum = s_sum + s, b_sum + b, w_sum + w
        return s_sum, b_sum, w_sum, self.window_s + (now - second)


class StatsSnapshot(BaseModel):
    """One loader's statistics at one moment, each field declared once: its meaning,
    and, when ``/metrics`` exports it, its ``Metric``.

    A pydantic model rather than a dataclass: it is the HTTP body as it stands (FastAPI
    serializes it and writes its schema into /openapi.json) and ``pinfeed status``
    validates the JSON back into it. ``LoaderStats.snapshot()`` builds it without
    validation (every value is computed and typed there; see ``_built``).

    Fields with ``exclude=True`` are the running totals that Prometheus takes rates of,
    exported to /metrics only (the body's schema stays what clients know); their
    defaults are what a snapshot parsed back from the body holds.
    """

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="the loader's name")
    batches_produced: Annotated[
        int, Metric("batches_produced_total", "counter", "Batches written into the ring")
    ] = Field(description="batches written into the ring")
    batches_consumed: Annotated[
        int, Metric("batches_consumed_total", "counter", "Batches handed to the consumer")
    ] = Field(description="batches handed to the consumers")
    samples_consumed: Annotated[
        int, Metric("samples_consumed_total", "counter", "Samples handed to the consumer")
    ] = Field(description="samples handed to the consumers")
    bytes_consumed: Annotated[
        int, Metric("bytes_consumed_total", "counter", "Ring bytes handed to the consumer")
    ] = Field(0, exclude=True, description="ring bytes handed to the consumers")
    errors: Annotated[
        int, Metric("errors_total", "counter", "Batches that failed because a sample raised")
    ] = Field(description="batches that failed (a sample raised)")
    skipped: Annotated[
        int,
        Metric(
            "skipped_total",
            "counter",
            "Batches skipped because a sample raised (on_error=skip)",
        ),
    ] = Field(0, description="of those, batches skipped (on_error: skip)")
    samples_per_s: Annotated[
        float,
        Metric("samples_per_second", "gauge", "Samples consumed per second over the last 10 s"),
    ] = Field(description="consumed, over the last 10 s")
    bytes_per_s: Annotated[
        float,
        Metric("bytes_per_second", "gauge", "Bytes consumed per second over the last 10 s"),
    ] = Field(description="consumed, over the last 10 s")
    samples_per_s_total: float = Field(description="consumed, since the loader started")
    bytes_per_s_total: float = Field(description="consumed, since the loader started")
    consumer_wait_p50_s: float | None = Field(description="median wait for one batch")
    consumer_wait_p99_s: float | None = Field(description="99th percentile of that wait")
    wait_histogram: Annotated[
        WaitHistogram,
        Metric(
            "next_wait_seconds",
            "histogram",
            "How long one next() of a trainer blocked for its batch",
        ),
    ] = Field(NO_WAITS, exclude=True, description="the waits the percentiles come from")
    # Measured by the trainers themselves: each NEXT reports how long the previous
    # next() blocked.
    consumer_wait_share: Annotated[
        float,
        Metric(
            "consumer_wait_share",
            "gauge",
            "Share of the last 10 s the trainers waited for batches: near 1 = input-bound",
        ),
    ] = Field(
        description="share of the last 10 s the trainers spent blocked waiting for batches "
        "(measured in the trainers): near 1 = training is input-bound"
    )
    consumer_wait_share_total: Annotated[
        float,
        Metric(
            "consumer_wait_share_since_start",
            "gauge",
            "Share of time the trainers waited for batches since they started asking",
        ),
    ] = Field(0.0, description="the same share since trainers started asking")
    consumer_wait_s: Annotated[
        float,
        Metric(
            "consumer_wait_seconds_total",
            "counter",
            "Time the consumers spent waiting for batches",
        ),
    ] = Field(0.0, exclude=True, description="the trainers' waits, summed")
    worker_busy_share: Annotated[
        float,
        Metric("worker_busy_share", "gauge", "Share of worker time spent building batches"),
    ] = Field(description="share of worker time spent building batches")
    worker_busy_s: Annotated[
        float,
        Metric(
            "worker_busy_seconds_total",
            "counter",
            "Time worker processes (or the in-server producer) spent building batches",
        ),
    ] = Field(0.0, exclude=True, description="time spent building batches, all workers")
    workers: Annotated[
        int, Metric("workers", "gauge", "Worker processes the loader is configured with")
    ] = Field(0, exclude=True, description="the worker count the busy share divides by")
    uptime_s: float = Field(description="seconds since the loader started")
    autotune: dict[str, Any] | None = Field(
        None,
        description="autotune's settings, whether it has settled, and its last decisions "
        "({t, num_workers, prefetch_factor, reason, samples_per_s, wait_share, busy_share})",
    )

    @classmethod
    def zeros(cls, name: str, workers: int) -> StatsSnapshot:
        """A registered loader that could not start: nothing produced, nothing measured
        (``workers``: its configured worker count, as a started one reports)."""
        return LoaderStats().snapshot(name, 0.0, workers)


def _built(values: dict[str, Any]) -> StatsSnapshot:
    """``StatsSnapshot.model_construct(**values)`` for ``values`` that name every field
    (``metric.built``): a scrape builds one snapshot per loader."""
    return built(StatsSnapshot, values)


class LoaderStats:
    WINDOW_S = 10

    def __init__(self) -> None:
        self._write = threading.Lock()  # writers only; readers never take it
        self.started = time.monotonic()
        self.batches_produced = 0
        self._consumed: tuple[int, int, int] = (0, 0, 0)  # batches, samples, bytes
        self._waited: tuple[float, float] = (0.0, 0.0)  # total wait_s, first wait time
        self.errors = 0
        self.skipped = 0
        self.busy_s = 0.0
        self._wait_counts = [0] * (len(WAIT_BUCKETS_S) + 1)
        self._window = RateWindow(self.WINDOW_S)
        self._slot_bytes = 0

    # -- the per-batch path: O(1) each --------------------------------------------------
    def produced(self, rows: int, slot_bytes: int) -> None:
        with self._write:
            self.batches_produced += 1
            self._slot_bytes = slot_bytes

    def consumed(self, rows: int) -> None:
        now = time.monotonic()
        with self._write:
            batches, samples, nbytes = self._consumed
            self._consumed = (batches + 1, samples + rows, nbytes + self._slot_bytes)
            self._window.add(now, samples=rows, nbytes=self._slot_bytes)

    def consumer_wait(self, waited_s: float) -> None:
        """What a trainer reported: how long its last ``next()`` blocked."""
        now = time.monotonic()
        with self._write:
            total, first = self._waited
            self._waited = (total + waited_s, first or (now - waited_s))
            self._wait_counts[bisect.bisect_left(WAIT_BUCKETS_S, waited_s)] += 1
            self._window.add(now, wait_s=waited_s)

    def add_busy(self, seconds: float) -> None:
        with self._write:
            self.busy_s += seconds

    # -- reads: lock-free, O(1) -----------------------------------------------------------
    @property
    def batches_consumed(self) -> int:
        return self._consumed[0]

    @property
    def samples_consumed(self) -> int:
        return self._consumed[1]

    @property
    def bytes_consumed(self) -> int:
        return self._consumed[2]

    @property
    def wait_s(self) -> float:
        return self._waited[0]

    @property
    def first_wait(self) -> float | None:
        """When trainers started asking (monotonic), or None."""
        return self._waited[1] or None

    def wait_histogram(self) -> WaitHistogram:
        return WaitHistogram(tuple(self._wait_counts), self._waited[0])

    def snapshot(
        self,
        name: str,
        worker_busy_s: float,
        num_workers: int,
        consumers: int = 1,
        autotune: dict[str, Any] | None = None,
    ) -> StatsSnapshot:
        """Loader ``name``'s statistics now. ``consumers``: trainers sharing the loader
        (a group), to average their wait; ``autotune``: its report, when it is on.
        Percentiles come from the histogram's buckets (interpolated, since start)."""
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        batches, samples, nbytes = self._consumed
        wait_total, first = self._waited
        counts = tuple(self._wait_counts)
        recent_samples, recent_bytes, recent_wait, covered = self._window.sums(now)
        window = min(covered, elapsed)
        asking = max(now - first, 1e-9) if first else None
        per = max(1, consumers)
        busy = worker_busy_s + self.busy_s
        p50, p99 = bucket_quantiles((0.5, 0.99), WAIT_BUCKETS_S, counts)
        return _built(
            {
                "name": name,
                "batches_produced": self.batches_produced,
                "batches_consumed": batches,
                "samples_consumed": samples,
                "bytes_consumed": nbytes,
                "errors": self.errors,
                "skipped": self.skipped,
                "samples_per_s": recent_samples / window,
                "bytes_per_s": recent_bytes / window,
                "samples_per_s_total": samples / elapsed,
                "bytes_per_s_total": nbytes / elapsed,
                "consumer_wait_p50_s": p50,
                "consumer_wait_p99_s": p99,
                "wait_histogram": WaitHistogram(counts, wait_total),
                "consumer_wait_share": (
                    min(1.0, recent_wait / min(window, asking) / per) if asking else 0.0
                ),
                "consumer_wait_share_total": (
                    min(1.0, wait_total / asking / per) if asking else 0.0
                ),
                "consumer_wait_s": wait_total,
                "worker_busy_share": busy / (elapsed * max(1, num_workers)),
                "worker_busy_s": busy,
                "workers": num_workers,
                "uptime_s": elapsed,
                "autotune": autotune,
            }
        )
